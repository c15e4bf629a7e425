"""Headless command line: `python -m specchat generate|bench|stats|models ...`.

`generate --json` writes one JSON line per emitted token and a final stats line (the contract
in docs/design.md: tools outside the test suite rely on it; extend it, never change it).

This module imports neither torch nor transformers: `models` lists from headers in well under
a second with catalog.py's imports alone, and each other command imports what it needs
(specchat.args, specchat.check, their subcommands' modules) when it is parsed or run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
from dataclasses import asdict, replace

from specchat.help import HelpFormatter
from specchat.models import catalog


def cmd_generate(args) -> int:
    """One reply to --prompt (or stdin). Exit codes: 0 for a reply, 1 when the models do not
    load or the reply ends in an error, 2 for a request that is refused before any decoding."""
    from specchat.args import config_from_args, load_for_cli, validate_sampling
    from specchat.core.inputs import InputError
    prompt = _read_prompt(args)
    if not prompt.strip():
        return _refuse("the prompt is empty; pass --prompt TEXT (or text on stdin).")
    problem = validate_sampling(args)
    if problem:
        return _refuse(problem)
    store = _open_store(args.db)  # before the reply: a bad --db is said up front, once
    if args.json:  # keep stderr readable for scripts: no weight-loading progress bars
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    report = load_for_cli(args)
    if report is None:
        return 1
    try:
        cfg = config_from_args(args, report)
    except InputError as e:
        return _refuse(e)
    ids, stop = _prompt_ids(report.engine, prompt, args)
    cfg = replace(cfg, stop=stop)
    events = report.engine.stream(ids, cfg)
    try:
        first = next(events)  # the engine checks the request before any work: say what's wrong
    except (ValueError, RuntimeError) as e:  # a bad request, or a backend refusing it
        return _refuse(e)
    reply, stats = _print_reply(itertools.chain([first], events), args.json)
    out = _stats_json(stats, report)
    if store is not None:  # saved before the stats line: a script reading it finds the row
        _record(store, report, prompt, reply, out)
    _print_stats(stats, out, report, args.json)
    return 1 if stats.stop_reason == "error" else 0


def _refuse(problem) -> int:
    """Say why a request cannot run, in one line; exit code 2."""
    print(f"specchat: {problem}", file=sys.stderr)
    return 2


def _read_prompt(args) -> str:
    """--prompt, else all of stdin, with lone surrogates replaced."""
    from specchat.core.inputs import clean_text
    return clean_text(args.prompt if args.prompt is not None else sys.stdin.read())


def _prompt_ids(engine, prompt: str, args):
    """(token ids, stop strings): the prompt as plain text (--raw), or as the user's turn of a
    chat after --system."""
    if args.raw:
        return engine.text_prompt(prompt)
    from specchat.core.inputs import clean_text
    system = clean_text(args.system)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return engine.chat_prompt(messages)


def _print_reply(events, as_json: bool):
    """Print the reply as it streams: its text, or with --json its token and step lines.
    Returns (the reply's text, the GenerationStats that end the stream)."""
    from specchat.core.events import GenerationStats, StepRecord, TokenEvent
    reply = []
    stats = None
    for event in events:
        if isinstance(event, TokenEvent):
            reply.append(event.text)
            if as_json:
                print(json.dumps(event.to_json(), ensure_ascii=False), flush=True)
            else:
                print(event.text, end="", flush=True)
        elif isinstance(event, StepRecord):
            if as_json:
                print(json.dumps(event.to_json(), ensure_ascii=False), flush=True)
        elif isinstance(event, GenerationStats):
            stats = event
    return "".join(reply), stats


def _stats_json(stats, report) -> dict:
    """The stats line: `GenerationStats.to_json()`, the models, and the CPU path if local."""
    out = stats.to_json()
    out.update(target=report.engine.target.label,
               draft=report.draft.label if report.draft else None)
    runtime = getattr(report.engine.target, "runtime", None)  # None for a serving backend
    if runtime is not None:
        out["runtime"] = runtime.to_json()
    return out


def _print_stats(stats, out: dict, report, as_json: bool) -> None:
    """The stats line on stdout (--json), else a summary on stderr under the reply."""
    if as_json:
        print(json.dumps(out), flush=True)
        return
    print()
    print(f"-- {stats.new_tokens} tokens in {stats.seconds:.2f}s "
          f"({stats.tokens_per_s:.1f} tok/s), {stats.target_calls} target calls, "
          f"acceptance {stats.acceptance_rate:.0%}, drafter {stats.drafter}", file=sys.stderr)
    runtime = getattr(report.engine.target, "runtime", None)
    if runtime is not None:
        print(f"-- {runtime.path} on {runtime.cpu}; " + (
            "verifies row-exact (proved at load)" if runtime.row_exact else
            f"NOT LOSSLESS BIT FOR BIT: {runtime.lossless_note}"), file=sys.stderr)


def _open_store(path):
    """The stats store for --db, or None (no --db, or it cannot be used: said once here)."""
    if not path:
        return None
    from specchat.stats.store import StatsStore
    # The store also logs its errors; here they are printed once, by us.
    logging.getLogger("specchat.stats").addHandler(logging.NullHandler())
    store = StatsStore.open_or_disabled(path)
    if store.error:
        print(f"specchat: {store.error}", file=sys.stderr)
        return None
    return store


def _record(store, report, prompt, reply, stats_json) -> None:
    engine = report.engine
    conversation = store.new_conversation(prompt[:60], "local", engine.target.name,
                                          report.draft.name if report.draft else "",
                                          engine.target.quantization, engine.device.type)
    store.record_turn(conversation, prompt, reply, stats_json)
    if store.error:
        print(f"specchat: {store.error}", file=sys.stderr)


def cmd_models(args) -> int:
    """The models on disk (specchat.models.catalog), a table or --json's array; exit 0 also
    when there are none."""
    entries = catalog.list_models(args.folders)
    if args.json:
        print(json.dumps([asdict(e) for e in entries], indent=2))
    if not entries:
        searched = ", ".join(str(root) for _, root in catalog.search_roots(args.folders))
        print(f"no models found in: {searched}", file=sys.stderr if args.json else sys.stdout)
    elif not args.json:
        print(_models_table(entries))
    return 0


def _human(n: int | None, size=False) -> str:
    """1236000000 -> "1.24B", 268098176 -> "268M"; a size: 253037344 -> "253 MB"; None -> "-"."""
    if n is None:
        return "-"
    units = (" B", " KB", " MB", " GB", " TB") if size else ("", "K", "M", "B")
    k = 0
    while k + 1 < len(units) and n >= 0.9995 * 1000 ** (k + 1):  # 999.96K is shown as 1M
        k += 1
    return f"{n}{units[0]}" if k == 0 else f"{n / 1000 ** k:.3g}{units[k]}"


def _models_table(entries: list) -> str:
    """Aligned columns, a model a line; an unsupported one's reason on the line under it."""
    rows = [("name", "family", "params", "quant", "size", "source", "path")]
    rows += [(e.name, e.family or "-", _human(e.parameters), e.quantization or "-",
              _human(e.size_bytes, size=True), e.source, e.path) for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[6])
        if k and not entries[k - 1].supported:
            lines.append(f"    not supported: {entries[k - 1].why}")
    return "\n".join(lines)


def add_models(sub) -> None:
    p = sub.add_parser("models", help="list the models on this machine (specchat's cache, "
                                      "Hugging Face, LM Studio, Ollama)",
                       formatter_class=HelpFormatter,
                       description="The models on disk, from their headers alone (nothing "
                                   "is loaded): SPECCHAT_CACHE, HF_HUB_CACHE (or HF_HOME), "
                                   "LMSTUDIO_MODELS, OLLAMA_MODELS replace the folders.")
    p.add_argument("folders", nargs="*", metavar="DIR",
                   help=f"also list the .gguf files and checkpoint folders under these "
                        f"folders, {catalog.MAX_DEPTH} levels down (default: none)")
    p.add_argument("--json", action="store_true",
                   help="one JSON array (name, family, parameters, quantization, size_bytes, "
                        "path, source, supported, why) instead of the table")
    p.set_defaults(func=cmd_models)


def add_check(sub) -> None:
    from specchat.check import add_cli  # torch's import: for `check` and the whole parser only
    add_cli(sub)


def build_parser() -> argparse.ArgumentParser:
    # (imported here: `check` runs on a bare GPU machine without the stats store, gradio or the
    # API's packages; `main` builds it a parser of its own)
    from specchat.api.cli import add_cli as add_serve
    from specchat.args import add_model_arguments, add_sampling_arguments
    from specchat.bench.cli import add_cli as add_bench
    from specchat.stats.cli import add_cli as add_stats
    from specchat.train.cli import add_cli as add_train_draft

    parser = argparse.ArgumentParser(
        prog="python -m specchat", formatter_class=HelpFormatter,
        description="specchat: speculative decoding you can see. Headless commands.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate one reply", formatter_class=HelpFormatter,
                         description="Generate one reply; --json writes one JSON line per "
                                     "token ({type: token, id, text, kind, ...}), one per "
                                     "verification step ({type: step, ...}: what was drafted, "
                                     "kept and why) and a final stats line.")
    gen.add_argument("--prompt", default=None, metavar="TEXT",
                     help="the user message (default: read from stdin)")
    gen.add_argument("--system", default="", metavar="TEXT",
                     help="system prompt, for the chat format (default: none)")
    gen.add_argument("--raw", action="store_true",
                     help="feed the prompt as plain text, without the chat format")
    gen.add_argument("--json", action="store_true", help="JSON lines instead of plain text")
    gen.add_argument("--db", default=None, metavar="PATH",
                     help="record this turn in the stats database at this path (default: the "
                          "turn is not recorded)")
    add_model_arguments(gen)
    add_sampling_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    sub.add_parser("app", help="the web app, as `python app.py` (its options: app --help)",
                   add_help=False)
    add_bench(sub)
    add_serve(sub)
    add_stats(sub)
    add_train_draft(sub)
    add_check(sub)
    add_models(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["app"]:  # the web app keeps its own options
        from specchat.app import main as app_main
        return app_main(argv[1:])
    if argv[:1] in (["check"], ["models"]):  # their own parser: check runs on a bare image,
        # models lists without the other commands' imports (torch's among them)
        parser = argparse.ArgumentParser(prog="python -m specchat", formatter_class=HelpFormatter)
        (add_check if argv[0] == "check" else add_models)(
            parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(argv)
        return args.func(args)
    args = build_parser().parse_args(argv)
    return args.func(args)
