"""specchat's C kernels (`kernels/csrc`) against their plain-C references: the SIMD build's kernels
give the same bits as the references of both builds for 1 to 16 rows, and the portable build
(no instruction-set flags) loads, is row-exact and computes the products it documents."""

import copy
import ctypes
import os
import shutil

import pytest
import torch

from specchat import kernels

ROWS = range(1, 17)
NF4_TABLE = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                          -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                          0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                          0.33791524726104736, 0.44070982933044434, 0.5626170039154053,
                          0.7229568362236023, 1.0])


def _compiler() -> bool:
    return shutil.which(os.environ.get("CC", "gcc")) is not None


def _simd(variant: str = "avx2"):
    """`variant`'s SIMD kernels and the references that must match them: the SIMD build's own
    and the portable build's. Skips only where this CPU cannot run the variant or there is no
    compiler; where it can, the libraries must load."""
    if not kernels.runs_here(variant):
        pytest.skip(f"this CPU lacks the instructions of the {variant!r} kernels")
    if not _compiler():
        pytest.skip("no C compiler")
    lib = kernels.load(variant)
    refs = [kernels.reference(variant, portable=False), kernels.reference(variant)]
    assert lib is not None and lib.variant == variant and None not in refs
    assert [r.variant for r in refs] == ["ref", "ref"]
    assert lib.q8_width == refs[0].q8_width == refs[1].q8_width == (16 if variant == "avx512"
                                                                     else 8)
    assert refs[0].path == lib.path and refs[1].path != lib.path
    return lib, refs


