"""`nf4_matmul_i8` (kernels/csrc/nf4_i8.c): NF4 by integer dot products, the `cpu-int8`
path's product. Every kernel this machine runs (AVX-512 VNNI, AVX2, the SIMD build's reference
and the portable build's) gives the portable reference's bits, at 1, 2, 3, 4, 8, 16 and 64 rows,
for odd shapes (a last group of fewer than 16 weight rows), NF4 blocks of 32, 64 and 128 and
any thread count; a row's result
is the same alone or among others; and the product is NF4's within what its int8 roundings
explain."""

import os
import shutil

import pytest
import torch
from tiny import with_kernel

from specchat import kernels

# the row counts a verify or a prompt feeds; 24, 40 and 100 take the AMX kernel's part-filled
# tiles of 16 and its passes of up to 32 rows
ROWS = (1, 2, 3, 4, 8, 16, 24, 40, 64, 100)
SHAPES = ((40, 64), (100, 192), (33, 640), (256, 2048))  # (out, in): odd groups, long rows
# NF4's codebook (bitsandbytes' `nf4` table)
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                    0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                    0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236328, 1.0])
W_SCALE = 112.0  # NF4 value v -> the int8 round(112 v), block scale absmax / 112 (nf4_i8.c)


def _compiler() -> bool:
    return shutil.which(os.environ.get("CC", "gcc")) is not None


def _kernels() -> dict:
    """{name: Kernels whose nf4_matmul_i8 is that kernel}: the portable reference always, and
    on x86 with AVX2 the SIMD build's reference, its AVX2 kernel and, where the CPU has it, its
    VNNI kernel."""
    if not _compiler():
        pytest.skip("no C compiler")
    found = {"ref": kernels.load("ref")}
    simd = kernels.load("avx2")
    if simd is not None:
        for name in kernels.I8_KERNELS:
            if kernels.i8_runs(name):
                found[f"simd-{name}"] = with_kernel(simd, "nf4_matmul_i8",
                                                    f"nf4_matmul_i8_{name}")
    assert None not in found.values()
    return found


