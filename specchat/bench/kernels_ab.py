"""Two builds of specchat's C kernels, side by side in one process: the forward of n rows
(`cpu-int8`'s decoder stack and LM head, on the embedded target or `--target`'s) by the working
tree's sources and by a git revision's, alternated call by call so that the machine's drift
hits both alike, with the bits compared.

    python -m specchat.bench.kernels_ab --base HEAD~1 --rows 1,4,8,16 --repeats 21
    python -m specchat.bench.kernels_ab --base HEAD~1 --target llama-3.2-1b-Q4_0.gguf

A kernel change that should not change a bit must print `same bits`; its speed is the ratio of
the medians (B/A: the working tree over the base). Timing one build after the other, minutes
apart, measures the machine more than the change on a shared CPU.

`--kernels vnni,amx` compares two integer kernels of the working tree's build instead (A, B:
the NF4 products and the LM head's, forced; `kernels.I8_KERNELS`), on one model and cache.
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
    p.add_argument("--target", default="embedded",
                   help="the model whose forward is timed (default: the embedded target)")
    p.add_argument("--kernels", metavar="A,B",
                   help="two integer kernels of the working tree's build instead, of amx, "
                        "vnni, avxvnni and avx2 (vnni,amx)")
    args = p.parse_args(argv)
    if not kernels.runs_here("avx2"):
        print("the A/B needs the SIMD build (AVX2, FMA, F16C)", file=sys.stderr)
        return 2
    from specchat.loader import load_engine
    from specchat.runners.cpu.runner import CpuRunner

    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    if args.kernels:
        return _kernels_ab(args, rows)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "base").mkdir()
        libs = {"A": _build(_sources_at(args.base, tmp / "base"), tmp / "a.so"),
                "B": _build(kernels.CSRC, tmp / "b.so")}
        engine = load_engine(args.target, progress=lambda *a: None).engine
        ids, _ = engine.text_prompt(PROMPT)
        runners = {k: CpuRunner(engine.model, lib, int8=True) for k, lib in libs.items()}
        # one LM head module serves both runners: its integer product takes each build's
        # library in turn, as the decoder stacks do
        head = vars(engine.model.get_output_embeddings()).get("forward")
        caches = {}
        for k, runner in runners.items():
            caches[k] = runner.new_cache()
            runner.forward(caches[k], ids, 0, 1)
        start, times, outs = len(ids), {}, {}
        for rep in range(args.repeats):
            for n in rows:
                order = list(runners) if rep % 2 == 0 else list(reversed(runners))
                for k in order:
                    if head is not None:
                        head.lib = libs[k]
                    began = time.perf_counter()
                    outs[k, n] = runners[k].forward(caches[k], [ids[-1]] * n, start, n).clone()
                    times.setdefault((k, n), []).append(time.perf_counter() - began)
                    runners[k].crop(caches[k], start + n, start)
    print(f"forward (decoder and LM head) after a {start}-token prompt, {args.threads} "
          f"threads, median of {args.repeats} (A: {args.base}, B: the working tree)")
    for n in rows:
        a, b = (statistics.median(times[k, n]) * 1000 for k in ("A", "B"))
        same = "same bits" if torch.equal(outs["A", n], outs["B", n]) else "BITS DIFFER"
        print(f"  {n:3} rows: A {a:7.2f} ms  B {b:7.2f} ms  B/A {b / a:.3f}  {same}")
    return 0


def _kernels_ab(args, rows: list[int]) -> int:
    """Two integer kernels of one build, alternated forward by forward on one runner: its
    decoder stack's function and its LM head's library swapped between calls."""
    from specchat.loader import load_engine

    names = args.kernels.split(",")
    if len(names) != 2 or any(n not in kernels.I8_KERNELS or n == "ref" or not kernels.i8_runs(n)
                              for n in names):
        print(f"--kernels takes two of {', '.join(n for n in kernels.I8_KERNELS if n != 'ref')} "
              f"that this CPU runs, not {args.kernels!r}", file=sys.stderr)
        return 2
    engine = load_engine(args.target, progress=lambda *a: None).engine
    runner = engine.runner
    if not getattr(runner, "int8", False):
        print(f"--kernels needs the cpu-int8 path; this model runs {engine.target.runtime.path}",
              file=sys.stderr)
        return 2
    head = vars(runner.head)["forward"]
    libs = {k: kernels.with_i8_kernel(runner.lib, name) for k, name in zip("AB", names)}
    ids, _ = engine.text_prompt(PROMPT)
    cache = runner.new_cache()
    runner.forward(cache, ids, 0, 1)
    start, times, outs = len(ids), {}, {}
    for rep in range(args.repeats):
        for n in rows:
            for k in ("AB" if rep % 2 == 0 else "BA"):
                runner._decoder, head.lib = libs[k].decoder_forward_i8, libs[k]
                began = time.perf_counter()
                outs[k, n] = runner.forward(cache, [ids[-1]] * n, start, n).clone()
                times.setdefault((k, n), []).append(time.perf_counter() - began)
                runner.crop(cache, start + n, start)
    print(f"decoder forward after a {start}-token prompt, {args.threads} threads, "
          f"median of {args.repeats} (A: {names[0]}, B: {names[1]})")
    one = {k: statistics.median(times[k, rows[0]]) for k in "AB"}
    for n in rows:
        a, b = (statistics.median(times[k, n]) for k in "AB")
        same = "same bits" if torch.equal(outs["A", n], outs["B", n]) else "BITS DIFFER"
        print(f"  {n:3} rows: A {a * 1000:7.2f} ms  B {b * 1000:7.2f} ms  B/A {b / a:.3f}  "
              f"x {rows[0]} rows: A {a / one['A']:.2f} B {b / one['B']:.2f}  {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
