"""The conversations beside the chat: listed, searched, reopened to continue, renamed, deleted
and exported, from the one stats store the Stats tab reads (no second copy in the browser).

Plain functions of (store, owner, ...) as in stats_tab.py: `owner` is None for a viewer who
sees everything and the visitor's owner key otherwise, and every read and write filters by it
in SQL. A conversation that is not the viewer's gets the same answer as one that does not
exist.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from dataclasses import dataclass, fields

from specchat.core.events import GenerationStats, StepRecord, TokenEvent
from specchat.stats.format import fmt_date, fmt_mean
from specchat.stats.speedup import Speedup
from specchat.stats.store import StatsStore
from specchat.ui.state import Session, Settings, Turn

NOT_FOUND = "That conversation is not yours or no longer exists."
TITLE_CHARS = 120  # the longest title a rename keeps
LIST_TITLE_CHARS = 48  # the most of a title the list shows


@dataclass
class Entry:
    """One conversation of the list."""
    id: str
    title: str
    updated: str  # its last turn's time (ISO), else its creation's
    models: str
    speedup: str  # its mean speedup as the Stats tab shows it ("1.23x", "≈1.10x est.", "—")
    turns: int

    @property
    def label(self) -> str:
        """The list's text for it, plain text (the list escapes it): the title's first line,
        cut to LIST_TITLE_CHARS, then on a line of its own the date, the target's short name
        (what follows its name in brackets left out) and the mean speedup."""
        title = (self.title.strip().splitlines() or ["(untitled)"])[0].strip()
        if len(title) > LIST_TITLE_CHARS:
            title = title[:LIST_TITLE_CHARS - 1].rstrip() + "…"
        models = " + ".join(re.sub(r"\s*\(.*\)\s*$", "", m) or m
                            for m in self.models.split(" + "))
        return f"{title}\n{fmt_date(self.updated)} · {models} · {self.speedup}"


def entries(store: StatsStore, owner: str | None, query: str = "") -> list[Entry]:
    """The viewer's conversations, the most recently active first; with `query`, only those
    whose title, prompts or replies hold it."""
    rows = store.conversations(owner)
    query = query.strip()
    if query:
        found = store.matching(query, owner)
        rows = [r for r in rows if r["id"] in found]
    # (the last turn's id orders turns saved within one second of each other)
    rows.sort(key=lambda r: (r["updated"] or "", r["last_turn"] or 0), reverse=True)
    return [Entry(r["id"], r["title"] or "", r["updated"] or r["created"],
                  _models(r), fmt_mean(r["mean_speedup"], r["speedup_basis"]), r["turns"])
            for r in rows]


def _models(row: dict) -> str:
    return row["target"] + (f" + {row['draft']}" if row["draft"] else "")


def conversation_turns(store: StatsStore, owner: str | None, conversation_id: str
                       ) -> list[dict]:
    """The conversation's own turns, oldest first: its races' runs left out (they
    repeat a turn's prompt to time it, and are no part of what was said)."""
    rows = store.turns(conversation_id, owner)
    baselines = {r["baseline_turn_id"] for r in rows if r["baseline_turn_id"] is not None}
    return [r for r in rows if not r["withdrawn"] and not _replay(r, baselines)]


def _replay(row: dict, baselines: set[int]) -> bool:
    if row["settings"] is not None:
        return bool(row["settings"].get("replay"))
    # kept before turns had their settings: an A/B run is timed against a plain run
    return row["baseline_turn_id"] is not None or row["id"] in baselines


@dataclass
class Reopened:
    """A stored conversation, ready to continue."""
    session: Session
    settings: Settings | None  # those of its last turn (None: kept without them)
    target: str  # the model it was held with


def reopen(store: StatsStore, owner: str | None, conversation_id: str) -> Reopened | None:
    """The conversation as a page session whose next turn is appended to it, its turns with
    their tokens, steps and figures as they were shown; None when it is missing or not the
    viewer's."""
    row = store.conversation(conversation_id, owner) if conversation_id else None
    if row is None:
        return None
    rows = conversation_turns(store, owner, conversation_id)
    turns = [_turn(t, store.steps(t["id"], owner)) for t in rows]
    session = Session(turns=turns, conversation_id=conversation_id, conversation={
        key: row[key] for key in ("title", "owner", "target", "draft", "quantization",
                                  "device")})
    kept = next((t["settings"] for t in reversed(rows) if t["settings"]), None)
    return Reopened(session, settings_of(kept), row["target"])


def settings_of(kept: dict | None) -> Settings | None:
    """A turn's stored settings as the page's, fields it does not know left out."""
    if kept is None:
        return None
    names = {f.name for f in fields(Settings)}
    return Settings(**{k: v for k, v in kept.items() if k in names})


_STATS_FIELDS = {f.name for f in fields(GenerationStats)}


def _turn(row: dict, steps: list[dict]) -> Turn:
    tokens = [TokenEvent(*token) for token in row["tokens"]]
    if not tokens and row["reply"]:  # kept without its tokens: its text as one plain token
        tokens = [TokenEvent(-1, row["reply"], "target", 0, 0, 0)]
    stats = GenerationStats(**{k: v for k, v in row.items()
                               if k in _STATS_FIELDS and v is not None})
    saved: Future = Future()
    saved.set_result(row["id"])
    return Turn(row["prompt"] or "", tokens, [StepRecord.from_json(s) for s in steps],
                stats=stats, speedup=Speedup.from_row(row), saved=saved)


def rename(store: StatsStore, owner: str | None, conversation_id: str, title: str) -> str:
    """Rename; -> the message to show."""
    title = " ".join((title or "").split())[:TITLE_CHARS]
    if not title:
        return "Type a title first: a conversation keeps its name until it gets a new one."
    if not conversation_id:
        return "Pick a conversation first."
    if store.rename_conversation(conversation_id, title, owner):
        return "Renamed."
    return NOT_FOUND


def as_markdown(store: StatsStore, owner: str | None, conversation_id: str) -> str | None:
    """The conversation as a Markdown document (its texts as written, under headings that
    say who wrote each); None when missing or not the viewer's."""
    row = store.conversation(conversation_id, owner)
    if row is None:
        return None
    lines = [f"# {row['title'] or '(untitled)'}", "",
             f"{fmt_date(row['created'])} · {_models(row)} · mean speedup "
             f"{fmt_mean(row['mean_speedup'], row['speedup_basis'])}", ""]
    for t in conversation_turns(store, owner, conversation_id):
        lines += ["## You", "", t["prompt"] or "", "", "## Model", "", t["reply"] or "", ""]
    return "\n".join(lines)


def as_json(store: StatsStore, owner: str | None, conversation_id: str) -> str | None:
    """The conversation and its turns (texts, settings, figures) as JSON; None when missing
    or not the viewer's."""
    row = store.conversation(conversation_id, owner)
    if row is None:
        return None
    turns = [{k: v for k, v in t.items() if k not in ("tokens", "conversation_id")}
             for t in conversation_turns(store, owner, conversation_id)]
    keep = ("id", "title", "created", "updated", "target", "draft", "quantization", "device",
            "mean_speedup", "speedup_basis", "speedup_note")
    return json.dumps({**{k: row[k] for k in keep}, "turns": turns}, ensure_ascii=False,
                      indent=1)
