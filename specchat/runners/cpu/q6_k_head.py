"""An LM head whose weight is a GGUF's Q6_K rows as the file holds them (6.56 bits a weight),
run by specchat's integer Q6_K kernel (csrc/q6_k.c). llama-quantize writes the head of most
Q4_K_M, Q5_K_M, Q6_K and Q4_0 files in Q6_K; read in its own type, a step reads 23% fewer head
bytes than through a Q8_0 copy (8.5 bits). `models.gguf_head.gguf_q6_k_head` reads the rows and
checks them against the checkpoint before the head takes this forward.

`q6_k_values` gives the float32 values as the gguf package dequantizes them; `quantize_q6_k`
writes float rows in Q6_K (llama.cpp's first choice of scales, without its search), for files
in a real model's shape (`bench.gguf_shapes`) and for tests."""

from __future__ import annotations

import torch

from specchat import kernels
from specchat.runners.cpu.q8_head import Q8Head

SUPER, BYTES = kernels.Q6_K_SUPER, kernels.Q6_K_BYTES  # values of a superblock, its bytes


class Q6KHead(Q8Head):
    """`Q8Head`'s contract (the runner's head products, `leading`'s `upto` and block maxima) on
    a Q6_K tensor: `q` uint8 [out, in / 256 * 210], the file's bytes repacked 16 rows a group
    (`kernels.q6_k_pack`, a view of the whole groups); no separate scales."""

    def __init__(self, head: torch.nn.Linear, rows: torch.Tensor, lib):
        super().__init__(head, kernels.q6_k_pack(lib, rows), None, lib)

    def pack_rows(self, lib) -> bool:
        """Every path reads the same packed rows: nothing to repack."""
        self.lib = lib
        return True

    def _product(self, x, upto=None, maxima=None) -> torch.Tensor:
        return kernels.q6_k_matmul_i8(self.lib, x, self.q, upto, maxima)

    def dequantized(self, rows: torch.Tensor) -> torch.Tensor:
        """The float32 values of some rows of W, the gguf package's bits."""
        return q6_k_values(unpacked(self.q, rows))


def unpacked(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of a `kernels.q6_k_pack` tensor in the file's layout (`q6_k_pack` undone)."""
    whole = torch.as_strided(packed, (-(-packed.shape[0] // 16) * 16, packed.shape[1]),
                             packed.stride())  # the view's last group whole
    group = whole.view(whole.shape[0] // 16, -1, 16 * BYTES)[rows // 16]  # [n, supers, 3360]
    i = (rows % 16).view(-1, 1, 1, 1)
    n, supers = group.shape[:2]
    subs = group[..., :16 * 192].reshape(n, supers, 16, 192)
    pos = (4 * i + torch.arange(4).view(1, 1, 1, 4)).expand(n, supers, 16, 4)  # p = 4 row + m
    low = torch.stack([(subs[..., :64].gather(-1, pos) & 15), subs[..., :64].gather(-1, pos) >> 4,
                       subs[..., 64:128].gather(-1, pos) & 15,
                       subs[..., 64:128].gather(-1, pos) >> 4], 3)  # [n, supers, t, k, m]
    bits = subs[..., 128:].gather(-1, pos)
    high = torch.stack([bits >> 2 * k & 3 for k in range(4)], 3)
    q = (low | high << 4).reshape(n, supers, SUPER)  # value 16 t + 4 k + m
    scales = group[..., 16 * 192:16 * 192 + 256].reshape(n, supers, 16, 16)
    scale = scales.gather(-1, i.expand(n, supers, 16, 1))[..., 0]  # [n, supers, 16]
    d = group[..., 16 * 192 + 256:].reshape(n, supers, 16, 2)
    d = d.gather(2, i.view(-1, 1, 1, 1).expand(n, supers, 1, 2))[:, :, 0]  # [n, supers, 2]
    return file_rows(q, scale, d)


def file_rows(q: torch.Tensor, scale: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q6_K rows uint8 [rows, supers * 210] in the file's layout from each superblock's levels
    q (0..63) [rows, supers, 256], int8 scales as bytes [rows, supers, 16] and fp16 d as bytes
    [rows, supers, 2]."""
    n = q.shape[0]
    q = q.reshape(n, -1, 2, 4, 32)  # [rows, supers, half, group of 32, 32]
    ql = (q[:, :, :, :2] & 15 | q[:, :, :, 2:] << 4).reshape(n, -1, 128)  # group 2, 3 high
    qh = (q[:, :, :, 0] >> 4 | q[:, :, :, 1] >> 4 << 2 | q[:, :, :, 2] >> 4 << 4
          | q[:, :, :, 3] >> 4 << 6).reshape(n, -1, 64)
    return torch.cat([ql, qh, scale, d], -1).reshape(n, -1)


def q6_k_values(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [rows, in] from Q6_K rows uint8 [rows, in / 256 * 210], as the gguf package's
    dequantizer computes them: (d * scale) * (q - 32), d and the scale widened to float32."""
    rows = blocks.shape[0]
    sb = blocks.reshape(rows, -1, BYTES)
    ql, qh = sb[..., :128].reshape(rows, -1, 2, 1, 64), sb[..., 128:192].reshape(rows, -1, 2, 1, 32)
    low = (ql >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 15  # [.., half, nibble, 64]
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3  # [.., half, 4, 32]
    q = (low.reshape(rows, -1, 2, 4, 32) | high << 4).to(torch.float32) - 32  # value order
    scale = sb[..., 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = sb[..., 208:210].contiguous().view(torch.float16).to(torch.float32)  # [rows, supers, 1]
    return (q.reshape(rows, -1, 16, 16) * (d * scale)[..., None]).reshape(rows, -1)


def quantize_q6_k(weight: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """uint8 [out, in / 256 * 210]: float rows in GGUF's Q6_K. Per sub-block of 16, the scale
    that maps its largest magnitude to -32 (llama.cpp's first guess); per superblock, d =
    max scale / -128 in fp16, the scales rounded to int8 against it, and every value rounded to
    the nearest of its 64 levels. `chunk_rows` rows at a time."""
    out, cols = weight.shape
    if cols % SUPER:
        raise ValueError(f"Q6_K takes rows of whole superblocks of {SUPER}; got {cols}")
    result = torch.empty(out, cols // SUPER * BYTES, dtype=torch.uint8)
    for r in range(0, out, chunk_rows):
        w = weight[r:r + chunk_rows].detach().to(torch.float32)
        n = w.shape[0]
        sub = w.reshape(n, -1, 16, 16)  # [rows, supers, sub-blocks, 16]
        peak = sub.gather(-1, sub.abs().argmax(-1, keepdim=True))[..., 0]  # signed
        scales = peak / -32
        top = scales.gather(-1, scales.abs().argmax(-1, keepdim=True))  # [rows, supers, 1]
        d = (top / -128).to(torch.float16)
        inverse = torch.where(d != 0, 1 / d.float(), torch.zeros_like(top))
        sc = (scales * inverse).round().clamp(-128, 127).to(torch.int8)
        step = d.float() * sc.float()  # each sub-block's (d * scale)
        level = torch.where(step[..., None] != 0, sub / step[..., None], torch.zeros_like(sub))
        q = (level.round().clamp(-32, 31) + 32).to(torch.uint8).reshape(n, -1, SUPER)
        result[r:r + n] = file_rows(q, sc.view(torch.uint8), d.view(torch.uint8))
    return result
