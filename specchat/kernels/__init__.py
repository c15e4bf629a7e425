"""specchat's own CPU kernels (the C files in `csrc/`): products with weights kept compact (NF4
where bitsandbytes has no fused kernel, bf16, GGUF's Q8_0), the attention of a few query rows
over the KV cache, Gemma's RMSNorm, and a whole Gemma 3 decoder stack built from them (one call
a forward: `runners.cpu.runner`). Every kernel is row-exact: a row's result is the same
bits whatever the number of rows in the call.

The C files are compiled with the system's C compiler (`$CC`, else `gcc`) into specchat's cache,
once per build, and loaded with ctypes; their OpenMP loops run on torch's own OpenMP runtime,
whose library is already loaded. Two builds of the same files (`build_flags`):

- the SIMD build, for x86 CPUs with AVX2, FMA and F16C: the SIMD kernels, and beside each its
  plain-C reference (`<name>_ref`);
- the portable build, for any CPU: only the references.

`load(variant)` gives one variant's functions under the plain names: "avx512" (the SIMD build,
its NF4 and Q8_0 products 16 lanes wide, the decoder stack on them, the integer Q8_0 product by
AVX-512 VNNI where the CPU has it), "avx2" (the SIMD build, 8 wide) or "ref" (the portable
build, computing the bits "avx2" computes). `reference(variant)` gives the references of "avx2"
or "avx512". Where a variant cannot be built or run here, its `load` returns None and the
caller keeps its other path.

The integer paths' kernels (csrc/nf4_i8.c) all give their reference's bits, so the fastest
that runs here is bound (`i8_kernel`): for `cpu-int8` (the "avx512" variant) AMX-INT8 tiles
where the CPU has them and Linux grants them (`amx_granted`), else AVX-512 VNNI; for
`cpu-int8-avx2` (the "avx2" variant) AVX-VNNI's 256-bit VNNI where the CPU has it, else AVX2.
`SPECCHAT_I8_KERNEL` forces one, and `with_i8_kernel` binds one for a test or an A/B.
"""

from __future__ import annotations

import array
import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

CSRC = Path(__file__).with_name("csrc")
VARIANTS = ("avx512", "avx2", "ref")
SIMD_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared",
              "-fPIC"]
PORTABLE_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_NEEDS = {"avx2": frozenset({"avx2", "fma", "f16c"}),  # F16C: the Q8_0 head's fp16 scales
          "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                               "avx512dq"}),
          "ref": frozenset()}

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_ARGTYPES = {
    "nf4_matmul": [_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _int],
    "bf16_matmul": [_ptr, _i64, _i64, _ptr, _ptr, _i64, _int],
    "q8_0_matmul": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _int],
    "q8_0_matmul_i8": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _int],
    "attend": [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _int, _ptr, _i64, _i64,
               ctypes.c_float, ctypes.c_float, _ptr, _ptr, _int],
    "rms_norm": [_ptr, _i64, _i64, _int, _ptr, ctypes.c_float, _ptr],
    "decoder_forward": [_ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr,
                        _int],
    "shape_pick": [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, ctypes.c_float, ctypes.c_float,
                   ctypes.c_float, _i64, ctypes.c_double, ctypes.c_double, _i64, _int,
                   ctypes.c_float, ctypes.c_double, _ptr, _i64, _int],
    "embed_rows": [_ptr, _int, _i64, _ptr, _i64, ctypes.c_float, _ptr],
    "row_top": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _int],
    "row_evidence": [_ptr, _i64, _i64, ctypes.c_float, ctypes.c_double, _i64, _ptr, _ptr, _ptr,
                     _ptr, _int],
    "min_p_place": [_ptr, _i64, _ptr, ctypes.c_float, ctypes.c_double, ctypes.c_uint32,
                    ctypes.c_uint32, _ptr],
    "shape_reduced": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, ctypes.c_float, ctypes.c_float,
                      ctypes.c_float, _i64, ctypes.c_double, ctypes.c_double, _i64],
    # the integer NF4 product (csrc/nf4_i8.c), the decoder stack on it, and its packing
    "nf4_matmul_i8": [_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _int],
    "decoder_forward_i8": [_ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr,
                           _ptr, _int],
    "nf4_i8_pack": [_ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr],
    "nf4_i8_unpack": [_ptr, _i64, _i64, _ptr],
    "q8_0_i8_pack": [_ptr, _ptr, _i64, _i64, _ptr],
    "q8_0_rows_matmul_i8": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _int],
    "nf4_i8_packed_bytes": [_i64, _i64],
    "q6_k_pack": [_ptr, _i64, _i64, _ptr],
    "q6_k_matmul_i8": [_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _int],
    "logits_cut": [_ptr, _i64, _i64, _i64, _i64, _ptr],
    "logits_softcap": [_ptr, _i64, ctypes.c_float, _int],
    "logits_maxima": [_ptr, _i64, _i64, _ptr, _int],
    # a step of the draft head (csrc/head.c, `models.eagle.DraftHead`)
    "draft_head_forward": [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64,
                           _ptr, _int],
    # a greedy draft chain of it (csrc/head.c)
    "draft_head_chain": [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr,
                         _ptr, _ptr, _int],
}
# 0, or -1 out of memory; the others return nothing
_RESTYPES = {"decoder_forward": _int, "shape_pick": _int, "decoder_forward_i8": _int,
             "nf4_i8_pack": _int, "nf4_i8_unpack": _int, "nf4_i8_packed_bytes": _i64,
             "q8_0_i8_pack": _int, "q6_k_pack": _int,
             "draft_head_forward": _int, "draft_head_chain": _int, "row_top": ctypes.c_float,
             "row_evidence": ctypes.c_float, "shape_reduced": _int, "min_p_place": _i64}
# one function in both builds, no reference twin
_PLAIN = frozenset({"nf4_i8_pack", "nf4_i8_unpack", "nf4_i8_packed_bytes", "q8_0_i8_pack",
                    "q6_k_pack",
                    "draft_head_forward", "draft_head_chain", "shape_reduced",
                    "logits_softcap", "logits_maxima"})
