"""Per-conversation speedup statistics in SQLite, and the `specchat stats` command.

The chat UI and `specchat generate --db` call `StatsStore.record_turn` once per reply with the
engine's `GenerationStats.to_json()` dict; the Stats tab and `specchat stats` read it back.
This module imports nothing from the engine or from gradio: it only sees plain dicts.

Durability: WAL journal, every turn written in one `BEGIN IMMEDIATE` transaction, a busy timeout
plus a bounded retry so concurrent writers (two app processes, threads) wait for each other
instead of failing, and `StatsStore.open_or_disabled` which turns a corrupt or unwritable file
into a clear message while the chat keeps working. The app writes through `StatsWriter`
(writer.py), one background thread, so no reply ever waits on the database.

Speedups follow `speedup.py`'s one definition (a speculative turn's tokens/s over its A/B plain
run's, else an estimate from its own steps with a band; never a ratio to another prompt's
reply; a conversation's is the geometric mean of its A/B pairs, else of its estimates). Each
turn row keeps the figure it was shown with: `speedup`, `speedup_basis` ("ab" or "est"), the
`speedup_baseline` tokens/s it was compared with, the band `speedup_low`..`speedup_high` of an
estimate and a `speedup_note`. The figure is set once, when the turn is recorded (the page
passes the one it showed), and later turns never change it.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
import random
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, TypeVar

import platformdirs
from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from specchat.stats.format import models_label
from specchat.stats.speedup import (
    INTERRUPTED_REASONS,
    Speedup,
    conversation_speedup,
    conversation_speedups,
    field,
    turn_speedup,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

DB_ENV_VAR = "SPECCHAT_DB"
OFF_VALUES = ("off", "none")  # `--db off` / SPECCHAT_DB=off: run without stats
BUSY_TIMEOUT_S = 2.0  # SQLite's own wait for a lock, per attempt
WRITE_ATTEMPTS = 8  # then give up: worst case about 8 * 2 s + backoff, bounded

# Stats keys copied verbatim into a turn row (the derived ones are computed in `turn_row`).
COPIED_STATS = ("speculation", "drafter", "draft_len", "temperature", "top_p", "top_k", "seed",
                "new_tokens", "seconds", "ttft_s", "target_calls", "drafted", "accepted",
                "draft_s", "verify_s", "stop_reason", "error", "tree_nodes")


def default_db_path() -> Path:
    """$SPECCHAT_DB, else the platform's per-user data dir (~/.local/share/specchat/stats.db)."""
    if os.environ.get(DB_ENV_VAR):
        return Path(os.environ[DB_ENV_VAR]).expanduser()
    return platformdirs.user_data_path("specchat", appauthor=False) / "stats.db"


def resolve_db_path(path: str | os.PathLike | None) -> str:
    """The `--db` value if given, else the default; "off" passes through (stats disabled)."""
    return str(Path(path).expanduser()) if path else str(default_db_path())


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------
# Schema: sqlite-utils migrations, applied in order, each recorded in _sqlite_migrations.
# Never edit a migration that has shipped; add a new one. m001 is the v1 schema as first released.
MIGRATIONS = Migrations("specchat.stats")


@MIGRATIONS()
def m001_initial(db: Database) -> None:
    db["conversations"].create({
        "id": str, "title": str, "created": str,
        "target": str, "draft": str, "quantization": str, "device": str,
    }, pk="id")
    db["turns"].create({
        "id": int, "conversation_id": str, "idx": int, "created": str,
        "prompt": str, "reply": str,
        "speculation": bool, "drafter": str, "k": int,
        "temperature": float, "top_p": float, "top_k": int, "seed": int,
        "new_tokens": int, "seconds": float, "tokens_per_s": float, "target_calls": int,
        "drafted": int, "accepted": int, "acceptance_rate": float, "mean_accepted_len": float,
        "stop_reason": str,
    }, pk="id", foreign_keys=[("conversation_id", "conversations", "id")])


