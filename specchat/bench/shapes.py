"""Real models' shapes with random weights on this CPU: what a token reads and the memory limit
that follows, plain decode (tg), prompt speed (pp512), the first token after a 328-token prompt,
the verify curve, and, with a draft shape, the draft token's cost c and the speedup Leviathan
et al.'s cost model projects from them at a per-token acceptance of 0.6, 0.7 and 0.8.

    python -m specchat.bench.shapes --target qwen2.5-1.5b --draft qwen2.5-0.5b
    python -m specchat.bench.shapes --target llama-3.2-1b

Random weights say nothing about acceptance (their text loops), so the speedups are projections
from measured costs, labelled so; the costs themselves are the shape's (a step reads the same
bytes whatever their values). Both models load as `--target` and `--draft-model` load on a CPU
(NF4, the runtime's path); the checkpoints are written once into `--workdir`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

ALPHAS = (0.6, 0.7, 0.8)
WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)  # rows a verify feeds (k drafts: k + 1)
CONTEXT = 256  # tokens cached before each timed forward


def checkpoint(shape: str, workdir: Path) -> Path:
    """A checkpoint of `shape` with random weights in `workdir`, written once; a path (a
    checkpoint folder, a GGUF file) is taken as it is."""
    from specchat.models.synthetic import SHAPES, byte_tokenizer, random_model, save, shape_config

    if shape not in SHAPES:
        return Path(shape)
    path = workdir / shape
    if not (path / "config.json").exists():
        model = random_model(shape_config(shape), seed=3)
        save(model, byte_tokenizer(), path)
        del model
    return path


def read_rate(gigabytes: float = 2.0, repeats: int = 5) -> float:
    """GB/s of a sum over `gigabytes` of float32 on torch's threads: the rate a decode step's
    weight reads are held to (a read, as a step's; no write)."""
    x = torch.ones(int(gigabytes * 1e9) // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.nbytes / min(times) / 1e9


def _forward_ms(runner, vocab: int, widths=WIDTHS, repeats: int = 7) -> dict[int, float]:
    """Median milliseconds of a forward of n rows (logits for every row, as a verify's) after
    CONTEXT cached tokens, the cache rolled back after each."""
    cache = runner.new_cache()
    ids = torch.randint(3, vocab, (CONTEXT + max(widths),),
                        generator=torch.Generator().manual_seed(0)).tolist()
    runner.forward(cache, ids[:CONTEXT], 0, 1)
    out = {}
    for n in widths:
        times = []
        for _ in range(repeats + 1):  # the first warms buffers up
            t = time.perf_counter()
            runner.forward(cache, ids[CONTEXT:CONTEXT + n], CONTEXT, n)
            times.append(time.perf_counter() - t)
            runner.crop(cache, CONTEXT + n, CONTEXT)
        out[n] = 1000 * statistics.median(times[1:])
    return out


def _prompt(engine, tokens: int) -> tuple[float, float]:
    """(seconds to the first token, prompt tokens/s) of a prompt of `tokens` random ids through
    the engine (its pages, its LM head on the last row), from the request to its first token,
    best of two."""
    from specchat.core.events import TokenEvent
    from specchat.core.settings import request

    best = None
    for run in range(2):
        # a first token of its own each run: the engine continues a prompt that starts as
        # the last request's did from that request's cache
        ids = torch.randint(3, 250, (tokens,),
                            generator=torch.Generator().manual_seed(tokens + run)).tolist()
        ids[0] = 250 + (tokens + run) % 9
        cfg = request(engine.drafters, speculation=False, max_new_tokens=1, temperature=0.0)
        start = time.perf_counter()
        next(e for e in engine.stream(ids, cfg) if isinstance(e, TokenEvent))
        seconds = time.perf_counter() - start
        best = seconds if best is None else min(best, seconds)
    return best, tokens / best


def measure(target: str, draft: str | None, workdir: Path, progress=print,
            nf4_head: bool = False) -> dict:
    from specchat.bench.metrics import leviathan_speedup
    from specchat.bench.run import current_rss_mb, peak_rss_mb
    from specchat.core.engine import Engine
    from specchat.models.load import load_model

    progress(f"{target}: writing and loading its checkpoint (random weights)")
    loaded = load_model(str(checkpoint(target, workdir)), "nf4", "cpu", progress=progress)
    os.sync()  # a first load's conversion written back now, not while the steps are timed
    vocab = loaded.model.config.get_text_config().vocab_size
    runner = loaded.runner
    engine = Engine(loaded, {}, prefix_tokens=0)
    engine.eos_ids = set()
    ms = _forward_ms(runner, vocab)
    step = ms[1]
    # the load's and the steps' peak, before the read rate's buffer (2 GB) would count in it
    peak, resident = peak_rss_mb() / 1024, (current_rss_mb() or 0.0) / 1024
    rate = read_rate()
    read = getattr(runner, "bytes_per_token", None)
    first, _ = _prompt(engine, 328)
    _, pp512 = _prompt(engine, 512)
    out = {"target": target, "label": loaded.label, "runtime": loaded.runtime.to_json(),
           "threads": torch.get_num_threads(), "read_gb_s": round(rate, 1),
           "bytes_per_token_gb": round(read / 1e9, 3) if read else None,
           "memory_limit_tok_s": round(rate * 1e9 / read, 1) if read else None,
           "tg_tok_s": round(1000 / step, 1), "step_ms": round(step, 2),
           "pp512_tok_s": round(pp512, 1), "first_token_s_328": round(first, 3),
           "verify_ms": {n: round(v, 2) for n, v in ms.items()},
           "verify_vs_step": {n: round(v / step, 2) for n, v in ms.items()}}
    if read:
        out["of_memory_limit"] = round(out["tg_tok_s"] / out["memory_limit_tok_s"], 3)
    del engine
    if draft:
        progress(f"{draft}: writing and loading its checkpoint (random weights)")
        small = load_model(str(checkpoint(draft, workdir)), "nf4", "cpu", progress=progress,
                           nf4_head=nf4_head)
        d_ms = _forward_ms(small.runner, vocab, widths=(1,))[1]
        c = d_ms / step
        projected = {}
        for alpha in ALPHAS:
            best = max(((leviathan_speedup(alpha, k, c, ms[k + 1] / step), k)
                        for k in range(1, 9) if k + 1 in ms), default=(0.0, 0))
            projected[str(alpha)] = {"speedup": round(best[0], 2), "k": best[1]}
        out.update({"draft": draft, "draft_label": small.label, "draft_step_ms": round(d_ms, 2),
                    "c": round(c, 3), "projected": projected,
                    "note": "projected from measured costs (random weights: no acceptance)"})
    out["peak_rss_gb"], out["rss_gb"] = round(peak, 2), round(resident, 2)
    return out


def summary(r: dict) -> str:
    lines = [f"{r['target']} on {r['runtime']['cpu']}, {r['threads']} threads, "
             f"{r['runtime']['path']}: {r['label']}",
             f"  a token reads {r['bytes_per_token_gb']} GB; reads run at {r['read_gb_s']} GB/s: "
             f"memory limit {r['memory_limit_tok_s']} tok/s",
             f"  tg {r['tg_tok_s']} tok/s ({r.get('of_memory_limit', 0):.0%} of the limit), "
             f"pp512 {r['pp512_tok_s']} tok/s, first token after 328: "
             f"{r['first_token_s_328']} s",
             "  verify (rows: plain steps) " + ", ".join(
                 f"{n}: {v}" for n, v in r["verify_vs_step"].items())]
    if "draft" in r:
        lines.append(f"  draft {r['draft_label']}: {r['draft_step_ms']} ms a token, c = {r['c']}; "
                     "projected (random weights: no acceptance): " + ", ".join(
                         f"a={a}: {p['speedup']}x at k={p['k']}"
                         for a, p in r["projected"].items()))
    lines.append(f"  peak RSS {r['peak_rss_gb']} GB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from specchat.models.synthetic import SHAPES

    p = argparse.ArgumentParser(prog="python -m specchat.bench.shapes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, metavar="SHAPE_OR_PATH",
                   help=f"a shape ({', '.join(SHAPES)}) or a model: a checkpoint folder or a "
                        "GGUF file")
    p.add_argument("--draft", default=None, metavar="SHAPE_OR_PATH",
                   help="a draft shape or model, as --target (default: none)")
    p.add_argument("--workdir", type=Path, default=Path("shapes"),
                   help="where the random checkpoints are written once (default: ./shapes)")
    p.add_argument("--draft-quantization", choices=["nf4", "nf4-head"], default="nf4",
                   help="the draft's weights, as the app's option: nf4-head puts its LM head in "
                        "NF4 too (default: nf4)")
    p.add_argument("--json", action="store_true", help="one JSON line instead of the summary")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    result = measure(args.target, args.draft, args.workdir,
                     progress=lambda *a: None if args.json else print(*a),
                     nf4_head=args.draft_quantization == "nf4-head")
    print(json.dumps(result) if args.json else summary(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
