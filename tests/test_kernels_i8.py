"""`q8_0_matmul_i8` (kernels/csrc/q8_0.c): the Q8_0 product by integer dot products, x quantized
to int8 per block of 32 as llama.cpp quantizes activations. The AVX2 kernel gives its plain-C
reference's bits (both builds) for 1 to 16 rows and every tile's tail, and so do the AVX-512
kernels of 16 lanes (AVX512BW and VNNI, each where the CPU runs it); each is row-exact and the same
for any thread count, handles weight bytes of -128 exactly, and is the float64 product up to
what the activations' quantization explains (bounded below, not fudged)."""

import ctypes
import itertools
import os
import shutil

import pytest
import torch

from specchat import kernels

ROWS = range(1, 17)
U = 2.0 ** -24  # float32's unit roundoff


def _compiler() -> bool:
    return shutil.which(os.environ.get("CC", "gcc")) is not None


def _simd(width: int = 8):
    """The SIMD kernels of `width` lanes and every reference that must give their bits. 8: the
    AVX2 kernel, against the SIMD build's reference and the portable build's (two builds). 16:
    the "avx512" variant's kernel and, beside it, both of its ways to the integers (AVX512BW and
    VNNI, each where this CPU runs it), against the references of 16 lanes."""
    variant = "avx2" if width == 8 else "avx512"
    if not kernels.runs_here(variant):
        pytest.skip(f"this CPU lacks the instructions of the {variant!r} kernels")
    if not _compiler():
        pytest.skip("no C compiler")
    lib = kernels.load(variant)
    refs = [kernels.reference(variant, portable=False), kernels.reference(variant)]
    if width == 8:
        refs.append(kernels.load("ref"))
    assert lib is not None and None not in refs and lib.q8_width == width
    assert {r.variant for r in refs} == {"ref"} and {r.q8_width for r in refs} == {width}
    assert refs[0].path == lib.path and refs[1].path != lib.path
    if width == 16:
        refs += _avx512_kernels(lib)
    return lib, refs


def _avx512_kernels(lib):
    """Both AVX-512 integer kernels as Kernels, each where this CPU runs it."""
    import dataclasses

    raw = ctypes.CDLL(str(lib.path))
    names = ["q8_0_matmul_i8_avx512"] + (["q8_0_matmul_i8_vnni"]
                                        if "avx512_vnni" in kernels._cpu_flags() else [])
    out = []
    for name in names:
        function = raw[name]
        function.argtypes, function.restype = lib.q8_0_matmul_i8.argtypes, None
        out.append(dataclasses.replace(lib, q8_0_matmul_i8=function))
    return out


def _portable():
    if not _compiler():
        pytest.skip("no C compiler")
    lib = kernels.load("ref")
    assert lib is not None and lib.variant == "ref"
    return lib


