"""The stats store: derived numbers, speedup baselines, migrations, concurrency, crash safety,
unusable files, and the `specchat stats` CLI. Fast, offline, no wall-clock assertions."""

from __future__ import annotations

import argparse
import csv
import io
import json
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from sqlite_utils import Database

from specchat.core.events import GenerationStats
from specchat.stats import store as stats_mod
from specchat.stats.cli import add_cli
from specchat.stats.store import MIGRATIONS, StatsStore, default_db_path, turn_row

REPO = Path(__file__).resolve().parents[1]


def spec_stats(new_tokens=40, seconds=2.0, temperature=0.0, stop_reason="eos") -> GenerationStats:
    # 8 speculative steps with k=4: 12 of 20 drafts accepted, 4 steps ended in a rejection.
    return GenerationStats(new_tokens=new_tokens, seconds=seconds, ttft_s=0.25,
                           tokens_per_s=new_tokens / seconds, target_calls=9, drafted=20,
                           accepted=12, rejections=4, acceptance_rate=0.6, alpha=0.75,
                           mean_accepted_len=2.5, speculation=True, drafter="ngram", draft_len=4,
                           temperature=temperature, seed=7, draft_s=0.1, verify_s=1.5,
                           accepted_by_position=[6, 3, 2, 1], drafted_by_position=[8, 6, 4, 2],
                           stop_reason=stop_reason)


def plain_stats(new_tokens=20, seconds=2.0, temperature=0.0, stop_reason="eos") -> dict:
    return GenerationStats(new_tokens=new_tokens, seconds=seconds, temperature=temperature,
                           tokens_per_s=new_tokens / seconds, target_calls=new_tokens + 1,
                           stop_reason=stop_reason).to_json()


@pytest.fixture
def store():
    s = StatsStore(":memory:")
    yield s
    s.close()


def test_turn_rows_hold_the_derived_numbers(store):
    cid = store.new_conversation("A chat", "local", "gemma-270m", "ngram", "nf4", "cpu")
    t1 = store.record_turn(cid, "Hi", "Hello there", spec_stats())  # the dataclass itself
    t2 = store.record_turn(cid, "More", "Sure", plain_stats())  # its to_json() dict
    # A stopped reply whose stats came with inconsistent derived fields: the counts win.
    messy = spec_stats(stop_reason="stopped").__dict__ | {"acceptance_rate": 0.9, "alpha": 0.1}
    t3 = store.record_turn(cid, "Again", "Par", messy)

    turns = store.turns(cid)
    assert [t["id"] for t in turns] == [t1, t2, t3]
    assert [t["idx"] for t in turns] == [1, 2, 3]
    spec, plain, stopped = turns
    assert spec["speculation"] is True and spec["drafter"] == "ngram" and spec["draft_len"] == 4
    assert spec["acceptance_rate"] == pytest.approx(12 / 20)
    assert spec["alpha"] == pytest.approx(12 / (12 + 4))
    assert spec["mean_accepted_len"] == pytest.approx((12 + 8) / 8)  # (accepted + steps) / steps
    assert spec["tokens_per_s"] == pytest.approx(20.0)
    assert spec["accepted_by_position"] == [6, 3, 2, 1]
    assert spec["drafted_by_position"] == [8, 6, 4, 2]
    assert (spec["ttft_s"], spec["seed"], spec["draft_s"], spec["verify_s"]) == (0.25, 7, 0.1, 1.5)
    assert spec["prompt"] == "Hi" and spec["reply"] == "Hello there"
    assert spec["interrupted"] is False
    # Nothing drafted: acceptance is unknown, not 0, so averages skip plain turns.
    assert plain["speculation"] is False
    assert plain["acceptance_rate"] is None and plain["mean_accepted_len"] is None
    assert plain["speedup"] is None
    assert stopped["interrupted"] is True
    assert stopped["acceptance_rate"] == pytest.approx(0.6)
    assert stopped["alpha"] == pytest.approx(0.75)


def test_turn_row_matches_engine_summary():
    row = turn_row("c", "p", "r", spec_stats())
    assert row["mean_accepted_len"] == pytest.approx(spec_stats().mean_accepted_len)
    assert row["acceptance_rate"] == pytest.approx(spec_stats().acceptance_rate)
    assert row["alpha"] == pytest.approx(spec_stats().alpha)


