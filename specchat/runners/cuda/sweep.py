"""Time the CUDA runtime's matmul kernels on this GPU, for the weight shapes of Llama 3.1 8B and
Llama 3.2 1B as the runtime runs them (q|k|v and gate|up fused):

    python -m specchat.runners.cuda.sweep                  # every shape, 1 to 64 rows
    python -m specchat.runners.cuda.sweep --shape 8b --write
    python -m specchat.runners.cuda.sweep --compile-only --arch 90   # no GPU: machine code

For each NF4 shape it tries tile configurations on a plain step's product (one live row of the
16 the runtime pads every step of up to 16 tokens to), then times the best and the runtime's own
at 1, 2, 4, 8, 16 and 64 live rows, fed as the runtime feeds them (16 or 64 rows, the live count
in a device scalar), beside the bf16 kernel and bitsandbytes' own 4-bit matmul on the same
weights: microseconds, the read bandwidth (weights, scales and activations once) and its
fraction of this GPU's measured copy rate. Each time is a launch's inside a CUDA graph, over
copies of the weights together at least twice the L2 cache, so that every launch reads its
weights from memory as a decode step does. `--write` keeps the best configuration of each shape
for this card in `configs.json`, which `kernels.nf4_config` reads: configurations are chosen by
the weight's shape and the card, never by timings at run time (a row's bits must not depend on a
timing)."""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

# Llama 3.1 8B and Llama 3.2 1B: (out features, in features) of each NF4 product the runtime
# launches, and the LM head (bf16)
SHAPES = {
    "8b": {"q|k|v": (6144, 4096), "o": (4096, 4096), "gate|up": (28672, 4096),
           "down": (4096, 14336), "lm head": (128256, 4096)},
    "1b": {"q|k|v": (3072, 2048), "o": (2048, 2048), "gate|up": (16384, 2048),
           "down": (2048, 8192), "lm head": (128256, 2048)},
}
ROWS = (1, 2, 4, 8, 16, 64)


