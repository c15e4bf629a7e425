"""The CUDA runtime's Triton kernels. Each computes a row of its output from that row of its
input alone, in an order fixed by the shapes of the weights, never by the number of rows: rows
are tiles of ROWS, reductions run over fixed blocks in one sequential loop, K's slices (counted
by the weight's shape) are added in order, never by atomics. So a token's activations are the
same bits whatever is fed beside it.

| kernel      | computes                                                        |
| ----------- | --------------------------------------------------------------- |
| `nf4_matmul`| x @ W.T for bitsandbytes' NF4 W: each 64-code block read once for all rows, decoded by `pair_table`, `tl.gather` or byte permutes in registers (DECODE 0, 1; 2, 3), the block's absmax (laid out [K/64, N], `nf4_scales`) applied to its partial product; K split into slices by the weight's shape (`nf4_config`); pad rows' activations never read (`rows`) |
| `matmul`    | x @ W.T for a bf16 W (the LM head, unquantized layers)          |
| `rms_norm`  | an optional residual add, then the RMS norm of each row; takes a split product's planes as its input or its add (`Planes`) |
| `act_mul`   | silu(gate) * up (Llama) or gelu(gate) * up (Gemma)              |
| `rope_store`| RoPE (after Gemma's q and k norms) on a q|k|v row (or its product's planes): q out, k and v into the static cache |
| `attention` | causal (optionally sliding-window) attention over the static cache, blocks of KEYS keys from slot 0, combined in one pass whatever the context's length |

Under `TRITON_INTERPRET=1` the same kernels run on the CPU (the tests do, at tiny shapes).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Under the interpreter (the CPU tests), tl.dot misreads bf16 operands and runs on numpy's
# BLAS, whose rows depend on the rows beside them: there `_dot` multiplies float32 copies and
# sums each product row in numpy's fixed order instead, so the interpreted kernels are
# row-exact as the compiled ones are.
UPCAST = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """a [M, K] @ b [K, N] in float32."""
    if UPCAST:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a, b)

ROWS = 16  # rows per tile: tl.dot's smallest M; a decode step pads its rows to a multiple
KEYS = 64  # keys per attention block (a fixed split size, counted from slot 0)
NF4_BLOCK = 64  # codes per absmax: bitsandbytes' default 4-bit blocksize, the one supported


# -- NF4 ------------------------------------------------------------------------------------


def pair_table(code: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' 16-entry NF4 codebook -> 264 int32s. The first 256: for each byte, the bf16
    bits of its high-nibble code (the first of the two) in the low half and of its low-nibble
    code in the high half, so one lookup gives both codes of a byte. Then 8 words for the byte
    permutes of DECODE 2 (`PRMT_DECODE`): the low bytes of codes 0-3, 4-7, 8-11, 12-15 (code
    4i + j in byte j), then their high bytes the same way."""
    bits = code.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    byte = torch.arange(256)
    pairs = bits[byte >> 4] | (bits[byte & 15] << 16)
    words = [sum(((bits[4 * i + j] >> shift) & 0xFF) << (8 * j) for j in range(4))
             for shift in (0, 8) for i in range(4)]
    words = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in map(int, words)])
    return torch.cat([pairs, words]).to(torch.int32).contiguous()


# DECODE 2's table decode, four bytes (eight codes) a call, in registers: `prmt.b32` picks bytes
# of two 32-bit words by 4-bit selectors, as llama.cpp's `get_int_from_table_16` does. $4 holds
# four bytes; then come the codes' low bytes (4 words) and their high bytes (4 words), the last
# 8 words of `pair_table`. Each half (the low nibbles, then the high) gathers its four codes into the selector
# nibbles (`s`), looks up the low and the high bytes in codes 0-7 and 8-15 (`s & 0x7777`), keeps
# per byte the half its code's bit 3 names (`sel`), and interleaves the low and high bytes into
# four bf16s: the first codes in $0-$1, the second in $2-$3, two a register, in element order.
# (A 32-bit input takes a register per element of the four: word i is $(5 + 4i) .. $(8 + 4i),
# all the same value.)
PRMT_HALF = """
    and.b32 n, n, 0x0F0F0F0F;
    shr.u32 t, n, 4;
    or.b32 n, n, t;
    prmt.b32 s, n, n, 0x0020;
    and.b32 s7, s, 0x7777;
    and.b32 sel, s, 0x8888;
    shr.u32 sel, sel, 1;
    or.b32 sel, sel, 0x3210;
    prmt.b32 a, {w0}, {w1}, s7;
    prmt.b32 b, {w2}, {w3}, s7;
    prmt.b32 lo, a, b, sel;
    prmt.b32 a, {w4}, {w5}, s7;
    prmt.b32 b, {w6}, {w7}, s7;
    prmt.b32 hi, a, b, sel;
    prmt.b32 {out0}, lo, hi, 0x5140;
    prmt.b32 {out1}, lo, hi, 0x7362;"""
_PRMT_REGS = "{\n    .reg .b32 n, t, s, s7, sel, a, b, lo, hi;"


