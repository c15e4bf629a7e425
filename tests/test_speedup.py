"""One definition of speedup (`stats.speedup`): the rule itself (measured against the A/B plain
run of the same prompt, else estimated from the turn's own steps with a band, never a ratio of
two prompts' replies, fixed once recorded), and one conversation showing the same figure for
each turn in the chat line, the A/B verdict, the store's rows, the CSV export, `specchat stats`
(text and --json) and the Stats tab's tables, charts and reopened chat."""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import statistics

import pytest

from specchat.core.events import GenerationStats, StepRecord
from specchat.core.request import GenerateConfig
from specchat.stats import speedup as speedups
from specchat.stats.cli import add_cli
from specchat.stats.format import fmt_figure, fmt_mean, fmt_speedup
from specchat.stats.speedup import AB, ESTIMATE, PlainStepTimes, Speedup
from specchat.stats.store import StatsStore
from specchat.ui import stats_tab
from specchat.core.race import Lane
from specchat.stats.race import Entry
from specchat.ui.handlers import race_verdict
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


def steps(passes: int = 8, per_pass: int = 3, step_s: float = 0.010, plain: int = 4,
          plain_s: float = 0.008) -> list[dict]:
    """A reply's step records (as the store keeps them): `passes` speculative steps, each
    emitting `per_pass` tokens in about `step_s` seconds, then `plain` one-token steps that
    drafted nothing, of about `plain_s` seconds."""
    spec = [StepRecord(i + 1, per_pass - 1, per_pass - 1, per_pass, 0.001,
                       step_s + 0.001 * (i % 3)).to_json() for i in range(passes)]
    plain_steps = [StepRecord(passes + i + 1, 0, 0, 1, 0.0, plain_s + 0.001 * (i % 2)).to_json()
                   for i in range(plain)]
    return spec + plain_steps


# ---------------------------------------------------------------------------------------------
# The rule

def test_a_turn_is_measured_against_its_ab_plain_run_else_estimated_from_its_own_steps():
    spec, own = run(30, True), steps()  # 15 tok/s
    measured = speedups.turn_speedup(spec, run(20, False), own)  # its A/B plain run: 10 tok/s
    assert measured.value == pytest.approx(1.5) and measured.basis == AB
    assert measured.low is None and measured.label() == "1.50x"
    assert measured.note == "vs its A/B plain run of the same prompt and settings: 10.0 tok/s"

    estimated = speedups.turn_speedup(spec, None, own)
    tokens = 8 * 3 + 4
    seconds = sum(s["draft_s"] + s["verify_s"] for s in own)
    plain_step = statistics.median([0.008, 0.009, 0.008, 0.009])  # its own plain steps
    assert estimated.basis == ESTIMATE
    assert estimated.value == pytest.approx(tokens / seconds * plain_step)
    assert estimated.baseline == pytest.approx(1 / plain_step)
    assert estimated.low < estimated.value < estimated.high  # a band, around the value
    assert estimated.label() == \
        f"≈{estimated.value:.2f}x est. ({estimated.low:.2f}–{estimated.high:.2f}x)"
    assert f"{tokens / 12:.2f} tokens per target pass" in estimated.note
    assert "median of 4 plain steps of this reply" in estimated.note
    assert speedups.turn_speedup(spec, None, own) == estimated  # deterministic
    # An A/B run with nothing to time is no baseline: the estimate stands.
    assert speedups.turn_speedup(spec, run(0, False), own) == estimated


def test_a_turn_with_too_few_plain_steps_is_priced_by_the_plain_steps_timed_in_the_process():
    spec, own = run(30, True), steps(plain=1)
    alone = speedups.turn_speedup(spec, None, own)
    assert alone.value is None and "no plain step timed in this process yet" in alone.note
    times = PlainStepTimes()
    times.add(steps(passes=0, plain=6, plain_s=0.020) + steps(plain=0))  # drafted steps: left out
    assert times.recent() == pytest.approx([0.020, 0.021] * 3)
    priced = speedups.turn_speedup(spec, None, own, times.recent())
    assert priced.basis == ESTIMATE and "median of 7 plain steps timed in this process" in \
        priced.note
    seconds = sum(s["draft_s"] + s["verify_s"] for s in own)
    plain_step = statistics.median([0.008] + [0.020, 0.021] * 3)
    assert priced.value == pytest.approx(25 / seconds * plain_step)
    # Each engine has its own timings, kept for the life of the process.
    one, other = type("Engine", (), {})(), type("Engine", (), {})()
    speedups.plain_step_times(one).add(steps(passes=0, plain=3))
    assert len(speedups.plain_step_times(one).recent()) == 3
    assert speedups.plain_step_times(other).recent() == []