@MIGRATIONS()
def m002_owner_timing_positions(db: Database) -> None:
    # Shared demo links: a visitor sees only their own browser session's conversations.
    db["conversations"].add_column("owner", str, not_null_default="local")
    turns = db["turns"]
    turns.transform(rename={"k": "draft_len"})  # the UI and the engine call it draft_len
    for name, col_type in [("ttft_s", float), ("alpha", float), ("draft_s", float),
                           ("verify_s", float), ("accepted_by_position", str),
                           ("drafted_by_position", str), ("error", str)]:
        turns.add_column(name, col_type)
    turns.add_column("interrupted", bool, not_null_default=0)
    db.execute("UPDATE turns SET interrupted = stop_reason IN ('stopped', 'error')")
    turns.create_index(["conversation_id", "idx"])
    db["conversations"].create_index(["owner"])


@MIGRATIONS()
def m003_ab_baseline(db: Database) -> None:
    # baseline_turn_id: the A/B plain replay (same prompt, speculation off) it is timed against.
    db["turns"].add_column("baseline_turn_id", int)
    db["turns"].add_column("speedup", float)
    # Old spec turns get a speedup over the mean of their plain turns (m006 re-derives every
    # speedup by speedup.py's definition).
    for row in list(db.query("SELECT id FROM conversations")):
        db.execute("""
            UPDATE turns SET speedup = (
                SELECT NULLIF(turns.tokens_per_s, 0) / AVG(plain.tokens_per_s) FROM turns AS plain
                WHERE plain.conversation_id = turns.conversation_id
                  AND NOT plain.speculation AND NOT plain.interrupted AND plain.tokens_per_s > 0
                  AND ROUND(plain.temperature, 4) IS ROUND(turns.temperature, 4))
            WHERE conversation_id = ? AND speculation AND baseline_turn_id IS NULL
        """, [row["id"]])


@MIGRATIONS()
def m004_tree_nodes(db: Database) -> None:
    # The head's draft-tree size (0: chains); NULL on turns recorded before trees existed.
    db["turns"].add_column("tree_nodes", int)


@MIGRATIONS()
def m005_steps(db: Database) -> None:
    # What the inspector shows of a past reply: its tokens (id, text, kind, step) and one row
    # per verification step (the engine's StepRecord: drafted, kept, the decisive test).
    db["turns"].add_column("tokens", str)
    db["steps"].create({
        "id": int, "turn_id": int, "step": int, "drafted": int, "accepted": int,
        "draft_s": float, "verify_s": float, "k": int, "tree_depth": int, "record": str,
    }, pk="id", foreign_keys=[("turn_id", "turns", "id")])
    db["steps"].create_index(["turn_id", "step"])


@MIGRATIONS()
def m006_speedup_basis(db: Database) -> None:
    # What each speedup was compared with (speedup.py's one definition), re-derived for every
    # stored turn. (refresh_speedups must keep working on this schema; if a later migration
    # changes its columns, freeze a copy of it here.)
    db["turns"].add_column("speedup_baseline", float)
    db["turns"].add_column("speedup_note", str)
    for row in list(db.query("SELECT id FROM conversations")):
        refresh_speedups(db, row["id"])


@MIGRATIONS()
def m007_speedup_estimates(db: Database) -> None:
    # A speedup is measured against the turn's A/B plain run or estimated from its own steps,
    # never a ratio to another prompt's reply: which of the two (speedup_basis) and an
    # estimate's band. Every stored figure is derived once more by that definition, from what
    # is kept with its turn.
    db["turns"].add_column("speedup_basis", str)
    db["turns"].add_column("speedup_low", float)
    db["turns"].add_column("speedup_high", float)
    for row in list(db.query("SELECT id FROM conversations")):
        refresh_speedups(db, row["id"])


@MIGRATIONS()
def m008_turn_settings(db: Database) -> None:
    # The page's settings a turn was asked with (mode, drafter, samplers, penalties, system
    # prompt), so a conversation reopened in the chat continues as it was held.
    db["turns"].add_column("settings", str)
    # A reply taken back in the page (Retry, Undo): its figures stay, the conversation
    # reopened leaves it out.
    db["turns"].add_column("withdrawn", bool, not_null_default=0)


STEP_COLUMNS = ("step", "drafted", "accepted", "draft_s", "verify_s", "k", "tree_depth")


# ---------------------------------------------------------------------------------------------
# Pure helpers (no connection): what a turn row holds, and how the numbers derive.