def _portable():
    if not _compiler():
        pytest.skip("no C compiler")
    lib = kernels.load("ref")
    assert lib is not None and lib.variant == "ref" and lib.q8_width == 8
    wide = kernels.reference("avx512")
    assert wide is not None and wide.q8_width == 16 and wide.path == lib.path
    return lib, wide


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaNs included (torch.equal says a NaN differs from itself)."""
    a, b = a.contiguous(), b.contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


# ---- inputs ---------------------------------------------------------------------------------

def _nf4(out: int, inp: int, blocksize: int, g: torch.Generator):
    codes = torch.randint(0, 256, (out * inp // 2,), dtype=torch.uint8, generator=g)
    absmax = torch.rand(out * inp // blocksize, generator=g) * 0.2 + 0.01
    return codes, absmax


def _nf4_weight(codes, absmax, out, inp, blocksize) -> torch.Tensor:
    """The dequantized weight [out, in] in float64: the first code of a byte in its high nibble."""
    nibbles = torch.stack([codes >> 4, codes & 15], 1).reshape(out, inp).long()
    return (NF4_TABLE.double()[nibbles].reshape(-1, blocksize)
            * absmax.double()[:, None]).reshape(out, inp)


def _q8(out: int, inp: int, g: torch.Generator):
    q = torch.randint(-127, 128, (out, inp), dtype=torch.int8, generator=g)
    d = (torch.rand(out, inp // 32, generator=g) * 0.02 - 0.005).half()
    d[::7, 0] = torch.tensor(3e-6).half()  # fp16 subnormals
    d[3::11, -1] = torch.tensor(-6e-8).half()
    assert (d.float().abs() < 2 ** -14).any()
    return q, d


def _attention_inputs(dtype, dim: int, g: torch.Generator, rows: int = 16):
    """GQA (6 query heads on 2 key/value heads), batch 2 with a mask each, keys and values as
    views of a wider cache buffer, a causal mask with random holes (every row keeps a slot)."""
    batch, heads, kv_heads, slots = 2, 6, 2, 90
    buffer = torch.randn(batch, kv_heads, 128, dim, generator=g).to(dtype)
    key = buffer[:, :, :slots]
    value = (torch.randn(batch, kv_heads, 128, dim, generator=g) * 2).to(dtype)[:, :, :slots]
    query = torch.randn(batch, heads, rows, dim, generator=g)
    position = torch.arange(slots - rows, slots)[:, None]
    causal = torch.arange(slots)[None, :] <= position
    holes = torch.rand(batch, 1, rows, slots, generator=g) < 0.3
    mask = causal & ~holes
    mask[..., 0] = True
    return query, key, value, mask


# ---- the SIMD kernels give their references' bits ---------------------------------------------

@pytest.mark.parametrize("variant", ["avx2", "avx512"])
@pytest.mark.parametrize("out,inp,blocksize", [(43, 640, 64), (20, 256, 128), (7, 96, 32)])
def test_nf4_kernel_is_its_reference(out, inp, blocksize, variant):
    """8 wide (a block's sum scaled) and 16 wide (the scaled table looked up): each its own
    reference's bits at every row count, every tile shape and weight-row tail."""
    lib, refs = _simd(variant)
    g = torch.Generator().manual_seed(inp)
    codes, absmax = _nf4(out, inp, blocksize, g)
    x = torch.randn(16, inp, generator=g)
    for n in ROWS:
        got = kernels.nf4_matmul(lib, x[:n], codes, absmax, blocksize, NF4_TABLE, out)
        for ref in refs:
            want = kernels.nf4_matmul(ref, x[:n], codes, absmax, blocksize, NF4_TABLE, out)
            assert torch.equal(got, want), (ref.path.name, n)


def test_bf16_kernel_is_its_reference():
    lib, refs = _simd()
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(43, 136, generator=g).to(torch.bfloat16)  # tails of both tiles
    x = torch.randn(16, 136, generator=g)
    for n in ROWS:
        got = kernels.bf16_matmul(lib, x[:n], weight)
        for ref in refs:
            assert torch.equal(got, kernels.bf16_matmul(ref, x[:n], weight)), (ref.path.name, n)


@pytest.mark.parametrize("variant", ["avx2", "avx512"])
def test_q8_0_kernel_is_its_reference(variant):
    """8 wide against `q8_0_matmul_ref`, 16 wide (CPUs with AVX-512) against
    `q8_0_matmul16_ref`; 67 weight rows leave a tail of every tiling."""
    lib, refs = _simd(variant)
    g = torch.Generator().manual_seed(2)
    q, d = _q8(67, 160, g)
    x = torch.randn(16, 160, generator=g)
    for n in ROWS:
        got = kernels.q8_0_matmul(lib, x[:n], q, d)
        for ref in refs:
            assert torch.equal(got, kernels.q8_0_matmul(ref, x[:n], q, d)), (ref.path.name, n)


def test_q8_0_reference_widens_every_fp16_scale_as_f16c_does():
    """Each of the 65536 fp16 values as a block's scale, times 1 (and 0): the references'
    plain-C widening gives the SIMD kernel's bits (NaNs included) and torch's value."""
    lib, refs = _simd()
    d = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    q = torch.zeros(len(d), 32, dtype=torch.int8)
    q[:, 0] = 1
    x = torch.zeros(1, 32)
    x[0, 0] = 1
    got = kernels.q8_0_matmul(lib, x, q, d[:, None].contiguous())[0]
    for ref in refs:
        assert _same_bits(got, kernels.q8_0_matmul(ref, x, q, d[:, None].contiguous())[0])
    finite = d.isfinite() & (d != 0)  # a zero scale's -0 becomes +0 in the sum of lanes
    assert torch.equal(got[finite], d[finite].float())
    assert got[~d.isfinite()].isnan().all()  # infinity times the block's zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [72, 136])  # one partial group of 8 accumulators; two and a part
def test_attention_kernel_is_its_reference(dtype, dim):
    lib, refs = _simd()
    g = torch.Generator().manual_seed(dim)
    query, key, value, mask = _attention_inputs(dtype, dim, g, rows=40)
    # a verify's rows (the kernel splits their keys and values by slot and dimension) and a
    # prompt's (by group of rows): 3 query heads a key/value head, so up to 120 rows
    for n in (*ROWS, 24, 40):
        q, m = query[:, :, :n], mask[:, :, :n]
        got = kernels.attend(lib, q, key, value, m, 0.11)
        for ref in refs:
            assert torch.equal(got, kernels.attend(ref, q, key, value, m, 0.11)), (ref.path.name,
                                                                                   n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_is_its_reference(dtype):
    lib, refs = _simd()
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(16, 136, generator=g) * 3).to(dtype)
    w1 = torch.randn(136, generator=g) * 0.5 + 1
    for n in ROWS:
        got = kernels.rms_norm(lib, x[:n], w1, 1e-6)
        assert got.dtype == dtype
        for ref in refs:
            assert torch.equal(got, kernels.rms_norm(ref, x[:n], w1, 1e-6)), (ref.path.name, n)


# ---- the portable build --------------------------------------------------------------------

def test_the_portable_build_has_no_instruction_set_flags_and_only_the_references():
    flags = kernels.build_flags("ref")
    assert not any(f.startswith(("-mavx", "-march", "-mf16c", "-msse", "-mtune")) for f in flags)
    assert "-ffp-contract=off" in flags and "-ffp-contract=off" in kernels.build_flags("avx2")
    assert ("-mfma" in flags) == ("fma" in kernels._cpu_flags())  # x86 with FMA only
    assert "-mavx2" in kernels.build_flags("avx2") and "-mf16c" in kernels.build_flags("avx512")
    lib, _ = _portable()
    raw = ctypes.CDLL(str(lib.path))
    for name in ("nf4_matmul", "nf4_matmul_avx512", "bf16_matmul", "q8_0_matmul",
                 "q8_0_matmul_avx512", "attend", "rms_norm", "decoder_forward_avx512"):
        assert not hasattr(raw, name), name
        assert hasattr(raw, f"{name}_ref") or name.endswith("_avx512")
    for name in ("q8_0_matmul16_ref", "nf4_matmul16_ref", "decoder_forward16_ref"):
        assert hasattr(raw, name), name
    assert lib.max_in() == 16384


def _row_exact(product, x: torch.Tensor) -> torch.Tensor:
    """Each row alone, checked against every prefix of the rows; returns all rows' results."""
    alone = torch.cat([product(x[i:i + 1]) for i in range(len(x))])
    for n in range(2, len(x) + 1):
        assert torch.equal(product(x[:n]), alone[:n]), n
    return alone


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    assert (got.double() - want).abs().max() <= rel * want.abs().max()


@pytest.mark.parametrize("out,inp,blocksize", [(43, 640, 64), (9, 256, 128)])
def test_portable_nf4_is_row_exact_and_the_dequantized_product(out, inp, blocksize):
    lib, wide = _portable()
    g = torch.Generator().manual_seed(5)
    codes, absmax = _nf4(out, inp, blocksize, g)
    x = torch.randn(16, inp, generator=g)
    for ref in (lib, wide):  # 8 and 16 lanes
        got = _row_exact(lambda r: kernels.nf4_matmul(ref, r, codes, absmax, blocksize,
                                                      NF4_TABLE, out), x)
        _close(got, x.double() @ _nf4_weight(codes, absmax, out, inp, blocksize).T)


def test_portable_bf16_and_q8_0_are_row_exact_and_their_products():
    lib, wide = _portable()
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(43, 136, generator=g).to(torch.bfloat16)
    x = torch.randn(16, 136, generator=g)
    got = _row_exact(lambda r: kernels.bf16_matmul(lib, r, weight), x)
    _close(got, x.double() @ weight.double().T)

    q, d = _q8(67, 160, g)
    x = torch.randn(16, 160, generator=g)
    want = x.double() @ (q.double().view(67, -1, 32) * d.double()[..., None]).view(67, 160).T
    eight = _row_exact(lambda r: kernels.q8_0_matmul(lib, r, q, d), x)
    sixteen = _row_exact(lambda r: kernels.q8_0_matmul(wide, r, q, d), x)
    _close(eight, want)
    _close(sixteen, want)
    assert not torch.equal(eight, sixteen)  # two summation orders, really


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_attention_is_row_exact_and_attention(dtype):
    lib, _ = _portable()
    g = torch.Generator().manual_seed(7)
    query, key, value, mask = _attention_inputs(dtype, 72, g)
    got = kernels.attend(lib, query, key, value, mask, 0.11)
    for n in ROWS:
        assert torch.equal(kernels.attend(lib, query[:, :, :n], key, value, mask[:, :, :n], 0.11),
                           got[:, :, :n]), n
        alone = kernels.attend(lib, query[:, :, n - 1:n], key, value, mask[:, :, n - 1:n], 0.11)
        assert torch.equal(alone, got[:, :, n - 1:n]), n
    rep = query.shape[1] // key.shape[1]
    want = torch.nn.functional.scaled_dot_product_attention(
        query.double(), key.double().repeat_interleave(rep, 1),
        value.double().repeat_interleave(rep, 1), attn_mask=mask, scale=0.11)
    _close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_rms_norm_is_row_exact_and_the_norm(dtype):
    lib, _ = _portable()
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(16, 136, generator=g) * 3).to(dtype)
    w1 = torch.randn(136, generator=g) * 0.5 + 1
    got = _row_exact(lambda r: kernels.rms_norm(lib, r, w1, 1e-6), x)
    xd = x.double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w1.double()
    if dtype == torch.float32:
        _close(got, want)
    else:  # float32 arithmetic, then one rounding to bf16: within one bf16 step of the value
        assert ((got.double() - want).abs() <= 2 ** -7 * want.abs()).all()