def test_a_turn_is_never_compared_with_another_prompts_reply():
    store = StatsStore(":memory:")
    cid = store.new_conversation("two prompts")
    store.record_turn(cid, "The three primary colors are", "r", run(40, True),  # 20 tok/s
                      steps=steps())
    store.record_turn(cid, "Write a long essay", "r", run(4, False))  # 2 tok/s
    store.record_turn(cid, "Another prompt", "r", run(40, True))  # no steps kept
    first, _, bare = store.turns(cid)
    # Dividing by the other prompt's reply would say 10x; the turn's own steps say otherwise.
    assert first["speedup"] != pytest.approx(10.0) and first["speedup_basis"] == ESTIMATE
    assert first["speedup"] == pytest.approx(speedups.estimate(steps()).value)
    # With nothing of its own to go on, a turn gets no figure rather than a ratio.
    assert bare["speedup"] is None and bare["speedup_note"] == "too few steps to estimate from (0)"
    store.close()


def test_a_recorded_figure_never_changes_with_later_turns():
    store = StatsStore(":memory:")
    cid = store.new_conversation("later turns")
    store.record_turn(cid, "q", "r", run(30, True), steps=steps())
    shown = Speedup.from_row(store.turns(cid)[0])
    plain = store.record_turn(cid, "q", "r", run(20, False), steps=steps(passes=0, plain=9))
    store.record_turn(cid, "q", "r", run(36, True), baseline_turn_id=plain, steps=steps())
    store.record_turn(cid, "other", "r", run(4, False))
    first, _, replay, _ = store.turns(cid)
    assert Speedup.from_row(first) == shown
    assert replay["speedup"] == pytest.approx(1.8) and replay["speedup_basis"] == AB
    # A figure given by the page is kept as it is.
    given = Speedup(2.5, 10.0, ESTIMATE, "as shown", 2.0, 3.0)
    store.record_turn(cid, "q", "r", run(30, True), steps=steps(), speedup=given)
    assert Speedup.from_row(store.turns(cid)[-1]) == given
    store.close()


def test_what_gets_no_figure():
    own = steps()
    stopped = speedups.turn_speedup(run(30, True, stop="cancelled"), run(20, False), own)
    assert stopped.value is None and stopped.note == "cancelled: a partial reply is not compared"
    assert speedups.turn_speedup(run(20, False), None, own).value is None  # a plain turn
    assert speedups.turn_speedup(run(0, True), None, own).note == "no tokens to time"
    few = speedups.turn_speedup(run(30, True), None, own[:2])
    assert few.value is None and few.note == "too few steps to estimate from (2)"
    assert fmt_speedup(few.value) == fmt_figure(None) == "—"


def test_the_conversation_figure_says_what_it_summarizes():
    def turn(value, basis):
        return {"speculation": True, "speedup": value, "speedup_basis": basis}

    both = speedups.conversation_speedup([turn(2.0, AB), turn(0.5, AB), turn(9.0, ESTIMATE),
                                          {"speculation": False}])
    assert both.mean == pytest.approx(1.0) and both.basis == AB  # the estimate is left out
    assert (both.counted, both.speculative) == (2, 3) and both.label() == "1.00x"
    assert both.note == "geometric mean of 2 A/B pairs (1 other turn only estimated, left out)"
    estimated = speedups.conversation_speedup([turn(2.0, ESTIMATE), turn(8.0, ESTIMATE)])
    assert estimated.mean == pytest.approx(4.0) and estimated.label() == "≈4.00x est."
    assert estimated.note.startswith("est.: geometric mean of 2 turns' estimates")
    none = speedups.conversation_speedup([{"speculation": True, "speedup": None,
                                           "speedup_note": "too few steps to estimate from (1)"}])
    assert none.mean is None and none.note == "too few steps to estimate from (1)"
    assert speedups.conversation_speedup([]).note == "no speculative turn"


def test_the_conversation_mean_is_geometric():
    assert speedups.geometric_mean([2.0, 0.5]) == pytest.approx(1.0)
    assert speedups.geometric_mean([1.5, None, 3.0]) == pytest.approx(math.sqrt(4.5))
    assert speedups.geometric_mean([]) is None


# ---------------------------------------------------------------------------------------------
# One conversation, every view

