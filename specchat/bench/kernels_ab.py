"""Two builds of specchat's C kernels, side by side in one process: the decoder forward of n rows
(`cpu-int8`'s, on the embedded target) by the working tree's sources and by a git revision's,
alternated call by call so that the machine's drift hits both alike, with the bits compared.

    python -m specchat.bench.kernels_ab --base HEAD~1 --rows 1,4,8,16 --repeats 21

A kernel change that should not change a bit must print `same bits`; its speed is the ratio of
the medians (B/A: the working tree over the base). Timing one build after the other, minutes
apart, measures the machine more than the change on a shared CPU.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specchat import kernels

PROMPT = ("The three most useful things to know about the history of the printing press are, "
          "in the words of a historian who spent forty years with the books of the fifteenth "
          "century, ") * 4


def _sources_at(revision: str, folder: Path) -> Path:
    """The C sources of `revision` (git), written into `folder`."""
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                               text=True, check=True, cwd=kernels.CSRC).stdout.strip())
    csrc = kernels.CSRC.relative_to(root).as_posix()
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{csrc}"],
                           capture_output=True, text=True, check=True, cwd=root).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{revision}:{csrc}/{name}"], capture_output=True,
                              check=True, cwd=root).stdout
        (folder / name).write_bytes(blob)
    return folder


def _build(sources: Path, out: Path) -> kernels.Kernels:
    """The SIMD build of the C files in `sources`, bound as `kernels.load("avx512")` binds the
    cached one."""
    subprocess.run(["gcc", *kernels.build_flags("avx2"), "-o", str(out),
                    *map(str, sorted(sources.glob("*.c"))), "-lm"], check=True)
    return kernels._load(False, wide=kernels.runs_here("avx512"), simd=True, path=out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specchat.bench.kernels_ab",
                                description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--base", default="HEAD", help="the git revision to compare against (A)")
    p.add_argument("--rows", default="1,4,8,16", help="rows a forward feeds (default: 1,4,8,16)")
    p.add_argument("--repeats", type=int, default=21, help="forwards of each build and width")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if not kernels.runs_here("avx2"):
        print("the A/B needs the SIMD build (AVX2, FMA, F16C)", file=sys.stderr)
        return 2
    from specchat.loader import load_engine
    from specchat.runners.cpu.runner import CpuRunner

    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "base").mkdir()
        libs = {"A": _build(_sources_at(args.base, tmp / "base"), tmp / "a.so"),
                "B": _build(kernels.CSRC, tmp / "b.so")}
        engine = load_engine("embedded", progress=lambda *a: None).engine
        ids, _ = engine.text_prompt(PROMPT)
        runners = {k: CpuRunner(engine.model, lib, int8=True) for k, lib in libs.items()}
        caches = {}
        for k, runner in runners.items():
            caches[k] = runner.new_cache()
            runner.forward(caches[k], ids, 0, 1)
        start, times, outs = len(ids), {}, {}
        for rep in range(args.repeats):
            for n in rows:
                order = list(runners) if rep % 2 == 0 else list(reversed(runners))
                for k in order:
                    began = time.perf_counter()
                    outs[k, n] = runners[k].forward(caches[k], [ids[-1]] * n, start, n).clone()
                    times.setdefault((k, n), []).append(time.perf_counter() - began)
                    runners[k].crop(caches[k], start + n, start)
    print(f"decoder forward after a {start}-token prompt, {args.threads} threads, "
          f"median of {args.repeats} (A: {args.base}, B: the working tree)")
    for n in rows:
        a, b = (statistics.median(times[k, n]) * 1000 for k in ("A", "B"))
        same = "same bits" if torch.equal(outs["A", n], outs["B", n]) else "BITS DIFFER"
        print(f"  {n:3} rows: A {a:7.2f} ms  B {b:7.2f} ms  B/A {b / a:.3f}  {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
