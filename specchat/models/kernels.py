"""specchat's own CPU kernels (`kernels.c`) for x86 CPUs with AVX2 and FMA: products with
weights kept compact (NF4 where bitsandbytes has no fused kernel, bf16, GGUF's Q8_0), and the
attention of a few query rows over the KV cache.

The C file is compiled once with the system's C compiler (`$CC`, else `gcc`) into specchat's
cache and loaded with ctypes; its OpenMP loops run on torch's own OpenMP runtime, whose library
is already loaded. Where it cannot be built (no compiler, another CPU), `load()` returns None
and the caller keeps its other path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]


@functools.cache
def _cpu_flags() -> frozenset[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def _cpu_runs_kernels() -> bool:
    """AVX2 and FMA for the arithmetic, F16C for the Q8_0 head's fp16 scales."""
    return {"avx2", "fma", "f16c"} <= _cpu_flags()


def uses_avx512() -> bool:
    """Whether the Q8_0 head runs 16 wide (`q8_0_matmul_avx512`): on CPUs with AVX-512, unless
    SPECCHAT_NO_AVX512 is set. Fixed for the process, so every row count takes the same path."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= _cpu_flags() \
        and not os.environ.get("SPECCHAT_NO_AVX512")


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot run here."""
    if not _cpu_runs_kernels() or os.environ.get("SPECCHAT_NO_KERNELS"):
        return None
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if not compiler:
        _say(f"no C compiler ({os.environ.get('CC', 'gcc')}) to build specchat's AVX2 kernels")
        return None
    from specchat.paths import cache_dir

    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:12]
    lib_path = cache_dir() / "kernels" / f"cpu_kernels-{tag}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        partial = lib_path.with_suffix(f".{os.getpid()}.tmp")
        try:
            subprocess.run([compiler, *FLAGS, "-o", str(partial), str(SOURCE), "-lm"], check=True,
                           capture_output=True, timeout=120)
            partial.replace(lib_path)  # atomic: another process may be compiling too
        except (OSError, subprocess.SubprocessError) as e:
            partial.unlink(missing_ok=True)
            detail = getattr(e, "stderr", b"") or str(e).encode()
            _say(f"could not build specchat's AVX2 kernels with {compiler}: "
                 f"{detail.decode(errors='replace').strip().splitlines()[0]}")
            return None
    try:
        lib = ctypes.CDLL(str(lib_path))
    except OSError as e:
        _say(f"could not load specchat's AVX2 kernels ({lib_path}): {e}")
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.nf4_matmul.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i64, ctypes.c_int]
    lib.bf16_matmul.argtypes = [ptr, i64, i64, ptr, ptr, i64, ctypes.c_int]
    lib.q8_0_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ctypes.c_int]
    lib.q8_0_matmul_avx512.argtypes = lib.q8_0_matmul.argtypes
    lib.q8_0_matmul_avx512.restype = None
    lib.attend.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ctypes.c_int, ptr, i64, i64,
                           ctypes.c_float, ptr, ptr, ctypes.c_int]
    lib.rms_norm.argtypes = [ptr, i64, i64, ctypes.c_int, ptr, ctypes.c_float, ptr]
    lib.nf4_matmul.restype = lib.bf16_matmul.restype = lib.q8_0_matmul.restype = None
    lib.attend.restype = lib.rms_norm.restype = None
    lib.max_in.restype = ctypes.c_int
    return lib


def _say(why: str) -> None:
    print(f"specchat: {why}; torch's and bitsandbytes' own paths run instead (slower; "
          "on a CPU without native bf16 the NF4 layers become float32 copies, more memory)",
          file=sys.stderr)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()


def nf4_matmul(lib, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor,
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


def bf16_matmul(lib, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight.T in float32, for a contiguous bf16 weight [out, in]."""
    rows = _rows(x)
    y = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
    lib.bf16_matmul(rows.data_ptr(), rows.shape[0], rows.shape[1], weight.data_ptr(),
                    y.data_ptr(), weight.shape[0], torch.get_num_threads())
    return y.reshape(*x.shape[:-1], weight.shape[0])


def q8_0_matmul(lib, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor,
                avx512: bool | None = None) -> torch.Tensor:
    """x [..., in] @ W.T in float32 for W = q * d: `q` int8 [out, in], `d` float16
    [out, in / 32], one scale per 32 values (GGUF's Q8_0). `avx512`: the 16-wide kernel
    (default: `uses_avx512()`)."""
    rows = _rows(x)
    y = torch.empty(rows.shape[0], q.shape[0], dtype=torch.float32)
    wide = uses_avx512() if avx512 is None else avx512
    (lib.q8_0_matmul_avx512 if wide else lib.q8_0_matmul)(rows.data_ptr(), rows.shape[0], rows.shape[1], q.data_ptr(), d.data_ptr(),
                    y.data_ptr(), q.shape[0], torch.get_num_threads())
    return y.reshape(*x.shape[:-1], q.shape[0])


def attend(lib, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           mask: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * query @ key.T, over the slots `mask` allows) @ value, in float32.

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
                       m.stride(0), scale, scores.data_ptr(), out[b, h].data_ptr(), threads)
    return out.reshape(batch, heads, rows, dim)


def rms_norm(lib, x: torch.Tensor, w1: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm of x [..., dim] (float32 or bf16): x * rsqrt(mean(x^2) + eps) * w1, in
    float32, returned in x's dtype. `w1` float32 [dim]: 1 + the norm's weight."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(rows)
    lib.rms_norm(rows.data_ptr(), rows.shape[0], rows.shape[1],
                 int(rows.dtype == torch.bfloat16), w1.data_ptr(), eps, y.data_ptr())
    return y.reshape(x.shape)