def test_speedup_against_a_recorded_ab_baseline(store):
    cid = store.new_conversation("ab")
    plain = store.record_turn(cid, "Q", "A", plain_stats(new_tokens=20, seconds=2.0))  # 10 tok/s
    spec = store.record_turn(cid, "Q", "A", spec_stats(new_tokens=50, seconds=2.0),  # 25 tok/s
                             baseline_turn_id=plain)
    row = store.turns(cid)[1]
    assert row["id"] == spec and row["baseline_turn_id"] == plain
    assert row["speedup"] == pytest.approx(2.5)


def test_other_prompts_plain_turns_are_no_baseline(store):
    cid = store.new_conversation("mixed")
    store.record_turn(cid, "1", "r", spec_stats(new_tokens=60, seconds=2.0))  # 30 tok/s
    store.record_turn(cid, "2", "r", plain_stats(new_tokens=20, seconds=2.0))  # 10 tok/s
    store.record_turn(cid, "3", "r", plain_stats(new_tokens=40, seconds=2.0))  # 20 tok/s
    first = store.turns(cid)[0]
    # No A/B run and no steps kept: no figure, rather than 30 over another prompt's 10 or 15.
    assert first["speedup"] is None and first["speedup_basis"] == ""
    assert first["speedup_note"] == "too few steps to estimate from (0)"


def test_conversation_list_summarizes_its_turns(store):
    a = store.new_conversation("first", "sess-a", "gemma", "ngram", "nf4", "cpu")
    plain = store.record_turn(a, "1", "r", plain_stats(new_tokens=20, seconds=2.0))
    store.record_turn(a, "1", "r", spec_stats(new_tokens=40, seconds=2.0), plain)  # 2.0x
    store.record_turn(a, "1", "r", spec_stats(new_tokens=30, seconds=1.0), plain)  # 3.0x
    b = store.new_conversation("second", "sess-b")
    rows = store.conversations()
    assert [r["id"] for r in rows] == [b, a]  # newest first
    row = rows[1]
    assert row["turns"] == 3 and row["title"] == "first" and row["owner"] == "sess-a"
    assert row["mean_speedup"] == pytest.approx((2.0 * 3.0) ** 0.5)  # geometric mean
    assert (row["speedup_turns"], row["spec_turns"], row["speedup_basis"]) == (2, 2, "ab")
    assert row["speedup_note"] == "geometric mean of 2 A/B pairs"
    assert row["acceptance"] == pytest.approx(24 / 40)
    assert row["spec_tokens_per_s"] == pytest.approx(25.0)
    assert row["plain_tokens_per_s"] == pytest.approx(10.0)
    assert rows[0]["turns"] == 0 and rows[0]["mean_speedup"] is None
    assert [r["id"] for r in store.conversations("sess-a")] == [a]
    assert store.summary_rows("sess-a")[0]["models"] == "gemma + ngram"
    assert store.find_conversation(a[:8]) == a


def test_delete_only_by_its_owner(store):
    a = store.new_conversation("a", "sess-a")
    b = store.new_conversation("b", "sess-b")
    t = store.record_turn(b, "q", "r", plain_stats())
    store.record_turn(b, "q", "r", spec_stats(), baseline_turn_id=t)
    assert store.delete_conversation(b, owner="sess-a") is False
    assert store.turns(b, owner="sess-a") == []  # nor read it
    assert len(store.turns(b)) == 2
    assert store.delete_conversation(b, owner="sess-b") is True
    assert store.turns(b) == [] and [c["id"] for c in store.conversations()] == [a]
    assert store.db["turns"].count == 0
    assert store.delete_conversation(a) is True  # owner=None: the app's owner


def test_export_csv(store, tmp_path):
    a = store.new_conversation("a", target="gemma")
    plain = store.record_turn(a, "q1", "r1", plain_stats())
    store.record_turn(a, "q1", "r2, with a comma", spec_stats(), baseline_turn_id=plain)
    b = store.new_conversation("b")
    store.record_turn(b, "q3", "r3", plain_stats())
    out = tmp_path / "all.csv"
    assert store.export_csv(out) == 3
    buffer = io.StringIO()
    assert store.export_csv(buffer, conversation_id=a) == 2
    import csv
    rows = list(csv.DictReader(io.StringIO(buffer.getvalue())))
    assert [r["prompt"] for r in rows] == ["q1", "q1"]
    assert rows[1]["reply"] == "r2, with a comma" and rows[1]["target"] == "gemma"
    assert json.loads(rows[1]["accepted_by_position"]) == [6, 3, 2, 1]
    assert float(rows[1]["speedup"]) == pytest.approx(2.0)
    assert len(list(csv.DictReader(out.open()))) == 3