def candidates(n: int, k: int) -> list:
    """Tile configurations worth timing for an [n, k] NF4 weight (at most 27: each is compiled
    once): the shape's own rule, and around it columns a program and slices of K for the
    gathered codebook (the rule's decode) and columns for the pair table, at 256 codes a step;
    then 128 and 512 codes a step; then the byte-permute decodings (DECODE 2, and 4: DECODE 3
    with wide loads, fewer instructions and barriers) at 32, 64 and 128 columns (their weights
    are the MMA's first operand, so wider tiles); then warps and pipeline stages around the
    rule's and DECODE 4's tiles."""
    from specchat.runners.cuda import kernels

    own = kernels.nf4_config(n, k)
    out = [own]
    w, st = own.warps, own.stages
    tried = [(block_n, 256, split, w, st, 1) for block_n in (16, 32, 64)
             for split in (own.split // 2, own.split, own.split * 2)]
    tried += [(block_n, 256, own.split, w, st, 0) for block_n in (16, 32, 64)]
    tried += [(own.block_n, block_k, own.split, w, st, own.decode) for block_k in (128, 512)]
    tried += [(block_n, 256, own.split, w, st, decode) for decode in (2, 4)
              for block_n in (32, 64, 128)]
    tried += [(own.block_n, own.block_k, own.split, warps, stages, own.decode)
              for warps, stages in ((8, st), (w, 2), (w, 4))]
    tried += [(64, 256, own.split, warps, stages, 4) for warps, stages in ((8, st), (w, 2))]
    for block_n, block_k, split, warps, stages, decode in tried:
        c = kernels.NF4Config(block_n, block_k, split, warps, stages, decode)
        if split >= 1 and k % (split * block_k) == 0 and c not in out:
            out.append(c)
    return out


def _time_us(fn, repeats: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def copies_for(nbytes: int, l2_bytes: int) -> int:
    """Copies of a weight of `nbytes` that a timing rotates through so that none is still in
    the L2 cache when it is read again: together at least twice the L2."""
    return max(1, -(-2 * l2_bytes // max(1, nbytes)))


LAUNCHES = 8  # the fewest launches a timed graph holds


def _graph_time_us(launches: list, repeats: int = 20) -> tuple[float, str]:
    """(median microseconds a launch, how it was timed) of `launches`, each reading its own
    copy of the weights (`copies_for`), replayed as one CUDA graph: the launches' own time,
    without the host's launch gaps or a weight left in the L2 by the launch before. Where a
    launch cannot be captured (a library's host-side work), each is timed alone by events."""
    launches = launches * -(-LAUNCHES // len(launches))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and allocate outside the capture
        for fn in launches:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in launches:
                fn()
    except Exception:  # noqa: BLE001 - timed by events instead, and said so
        torch.cuda.synchronize()
        turn = itertools.cycle(launches)
        return _time_us(lambda: next(turn)(), repeats * 4), "events"
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(launches))
    return statistics.median(times), "graph"


def copy_rate(device) -> float:
    """This GPU's device-to-device copy rate in bytes/s (read and write counted)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    us = _time_us(lambda: b.copy_(a), 20)
    return 2 * a.numel() / us * 1e6


def _nf4_weights(n: int, k: int, device):
    """Random NF4 weights in bitsandbytes' layout, quantized by bitsandbytes (no double
    quantization: the float32 absmax the runtime reads), and bitsandbytes' own forward."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import quantize_4bit

    from specchat.runners.cuda import kernels

    weight = torch.randn(n, k, dtype=torch.bfloat16, device=device)
    packed, state = quantize_4bit(weight, blocksize=kernels.NF4_BLOCK, quant_type="nf4",
                                  compress_statistics=False)
    codes = packed.view(n, k // 2)
    absmax = kernels.nf4_scales(state.absmax.float().view(n, k // kernels.NF4_BLOCK))
    table = kernels.pair_table(state.code.float().cpu()).to(device)
    return weight, codes, absmax, table, lambda x: bnb.matmul_4bit(x, packed.t(), state)


def sweep(shape: str, rows: tuple[int, ...], rate: float, device, keep=None) -> dict:
    """Print the table of one model's shapes; -> {"n x k": best config} for `--write`, each
    also handed to `keep` as soon as it is chosen (a sweep cut short keeps what it chose).
    Every figure is a CUDA graph's launches over copies of the weights together twice the L2
    (`_graph_time_us`, `copies_for`): what a captured decode step reads, from memory."""
    from specchat.runners.cuda import kernels

    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20
    best_of = {}
    for name, (n, k) in SHAPES[shape].items():
        if name == "lm head":
            weight = torch.randn(n, k, dtype=torch.bfloat16, device=device)
            weights = [weight] + [weight.clone() for _ in range(copies_for(2 * n * k, l2) - 1)]
            for m in rows:
                x, live = _fed(m, k, device)
                us, how = _graph_time_us([lambda w=w, x=x, live=live: kernels.matmul(x, w,
                                                                                    rows=live)
                                          for w in weights])
                _line(name, n, k, m, "bf16", us, weight.numel() * 2 + m * k * 2, rate, how)
            continue
        weight, codes, absmax, table, bnb_forward = _nf4_weights(n, k, device)
        nf4_bytes = codes.numel() + absmax.numel() * 4
        # (codes, absmax) copies, and bf16 copies for the bf16 kernel
        nf4 = [(codes, absmax)] + [(codes.clone(), absmax.clone())
                                   for _ in range(copies_for(nf4_bytes, l2) - 1)]
        bf16 = [weight] + [weight.clone() for _ in range(copies_for(2 * n * k, l2) - 1)]
        print(f"  {name}: {len(nf4)} NF4 and {len(bf16)} bf16 copies of the weights rotate "
              f"(L2 {l2 >> 20} MiB)")

        def launches(m, config, nf4=nf4, table=table):
            x, live = _fed(m, k, device)
            return [lambda w=w: kernels.nf4_matmul(x, w[0], w[1], table, config=config,
                                                   rows=live) for w in nf4]

        timed = []
        for config in candidates(n, k):  # chosen by a plain step's product: one live row
            try:
                timed.append((_graph_time_us(launches(1, config), 10)[0], config))
            except Exception as e:  # noqa: BLE001 (a tile that does not fit this GPU)
                print(f"  {name} {config}: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
        best = min(timed)[1]
        own = kernels.nf4_config(n, k)
        best_of[f"{n}x{k}"] = list(best)
        if keep is not None:
            keep({f"{n}x{k}": list(best)})
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
            read = nf4_bytes + x.numel() * 2
            for label, config in (("nf4 best", best), ("nf4 runtime", own)):
                us, how = _graph_time_us(launches(m, config))
                _line(name, n, k, m, f"{label} {tuple(config)}", us, read, rate, how)
            fed, live = _fed(m, k, device)
            us, how = _graph_time_us([lambda w=w: kernels.matmul(fed, w, rows=live)
                                      for w in bf16])
            _line(name, n, k, m, "bf16 kernel", us, weight.numel() * 2 + x.numel() * 2, rate,
                  how)
            # bitsandbytes' forward (host-side work around its kernel): by events, one copy
            _line(name, n, k, m, "bitsandbytes", _time_us(lambda f=bnb_forward, x=x: f(x)), read, rate,
                  "events, one copy")
    return best_of


def _fed(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """m rows as the runtime feeds a product: padded to its decode width (16) or its page (64),
    with the live count in a device scalar, so that only the live rows are read."""
    from specchat.runners.cuda.runner import PAGE, WIDTH

    width = WIDTH if m <= WIDTH else max(m, PAGE)
    return (torch.randn(width, k, dtype=torch.bfloat16, device=device),
            torch.tensor([m], dtype=torch.int32, device=device))


def _line(name: str, n: int, k: int, m: int, what: str, us: float, read: int,
          rate: float, how: str = "graph") -> None:
    gbs = read / us / 1e3
    print(f"  {name:8} {n:>6}x{k:<6} {m:>3} rows  {what:40} {us:9.1f} us {gbs:7.0f} GB/s "
          f"{gbs * 1e9 / rate:6.1%}" + ("" if how == "graph" else f"  ({how})"))


def _compile_only(shape: str, arch: int, json_file: str | None) -> int:
    """Every NF4 shape's configurations compiled for `arch`, no GPU needed: a row each."""
    from specchat.runners.cuda import sass

    configs = {f"{model} {name}": (n, k, candidates(n, k))
               for model in (SHAPES if shape == "all" else [shape])
               for name, (n, k) in SHAPES[model].items() if name != "lm head"}
    import triton
    print(f"NF4 kernel compiled for sm_{arch} by Triton {triton.__version__}: per K-loop "
          "iteration (codes of each column), barriers, shared stores and loads, global loads "
          "by bytes; registers and shared memory of the kernel")
    rows = sass.report(configs, arch)
    for r in rows:
        print(f"  {r['shape']:12} {str(tuple(r['config'])):26} codes {r['codes_per_iteration']:>3} "
              f"BAR.SYNC {r['BAR.SYNC']:>2} STS {r['STS']:>2} LDS {r['LDS']:>2} "
              f"LDSM {r['LDSM']:>2} LDG {r['global_loads_by_bytes']} "
              f"regs {r['registers']:>3} shared {r['shared_bytes'] // 1024} KiB"
              + (" (one step: no loop)" if r["unrolled"] else ""))
    if json_file:
        Path(json_file).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def _configs_file() -> Path:
    """The configurations the kernels read (`kernels.CONFIGS_FILE`), found without importing
    Triton."""
    return Path(__file__).with_name("configs.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specchat.runners.cuda.sweep",
        description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--shape", choices=(*SHAPES, "all"), default="all",
                   help="the model whose shapes to time (default: all)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), metavar="N,N,...",
                   help="row counts to time (default: %(default)s)")
    p.add_argument("--compile-only", action="store_true",
                   help="compile every shape's configurations for --arch without a GPU and "
                        "print what each K-loop iteration holds in machine code (sass.py)")
    p.add_argument("--arch", type=int, default=90, metavar="SM",
                   help="the compute capability --compile-only compiles for (default: 90)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write --compile-only's rows to this file")
    p.add_argument("--write", nargs="?", const=str(_configs_file()), default=None,
                   metavar="FILE",
                   help="keep each shape's best configuration for this card in FILE (default: "
                        "the package's configs.json, which the kernels read)")
    args = p.parse_args(argv)
    try:
        rows = tuple(int(r) for r in args.rows.split(","))
        if not rows or min(rows) < 1:
            raise ValueError
    except ValueError:
        p.error(f"--rows takes positive whole numbers separated by commas (got {args.rows!r})")
    if args.compile_only:
        return _compile_only(args.shape, args.arch, args.json)
    if not torch.cuda.is_available():
        print("sweep: it times the CUDA kernels and needs a CUDA GPU; none is visible here "
              f"(torch {torch.__version__})", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    card = torch.cuda.get_device_name(device)
    rate = copy_rate(device)
    print(f"{card}: copy rate {rate / 1e9:.0f} GB/s; NF4 configurations (columns, codes a "
          "step, slices of K, warps, stages, decode); GB/s and its share of the copy rate")
    def keep(best: dict) -> None:  # written at once: a stage cut short keeps what it chose
        path = Path(args.write)
        table = json.loads(path.read_text()) if path.exists() else {}
        table.setdefault(card, {}).update(best)
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")

    for shape in (SHAPES if args.shape == "all" else [args.shape]):
        print(f"{shape}:")
        sweep(shape, rows, rate, device, keep if args.write else None)
    if args.write:
        print(f"best configurations for {card} written to {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
