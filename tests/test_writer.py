"""Saving turns off the reply path (`stats.writer.StatsWriter`): a locked database delays no
reply and loses no turn, every turn creates its conversation, a turn that cannot be saved is
reported, and the warning clears once writing works again."""

from __future__ import annotations

import logging
import sqlite3
import time

import pytest
from tiny import byte_tokenizer, loaded, tiny_llama

from specchat.core.engine import Engine
from specchat.core.events import GenerationStats
from specchat.drafters.ngram import NgramDrafter
from specchat.stats.store import StatsStore
from specchat.stats.writer import StatsWriter
from specchat.ui.handlers import ChatApp
from specchat.ui.state import Session, Settings

HOLD_S = 8.0  # how long another process keeps the database locked: several busy timeouts


def stats(tokens=5) -> dict:
    return GenerationStats(new_tokens=tokens, seconds=1.0, stop_reason="eos").to_json()


def conversation(owner="local") -> dict:
    return dict(title="t", owner=owner, target="tiny", draft="", quantization="none",
                device="cpu")


def test_the_first_turn_creates_its_conversation(tmp_path):
    store = StatsStore(tmp_path / "s.db")
    writer = StatsWriter(store)
    first = writer.submit("c1", "q1", "r1", stats(), conversation())
    second = writer.submit("c1", "q2", "r2", stats(), conversation(), baseline=first)
    assert writer.flush(10)
    assert first.result() and second.result()
    assert [t["prompt"] for t in store.turns("c1")] == ["q1", "q2"]
    assert store.turns("c1")[1]["baseline_turn_id"] == first.result()
    assert store.conversation("c1")["title"] == "t" and writer.error == ""
    writer.close()


def test_a_turn_that_cannot_be_saved_is_reported_and_the_next_clears_it(tmp_path, caplog):
    store = StatsStore(tmp_path / "s.db")
    writer = StatsWriter(store)
    too_big = dict(stats(), seed=2**64)  # SQLite holds 64-bit signed integers
    with caplog.at_level(logging.WARNING, logger="specchat.stats.writer"):
        lost = writer.submit("c1", "doomed prompt", "r", too_big, conversation())
        assert writer.flush(10)
    assert lost.result() is None and writer.lost == 1
    assert "doomed prompt" in writer.error and "not saved" in caplog.text
    assert writer.submit("c1", "fine", "r", stats(), conversation()).result(10)
    assert writer.error == ""  # writing works again: the warning is gone
    assert [t["prompt"] for t in store.turns("c1")] == ["fine"]
    writer.close()


def test_a_store_closed_while_its_writer_saves_gives_the_writer_a_database_error():
    """The app closes its store when it stops. A turn the writer had begun to save then meets a
    database error (the turn is lost, and the writer says so), not an exception on the writer's
    thread: the store checks that it is open under the lock its writes take."""
    store = StatsStore(":memory:")
    writer = store._turn_writer("c1", "late prompt", "r", stats(), None, conversation())
    store.close()
    with pytest.raises(sqlite3.OperationalError, match="not open"):
        store._transaction(writer)


def test_turns_wait_for_a_locked_database_and_are_lost_only_after_keep_for(tmp_path):
    path = tmp_path / "s.db"
    store = StatsStore(path)
    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN EXCLUSIVE")
    writer = StatsWriter(store, keep_for_s=0.5)
    lost = writer.submit("c1", "q", "r", stats(), conversation())
    assert lost.result(timeout=30) is None and writer.lost == 1
    blocker.execute("ROLLBACK")
    assert writer.submit("c1", "q2", "r", stats(), conversation()).result(30)
    writer.close()


@pytest.fixture(scope="module")
def engine():
    return Engine(loaded(tiny_llama(0), byte_tokenizer()), {"ngram": NgramDrafter()})


def reply_seconds(app, session, text) -> float:
    start = time.perf_counter()
    box, _, _, notice = app.user(text, session)
    assert box == "" and notice == "", notice
    for _ in app.bot(session, Settings(max_new_tokens=16, seed=0)):
        pass
    return time.perf_counter() - start


def test_a_database_locked_for_seconds_delays_no_reply_and_loses_no_turn(engine, tmp_path):
    path = tmp_path / "stats.db"
    store = StatsStore.open_or_disabled(path)
    app = ChatApp(engine, store, min_interval=0.0)
    session = Session()
    unlocked = reply_seconds(app, session, "before the lock")
    assert app.writer.flush(10)

    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN EXCLUSIVE")  # another process holds the file: no reads, no writes
    locked_at = time.monotonic()
    for i in range(3):  # replies while it is held: each as quick as without the lock
        assert reply_seconds(app, session, f"during the lock {i}") < unlocked + 1.0
    time.sleep(3)  # the writer has tried and is waiting: the page says so
    assert "locked" in app.writer.error and "waiting" in app.writer.error
    time.sleep(max(0.0, HOLD_S - (time.monotonic() - locked_at)))
    blocker.execute("ROLLBACK")

    assert app.writer.flush(30)
    prompts = [t["prompt"] for t in store.turns(session.conversation_id)]
    assert prompts == ["before the lock"] + [f"during the lock {i}" for i in range(3)]
    assert app.writer.error == "" and app.writer.lost == 0
    app.writer.close()