def _half(out0: str, out1: str, first_word: int) -> str:
    """PRMT_HALF into registers out0 and out1, the table's word i in $(first_word + 4i)."""
    return PRMT_HALF.format(out0=out0, out1=out1,
                            **{f"w{i}": f"${first_word + 4 * i}" for i in range(8)})


PRMT_DECODE = tl.constexpr(_PRMT_REGS + "\n    mov.b32 n, $4;" + _half("$2", "$3", 5)
                           + "\n    shr.u32 n, $4, 4;" + _half("$0", "$1", 5) + "\n}")
# four outputs, then the bytes and the 8 table words (4 registers each)
PRMT_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 33))
# DECODE 3's: four codes (0-15, a byte each) in $2 -> their bf16s in $0-$1, two a register, in
# element order; the table words in $3 + 4i
PRMT_CODES = tl.constexpr(_PRMT_REGS + "\n    mov.b32 n, $2;" + _half("$0", "$1", 3) + "\n}")
PRMT_CODES_CONSTRAINTS = tl.constexpr("=r,=r," + ",".join(["r"] * 33))


# A program takes BLOCK_N columns of W and one of SPLIT equal slices of K, for ROWS rows: each
# step reads BLOCK_K codes of every column (BLOCK_K / 2 bytes: 128 at the default 256 codes),
# block by block of 64 codes, with the block's partial product scaled by its absmax and added in
# order. SPLIT > 1 writes each slice's float32 sums to its own plane of `partial`, and
# `_nf4_sum_kernel` adds the planes in order: no atomics, and every count is the weight's, so a
# row's bits never depend on the rows beside it.
#
# Decoding: DECODE 0 looks each byte up in the 256-entry pair table (one load gives both codes,
# from global memory, cached); DECODE 1 loads the 16 codebook values once per program and
# decodes every nibble with `tl.gather` (which Triton lowers to a table in shared memory behind
# barriers). Both give the same bf16 values and the same bits.
#
# DECODE 2 decodes in registers and hands the MMA its weights as they are decoded: byte
# permutes (`PRMT_DECODE`) turn each byte into its first and second code, and the block's
# product is W_first @ x_even.T + W_second @ x_odd.T (x's even and odd columns of the block),
# computed transposed, [columns, rows], so the weights are the MMA's first operand and nothing
# is joined, reshaped or transposed between the load and the dot. Its sums run in another order
# than DECODE 0/1's, fixed by the shapes as theirs: a row's bits never depend on the rows beside
# it. (Interpreted, the pair table stands in for the permutes: the same values.)
#
# DECODE 3 works elementwise on a step's [BLOCK_N, BLOCK_K] weights: each code's nibble picked
# from its byte (read a byte per code: each byte serves its two codes from the cache), decoded
# four a call by the same permutes (`PRMT_CODES`) and scaled by its block's absmax (read per
# code, cached) into bitsandbytes' own dequantized bf16 value; then one MMA a step, the weights
# its first operand, transposed as DECODE 2's. Nothing but elementwise operations lies between
# the loads and the dot, and its sums run over the step's codes in one product, not block by
# block: other bits than DECODE 0-2's, fixed by the shapes as theirs.