# (prompt, stats, steps, A/B role): chat turns, a race's runs of "why", a stopped reply and one
# too short to estimate.
CONVERSATION = [
    ("hi", run(40, True), steps(), None),  # estimated
    ("plain 1", run(20, False), steps(passes=0, plain=19), None),
    ("why", run(30, True), steps(per_pass=2, step_s=0.012), None),  # estimated
    ("why", run(24, False), steps(passes=0, plain=23), "ab"),  # the A/B plain run: 12 tok/s
    ("why", run(27, True), steps(), "ab-on"),  # the A/B speculative run: 13.5 tok/s
    ("long", run(50, True, stop="stopped"), steps(), None),
    ("short", run(2, True), steps(passes=1, plain=0), None),
]
EXPECTED_BASIS = [ESTIMATE, "", ESTIMATE, "", AB, "", ""]
EXPECTED_MEAN = 13.5 / 12  # the one A/B pair


@pytest.fixture
def recorded(tmp_path):
    """The conversation in a stats file, and the chat session that showed its chat turns."""
    path = tmp_path / "stats.db"
    store = StatsStore(path)
    cid = store.new_conversation("one figure", "local", "gemma", "ngram", "nf4", "cpu")
    ab_plain_id = None
    for prompt, stats, kept, ab in CONVERSATION:
        baseline = ab_plain_id if ab == "ab-on" else None
        turn_id = store.record_turn(cid, prompt, "reply", stats.to_json(), baseline, steps=kept)
        if ab == "ab":
            ab_plain_id = turn_id
    session = Session()
    for row, (_, stats, _, ab) in zip(store.turns(cid), CONVERSATION):
        if ab is None:  # the chat shows the figure its turn was recorded with
            session.turns.append(Turn(user=row["prompt"], stats=stats,
                                      speedup=Speedup.from_row(row)))
    yield store, path, cid, session
    store.close()


def stats_cli(*argv: str) -> str:
    parser = argparse.ArgumentParser(prog="specchat")
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["stats", *argv])
    out = io.StringIO()
    assert args.func(args, out=out) == 0
    return out.getvalue()


def figures(rows) -> list[str]:
    return [fmt_figure(r["speedup"], r["speedup_basis"], r["speedup_low"], r["speedup_high"])
            for r in rows]


def test_the_function_and_the_stored_rows_agree(recorded):
    store, _, cid, _ = recorded
    rows = store.turns(cid)
    assert [r["speedup_basis"] or "" for r in rows] == EXPECTED_BASIS
    assert rows[0]["speedup"] == pytest.approx(speedups.estimate(CONVERSATION[0][2]).value)
    assert rows[4]["speedup"] == pytest.approx(13.5 / 12)
    assert rows[4]["speedup_note"] == \
        "vs its A/B plain run of the same prompt and settings: 12.0 tok/s"
    assert rows[6]["speedup_note"] == "too few steps to estimate from (1)"
    steps_by_id = {r["id"]: kept for r, (_, _, kept, _) in zip(rows, CONVERSATION)}
    again = speedups.conversation_speedups(rows, steps=steps_by_id)
    assert [s.row() for s in again] == [Speedup.from_row(r).row() for r in rows]
    assert store.conversation(cid)["mean_speedup"] == pytest.approx(EXPECTED_MEAN)


def test_csv_and_the_cli_show_the_same_figures(recorded):
    store, path, cid, _ = recorded
    rows = store.turns(cid)
    out = io.StringIO()
    store.export_csv(out, cid)
    exported = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert [float(r["speedup"]) if r["speedup"] else None for r in exported] == \
        pytest.approx([r["speedup"] for r in rows])
    assert [r["speedup_basis"] for r in exported] == EXPECTED_BASIS
    assert float(exported[0]["conversation_mean_speedup"]) == pytest.approx(EXPECTED_MEAN)
    assert exported[0]["conversation_speedup_of"].startswith("geometric mean of 1 A/B pair")
    store.close()

    (summary,) = json.loads(stats_cli("--db", str(path), "--json"))
    assert summary["mean_speedup"] == pytest.approx(EXPECTED_MEAN)
    assert (summary["speedup_turns"], summary["spec_turns"], summary["speedup_basis"]) == \
        (1, 5, AB)
    turns = json.loads(stats_cli("--db", str(path), "--conversation", cid, "--json"))
    assert [t["speedup"] for t in turns] == pytest.approx([r["speedup"] for r in rows])
    listing = stats_cli("--db", str(path))
    assert fmt_speedup(EXPECTED_MEAN) in listing and "1 A/B" in listing
    table = stats_cli("--db", str(path), "--conversation", cid)
    for shown in figures(rows):
        assert shown in table