# ---------------------------------------------------------------------------------------------
# Schema migrations

def test_migrating_a_v1_file_keeps_every_row(tmp_path):
    path = tmp_path / "v1.db"
    db = Database(path)
    MIGRATIONS.apply(db, stop_before="m002_owner_timing_positions")  # the v1 schema
    assert "k" in db["turns"].columns_dict and "owner" not in db["conversations"].columns_dict
    conversations = [{"id": f"c{i}", "title": f"chat {i}", "created": "2025-01-0%dT10:00:00+00:00"
                      % (i + 1), "target": "gemma", "draft": "ngram", "quantization": "nf4",
                      "device": "cpu"} for i in range(3)]
    db["conversations"].insert_all(conversations)
    turns = []
    for i in range(30):
        spec = i % 2 == 1
        turns.append({"conversation_id": f"c{i % 3}", "idx": i // 3 + 1, "created": "2025",
                      "prompt": f"prompt {i}", "reply": f"reply {i}", "speculation": spec,
                      "drafter": "ngram" if spec else "none", "k": 4 if spec else 0,
                      "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": i,
                      "new_tokens": 10 + i, "seconds": 1.0, "tokens_per_s": 10.0 + i,
                      "target_calls": 5, "drafted": 8 if spec else 0, "accepted": 4 if spec else 0,
                      "acceptance_rate": 0.5 if spec else None,
                      "mean_accepted_len": 2.0 if spec else None,
                      "stop_reason": "stopped" if i == 5 else "eos"})
    db["turns"].insert_all(turns)
    db.close()

    store = StatsStore(path)
    assert [m.name for m in MIGRATIONS.applied(store.db)] == [
        "m001_initial", "m002_owner_timing_positions", "m003_ab_baseline", "m004_tree_nodes",
        "m005_steps", "m006_speedup_basis", "m007_speedup_estimates", "m008_turn_settings"]
    assert store.db["conversations"].count == 3 and store.db["turns"].count == 30
    got = {t["prompt"]: t for c in conversations for t in store.turns(c["id"])}
    for i, old in enumerate(turns):
        new = got[f"prompt {i}"]
        assert new["draft_len"] == old["k"]  # renamed column, values kept
        for key in ("conversation_id", "idx", "reply", "new_tokens", "tokens_per_s", "seed",
                    "acceptance_rate", "stop_reason"):
            assert new[key] == old[key], key
        assert new["interrupted"] is (i == 5)
        assert new["accepted_by_position"] == []
    assert {c["owner"] for c in store.conversations()} == {"local"}
    # Speedups derived by today's definition: a v1 file kept no A/B runs and no steps, so no
    # turn has a figure, and none is a ratio to another prompt's reply.
    for turn in store.turns("c1"):
        assert turn["speedup"] is None
        if turn["speculation"]:
            assert turn["speedup_note"] == "too few steps to estimate from (0)"
    # The stopped speculative turn says why it has none.
    (stopped,) = [t for t in store.turns("c2") if t["prompt"] == "prompt 5"]
    assert stopped["speedup"] is None and "stopped" in stopped["speedup_note"]
    # The upgraded file takes new turns, and opening it again changes nothing.
    store.record_turn("c0", "new", "turn", spec_stats())
    store.close()
    again = StatsStore(path)
    assert again.db["turns"].count == 31 and len(MIGRATIONS.applied(again.db)) == 8
    again.close()


