"""The NF4 kernel's machine code, read without a GPU.

Triton compiles `kernels._nf4_matmul_kernel` for a GPU architecture on any machine (no driver:
`GPUTarget("cuda", arch, 32)`), and the `nvdisasm` its wheel ships turns the cubin into SASS.
This counts, in the K loop (the loop that holds the matrix multiplies), what decides whether a
step decodes in registers or goes through shared memory: barriers (`BAR.SYNC`), shared stores
(`STS`) and loads (`LDS`, `LDSM`), and global loads by width (into registers, `LDG`, or into
shared memory by the pipeline's async copies, `LDGSTS`); and, for the kernel, registers (the
highest register named) and shared memory. It compiles the kernel as the JIT specializes it at
the runtime's launches: pointers 16-byte aligned, integers multiples of 16.

    python -m specchat.runners.cuda.sweep --compile-only --arch 90 [--json FILE]
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

SASS_LOOP_OPS = ("BAR.SYNC", "STS", "LDS", "LDSM")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*?\((\.L_x_\d+)\)")
_MMA = re.compile(r"\b(HMMA|WGMMA|HGMMA)\b")
_LDG = re.compile(r"\bLDG(?:STS)?((?:\.\w+)*)")  # loads from global memory, and async copies
_WIDTH = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def compile_kernel(fn, signature: dict, constants: dict, arch: int = 90, warps: int = 4,
                   stages: int = 3):
    """A Triton kernel compiled for `arch` as the JIT specializes the runtime's launches of it:
    every pointer 16-byte aligned and every integer a multiple of 16 (16 rows; the columns and
    strides of the models' shapes), which is what lets loads of contiguous bytes be wide.
    `signature`: the runtime arguments' types by name; `constants`: the constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{name: "constexpr" for name in constants}}
    aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
               for name, kind in signature.items() if kind.startswith("*") or kind == "i32"}
    source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(name),): value
                                                  for name, value in constants.items()},
                       attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "num_stages": stages})


def compile_nf4(config, k: int, arch: int = 90, has_bias: bool = False):
    """The NF4 kernel for an [n, k] weight under `config` (`kernels.NF4Config`), as the runtime
    launches it on a GPU (bf16 activations, the decode width's row tile, the live rows read
    from a device scalar), compiled for `arch`: Triton's compiled kernel (its
    `asm["cubin"]`, `metadata.shared`)."""
    from specchat.runners.cuda import kernels

    signature = {"x_ptr": "*bf16", "w_ptr": "*u8", "absmax_ptr": "*fp32", "table_ptr": "*i32",
                 "bias_ptr": "*bf16", "out_ptr": "*bf16", "partial_ptr": "*fp32",
                 "rows_ptr": "*i32", "M": "i32", "N": "i32", "stride_om": "i32",
                 "stride_a": "i32"}
    constants = {"K": k, "HAS_BIAS": has_bias, "BLOCK_M": kernels.ROWS,
                 "BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "SPLIT": config.split,
                 "DECODE": config.decode, "UPCAST": 0, "LIVE": True}
    return compile_kernel(kernels._nf4_matmul_kernel, signature, constants, arch,
                          config.warps, config.stages)


def compile_consumers(arch: int = 90) -> list:
    """The kernels that add a split product's planes (`kernels.Planes`), compiled for `arch`
    as an 8B Llama's layer launches them: RMS norm with planes as its add and as its input,
    RoPE-and-store with q|k|v's planes (with a bias, and with Gemma's q and k norms)."""
    from specchat.runners.cuda import kernels

    norm = {"x_ptr": "*bf16", "add_ptr": "*fp32", "w_ptr": "*bf16", "out_ptr": "*bf16",
            "bias_ptr": "*bf16", "M": "i32", "D": "i32", "eps": "fp32", "offset": "fp32"}
    rope = {"qkv_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i32",
            "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "qn_ptr": "*bf16",
            "kn_ptr": "*bf16", "bias_ptr": "*bf16", "M": "i32", "S": "i32", "eps": "fp32",
            "offset": "fp32"}
    shape = {"BLOCK_M": 2, "BLOCK_D": 4096}
    heads = {"HQ": 32, "HKV": 8, "D": 128, "BLOCK_M": 1, "BLOCK_H": 64}
    return [
        compile_kernel(kernels._rms_norm_kernel, norm, {
            "HAS_ADD": True, "CAST_FIRST": True, **shape, "X_PARTS": 0, "ADD_PARTS": 4,
            "HAS_BIAS": False}, arch, warps=8),
        compile_kernel(kernels._rms_norm_kernel, {**norm, "x_ptr": "*fp32"}, {
            "HAS_ADD": False, "CAST_FIRST": False, **shape, "X_PARTS": 4, "ADD_PARTS": 0,
            "HAS_BIAS": True}, arch, warps=8),
        compile_kernel(kernels._rope_store_kernel, rope, {
            **heads, "QK_NORM": False, "PARTS": 4, "HAS_BIAS": True}, arch),
        compile_kernel(kernels._rope_store_kernel, rope, {
            **heads, "QK_NORM": True, "PARTS": 2, "HAS_BIAS": False}, arch),
    ]


def disassemble(cubin: bytes) -> str:
    """SASS text of a cubin, by the `nvdisasm` of Triton's wheel."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "nvdisasm")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        done = subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True)
    return done.stdout


def k_loop(sass: str) -> list[str]:
    """The instructions of the K loop: of the loops (a label, then a branch back to it), the
    one whose body holds the most matrix multiplies."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line.strip()))}
    best: list[str] = []
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = lines[labels[m.group(1)]:i + 1]
            if sum(bool(_MMA.search(b)) for b in body) > sum(bool(_MMA.search(b)) for b in best):
                best = body
    return best


def counts(sass: str, block_k: int) -> dict:
    """What one K-loop iteration (`block_k` codes of each column) holds, and the kernel's
    registers. A program with one step of K has no loop (`unrolled`): the whole kernel counts
    as its one iteration."""
    body = k_loop(sass)
    unrolled = not body  # one step of K a program: no loop, the kernel is that one iteration
    if unrolled:
        body = sass.splitlines()
    ops = {op: 0 for op in SASS_LOOP_OPS}
    loads: dict[int, int] = {}
    for line in body:
        text = line.split("*/", 1)[-1]
        for op in SASS_LOOP_OPS:
            if re.search(rf"\b{re.escape(op)}(\.|\s)", text):
                ops[op] += 1
        m = _LDG.search(text)
        if m:
            parts = (m.group(1) or "").strip(".").split(".")
            width = next((_WIDTH[p] for p in parts if p in _WIDTH), 4)
            loads[width] = loads.get(width, 0) + 1
    registers = max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=-1) + 1
    return {"codes_per_iteration": block_k, "unrolled": unrolled, "loop_instructions": len(body),
            "mma": sum(bool(_MMA.search(b)) for b in body), **ops,
            "global_loads_by_bytes": dict(sorted(loads.items())), "registers": registers}


def report(configs: dict, arch: int = 90) -> list[dict]:
    """{shape name: (n, k, [configs])} -> one row each: the configuration and its counts."""
    rows = []
    for name, (n, k, tried) in configs.items():
        for config in tried:
            compiled = compile_nf4(config, k, arch)
            row = {"shape": name, "n": n, "k": k, "config": list(config),
                   "shared_bytes": compiled.metadata.shared,
                   **counts(disassemble(compiled.asm["cubin"]), config.block_k)}
            rows.append(row)
    return rows
