"""Turns written to the stats database from one background thread.

A reply must never wait on SQLite: another process may hold the database locked for seconds
(a `BEGIN EXCLUSIVE`, a backup, a slow disk). `StatsWriter.submit` queues the turn and returns at
once; the writer thread saves queued turns in order, each in one transaction that also creates
its conversation (so no turn depends on an earlier write having worked). While the database is
locked, turns wait in the queue and are retried with a growing pause for up to `keep_for_s`;
a turn that cannot be saved (locked too long, a corrupt or read-only file, a value SQLite cannot
hold) is logged as lost, one warning per turn. `error` says what is happening now and clears
once a write succeeds again.

The writer has a connection of its own (a file database), so readers of the main store (the
Stats tab) are never held up behind a write that is waiting for a lock.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from specchat.stats.speedup import Speedup
from specchat.stats.store import StatsStore

log = logging.getLogger(__name__)

MAX_QUEUED = 1000  # turns waiting for a locked database; beyond this the oldest is lost
KEEP_FOR_S = 600.0  # how long a turn waits for a locked database before it is reported lost
MAX_PAUSE_S = 5.0  # longest pause between attempts on a locked database


@dataclass
class PendingTurn:
    """One reply to save: `StatsStore.write_turn`'s arguments, the baseline as another pending
    turn's future (a race's plain run, queued just before)."""
    conversation_id: str
    prompt: str
    reply: str
    stats: dict
    conversation: dict  # the fields of `store.conversation_row`, for its first turn
    baseline: Future | None = None
    tokens: list[dict] | None = None  # TokenEvent.to_json()s: what the inspector re-renders
    steps: list[dict] | None = None  # StepRecord.to_json()s
    speedup: Speedup | None = None  # the figure the turn was shown with (None: derived)
    settings: dict | None = None  # the page's settings it was asked with
    future: Future = field(default_factory=Future)  # the turn id, or None when lost
    queued_at: float = field(default_factory=time.monotonic)


class StatsWriter:
    def __init__(self, store: StatsStore, keep_for_s: float = KEEP_FOR_S,
                 max_queued: int = MAX_QUEUED):
        self.store = store
        self.keep_for_s, self.max_queued = keep_for_s, max_queued
        self.lost = 0  # turns given up on since the start
        self._error = ""
        self._queue: deque[PendingTurn] = deque()
        self._cond = threading.Condition()
        self._busy = False  # a turn is being written
        self._closed = False
        self._db: StatsStore | None = None  # the writer thread's own connection
        self._thread = threading.Thread(target=self._run, name="specchat-stats", daemon=True)
        if store.enabled:
            self._thread.start()

    @property
    def error(self) -> str:
        """What is wrong with saving right now ("" when writes work)."""
        return self._error

    def submit(self, conversation_id: str, prompt: str, reply: str, stats: dict,
               conversation: dict, baseline: Future | None = None,
               tokens: list[dict] | None = None, steps: list[dict] | None = None,
               speedup: Speedup | None = None, settings: dict | None = None) -> Future:
        """Queue a turn; returns a future of its row id (None when it could not be saved).
        `speedup`: the figure the page showed for it, kept as it is; `settings`: the page's
        settings it was asked with."""
        turn = PendingTurn(conversation_id, prompt, reply, stats, conversation, baseline,
                           tokens, steps, speedup, settings)
        if not self.store.enabled:
            turn.future.set_result(None)
            return turn.future
        with self._cond:
            if len(self._queue) >= self.max_queued:
                self._lose(self._queue.popleft(), "too many turns were waiting")
            self._queue.append(turn)
            self._cond.notify_all()
        return turn.future

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued turn is saved or lost; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float = 5.0) -> None:
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- the writer thread ---------------------------------------------------------------------

    def _run(self) -> None:
        attempts = 0
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed and not self._queue:
                    return
                turn, self._busy = self._queue[0], True
            outcome = self._attempt(turn)
            with self._cond:
                if outcome == "retry" and turn in self._queue:
                    waiting = len(self._queue)
                else:
                    if turn in self._queue:
                        self._queue.remove(turn)
                    waiting = 0
            if outcome == "saved":
                attempts, self._error = 0, ""
            elif outcome == "retry":
                attempts += 1
                self._error = (f"The stats database is locked by another process; {waiting} "
                               "turn(s) are waiting and will be saved when it frees.")
                with self._cond:  # a pause that `close` can cut short
                    self._cond.wait(min(0.1 * 2 ** attempts, MAX_PAUSE_S))

    def _attempt(self, turn: PendingTurn) -> str:
        """Write one turn: "saved", "retry" (locked) or "lost"."""
        try:
            baseline = turn.baseline.result(timeout=0) if turn.baseline is not None else None
        except Exception:  # noqa: BLE001 (the baseline was lost: time against nothing)
            baseline = None
        try:
            turn_id = self._connection().write_turn(
                turn.conversation_id, turn.prompt, turn.reply, turn.stats, baseline,
                turn.conversation, turn.tokens, turn.steps, turn.speedup, turn.settings)
        except sqlite3.OperationalError as error:
            text = str(error).lower()
            if ("locked" in text or "busy" in text) and \
                    time.monotonic() - turn.queued_at < self.keep_for_s:
                return "retry"
            self._lose(turn, str(error))
            return "lost"
        except (sqlite3.Error, LookupError, OverflowError, ValueError) as error:
            self._lose(turn, str(error))
            return "lost"
        turn.future.set_result(turn_id)
        return "saved"

    def _connection(self) -> StatsStore:
        if self._db is None:
            if self.store.path == ":memory:":  # one database per connection: share it
                self._db = self.store
            else:
                self._db = StatsStore(self.store.path)  # raises while locked: retried
        return self._db

    def _lose(self, turn: PendingTurn, why: str) -> None:
        self.lost += 1
        prompt = turn.prompt if len(turn.prompt) <= 40 else turn.prompt[:39] + "…"
        self._error = (f"A turn's stats could not be saved ({why}): {prompt!r}. "
                       f"{self.lost} turn(s) lost since the start; the chat is unaffected.")
        log.warning("stats: turn of conversation %s not saved (%s): %r", turn.conversation_id,
                    why, prompt)
        if not turn.future.done():
            turn.future.set_result(None)
