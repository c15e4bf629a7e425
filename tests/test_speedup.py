"""One definition of speedup (`stats.speedup`): the rule itself, and one conversation showing the
same figure for each turn in the chat line, the A/B verdict, the store's rows, the CSV export,
`specchat stats` (text and --json) and the Stats tab's tables, charts and reopened chat."""

from __future__ import annotations

import argparse
import csv
import io
import json
import math

import pytest

from specchat.core.engine import GenerateConfig
from specchat.core.events import GenerationStats
from specchat.stats import speedup as speedups
from specchat.stats.cli import add_cli
from specchat.stats.format import fmt_speedup
from specchat.stats.store import StatsStore
from specchat.ui import stats_tab
from specchat.ui.handlers import ab_verdict
from specchat.ui.render import render_history
from specchat.ui.state import Session, Turn


def run(new_tokens: int, speculation: bool, temperature: float = 0.0,
        stop: str = "eos") -> GenerationStats:
    """A reply timed over 2 s (new_tokens / 2 tokens/s); speculative: drafts at 2 positions."""
    drafted = [new_tokens // 2, new_tokens // 2] if speculation else []
    accepted = [new_tokens // 4, new_tokens // 8] if speculation else []
    return GenerationStats(new_tokens=new_tokens, seconds=2.0, tokens_per_s=new_tokens / 2.0,
                           speculation=speculation, drafter="ngram" if speculation else "none",
                           draft_len=4 if speculation else 0, temperature=temperature,
                           drafted=sum(drafted), accepted=sum(accepted),
                           drafted_by_position=drafted, accepted_by_position=accepted,
                           stop_reason=stop)


# ---------------------------------------------------------------------------------------------
# The rule

def test_an_ab_plain_run_comes_first_then_the_median_plain_turn():
    plain = [run(20, False), run(36, False), run(24, False)]  # 10, 18, 12 tok/s: median 12
    spec = run(30, True)  # 15 tok/s
    by_median = speedups.turn_speedup(spec, plain)
    assert by_median.value == pytest.approx(15 / 12)  # the mean (13.3) would give 1.125
    assert (by_median.baseline, by_median.basis) == (12.0, speedups.PLAIN)
    assert by_median.note == "vs the median of 3 plain turns: 12.0 tok/s"
    by_replay = speedups.turn_speedup(spec, plain, ab_baseline=run(20, False))
    assert by_replay.value == pytest.approx(1.5) and by_replay.basis == speedups.AB
    # An A/B run with nothing to time falls back to the conversation's plain turns.
    assert speedups.turn_speedup(spec, plain, ab_baseline=run(0, False)).value == \
        pytest.approx(15 / 12)


def test_what_is_not_compared():
    plain = [run(20, False), run(200, False, stop="stopped"), run(200, False, temperature=0.7)]
    # Interrupted plain turns and other temperatures are no baseline: only the 10 tok/s turn.
    assert speedups.turn_speedup(run(30, True), plain).value == pytest.approx(1.5)
    stopped = speedups.turn_speedup(run(30, True, stop="cancelled"), plain)
    assert stopped.value is None and stopped.note == "cancelled: a partial reply is not compared"
    assert speedups.turn_speedup(run(20, False), plain).value is None  # a plain turn
    assert speedups.turn_speedup(run(0, True), plain).note == "no tokens to time"


def test_no_baseline_is_no_figure_with_a_reason():
    lone = speedups.turn_speedup(run(30, True, temperature=0.7), [run(20, False)])
    assert lone == speedups.Speedup(note="no plain turn at temperature 0.7 to compare with yet")
    assert fmt_speedup(lone.value) == "—"
    summary = speedups.conversation_speedup([{"speculation": True, "speedup": None,
                                              "speedup_note": lone.note}])
    assert summary.mean is None and summary.note == lone.note
    assert speedups.conversation_speedup([]).note == "no speculative turn"


def test_the_conversation_mean_is_geometric():
    assert speedups.geometric_mean([2.0, 0.5]) == pytest.approx(1.0)
    assert speedups.geometric_mean([1.5, None, 3.0]) == pytest.approx(math.sqrt(4.5))
    assert speedups.geometric_mean([]) is None


# ---------------------------------------------------------------------------------------------
# One conversation, every view

# (prompt, stats, A/B baseline's prompt): chat turns, an A/B replay of "why", a stopped reply
# and one at another temperature.
CONVERSATION = [
    ("hi", run(40, True), None),  # 20 tok/s
    ("plain 1", run(20, False), None),  # 10 tok/s
    ("plain 2", run(36, False), None),  # 18 tok/s
    ("why", run(30, True), None),  # 15 tok/s
    ("why", run(24, False), "ab"),  # the A/B plain run: 12 tok/s
    ("why", run(27, True), "ab-on"),  # the A/B speculative run: 13.5 tok/s
    ("long", run(50, True, stop="stopped"), None),
    ("hot", run(30, True, temperature=0.7), None),
]
# The plain turns at temperature 0 run at 10, 18 and 12 tok/s: median 12.
EXPECTED = [20 / 12, None, None, 15 / 12, None, 13.5 / 12, None, None]
EXPECTED_MEAN = (20 / 12 * 15 / 12 * 13.5 / 12) ** (1 / 3)


@pytest.fixture
def recorded(tmp_path):
    """The conversation in a stats file, and the chat session that produced it."""
    path = tmp_path / "stats.db"
    store = StatsStore(path)
    cid = store.new_conversation("one figure", "local", "gemma", "ngram", "nf4", "cpu")
    session, ab_plain_id = Session(), None
    for prompt, stats, ab in CONVERSATION:
        baseline = ab_plain_id if ab == "ab-on" else None
        turn_id = store.record_turn(cid, prompt, "reply", stats.to_json(), baseline)
        if ab == "ab":
            ab_plain_id = turn_id
            session.ab_plain.append(stats)
        elif ab is None:
            session.turns.append(Turn(user=prompt, stats=stats))
    yield store, path, cid, session
    store.close()


def stats_cli(*argv: str) -> str:
    parser = argparse.ArgumentParser(prog="specchat")
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["stats", *argv])
    out = io.StringIO()
    assert args.func(args, out=out) == 0
    return out.getvalue()


def test_the_function_and_the_stored_rows_agree(recorded):
    store, _, cid, _ = recorded
    rows = store.turns(cid)
    assert [r["speedup"] for r in rows] == pytest.approx(EXPECTED)
    assert [s.value for s in speedups.conversation_speedups(rows)] == pytest.approx(EXPECTED)
    assert rows[5]["speedup_note"] == "vs its A/B plain run: 12.0 tok/s"
    assert rows[7]["speedup_note"] == "no plain turn at temperature 0.7 to compare with yet"
    assert store.conversation(cid)["mean_speedup"] == pytest.approx(EXPECTED_MEAN)


def test_csv_and_the_cli_show_the_same_figures(recorded):
    store, path, cid, _ = recorded
    out = io.StringIO()
    store.export_csv(out, cid)
    exported = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert [float(r["speedup"]) if r["speedup"] else None for r in exported] == \
        pytest.approx(EXPECTED)
    assert float(exported[0]["conversation_mean_speedup"]) == pytest.approx(EXPECTED_MEAN)
    store.close()

    (summary,) = json.loads(stats_cli("--db", str(path), "--json"))
    assert summary["mean_speedup"] == pytest.approx(EXPECTED_MEAN)
    assert (summary["speedup_turns"], summary["spec_turns"]) == (3, 5)
    turns = json.loads(stats_cli("--db", str(path), "--conversation", cid, "--json"))
    assert [t["speedup"] for t in turns] == pytest.approx(EXPECTED)
    assert fmt_speedup(EXPECTED_MEAN) in stats_cli("--db", str(path))
    table = stats_cli("--db", str(path), "--conversation", cid)
    for value in EXPECTED:
        assert fmt_speedup(value) in table


def test_the_stats_tab_shows_the_same_figures(recorded):
    store, _, cid, _ = recorded
    shown = [fmt_speedup(value) for value in EXPECTED]
    assert list(stats_tab.turn_table(store, None, cid)["speedup"]) == shown
    (row,) = stats_tab.conversation_table(store, None).to_dict("records")
    assert row["mean speedup"] == fmt_speedup(EXPECTED_MEAN)
    chart = stats_tab.plot_frames(store, None, cid).speedup
    measured = [(i + 1, round(v, 2)) for i, v in enumerate(EXPECTED) if v is not None]
    assert list(zip(chart.frame["turn"], chart.frame["speedup"])) == measured
    assert chart.caption.startswith(fmt_speedup(EXPECTED_MEAN))
    replies = stats_tab.chat_history(store, None, cid)[1::2]
    for reply, value in zip(replies, EXPECTED):
        if value is not None:
            assert f"speedup {fmt_speedup(value)} (" in reply["content"]


def test_the_chat_line_and_the_ab_verdict_show_the_same_figures(recorded):
    store, _, cid, session = recorded
    rows = store.turns(cid)
    chat = render_history(session)[1::2]  # the replies, in the session's order
    chat_rows = [r for r, (_, _, ab) in zip(rows, CONVERSATION) if ab is None]
    assert len(chat) == len(chat_rows)
    for reply, row in zip(chat, chat_rows):
        if row["speedup"] is not None:
            assert f"<b>{fmt_speedup(row['speedup'], '×')}</b> vs plain" in reply["content"]
        elif row["speculation"] and not row["interrupted"]:
            assert "no plain baseline yet" in reply["content"]
    stopped = chat[chat_rows.index(rows[6])]["content"]
    assert "<b>—</b> vs plain" in stopped and "partial reply" in stopped

    off, on = CONVERSATION[4][1], CONVERSATION[5][1]
    plain = [t.stats for t in session.turns] + session.ab_plain
    verdict = ab_verdict({"off": ([], off), "on": ([], on)}, GenerateConfig(), "none",
                         plain=plain)
    assert f"Speedup: {fmt_speedup(rows[5]['speedup'], '×')}</b>" in verdict


def test_the_plot_frames_have_numeric_axes_and_both_series(recorded):
    store, _, cid, _ = recorded
    frames = stats_tab.plot_frames(store, None, cid)
    for chart, x, y in ((frames.speedup, "turn", "speedup"),
                        (frames.acceptance, "position", "acceptance"),
                        (frames.tokens_per_s, "turn", "tokens/s")):
        assert chart.frame[x].dtype.kind == "i" and chart.frame[y].dtype.kind == "f"
        assert len(chart.frame) and list(chart.frame[x]) == sorted(chart.frame[x])  # in order
        assert chart.y_lim[0] == 0 and chart.frame[y].max() < chart.y_lim[1]  # nothing clipped
    tokens = frames.tokens_per_s.frame
    assert set(tokens["speculation"]) == {"on", "off"}
    assert list(tokens["turn"]) == list(range(1, len(CONVERSATION) + 1))
    assert frames.speedup.y_lim[1] > 1  # 1x stays in view


def test_empty_charts_say_why(tmp_path):
    store = StatsStore(":memory:")
    cid = store.new_conversation("no plain turn")
    store.record_turn(cid, "q", "r", run(30, True).to_json())
    frames = stats_tab.plot_frames(store, None, cid)
    assert frames.speedup.frame.empty and frames.speedup.frame["speedup"].dtype.kind == "f"
    assert "no plain turn at temperature 0 to compare with yet" in frames.speedup.caption
    assert "No plain turn to compare with yet" in frames.tokens_per_s.caption
    (row,) = stats_tab.turn_table(store, None, cid).to_dict("records")
    assert row["speedup"] == "—" and row["speedup vs"].startswith("no plain turn")
    plain_only = store.new_conversation("plain only")
    store.record_turn(plain_only, "q", "r", run(20, False).to_json())
    frames = stats_tab.plot_frames(store, None, plain_only)
    assert frames.speedup.caption == "No speculative turn in this conversation yet."
    assert frames.acceptance.caption == "Nothing drafted in this conversation yet."
    store.close()


def test_a_speedup_within_the_runs_own_noise_is_called_no_measurable_speedup():
    from specchat.stats.speedup import noise_band
    rng = __import__("random").Random(1)
    off = [(1, 0.030 + rng.uniform(-0.01, 0.01)) for _ in range(40)]
    noisy_same = [(1, 0.029 + rng.uniform(-0.01, 0.01)) for _ in range(40)]
    faster = [(3, 0.036 + rng.uniform(-0.01, 0.01)) for _ in range(14)]
    low, high = noise_band(off, noisy_same)
    assert low < 1.0 < high
    low, high = noise_band(off, faster)
    assert 1.5 < low < high
    assert noise_band(off[:3], faster) is None
    assert noise_band(off, faster) == noise_band(off, faster)  # deterministic
    # The A/B verdict names it, from the runs' step records.
    from specchat.core.events import StepRecord
    off_stats = GenerationStats(new_tokens=40, seconds=1.2, tokens_per_s=33.3, stop_reason="eos")
    on_stats = GenerationStats(new_tokens=40, seconds=1.1, tokens_per_s=36.4, speculation=True,
                               stop_reason="eos")
    steps = {"off": [StepRecord(i + 1, 0, 0, 1, 0.0, t) for i, (_, t) in enumerate(off)],
             "on": [StepRecord(i + 1, 0, 0, 1, 0.0, t) for i, (_, t) in enumerate(noisy_same)]}
    verdict = ab_verdict({"off": ([], off_stats), "on": ([], on_stats)}, GenerateConfig(), "none",
                         steps=steps)
    assert "no measurable speedup" in verdict