# the integer NF4 kernels (csrc/nf4_i8.c), each with the CPU flags it needs; all give the bits
# of their reference, so the fastest one that runs here is taken (`i8_kernel`)
_VNNI = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"})
I8_KERNELS = {"amx": _VNNI | {"amx_tile", "amx_int8"}, "vnni": _VNNI,
              "avxvnni": _NEEDS["avx2"] | {"avx_vnni"}, "avx2": _NEEDS["avx2"],
              "ref": frozenset()}
# best first, for each SIMD variant's integer path
_I8_ORDER = {True: ("amx", "vnni", "avxvnni", "avx2"), False: ("avxvnni", "avx2")}


@dataclass(frozen=True, eq=False)
class Kernels:
    """One variant's kernels: ctypes functions under the plain names (the wrappers below call
    them), all from the shared library at `path`."""

    variant: str  # "avx512", "avx2" or "ref"
    q8_width: int  # lanes of q8_0_matmul's accumulators: 16 ("avx512" and its reference) or 8
    path: Path
    nf4_matmul: Callable[..., None]
    bf16_matmul: Callable[..., None]
    q8_0_matmul: Callable[..., None]
    # the Q8_0 product by integer dot products (x quantized to int8 per block of 32, as
    # llama.cpp does), `q8_width` lanes: the AVX2 kernel in "avx2", the AVX-512 one in
    # "avx512", else the reference of that width
    q8_0_matmul_i8: Callable[..., None]
    attend: Callable[..., None]
    rms_norm: Callable[..., None]
    # a Gemma 3 decoder stack for n rows in one call (csrc/decoder.c, `runners.cpu.runner`)
    decoder_forward: Callable[..., int]
    # the sampler's mask, penalties and pick over a forward's rows (csrc/sample.c, `shape_pick`)
    shape_pick: Callable[..., int]
    # an embedding table's rows for some ids, scaled (csrc/decoder.c, `embed_rows`)
    embed_rows: Callable[..., None]
    # a row's largest logits and its log-sum-exp (csrc/sample.c, `row_top`)
    row_top: Callable[..., float]
    # the same at a sampling temperature, with one token's probability there and under min-p
    # (csrc/sample.c, `row_evidence`): the inspector's evidence
    row_evidence: Callable[..., float]
    # the request's penalties on a row of a drafter's reduced vocabulary (csrc/sample.c)
    shape_reduced: Callable[..., int]
    # min-p's draw over a drafter's reduced vocabulary, keyed by token id (csrc/sample.c)
    min_p_place: Callable[..., int]
    # an LM head's logits past the sampled ids set to -inf, their block maxima mended
    logits_cut: Callable[..., None]
    logits_softcap: Callable[..., None]  # Gemma 2's final soft-cap, in place (csrc/q8_0.c)
    logits_maxima: Callable[..., None]  # the block maxima of logits computed without them
    # NF4 by integer dot products (csrc/nf4_i8.c), on weights packed by `nf4_i8_pack`, and the
    # decoder stack on it (the `cpu-int8` path): the fastest kernel this CPU runs (`i8_kernel`)
    nf4_matmul_i8: Callable[..., None]
    decoder_forward_i8: Callable[..., int]
    nf4_i8_pack: Callable[..., int]
    nf4_i8_unpack: Callable[..., int]
    nf4_i8_packed_bytes: Callable[..., int]
    # the Q8_0 LM head by the same arithmetic, repacked in place (`q8_0_i8_pack`): VNNI where
    # the CPU has it, else the reference (the same bits)
    q8_0_i8_pack: Callable[..., int]
    q8_0_rows_matmul_i8: Callable[..., None]
    # an LM head of GGUF Q6_K rows, repacked 16 rows a group (`q6_k_pack`), by integer dot
    # products (csrc/q6_k.c): VNNI where the CPU has it (AVX-512's, or AVX-VNNI's in "avx2"),
    # else vpmaddubsw, else the reference; all give the same bits
    q6_k_pack: Callable[..., int]
    q6_k_matmul_i8: Callable[..., None]
    # a step of the draft head on the Q8_0 product it is given, and a greedy chain of them
    # (csrc/head.c)
    draft_head_forward: Callable[..., int]
    draft_head_chain: Callable[..., int]
    max_in: Callable[[], int]  # the longest weight row (inputs) the products take
    # whether q8_0_rows_matmul_i8 is a VNNI kernel (AVX-512's, AVX-VNNI's) or the AMX one, which
    # read a draft head's rows repacked faster than its row-major product; else the AVX2 kernel
    # or the plain C reference
    rows_i8_vnni: bool = False


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's flags, read once: /proc/cpuinfo's `flags` line (x86) or `Features` (ARM);
    none where it cannot be read. The one reader of them (`models.runtime.cpu_kind` too)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _cpu_flags() -> frozenset[str]:
    """The x86 instruction sets the builds and kernels need: `cpu_flags` on x86, else none."""
    return cpu_flags() if platform.machine().lower() in ("x86_64", "amd64") else frozenset()


def runs_here(variant: str) -> bool:
    """Whether this CPU runs `variant`'s instructions ("ref": any CPU)."""
    return _NEEDS[_check(variant)] <= _cpu_flags()


def build_flags(variant: str) -> list[str]:
    """The compiler flags of `variant`'s build: the SIMD build's for "avx512" and "avx2"; for
    "ref", no instruction-set flags but `-mfma` on x86 CPUs with FMA (so that `fmaf` is one
    instruction; on aarch64 it is one anyway)."""
    if _check(variant) != "ref":
        return list(SIMD_FLAGS)
    return PORTABLE_FLAGS + (["-mfma"] if "fma" in _cpu_flags() else [])