def test_the_stats_tab_shows_the_same_figures(recorded):
    store, _, cid, _ = recorded
    rows = store.turns(cid)
    assert list(stats_tab.turn_table(store, None, cid)["speedup"]) == figures(rows)
    (row,) = stats_tab.conversation_table(store, None).to_dict("records")
    assert row["mean speedup"] == fmt_mean(EXPECTED_MEAN, AB)
    assert row["mean of"] == "geometric mean of 1 A/B pair (2 other turns only estimated, left out)"
    chart = stats_tab.plot_frames(store, None, cid).speedup
    shown = [(r["idx"], round(r["speedup"], 2), "A/B" if r["speedup_basis"] == AB else "est.")
             for r in rows if r["speedup"] is not None]
    assert list(zip(chart.frame["turn"], chart.frame["speedup"], chart.frame["basis"])) == shown
    assert chart.caption.startswith(f"{fmt_speedup(EXPECTED_MEAN)}: geometric mean of 1 A/B")
    replies = stats_tab.chat_history(store, None, cid)[1::2]
    for reply, row, text in zip(replies, rows, figures(rows)):
        if row["speculation"]:
            assert f"speedup {text} (" in reply["content"]


def test_the_chat_line_and_the_ab_verdict_show_the_same_figures(recorded):
    store, _, cid, session = recorded
    rows = store.turns(cid)
    chat = render_history(session)[1::2]  # the replies, in the session's order
    chat_rows = [r for r, (_, _, _, ab) in zip(rows, CONVERSATION) if ab is None]
    assert len(chat) == len(chat_rows)
    for reply, row in zip(chat, chat_rows):
        content = reply["content"]
        if row["speedup_basis"] == ESTIMATE:
            assert (f"<b>≈{row['speedup']:.2f}×</b> est. ({row['speedup_low']:.2f}–"
                    f"{row['speedup_high']:.2f}×)") in content
            assert 'class="sc-speedup"' not in content  # an estimate is not shown as measured
        elif row["speculation"]:
            assert "<b>—</b> speedup" in content
    stopped = chat[chat_rows.index(rows[5])]["content"]
    assert "partial reply" in stopped

    (off, off_steps), (on, on_steps) = [(stats, [StepRecord.from_json(s) for s in kept])
                                        for _, stats, kept, _ in CONVERSATION[3:5]]
    lanes = [Lane("plain", "speculation off", GenerateConfig()),
             Lane("model", "draft model", GenerateConfig())]
    shown = f"{fmt_speedup(rows[4]['speedup'], '×')} ("  # the figure, then its band
    assert shown in race_verdict(lanes, [Entry("plain", off, off_steps), Entry("model", on, on_steps)],
                                 GenerateConfig(), "none")


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
    assert set(frames.speedup.frame["basis"]) == {"A/B", "est."}
    assert frames.speedup.y_lim[1] > 1  # 1x stays in view


def test_empty_charts_say_why(tmp_path):
    store = StatsStore(":memory:")
    cid = store.new_conversation("nothing to estimate from")
    store.record_turn(cid, "q", "r", run(30, True).to_json())
    frames = stats_tab.plot_frames(store, None, cid)
    assert frames.speedup.frame.empty and frames.speedup.frame["speedup"].dtype.kind == "f"
    assert "too few steps to estimate from (0)" in frames.speedup.caption
    assert "No plain turn to compare with yet" in frames.tokens_per_s.caption
    (row,) = stats_tab.turn_table(store, None, cid).to_dict("records")
    assert row["speedup"] == "—" and row["speedup vs"].startswith("too few steps")
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
    # The race's results name it, from the runs' step records.
    off_stats = GenerationStats(new_tokens=40, seconds=1.2, tokens_per_s=33.3, stop_reason="eos")
    on_stats = GenerationStats(new_tokens=40, seconds=1.1, tokens_per_s=36.4, speculation=True,
                               stop_reason="eos")

    def records(timed):
        return [StepRecord(i + 1, 0, 0, 1, 0.0, t) for i, (_, t) in enumerate(timed)]

    lanes = [Lane("plain", "speculation off", GenerateConfig()),
             Lane("ngram", "n-gram lookup", GenerateConfig())]
    verdict = race_verdict(lanes, [Entry("plain", off_stats, records(off)),
                                   Entry("ngram", on_stats, records(noisy_same))],
                           GenerateConfig(), "none")
    assert "No run is measurably ahead" in verdict
    # Its band is named for what it is, not with a token kind's name.
    faster_records = [StepRecord(i + 1, 2, 2, 3, 0.0, t) for i, (_, t) in enumerate(faster)]
    verdict = race_verdict(lanes, [Entry("plain", off_stats, records(off)),
                                   Entry("ngram", on_stats, faster_records)],
                           GenerateConfig(), "none")
    assert "Fastest: n-gram lookup" in verdict and "its band is how far chance" in verdict
    assert "resampl" not in verdict.lower()
