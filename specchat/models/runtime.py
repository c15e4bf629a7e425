"""The model runtime on a CPU: what this CPU is, which compute path a model takes on it, and
what that path proved once loaded.

A path is a compute dtype and the code that runs the products, attention and norms:

| path              | compute  | runs                                                  | needs          |
| ----------------- | -------- | ----------------------------------------------------- | -------------- |
| `cpu-fp32-avx512` | float32  | specchat's kernels, the Q8_0 head 16 wide             | AVX-512        |
| `cpu-bf16-native` | bfloat16 | bitsandbytes' fused NF4 kernel, specchat's AVX-512 kernels | native bf16 |
| `cpu-fp32-avx2`   | float32  | specchat's AVX2 kernels                               | AVX2, FMA, F16C |
| `cpu-fp32-ref`    | float32  | specchat's plain C kernels (the references)           | a C compiler   |
| `cpu-fp32-dense`  | float32  | NF4 dequantized once, torch's and oneDNN's products   | nothing        |

The loader takes the first path this CPU runs (`candidates`), or the one `SPECCHAT_CPU_PATH`
names. The CPU's features come from its own flags (`cpu_kind`), never from a library's answer
to "is bf16 supported?": oneDNN says yes on every AVX-512 CPU and then emulates bf16, slower than
float32 and with one-row and several-row products that round differently.

Then `prove_row_exact` checks what speculation's promise rests on: a verify's logits equal the
logits of the same tokens fed one at a time, bit for bit. A path that fails it is not taken
silently: the loader moves on to the next path, and a forced path that fails is labelled
(`Runtime.row_exact` False, with the reason) so the page, `generate` and the bench say that
speculation may change the text there.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

from specchat import kernels

ENV = "SPECCHAT_CPU_PATH"

AVX2 = frozenset({"avx2", "fma", "f16c"})
AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
NATIVE_BF16 = frozenset({"avx512_bf16", "amx_bf16"})
VNNI = frozenset({"avx512_vnni", "avx_vnni"})
AMX_INT8 = frozenset({"amx_tile", "amx_int8"})


@dataclass(frozen=True)
class CpuKind:
    """A CPU as its flags describe it (/proc/cpuinfo's `flags` on x86, `Features` on ARM)."""

    machine: str  # platform.machine(): x86_64, aarch64, arm64, ...
    flags: frozenset[str]

    @property
    def x86(self) -> bool:
        return self.machine.lower() in ("x86_64", "amd64")

    @property
    def avx2(self) -> bool:
        return self.x86 and AVX2 <= self.flags

    @property
    def avx512(self) -> bool:
        return self.avx2 and AVX512 <= self.flags

    @property
    def native_bf16(self) -> bool:
        """bf16 arithmetic in hardware (AVX512-BF16, AMX), not oneDNN's emulation of it; with
        AVX-512, which the kernels of that path use too."""
        return self.avx512 and bool(NATIVE_BF16 & self.flags)

    @property
    def avx512_vnni(self) -> bool:
        """AVX-512 with VNNI: the `cpu-int8` path's kernel (csrc/nf4_i8.c)."""
        return self.avx512 and "avx512_vnni" in self.flags

    @property
    def amx_int8(self) -> bool:
        """AMX's int8 tiles beside AVX-512 VNNI: the `cpu-int8` path's products from 8 rows."""
        return self.avx512_vnni and AMX_INT8 <= self.flags

    @property
    def vnni(self) -> bool:
        return self.x86 and bool(VNNI & self.flags)

    def describe(self) -> str:
        """The flags that matter, in words: 'x86_64 AVX2 (no AVX-512, no native bf16)'."""
        if not self.x86:
            return f"{self.machine} (no x86 SIMD: plain C kernels)"
        if not self.avx2:
            return f"{self.machine} without AVX2"
        has = ["AVX2"] + (["AVX-512"] if self.avx512 else []) + (["VNNI"] if self.vnni else []) \
            + (["AMX-INT8"] if self.amx_int8 else []) \
            + (["native bf16"] if self.native_bf16 else [])
        lacks = ([] if self.avx512 else ["AVX-512"]) + ([] if self.native_bf16 else ["native bf16"])
        return f"{self.machine} {' '.join(has)}" + (f" (no {', no '.join(lacks)})" if lacks else "")


def cpu_kind(flags: set[str] | frozenset[str] | None = None, machine: str | None = None) -> CpuKind:
    """This CPU (or, for tests, the one these flags describe)."""
    machine = machine or platform.machine()
    if flags is None:
        flags = kernels.cpu_flags()
    return CpuKind(machine, frozenset(flags))


@dataclass(frozen=True)
class Path:
    """One way to run a model on this CPU."""

    name: str
    compute: torch.dtype
    kernels: str | None  # the `kernels.load` build it runs on, None for torch's own products
    fused_nf4: bool = False  # NF4 layers through bitsandbytes' fused kernel (native bf16 only)
    int8: bool = False  # the decoder's NF4 products by integer dot products (csrc/nf4_i8.c)
    requires: str = ""  # the CpuKind property the CPU must have ("" for none)
    needs: str = ""  # the same in words

    def missing(self, cpu: CpuKind) -> str | None:
        """Why this CPU cannot run the path, or None."""
        if not self.requires or getattr(cpu, self.requires):
            return None
        return f"{self.name} needs {self.needs}; this CPU is {cpu.describe()}"


# Best first, by measured figures (docs/cpu.md, "Which path runs"): with AVX-512 VNNI the
# integer products (1.16x the float path's plain tok/s end to end in real use, prompts 1.8x
# faster); on a CPU with native bf16 the float32 AVX-512 path runs specchat's own decoder
# forward and decodes 1.6x faster than `cpu-bf16-native` (transformers' forward, bitsandbytes'
# fused kernel), which stays forcible. Without AVX-512 the integer products on 256 bits
# (AVX-VNNI where the CPU has it, else AVX2) before the float32 AVX2 forward: fewer
# instructions a weight at every row count, faster at each in the forced comparison.
PATHS = (
    Path("cpu-int8", torch.float32, "avx512", int8=True, requires="avx512_vnni",
         needs="AVX-512 VNNI"),
    Path("cpu-fp32-avx512", torch.float32, "avx512", requires="avx512",
         needs="AVX-512 (avx512f/bw/vl/dq)"),
    Path("cpu-bf16-native", torch.bfloat16, "avx512", fused_nf4=True, requires="native_bf16",
         needs="native bf16 (avx512_bf16 or amx_bf16)"),
    Path("cpu-int8-avx2", torch.float32, "avx2", int8=True, requires="avx2",
         needs="AVX2, FMA and F16C"),
    Path("cpu-fp32-avx2", torch.float32, "avx2", requires="avx2", needs="AVX2, FMA and F16C"),
    Path("cpu-fp32-ref", torch.float32, "ref", needs="a C compiler"),
    Path("cpu-fp32-dense", torch.float32, None),
)
BY_NAME = {p.name: p for p in PATHS}


class PathError(ValueError):
    """A forced path that does not exist or cannot run on this CPU."""


def forced_path() -> str | None:
    return os.environ.get(ENV) or None


def candidates(cpu: CpuKind | None = None, forced: str | None = None) -> list[Path]:
    """The paths to try, best first: the forced one alone (`SPECCHAT_CPU_PATH`, or `forced`),
    else every path this CPU runs. Raises PathError for a forced path that cannot run here."""
    cpu = cpu or cpu_kind()
    forced = forced if forced is not None else forced_path()
    if forced:
        if forced not in BY_NAME:
            raise PathError(f"{ENV}={forced}: no such path; the paths are "
                            f"{', '.join(BY_NAME)}")
        why = BY_NAME[forced].missing(cpu)
        if why:
            raise PathError(f"{ENV}={forced}: {why}")
        return [BY_NAME[forced]]
    return [p for p in PATHS if p.missing(cpu) is None]


@dataclass
class Runtime:
    """What a loaded model runs on and what it proved (`LoadedModel.runtime`)."""

    path: str  # a `PATHS` name, or the device's name off the CPU ("cuda")
    cpu: str  # `CpuKind.describe()`, or the GPU's name
    row_exact: bool  # a verify's logits are the one-token steps' logits, bit for bit (proved)
    proof: str  # what the check found, in words
    forced: bool = False  # the path was named by SPECCHAT_CPU_PATH
    skipped: tuple[str, ...] = ()  # paths tried first that failed the check, with why
    # the `kernels.load` build the path runs on (None: torch's own products, or off the CPU),
    # handed to whatever else runs beside the model (a draft head)
    kernels: object = None

    @property
    def lossless_note(self) -> str:
        """'' where speculation keeps greedy and seeded replies identical; else why not."""
        if self.row_exact:
            return ""
        return (f"{self.path}: {self.proof}, so greedy and seeded replies with speculation may "
                "differ from plain decoding's at near-ties (still lossless in distribution)")

    def to_json(self) -> dict:
        return {"path": self.path, "cpu": self.cpu, "row_exact": self.row_exact,
                "proof": self.proof}


PROOF_PROMPT = 9  # tokens before the proof's rows
PROOF_WIDTHS = (1, 2, 6, 16, 17)  # rows per forward compared over PROOF_NEW tokens (1: the
# steps; 16 and 17: the CUDA runtime's decode width and one past it, a prompt-page forward)
PROOF_NEW = 17
PROOF_WIDEST = 63  # then one forward this wide against forwards of 17: every width a verify
# or a prompt's last page can take (the engine feeds at most `LoadedModel.narrow_rows` rows)


@torch.inference_mode()
def prove_row_exact(runner, vocab: int) -> tuple[bool, str]:
    """Feed the same tokens after a short prompt through `runner` (core/runner.py) in forwards
    of each width of PROOF_WIDTHS (one at a time, 2, 6, 16 and 17 at a time: chains and trees of
    drafts, the widths a runtime pads to), then PROOF_WIDEST tokens in one forward against
    forwards of 17, and compare their logits bit for bit. Returns (exact, what was found).
    About a second on the embedded target."""
    ids = [(1000 + 37 * i) % vocab for i in range(PROOF_PROMPT + PROOF_WIDEST)]
    prompt = ids[:PROOF_PROMPT]

    def forwards(new: list[int], width: int):
        """(offset, logits) of each forward feeding `new` `width` tokens at a time."""
        cache = runner.new_cache()
        runner.forward(cache, prompt, 0, 1)
        for i in range(0, len(new), width):
            yield i, runner.forward(cache, new[i:i + width], PROOF_PROMPT + i,
                                    len(new[i:i + width]))

    def differing(new: list[int], width: int, want: torch.Tensor) -> int:
        """Positions where forwards of `width` give other logits than `want`, compared a
        forward at a time: no copy of every row's logits (1 MB a row of a 262k vocabulary)."""
        return sum(int((rows != want[i:i + len(rows)]).any(-1).sum())
                   for i, rows in forwards(new, width))

    new = ids[PROOF_PROMPT:PROOF_PROMPT + PROOF_NEW]
    steps = torch.cat([rows for _, rows in forwards(new, 1)])
    for width in PROOF_WIDTHS[1:]:
        differ = differing(new, width, steps)
        if differ:
            return False, (f"a verify of {width} rows gave other logits than one-token steps at "
                           f"{differ} of {len(new)} positions")
    del steps
    wide = ids[PROOF_PROMPT:]
    differ = differing(wide, PROOF_NEW, next(forwards(wide, PROOF_WIDEST))[1])
    if differ:
        return False, (f"a forward of {PROOF_WIDEST} rows gave other logits than forwards of "
                       f"{PROOF_NEW} at {differ} of {len(wide)} positions")
    return True, (f"forwards of {', '.join(map(str, PROOF_WIDTHS[1:]))} and {PROOF_WIDEST} rows "
                  "gave the one-token steps' logits, bit for bit")
