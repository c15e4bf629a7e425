"""`python -m specchat stats` and the `--db` argument."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import IO

from specchat.help import HelpFormatter
from specchat.stats.format import (
    _clip,
    fmt_date,
    fmt_figure,
    fmt_mean,
    fmt_number,
    fmt_percent,
    format_table,
    models_label,
)
from specchat.stats.store import (
    DB_ENV_VAR,
    OFF_VALUES,
    StatsStore,
    default_db_path,
    resolve_db_path,
)

# ---------------------------------------------------------------------------------------------
# CLI: `python -m specchat stats`

def add_db_argument(parser: argparse.ArgumentParser) -> None:
    """`--db PATH` for any subcommand that reads or records statistics."""
    parser.add_argument(
        "--db", metavar="PATH", default=None,
        help=f"statistics database (default: ${DB_ENV_VAR} or {default_db_path()}; "
             "'off' records nothing)")


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `stats`; the main CLI then calls `args.func(args)`."""
    parser = subparsers.add_parser(
        "stats", formatter_class=HelpFormatter,
        help="list past conversations with their speedup and acceptance",
        description="List stored conversations with their speedup over plain decoding and "
                    "their draft acceptance rate.")
    add_db_argument(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--csv", metavar="OUT",
                        help="export turns as CSV to OUT ('-' = stdout) (default: no export, "
                             "print the list)")
    parser.add_argument("--steps", action="store_true",
                        help="with --csv: export one row per verification step instead (what "
                             "was drafted, kept, and the test that decided)")
    parser.add_argument("--conversation", metavar="ID",
                        help="only this conversation (an id or a unique prefix): show its turns "
                             "(default: every conversation)")
    parser.set_defaults(func=run_stats_cli)
    return parser


def run_stats_cli(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    out = out or sys.stdout
    path = resolve_db_path(args.db)
    if path.lower() in OFF_VALUES or (path != ":memory:" and not Path(path).exists()):
        # Reading must not create an empty database as a side effect.
        print("[]" if args.json else f"No statistics recorded yet ({path}).", file=out)
        return 0
    store = StatsStore.open_or_disabled(path)
    if not store.enabled:
        print(store.error, file=sys.stderr)
        return 1
    try:
        conversation_id = None
        if args.conversation:
            conversation_id = store.find_conversation(args.conversation)
            if conversation_id is None:
                print(f"No single conversation matches {args.conversation!r}.", file=sys.stderr)
                return 1
        if args.csv:
            export = store.export_steps_csv if args.steps else store.export_csv
            count = export(out if args.csv == "-" else args.csv, conversation_id)
            if args.csv != "-":
                what = "steps" if args.steps else "turns"
                print(f"Wrote {count} {what} to {args.csv}", file=sys.stderr)
            return 0
        if conversation_id:
            print_conversation(store, conversation_id, args.json, out)
        else:
            print_conversations(store, args.json, out)
        return 0
    finally:
        store.close()


def print_conversations(store: StatsStore, as_json: bool, out: IO[str]) -> None:
    rows = store.summary_rows()
    if as_json:
        json.dump(rows, out, indent=2)
        print(file=out)
        return
    if not rows:
        print("No conversations recorded yet.", file=out)
        return
    header = ["id", "date", "title", "models", "turns", "speedup", "of", "acceptance"]
    print(format_table([[r["id"][:8], fmt_date(r["created"]), _clip(r["title"], 40), r["models"],
                         str(r["turns"]), fmt_mean(r["mean_speedup"], r["speedup_basis"]),
                         _mean_of(r), fmt_percent(r["acceptance"])] for r in rows], header),
          file=out)
    print("\nspeedup: the geometric mean of the conversation's A/B pairs (a speculative reply "
          "against a plain run of the same prompt), else of its estimates (est.: from each "
          "reply's own steps); of: how many it covers", file=out)


def _mean_of(row: dict) -> str:
    """What a conversation's mean covers, in a few characters: "2 A/B", "3 est.", "-"."""
    if row["mean_speedup"] is None:
        return "-"
    kind = "est." if row["speedup_basis"] == "est" else "A/B"
    return f"{row['speedup_turns']} {kind}"


def print_conversation(store: StatsStore, conversation_id: str, as_json: bool,
                       out: IO[str]) -> None:
    turns = store.turns(conversation_id)
    if as_json:
        json.dump(turns, out, indent=2)
        print(file=out)
        return
    c = store.conversation(conversation_id)
    print(f"{c['title']}  ({fmt_date(c['created'])}, {models_label(c['target'], c['draft'])})\n"
          f"mean speedup {fmt_mean(c['mean_speedup'], c['speedup_basis'])} "
          f"({c['speedup_note']}), "
          f"acceptance {fmt_percent(c['acceptance'])}\n", file=out)
    header = ["turn", "spec", "drafter", "k", "temp", "tokens", "tok/s", "accept", "mean len",
              "speedup", "vs", "stop"]
    print(format_table([_turn_cells(t) for t in turns], header), file=out)


def _turn_cells(t: dict) -> list[str]:
    spec = t["speculation"]
    return [str(t["idx"]), "on" if spec else "off", t["drafter"] if spec else "",
            str(t["draft_len"]) if spec else "", fmt_number(t["temperature"], 2),
            str(t["new_tokens"]), fmt_number(t["tokens_per_s"]), fmt_percent(t["acceptance_rate"]),
            fmt_number(t["mean_accepted_len"], 2),
            fmt_figure(t["speedup"], t["speedup_basis"], t["speedup_low"], t["speedup_high"]),
            t["speedup_note"] or "", t["stop_reason"] or ""]