@functools.cache
def load(variant: str | None = None) -> Kernels | None:
    """`variant`'s kernels, or None where they cannot run here. None: the default, "avx512"
    where the CPU has AVX-512 (unless SPECCHAT_NO_AVX512 is set), else "avx2"; and None where the
    CPU has neither or SPECCHAT_NO_KERNELS is set. The choice is fixed for the process, so every
    row count takes the same path."""
    if variant is None:
        if os.environ.get("SPECCHAT_NO_KERNELS"):
            return None
        variant = "avx512" if runs_here("avx512") and not os.environ.get("SPECCHAT_NO_AVX512") \
            else "avx2"
    if not runs_here(variant):
        return None
    if variant == "ref":
        return _load(portable=True, wide=False)
    return _load(portable=False, wide=variant == "avx512", simd=True)


@functools.cache
def reference(variant: str = "avx2", portable: bool = True) -> Kernels | None:
    """The plain-C references computing exactly what `variant` ("avx2" or "avx512") computes,
    as a Kernels of variant "ref" (q8_width 8 or 16): from the portable build (any CPU), or
    with portable=False the SIMD build's own `_ref` functions (CPUs with AVX2, FMA and F16C)."""
    if _check(variant) == "ref":
        raise ValueError('reference("avx2") is what load("ref") gives')
    if not runs_here("ref" if portable else "avx2"):
        return None
    return _load(portable=portable, wide=variant == "avx512")


def _check(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"unknown kernels variant {variant!r} (one of {', '.join(VARIANTS)})")
    return variant


def _load(portable: bool, wide: bool, simd: bool = False, path: Path | None = None
          ) -> Kernels | None:
    """Bind a build's functions (compiling it first if the cache has no copy): its SIMD kernels
    (`simd`) or its references. `path`: a library built elsewhere from the same sources' kind
    (`bench.kernels_ab` builds two), instead of the cached build."""
    path = path or _build(portable)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        _say(f"could not load specchat's {_what(portable)} ({path}): {e}", fallback=not portable)
        return None
    names = symbols(wide, simd)
    functions = {}
    for name, argtypes in _ARGTYPES.items():
        function = lib[names[name]]
        function.argtypes, function.restype = argtypes, _RESTYPES.get(name)
        functions[name] = function
    max_in = lib["max_in"]
    max_in.argtypes, max_in.restype = [], ctypes.c_int
    variant = ("avx512" if wide else "avx2") if simd else "ref"
    return Kernels(variant=variant, q8_width=16 if wide else 8, path=path, max_in=max_in,
                   rows_i8_vnni=names["q8_0_rows_matmul_i8"].endswith(
                       ("_vnni", "_avxvnni", "_amx")),
                   **functions)


def symbols(wide: bool, simd: bool) -> dict[str, str]:
    """The C function (csrc/specchat.h) behind each of `Kernels`' names: the SIMD kernel or
    its reference (`simd`), 16 lanes wide where there is such a twin (`wide`)."""
    names = {name: name if simd or name in _PLAIN else f"{name}_ref" for name in _ARGTYPES}
    # the integer products, the NF4 layers' and the Q8_0 head's, on one kernel
    for name in ("nf4_matmul_i8", "decoder_forward_i8", "q8_0_rows_matmul_i8"):
        names[name] = f"{name}_{i8_kernel(wide)}" if simd else f"{name}_ref"
    names["q6_k_matmul_i8"] = q6_k_kernel(wide) if simd else "q6_k_matmul_i8_ref"
    if wide:  # 16 lanes: the NF4 product (and the decoder stack on it), the Q8_0 products
        names["nf4_matmul"] = "nf4_matmul_avx512" if simd else "nf4_matmul16_ref"
        names["decoder_forward"] = "decoder_forward_avx512" if simd else "decoder_forward16_ref"
        names["q8_0_matmul"] = "q8_0_matmul_avx512" if simd else "q8_0_matmul16_ref"
        names["q8_0_matmul_i8"] = i8_avx512() if simd else "q8_0_matmul_i8_16_ref"
    return names


def i8_kernel(wide: bool = True) -> str:
    """The integer kernel a SIMD variant runs here. `wide` (the "avx512" variant, `cpu-int8`):
    "amx" (AMX-INT8 tiles) where the CPU has them and Linux grants them (`amx_granted`), else
    "vnni" (AVX-512 VNNI) where the CPU has it; else, and for the "avx2" variant
    (`cpu-int8-avx2`), "avxvnni" (VNNI on 256 bits) where the CPU has it, else "avx2".
    `SPECCHAT_I8_KERNEL` names another that runs here (all give the same bits)."""
    forced = os.environ.get("SPECCHAT_I8_KERNEL")
    if forced and forced in I8_KERNELS and forced != "ref" and i8_runs(forced):
        return forced
    return next(name for name in _I8_ORDER[wide] if i8_runs(name))


def with_function(lib: Kernels, field: str, symbol: str) -> Kernels:
    """`lib` with its function `field` bound to the C function `symbol` of the same library (a
    kernel variant forced, whatever this CPU would pick; tests and A/Bs)."""
    function = ctypes.CDLL(str(lib.path))[symbol]
    bound = getattr(lib, field)
    function.argtypes, function.restype = bound.argtypes, bound.restype
    return dataclasses.replace(lib, **{field: function})


def with_i8_kernel(lib: Kernels, name: str) -> Kernels:
    """`lib` (a SIMD build) with the integer kernel `name` (an I8_KERNELS key but "ref") in the
    NF4 product, the decoder stack on it and the Q8_0 head's product."""
    for field in ("nf4_matmul_i8", "decoder_forward_i8", "q8_0_rows_matmul_i8"):
        lib = with_function(lib, field, f"{field}_{name}")
    return dataclasses.replace(lib, rows_i8_vnni=name != "avx2")


def i8_runs(name: str) -> bool:
    """Whether the integer kernel `name` (an I8_KERNELS key) runs on this CPU."""
    return I8_KERNELS[name] <= _cpu_flags() and (name != "amx" or amx_granted())


