"""A draft model's LM head in NF4 (4.5 bits a weight), run by the integer NF4 kernel of the
layers (csrc/nf4_i8.c): `--draft-quantization nf4-head`. A draft's head is a large share of
what a draft token reads (Qwen 2.5 0.5B's: 145 of 346 MB in Q8_0), and a draft's rounding never
changes a token of the reply: the target verifies each draft token against the probabilities
the draft sampled it from, which are this head's. It does cost acceptance: on the embedded
Gemma 3 270M the NF4 head agrees with the file's Q8_0 head on 89% of greedy tokens, so it is
not the default (docs/performance.md, "A draft's LM head in NF4"). Quantized once at load
(`models.gguf_head.quantized_nf4_head`), with the codes bitsandbytes writes for the layers
(`quantize_nf4`)."""

from __future__ import annotations

import torch

from specchat import kernels
from specchat.runners.cpu.q8_head import Q8Head

BLOCKSIZE = 64  # inputs per NF4 scale, bitsandbytes' default (the layers')
I8_SCALE = 112.0  # the integer kernels' NF4 value v -> round(112 v) (csrc/nf4_i8.c)


def nf4_table() -> torch.Tensor:
    """NF4's 16 values, ascending: bitsandbytes' table."""
    from bitsandbytes.functional import get_4bit_type
    return get_4bit_type("nf4", device="cpu").to(torch.float32)


def quantize_nf4(weight: torch.Tensor, blocksize: int = BLOCKSIZE, chunk_rows: int = 8192
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [out * in / 2], two a byte, the first in the high nibble; absmax float32
    [out * in / blocksize]): `weight` in NF4 as bitsandbytes' `quantize_4bit` writes it (each
    block of `blocksize` divided by its largest magnitude, every value the nearest of NF4's
    levels), `chunk_rows` rows at a time: no float32 copy of the whole weight."""
    out, cols = weight.shape
    if cols % blocksize:
        raise ValueError(f"NF4 blocks of {blocksize} do not divide rows of {cols}")
    table = nf4_table()
    bounds = (table[1:] + table[:-1]) / 2
    codes = torch.empty(out * cols // 2, dtype=torch.uint8)
    absmax = torch.empty(out * cols // blocksize, dtype=torch.float32)
    for r in range(0, out, chunk_rows):
        w = weight[r:r + chunk_rows].detach().to(torch.float32).reshape(-1, blocksize)
        top = w.abs().amax(-1)
        scaled = w / torch.where(top > 0, top, torch.ones_like(top))[:, None]
        level = torch.bucketize(scaled, bounds).to(torch.uint8).view(-1, 2)
        n = w.numel()
        first = r * cols
        codes[first // 2:(first + n) // 2] = level[:, 0] << 4 | level[:, 1]
        absmax[first // blocksize:(first + n) // blocksize] = top
    return codes, absmax


class NF4Head(Q8Head):
    """`Q8Head`'s contract (the runner's head products, `leading`'s `upto` and block maxima) on
    NF4 codes packed for the integer kernels: `q` uint8 [out, in / 2] (`kernels.nf4_i8_pack`'s
    bytes), `dw` the block scales (absmax / 112)."""

    def __init__(self, head: torch.nn.Linear, lib, blocksize: int = BLOCKSIZE):
        out, cols = head.weight.shape
        codes, absmax = quantize_nf4(head.weight, blocksize)
        packed, dw = kernels.nf4_i8_pack(lib, codes, absmax, out, cols, blocksize)
        super().__init__(head, packed.view(out, cols // 2), None, lib)
        self.dw, self.blocksize, self.table = dw, blocksize, nf4_table()

    def pack_rows(self, lib) -> bool:
        """Every path reads the same packed codes: nothing to repack."""
        self.lib = lib
        return True

    def _product(self, x, upto=None, maxima=None) -> torch.Tensor:
        return kernels.nf4_head_matmul_i8(self.lib, x, self.q, self.dw, self.table,
                                          self.blocksize, upto, maxima)

    def dequantized(self, rows: torch.Tensor) -> torch.Tensor:
        """The float32 values of some rows of W as the kernel multiplies them:
        round(112 v) of each code's NF4 value v, times its block's absmax / 112."""
        out, half = self.q.shape
        cols = 2 * half
        codes = kernels.nf4_i8_unpack(self.lib, self.q, out, cols).view(out, half)[rows]
        level = torch.stack([codes >> 4, codes & 15], -1).reshape(len(rows), cols).long()
        w8 = (self.table * I8_SCALE).round()  # ties to even, as the kernels' table
        blocks = cols // self.blocksize
        scale = self.dw.view(-1, blocks, 16)[rows // 16, :, rows % 16]  # [rows, blocks]
        values = w8[level].view(len(rows), blocks, self.blocksize) * scale[..., None]
        return values.reshape(len(rows), cols)