def turn_row(conversation_id: str, prompt: str, reply: str, stats: Mapping | Any) -> dict:
    """One `turns` row from a `GenerationStats` (dataclass or its to_json() dict)."""
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        stats = dataclasses.asdict(stats)
    row = {key: stats.get(key) for key in COPIED_STATS}
    row.update(conversation_id=conversation_id, created=now_iso(), prompt=prompt, reply=reply)
    row["speculation"] = bool(row["speculation"])
    drafted = int(stats.get("drafted") or 0)
    accepted = int(stats.get("accepted") or 0)
    rejections = int(stats.get("rejections") or 0)
    drafted_by_pos = list(stats.get("drafted_by_position") or [])
    new_tokens, seconds = int(stats.get("new_tokens") or 0), float(stats.get("seconds") or 0.0)
    # Re-derived from the counts so every reader agrees on one definition (docs/design.md):
    # acceptance_rate = accepted / drafted, alpha = accepted / (accepted + rejections).
    # NULL, not 0, where nothing was drafted: averages then skip plain turns.
    row["acceptance_rate"] = accepted / drafted if drafted else None
    tested = accepted + rejections
    row["alpha"] = accepted / tested if tested else None
    # Every speculative step drafts at least one token, so drafted_by_position[0] counts them;
    # each step emits its accepted tokens plus one from the target.
    steps = drafted_by_pos[0] if drafted_by_pos else 0
    row["mean_accepted_len"] = ((accepted + steps) / steps if steps
                                else stats.get("mean_accepted_len") or None)
    row["tokens_per_s"] = new_tokens / seconds if seconds > 0 else float(
        stats.get("tokens_per_s") or 0.0)
    row["accepted_by_position"] = json.dumps(list(stats.get("accepted_by_position") or []))
    row["drafted_by_position"] = json.dumps(drafted_by_pos)
    row["interrupted"] = row["stop_reason"] in INTERRUPTED_REASONS
    return row


SPEEDUP_INPUTS = ("id", "speculation", "new_tokens", "seconds", "tokens_per_s", "temperature",
                  "stop_reason", "interrupted", "baseline_turn_id")


def _step_records(db: Database, turn_ids: list[int]) -> dict[int, list[dict]]:
    """turn id -> its stored step records (StepRecord.to_json() dicts), in order."""
    if not turn_ids:
        return {}
    found: dict[int, list[dict]] = {}
    rows = db.query(f"SELECT turn_id, record FROM steps WHERE turn_id IN "
                    f"({', '.join('?' * len(turn_ids))}) ORDER BY turn_id, step", turn_ids)
    for row in rows:
        found.setdefault(row["turn_id"], []).append(json.loads(row["record"]))
    return found


def baseline_row(db: Database, turn_id: int | None) -> dict | None:
    """The numbers of a turn that serves as an A/B baseline, or None."""
    if turn_id is None:
        return None
    rows = list(db.query(f"SELECT {', '.join(SPEEDUP_INPUTS)} FROM turns WHERE id = ?",
                         [turn_id]))
    return rows[0] if rows else None


def refresh_speedups(db: Database, conversation_id: str) -> None:
    """Derive every turn's figure of the conversation from what is kept with it: its A/B
    run, else its own steps (`speedup.conversation_speedups`). Only migrations call it: a
    recorded turn's figure never changes afterwards. Writes the figure's columns that the
    schema has (a migration may run it before later columns exist)."""
    columns = ", ".join(SPEEDUP_INPUTS)
    turns = list(db.query(f"SELECT {columns} FROM turns WHERE conversation_id = ? ORDER BY idx",
                          [conversation_id]))
    # An A/B run is recorded in its turn's conversation; one kept elsewhere is looked up too.
    outside = sorted({t["baseline_turn_id"] for t in turns} - {t["id"] for t in turns} - {None})
    others = list(db.query(f"SELECT {columns} FROM turns WHERE id IN "
                           f"({', '.join('?' * len(outside))})", outside)) if outside else []
    steps = _step_records(db, [t["id"] for t in turns])
    present = [c for c in Speedup().row() if c in db["turns"].columns_dict]
    db.conn.executemany(
        f"UPDATE turns SET {', '.join(f'{c} = ?' for c in present)} WHERE id = ?",
        [(*(result.row()[c] for c in present), turn["id"])
         for turn, result in zip(turns, conversation_speedups(turns, others, steps))])


