"""The `bench` subcommand."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specchat.bench.config import ALL_MODES, HEAD_MODES, BenchSettings
from specchat.bench.questions import default_questions_path, load_questions
from specchat.bench.report import format_report
from specchat.bench.run import available_modes, bench, current_rss_mb, machine_config, peak_rss_mb
from specchat.core.engine import TREE_NODES

# ---------------------------------------------------------------------------------------------
# CLI


def _modes_arg(value: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(m.strip() for m in value.split(",") if m.strip()))
    bad = [m for m in modes if m not in ALL_MODES + HEAD_MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(bad) or '(none)'}; choose from "
            f"{', '.join(ALL_MODES + HEAD_MODES)}")
    return modes


def add_cli(subparsers) -> argparse.ArgumentParser:
    from specchat.args import add_model_arguments
    p = subparsers.add_parser(
        "bench", help="benchmark decoding modes on a question set (Spec-Bench)",
        description="Run a JSONL question set (Spec-Bench's by default) in several decoding "
                    "modes side by side on one loaded target, interleaved per question, and "
                    "report tokens/s, speedup over plain decoding, acceptance, target calls per "
                    "token and time to first token, per category and overall.")
    p.add_argument("--questions", default=None,
                   help="JSONL file, one question a line with `turns` and `category` (default: "
                        "../shared/benchmarks/spec_bench/question.jsonl next to the repository)")
    p.add_argument("--categories", nargs="+", default=None,
                   help="only these categories (space or comma separated)")
    p.add_argument("--limit-per-category", type=int, default=None, metavar="N",
                   help="the first N questions of each category")
    p.add_argument("--turns", choices=["first", "all"], default="first",
                   help="first turns only, or every turn (follow-ups reuse the cached history)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", type=_modes_arg, default=None,
                   help=f"comma separated, from {','.join(ALL_MODES + HEAD_MODES)} (default: "
                        "every mode the loaded models allow)")
    p.add_argument("--draft-len", type=int, default=4, help="k: most draft tokens per step")
    p.add_argument("--fixed-draft-len", action="store_true",
                   help="always draft k tokens (default: the engine adapts k)")
    p.add_argument("--tree-nodes", type=int, default=TREE_NODES, metavar="N",
                   help="draft-tree size of the head-tree and combined-tree modes "
                        "(default: %(default)s)")
    p.add_argument("--hf-pld-tokens", type=int, default=0, metavar="N",
                   help="prompt_lookup_num_tokens for hf-pld (default: --draft-len)")
    p.add_argument("--repeats", type=int, default=1, help="runs per question and mode; "
                                                          "timings are medians")
    p.add_argument("--ignore-stop-strings", action="store_true",
                   help="stop at EOS and --max-new-tokens only, not at the chat format's stop "
                        "strings (longer replies: decoding speed rather than short answers)")
    p.add_argument("--warmup-tokens", type=int, default=16,
                   help="tokens of one unrecorded warm-up run per mode (0: none)")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch CPU threads (default: torch's choice). On a machine shared with "
                        "other busy processes, 1 avoids threads waiting on each other")
    p.add_argument("--json", metavar="OUT", default=None, help="write the full report here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p


def cmd_bench(args) -> int:
    from specchat.args import load_for_cli, validate_sampling

    path = args.questions or default_questions_path()
    if path is None:
        print("specchat: no question file given and Spec-Bench's question.jsonl was not found "
              "next to the repository; pass --questions FILE.", file=sys.stderr)
        return 2
    categories = [c for arg in (args.categories or []) for c in arg.split(",") if c]
    try:
        questions = load_questions(path, categories, args.limit_per_category)
    except (OSError, ValueError) as e:
        print(f"specchat: {e}", file=sys.stderr)
        return 2
    if not questions:
        print(f"specchat: no questions in {path}", file=sys.stderr)
        return 2
    problem = ("--repeats must be at least 1" if args.repeats < 1 else
               "--seed must be >= 0: the bench compares replies per seed" if args.seed < 0 else
               validate_sampling(args))
    if problem:
        print(f"specchat: {problem}", file=sys.stderr)
        return 2
    if args.threads > 0:
        import torch
        torch.set_num_threads(args.threads)
    report = load_for_cli(args)
    if report is None:
        return 1
    loaded_peak_mb, loaded_rss_mb = peak_rss_mb(), current_rss_mb()
    engine = report.engine
    assistant = report.draft.model if report.draft else None
    modes = args.modes or tuple(available_modes(engine, assistant))
    try:
        import transformers
        transformers.logging.set_verbosity_error()  # generate()'s per-call advice, not results
    except Exception:  # noqa: BLE001
        pass
    settings = BenchSettings(modes=modes, turns=args.turns, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                             seed=args.seed, draft_len=args.draft_len,
                             adaptive=not args.fixed_draft_len, hf_pld_tokens=args.hf_pld_tokens,
                             tree_nodes=args.tree_nodes,
                             repeats=args.repeats, warmup_tokens=args.warmup_tokens,
                             stop_strings=not args.ignore_stop_strings)
    extra = {"questions_file": str(path), "categories": categories or None,
             "limit_per_category": args.limit_per_category,
             "target": engine.target.label, "draft": report.draft.label if report.draft else None,
             "command": "python -m specchat " + " ".join(sys.argv[1:]),
             "peak_rss_after_load_mb": loaded_peak_mb, "rss_after_load_mb": loaded_rss_mb,
             **machine_config()}
    try:
        result = bench(engine, questions, settings, assistant, progress=not args.no_progress,
                       extra_config=extra)
    except ValueError as e:
        print(f"specchat: {e}", file=sys.stderr)
        return 2
    print(format_report(result))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"report written to {out}", file=sys.stderr)
    return 130 if result["config"]["interrupted"] else 0
