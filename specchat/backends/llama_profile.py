"""llama.cpp's side of `bench --profile`: where a plain decoding token of llama.cpp goes.

`llama-specchat-profile` (csrc/llama_profile.cpp) is a small program on llama.cpp's own
libraries, built beside llama-server (`llama_cpp.build`). It decodes the race's prompts with
the race's samplers, as llama-server does (`llama_decode`, then the server's sampler chain,
`common_sampler`), and times the forward and the sampling of each decode step. A second pass
times each node of the forward's graph alone (an eval callback): the share of the layers'
products, the LM head, attention, norms and the rest in a token's forward.

    found = run(tool, gguf, prompts, threads=2, max_new_tokens=128, sampling={...})
    # {"tokens", "forward_s", "sample_s", "split_tokens", "split_forward_s", "nodes": [...]}

`bench.profile.llama_rows` sorts the nodes into the rows of specchat's own profile.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

TOOL = "llama-specchat-profile"
SOURCE = Path(__file__).with_name("csrc") / "llama_profile.cpp"


class ProfileError(RuntimeError):
    """The profile program could not be built or run; the message says why."""


def build_tool(source_tree: Path, build_dir: Path, into: Path) -> Path:
    """Compile `SOURCE` against a llama.cpp build's static libraries (`build_dir`, made from
    `source_tree` with llama-server) into `into`/TOOL; returns its path."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise ProfileError("no C++ compiler (g++ or $CXX) for llama.cpp's profile program")
    libraries = [p for name in ("libllama-common.a", "libllama-common-base.a", "libcommon.a",
                                "libllama.a", "libggml.a", "libggml-cpu.a", "libggml-base.a")
                 for p in sorted(build_dir.rglob(name))]
    if not any(p.name == "libllama.a" for p in libraries):
        raise ProfileError(f"no libllama.a under {build_dir}")
    includes = [source_tree / "include", source_tree / "ggml" / "include",
                source_tree / "common", source_tree / "vendor"]
    out = into / TOOL
    cmd = [compiler, "-O2", "-std=c++17", str(SOURCE), *[f"-I{d}" for d in includes],
           "-o", str(out), "-Wl,--start-group", *map(str, libraries), "-Wl,--end-group",
           "-fopenmp", "-lpthread"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ProfileError(f"building {TOOL} failed:\n{(done.stderr or done.stdout)[-1500:]}")
    return out


def beside(server: Path) -> Path | None:
    """The profile program built with the llama-server at `server`, if it was."""
    tool = Path(server).with_name(TOOL)
    return tool if tool.is_file() else None


def run(tool: Path, gguf: Path, prompts: list[list[int]], threads: int, max_new_tokens: int,
        sampling: dict, stop: list[str] | tuple = (), context: int = 4096,
        swa_full: bool = True, timeout: float = 3600) -> dict:
    """Decode `prompts` (token ids) with llama.cpp's code as the bench's llama-server does
    (`sampling`: the server request's sampler fields; `stop`: its stop strings; `context`,
    `swa_full`: its launch's); returns the program's findings (see the module's docstring)."""
    request = {"model": str(gguf), "threads": threads, "context": context,
               "swa_full": swa_full, "max_new_tokens": max_new_tokens,
               "prompts": prompts, "stop": list(stop), "sampling": sampling}
    try:
        done = subprocess.run([str(tool)], input=json.dumps(request), capture_output=True,
                              text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ProfileError(f"{TOOL} did not run: {e}") from None
    if done.returncode != 0:
        raise ProfileError(f"{TOOL} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    try:
        found = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise ProfileError(f"{TOOL} wrote no report: {done.stdout[-300:]!r}") from None
    if not found.get("tokens") or not found.get("split_tokens"):
        raise ProfileError(f"{TOOL} decoded no tokens")
    return found
