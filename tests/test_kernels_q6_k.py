"""`q6_k_matmul_i8` (kernels/csrc/q6_k.c): an LM head of GGUF Q6_K rows, repacked 16 rows a
group at load, by integer dot products. `quantize_q6_k` writes what the gguf package reads
back; the packing loses nothing; every kernel (AVX-512 VNNI, AVX512BW, AVX-VNNI, AVX2, each
forced where this CPU runs it) gives the plain-C reference's bits (both builds) for 1 to 17
rows, row-exact and the same for any thread count; the product is the dequantized weight's
up to what the activations' quantization explains; and the head's contract for ids past
`upto` and for the block maxima holds."""

import os
import shutil

import numpy as np
import pytest
import torch

from specchat import kernels
from specchat.runners.cpu.q6_k_head import q6_k_values, quantize_q6_k, unpacked
from specchat.runners.cpu.q8_head import activation_error

SYMBOLS = {"vnni": "q6_k_matmul_i8_vnni", "avx512": "q6_k_matmul_i8_avx512",
           "avxvnni": "q6_k_matmul_i8_avxvnni", "avx2": "q6_k_matmul_i8_avx2"}


def _compiler() -> bool:
    return shutil.which(os.environ.get("CC", "gcc")) is not None


def _reference():
    if not _compiler():
        pytest.skip("no C compiler")
    lib = kernels.load("ref")
    assert lib is not None
    return lib


def _kernel(name: str):
    """The SIMD build with its Q6_K product bound to kernel `name`, where this CPU runs it."""
    if not _compiler():
        pytest.skip("no C compiler")
    if not kernels.Q6_K_KERNELS[name] <= kernels.cpu_flags():
        pytest.skip(f"this CPU lacks the instructions of the {name!r} Q6_K kernel")
    lib = kernels.load("avx2")
    assert lib is not None
    return kernels.with_function(lib, "q6_k_matmul_i8", SYMBOLS[name])


