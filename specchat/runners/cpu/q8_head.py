"""An LM head whose weight is GGUF Q8_0 blocks (int8 values, one fp16 scale per 32), run by
specchat's integer Q8_0 kernel (csrc/q8_0.c). `models.gguf_head` reads the blocks of the embedded
target's GGUF and checks them before a model's head takes this forward."""

from __future__ import annotations

import torch

from specchat.runners.cpu import kernels

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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16) or x.requires_grad:
            return torch.nn.functional.linear(x, self.head.weight.to(x.dtype))
        return kernels.q8_0_matmul_i8(self.lib, x, self.q, self.d)  # float32 logits

    def leading(self, x: torch.Tensor, upto: int | None,
                maxima: torch.Tensor | None = None) -> torch.Tensor:
        """`self(x)` with the logits of ids `upto`.. -inf (ids never sampled; None: none), not
        computed for a single row: the same bits in the others. `maxima` [rows,
        kernels.head_blocks(vocabulary)] receives the logits' block maxima."""
        return kernels.q8_0_matmul_i8(self.lib, x, self.q, self.d, upto, maxima)

    def dequantized(self, rows: torch.Tensor) -> torch.Tensor:
        """The float32 values of some rows of W (exact: q * d)."""
        q, d = self.q[rows].to(torch.float32), self.d[rows].to(torch.float32)
        return (q.view(len(rows), -1, BLOCK) * d[..., None]).view(len(rows), -1)


def activation_error(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The most that quantizing x [n, in] to int8 per block of 32 (scale max|x| / 127, values
    rounded to nearest) moves x @ w.T [n, out]: half a step per value, summed with |w|."""
    n, cols = x.shape
    step = x.abs().view(n, cols // BLOCK, BLOCK).amax(-1) / 127  # [n, blocks]
    weight = w.abs().view(w.shape[0], cols // BLOCK, BLOCK).sum(-1)  # [out, blocks]
    return step @ weight.T / 2 * 1.001