def test_migrating_replaces_cross_prompt_figures_and_keeps_ab_pairs(tmp_path):
    from specchat.core.events import StepRecord
    path = tmp_path / "m006.db"
    db = Database(path)
    MIGRATIONS.apply(db, stop_before="m007_speedup_estimates")
    db["conversations"].insert({"id": "c", "title": "t", "created": "2026", "owner": "local"})
    common = {"conversation_id": "c", "created": "2026", "reply": "r", "seconds": 2.0,
              "temperature": 0.0, "stop_reason": "eos", "interrupted": False}
    db["turns"].insert_all([
        # A speculative turn that was divided by another prompt's plain reply: 10x.
        {**common, "id": 1, "idx": 1, "prompt": "fast", "speculation": True, "new_tokens": 40,
         "tokens_per_s": 20.0, "speedup": 10.0, "speedup_note": "vs the plain turn"},
        {**common, "id": 2, "idx": 2, "prompt": "slow", "speculation": False, "new_tokens": 4,
         "tokens_per_s": 2.0},
        # An A/B pair of one prompt.
        {**common, "id": 3, "idx": 3, "prompt": "q", "speculation": False, "new_tokens": 20,
         "tokens_per_s": 10.0},
        {**common, "id": 4, "idx": 4, "prompt": "q", "speculation": True, "new_tokens": 30,
         "tokens_per_s": 15.0, "baseline_turn_id": 3, "speedup": 1.5},
    ])
    # The first turn kept its steps: it gets an estimate from them.
    records = [StepRecord(i + 1, 2, 2, 3, 0.001, 0.010) for i in range(5)] + \
        [StepRecord(6 + i, 0, 0, 1, 0.0, 0.008) for i in range(3)]
    db["steps"].insert_all([{"turn_id": 1, "step": r.step, "record": json.dumps(r.to_json())}
                            for r in records])
    db.close()
    store = StatsStore(path)
    fast, slow, plain, replay = store.turns("c")
    assert fast["speedup_basis"] == "est" and fast["speedup"] == pytest.approx(18 / 0.079 * 0.008)
    assert fast["speedup_low"] <= fast["speedup"] <= fast["speedup_high"]
    assert replay["speedup_basis"] == "ab" and replay["speedup"] == pytest.approx(1.5)
    assert slow["speedup"] is None and plain["speedup"] is None
    store.close()


def test_new_file_is_wal(tmp_path):
    store = StatsStore(tmp_path / "deep" / "folder" / "stats.db")
    assert store.db.journal_mode == "wal"
    store.close()


# ---------------------------------------------------------------------------------------------
# Concurrency and durability

def test_threads_share_one_store(tmp_path):
    store = StatsStore(tmp_path / "threads.db")
    cid = store.new_conversation("busy")
    errors = []

    def work(n):
        try:
            for i in range(25):
                store.record_turn(cid, f"t{n}-{i}", "r", spec_stats() if i % 2 else plain_stats())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(t["idx"] for t in store.turns(cid)) == list(range(1, 201))
    store.close()


def test_threads_with_their_own_connections(tmp_path):
    path = tmp_path / "conns.db"
    cid = StatsStore(path).new_conversation("busy")
    errors = []
    barrier = threading.Barrier(6)

    def work(n):
        try:
            store = StatsStore(path)
            barrier.wait()
            for i in range(20):
                store.record_turn(cid, f"t{n}-{i}", "r", spec_stats())
            store.close()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    check = StatsStore(path)
    assert sorted(t["idx"] for t in check.turns(cid)) == list(range(1, 121))


def test_connections_opening_a_new_file_at_once_migrate_it_once(tmp_path):
    path = tmp_path / "fresh.db"
    barrier = threading.Barrier(6)
    stores, errors = [], []

    def open_it():
        barrier.wait()
        try:
            stores.append(StatsStore(path))  # a connection of its own, like another process
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=open_it) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(stores) == 6
    assert [m.name for m in MIGRATIONS.applied(stores[0].db)] == [
        "m001_initial", "m002_owner_timing_positions", "m003_ab_baseline", "m004_tree_nodes",
        "m005_steps", "m006_speedup_basis", "m007_speedup_estimates", "m008_turn_settings"]
    for store in stores:
        store.close()


def _process_worker(path: str, cid: str, n: int, count: int, barrier) -> None:
    store = StatsStore(path)
    barrier.wait()
    for i in range(count):
        store.record_turn(cid, f"p{n}-{i}", "r", spec_stats() if i % 2 else plain_stats())
    store.close()