@functools.cache
def amx_granted() -> bool:
    """Whether this process may use AMX's tiles: Linux hands their state only on request
    (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), once for every thread; without it
    the first tile instruction kills the process. False off Linux x86-64 or where refused (a
    kernel before 5.16, a sandbox that filters the call): the VNNI kernel runs instead."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1023), ctypes.c_long(18)) == 0
    except (OSError, AttributeError):
        return False


def i8_avx512() -> str:
    """The "avx512" variant's integer Q8_0 kernel: the VNNI one where the CPU has AVX512-VNNI,
    else the AVX512BW one. Both compute the same integers, so the same bits (csrc/q8_0.c)."""
    return "q8_0_matmul_i8_vnni" if "avx512_vnni" in _cpu_flags() else "q8_0_matmul_i8_avx512"


Q6_K_KERNELS = {"vnni": _VNNI, "avx512": _NEEDS["avx512"], "avxvnni": I8_KERNELS["avxvnni"],
                "avx2": _NEEDS["avx2"]}  # csrc/q6_k.c's, each with the CPU flags it needs


def q6_k_kernel(wide: bool = True) -> str:
    """The Q6_K head's kernel a SIMD variant binds here: `wide` ("avx512"), the AVX-512 VNNI one
    where the CPU has it, else the AVX512BW one; else the AVX-VNNI one, else the AVX2 one. Each
    pair computes the same integers, so the same bits."""
    order = ("vnni", "avx512") if wide else ("avxvnni", "avx2")
    return "q6_k_matmul_i8_" + next(k for k in order if Q6_K_KERNELS[k] <= _cpu_flags())


def _what(portable: bool) -> str:
    return "reference kernels" if portable else "AVX2 kernels"


def build_soon(variant: str) -> None:
    """Start compiling `variant`'s build in the background, if the cache lacks it: a first
    launch's compiler run takes seconds, which can pass while the model converts and loads. A
    later `load` of a variant of that build waits for this compile rather than starting its
    own."""
    if not runs_here(variant):
        return
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    portable = _check(variant) == "ref"
    lib_path = _library(portable)
    if compiler and not lib_path.exists():
        _compile_once(compiler, portable, lib_path)


def _library(portable: bool) -> Path:
    """Where the build's library lies in specchat's cache: its file name holds a hash of the
    sources and the flags, so a changed source or flag builds anew."""
    from specchat.paths import cache_dir

    flags = build_flags("ref" if portable else "avx2")
    digest = hashlib.sha256(" ".join(flags).encode())
    for file in sorted(CSRC.glob("*.[ch]")):
        digest.update(b"\0" + file.name.encode() + b"\0" + file.read_bytes())
    name = "cpu_kernels_ref" if portable else "cpu_kernels"
    return cache_dir() / "kernels" / f"{name}-{digest.hexdigest()[:12]}.so"


def _build(portable: bool) -> Path | None:
    """The build's library in specchat's cache, compiled there if missing, or None if it cannot
    be built."""
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if not compiler:
        _say(f"no C compiler ({os.environ.get('CC', 'gcc')}) to build specchat's "
             f"{_what(portable)}", fallback=not portable)
        return None
    lib_path = _library(portable)
    if lib_path.exists():
        return lib_path
    return _compile_once(compiler, portable, lib_path).result()


# The compiles in progress, and those that failed (not repeated, not said twice), by compiler
# and library: each runs on a thread of its own (`build_soon` does not wait for it), and every
# caller waits for the same one.
_compiles: dict[tuple[str, Path], Future] = {}
_compiles_lock = threading.Lock()


def _compile_once(compiler: str, portable: bool, lib_path: Path) -> Future:
    key = (compiler, lib_path)
    with _compiles_lock:
        job = _compiles.get(key)
        if job is None:
            job = _compiles[key] = Future()

            def run():
                try:
                    built = _compile(compiler, portable, lib_path)
                except Exception as e:  # noqa: BLE001 (handed to whoever waits, raised there)
                    job.set_exception(e)
                    return
                if built is not None:  # in the cache from now on
                    with _compiles_lock:
                        del _compiles[key]
                job.set_result(built)

            threading.Thread(target=run, name="specchat-kernels-build").start()
    return job


def _compile(compiler: str, portable: bool, lib_path: Path) -> Path | None:
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    partial = lib_path.with_suffix(f".{os.getpid()}.tmp")
    sources = [str(f) for f in sorted(CSRC.glob("*.c"))]
    try:
        subprocess.run([compiler, *build_flags("ref" if portable else "avx2"), "-o",
                        str(partial), *sources, "-lm"], check=True, capture_output=True,
                       timeout=300)
        partial.replace(lib_path)  # atomic: another process may be compiling too
    except (OSError, subprocess.SubprocessError) as e:
        partial.unlink(missing_ok=True)
        detail = getattr(e, "stderr", b"") or str(e).encode()
        _say(f"could not build specchat's {_what(portable)} with {compiler}: "
             f"{detail.decode(errors='replace').strip().splitlines()[0]}", fallback=not portable)
        return None
    return lib_path


def _say(why: str, fallback: bool = True) -> None:
    print(f"specchat: {why}" + ("; torch's and bitsandbytes' own paths run instead (slower; "
          "on a CPU without native bf16 the NF4 layers become float32 copies, more memory)"
          if fallback else ""), file=sys.stderr)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()


def nf4_matmul(lib: Kernels, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor,
               blocksize: int, table: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [..., in] @ W.T for W [out, in] in bitsandbytes' NF4 layout: `codes` its packed uint8
    weight, `absmax` one float32 scale per block (of a multiple of 32 codes), `table` the 16 NF4
    values."""
    rows = _rows(x)
    y = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    lib.nf4_matmul(rows.data_ptr(), rows.shape[0], rows.shape[1], codes.data_ptr(),
                   absmax.data_ptr(), blocksize, table.data_ptr(), y.data_ptr(), out_features,
                   torch.get_num_threads())
    return y.reshape(*x.shape[:-1], out_features)