def _portable16():
    """The portable build's reference of the 16-lane kernel."""
    if not _compiler():
        pytest.skip("no C compiler")
    lib = kernels.reference("avx512")
    assert lib is not None and lib.q8_width == 16 and lib.path == kernels.load("ref").path
    return lib


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaNs included."""
    a, b = a.contiguous(), b.contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _weights(out: int, inp: int, g: torch.Generator):
    """int8 weights with some bytes of -128, fp16 scales of both signs, some subnormal."""
    q = torch.randint(-127, 128, (out, inp), dtype=torch.int8, generator=g)
    q[1::5, ::3] = -128
    d = (torch.rand(out, inp // 32, generator=g) * 0.02 - 0.005).half()
    d[::7, 0] = torch.tensor(3e-6).half()  # fp16 subnormals
    d[3::11, -1] = torch.tensor(-6e-8).half()
    return q, d


def _inputs(inp: int, g: torch.Generator, special: bool = True) -> torch.Tensor:
    """16 rows of several magnitudes; with `special`, blocks the quantization treats apart."""
    x = torch.randn(16, inp, generator=g) * torch.logspace(-3, 3, 16)[:, None]
    x[1, 32:64] = 0  # a zero block: dx = 0, id = 0
    x[2] *= 1e30  # large values
    x[3, 5] = 4e4  # a block dominated by one value (the others round to few levels)
    x[4, :32] = torch.arange(32) - 15.5  # halves ...
    x[4, 31] = 127  # ... with dx = 1, id = 1: ties, rounded to even
    x[5, 32:64] *= 1e-36 / x[5, 32:64].abs().max()  # amax 1e-36: dx subnormal, 1 / dx finite
    if special:
        x[6, :32] *= 1e-42  # 1 / dx overflows: id = 0, the block's qx are 0
        x[7, 40] = float("inf")  # row 7's outputs: NaN
        x[8, 0] = float("nan")  # row 8's too
        x[9] = 0  # every block zero: y = 0
    return x


# ---- the AVX2 kernel gives its references' bits -----------------------------------------------

@pytest.mark.parametrize("width", [8, 16])
@pytest.mark.parametrize("out,inp", [(67, 160), (67, 320), (131, 256), (9, 96)])
def test_i8_kernel_is_its_reference(out, inp, width):
    """Blocks per row: 5 and 3 (the block factors one at a time), 10 (8 at a time, the last 8
    overlapping), 8 (exactly); 5 and 3 leave the 16-lane kernels an odd last block. 67 and 131
    weight rows leave a tail of every tiling (blocks of 64 rows; AVX2 tiles of 1 weight row x up
    to 8 input rows, 16 lanes tiles of 1 or 2 rows x up to 8); 9 are fewer than a block."""
    lib, refs = _simd(width)
    g = torch.Generator().manual_seed(out * inp)
    q, d = _weights(out, inp, g)
    x = _inputs(inp, g)
    for n in ROWS:
        got = kernels.q8_0_matmul_i8(lib, x[:n], q, d)
        for ref in refs:
            assert _same_bits(got, kernels.q8_0_matmul_i8(ref, x[:n], q, d)), (ref.path.name, n)


@pytest.mark.parametrize("width", [8, 16])
def test_i8_kernel_is_its_reference_in_many_tiles(width):
    """17 to 25 rows: three tiles of input rows (6, 6, 5 ... 9, 8, 8) and four (7, 6, 6, 6)."""
    lib, refs = _simd(width)
    g = torch.Generator().manual_seed(7)
    q, d = _weights(67, 160, g)
    x = torch.cat([_inputs(160, g), _inputs(160, g, special=False)])
    for n in (17, 23, 24, 25):
        got = kernels.q8_0_matmul_i8(lib, x[:n], q, d)
        for ref in refs:
            assert _same_bits(got, kernels.q8_0_matmul_i8(ref, x[:n], q, d)), (ref.path.name, n)


@pytest.mark.parametrize("width", [8, 16])
def test_i8_special_blocks(width):
    """A non-finite value makes its row's outputs NaN (and nothing else); a block whose 1 / dx
    overflows counts 0; a zero row gives zeros; no rows, no outputs."""
    lib, refs = _simd(width)
    g = torch.Generator().manual_seed(3)
    q, d = _weights(67, 160, g)
    x = _inputs(160, g)
    only_tiny = torch.zeros(1, 160)
    only_tiny[0, 64:96] = torch.randn(32, generator=g) * 1e-42
    for k in [lib, *refs]:
        y = kernels.q8_0_matmul_i8(k, x, q, d)
        assert y[7].isnan().all() and y[8].isnan().all()
        assert not y[torch.arange(16) < 7].isnan().any() and not y[9:].isnan().any()
        assert _same_bits(y[9], torch.zeros(67))
        assert _same_bits(kernels.q8_0_matmul_i8(k, only_tiny, q, d), torch.zeros(1, 67))
        without = x[6:7].clone()
        without[0, :32] = 0  # the tiny block dropped
        assert _same_bits(y[6:7], kernels.q8_0_matmul_i8(k, without, q, d))
        assert kernels.q8_0_matmul_i8(k, x[:0], q, d).shape == (0, 67)


# ---- row-exact, any thread count ------------------------------------------------------------

def _row_exact(product, x: torch.Tensor) -> torch.Tensor:
    """Each row alone, against every prefix of the rows and the rows reversed."""
    alone = torch.cat([product(x[i:i + 1]) for i in range(len(x))])
    for n in range(2, len(x) + 1):
        assert _same_bits(product(x[:n]), alone[:n]), n
    assert _same_bits(product(x.flip(0)).flip(0), alone)
    return alone


@pytest.mark.parametrize("which", ["simd", "avx512", "portable", "portable16"])
def test_i8_is_row_exact(which):
    libs = {"simd": lambda: [_simd()[0]], "avx512": lambda: [_simd(16)[0], *_simd(16)[1][2:]],
            "portable": lambda: [_portable()], "portable16": lambda: [_portable16()]}[which]()
    g = torch.Generator().manual_seed(4)
    q, d = _weights(67, 320, g)
    x = _inputs(320, g)
    for lib in libs:
        _row_exact(lambda r: kernels.q8_0_matmul_i8(lib, r, q, d), x)


def _call(function, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor,
          threads: int) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty(x.shape[0], q.shape[0])
    function(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), d.data_ptr(), y.data_ptr(),
             q.shape[0], None, threads)
    return y


@pytest.mark.parametrize("which", ["simd", "portable"])
def test_i8_outputs_nobody_reads_come_out_minus_infinity_and_the_rest_unchanged(which):
    """`upto`: an LM head's ids that are never sampled. One row computes only the outputs
    before `upto` (the kernel takes them as a shorter weight), more rows compute all; either
    way those outputs keep their bits and the rest are -inf."""
    lib = _simd()[0] if which == "simd" else _portable()
    g = torch.Generator().manual_seed(6)
    q, d = _weights(131, 256, g)
    x = _inputs(256, g, special=False)
    for n in (1, 3):
        full = kernels.q8_0_matmul_i8(lib, x[:n], q, d)
        for upto in (0, 1, 64, 130, 131, 200):
            got = kernels.q8_0_matmul_i8(lib, x[:n], q, d, upto)
            assert got.shape == full.shape
            assert _same_bits(got[:, :upto], full[:, :upto]), (n, upto)
            assert bool((got[:, upto:] == -torch.inf).all()), (n, upto)


@pytest.mark.parametrize("width", [8, 16])
def test_i8_block_maxima_are_each_blocks_largest_logit(width):
    """The head's block maxima (`maxima`, for the sampler): the largest of each 64 outputs of
    each row, NaN where a block holds one; with `upto`, the -inf past it counted. Every kernel
    and reference of the width, 1 to 9 rows, and a last block of 5 outputs."""
    lib, refs = _simd(width)
    g = torch.Generator().manual_seed(7)
    q, d = _weights(261, 256, g)
    x = _inputs(256, g, special=False)
    for k in (lib, *refs):
        for n, upto in itertools.product((1, 2, 9), (None, 0, 64, 100, 261)):
            maxima = torch.empty(n, kernels.head_blocks(261))
            y = kernels.q8_0_matmul_i8(k, x[:n], q, d, upto, maxima)
            padded = torch.full((n, 320), -torch.inf)
            padded[:, :261] = y
            want = padded.view(n, 5, 64).amax(-1)
            assert _same_bits(maxima, want), (k.path.name, k.variant, n, upto)
        poisoned = d.clone()
        poisoned[70, 0] = torch.nan  # a NaN scale: output 70 is NaN, and block 1's maximum
        maxima = torch.empty(2, kernels.head_blocks(261))
        kernels.q8_0_matmul_i8(k, x[:2], q, poisoned, None, maxima)
        assert bool(maxima[:, 1].isnan().all()) and not bool(maxima[:, [0, 2, 3, 4]].isnan().any())


@pytest.mark.parametrize("width", [8, 16])
def test_i8_thread_count_changes_no_bits(width):
    lib, refs = _simd(width)
    g = torch.Generator().manual_seed(5)
    q, d = _weights(261, 256, g)  # 4 blocks of 64 weight rows and a row
    x = _inputs(256, g)
    for function in (lib.q8_0_matmul_i8, refs[1].q8_0_matmul_i8,
                     *[k.q8_0_matmul_i8 for k in refs[2:] if width == 16]):
        for n in (1, 2, 5, 11, 16):
            one = _call(function, x[:n], q, d, 1)
            for threads in (2, 3, 5):
                assert _same_bits(_call(function, x[:n], q, d, threads), one), (n, threads)


# ---- what it computes -----------------------------------------------------------------------

def _quantize(x: torch.Tensor):
    """llama.cpp's Q8_0 activation quantization as the kernels do it, in float32: qx [n, nb, 32]
    (integers) and dx [n, nb], for finite x."""
    blocks = x.reshape(x.shape[0], -1, 32)
    dx = blocks.abs().amax(-1) / 127
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    inv = torch.where(inv.isfinite(), inv, torch.zeros_like(dx))
    return torch.round(blocks * inv[..., None]), dx  # round: to nearest, ties to even


@pytest.mark.parametrize("which", ["simd", "avx512", "portable", "portable16"])
def test_i8_is_the_product_up_to_the_quantization_of_x(which):
    """Two bounds, each derived, not fitted:

    1. the kernel's floats against the exact product of the quantized activations
       y_q[j, o] = sum_b dw * dx_b * s_b (s_b the exact integer dot product of block b):
       each term s * f with f = fl(dw * dx) (one rounding), through a chain of nb fused
       multiply-adds per lane and 3 additions of lanes, so |y - y_q| <= (nb + 4) u T / (1 -
       (nb + 4) u), T = sum_b |dw dx_b| sum_l |s_bl| (u = 2^-24; no subnormals here);
    2. the quantization: qx = round(fl(x * id)), id = fl(1 / dx), so
       |qx dx - x| <= dx |qx - fl(x id)| + dx |fl(x id) - x id| + |x| |id dx - 1|
                   <= dx / 2 + 2 u |x| (1 + u), and |y_q - x @ W^T| <= sum_k |w_k| (that).
    The sum of the two bounds the distance to the float64 product."""
    lib = {"simd": lambda: _simd()[0], "avx512": lambda: _simd(16)[0],
           "portable": _portable, "portable16": _portable16}[which]()
    g = torch.Generator().manual_seed(6)
    out, inp = 67, 320
    q, d = _weights(out, inp, g)
    x = _inputs(inp, g, special=False)
    x[5] = torch.randn(inp, generator=g)  # subnormal scales have a bound of their own
    y = kernels.q8_0_matmul_i8(lib, x, q, d).double()

    nb = inp // 32
    qx, dx = _quantize(x)
    qx, dx = qx.double(), dx.double()
    dw = d.double()  # [out, nb]
    qb = q.double().view(out, nb, 32)
    s = torch.einsum("oblk,jblk->jobl", qb.view(out, nb, 8, 4), qx.view(-1, nb, 8, 4))  # exact
    factor = dw[None] * dx[:, None]  # [n, out, nb]
    y_q = (s.sum(-1) * factor).sum(-1)
    terms = (s.abs() * factor.abs()[..., None]).sum((-1, -2))
    k = (nb + 4) * U
    assert ((y - y_q).abs() <= k / (1 - k) * terms).all()

    w = (qb * dw[..., None]).view(out, inp)
    exact = x.double() @ w.T
    per_value = dx[..., None].expand(-1, -1, 32).reshape(x.shape) / 2 \
        + 2 * U * (1 + U) * x.double().abs()
    assert ((qx.view(x.shape) * dx.repeat_interleave(32, -1) - x.double()).abs()
            <= per_value).all()
    quantization = per_value @ w.abs().T
    assert ((y_q - exact).abs() <= quantization).all()
    assert ((y - exact).abs() <= quantization + k / (1 - k) * terms).all()
    # and the bound says something: within it, but not far within it everywhere
    assert ((y - exact).abs() / quantization).max() > 0.05


def test_i8_weight_bytes_of_minus_128_are_exact():
    """|q| = 128 as an unsigned byte, qx signed by q: the largest pair, -128 * -127 twice, is
    32512 < 32767 (no saturation); VNNI's unsigned bytes qx + 128 go up to 255, its sums
    are int32. With d = 1 and integer x holding +-127 in every block (dx = 1, id = 1, qx = x),
    every sum is an integer below 2^24: y is the exact product."""
    lib, refs = _simd()
    if kernels.runs_here("avx512"):
        wide, wide_refs = _simd(16)
        refs = refs + [wide, *wide_refs]
    g = torch.Generator().manual_seed(7)
    out, inp = 13, 256
    q = torch.randint(-128, 128, (out, inp), dtype=torch.int8, generator=g)
    q[0] = -128
    q[1, ::2] = -128
    q[2, 1::2] = 127
    d = torch.ones(out, inp // 32, dtype=torch.float16)
    x = torch.randint(-127, 128, (6, inp), generator=g).float()
    x[:, ::32] = 127 * torch.where(torch.rand(6, inp // 32, generator=g) < 0.5, 1, -1)
    x[0] = -127  # against q[0]: every pair is 128 * 127 * 2
    x[1] = torch.tensor([127.0, -127.0]).repeat(inp // 2)
    want = (x.long() @ q.long().T).float()
    assert want[0, 0] == 128 * 127 * inp
    for k in [lib, *refs]:
        assert torch.equal(kernels.q8_0_matmul_i8(k, x, q, d), want), k.path.name


def test_i8_binds_the_kernel_of_each_variant():
    """The AVX2 kernel in "avx2", the AVX-512 one in "avx512" (by VNNI where the CPU has it),
    the reference elsewhere; the portable build has only the references."""
    if not _compiler():
        pytest.skip("no C compiler")
    raw = ctypes.CDLL(str(_portable().path))
    assert not hasattr(raw, "q8_0_matmul_i8") and hasattr(raw, "q8_0_matmul_i8_ref")
    assert not hasattr(raw, "q8_0_matmul_i8_vnni") and hasattr(raw, "q8_0_matmul_i8_16_ref")
    if kernels.runs_here("avx2"):
        lib = kernels.load("avx2")
        assert lib.q8_0_matmul_i8.__name__ == "q8_0_matmul_i8"
        assert kernels.reference("avx2", portable=False).q8_0_matmul_i8.__name__ == \
            "q8_0_matmul_i8_ref"
        assert kernels.reference("avx512").q8_0_matmul_i8.__name__ == "q8_0_matmul_i8_16_ref"
    if kernels.runs_here("avx512"):
        vnni = "avx512_vnni" in kernels._cpu_flags()
        assert kernels.load("avx512").q8_0_matmul_i8.__name__ == \
            ("q8_0_matmul_i8_vnni" if vnni else "q8_0_matmul_i8_avx512")
    assert kernels.load("ref").q8_0_matmul_i8.__name__ == "q8_0_matmul_i8_ref"


def test_i8_widths_are_two_summation_orders():
    """8 lanes over every block in turn, against 16 lanes taking blocks in pairs: two orders of
    the same float sums (so a process keeps one for every row count), within rounding of each
    other, and really different."""
    eight, sixteen = _portable(), _portable16()
    g = torch.Generator().manual_seed(8)
    q, d = _weights(67, 320, g)
    x = _inputs(320, g, special=False)
    a, b = kernels.q8_0_matmul_i8(eight, x, q, d), kernels.q8_0_matmul_i8(sixteen, x, q, d)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(a.abs().max()))
    assert not torch.equal(a, b)
