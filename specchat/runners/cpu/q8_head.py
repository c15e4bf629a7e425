"""An LM head whose weight is GGUF Q8_0 blocks (int8 values, one fp16 scale per 32), run by
specchat's integer Q8_0 kernel (csrc/q8_0.c). `models.gguf_head` reads the blocks of the embedded
target's GGUF and checks them before a model's head takes this forward;
`models.gguf_head.quantized_q8_head` makes them from another model's float head, once at load,
on the integer path (`quantize_q8_0`)."""

from __future__ import annotations

import torch

from specchat import kernels

BLOCK = 32  # values per Q8_0 block


class Q8Head:
    """An LM head's forward through `kernels.q8_0_matmul_i8`: float32 logits from the GGUF's
    Q8_0 values by integer dot products, as llama.cpp computes them: each input row quantized
    to int8 per block of 32 once, int32 sums of products, then one float scale per block
    (csrc/q8_0.c). About half the time of widening every weight to float (docs/cpu.md), at the
    cost of the activations' int8 rounding (`activation_error`). Gradients and other dtypes go
    through the module's own weight."""

    def __init__(self, head: torch.nn.Linear, q: torch.Tensor, d: torch.Tensor, lib):
        self.head, self.q, self.d, self.lib = head, q, d, lib
        self.dw: torch.Tensor | None = None  # the scales once repacked (`pack_rows`)

    def pack_rows(self, lib) -> bool:
        """Repack the values in place for the integer NF4 kernels' arithmetic (the `cpu-int8`
        path: `kernels.q8_0_rows_matmul_i8` on `lib`); every product from then on takes it.
        Returns whether it did (a head of other sizes keeps its kernel)."""
        if self.dw is not None:
            return True
        try:
            self.dw = kernels.q8_0_i8_pack(lib, self.q, self.d)
        except ValueError:
            return False
        self.lib, self.d = lib, None
        return True

    def _product(self, x, upto=None, maxima=None) -> torch.Tensor:
        if self.dw is not None:
            return kernels.q8_0_rows_matmul_i8(self.lib, x, self.q, self.dw, upto, maxima)
        return kernels.q8_0_matmul_i8(self.lib, x, self.q, self.d, upto, maxima)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16) or x.requires_grad:
            return torch.nn.functional.linear(x, self.head.weight.to(x.dtype))
        return self._product(x)  # float32 logits

    def leading(self, x: torch.Tensor, upto: int | None,
                maxima: torch.Tensor | None = None) -> torch.Tensor:
        """`self(x)` with the logits of ids `upto`.. -inf (ids never sampled; None: none), not
        computed for a single row: the same bits in the others. `maxima` [rows,
        kernels.head_blocks(vocabulary)] receives the logits' block maxima."""
        return self._product(x, upto, maxima)

    def dequantized(self, rows: torch.Tensor) -> torch.Tensor:
        """The float32 values of some rows of W (exact: q * d)."""
        if self.dw is not None:  # repacked: [groups, blocks, 4 v, 16 rows, 4] + 128
            out, cols = self.q.shape
            packed = self.q.view(torch.uint8).view(out // 16, cols // BLOCK, 8, 16, 4)
            g, i = rows // 16, rows % 16
            q = packed[g, :, :, i, :].to(torch.float32) - 128  # [rows, blocks, 8, 4]
            d = self.dw.view(out // 16, cols // BLOCK, 16)[g, :, i].float()  # [rows, blocks]
            return (q.reshape(len(rows), -1, BLOCK) * d[..., None]).reshape(len(rows), -1)
        q, d = self.q[rows].to(torch.float32), self.d[rows].to(torch.float32)
        return (q.view(len(rows), -1, BLOCK) * d[..., None]).view(len(rows), -1)


def activation_error(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The most that quantizing x [n, in] to int8 per block of 32 (scale max|x| / 127, values
    rounded to nearest) moves x @ w.T [n, out]: half a step per value, summed with |w|."""
    n, cols = x.shape
    step = x.abs().view(n, cols // BLOCK, BLOCK).amax(-1) / 127  # [n, blocks]
    weight = w.abs().view(w.shape[0], cols // BLOCK, BLOCK).sum(-1)  # [out, blocks]
    return step @ weight.T / 2 * 1.001


def quantize_q8_0(weight: torch.Tensor, chunk_rows: int = 8192) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """(q int8 [out, in], d float16 [out, in / 32]): `weight` in Q8_0, the bits of llama.cpp's
    `quantize_row_q8_0_ref` (and the gguf package's): per block of 32, d = max|w| / 127 in
    float32, q = w * (1 / d) rounded to nearest, ties away from zero, d stored in fp16.
    `chunk_rows` rows at a time: no float32 copy of the whole weight."""
    out, cols = weight.shape
    q = torch.empty(out, cols, dtype=torch.int8)
    d = torch.empty(out, cols // BLOCK, dtype=torch.float16)
    for r in range(0, out, chunk_rows):
        w = weight[r:r + chunk_rows].detach().to(torch.float32).view(-1, cols // BLOCK, BLOCK)
        scale = w.abs().amax(-1) / 127
        inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        x = w * inverse[..., None]
        a = x.abs()
        whole = a.floor()  # roundf's ties away from zero, as the gguf package writes it
        q[r:r + chunk_rows] = (x.sign() * (whole + (2 * (a - whole)).floor())).view(
            -1, cols).to(torch.int8)
        d[r:r + chunk_rows] = scale.to(torch.float16)
    return q, d