def _rows(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """Q6_K rows of N(0, 0.02) weights, some rows with a sub-block of zeros (scale 0)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.02
    w[::5, 16:32] = 0
    return quantize_q6_k(w)


def _inputs(n: int, inp: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inp, generator=g) * torch.logspace(-2, 2, n)[:, None]
    if n > 3:
        x[1, 32:64] = 0  # a zero block: dx = 0
        x[2, 7] = 300.0  # a block dominated by one value
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.contiguous(), b.contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_quantized_rows_are_what_the_gguf_package_reads_back():
    """`quantize_q6_k`'s bytes, dequantized by the gguf package, are `q6_k_values`' bits, and
    near the weights: half a level on average; at most one and a half (a value clipped at +31
    where its sub-block's peak took -32, under a scale rounded to int8)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 512, generator=g) * 0.02
    rows = quantize_q6_k(w)
    assert rows.shape == (48, 2 * 210) and rows.dtype == torch.uint8
    theirs = dequantize(rows.numpy(), GGMLQuantizationType.Q6_K).reshape(48, 512)
    assert np.array_equal(theirs, q6_k_values(rows).numpy())
    step = w.abs().view(48, -1, 16).amax(-1) / 32  # a sub-block's level, about
    error = (torch.from_numpy(theirs) - w).abs().view(48, -1, 16).amax(-1)
    assert bool((error <= step * 1.5).all()) and float((error / step).mean()) < 0.5


def test_packing_loses_nothing():
    """Any bytes (random codes, scales and d) come back from the packed rows, row by row."""
    lib = _reference()
    g = torch.Generator().manual_seed(2)
    for out in (64, 61):  # whole groups, and a last group of 13 rows
        rows = torch.randint(0, 256, (out, 3 * 210), dtype=torch.uint8, generator=g)
        packed = kernels.q6_k_pack(lib, rows)
        assert packed.shape == rows.shape and not torch.equal(packed, rows)
        assert torch.equal(unpacked(packed, torch.arange(out)), rows)
        assert torch.equal(unpacked(packed, torch.tensor([out - 1, 0, 17])), rows[[out - 1, 0, 17]])


@pytest.mark.parametrize("out,width", [(16, 211), (16, 0), (0, 210)])
def test_other_sizes_are_refused(out, width):
    lib = _reference()
    with pytest.raises(ValueError, match="whole superblocks"):
        kernels.q6_k_pack(lib, torch.zeros(out, width, dtype=torch.uint8))


@pytest.mark.parametrize("name", list(SYMBOLS))
@pytest.mark.parametrize("out,inp", [(16, 256), (77, 512), (208, 2048)])
def test_each_kernel_gives_the_references_bits(name, out, inp):
    """For 1 to 17 rows (every tile height and a split into tiles), alone and together."""
    lib, ref = _kernel(name), _reference()
    packed = kernels.q6_k_pack(ref, _rows(out, inp))
    x = _inputs(17, inp)
    want = kernels.q6_k_matmul_i8(ref, x, packed)
    assert _same_bits(want, torch.cat([kernels.q6_k_matmul_i8(ref, r[None], packed) for r in x]))
    for n in range(1, 18):
        assert _same_bits(kernels.q6_k_matmul_i8(lib, x[:n], packed), want[:n]), n
    portable_simd = kernels.reference("avx2", portable=False)
    if portable_simd is not None:  # the SIMD build's reference: the same bits as the portable one
        assert _same_bits(kernels.q6_k_matmul_i8(portable_simd, x, packed), want)


@pytest.mark.parametrize("name", list(SYMBOLS))
def test_thread_count_changes_no_bits(name):
    lib = _kernel(name)
    packed = kernels.q6_k_pack(lib, _rows(208, 512))
    x = _inputs(9, 512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.q6_k_matmul_i8(lib, x, packed)
        torch.set_num_threads(max(2, before))
        assert _same_bits(kernels.q6_k_matmul_i8(lib, x, packed), one)
    finally:
        torch.set_num_threads(before)


def test_the_product_is_the_dequantized_weights_up_to_the_activations_rounding():
    """Against float64 products of the dequantized values: within the bound that rounding x
    to int8 per block of 32 explains (plus float32 sums), and not far inside it (no fudge)."""
    lib = _reference()
    rows = _rows(96, 1024)
    packed = kernels.q6_k_pack(lib, rows)
    values = q6_k_values(rows)
    x = _inputs(6, 1024)
    got = kernels.q6_k_matmul_i8(lib, x, packed).double()
    want = x.double() @ values.double().T
    bound = activation_error(x, values).double() + 1e-5 * want.abs().max(1, keepdim=True).values
    assert bool(((got - want).abs() <= bound).all())
    assert bool(((got - want).abs() > bound / 1000).any())  # the rounding shows: not float


def test_nan_and_infinity_spoil_only_their_rows():
    lib = _reference()
    packed = kernels.q6_k_pack(lib, _rows(32, 256))
    x = _inputs(4, 256)
    x[1, 3], x[2, 100] = float("nan"), float("inf")
    y = kernels.q6_k_matmul_i8(lib, x, packed)
    assert y[1].isnan().all() and y[2].isnan().all()
    assert y[0].isfinite().all() and y[3].isfinite().all()


@pytest.mark.parametrize("name", list(SYMBOLS) + ["ref"])
def test_ids_past_upto_are_minus_infinity_and_the_block_maxima_each_blocks_largest(name):
    lib = _reference() if name == "ref" else _kernel(name)
    out = 203  # a last group of 11 rows
    packed = kernels.q6_k_pack(lib, _rows(out, 512))
    x = _inputs(3, 512)
    full = kernels.q6_k_matmul_i8(lib, x, packed)
    for n, upto in ((1, 101), (1, 5), (3, 101), (1, out)):
        maxima = torch.empty(n, kernels.head_blocks(out))
        y = kernels.q6_k_matmul_i8(lib, x[:n], packed, upto, maxima)
        assert _same_bits(y[:, :upto], full[:n, :upto])
        assert bool((y[:, upto:] == -float("inf")).all())
        want = torch.nn.functional.pad(y, (0, kernels.head_blocks(out) * 64 - out),
                                       value=-float("inf")).view(n, -1, 64).amax(-1)
        assert torch.equal(maxima, want), (n, upto)


def test_each_variant_binds_the_fastest_kernel_this_cpu_runs():
    if not _compiler():
        pytest.skip("no C compiler")
    flags = kernels.cpu_flags()
    for wide, order in ((True, ("vnni", "avx512")), (False, ("avxvnni", "avx2"))):
        runs = [k for k in order if kernels.Q6_K_KERNELS[k] <= flags]
        if runs:
            assert kernels.q6_k_kernel(wide) == SYMBOLS[runs[0]]
            assert kernels.symbols(wide, simd=True)["q6_k_matmul_i8"] == SYMBOLS[runs[0]]
    assert kernels.symbols(True, simd=False)["q6_k_matmul_i8"] == "q6_k_matmul_i8_ref"