def conversation_row(id: str | None = None, title: str = "", owner: str = "local",  # noqa: A002
                     target: str = "", draft: str = "", quantization: str = "",
                     device: str = "") -> dict:
    """One `conversations` row; a fresh id unless given."""
    return {"id": id or uuid.uuid4().hex, "title": title.strip() or "Untitled",
            "created": now_iso(), "owner": owner or "local", "target": target, "draft": draft,
            "quantization": quantization, "device": device}


def _decode_turn(row: dict) -> dict:
    row = dict(row)
    row["tokens"] = json.loads(row["tokens"]) if row.get("tokens") else []
    row["settings"] = json.loads(row["settings"]) if row.get("settings") else None
    row["speculation"] = bool(row["speculation"])
    row["interrupted"] = bool(row["interrupted"])
    row["withdrawn"] = bool(row.get("withdrawn"))
    for key in ("accepted_by_position", "drafted_by_position"):
        row[key] = json.loads(row[key]) if row[key] else []
    return row


def _is_busy(error: sqlite3.OperationalError) -> bool:
    text = str(error).lower()
    return "locked" in text or "busy" in text


def describe_error(path: str, error: BaseException, opening: bool = True) -> str:
    """A message a user can act on, for a database we cannot open (or, with opening=False,
    a write that failed on a database that opened fine)."""
    text = str(error)
    low = text.lower()
    if "not a database" in low or "malformed" in low or "corrupt" in low:
        what = f"is corrupt ({text})"
        fix = "Move the file away to start fresh."
    elif isinstance(error, OSError) or "readonly" in low or "unable to open" in low:
        what = f"cannot be written ({text})"
        fix = "Check the file and folder permissions, or pass --db PATH."
    elif "locked" in low or "busy" in low:
        what = f"stayed locked by another process ({text})"
        fix = "Close other specchat processes using it, or pass --db PATH."
    else:
        what = f"failed ({text})"
        fix = "Pass --db PATH to use another file."
    consequence = "stats are off" if opening else "this turn's stats were not saved"
    return f"Stats database {path} {what}; chat works, {consequence}. {fix}"


# ---------------------------------------------------------------------------------------------