def nf4_i8_pack(lib: Kernels, codes: torch.Tensor, absmax: torch.Tensor, out_features: int,
                in_features: int, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' NF4 codes and float32 block scales -> (packed codes, scales per NF4
    block) in the integer kernels' layout (csrc/nf4_i8.c): the same 4 bits a weight, and the
    checkpoint's one scale a block."""
    codes, absmax = codes.contiguous(), absmax.to(torch.float32).contiguous()
    packed = torch.empty(lib.nf4_i8_packed_bytes(out_features, in_features), dtype=torch.uint8)
    groups = -(-out_features // 16)
    dw = torch.empty(groups * (in_features // max(blocksize, 1)) * 16, dtype=torch.float32)
    if lib.nf4_i8_pack(codes.data_ptr(), absmax.data_ptr(), out_features, in_features,
                       blocksize, packed.data_ptr(), dw.data_ptr()):
        raise ValueError(f"the integer NF4 kernels take NF4 blocks of 32 times a power of two, "
                         f"and inputs in whole blocks; got {in_features} inputs, blocks of "
                         f"{blocksize}")
    return packed, dw


def nf4_i8_unpack(lib: Kernels, packed: torch.Tensor, out_features: int,
                  in_features: int) -> torch.Tensor:
    """bitsandbytes' NF4 codes [out * in / 2] back from `nf4_i8_pack`'s packed ones."""
    codes = torch.empty(out_features * in_features // 2, dtype=torch.uint8)
    if lib.nf4_i8_unpack(packed.data_ptr(), out_features, in_features, codes.data_ptr()):
        raise ValueError(f"no packed NF4 layer of {out_features} x {in_features}")
    return codes


def nf4_matmul_i8(lib: Kernels, x: torch.Tensor, packed: torch.Tensor, dw: torch.Tensor,
                  table: torch.Tensor, out_features: int, blocksize: int) -> torch.Tensor:
    """x [..., in] @ W.T by integer dot products, W packed by `nf4_i8_pack` from NF4 blocks of
    `blocksize`; `table` the 16 NF4 values."""
    rows, table = _rows(x), table.to(torch.float32).contiguous()
    y = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    lib.nf4_matmul_i8(rows.data_ptr(), rows.shape[0], rows.shape[1], packed.data_ptr(),
                      dw.data_ptr(), blocksize, table.data_ptr(), y.data_ptr(), out_features,
                      torch.get_num_threads())
    return y.reshape(*x.shape[:-1], out_features)


I8_ROWS = 16  # weight rows a group of `q8_0_i8_pack` holds (csrc/nf4_i8.c)


def q8_0_i8_pack(lib: Kernels, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8_0 values q int8 [out, in] (out a multiple of 16), repacked in place for
    `q8_0_rows_matmul_i8` (csrc/nf4_i8.c); returns the scales, float16 [groups, blocks, 16].
    Raises ValueError (q unchanged) for other sizes."""
    out, cols = q.shape
    dw = torch.empty(out * cols // 32, dtype=torch.float16)
    if not q.is_contiguous() or not d.is_contiguous() or d.dtype != torch.float16 \
            or lib.q8_0_i8_pack(q.data_ptr(), d.data_ptr(), out, cols, dw.data_ptr()):
        raise ValueError(f"the integer head takes contiguous Q8_0 rows in groups of 16 and "
                         f"inputs in blocks of 32; got {out} x {cols}")
    return dw


def q8_0_rows_matmul_i8(lib: Kernels, x: torch.Tensor, packed: torch.Tensor,
                        dw: torch.Tensor, upto: int | None = None,
                        maxima: torch.Tensor | None = None) -> torch.Tensor:
    """`q8_0_matmul_i8` for a head repacked by `q8_0_i8_pack`: the NF4 integer kernels'
    arithmetic (one epilogue per block, in order), the same contract for `upto` and
    `maxima`."""
    return _head_product(lib, lib.q8_0_rows_matmul_i8, x, packed, dw, upto, maxima)


def bf16_matmul(lib: Kernels, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight.T in float32, for a contiguous bf16 weight [out, in]."""
    rows = _rows(x)
    y = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
    lib.bf16_matmul(rows.data_ptr(), rows.shape[0], rows.shape[1], weight.data_ptr(),
                    y.data_ptr(), weight.shape[0], torch.get_num_threads())
    return y.reshape(*x.shape[:-1], weight.shape[0])


def q8_0_matmul(lib: Kernels, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor,
                avx512: bool | None = None) -> torch.Tensor:
    """x [..., in] @ W.T in float32 for W = q * d: `q` int8 [out, in], `d` float16
    [out, in / 32], one scale per 32 values (GGUF's Q8_0), `lib.q8_width` lanes wide.
    `avx512` (for older callers): True or False asks for 16 or 8 lanes, from `lib` where it has
    that width, else from the "avx512" or "avx2" variant."""
    if avx512 is not None and avx512 != (lib.q8_width == 16):
        lib = load("avx512" if avx512 else "avx2")
        if lib is None:
            raise RuntimeError(f"no {'16' if avx512 else '8'}-wide Q8_0 kernel on this CPU")
    rows = _rows(x)
    y = torch.empty(rows.shape[0], q.shape[0], dtype=torch.float32)
    lib.q8_0_matmul(rows.data_ptr(), rows.shape[0], rows.shape[1], q.data_ptr(), d.data_ptr(),
                    y.data_ptr(), q.shape[0], torch.get_num_threads())
    return y.reshape(*x.shape[:-1], q.shape[0])


HEAD_BLOCK = 64  # outputs per block maximum (csrc/common.h, `block_maxima`)


def head_blocks(out: int) -> int:
    """How many block maxima a row of `out` logits has."""
    return -(-out // HEAD_BLOCK)


def q8_0_matmul_i8(lib: Kernels, x: torch.Tensor, q: torch.Tensor,
                   d: torch.Tensor, upto: int | None = None,
                   maxima: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W.T in float32 for W = q * d (GGUF's Q8_0, as `q8_0_matmul` takes it) by
    integer dot products: each row of x quantized to int8 per block of 32 (llama.cpp's Q8_0
    activations, the scale kept in float32), int32 sums of 4 products per lane, scaled per block
    into `lib.q8_width` float lanes (csrc/q8_0.c). Other bits than `q8_0_matmul`, row-exact as
    it is. `upto`: the outputs from `upto` on are -inf instead (outputs nobody reads: an LM
    head's ids that are never sampled); for one row of x they are not computed at all, and the
    others are the same bits either way. `maxima`: a float32 tensor [rows, head_blocks(out)]
    that receives each row's block maxima (the largest of each HEAD_BLOCK outputs, NaN where a
    block holds one), for `shape_pick`."""
    return _head_product(lib, lib.q8_0_matmul_i8, x, q, d, upto, maxima)


def _check_maxima(maxima: torch.Tensor | None, rows: int, out: int) -> None:
    """ValueError unless `maxima` is None or a contiguous float32 [rows, head_blocks(out)]."""
    if maxima is not None and (maxima.shape != (rows, head_blocks(out))
                               or maxima.dtype != torch.float32 or not maxima.is_contiguous()):
        raise ValueError(f"maxima must be contiguous float32 [{rows}, {head_blocks(out)}]")


def _head_product(lib: Kernels, function, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor,
                  upto: int | None, maxima: torch.Tensor | None) -> torch.Tensor:
    """An integer LM-head product (`q8_0_matmul_i8`'s contract) through `function`, which
    takes (x, rows, in, values, scales, y, outputs computed, maxima, threads)."""
    # (an LM head's rows come contiguous float32: no reshape or copy, each a torch call)
    rows = x if x.dim() == 2 and x.dtype is torch.float32 and x.is_contiguous() else _rows(x)
    out = q.shape[0]
    y = torch.empty(rows.shape[0], out, dtype=torch.float32)
    computed = out if upto is None or rows.shape[0] != 1 else max(0, min(upto, out))
    _check_maxima(maxima, rows.shape[0], out)
    function(rows.data_ptr(), rows.shape[0], rows.shape[1], q.data_ptr(), d.data_ptr(),
             y.data_ptr(), computed, maxima.data_ptr() if maxima is not None else None,
             torch.get_num_threads())
    if upto is not None and upto < out:  # (one call, not a few torch calls a step)
        lib.logits_cut(y.data_ptr(), rows.shape[0], out, upto, computed,
                       maxima.data_ptr() if maxima is not None else None)
    return y.reshape(*x.shape[:-1], out)


Q6_K_SUPER, Q6_K_BYTES = 256, 210  # values of a Q6_K superblock, and its bytes


def q6_k_pack(lib: Kernels, rows: torch.Tensor) -> torch.Tensor:
    """A GGUF Q6_K tensor's rows (uint8 [out, in / 256 * 210]) repacked 16 rows a group for
    `q6_k_matmul_i8` (csrc/q6_k.c): the same bytes in another order, the last group filled
    out with zero rows past `out`. Returns [out, in / 256 * 210], a view of the whole groups.
    Raises ValueError for other sizes."""
    out, width = rows.shape
    packed = torch.empty(-(-out // 16) * 16, width, dtype=torch.uint8)
    if rows.dtype != torch.uint8 or not rows.is_contiguous() or width % Q6_K_BYTES \
            or lib.q6_k_pack(rows.data_ptr(), out, width // Q6_K_BYTES * Q6_K_SUPER,
                             packed.data_ptr()):
        raise ValueError(f"the Q6_K head takes contiguous rows of whole superblocks of "
                         f"{Q6_K_SUPER} values ({Q6_K_BYTES} bytes); got {out} rows of "
                         f"{width} bytes")
    return packed[:out]


def q6_k_matmul_i8(lib: Kernels, x: torch.Tensor, packed: torch.Tensor,
                   upto: int | None = None, maxima: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W.T in float32 for W a GGUF Q6_K tensor repacked by `q6_k_pack`, by
    integer dot products, x quantized to int8 per block of 32 as for `q8_0_matmul_i8`, whose
    contract for `upto` and `maxima` it keeps (csrc/q6_k.c). Row-exact."""
    function = lib.q6_k_matmul_i8  # (its scales lie among its bytes: no pointer of their own)
    return _head_product(lib, lambda x, n, cols, w, _, y, out, m, t: function(x, n, cols, w, y,
                                                                               out, m, t),
                         x, packed, packed, upto, maxima)


def nf4_head_matmul_i8(lib: Kernels, x: torch.Tensor, packed: torch.Tensor, dw: torch.Tensor,
                       table: torch.Tensor, blocksize: int, upto: int | None = None,
                       maxima: torch.Tensor | None = None) -> torch.Tensor:
    """An LM head in NF4 (a draft model's, `runners.cpu.nf4_head`): `nf4_matmul_i8` over every
    output (`packed` [out, in / 2], `nf4_i8_pack`'s bytes), with `q8_0_matmul_i8`'s contract for
    `upto` and `maxima`, the maxima taken after the product (`logits_maxima`). Row-exact."""
    out = packed.shape[0]
    y = nf4_matmul_i8(lib, x, packed, dw, table, out, blocksize)
    flat = y.view(-1, out)
    _check_maxima(maxima, flat.shape[0], out)
    if maxima is not None:
        lib.logits_maxima(flat.data_ptr(), flat.shape[0], out, maxima.data_ptr(),
                          torch.get_num_threads())
    if upto is not None and upto < out:
        lib.logits_cut(flat.data_ptr(), flat.shape[0], out, upto, out,
                       maxima.data_ptr() if maxima is not None else None)
    return y


def attend(lib: Kernels, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           mask: torch.Tensor, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """softmax(scale * query @ key.T, over the slots `mask` allows) @ value, in float32; with
    `softcap` > 0 the scores soft-capped first, softcap tanh(score / softcap) (Gemma 2's).

    query [B, H, Q, D]; key, value [B, KV, S, D], float32 or bf16, each row contiguous (views
    of a cache buffer are fine); mask bool [B or 1, 1, Q, >= S], True where a query row may
    attend. H must be a multiple of KV (grouped-query heads), D of 8. Returns [B, H, Q, D]."""
    batch, heads, rows, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * rows, dim).to(torch.float32).contiguous()
    out = torch.empty_like(q)
    scores = torch.empty(groups * rows, slots, dtype=torch.float32)
    mask = mask.view(torch.uint8)
    bf16 = key.dtype == torch.bfloat16
    es = key.element_size()
    threads = torch.get_num_threads()
    for b in range(batch):
        m = mask[b if mask.shape[0] > 1 else 0, 0]
        for h in range(kv_heads):
            lib.attend(q[b, h].data_ptr(), groups * rows, dim,
                       key.data_ptr() + (b * key.stride(0) + h * key.stride(1)) * es,
                       value.data_ptr() + (b * value.stride(0) + h * value.stride(1)) * es,
                       slots, key.stride(2), value.stride(2), int(bf16), m.data_ptr(), rows,
                       m.stride(0), scale, softcap, scores.data_ptr(), out[b, h].data_ptr(),
                       threads)
    return out.reshape(batch, heads, rows, dim)


def softcap_logits(lib: Kernels, logits: torch.Tensor, cap: float) -> torch.Tensor:
    """A contiguous float32 CPU tensor soft-capped in place, cap tanh(value / cap), each value
    alone (so a row's bits never depend on the rows beside it); -inf stays -inf. Returns it."""
    if logits.dtype != torch.float32 or not logits.is_contiguous() or logits.device.type != "cpu":
        raise ValueError("softcap_logits takes a contiguous float32 CPU tensor")
    lib.logits_softcap(logits.data_ptr(), logits.numel(), cap, torch.get_num_threads())
    return logits


def rms_norm(lib: Kernels, x: torch.Tensor, w1: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm of x [..., dim] (float32 or bf16): x * rsqrt(mean(x^2) + eps) * w1, in
    float32, returned in x's dtype. `w1` float32 [dim]: 1 + the norm's weight."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(rows)
    lib.rms_norm(rows.data_ptr(), rows.shape[0], rows.shape[1],
                 int(rows.dtype == torch.bfloat16), w1.data_ptr(), eps, y.data_ptr())
    return y.reshape(x.shape)


TOP_MAX = 16  # the most values `row_top` returns


def row_top(lib: Kernels, row: torch.Tensor, n: int) -> tuple[list[int], list[float], float]:
    """One contiguous float32 CPU row [width] -> (the ids of its n largest values, largest first
    and the first id among equal ones, never NaN or -inf; those values; log(sum e^row)), in one
    native call (csrc/sample.c): the log-sum-exp by specchat's own exp, within a few float32
    ulps of torch's, in about a tenth of the time of torch's topk and logsumexp on a
    262,144-token row."""
    if row.dtype is not torch.float32 or row.dim() != 1 or not row.is_contiguous() \
            or row.device.type != "cpu":
        raise ValueError("row_top takes one contiguous float32 CPU row")
    if not 0 <= n <= TOP_MAX:
        raise ValueError(f"row_top returns at most {TOP_MAX} values")
    ids, values, found = (ctypes.c_int64 * TOP_MAX)(), (ctypes.c_float * TOP_MAX)(), _i64()
    lse = lib.row_top(row.data_ptr(), row.shape[0], n, ids, values, ctypes.byref(found),
                      torch.get_num_threads())
    return list(ids[:found.value]), list(values[:found.value]), lse


def row_evidence(lib: Kernels, row: torch.Tensor, n: int, temperature: float, min_p: float,
                 also: int | None) -> tuple[list[int], list[float], float, float | None,
                                            float | None]:
    """`row_top` of one row as sampling at `temperature` sees it (row / temperature, torch's
    float32 division; 1: the row itself): (ids, scaled values, log-sum-exp, and of token
    `also` its probability at that temperature and among min-p's candidates (`min_p` 0: the
    same; 0 outside them), None without `also`), in one native call (csrc/sample.c)."""
    if row.dtype is not torch.float32 or row.dim() != 1 or not row.is_contiguous() \
            or row.device.type != "cpu":
        raise ValueError("row_evidence takes one contiguous float32 CPU row")
    if not 0 <= n <= TOP_MAX:
        raise ValueError(f"row_evidence returns at most {TOP_MAX} values")
    if not temperature > 0 or not 0 <= min_p <= 1:
        raise ValueError(f"row_evidence: temperature {temperature} must be > 0 and min_p "
                         f"{min_p} in [0, 1]")
    ids, values, found = (ctypes.c_int64 * TOP_MAX)(), (ctypes.c_float * TOP_MAX)(), _i64()
    p_also = (ctypes.c_double * 2)()
    lse = lib.row_evidence(row.data_ptr(), row.shape[0], n, temperature, min_p,
                           -1 if also is None else also, ids, values, ctypes.byref(found),
                           p_also, torch.get_num_threads())
    p_at, p_kept = (None, None) if also is None else (p_also[0], p_also[1])
    return list(ids[:found.value]), list(values[:found.value]), lse, p_at, p_kept


def min_p_place(lib: Kernels, row: torch.Tensor, ids: torch.Tensor, temperature: float,
                min_p: float, keys: tuple[int, int]) -> tuple[int, float] | None:
    """min-p's draw over a drafter's reduced vocabulary (csrc/sample.c): row [width] a
    contiguous float32 CPU row whose place j holds token ids[j] (int64), `keys` the position's
    two noise keys (`Noise.keys`). -> (the winner's place, its probability among the
    candidates), or None where the row holds no finite logit: the bits of
    `sampling.min_p_place`."""
    if row.dtype is not torch.float32 or row.dim() != 1 or not row.is_contiguous() \
            or row.device.type != "cpu" or ids.dtype is not torch.int64 \
            or not ids.is_contiguous() or ids.shape[0] < row.shape[0]:
        raise ValueError("min_p_place takes a contiguous float32 CPU row and an int64 id a place")
    if not 0 < min_p <= 1:
        raise ValueError(f"min_p_place draws with 0 < min_p <= 1, not {min_p}")
    prob = ctypes.c_double()
    place = lib.min_p_place(row.data_ptr(), row.shape[0], ids.data_ptr(),
                            max(temperature, 1e-5), min_p, keys[0], keys[1], ctypes.byref(prob))
    return None if place < 0 else (place, prob.value)


def shape_reduced(lib: Kernels, row: torch.Tensor, places: torch.Tensor, seq: torch.Tensor,
                  breaks: torch.Tensor, penalties) -> None:
    """In place on one contiguous float32 CPU row of a drafter's reduced vocabulary (token t
    at row[places[t]], -1 where the row lacks t): the penalties (a `core.penalties.Penalties`)
    for the prefix `seq` (int64), `breaks` (uint8: whether each token's text holds a DRY
    breaker). The bits of `Shaper.shape_row(row, seq, places)` (csrc/sample.c)."""
    if row.dtype is not torch.float32 or row.dim() != 1 or not row.is_contiguous() \
            or places.dtype is not torch.int64 or not places.is_contiguous() \
            or seq.dtype is not torch.int64 or not seq.is_contiguous() \
            or breaks.dtype is not torch.uint8 or not breaks.is_contiguous() \
            or breaks.shape[0] < seq.shape[0]:
        raise ValueError("shape_reduced takes a contiguous float32 row, int64 places and "
                         "tokens, and a uint8 breaker flag a token")
    pen = penalties
    done = lib.shape_reduced(row.data_ptr(), row.shape[0], places.data_ptr(), places.shape[0],
                             seq.data_ptr(), breaks.data_ptr(), seq.shape[0],
                             pen.repeat_penalty, pen.frequency_penalty, pen.presence_penalty,
                             pen.repeat_last_n, pen.dry_multiplier, pen.dry_base,
                             pen.dry_allowed_length)
    if done != 0:
        raise MemoryError("out of memory in the draft's penalties")


PICK_NONE, PICK_GREEDY, PICK_MIN_P = 0, 1, 2  # shape_pick's modes


def shape_pick(lib: Kernels, logits: torch.Tensor, runs: list[tuple[int, int]],
               seq: torch.Tensor, breaks: torch.Tensor, lengths: list[int], penalties=None,
               mode: int = PICK_NONE, temperature: float = 1.0, min_p: float = 0.0,
               keys: list[tuple[int, int]] | None = None,
               maxima: torch.Tensor | None = None) -> list[int]:
    """In place on float32 CPU logits [rows, width]: each row's ids in `runs` ([start, end)
    pairs) set to -inf, then the penalties (a `core.penalties.Penalties`, None: off) for row r's
    prefix seq[:lengths[r]] (`seq` int64 and `breaks` uint8 contiguous tensors: the tokens and
    whether each one's text holds a DRY breaker), then each row's pick: its argmax
    (PICK_GREEDY) or min-p's draw at `temperature` with the row's keys (PICK_MIN_P). The bits
    of `Shaper.shape_`, `sampling.argmax` and `sampling.min_p_draw` (csrc/sample.c).
    `maxima`: the LM head's block maxima of these very logits (`q8_0_matmul_i8`), from which
    the picks read only the blocks they need; the same picks without them. -> the picks (none
    for PICK_NONE).

    It runs right after a forward, when every object it touches is out of the CPU's caches:
    hence torch tensors (data_ptr) rather than numpy arrays (.ctypes) and one `array` of the
    small arguments."""
    rows, width = logits.shape
    if logits.dtype is not torch.float32 or not logits.is_contiguous() or len(lengths) != rows:
        raise ValueError("shape_pick takes contiguous float32 logits [rows, width] and a "
                         "prefix length per row")
    if not isinstance(seq, torch.Tensor) or seq.dtype is not torch.int64 \
            or not isinstance(breaks, torch.Tensor) or breaks.dtype is not torch.uint8 \
            or not seq.is_contiguous() or not breaks.is_contiguous():
        raise ValueError("shape_pick takes contiguous int64 tokens and uint8 breaker flags")
    if max(lengths) > seq.shape[0] or breaks.shape[0] < seq.shape[0]:
        raise ValueError("a row's prefix is longer than the tokens given")
    if maxima is not None and (maxima.dtype != torch.float32 or not maxima.is_contiguous()
                               or maxima.shape[0] != rows
                               or maxima.shape[1] < head_blocks(width)):
        raise ValueError(f"maxima must be contiguous float32 [{rows}, >= {head_blocks(width)}]")
    # One int64 buffer for the small arguments: runs, lengths, keys, then room for the picks.
    args = array.array("q", [x for run in runs for x in run])
    args.extend(lengths)
    args.extend([x for pair in keys for x in pair] if keys else [0] * (2 * rows))
    args.extend([0] * rows)
    pen = penalties
    if pen is None:
        repeat, frequency, presence, last_n, dry_m, dry_b, dry_a = 1.0, 0.0, 0.0, 0, 0.0, 1.0, 0
    else:
        repeat, frequency, presence = pen.repeat_penalty, pen.frequency_penalty, \
            pen.presence_penalty
        last_n, dry_m, dry_b, dry_a = pen.repeat_last_n, pen.dry_multiplier, pen.dry_base, \
            pen.dry_allowed_length
    done = lib.shape_pick(logits.data_ptr(), rows, width, args.buffer_info()[0], len(runs),
                          seq.data_ptr(), breaks.data_ptr(), repeat, frequency, presence,
                          last_n, dry_m, dry_b, dry_a, mode, max(temperature, 1e-5), min_p,
                          maxima.data_ptr() if maxima is not None else None,
                          maxima.shape[1] if maxima is not None else 0, torch.get_num_threads())
    if done != 0:
        raise MemoryError("out of memory in the sampler")
    return args[len(args) - rows:].tolist() if mode != PICK_NONE else []