def test_processes_writing_at_once_lose_no_rows(tmp_path):
    path = str(tmp_path / "procs.db")
    parent = StatsStore(path)
    cid = parent.new_conversation("shared")
    parent.close()  # so a forked child inherits no open connection; each opens its own
    # fork starts in milliseconds where spawn re-imports pytest in every child (seconds).
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    workers, count = 4, 30
    barrier = ctx.Barrier(workers)
    procs = [ctx.Process(target=_process_worker, args=(path, cid, n, count, barrier))
             for n in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * workers  # a "locked" error would exit 1
    turns = StatsStore(path).turns(cid)
    assert sorted(t["prompt"] for t in turns) == sorted(
        f"p{n}-{i}" for n in range(workers) for i in range(count))
    assert sorted(t["idx"] for t in turns) == list(range(1, workers * count + 1))


def test_write_waits_out_a_lock_held_past_the_busy_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(stats_mod, "BUSY_TIMEOUT_S", 0.01)  # so the retry loop must do the waiting
    path = tmp_path / "held.db"
    store = StatsStore(path)
    cid = store.new_conversation("x")
    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN IMMEDIATE")
    threading.Timer(0.3, blocker.execute, args=("COMMIT",)).start()
    assert store.record_turn(cid, "q", "r", plain_stats()) is not None
    assert len(store.turns(cid)) == 1


CRASH_SCRIPT = """
import sys
from specchat.stats.store import StatsStore
store = StatsStore(sys.argv[1])
cid = store.new_conversation("crash")
i = 0
while True:
    stats = {"new_tokens": i, "seconds": 1.0, "speculation": i % 2 == 1, "drafted": 4,
             "accepted": 2, "drafted_by_position": [2, 2], "accepted_by_position": [1, 1],
             "stop_reason": "eos"}
    store.record_turn(cid, f"prompt {i}", "reply " * i, stats)
    print(i, flush=True)
    i += 1
"""


def test_killed_writer_leaves_a_valid_database(tmp_path):
    path = tmp_path / "crash.db"
    proc = subprocess.Popen([sys.executable, "-c", CRASH_SCRIPT, str(path)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    finished = -1
    try:
        for line in proc.stdout:  # each line: a turn whose transaction has committed
            finished = int(line)
            if finished >= 40:
                break
    finally:
        proc.send_signal(signal.SIGKILL)  # mid-write, most likely
        proc.wait()
    assert finished >= 40
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    store = StatsStore(path)
    (conversation,) = store.conversations()
    turns = store.turns(conversation["id"])
    assert len(turns) >= finished + 1
    for i, turn in enumerate(turns):
        assert turn["idx"] == i + 1
        assert turn["prompt"] == f"prompt {i}" and turn["reply"] == "reply " * i
        assert turn["new_tokens"] == i and turn["acceptance_rate"] == 0.5


# ---------------------------------------------------------------------------------------------
# Unusable databases: chat keeps working, stats say why they are off

def test_corrupt_file_gives_a_disabled_store(tmp_path):
    path = tmp_path / "stats.db"
    path.write_bytes(b"this is not sqlite at all\x00\xff" * 200)
    store = StatsStore.open_or_disabled(path)
    assert not store.enabled
    assert str(path) in store.error and "corrupt" in store.error
    assert "chat works, stats are off" in store.error and "Move the file away" in store.error
    cid = store.new_conversation("still chatting")
    assert store.record_turn(cid, "q", "r", plain_stats()) is None
    assert store.conversations() == [] and store.turns(cid) == []
    assert store.delete_conversation(cid) is False
    with pytest.raises(sqlite3.DatabaseError):
        StatsStore(path)  # not quiet: raises for code that wants to know


def test_unwritable_location_gives_a_disabled_store(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    store = StatsStore.open_or_disabled(blocker / "stats.db")
    assert not store.enabled and "cannot be written" in store.error


def test_read_only_file_gives_a_disabled_store(tmp_path):
    path = tmp_path / "ro.db"
    StatsStore(path).close()
    path.chmod(0o444)
    immutable = False
    if os.access(path, os.W_OK):  # root ignores permissions; the immutable flag binds it too
        immutable = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
        if not immutable:
            pytest.skip("cannot make a file read-only for this user")
    try:
        store = StatsStore.open_or_disabled(path)
        assert not store.enabled  # found when opening, not at the first reply
        assert "cannot be written" in store.error and "stats are off" in store.error
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)])


def test_quiet_store_survives_a_bad_write(tmp_path):
    store = StatsStore.open_or_disabled(tmp_path / "ok.db")
    assert store.enabled and store.error == ""
    assert store.record_turn("no-such-conversation", "q", "r", plain_stats()) is None
    assert "not saved" in store.error


def test_db_off(tmp_path):
    store = StatsStore.open_or_disabled("off")
    assert not store.enabled and "off" in store.error


def test_default_db_path(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECCHAT_DB", raising=False)
    path = default_db_path()
    assert path.name == "stats.db" and path.parent.name == "specchat"
    monkeypatch.setenv("SPECCHAT_DB", str(tmp_path / "env.db"))
    assert default_db_path() == tmp_path / "env.db"


# ---------------------------------------------------------------------------------------------
# CLI

def run_cli(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="specchat")
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["stats", *argv])
    out = io.StringIO()
    return args.func(args, out=out), out.getvalue()


def test_cli_lists_the_same_numbers(tmp_path):
    path = tmp_path / "cli.db"
    store = StatsStore(path)
    a = store.new_conversation("Tell me a story", "local", "gemma-270m", "ngram")
    plain = store.record_turn(a, "q", "r", plain_stats(new_tokens=20, seconds=2.0))
    store.record_turn(a, "q", "r", spec_stats(new_tokens=36, seconds=2.0), plain)  # its A/B pair
    store.close()

    code, text = run_cli("--db", str(path))
    assert code == 0
    assert "Tell me a story" in text and "1.80x" in text and "60.0%" in text
    assert "1 A/B" in text
    assert "gemma-270m + ngram" in text

    code, text = run_cli("--db", str(path), "--json")
    (row,) = json.loads(text)
    assert row["id"] == a and row["turns"] == 2
    assert row["mean_speedup"] == pytest.approx(1.8) and row["acceptance"] == pytest.approx(0.6)

    code, text = run_cli("--db", str(path), "--conversation", a[:6], "--json")
    assert [t["speculation"] for t in json.loads(text)] == [False, True]
    code, text = run_cli("--db", str(path), "--conversation", a[:6])
    assert "1.80x" in text and "ngram" in text

    out = tmp_path / "turns.csv"
    code, _ = run_cli("--db", str(path), "--csv", str(out))
    assert code == 0 and len(out.read_text().strip().splitlines()) == 3


def test_cli_does_not_create_a_missing_db(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_DB", str(tmp_path / "never.db"))
    code, text = run_cli("--json")
    assert code == 0 and json.loads(text) == []
    assert not (tmp_path / "never.db").exists()


def test_cli_reports_a_corrupt_db(tmp_path, capsys):
    path = tmp_path / "bad.db"
    path.write_bytes(b"\x01" * 5000)
    code, _ = run_cli("--db", str(path))
    assert code == 1 and "corrupt" in capsys.readouterr().err


def test_a_turn_records_its_draft_tree_size(tmp_path):
    from specchat.core.events import GenerationStats
    store = StatsStore(tmp_path / "s.db")
    conv = store.new_conversation("trees", target="target", quantization="nf4")
    stats = GenerationStats(new_tokens=3, seconds=1.0, speculation=True, drafter="head",
                            draft_len=4, tree_nodes=10, drafted=12, accepted=2)
    store.record_turn(conv, "p", "r", stats)
    assert [t["tree_nodes"] for t in store.turns(conv)] == [10]


def test_steps_are_kept_exported_and_deleted_with_their_conversation(store, tmp_path):
    from specchat.core.events import Candidate, Evidence, StepRecord, TokenEvent
    cid = store.new_conversation("inspect me", "local")
    step = StepRecord(1, 3, 1, 2, 0.01, 0.05, proposal=[7, 8, 9], proposal_text=["a", "b", "c"],
                      path=[0], k=4, alpha=0.6, expected_gain=1.3,
                      evidence=Evidence(1, 5, "x", 8, "b", 0.2, 1.0, 0.2, False,
                                        [Candidate(5, "x", 0.7)], []))
    tokens = [TokenEvent(7, "a", "accepted", 1, 3, 1), TokenEvent(5, "x", "resampled", 1, 3, 1)]
    turn = store.record_turn(cid, "=cmd()", "ax", spec_stats(), tokens=[t.to_json() for t in tokens],
                             steps=[step.to_json()])
    (row,) = store.turns(cid)
    assert row["tokens"] == [[7, "a", "accepted", 1, 3, 1], [5, "x", "resampled", 1, 3, 1]]
    (kept,) = store.steps(turn)
    assert StepRecord.from_json(kept) == step  # what the inspector shows, back whole
    assert store.steps(turn, owner="someone else") == []
    out = io.StringIO()
    assert store.export_steps_csv(out, cid) == 1
    (exported,) = csv.DictReader(io.StringIO(out.getvalue()))
    assert exported["rejected_text"] == "b" and float(exported["p"]) == 0.2
    assert json.loads(exported["proposal_text"]) == ["a", "b", "c"]
    turns_csv = io.StringIO()
    store.export_csv(turns_csv, cid)
    assert "'=cmd()" in turns_csv.getvalue()  # a formula-looking prompt stays text
    assert store.delete_conversation(cid)
    assert store.db["steps"].count == 0