class StatsStore:
    """Conversations and turns in one SQLite file (or ":memory:").

    One connection per store, shared by gradio's worker threads under a lock (so ":memory:"
    works too); other processes are kept apart by SQLite's file locks. With `quiet=True`
    (what `open_or_disabled` gives the app) no method raises on a database error: the store
    records nothing, reads return empty, and `.error` says why.
    """

    def __init__(self, path: str | os.PathLike = ":memory:", *, quiet: bool = False):
        self.path = str(path)
        self.quiet = quiet
        self.error = ""  # human message when stats are off or the last write failed
        self.db: Database | None = None
        self._lock = threading.RLock()
        if self.path.lower() in OFF_VALUES:
            self.error = "Stats are off (--db off): nothing is recorded."
            return
        try:
            self.db = self._retry(lambda: _open(self.path))
        except (sqlite3.Error, OSError) as error:
            if not quiet:
                raise
            self.error = describe_error(self.path, error)
            log.warning("%s", self.error)

    @classmethod
    def open_or_disabled(cls, path: str | os.PathLike | None = None) -> StatsStore:
        """The app's way in: never raises; a store with `.enabled` False and `.error` set
        when the file is corrupt, unwritable or locked."""
        return cls(resolve_db_path(path), quiet=True)

    @property
    def enabled(self) -> bool:
        return self.db is not None

    def close(self) -> None:
        with self._lock:
            if self.db is not None:
                self.db.close()
                self.db = None

    # -- writes ---------------------------------------------------------------------------------

    def new_conversation(self, title: str = "", owner: str = "local", target: str = "",
                         draft: str = "", quantization: str = "", device: str = "") -> str:
        """Create a conversation; returns its id (an id even when disabled, so callers can
        key on it)."""
        row = conversation_row(title=title, owner=owner, target=target, draft=draft,
                               quantization=quantization, device=device)
        self._write(lambda db: db["conversations"].insert(row), None)
        return row["id"]

    def record_turn(self, conversation_id: str, prompt: str, reply: str, stats: Mapping | Any,
                    baseline_turn_id: int | None = None, conversation: Mapping | None = None,
                    tokens: list[dict] | None = None, steps: list[dict] | None = None,
                    speedup: Speedup | None = None, settings: Mapping | None = None
                    ) -> int | None:
        """Store one finished (or stopped, or failed) reply; returns the turn id. With
        `conversation` (the fields of `conversation_row`), the turn creates its conversation
        when that does not exist yet, in the same transaction. `tokens` and `steps` (the
        engine's TokenEvent / StepRecord `to_json()`s) keep what the inspector shows.
        `speedup` is the figure the turn was shown with; without one the turn's figure is
        derived here, from its A/B run (`baseline_turn_id`) or its own `steps`. `settings`:
        the page's settings it was asked with (ui/state.py `Settings` as a dict)."""
        return self._write(self._turn_writer(conversation_id, prompt, reply, stats,
                                             baseline_turn_id, conversation, tokens, steps,
                                             speedup, settings), None)

    def write_turn(self, conversation_id: str, prompt: str, reply: str, stats: Mapping | Any,
                   baseline_turn_id: int | None = None, conversation: Mapping | None = None,
                   tokens: list[dict] | None = None, steps: list[dict] | None = None,
                   speedup: Speedup | None = None, settings: Mapping | None = None) -> int:
        """`record_turn` in one attempt that raises on any failure (`sqlite3.Error`,
        `LookupError`), whatever `quiet` says: for `StatsWriter`, which retries by itself."""
        if self.db is None:
            raise sqlite3.OperationalError(self.error or "the stats database is not open")
        return self._transaction(self._turn_writer(conversation_id, prompt, reply, stats,
                                                   baseline_turn_id, conversation, tokens,
                                                   steps, speedup, settings))

    @staticmethod
    def _turn_writer(conversation_id, prompt, reply, stats, baseline_turn_id, conversation,
                     tokens=None, steps=None, speedup=None, settings=None
                     ) -> Callable[[Database], int]:
        row = turn_row(conversation_id, prompt, reply, stats)
        row["baseline_turn_id"] = baseline_turn_id
        if settings is not None:
            row["settings"] = json.dumps(dict(settings), ensure_ascii=False)
        if tokens is not None:
            row["tokens"] = json.dumps([[t["id"], t["text"], t["kind"], t["step"],
                                         t["step_drafted"], t["step_accepted"]]
                                        for t in tokens], ensure_ascii=False)

        def write(db: Database) -> int:
            if conversation is not None:
                db["conversations"].insert(conversation_row(id=conversation_id, **conversation),
                                           ignore=True)
            if not db["conversations"].count_where("id = ?", [conversation_id]):
                raise KeyError(f"no conversation {conversation_id!r}")
            # Inside the write lock, so two writers never take the same index.
            row["idx"] = db.execute("SELECT COALESCE(MAX(idx), 0) + 1 FROM turns "
                                    "WHERE conversation_id = ?", [conversation_id]).fetchone()[0]
            baseline = baseline_row(db, baseline_turn_id)
            if baseline_turn_id is not None and baseline is None:
                raise KeyError(f"no baseline turn {baseline_turn_id}")
            # The figure is fixed here, once: later turns never change it.
            figure = speedup or turn_speedup(
                {**row, "drafts_reported": field(stats, "drafts_reported", True)}, baseline,
                steps or ())
            turn_id = db["turns"].insert({**row, **figure.row()}).last_pk
            if steps:
                db["steps"].insert_all(
                    [{"turn_id": turn_id, **{key: step.get(key) for key in STEP_COLUMNS},
                      "record": json.dumps(step, ensure_ascii=False)} for step in steps])
            return turn_id

        return write

    def delete_conversation(self, conversation_id: str, owner: str | None = None) -> bool:
        """Delete a conversation and its turns; `owner` (None = anyone) must match."""
        def write(db: Database) -> bool:
            if not self._visible(db, conversation_id, owner):
                return False
            turn_ids = "SELECT id FROM turns WHERE conversation_id = ?"
            # Keep the speedup numbers that were measured against these turns, drop the link.
            db.execute(f"UPDATE turns SET baseline_turn_id = NULL "
                       f"WHERE baseline_turn_id IN ({turn_ids})", [conversation_id])
            db.execute(f"DELETE FROM steps WHERE turn_id IN ({turn_ids})", [conversation_id])
            db.execute("DELETE FROM turns WHERE conversation_id = ?", [conversation_id])
            db.execute("DELETE FROM conversations WHERE id = ?", [conversation_id])
            return True

        return self._write(write, False)

    def withdraw_turn(self, turn_id: int, owner: str | None = None) -> bool:
        """Mark a turn taken back (Retry, Undo): kept for the stats, left out of the
        conversation when it is reopened. `owner` (None = anyone) must match."""
        def write(db: Database) -> bool:
            found = db.execute(
                "SELECT 1 FROM turns AS t JOIN conversations AS c ON c.id = t.conversation_id "
                "WHERE t.id = ? AND (? IS NULL OR c.owner = ?)", [turn_id, owner, owner]
            ).fetchone()
            if found:
                db.execute("UPDATE turns SET withdrawn = 1 WHERE id = ?", [turn_id])
            return bool(found)

        return self._write(write, False)

    def rename_conversation(self, conversation_id: str, title: str,
                            owner: str | None = None) -> bool:
        """Give a conversation a new title; `owner` (None = anyone) must match."""
        def write(db: Database) -> bool:
            if not self._visible(db, conversation_id, owner):
                return False
            db["conversations"].update(conversation_id, {"title": title})
            return True

        return self._write(write, False)

    # -- reads ----------------------------------------------------------------------------------

    def conversations(self, owner: str | None = None) -> list[dict]:
        """Conversations, newest first, with turn count, acceptance (all accepted / all
        drafted) and mean speedup (`speedup.conversation_speedup`: the geometric mean of its
        A/B pairs, else of its estimates, with `speedup_basis`, `speedup_turns` counted,
        `spec_turns` in all and a `speedup_note` saying what it summarizes). `owner` None =
        everyone's."""
        sql = """
            SELECT c.id, c.title, c.created, c.owner, c.target, c.draft, c.quantization, c.device,
                   COUNT(t.id) AS turns, COALESCE(MAX(t.created), c.created) AS updated,
                   MAX(t.id) AS last_turn,
                   CAST(SUM(t.accepted) AS REAL) / NULLIF(SUM(t.drafted), 0) AS acceptance,
                   AVG(CASE WHEN t.speculation THEN t.tokens_per_s END) AS spec_tokens_per_s,
                   AVG(CASE WHEN NOT t.speculation THEN t.tokens_per_s END) AS plain_tokens_per_s
            FROM conversations AS c LEFT JOIN turns AS t ON t.conversation_id = c.id
            WHERE :owner IS NULL OR c.owner = :owner
            GROUP BY c.id ORDER BY c.created DESC, c.rowid DESC
        """
        speedups_sql = """
            SELECT t.conversation_id, t.speculation, t.speedup, t.speedup_basis, t.speedup_note
            FROM turns AS t JOIN conversations AS c ON c.id = t.conversation_id
            WHERE :owner IS NULL OR c.owner = :owner ORDER BY t.conversation_id, t.idx
        """

        def read(db: Database) -> list[dict]:
            rows = list(db.query(sql, {"owner": owner}))
            by_conversation: dict[str, list[dict]] = {}
            for turn in db.query(speedups_sql, {"owner": owner}):
                by_conversation.setdefault(turn["conversation_id"], []).append(turn)
            for row in rows:
                mean = conversation_speedup(by_conversation.get(row["id"], []))
                row.update(mean_speedup=mean.mean, speedup_basis=mean.basis,
                           speedup_turns=mean.counted, spec_turns=mean.speculative,
                           speedup_note=mean.note)
            return rows

        return self._read(read, [])

    def matching(self, text: str, owner: str | None = None) -> set[str]:
        """The ids of the visible conversations whose title, or one of whose prompts or
        replies, holds `text` (case-insensitive for ASCII letters, as SQLite's LIKE)."""
        pattern = "%" + re.sub(r"([\\%_])", r"\\\1", text) + "%"
        sql = """
            SELECT c.id FROM conversations AS c
            WHERE (:owner IS NULL OR c.owner = :owner)
              AND (c.title LIKE :p ESCAPE '\\' OR EXISTS (
                   SELECT 1 FROM turns AS t WHERE t.conversation_id = c.id
                   AND (t.prompt LIKE :p ESCAPE '\\' OR t.reply LIKE :p ESCAPE '\\')))
        """
        return self._read(lambda db: {row["id"] for row in db.query(
            sql, {"owner": owner, "p": pattern})}, set())

    def conversation(self, conversation_id: str, owner: str | None = None) -> dict | None:
        """One row of `conversations(owner)`, or None when missing or not the owner's."""
        return next((c for c in self.conversations(owner) if c["id"] == conversation_id), None)

    def turns(self, conversation_id: str, owner: str | None = None) -> list[dict]:
        """A conversation's turns in order (position lists decoded); [] if not the owner's."""
        def read(db: Database) -> list[dict]:
            if not self._visible(db, conversation_id, owner):
                return []
            rows = db.query("SELECT * FROM turns WHERE conversation_id = ? ORDER BY idx",
                            [conversation_id])
            return [_decode_turn(row) for row in rows]

        return self._read(read, [])

    def steps(self, turn_id: int, owner: str | None = None) -> list[dict]:
        """A turn's step records (the engine's StepRecord as dicts), in order; [] when the
        turn is missing, kept no steps, or is not the owner's."""
        def read(db: Database) -> list[dict]:
            rows = list(db.query(
                "SELECT s.record FROM steps AS s JOIN turns AS t ON t.id = s.turn_id "
                "JOIN conversations AS c ON c.id = t.conversation_id "
                "WHERE s.turn_id = :turn AND (:owner IS NULL OR c.owner = :owner) "
                "ORDER BY s.step", {"turn": turn_id, "owner": owner}))
            return [json.loads(r["record"]) for r in rows]

        return self._read(read, [])

    def export_steps_csv(self, path_or_file: str | os.PathLike | IO[str],
                         conversation_id: str | None = None, owner: str | None = None) -> int:
        """One CSV row per verification step of the visible turns; returns the row count."""
        rows = []
        for c in self.conversations(owner):
            if conversation_id is not None and c["id"] != conversation_id:
                continue
            for turn in self.turns(c["id"], owner):
                for step in self.steps(turn["id"], owner):
                    evidence = step.get("evidence") or {}
                    rows.append({"conversation_id": c["id"], "turn": turn["idx"],
                                 "turn_id": turn["id"],
                                 **{key: step.get(key) for key in STEP_COLUMNS},
                                 "proposal_text": step.get("proposal_text"),
                                 "rejected_text": evidence.get("rejected_text"),
                                 "token_text": evidence.get("token_text"),
                                 "p": evidence.get("p"), "q": evidence.get("q"),
                                 "accept_prob": evidence.get("accept_prob")})
        return _export(path_or_file, rows, ["conversation_id", "turn", "step"])

    def find_conversation(self, id_or_prefix: str, owner: str | None = None) -> str | None:
        """Full id from a unique prefix (the CLI shows 8 characters)."""
        matches = [c["id"] for c in self.conversations(owner) if c["id"].startswith(id_or_prefix)]
        return matches[0] if len(matches) == 1 else None

    def summary_rows(self, owner: str | None = None) -> list[dict]:
        """What the Stats tab's table and `specchat stats` show, one dict per conversation."""
        return [{"id": c["id"], "title": c["title"], "created": c["created"], "owner": c["owner"],
                 "target": c["target"], "draft": c["draft"],
                 "models": models_label(c["target"], c["draft"]), "turns": c["turns"],
                 "mean_speedup": c["mean_speedup"], "speedup_basis": c["speedup_basis"],
                 "speedup_turns": c["speedup_turns"],
                 "spec_turns": c["spec_turns"], "speedup_note": c["speedup_note"],
                 "acceptance": c["acceptance"], "spec_tokens_per_s": c["spec_tokens_per_s"],
                 "plain_tokens_per_s": c["plain_tokens_per_s"]}
                for c in self.conversations(owner)]

    def export_csv(self, path_or_file: str | os.PathLike | IO[str],
                   conversation_id: str | None = None, owner: str | None = None) -> int:
        """Write one CSV row per turn (with its conversation's columns); returns the row count."""
        conversations = self.conversations(owner)
        if conversation_id is not None:
            conversations = [c for c in conversations if c["id"] == conversation_id]
        rows = [{"conversation_id": c["id"], "conversation_title": c["title"],
                 "target": c["target"], "draft": c["draft"], "quantization": c["quantization"],
                 "device": c["device"], "owner": c["owner"],
                 "conversation_mean_speedup": c["mean_speedup"],
                 "conversation_speedup_of": c["speedup_note"],
                 **{key: value for key, value in turn.items() if key != "tokens"}}
                for c in conversations for turn in self.turns(c["id"], owner)]
        return _export(path_or_file, rows, ["conversation_id", "conversation_title"])

    # -- plumbing -------------------------------------------------------------------------------

    @staticmethod
    def _visible(db: Database, conversation_id: str, owner: str | None) -> bool:
        where, params = "id = ?", [conversation_id]
        if owner is not None:
            where, params = "id = ? AND owner = ?", [conversation_id, owner]
        return bool(db["conversations"].count_where(where, params))

    def _write(self, fn: Callable[[Database], T], default: T) -> T:
        return self._guarded(lambda: self._transaction(fn), default)

    def _transaction(self, fn: Callable[[Database], T]) -> T:
        """fn(db) in one transaction that holds the write lock from its first statement."""
        with self._lock:
            if self.db is None:  # closed meanwhile (the app stopping): the writer reports it
                raise sqlite3.OperationalError(self.error or "the stats database is not open")
            # BEGIN IMMEDIATE, not BEGIN: a deferred transaction that reads and then writes
            # gets SQLITE_BUSY at once (no busy wait) if another process wrote meanwhile.
            self.db.conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(self.db)
                self.db.conn.execute("COMMIT")
            except BaseException:
                self.db.rollback()
                raise
            return result

    def _read(self, fn: Callable[[Database], T], default: T) -> T:
        def attempt() -> T:
            with self._lock:
                return fn(self.db)

        return self._guarded(attempt, default)

    def _guarded(self, attempt: Callable[[], T], default: T) -> T:
        if self.db is None:
            return default
        try:
            return self._retry(attempt)
        except (sqlite3.Error, LookupError, OverflowError) as error:
            # LookupError: an unknown conversation or turn id; OverflowError: a number SQLite
            # cannot hold. Neither may fail the chat.
            if not self.quiet:
                raise
            self.error = describe_error(self.path, error, opening=False)
            log.warning("%s", self.error)
            return default

    @staticmethod
    def _retry(attempt: Callable[[], T]) -> T:
        """Retry while another connection holds the lock longer than the busy timeout."""
        for n in range(1, WRITE_ATTEMPTS + 1):
            try:
                return attempt()
            except sqlite3.OperationalError as error:
                if not _is_busy(error) or n == WRITE_ATTEMPTS:
                    raise
                # Jittered backoff so writers that collided do not collide again.
                time.sleep(min(0.05 * 2 ** n, 1.0) * random.uniform(0.5, 1.5))
        raise AssertionError("unreachable")


