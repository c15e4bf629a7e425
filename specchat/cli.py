"""Headless command line: `python -m specchat generate|bench|stats ...`.

`generate --json` writes one JSON line per emitted token and a final stats line (DESIGN.md's
contract: checks outside the test suite rely on it; extend, don't change).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from specchat.engine import TREE_NODES, default_tree_nodes
from specchat.models import PRESETS


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--preset", choices=sorted(PRESETS),
                   help="a named target + draft pair: " +
                   "; ".join(f"{k}: {v.note}" for k, v in PRESETS.items()))
    g.add_argument("--target", default=None,
                   help="target model: hub id or local directory (default: the embedded "
                        "Gemma 3 270M, offline)")
    g.add_argument("--draft-model", default=None,
                   help="draft model (hub id or directory) sharing the target's tokenizer; "
                        "'embedded' for the embedded Gemma weights")
    g.add_argument("--quantization", choices=["nf4", "none"], default="nf4",
                   help="target weights: 4-bit NF4 via bitsandbytes (default) or unquantized")
    g.add_argument("--draft-quantization", choices=["nf4", "none"], default="none",
                   help="draft weights (default: unquantized)")
    g.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:1")
    g.add_argument("--head", default=None,
                   help="draft head file from `train-draft` (default: the head trained or "
                        "shipped for this target, if any)")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--speculation", choices=["on", "off"], default="on")
    g.add_argument("--drafter", choices=["model", "ngram", "head", "combined"], default=None,
                   help="who proposes drafts: a draft model, ngram prompt lookup, the trained "
                        "draft head, or combined (ngram when it finds a continuation, else the "
                        "head). Default: model when a draft model is loaded, else ngram")
    g.add_argument("--draft-len", type=int, default=4, help="k: most draft tokens per step")
    g.add_argument("--tree-nodes", type=int, default=None,
                   help="the head (and combined, when it uses the head) drafts a tree of up to "
                        "this many tokens, verified in one forward; 0: a chain, sampled at T > 0 "
                        f"(default: {TREE_NODES} for the head when greedy, else 0)")
    g.add_argument("--fixed-draft-len", action="store_true",
                   help="always draft k tokens (default: adapt k to measured acceptance/cost)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=128)


def model_choice(args) -> tuple[str, str]:
    target, draft = args.target, args.draft_model
    if args.preset:
        preset = PRESETS[args.preset]
        target = target or preset.target
        draft = draft if draft is not None else preset.draft
    return target or "embedded", draft or ""


def load_from_args(args, progress):
    from specchat.engine import load_engine
    target, draft = model_choice(args)
    return load_engine(target, draft, args.quantization, args.draft_quantization,
                       None if args.device == "auto" else args.device, progress,
                       head=getattr(args, "head", None))


def config_from_args(args, report):
    from specchat.engine import GenerateConfig
    drafters = report.engine.drafters
    drafter = args.drafter or report.engine.default_drafter()
    if drafter not in drafters:
        needs = ("a compatible --draft-model" if drafter == "model" else
                 "a draft head for this target (python -m specchat train-draft)")
        drafter = report.engine.default_drafter()
        print(f"specchat: drafter {args.drafter!r} needs {needs}; using {drafter}.",
              file=sys.stderr)
    return GenerateConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          speculation=args.speculation == "on", drafter=drafter,
                          draft_len=args.draft_len, adaptive=not args.fixed_draft_len,
                          tree_nodes=default_tree_nodes(args.temperature, drafter)
                          if args.tree_nodes is None else args.tree_nodes)


def validate_sampling(args) -> str | None:
    if args.max_new_tokens < 1:
        return "--max-new-tokens must be at least 1"
    if args.draft_len < 1 or args.draft_len > 16:
        return "--draft-len must be between 1 and 16"
    if args.tree_nodes is not None and not 0 <= args.tree_nodes <= 64:
        return "--tree-nodes must be between 0 and 64"
    if args.temperature < 0:
        return "--temperature must be >= 0"
    if not 0 < args.top_p <= 1:
        return "--top-p must be in (0, 1]"
    if args.top_k < 0:
        return "--top-k must be >= 0"
    return None


def cmd_generate(args) -> int:
    from specchat.events import GenerationStats, TokenEvent
    from specchat.models import ModelLoadError
    from specchat.text import chat_prompt, raw_prompt

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        print("specchat: the prompt is empty; pass --prompt TEXT (or text on stdin).",
              file=sys.stderr)
        return 2
    problem = validate_sampling(args)
    if problem:
        print(f"specchat: {problem}", file=sys.stderr)
        return 2
    if args.json:  # keep stderr readable for scripts: no weight-loading progress bars
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    try:
        report = load_from_args(args, lambda msg: print(msg, file=sys.stderr))
    except ModelLoadError as e:
        print(f"specchat: {e}", file=sys.stderr)
        return 1
    for note in report.notes:
        print(f"specchat: {note}", file=sys.stderr)
    engine = report.engine
    cfg = config_from_args(args, report)
    if args.raw:
        ids, stops = raw_prompt(engine.tokenizer, prompt), ()
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": prompt})
        ids, stops = chat_prompt(engine.tokenizer, messages)
    cfg.stop = stops
    reply = []
    stats = None
    events = engine.stream(ids, cfg)
    try:
        first = next(events)  # the engine checks the request before any work: say what's wrong
    except ValueError as e:
        print(f"specchat: {e}", file=sys.stderr)
        return 2
    for event in itertools.chain([first], events):
        if isinstance(event, TokenEvent):
            reply.append(event.text)
            if args.json:
                print(json.dumps(event.to_json(), ensure_ascii=False), flush=True)
            else:
                print(event.text, end="", flush=True)
        elif isinstance(event, GenerationStats):
            stats = event
    out = stats.to_json()
    out.update(target=report.engine.target.label,
               draft=report.draft.label if report.draft else None)
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        print()
        print(f"-- {stats.new_tokens} tokens in {stats.seconds:.2f}s "
              f"({stats.tokens_per_s:.1f} tok/s), {stats.target_calls} target calls, "
              f"acceptance {stats.acceptance_rate:.0%}, drafter {stats.drafter}", file=sys.stderr)
    if getattr(args, "db", None) is not None or _stats_enabled(args):
        _record(args, report, prompt, "".join(reply), out)
    return 1 if stats.stop_reason == "error" else 0


def _stats_enabled(args) -> bool:
    return bool(getattr(args, "db", None))


def _record(args, report, prompt, reply, stats_json) -> None:
    try:
        from specchat.stats import StatsStore
    except ImportError:
        return
    store = StatsStore.open_or_disabled(args.db)
    if getattr(store, "error", None):
        print(f"specchat: {store.error}", file=sys.stderr)
        return
    engine = report.engine
    conv = store.new_conversation(prompt[:60], "local", engine.target.name,
                                  report.draft.name if report.draft else "",
                                  engine.target.quantization, engine.device.type)
    store.record_turn(conv, prompt, reply, stats_json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m specchat",
        description="specchat: speculative decoding you can see. Headless commands.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate one reply",
                         description="Generate one reply; --json writes one JSON line per "
                                     "token ({type, id, text, kind}) and a final stats line.")
    gen.add_argument("--prompt", default=None, help="the user message (default: stdin)")
    gen.add_argument("--system", default="", help="system prompt")
    gen.add_argument("--raw", action="store_true",
                     help="feed the prompt as plain text, without the chat format")
    gen.add_argument("--json", action="store_true", help="JSON lines instead of plain text")
    gen.add_argument("--db", default=None,
                     help="record this turn in the stats database at this path")
    add_model_arguments(gen)
    add_sampling_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    try:
        from specchat.bench import add_cli as add_bench
        add_bench(sub)
    except ImportError:
        pass
    try:
        from specchat.stats import add_cli as add_stats
        add_stats(sub)
    except ImportError:
        pass
    try:
        from specchat.train_draft import add_cli as add_train_draft
        add_train_draft(sub)
    except ImportError:
        pass
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
