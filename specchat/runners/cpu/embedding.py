"""An embedding module's lookup in one C call (`embed_rows`, csrc/decoder.c), where that gives
the module's bits: a plain lookup (Llama's, Qwen's) or Gemma 2's and 3's scaled one, a float32 or bf16
table times its scale (as the module computes it in the table's dtype, or widened to float32
first). Right after a forward a
torch lookup costs tens of microseconds in calls around a copy of a few rows; the CPU runner
and the draft head look up their tokens here."""

from __future__ import annotations

from typing import NamedTuple

import torch

# `embed_rows`' kinds (csrc/decoder.c): a float32 table; a bf16 table widened, then scaled in
# float32; a bf16 table scaled in bf16, as the module computes it
EMBED_F32, EMBED_BF16_WIDE, EMBED_BF16 = 0, 1, 2


class CEmbedding(NamedTuple):
    table: torch.Tensor  # the module's weight, [rows, hidden]
    kind: int
    scale: float

    @property
    def rows(self) -> int:
        return self.table.shape[0]

    def lookup(self, lib, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Rows of `ids` (contiguous int64, each in [0, rows)) into `out` (contiguous float32
        [len(ids), hidden])."""
        lib.embed_rows(self.table.data_ptr(), self.kind, self.table.shape[1], ids.data_ptr(),
                       len(ids), self.scale, out.data_ptr())


def c_embedding(lib, embed, hidden: int, plain: bool = False) -> CEmbedding | None:
    """`embed`'s lookup by `embed_rows` on `lib`, checked on ids across the vocabulary to give
    the module's bits; None where it does not (another module, dtype or device). `plain`: a
    plain `nn.Embedding` too (the CPU runner's; the draft head's C step reads Gemma 3's only)."""
    weight, scale = getattr(embed, "weight", None), getattr(embed, "embed_scale", None)
    if plain and type(embed) is torch.nn.Embedding:  # its values times 1: exact
        scale = torch.ones((), dtype=getattr(weight, "dtype", torch.float32))
    if type(embed).__name__ not in ("Embedding", "Gemma2TextScaledWordEmbedding",
                                    "Gemma3TextScaledWordEmbedding") \
            or not isinstance(weight, torch.Tensor) or not isinstance(scale, torch.Tensor) \
            or weight.dtype not in (torch.float32, torch.bfloat16) \
            or weight.device.type != "cpu" or not weight.is_contiguous() \
            or weight.dim() != 2 or weight.shape[1] != hidden:
        return None
    rows = weight.shape[0]
    ids = torch.cat([torch.linspace(0, rows - 1, 61).long(),
                     torch.randint(0, rows, (67,), generator=torch.Generator().manual_seed(0))])
    with torch.inference_mode():
        expected = embed(ids).to(torch.float32).view(torch.int32)
    got = torch.empty(len(ids), hidden, dtype=torch.float32)
    kinds = [(EMBED_F32, scale.float())] if weight.dtype == torch.float32 else \
        [(EMBED_BF16_WIDE, scale.float()), (EMBED_BF16, scale.to(torch.bfloat16))]
    for kind, factor in kinds:
        found = CEmbedding(weight.detach(), kind, float(factor))
        found.lookup(lib, ids, got)
        if torch.equal(got.view(torch.int32), expected):
            return found
    return None