def _open(path: str) -> Database:
    """Connect, switch to WAL and bring the schema up to date (in one write transaction, so two
    processes opening a new file at once do not both create the tables)."""
    if path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    # timeout= is SQLite's busy_timeout; check_same_thread=False because gradio calls us from
    # worker threads (the store's lock serializes them).
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
    try:
        db = Database(conn)
        if path != ":memory:":
            db.enable_wal()
        conn.execute("BEGIN IMMEDIATE")
        try:
            MIGRATIONS.apply(db)
            # A file we may read but not write opens fine and BEGIN IMMEDIATE passes; a write
            # statement (even one touching no row) fails now rather than at the first reply.
            conn.execute("DELETE FROM conversations WHERE 0")
            conn.execute("COMMIT")
        except BaseException:
            db.rollback()
            raise
        return db
    except BaseException:
        conn.close()
        raise


def _export(path_or_file: str | os.PathLike | IO[str], rows: list[dict],
            empty_columns: list[str]) -> int:
    """Rows as CSV to a path or an open file; returns the row count."""
    columns = list(rows[0]) if rows else empty_columns
    if isinstance(path_or_file, (str, os.PathLike)):
        with open(path_or_file, "w", newline="", encoding="utf-8") as f:
            _write_csv(f, columns, rows)
    else:
        _write_csv(path_or_file, columns, rows)
    return len(rows)


def _write_csv(f: IO[str], columns: list[str], rows: list[dict]) -> None:
    writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _cell(json.dumps(v, ensure_ascii=False) if isinstance(v, list)
                                  else v) for k, v in row.items()})


def _cell(value):
    """A text cell a spreadsheet would run as a formula (=, +, -, @ first) gets a leading
    apostrophe: prompts and replies are data, never commands (OWASP's CSV injection advice)."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value