# ---- choosing a variant --------------------------------------------------------------------

def test_the_default_variant_and_the_variants_this_cpu_cannot_run(monkeypatch):
    if not _compiler():
        pytest.skip("no C compiler")
    default = kernels.load.__wrapped__()
    if not kernels.runs_here("avx2"):
        assert default is None and kernels.load("avx2") is None
    else:
        wide = kernels.runs_here("avx512")
        assert default.variant == ("avx512" if wide and not os.environ.get("SPECCHAT_NO_AVX512")
                                   else "avx2")
        monkeypatch.setenv("SPECCHAT_NO_AVX512", "1")
        assert kernels.load.__wrapped__().variant == "avx2"
    if not kernels.runs_here("avx512"):
        assert kernels.load("avx512") is None
    monkeypatch.setenv("SPECCHAT_NO_KERNELS", "1")
    assert kernels.load.__wrapped__() is None
    assert kernels.load.__wrapped__("ref").variant == "ref"  # asked for by name
    with pytest.raises(ValueError):
        kernels.load("neon")


@pytest.mark.parametrize("variant", ["avx512", "avx2", "ref"])
def test_every_kernel_checks_its_sizes(variant):
    """No rows: nothing written (a sentinel stays); rows of a width a kernel cannot take: NaN,
    never a crash or a write past the output."""
    if variant == "ref":
        libs = [_portable()[0]]
    else:
        lib, refs = _simd(variant)
        libs = [lib, *refs]
    g = torch.Generator().manual_seed(0)
    (codes, absmax), table = _nf4(8, 64, 64, g), NF4_TABLE.float().contiguous()
    q, d = _q8(8, 64, g)
    weight = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=g)
    ptr, th = (lambda t: t.data_ptr()), 1
    products = {  # name -> call(x rows, n, in, y)
        "nf4": lambda lib, n, width, y: lib.nf4_matmul(ptr(x), n, width, ptr(codes), ptr(absmax),
                                                       64, ptr(table), ptr(y), 8, th),
        "bf16": lambda lib, n, width, y: lib.bf16_matmul(ptr(x), n, width, ptr(weight), ptr(y),
                                                         8, th),
        "q8_0": lambda lib, n, width, y: lib.q8_0_matmul(ptr(x), n, width, ptr(q), ptr(d),
                                                         ptr(y), 8, th),
        "q8_0_i8": lambda lib, n, width, y: lib.q8_0_matmul_i8(ptr(x), n, width, ptr(q), ptr(d),
                                                               ptr(y), 8, None, th),
    }
    for lib in libs:
        for name, call in products.items():
            y = torch.full((3, 8), 7.0)
            call(lib, 0, 64, y)  # no rows
            assert bool((y == 7.0).all()), (lib.variant, name)
            call(lib, 2, 36, y)  # 36 inputs: not a multiple of 8, 32 or NF4's block of 64
            assert bool(y[:2].isnan().all()) and bool((y[2] == 7.0).all()), (lib.variant, name)
        out = torch.full((2, 64), 7.0)
        mask = torch.ones(2, 4, dtype=torch.uint8)
        keys = torch.randn(4, 64, generator=g)
        lib.attend(ptr(x), 0, 64, ptr(keys), ptr(keys), 4, 64, 64, 0, ptr(mask), 2, 4, 0.125,
                   0.0, ptr(torch.empty(2, 4)), ptr(out), th)
        assert bool((out == 7.0).all())
        lib.attend(ptr(x), 2, 12, ptr(keys), ptr(keys), 4, 64, 64, 0, ptr(mask), 2, 4, 0.125,
                   0.0, ptr(torch.empty(2, 4)), ptr(out), th)  # a head dimension not 8's multiple
        assert bool(out.view(-1)[:24].isnan().all()) and bool((out.view(-1)[24:] == 7.0).all())
        norm = torch.full((2, 64), 7.0)
        w1 = torch.ones(64)
        lib.rms_norm(ptr(x), 0, 64, 0, ptr(w1), 1e-6, ptr(norm))
        assert bool((norm == 7.0).all())
        lib.rms_norm(ptr(x), 2, 12, 0, ptr(w1), 1e-6, ptr(norm))
        assert bool(norm.view(-1)[:24].isnan().all()) and bool((norm.view(-1)[24:] == 7.0).all())