def _weight(out: int, inn: int, seed: int = 0, blocksize: int = 64):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (out * inn // 2,), dtype=torch.uint8, generator=g)
    absmax = torch.rand(out * inn // blocksize, generator=g) + 0.05
    return codes, absmax


def _dense(codes, absmax, out, inn) -> torch.Tensor:
    c = torch.stack([codes >> 4, codes & 15], 1).reshape(out, inn).long()
    return NF4[c].double() * absmax.double().repeat_interleave(64).reshape(out, inn)


def _arithmetic(x, codes, absmax, out, inn, blocksize: int = 64) -> torch.Tensor:
    """The kernels' arithmetic written with torch: x quantized per block of 32, the codes' int8
    values round(112 v), exact int32 block sums, then the block scales (in float64 here)."""
    blocks = x.reshape(len(x), -1, 32)
    d = blocks.abs().amax(-1) / 127.0  # float32, as the kernels compute them
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int64)  # ties to even
    c = torch.stack([codes >> 4, codes & 15], 1).reshape(out, inn).long()
    w8 = torch.round(W_SCALE * NF4)[c].to(torch.int64).reshape(out, -1, 32)
    isum = torch.einsum("jbt,obt->job", q, w8).double()
    dw = (absmax.repeat_interleave(blocksize // 32).reshape(out, -1) / W_SCALE).double()
    return (isum * dw[None] * d.double()[:, None, :]).sum(-1)


@pytest.mark.parametrize("out,inn", SHAPES)
def test_every_kernel_gives_the_references_bits_at_every_row_count(out, inn):
    found = _kernels()
    ref = found["ref"]
    codes, absmax = _weight(out, inn)
    packed, dw = kernels.nf4_i8_pack(ref, codes, absmax, out, inn, 64)
    assert packed.numel() == -(-out // 16) * 16 * inn // 2  # 4 bits a weight, groups of 16
    assert dw.numel() == -(-out // 16) * 16 * inn // 64  # the checkpoint's one scale a block
    for n in ROWS:
        x = torch.randn(n, inn) * torch.rand(n, 1) * 4
        want = kernels.nf4_matmul_i8(ref, x, packed, dw, NF4, out, 64)
        for name, lib in found.items():
            got = kernels.nf4_matmul_i8(lib, x, packed, dw, NF4, out, 64)
            assert torch.equal(got, want), (name, n)
        assert torch.allclose(want.double(), _arithmetic(x, codes, absmax, out, inn),
                              rtol=1e-5, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("out,inn", SHAPES)
def test_the_packed_codes_give_bitsandbytes_codes_back(out, inn):
    lib = _kernels()["ref"]
    codes, absmax = _weight(out, inn, seed=4)
    packed, _ = kernels.nf4_i8_pack(lib, codes, absmax, out, inn, 64)
    assert torch.equal(kernels.nf4_i8_unpack(lib, packed, out, inn), codes)


@pytest.mark.parametrize("blocksize", (32, 128))
def test_other_nf4_blocks_read_their_own_scales_on_every_kernel(blocksize):
    """A scale a block of 32, or one for four of them: every kernel reads block b's scale at
    b >> log2(blocksize / 32), and gives the arithmetic's values with the reference's bits."""
    found = _kernels()
    out, inn = 100, 384
    codes, absmax = _weight(out, inn, seed=3, blocksize=blocksize)
    packed, dw = kernels.nf4_i8_pack(found["ref"], codes, absmax, out, inn, blocksize)
    assert dw.numel() == 7 * 16 * inn // blocksize
    for n in (1, 5, 24):
        x = torch.randn(n, inn)
        want = kernels.nf4_matmul_i8(found["ref"], x, packed, dw, NF4, out, blocksize)
        for name, lib in found.items():
            assert torch.equal(kernels.nf4_matmul_i8(lib, x, packed, dw, NF4, out, blocksize),
                               want), (name, n)
        assert torch.allclose(want.double(),
                              _arithmetic(x, codes, absmax, out, inn, blocksize),
                              rtol=1e-5, atol=1e-4 * want.abs().max().item())


def test_a_row_is_the_same_bits_alone_among_others_and_with_any_thread_count():
    found = _kernels()
    out, inn = 100, 640
    codes, absmax = _weight(out, inn, seed=1)
    for name, lib in found.items():
        packed, dw = kernels.nf4_i8_pack(lib, codes, absmax, out, inn, 64)
        x = torch.randn(17, inn)
        together = kernels.nf4_matmul_i8(lib, x, packed, dw, NF4, out, 64)
        alone = torch.cat([kernels.nf4_matmul_i8(lib, x[i:i + 1], packed, dw, NF4, out, 64)
                           for i in range(17)])
        assert torch.equal(together, alone), name
        y = torch.empty(17, out)
        for threads in (1, 3):
            lib.nf4_matmul_i8(x.data_ptr(), 17, inn, packed.data_ptr(), dw.data_ptr(), 64,
                              NF4.data_ptr(), y.data_ptr(), out, threads)
            assert torch.equal(y, together), (name, threads)


def test_the_product_is_nf4s_within_its_int8_roundings():
    """Against the float64 product of the dequantized NF4 weight: the error stays within what
    the activations' rounding (half a step per value) and the table's (half a step of 1/112 per
    weight) explain, summed with the magnitudes they multiply."""
    lib = _kernels()["ref"]
    out, inn = 64, 640
    codes, absmax = _weight(out, inn, seed=2)
    packed, dw = kernels.nf4_i8_pack(lib, codes, absmax, out, inn, 64)
    x = torch.randn(8, inn)
    got = kernels.nf4_matmul_i8(lib, x, packed, dw, NF4, out, 64).double()
    w = _dense(codes, absmax, out, inn)
    want = x.double() @ w.T
    step = x.abs().reshape(8, -1, 32).amax(-1).double() / 127  # [rows, blocks]
    act = step @ w.abs().reshape(out, -1, 32).sum(-1).T / 2  # activations' rounding
    tab = x.abs().double() @ (absmax.double().repeat_interleave(64).reshape(out, inn).T
                              / (2 * W_SCALE))
    bound = (act + tab) * 1.01 + 1e-6 * want.abs()
    assert ((got - want).abs() <= bound).all()
    assert (got - want).abs().mean() > 0  # not the float product: the integer one ran


def test_sizes_it_does_not_take_give_nan_and_a_refused_packing():
    lib = _kernels()["ref"]
    codes, absmax = _weight(16, 64)
    wide, _ = _weight(16, 192)
    for blocksize in (48, 96, 16):  # whole blocks of 192 inputs, but not 32 times 2^k
        with pytest.raises(ValueError, match="blocks of 32 times a power of two"):
            kernels.nf4_i8_pack(lib, wide, torch.ones(16 * 192 // 16), 16, 192, blocksize)
    packed, dw = kernels.nf4_i8_pack(lib, codes, absmax, 16, 64, 64)
    assert kernels.nf4_matmul_i8(lib, torch.randn(2, 48), packed, dw, NF4, 16, 64).isnan().all()
    assert kernels.nf4_matmul_i8(lib, torch.randn(2, 64), packed, dw, NF4, 16, 48).isnan().all()


def _q8_kernels() -> dict:
    """{name: Kernels whose q8_0_rows_matmul_i8 is that kernel}: the references of both builds
    and every SIMD kernel the CPU runs (AVX2, AVX-VNNI, AVX-512 VNNI, AMX)."""
    if not _compiler():
        pytest.skip("no C compiler")
    found = {"ref": kernels.load("ref")}
    simd = kernels.load("avx2")
    if simd is not None:
        names = ["ref"] + [name for name in kernels.I8_KERNELS
                           if name != "ref" and kernels.i8_runs(name)]
        for name in names:
            found[f"simd-{name}"] = with_kernel(simd, "q8_0_rows_matmul_i8",
                                                f"q8_0_rows_matmul_i8_{name}")
    return found


def test_the_q8_0_head_repacked_in_place_gives_one_set_of_bits_its_maxima_and_its_values():
    """The `cpu-int8` path's LM head: GGUF's Q8_0 values repacked in place (no second copy),
    read back exactly; every kernel the same bits at every row count, with the block maxima
    and the outputs past `upto` cut as the float path's head gives them; the product is the
    values' within the activations' rounding."""
    from specchat.runners.cpu.q8_head import Q8Head, activation_error

    found = _q8_kernels()
    out, inn = 256, 640
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-128, 128, (out, inn), dtype=torch.int8, generator=g)
    d = (torch.rand(out, inn // 32, generator=g) * 0.01 + 1e-3).to(torch.float16)
    head = Q8Head(torch.nn.Linear(inn, out, bias=False), q.clone(), d.clone(), found["ref"])
    values = head.dequantized(torch.arange(out))
    pointer = head.q.data_ptr()
    assert head.pack_rows(found["ref"]) and head.q.data_ptr() == pointer and head.d is None
    assert not torch.equal(head.q, q)  # the bytes moved, in place
    assert torch.equal(head.dequantized(torch.arange(out)), values)
    assert torch.equal(head.dequantized(torch.tensor([3, 200, 17])), values[[3, 200, 17]])
    for n in ROWS:
        x = torch.randn(n, inn)
        maxima = torch.empty(n, kernels.head_blocks(out))
        want = kernels.q8_0_rows_matmul_i8(found["ref"], x, head.q, head.dw, None, maxima)
        assert torch.equal(maxima, want.view(n, -1, 64).amax(-1))
        for name, lib in found.items():
            got_maxima = torch.empty_like(maxima)
            got = kernels.q8_0_rows_matmul_i8(lib, x, head.q, head.dw, None, got_maxima)
            assert torch.equal(got, want) and torch.equal(got_maxima, maxima), (name, n)
        exact = x.double() @ values.double().T
        bound = activation_error(x, values).double() * 1.01 + 1e-5 * exact.abs().max()
        assert ((want.double() - exact).abs() <= bound).all()
    x = torch.randn(1, inn)
    full = head(x)
    for name, lib in found.items():
        cut = kernels.q8_0_rows_matmul_i8(lib, x, head.q, head.dw, upto=100)
        assert torch.equal(cut[:, :100], full[:, :100]) and cut[:, 100:].eq(-torch.inf).all()
    odd = Q8Head(torch.nn.Linear(inn, 40, bias=False), q[:40].clone(), d[:40].clone(),
                 found["ref"])
    assert not odd.pack_rows(found["ref"]) and odd.dw is None  # not groups of 16: unchanged
    assert torch.equal(odd.q, q[:40])


@pytest.mark.parametrize("inn", (32, 96))
def test_the_q8_0_head_kernels_agree_on_one_block_and_an_odd_number_of_blocks(inn):
    """Rows of one block of 32 inputs, and of three: the AMX kernel's two-deep pipeline over
    the blocks at its shortest and with its tile sets out of step."""
    from specchat.runners.cpu.q8_head import Q8Head

    found = _q8_kernels()
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-128, 128, (64, inn), dtype=torch.int8, generator=g)
    d = (torch.rand(64, inn // 32, generator=g) * 0.01 + 1e-3).to(torch.float16)
    head = Q8Head(torch.nn.Linear(inn, 64, bias=False), q, d, found["ref"])
    assert head.pack_rows(found["ref"])
    for n in (1, 5, 17, 40):
        x = torch.randn(n, inn, generator=g)
        want = kernels.q8_0_rows_matmul_i8(found["ref"], x, head.q, head.dw)
        for name, lib in found.items():
            assert torch.equal(kernels.q8_0_rows_matmul_i8(lib, x, head.q, head.dw), want), \
                (name, n)


def test_the_kernel_taken_is_amx_where_granted_else_vnni_and_a_forced_one_wins(monkeypatch):
    """AMX's tiles need the CPU's flags and Linux's grant; refused, the VNNI kernel runs (the
    same bits), for the decoder's products and the head's alike; the "avx2" variant
    (`cpu-int8-avx2`) takes AVX-VNNI where the CPU has it, else AVX2; SPECCHAT_I8_KERNEL names
    another kernel this CPU runs."""
    flags = kernels.I8_KERNELS["amx"] | kernels._NEEDS["avx512"] | {"avx_vnni"}
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: flags)
    monkeypatch.delenv("SPECCHAT_I8_KERNEL", raising=False)
    for granted, want in ((True, "amx"), (False, "vnni")):
        monkeypatch.setattr(kernels, "amx_granted", lambda granted=granted: granted)
        names = kernels.symbols(wide=True, simd=True)
        assert kernels.i8_kernel() == want
        for name in ("nf4_matmul_i8", "decoder_forward_i8", "q8_0_rows_matmul_i8"):
            assert names[name] == f"{name}_{want}"
        assert kernels.symbols(wide=False, simd=True)["decoder_forward_i8"] == \
            "decoder_forward_i8_avxvnni"
    monkeypatch.setattr(kernels, "amx_granted", lambda: True)
    monkeypatch.setenv("SPECCHAT_I8_KERNEL", "avx2")
    names = kernels.symbols(wide=True, simd=True)
    assert names["nf4_matmul_i8"] == "nf4_matmul_i8_avx2"
    assert names["q8_0_rows_matmul_i8"] == "q8_0_rows_matmul_i8_avx2"
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: kernels._NEEDS["avx2"])
    monkeypatch.setenv("SPECCHAT_I8_KERNEL", "amx")  # not on this CPU: the best that runs
    assert kernels.i8_kernel() == kernels.i8_kernel(wide=False) == "avx2"
    assert kernels.symbols(wide=False, simd=True)["q8_0_rows_matmul_i8"] == \
        "q8_0_rows_matmul_i8_avx2"
    assert kernels.symbols(wide=False, simd=False)["q8_0_rows_matmul_i8"] == \
        "q8_0_rows_matmul_i8_ref"


def test_a_block_with_nan_inf_or_negative_zero_quantizes_alike_on_every_kernel():
    """The activations' block maxima (SIMD where the build has it, plain C in the portable
    build) skip a NaN and take an infinity the same way: every kernel the same bits, NaNs
    included."""
    found = _kernels()
    out, inn = 48, 128
    codes, absmax = _weight(out, inn, seed=3)
    packed, dw = kernels.nf4_i8_pack(found["ref"], codes, absmax, out, inn, 64)
    x = torch.randn(16, inn)
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    x[3, 70] = -float("inf")
    x[4, :32] = -0.0
    x[5, 96:] = 0.0
    x[6, 3] = float("nan")
    x[6, 4] = float("inf")
    want = kernels.nf4_matmul_i8(found["ref"], x, packed, dw, NF4, out, 64).view(torch.int32)
    for name, lib in found.items():
        got = kernels.nf4_matmul_i8(lib, x, packed, dw, NF4, out, 64).view(torch.int32)
        assert torch.equal(got, want), name
    rest = kernels.nf4_matmul_i8(found["ref"], x[7:], packed, dw, NF4, out, 64)
    assert torch.isfinite(rest).all()