@triton.jit
def _nf4_block(x_ptr, w_ptr, table_ptr, values, rm, rn, row_ok, col_ok, kb,
               K: tl.constexpr, BLOCK_N: tl.constexpr, DECODE: tl.constexpr,
               UPCAST: tl.constexpr):
    """The unscaled product of one 64-code block: x[rm, 64 kb ..] @ W[rn, 64 kb ..].T."""
    rk = tl.arange(0, 64)
    rb = tl.arange(0, 32)
    x = tl.load(x_ptr + rm[:, None] * K + kb * 64 + rk[None, :], mask=row_ok[:, None],
                other=0.0)
    packed = tl.load(w_ptr + rn[:, None] * (K // 2) + kb * 32 + rb[None, :],
                     mask=col_ok[:, None], other=0)
    if DECODE == 1:
        codes = packed.to(tl.int32)
        first = tl.gather(values, tl.reshape(codes >> 4, (BLOCK_N * 32,)), 0)
        second = tl.gather(values, tl.reshape(codes & 15, (BLOCK_N * 32,)), 0)
        first = tl.reshape(first, (BLOCK_N, 32)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        second = tl.reshape(second, (BLOCK_N, 32)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        pair = tl.load(table_ptr + packed.to(tl.int32))
        first = (pair & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        second = ((pair >> 16) & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    w = tl.reshape(tl.join(first, second), (BLOCK_N, 64))
    return _dot(x, tl.trans(w), UPCAST)


@triton.jit
def _nf4_pairs(packed, table_ptr, UPCAST: tl.constexpr):
    """Each byte's first (high-nibble) and second code as bf16, [BLOCK_N, 32] each."""
    if UPCAST:  # the interpreter runs no PTX: the pair table gives the same values
        pair = tl.load(table_ptr + packed.to(tl.int32))
        first = (pair & 0xFFFF).to(tl.uint16)
        second = ((pair >> 16) & 0xFFFF).to(tl.uint16)
    else:
        words = table_ptr + 256
        first, second = tl.inline_asm_elementwise(
            PRMT_DECODE, PRMT_CONSTRAINTS,
            [packed, tl.load(words), tl.load(words + 1), tl.load(words + 2), tl.load(words + 3),
             tl.load(words + 4), tl.load(words + 5), tl.load(words + 6), tl.load(words + 7)],
            (tl.uint16, tl.uint16), is_pure=True, pack=4)
    return first.to(tl.bfloat16, bitcast=True), second.to(tl.bfloat16, bitcast=True)


@triton.jit
def _nf4_block_t(x_ptr, w_ptr, table_ptr, rm, rn, row_ok, col_ok, kb, K: tl.constexpr,
                 UPCAST: tl.constexpr):
    """DECODE 2's unscaled product of one 64-code block, transposed:
    W[rn, 64 kb ..] @ x[rm, 64 kb ..].T -> [BLOCK_N, BLOCK_M]."""
    rb = tl.arange(0, 32)
    packed = tl.load(w_ptr + rn[:, None] * (K // 2) + kb * 32 + rb[None, :],
                     mask=col_ok[:, None], other=0)
    at = x_ptr + rm[None, :] * K + kb * 64 + 2 * rb[:, None]  # [32, BLOCK_M]: even columns
    x_even = tl.load(at, mask=row_ok[None, :], other=0.0)
    x_odd = tl.load(at + 1, mask=row_ok[None, :], other=0.0)
    first, second = _nf4_pairs(packed, table_ptr, UPCAST)
    return _dot(first, x_even, UPCAST) + _dot(second, x_odd, UPCAST)


@triton.jit
def _nf4_codes(codes, table_ptr, UPCAST: tl.constexpr):
    """Codes (0-15, uint8) -> their bf16 values, elementwise."""
    if UPCAST:  # the interpreter runs no PTX: the pair table gives the same values
        value = (tl.load(table_ptr + (codes.to(tl.int32) << 4)) & 0xFFFF).to(tl.uint16)
    else:
        words = table_ptr + 256
        value = tl.inline_asm_elementwise(
            PRMT_CODES, PRMT_CODES_CONSTRAINTS,
            [codes, tl.load(words), tl.load(words + 1), tl.load(words + 2), tl.load(words + 3),
             tl.load(words + 4), tl.load(words + 5), tl.load(words + 6), tl.load(words + 7)],
            tl.uint16, is_pure=True, pack=4)
    return value.to(tl.bfloat16, bitcast=True)


@triton.jit
def _nf4_step_e(x_ptr, w_ptr, absmax_ptr, stride_a, table_ptr, rm, rn, row_ok, col_ok, k0,
                K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                UPCAST: tl.constexpr):
    """DECODE 3's product of a step's BLOCK_K codes, transposed:
    W[rn, k0 .. k0 + BLOCK_K] @ x[rm, same].T -> [BLOCK_N, BLOCK_M], each weight its code's
    value times its block's absmax rounded to bf16 (bitsandbytes' own dequantized value)."""
    rk = tl.arange(0, BLOCK_K)
    at = rn[:, None] * K + k0 + rk[None, :]  # [BLOCK_N, BLOCK_K]: each weight's place
    byte = tl.load(w_ptr + at // 2, mask=col_ok[:, None], other=0)
    codes = ((byte.to(tl.int32) >> (4 - 4 * (rk[None, :] % 2))) & 15).to(tl.uint8)  # even: high
    scale = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # each block's absmax, selected
    for j in tl.static_range(BLOCK_K // 64):
        block = tl.load(absmax_ptr + (k0 // 64 + j) * stride_a + rn, mask=col_ok, other=0.0)
        scale = tl.where((rk // 64 == j)[None, :], block[:, None], scale)
    w = (_nf4_codes(codes, table_ptr, UPCAST).to(tl.float32) * scale).to(tl.bfloat16)
    x_t = tl.load(x_ptr + rm[None, :] * K + k0 + rk[:, None], mask=row_ok[None, :], other=0.0)
    return _dot(w, x_t, UPCAST)


@triton.jit
def _nf4_step_h(x_ptr, w_ptr, absmax_ptr, stride_a, table_ptr, rm, rn, row_ok, col_ok, k0,
                K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                UPCAST: tl.constexpr):
    """DECODE 4: DECODE 3's product with the step's K in two halves, so that its codes load as
    whole bytes, contiguous (16 bytes a load, not one a code): column j < H of the tile is the
    high nibble of byte j, column H + j its low nibble (H = BLOCK_K / 2), and x (bf16) is read
    in the same order (even k, then odd k). Sums over K in another order than DECODE 3's: its
    own bits, still a row's alone."""
    H: tl.constexpr = BLOCK_K // 2
    rk = tl.arange(0, BLOCK_K)
    byte_at = rk % H  # the byte of the step each column reads
    low = rk >= H  # its low nibble (the code after the high one)
    byte = tl.load(w_ptr + rn[:, None] * (K // 2) + k0 // 2 + byte_at[None, :],
                   mask=col_ok[:, None], other=0)
    codes = ((byte.to(tl.int32) >> (4 - 4 * low.to(tl.int32))[None, :]) & 15).to(tl.uint8)
    k = 2 * byte_at + low.to(tl.int32)  # each column's place in the step
    scale = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for j in tl.static_range(BLOCK_K // 64):
        block = tl.load(absmax_ptr + (k0 // 64 + j) * stride_a + rn, mask=col_ok, other=0.0)
        scale = tl.where((k // 64 == j)[None, :], block[:, None], scale)
    w = (_nf4_codes(codes, table_ptr, UPCAST).to(tl.float32) * scale).to(tl.bfloat16)
    # x's two values of byte j's codes are one 32-bit word (bf16, even k first): words load
    # contiguous too, each column taking its half
    words = x_ptr.to(tl.pointer_type(tl.uint32))
    word = tl.load(words + rm[None, :] * (K // 2) + k0 // 2 + byte_at[:, None],
                   mask=row_ok[None, :], other=0)
    half = (word >> (16 * low.to(tl.uint32))[:, None]) & 0xFFFF
    x_t = half.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return _dot(w, x_t, UPCAST)


@triton.jit
def _nf4_matmul_kernel(x_ptr, w_ptr, absmax_ptr, table_ptr, bias_ptr, out_ptr, partial_ptr,
                       rows_ptr, M, N, stride_om, stride_a, K: tl.constexpr,
                       HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT: tl.constexpr, DECODE: tl.constexpr, UPCAST: tl.constexpr,
                       LIVE: tl.constexpr):
    # row tiles vary fastest, so the tiles of one column block run together and read its
    # codes from HBM once (a prompt page has four)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rm < M  # rows stored
    if LIVE:  # rows read: the live ones (a device scalar), pad rows computed from zeros
        load_ok = rm < tl.load(rows_ptr)
    else:
        load_ok = row_ok
    col_ok = rn < N
    first_block = pid_k * (K // 64 // SPLIT)
    if DECODE >= 2:  # accumulated transposed, [columns, rows], and stored so
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for step in range(0, K // SPLIT, BLOCK_K):
            if DECODE == 3:  # one product a step
                acc_t += _nf4_step_e(x_ptr, w_ptr, absmax_ptr, stride_a, table_ptr, rm, rn,
                                     load_ok, col_ok, first_block * 64 + step, K, BLOCK_N,
                                     BLOCK_K, UPCAST)
            elif DECODE == 4:  # one product a step, its codes loaded as whole bytes
                acc_t += _nf4_step_h(x_ptr, w_ptr, absmax_ptr, stride_a, table_ptr, rm, rn,
                                     load_ok, col_ok, first_block * 64 + step, K, BLOCK_N,
                                     BLOCK_K, UPCAST)
            else:
                for j in tl.static_range(BLOCK_K // 64):
                    kb = first_block + step // 64 + j
                    part = _nf4_block_t(x_ptr, w_ptr, table_ptr, rm, rn, load_ok, col_ok, kb, K,
                                        UPCAST)
                    scale = tl.load(absmax_ptr + kb * stride_a + rn, mask=col_ok, other=0.0)
                    acc_t += part * scale[:, None]
        ok_t = col_ok[:, None] & row_ok[None, :]
        if SPLIT == 1:
            if HAS_BIAS:
                acc_t += tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None],
                     acc_t.to(out_ptr.dtype.element_ty), mask=ok_t)
        else:
            tl.store(partial_ptr + (pid_k * M + rm[None, :]) * N + rn[:, None], acc_t, mask=ok_t)
    else:
        # code i: byte i << 4, first
        values = tl.load(table_ptr + tl.arange(0, 16) * 16) & 0xFFFF
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, K // SPLIT, BLOCK_K):
            for j in tl.static_range(BLOCK_K // 64):
                kb = first_block + step // 64 + j
                part = _nf4_block(x_ptr, w_ptr, table_ptr, values, rm, rn, load_ok, col_ok, kb,
                                  K, BLOCK_N, DECODE, UPCAST)
                scale = tl.load(absmax_ptr + kb * stride_a + rn, mask=col_ok, other=0.0)
                acc += part * scale[None, :]
        if SPLIT == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        else:
            tl.store(partial_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc,
                     mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _nf4_sum_kernel(partial_ptr, bias_ptr, out_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr,
                    SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = the SPLIT planes of partial added in order (+ bias), in out's dtype."""
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = at < M * N
    acc = tl.load(partial_ptr + at, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(partial_ptr + s * M * N + at, mask=ok, other=0.0)
    m, n = at // N, at % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


# Programs a matmul should start to keep every SM of an H100/H200 (132) busy with several
# programs, at a decode step's one row tile
PROGRAMS = 512
# The fastest configuration of each NF4 shape, per card, as `sweep.py --write` measured it:
# {card name: {"NxK": [columns, codes a step, slices, warps, stages, decode]}}
CONFIGS_FILE = Path(__file__).with_name("configs.json")


class NF4Config(NamedTuple):
    block_n: int  # columns a program
    block_k: int  # codes of each column a step (a multiple of 64)
    split: int  # equal slices of K, summed in order after
    warps: int
    stages: int
    decode: int = 1  # 0: the pair table in global memory, 1: `tl.gather`, 2: byte permutes of
    # whole bytes, 3: byte permutes of codes picked elementwise, 4: as 3, the codes loaded as
    # whole bytes (a step's K in two halves)


@functools.cache
def card_configs(card: str) -> dict[str, NF4Config]:
    """The configurations `sweep.py --write` kept for this card (none: the shape's rule)."""
    try:
        table = json.loads(CONFIGS_FILE.read_text())
    except (OSError, ValueError):
        return {}
    return {shape: NF4Config(*c) for shape, c in table.get(card, {}).items()}


@functools.cache
def _card(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def nf4_config(n: int, k: int, card: str | None = None) -> NF4Config:
    """The configuration of an [n, k] NF4 weight, from its shape (and the card) alone, never
    the rows: the card's measured best where `sweep.py --write` kept one; else enough programs
    at one row tile (`PROGRAMS`), each reading BLOCK_K codes of its columns a step.
    (Interpreted: wide tiles, few programs.)"""
    kept = card_configs(card).get(f"{n}x{k}") if card else None
    if kept is not None and k % (kept.split * kept.block_k) == 0:
        return kept
    blocks = k // NF4_BLOCK
    per_step = 4 if blocks % 4 == 0 else 2 if blocks % 2 == 0 else 1
    if UPCAST:
        return NF4Config(64, 64 * per_step, 2 if blocks % (2 * per_step) == 0 else 1, 4, 1)
    block_n = 32
    split = 1
    while (triton.cdiv(n, block_n) * split < PROGRAMS and split < 16
           and blocks % (2 * split * per_step) == 0):
        split *= 2
    return NF4Config(block_n, 64 * per_step, split, 4, 3)


class Planes(NamedTuple):
    """An NF4 product split over K, not yet added: its slices' float32 sums [SPLIT, M, N] and
    its bias. Its value is what `_nf4_sum_kernel` stores, (plane 0 + plane 1 + ... + bias) in
    `dtype`; a consumer that takes planes (`rms_norm`) adds them in the same order itself,
    which saves the product's second launch."""
    planes: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.planes.shape[1:]


def nf4_scales(absmax: torch.Tensor) -> torch.Tensor:
    """The absmax of an [N, K] NF4 weight, [N, K/64], as `nf4_matmul` reads it: float32
    [K/64, N], so that a step's scales of BLOCK_N columns are one contiguous load."""
    return absmax.float().T.contiguous()


def nf4_matmul(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
               table: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, config: NF4Config | None = None,
               rows: torch.Tensor | None = None, fold: bool = False
               ) -> torch.Tensor | Planes:
    """x [M, K] bf16 @ W.T, W [N, K] as NF4: packed [N, K/2] uint8 (two codes a byte, the
    first in the high nibble), absmax as `nf4_scales` gives it ([K/64, N] float32, columns
    contiguous, double quantization undone), table from `pair_table`. -> [M, N] in x's dtype; `out` may be a column slice of a wider
    buffer (rows strided, columns contiguous). `config` instead of the shape's own
    (`sweep.py` times them). `rows`: a one-element int32 tensor on x's device, the live rows
    (read when the kernel runs, as a captured graph replays): the rows from there on are
    computed from zeros (their output is the bias, or zero) and their activations never read.
    `fold` (and no `out`): a product split over K comes back as its `Planes`, for a consumer
    that adds them."""
    m, k = x.shape
    n = packed.shape[0]
    if absmax.shape != (k // NF4_BLOCK, n) or absmax.stride(1) != 1:
        raise ValueError(f"absmax {tuple(absmax.shape)} is not [K/64, N] = [{k // NF4_BLOCK}, "
                         f"{n}] with its columns contiguous (`nf4_scales`)")
    out_given = out
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    c = NF4Config(*config) if config is not None else nf4_config(n, k, _card(x.device))
    if k % (c.split * c.block_k) or c.block_k % NF4_BLOCK:
        raise ValueError(f"{c} does not divide K = {k} into whole steps")
    if c.decode in (3, 4) and c.block_k & (c.block_k - 1):
        raise ValueError(f"{c}: DECODE 3 takes a step's codes in one product, a power of two")
    partial = torch.empty(c.split, m, n, dtype=torch.float32, device=x.device) \
        if c.split > 1 else out
    grid = (triton.cdiv(m, ROWS), triton.cdiv(n, c.block_n), c.split)
    _nf4_matmul_kernel[grid](x, packed, absmax, table, bias if bias is not None else absmax,
                             out, partial, rows if rows is not None else absmax, m, n,
                             out.stride(0), absmax.stride(0), K=k, HAS_BIAS=bias is not None, BLOCK_M=ROWS,
                             BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT=c.split,
                             DECODE=c.decode, UPCAST=UPCAST, LIVE=rows is not None,
                             num_warps=c.warps, num_stages=c.stages)
    if c.split > 1 and fold and out_given is None:
        return Planes(partial, bias, x.dtype)
    if c.split > 1:
        _nf4_sum_kernel[(triton.cdiv(m * n, 1024),)](
            partial, bias if bias is not None else absmax, out, m, n, out.stride(0),
            HAS_BIAS=bias is not None, SPLIT=c.split, BLOCK=1024)
    return out


# -- bf16 -------------------------------------------------------------------------------------


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, rows_ptr, M, N, stride_om, K: tl.constexpr,
                   HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   UPCAST: tl.constexpr, LIVE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    if LIVE:  # as in the NF4 kernel: pad rows' activations are never read
        load_ok = rm < tl.load(rows_ptr)
    else:
        load_ok = row_ok
    col_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + rk < K
        x = tl.load(x_ptr + rm[:, None] * K + k0 + rk[None, :],
                    mask=load_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + k0 + rk[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += _dot(x, tl.trans(w), UPCAST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


# (columns a program, K an iteration, warps, stages) of the bf16 matmul
MATMUL_CONFIG = (64, 64, 4, 1) if UPCAST else (64, 128, 4, 3)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None,
           config: tuple[int, int, int, int] | None = None,
           rows: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T, weight [N, K] in x's dtype -> [M, N]. `config`: (columns a
    program, K an iteration, warps, stages) instead of the default; `rows`: the live rows, as
    `nf4_matmul` takes them."""
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config or MATMUL_CONFIG
    grid = (triton.cdiv(m, ROWS), triton.cdiv(n, block_n))
    _matmul_kernel[grid](x, weight, bias if bias is not None else weight, out,
                         rows if rows is not None else weight, m, n, out.stride(0), K=k,
                         HAS_BIAS=bias is not None, BLOCK_M=ROWS, BLOCK_N=block_n,
                         BLOCK_K=block_k, UPCAST=UPCAST, LIVE=rows is not None,
                         num_warps=warps, num_stages=stages)
    return out


# -- norms and activations ------------------------------------------------------------------


@triton.jit
def _planes_value(ptr, bias_ptr, at, col, ok, bias_ok, MN, PARTS: tl.constexpr,
                  HAS_BIAS: tl.constexpr, dtype: tl.constexpr):
    """An NF4 product's value at `at` (column `col`) from its planes, as `_nf4_sum_kernel`
    stores it: the planes added in order, then the bias, rounded to `dtype`."""
    acc = tl.load(ptr + at, mask=ok, other=0.0)
    for s in tl.static_range(1, PARTS):
        acc += tl.load(ptr + s * MN + at, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=bias_ok, other=0.0).to(tl.float32)
    return acc.to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, add_ptr, w_ptr, out_ptr, bias_ptr, M, D, eps, offset,
                     HAS_ADD: tl.constexpr, CAST_FIRST: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_D: tl.constexpr, X_PARTS: tl.constexpr, ADD_PARTS: tl.constexpr,
                     HAS_BIAS: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    ok = (rm < M)[:, None] & (rd < D)[None, :]
    at = rm[:, None] * D + rd[None, :]
    if X_PARTS:  # x: a product's planes, added here
        x = _planes_value(x_ptr, bias_ptr, at, rd[None, :], ok, (rd < D)[None, :], M * D,
                          X_PARTS, HAS_BIAS, out_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + at, mask=ok, other=0.0)
    if HAS_ADD:  # the residual stream: x += add, kept in x's dtype as the model's own add
        if ADD_PARTS:
            add = _planes_value(add_ptr, bias_ptr, at, rd[None, :], ok, (rd < D)[None, :],
                                M * D, ADD_PARTS, HAS_BIAS, x_ptr.dtype.element_ty)
        else:
            add = tl.load(add_ptr + at, mask=ok, other=0.0)
        x = (x.to(tl.float32) + add.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + at, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / D
    normed = xf * (1.0 / tl.sqrt(var + eps))[:, None]
    if CAST_FIRST:  # Llama rounds the normed row, then scales it; Gemma scales in float32
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + rd, mask=rd < D, other=0.0).to(tl.float32) + offset
    tl.store(out_ptr + at, (normed * w[None, :]).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor | Planes, weight: torch.Tensor, eps: float,
             add: torch.Tensor | Planes | None = None, out: torch.Tensor | None = None,
             offset: float = 0.0, cast_first: bool = True) -> torch.Tensor:
    """Each row of x [M, D]: first x += add (in place, where given), then
    x / rms(x) * (weight + offset), the normed row rounded to x's dtype before the scaling
    (Llama's way) or not (`cast_first` False: Gemma's, with offset 1). -> [M, D]. Either x
    (with no add) or add may be an NF4 product's `Planes`, added here as its own second kernel
    would have added them: the same bits, one launch fewer."""
    parts = x if isinstance(x, Planes) else add if isinstance(add, Planes) else None
    if isinstance(x, Planes) and add is not None:
        raise ValueError("planes as x take no add")
    m, d = x.shape
    if out is None:
        out = torch.empty(m, d, dtype=x.dtype, device=weight.device) if isinstance(x, Planes) \
            else torch.empty_like(x)
    block_d = triton.next_power_of_2(d)
    rows = max(1, min(ROWS, 8192 // block_d))  # a tile of rows, each reduced on its own
    x_arg = x.planes if isinstance(x, Planes) else x
    add_arg = add.planes if isinstance(add, Planes) else add if add is not None else x_arg
    bias = parts.bias if parts is not None else None
    _rms_norm_kernel[(triton.cdiv(m, rows),)](
        x_arg, add_arg, weight, out, bias if bias is not None else weight, m, d, eps, offset,
        HAS_ADD=add is not None, CAST_FIRST=cast_first, BLOCK_M=rows, BLOCK_D=block_d,
        X_PARTS=x.planes.shape[0] if isinstance(x, Planes) else 0,
        ADD_PARTS=add.planes.shape[0] if isinstance(add, Planes) else 0,
        HAS_BIAS=bias is not None, num_warps=8)
    return out


@triton.jit
def _act_mul_kernel(gu_ptr, out_ptr, M, I, GELU: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = (rm < M)[:, None] & (r < I)[None, :]
    g = tl.load(gu_ptr + rm[:, None] * 2 * I + r[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + rm[:, None] * 2 * I + I + r[None, :], mask=ok, other=0.0)
    if GELU:  # gelu with tanh's approximation: tanh(y) = 2 / (1 + e^(-2y)) - 1
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (2.0 / (1.0 + tl.exp(-2.0 * y)))
    else:
        act = g / (1.0 + tl.exp(-g))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rm[:, None] * I + r[None, :],
             (act * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def act_mul(gate_up: torch.Tensor, gelu: bool = False,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [M, 2I] (gate | up) -> act(gate) * up [M, I], act silu (Llama) or gelu with
    tanh's approximation (Gemma)."""
    m, two_i = gate_up.shape
    i = two_i // 2
    if out is None:
        out = torch.empty(m, i, dtype=gate_up.dtype, device=gate_up.device)
    block = 256
    grid = (triton.cdiv(m, ROWS), triton.cdiv(i, block))
    _act_mul_kernel[grid](gate_up, out, m, i, GELU=gelu, BLOCK_M=ROWS, BLOCK=block, num_warps=4)
    return out


# -- attention ------------------------------------------------------------------------------


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr,
                       bias_ptr, M, S, eps, offset, HQ: tl.constexpr, HKV: tl.constexpr,
                       D: tl.constexpr, QK_NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_H: tl.constexpr, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr):
    # one (row, head) pair a line: heads are HQ q heads, then HKV k heads, then HKV v heads
    line = tl.arange(0, BLOCK_M * BLOCK_H)
    row = tl.program_id(0) * BLOCK_M + line // BLOCK_H
    head = (line % BLOCK_H)[:, None]
    half = tl.arange(0, D // 2)[None, :]
    real = ((row < M) & (line % BLOCK_H < HQ + 2 * HKV))[:, None]
    pos = tl.load(pos_ptr + row, mask=row < M, other=0)[:, None]
    row = row[:, None]
    at = (row * (HQ + 2 * HKV) + head) * D + half
    if PARTS:  # qkv: a product's planes, added here as its second kernel would
        mn, col = M * (HQ + 2 * HKV) * D, head * D + half
        dtype = q_ptr.dtype.element_ty
        x1 = _planes_value(qkv_ptr, bias_ptr, at, col, real, real, mn, PARTS, HAS_BIAS, dtype)
        x2 = _planes_value(qkv_ptr, bias_ptr, at + D // 2, col + D // 2, real, real, mn, PARTS,
                           HAS_BIAS, dtype)
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    else:
        x1 = tl.load(qkv_ptr + at, mask=real, other=0.0).to(tl.float32)
        x2 = tl.load(qkv_ptr + at + D // 2, mask=real, other=0.0).to(tl.float32)
    if QK_NORM:  # each q and k head's RMS norm (Gemma's way: scaled in float32, then rounded)
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D
        inv = (1.0 / tl.sqrt(var + eps))[:, None]
        is_qh = head < HQ
        normed = head < HQ + HKV
        wq1 = tl.load(qn_ptr + half).to(tl.float32) + offset  # [1, D/2]: every head's
        wq2 = tl.load(qn_ptr + D // 2 + half).to(tl.float32) + offset
        wk1 = tl.load(kn_ptr + half).to(tl.float32) + offset
        wk2 = tl.load(kn_ptr + D // 2 + half).to(tl.float32) + offset
        w1 = tl.where(is_qh, wq1, wk1)
        w2 = tl.where(is_qh, wq2, wk2)
        dtype = q_ptr.dtype.element_ty
        x1 = tl.where(normed, (x1 * inv * w1).to(dtype).to(tl.float32), x1)
        x2 = tl.where(normed, (x2 * inv * w2).to(dtype).to(tl.float32), x2)
    c1 = tl.load(cos_ptr + pos * D + half).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * D + D // 2 + half).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * D + half).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * D + D // 2 + half).to(tl.float32)
    rotate = head < HQ + HKV  # q and k; v passes as it is
    y1 = tl.where(rotate, x1 * c1 - x2 * s1, x1).to(q_ptr.dtype.element_ty)
    y2 = tl.where(rotate, x2 * c2 + x1 * s2, x2).to(q_ptr.dtype.element_ty)
    is_q = real & (head < HQ)
    q_at = q_ptr + (row * HQ + head) * D + half
    tl.store(q_at, y1, mask=is_q)
    tl.store(q_at + D // 2, y2, mask=is_q)
    is_k = real & (head >= HQ) & (head < HQ + HKV)
    k_at = k_ptr + ((head - HQ) * S + pos) * D + half
    tl.store(k_at, y1, mask=is_k)
    tl.store(k_at + D // 2, y2, mask=is_k)
    is_v = real & (head >= HQ + HKV)
    v_at = v_ptr + ((head - HQ - HKV) * S + pos) * D + half
    tl.store(v_at, y1, mask=is_v)
    tl.store(v_at + D // 2, y2, mask=is_v)


def rope_store(qkv: torch.Tensor | Planes, cos: torch.Tensor, sin: torch.Tensor,
               pos: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, heads: int, kv_heads: int,
               qk_norm: tuple[torch.Tensor, torch.Tensor, float, float] | None = None) -> None:
    """qkv [M, (heads + 2 kv_heads) * D] -> q [M, heads, D] with RoPE at positions pos [M];
    k (with RoPE) and v written into the caches [kv_heads, S, D] at slot pos. `qk_norm`:
    (q norm weight, k norm weight, eps, offset), each q and k head normed first. qkv may be
    its product's `Planes`, added here as the product's second kernel would add them."""
    m = qkv.shape[0]
    d = q.shape[-1]
    block_h = triton.next_power_of_2(heads + 2 * kv_heads)
    rows = max(1, min(ROWS, 64 // block_h))
    qn, kn, eps, offset = qk_norm if qk_norm is not None else (cos, cos, 0.0, 0.0)
    parts = isinstance(qkv, Planes)
    bias = qkv.bias if parts else None
    _rope_store_kernel[(triton.cdiv(m, rows),)](
        qkv.planes if parts else qkv, cos, sin, pos, q, k_cache, v_cache, qn, kn,
        bias if bias is not None else cos, m, k_cache.shape[1], eps, offset, HQ=heads,
        HKV=kv_heads, D=d, QK_NORM=qk_norm is not None, BLOCK_M=rows, BLOCK_H=block_h,
        PARTS=qkv.planes.shape[0] if parts else 0, HAS_BIAS=bias is not None, num_warps=4)


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, M, S, scale, window,
                      HQ: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, UPCAST: tl.constexpr):
    head = tl.program_id(0)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rm < M
    rd = tl.arange(0, D)
    kv = head // GROUP
    pos = tl.load(pos_ptr + rm, mask=row_ok, other=0)
    q = tl.load(q_ptr + (rm[:, None] * HQ + head) * D + rd[None, :], mask=row_ok[:, None],
                other=0.0)
    hi = tl.max(pos, axis=0) + 1
    lowest = tl.min(tl.where(row_ok, pos, hi), axis=0)
    lo = tl.maximum(lowest - window + 1, 0) // BLOCK_S * BLOCK_S
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    k_base = k_ptr + kv * S * D
    v_base = v_ptr + kv * S * D
    for start in range(lo, hi, BLOCK_S):
        rs = start + tl.arange(0, BLOCK_S)
        k = tl.load(k_base + rs[:, None] * D + rd[None, :])
        s = _dot(q, tl.trans(k), UPCAST) * scale
        seen = (rs[None, :] <= pos[:, None]) & (pos[:, None] - rs[None, :] < window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + rs[:, None] * D + rd[None, :])
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (rm[:, None] * HQ + head) * D + rd[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
              scale: float, window: int | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """q [M, heads, D] at positions pos [M] (int32) over the caches [kv_heads, S, D], where the
    key of position p sits at slot p. Row r sees slots <= pos[r] (and > pos[r] - window).
    S must be a multiple of KEYS and exceed every position. -> [M, heads, D]."""
    m, heads, d = q.shape
    kv_heads, s, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    grid = (heads, triton.cdiv(m, ROWS))
    _attention_kernel[grid](q, k_cache, v_cache, pos, out, m, s, scale,
                            window if window else 1 << 30, HQ=heads, GROUP=heads // kv_heads,
                            D=d, BLOCK_M=ROWS, BLOCK_S=KEYS, UPCAST=UPCAST, num_warps=4,
                            num_stages=2)
    return out