@pytest.mark.parametrize("variant", ["avx512", "avx2", "ref"])
def test_embed_rows_gives_the_bits_of_each_kind_of_scaled_embedding(variant):
    """`embed_rows`: the rows of a table for some ids times a scale, in float32, as each kind
    of Gemma 3 embedding computes it: a float32 module, a bf16 table widened to float32 (the
    CPU paths' `_WideEmbedding`) and a bf16 module (its product rounded to bf16). Its bits,
    for ids anywhere in the table, repeated, in any order."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from specchat.runners.hf.cpu import _WideEmbedding

    libs = [_portable()[0]] if variant == "ref" else [_simd(variant)[0], *_simd(variant)[1]]
    embed = Gemma3TextScaledWordEmbedding(300, 72, 0, embed_scale=72 ** 0.5)
    torch.nn.init.normal_(embed.weight, std=3.0)
    ids = torch.tensor([0, 299, 5, 5, 123, 0, 77], dtype=torch.int64)
    wide = copy.deepcopy(embed).to(torch.bfloat16)  # (Module.to changes the module itself)
    with torch.no_grad():
        cases = [  # (kind, table, scale, the module's output)
            (0, embed.weight, float(embed.embed_scale), embed(ids)),
            (1, wide.weight, float(wide.embed_scale.float()),
             _WideEmbedding(wide, wide.weight)(ids)),
            (2, wide.weight, float(wide.embed_scale.to(torch.bfloat16)), wide(ids).float())]
    for lib in libs:
        for kind, table, scale, want in cases:
            got = torch.full((len(ids), 72), 7.0)
            lib.embed_rows(table.data_ptr(), kind, 72, ids.data_ptr(), len(ids), scale,
                           got.data_ptr())
            assert torch.equal(got.view(torch.int32), want.float().view(torch.int32)), \
                (lib.path.name, kind)


@pytest.mark.parametrize("variant", ["avx512", "avx2", "ref"])
def test_logits_cut_sets_the_unsampled_logits_and_mends_the_cut_blocks_maximum(variant):
    """`logits_cut`: logits from `upto` on -inf, the block maxima past it -inf, and the block
    `upto` cuts in two (where the product computed past it) the largest of its logits before
    `upto`: NaN where one of them is NaN."""
    libs = [_portable()[0]] if variant == "ref" else [_simd(variant)[0]]
    g = torch.Generator().manual_seed(1)
    out = 300
    blocks = kernels.head_blocks(out)
    for lib in libs:
        for upto, computed in ((130, 300), (128, 300), (130, 130), (0, 300), (299, 300)):
            y = torch.randn(3, out, generator=g)
            y[2, 129] = float("nan")
            want = y.clone()
            want[:, upto:] = -torch.inf
            want_max = torch.stack([want[:, b * 64:(b + 1) * 64].amax(-1)
                                    for b in range(blocks)], 1)
            maxima = torch.full((3, blocks), 7.0)
            if computed < out:  # what the product left: the cut block's maximum, its own
                maxima[:, upto // 64] = want_max[:, upto // 64]
            lib.logits_cut(y.data_ptr(), 3, out, upto, computed, maxima.data_ptr())
            assert torch.equal(y.view(torch.int32), want.view(torch.int32)), (upto, computed)
            tail = -(-upto // 64)
            assert bool((maxima[:, tail:] == -torch.inf).all()), (upto, computed)
            if upto % 64:
                got, exp = maxima[:, upto // 64], want_max[:, upto // 64]
                assert torch.equal(got.isnan(), exp.isnan()), (upto, computed)
                assert torch.equal(got.nan_to_num(0.0), exp.nan_to_num(0.0)), (upto, computed)
            assert bool((maxima[:, :upto // 64] == 7.0).all())  # blocks before: untouched
