"""The bench harness: its arithmetic on synthetic step records (speedup, alpha, the Leviathan
bound), question loading, the CLI, and a smoke run on a tiny random model pair. No wall-clock
assertions: timings here are whatever the machine gives."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from specchat.bench import cli as bench_cli
from specchat.bench import run as bench_run
from specchat.bench.config import ALL_MODES, BenchSettings, Run
from specchat.bench.metrics import (
    greedy_identical,
    leviathan_speedup,
    metrics,
    predicted_speedup,
    predicted_speedup_steps,
    hindsight_speedup,
    width_costs,
    prefill_share,
    step_costs,
    summarize_bench,
    with_prefill,
)
from specchat.bench.questions import default_questions_path, load_questions
from specchat.bench.report import format_report
from specchat.bench.run import bench, hf_steps
from specchat.core.engine import Engine
from specchat.core.events import StepRecord
from specchat.drafters.model import ModelDrafter
from specchat.drafters.ngram import NgramDrafter
from tiny import byte_tokenizer, loaded, tiny_llama

KEYS = {"tokens_per_s", "speedup", "acceptance_rate", "mean_accepted_len",
        "target_calls_per_token", "ttft_s"}


def st(drafted, accepted, draft_s=0.0, verify_s=0.1):
    return StepRecord(0, drafted, accepted, accepted + 1, draft_s, verify_s)


def run(mode, qid=1, seconds=1.0, tokens=20, steps=(), repeat=0, turn=1, cat="writing",
        text="hi", calls=None, ttft=0.1, forward_s=None):
    steps = list(steps)
    return Run(qid, cat, turn, mode, repeat, tokens, seconds, ttft, 30, 30,
               calls if calls is not None else len(steps) + 1,
               forward_s if forward_s is not None else 0.9 * seconds, steps, text, "length")


# -- the cost model -----------------------------------------------------------------------------

def test_leviathan_formula():
    # Leviathan et al. eq. 1 with free drafts and a verify as cheap as one step.
    assert leviathan_speedup(0.8, 4, 0.0) == pytest.approx((1 - 0.8 ** 5) / 0.2)  # 3.3616
    assert leviathan_speedup(0.8, 4, 0.05, 1.2) == pytest.approx(3.3616 / 1.4)
    assert leviathan_speedup(1.0, 4, 0.0, 1.25) == pytest.approx(5 / 1.25)  # all accepted
    assert leviathan_speedup(0.0, 3, 0.1, 1.1) == pytest.approx(1 / 1.4)  # drafting only costs
    assert leviathan_speedup(0.5, 0, 0.3) == pytest.approx(1.0)  # k = 0 is plain decoding


def test_step_costs_alpha_c_and_verify_ratio():
    plain = [st(0, 0, 0.0, 0.1)] * 10
    steps = ([st(4, 2, 0.004, 0.12)] * 3 + [st(4, 4, 0.004, 0.12)]
             + [st(0, 0, 0.0, 0.1)] * 2)
    costs = step_costs(steps, plain)
    # 10 accepted, 3 rejections: alpha = 10 / 13; 16 drafted in 4 drafting steps
    assert costs["alpha"] == pytest.approx(10 / 13)
    assert costs["acceptance_rate"] == pytest.approx(10 / 16)
    assert costs["k_mean"] == pytest.approx(4.0)
    assert costs["plain_step_s"] == pytest.approx(0.1)
    assert costs["c"] == pytest.approx(0.001 / 0.1)  # 1 ms per drafted token / 100 ms step
    assert costs["verify_ratio"] == pytest.approx(1.2)
    assert costs["verify_ratio_by_fed"] == pytest.approx({1: 1.0, 5: 1.2})
    assert predicted_speedup(costs) == pytest.approx(leviathan_speedup(10 / 13, 4, 0.01, 1.2))

    # Per step: 4 drafting steps at the formula's rate, 2 plain steps emitting 1 token per step.
    a = 10 / 13
    tokens = 4 * (1 - a ** 5) / (1 - a) + 2
    cost = 4 * (0.01 * 4 + 1.2) + 2 * 1.0
    assert predicted_speedup_steps(steps, costs) == pytest.approx(tokens / cost)
    assert predicted_speedup_steps(steps, costs) < predicted_speedup(costs)


def test_a_tree_step_counts_as_a_chain_as_deep_as_the_tree():
    """12 nodes 3 levels deep: 3 tests along the path, 3 draft forwards, a 13-token verify."""
    plain = [st(0, 0, 0.0, 0.1)] * 4
    tree = [StepRecord(0, 12, 2, 3, 0.006, 0.15, 3), StepRecord(0, 12, 3, 4, 0.006, 0.15, 3)]
    costs = step_costs(tree, plain)
    assert costs["alpha"] == pytest.approx(5 / 6)  # the first path stopped short of the leaves
    assert costs["acceptance_rate"] == pytest.approx(5 / 24)  # of the nodes drafted
    assert costs["k_mean"] == pytest.approx(3.0)
    assert costs["c"] == pytest.approx(0.002 / 0.1)  # per level, not per node
    assert costs["verify_ratio_by_fed"] == pytest.approx({13: 1.5})
    a = 5 / 6
    expected = 2 * (1 - a ** 4) / (1 - a) / (2 * (0.02 * 3 + 1.5))
    assert predicted_speedup_steps(tree, costs) == pytest.approx(expected)


def test_hindsight_drafts_only_what_passed_at_the_measured_width_costs():
    # Widths 1 (a plain step, 0.1 s), 3 (0.12 s) and 5 (0.16 s) measured; 2 and 4 lie between.
    steps = [st(4, 0, 0.004, 0.16), st(4, 2, 0.004, 0.16), st(2, 2, 0.002, 0.12),
             st(0, 0, 0.0, 0.1)]
    widths = width_costs(steps, 0.1)
    assert widths == pytest.approx({1: 1.0, 3: 1.2, 5: 1.6})
    # Hindsight: the failed step becomes a plain one; 2 passed: a 3-wide verify + 2 drafts.
    tokens = 1 + 3 + 3 + 1
    cost = 1.0 + (1.2 + 0.02) + (1.2 + 0.02) + 1.0
    hindsight, bound = hindsight_speedup(steps, 0.01, widths)
    assert hindsight == pytest.approx(tokens / cost)
    assert bound == pytest.approx(tokens / 4)  # every step one plain step's cost
    # Between and past the measured widths: linear.
    one = [st(1, 1, 0.0, 0.1)]
    assert hindsight_speedup(one, 0.0, widths)[0] == pytest.approx(2 / 1.1)
    six = [st(5, 5, 0.0, 0.1)]
    assert hindsight_speedup(six, 0.0, widths)[0] == pytest.approx(6 / 1.8)
    assert hindsight_speedup([], 0.01, widths) == (None, None)

    plain = [run("plain", 1, steps=[st(0, 0)] * 19)]
    ngram = [run("ngram", 1, steps=steps)]
    result = summarize_bench(plain + ngram, ["plain", "ngram"], {"temperature": 0.0})
    a = result["modes"]["ngram"]["analysis"]
    assert a["hindsight_speedup"] == pytest.approx(tokens / cost)
    assert "hindsight" in format_report(result)


def test_prefill_dilutes_the_predicted_speedup_amdahl():
    assert with_prefill(2.0, 0.0) == pytest.approx(2.0)
    assert with_prefill(2.0, 0.5) == pytest.approx(1 / (0.5 + 0.25))  # 1.33x
    assert with_prefill(2.0, 1.0) == pytest.approx(1.0)  # all prefill: nothing to gain
    assert with_prefill(None, 0.3) is None and with_prefill(2.0, None) is None

    plain = [run("plain", q, seconds=s, steps=[st(0, 0)] * 19) for q, s in ((1, 2.0), (2, 6.0))]
    plain[0].prefill_s, plain[1].prefill_s = 1.0, 1.0
    assert prefill_share(plain) == pytest.approx(2.0 / 8.0)
    ngram = [run("ngram", 1, seconds=1.5, steps=[st(4, 4)] * 4, calls=5)]
    result = summarize_bench(plain + ngram, ["plain", "ngram"], {"temperature": 0.0})
    a = result["modes"]["ngram"]["analysis"]
    assert a["prefill_share"] == pytest.approx(0.5)  # question 1 only: the one ngram ran
    assert a["predicted_speedup_e2e"] == pytest.approx(
        with_prefill(a["predicted_speedup_steps"], 0.5))
    assert "+prefill" in format_report(result)


def test_same_text_speedup_leaves_diverged_replies_out():
    runs = [run("plain", 1, seconds=2.0, tokens=20, text="a"),
            run("plain", 2, seconds=9.0, tokens=128, text="loop", cat="qa"),
            run("ngram", 1, seconds=1.0, tokens=20, text="a", steps=[st(4, 4)]),
            run("ngram", 2, seconds=1.0, tokens=6, text="short", cat="qa")]
    result = summarize_bench(runs, ["plain", "ngram"], {"temperature": 0.0})
    o = result["modes"]["ngram"]["overall"]
    assert o["speedup"] == pytest.approx((26 / 2.0) / (148 / 11.0))  # the diverged reply weighs in
    assert o["same_text_items"] == 1 and o["same_text_speedup"] == pytest.approx(2.0)
    assert "identical replies only: ngram 2.00x (1)" in format_report(result)
    # Sampled, one-hot drafts replay plain's reply per seed: the same view applies.
    sampled = summarize_bench(runs, ["plain", "ngram"], {"temperature": 0.7})
    assert sampled["modes"]["ngram"]["overall"]["same_text_speedup"] == pytest.approx(2.0)
    assert sampled["greedy_identical"] == {"plain": None, "ngram": None}
    assert sampled["identical_to_plain"] == {"plain": 1.0, "ngram": 0.5}


def test_step_costs_without_drafts_or_baseline():
    costs = step_costs([st(0, 0)] * 3, [st(0, 0)] * 3)
    assert costs["alpha"] is None and costs["c"] is None and predicted_speedup(costs) is None
    costs = step_costs([st(2, 1)], [])  # no plain steps to compare with
    assert costs["alpha"] == pytest.approx(0.5) and costs["c"] is None


# -- aggregation --------------------------------------------------------------------------------

def test_speedup_uses_medians_over_repeats_and_shared_items():
    runs = [run("plain", 1, s, 20, [st(0, 0)] * 19, repeat=i) for i, s in enumerate([1, 3, 2])]
    runs += [run("ngram", 1, s, 20, [st(4, 3)] * 5, repeat=i, calls=6)
             for i, s in enumerate([1.0, 0.5, 1.5])]
    runs += [run("ngram", 2, 4.0, 10, [st(2, 0)] * 10, calls=11)]  # no plain run: no speedup
    plain = [r for r in runs if r.mode == "plain"]
    m = metrics([r for r in runs if r.mode == "ngram"], plain)
    assert m["speedup"] == pytest.approx((20 / 1.0) / (20 / 2.0))  # medians: 1.0 s vs 2.0 s
    assert m["tokens_per_s"] == pytest.approx((20 + 10) / (1.0 + 4.0))
    # Counts pool every repeat: 15 steps of (4, 3) and 10 of (2, 0).
    assert m["acceptance_rate"] == pytest.approx(45 / (60 + 20))
    assert m["alpha"] == pytest.approx(45 / (45 + 25))
    assert m["mean_accepted_len"] == pytest.approx((15 * 4 + 10 * 1) / 25)
    assert m["target_calls_per_token"] == pytest.approx((3 * 6 + 11) / (3 * 20 + 10))
    assert m["questions"] == 2
    assert m["overhead_ms_per_token"] == pytest.approx(1000 * 0.1 * 5.0 / 30)
    p = metrics(plain, plain)
    assert p["speedup"] == pytest.approx(1.0)
    assert p["acceptance_rate"] is None and p["target_calls_per_token"] == pytest.approx(1.0)


def test_the_noise_floor_is_plain_against_itself_repeat_over_repeat():
    """Per category, the tokens/s of each repeat of plain over each other's; the report prints
    the band, and none comes without repeats."""
    from specchat.bench.metrics import noise_floor

    runs = [run("plain", 1, s, 20, repeat=i) for i, s in enumerate([1.0, 1.25, 1.1])]
    runs += [run("plain", 2, s, 20, repeat=i, cat="qa") for i, s in enumerate([1.0, 1.02, 1.0])]
    floor = noise_floor(runs)
    assert floor["widest"] == "writing"
    assert floor["low"] == pytest.approx(1.0 / 1.25) and floor["high"] == pytest.approx(1.25)
    assert floor["by_category"]["qa"] == pytest.approx((1.0 / 1.02, 1.02))
    assert noise_floor([r for r in runs if r.repeat == 0]) is None
    result = summarize_bench(runs + [run("ngram", 1, 1.0, 20, repeat=i) for i in range(3)],
                             ["plain", "ngram"], {"temperature": 0.0})
    assert "noise: plain against itself" in format_report(result)
    assert "0.80x..1.25x (widest: writing" in format_report(result)


def test_an_empty_plain_reply_is_named_and_the_report_goes_on():
    """A category whose plain replies were empty in one repeat (a rate of 0) has no ratio
    there: the band is made of the others, the report names the category, nothing divides by 0."""
    from specchat.bench.metrics import noise_floor

    runs = [run("plain", 1, s, 20, repeat=i) for i, s in enumerate([1.0, 1.25, 1.1])]
    runs += [run("plain", 2, 1.0, n, repeat=i, cat="qa") for i, n in enumerate([20, 0, 20])]
    floor = noise_floor(runs)
    assert floor["empty"] == ["qa"] and floor["by_category"]["qa"] == pytest.approx((1.0, 1.0))
    alone = noise_floor([r for r in runs if r.category == "qa" and r.repeat < 2])
    assert alone == {"empty": ["qa"]}
    ngram = [run("ngram", 2, 0.5, 20, repeat=i, cat="qa") for i in range(3)]
    result = summarize_bench(runs + ngram, ["plain", "ngram"], {"temperature": 0.0})
    report = format_report(result)
    assert "all empty in a repeat of qa" in report and "0.80x..1.25x" in report
    assert result["paired"]["ngram"]["qa"] == pytest.approx((2.0, 2.0))  # repeat 1 unpaired


def test_each_mode_is_paired_with_plain_in_the_same_repeat_per_category():
    """Per category and repeat, a mode's tokens/s over plain's in that repeat: the range over
    the repeats, and the report names a category where the mode was slower in every repeat."""
    from specchat.bench.metrics import paired_ratios

    plain = [run("plain", 1, s, 20, repeat=i) for i, s in enumerate([1.0, 1.3])]
    plain += [run("plain", 2, 1.0, 20, repeat=i, cat="qa") for i in range(2)]
    ngram = [run("ngram", 1, s, 20, repeat=i) for i, s in enumerate([1.05, 1.2])]  # noise
    ngram += [run("ngram", 2, s, 20, repeat=i, cat="qa") for i, s in enumerate([1.1, 1.05])]
    got = paired_ratios(ngram, plain)
    assert got["writing"] == pytest.approx((1.0 / 1.05, 1.3 / 1.2))
    assert got["qa"] == pytest.approx((1.0 / 1.1, 1.0 / 1.05))
    text = format_report(summarize_bench(plain + ngram, ["plain", "ngram"],
                                         {"temperature": 0.0}))
    assert "paired with plain in the same repeat" in text
    assert "below 0.98x in every repeat: qa 0.91x..0.95x" in text
    once = summarize_bench([r for r in plain + ngram if r.repeat == 0], ["plain", "ngram"],
                           {"temperature": 0.0})
    assert "paired" not in once  # one repeat: nothing to pair over


def test_modes_run_in_an_order_drawn_per_question_that_varies_who_goes_before_whom():
    modes = ("plain", "ngram", "head", "combined", "llama.cpp", "llama.cpp-ngram-map-k")
    orders = [bench_run.mode_order(modes, q, r) for q in range(39) for r in range(2)]
    assert all(sorted(o) == sorted(modes) for o in orders)
    assert orders[0] == bench_run.mode_order(modes, 0, 0)  # the same every run
    before_plain = {o[o.index("plain") - 1] for o in orders if o.index("plain")}
    assert len(before_plain) >= 4 and {o[0] for o in orders} == set(modes)


def test_turn_two_is_reported_apart():
    runs = [run("plain", 1, ttft=0.5), run("plain", 1, turn=2, ttft=0.05)]
    runs[1].prompt_tokens, runs[1].prefill_tokens = 300, 40
    m = metrics(runs, runs)
    assert m["ttft_s"] == pytest.approx(0.5)  # first turns only
    assert m["turn2_ttft_s"] == pytest.approx(0.05)
    assert (m["turn2_prompt_tokens"], m["turn2_prefill_tokens"]) == (300, 40)


def test_greedy_identical_and_report_shape():
    runs = [run("plain", 1, text="a"), run("plain", 2, text="b", cat="qa"),
            run("ngram", 1, text="a", steps=[st(3, 2)]), run("ngram", 2, text="x", cat="qa"),
            run("hf-plain", 1, text="a"), run("hf-plain", 2, text="b", cat="qa"),
            run("ngram", 1, text="zzz", repeat=1)]  # later repeats are not compared
    assert greedy_identical(runs, ["plain", "ngram", "hf-plain"]) == {
        "plain": 1.0, "ngram": 0.5, "hf-plain": 1.0}
    result = summarize_bench(runs, ["plain", "ngram", "hf-plain"], {"temperature": 0.0})
    assert set(result) >= {"config", "modes", "greedy_identical"}
    for mode, entry in result["modes"].items():
        assert KEYS <= set(entry["overall"])
        assert set(entry["by_category"]) == {"writing", "qa"}
        assert all(KEYS <= set(c) for c in entry["by_category"].values())
    assert "analysis" in result["modes"]["ngram"] and "analysis" not in result["modes"]["plain"]
    json.dumps(result)  # serializable as is
    text = format_report(result)
    assert "overall" in text and "ngram" in text and "qa" in text
    sampled = summarize_bench(runs, ["plain", "ngram"], {"temperature": 0.7})
    assert sampled["greedy_identical"] == {"plain": None, "ngram": None}


def test_hf_steps_from_forwards_and_stream():
    # prefill (12 prompt + 3 drafts), then: 4 fed -> 2 accepted + 1; 1 fed -> 1; 5 fed -> 4 + 1
    calls = [(15, 0.3), (4, 0.11), (1, 0.1), (5, 0.12)]
    puts = [(2, 0.0), (3, 0.0), (1, 0.0), (5, 0.0)]
    steps = hf_steps(calls, puts, prompt_len=12)
    assert [(s.drafted, s.accepted, s.emitted, s.verify_s) for s in steps] == [
        (3, 2, 3, 0.11), (0, 0, 1, 0.1), (4, 4, 5, 0.12)]
    assert hf_steps(calls, puts[:2], 12) == []  # no per-step view when they don't pair up


# -- questions and CLI --------------------------------------------------------------------------

def test_load_questions(tmp_path):
    f = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}", "again"]}
            for i, c in enumerate(["a", "a", "b", "a", "b"])]
    rows.append({"category": "c", "turns": "one string turn"})
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert [q["question_id"] for q in load_questions(f)] == [0, 1, 2, 3, 4, 6]
    assert [q["question_id"] for q in load_questions(f, limit_per_category=1)] == [0, 2, 6]
    got = load_questions(f, ["b", "c"])
    assert [q["category"] for q in got] == ["b", "b", "c"]
    assert got[-1]["turns"] == ["one string turn"]
    with pytest.raises(ValueError, match="zzz"):
        load_questions(f, ["zzz"])
    f.write_text(json.dumps({"category": "a", "prompt": "no turns"}) + "\n")
    with pytest.raises(ValueError, match="turns"):
        load_questions(f)


SPEC_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction",
                         "stem", "humanities", "translation", "summarization", "qa",
                         "math_reasoning", "rag")


def test_default_question_file_ships_in_the_package_with_every_category():
    path = default_questions_path()
    assert path.is_file() and path.parent == Path(bench_cli.__file__).parent
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert all(set(q) == {"question_id", "category", "turns"} for q in lines)
    assert len({q["question_id"] for q in lines}) == len(lines)  # ids are unique
    qs = load_questions(path)
    assert len(qs) == len(lines)
    assert sorted({q["category"] for q in qs}) == sorted(SPEC_BENCH_CATEGORIES)
    assert len(load_questions(path, limit_per_category=1)) == len(SPEC_BENCH_CATEGORIES)
    assert all(t.strip() for q in qs for t in q["turns"])


def test_default_question_file_is_none_of_the_training_prompts():
    # The bench measures a trained head on questions its training never saw.
    prompts_dir = Path(bench_cli.__file__).parents[1] / "train" / "prompts"
    seen = {json.loads(line).get("prompt", "").strip().lower()
            for f in prompts_dir.glob("*.jsonl")
            for line in f.read_text(encoding="utf-8").splitlines() if line.strip()}
    turns = {t.strip().lower() for q in load_questions(default_questions_path())
             for t in q["turns"]}
    assert not turns & seen


def test_cli_registers_bench():
    from specchat.cli import build_parser
    args = build_parser().parse_args(["bench", "--modes", "plain,hf-pld", "--turns", "all",
                                      "--limit-per-category", "2", "--quantization", "none"])
    assert args.func is bench_cli.cmd_bench
    assert args.modes == ("plain", "hf-pld") and args.turns == "all"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--modes", "plain,warp-drive"])


# -- smoke runs on tiny random models -------------------------------------------------------------

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Say hello hello hello", "Again, please"]},
    {"question_id": 2, "category": "qa", "turns": ["Repeat: abc abc abc abc"]},
]


def tiny_engine():
    tok = byte_tokenizer()
    draft = tiny_llama(0)  # the target's own weights: every draft is accepted
    engine = Engine(loaded(tiny_llama(0), tok),
                    {"ngram": NgramDrafter(), "model": ModelDrafter(draft, len(tok))})
    return engine, draft


def test_bench_smoke_on_a_tiny_pair():
    engine, draft = tiny_engine()
    settings = BenchSettings(modes=ALL_MODES, turns="all", max_new_tokens=10, warmup_tokens=2)
    result = bench(engine, QUESTIONS, settings, assistant=draft, progress=False)
    assert set(result["modes"]) == set(ALL_MODES)
    for mode, entry in result["modes"].items():
        overall = entry["overall"]
        assert KEYS <= set(overall) and overall["questions"] == 2
        assert set(entry["by_category"]) == {"writing", "qa"}
        assert overall["new_tokens"] > 0 and overall["tokens_per_s"] > 0
        if mode in ("plain", "ngram", "model"):  # the follow-up turn reuses the cached history
            assert overall["turn2_prefill_tokens"] < overall["turn2_prompt_tokens"]
        else:
            assert overall["turn2_prefill_tokens"] == overall["turn2_prompt_tokens"]
    assert result["modes"]["plain"]["overall"]["speedup"] == pytest.approx(1.0)
    assert result["modes"]["model"]["overall"]["acceptance_rate"] == pytest.approx(1.0)
    # Greedy, fp32, the same stop condition: every mode writes plain's text.
    assert result["greedy_identical"] == {m: 1.0 for m in ALL_MODES}
    analysis = result["modes"]["model"]["analysis"]
    assert analysis["alpha"] == pytest.approx(1.0) and analysis["c"] > 0
    assert math.isfinite(analysis["predicted_speedup"])
    assert len(result["runs"]) == 6 * 3 and result["config"]["peak_rss_mb"] > 0
    json.dumps(result)
    assert "cost model" in format_report(result)


def test_bench_history_regime_drafts_from_earlier_questions_only(monkeypatch):
    """--history: one user asking the questions in turn. Each question's runs may draft from
    the questions before it, never from its own runs (its reply joins the history after them),
    and the report names the regime."""
    engine, _ = tiny_engine()
    questions = [{"question_id": i, "category": "qa", "turns": ["Repeat: abc abc abc abc"]}
                 for i in (1, 2)]
    seen = []  # (tokens in the history, owner) at each lookup
    real = engine.history.lookup

    def spy(owner, context, k):
        seen.append((engine.history.tokens(owner), owner))
        return real(owner, context, k)

    monkeypatch.setattr(engine.history, "lookup", spy)
    settings = BenchSettings(modes=("plain", "ngram"), max_new_tokens=12, warmup_tokens=0,
                             repeats=2, history=True)
    result = bench(engine, questions, settings, progress=False)
    assert {owner for _, owner in seen} == {"bench"}
    sizes = [n for n, _ in seen]
    assert sizes[0] == 0  # question 1's runs: an empty history
    later = {n for n in sizes if n}
    assert len(later) == 1  # question 2's: question 1's prompt and reply, nothing of its own
    assert engine.history.tokens("bench") > later.pop()  # then question 2's joins
    assert "one user's history" in format_report(result)
    assert result["greedy_identical"] == {"plain": 1.0, "ngram": 1.0}


def test_bench_ctrl_c_reports_whole_questions(monkeypatch):
    engine, _ = tiny_engine()
    real, calls = bench_run.run_hf_mode, []

    def interrupt_on_second_question(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:  # warm-up, question 1, then Ctrl-C in question 2
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_run, "run_hf_mode", interrupt_on_second_question)
    settings = BenchSettings(modes=("plain", "hf-plain"), max_new_tokens=4, warmup_tokens=1)
    result = bench(engine, QUESTIONS, settings, progress=False, log=lambda msg: None)
    assert result["config"]["interrupted"] and result["config"]["questions_done"] == 1
    assert {r["question_id"] for r in result["runs"]} == {1}
    assert result["modes"]["hf-plain"]["overall"]["questions"] == 1
    assert "interrupted" in format_report(result)
    assert not engine.model._forward_hooks and not engine.model._forward_pre_hooks


def test_bench_rejects_modes_the_models_cannot_run():
    engine, _ = tiny_engine()
    del engine.drafters["model"]
    with pytest.raises(ValueError, match="model"):
        bench(engine, QUESTIONS, BenchSettings(modes=("plain", "model")), progress=False)
    with pytest.raises(ValueError, match="hf-assisted"):
        bench(engine, QUESTIONS, BenchSettings(modes=("hf-assisted",)), progress=False)


def test_cli_bench_without_questions_runs_the_default_set(tmp_path, capsys):
    from specchat.cli import main
    model_dir = tmp_path / "tiny"
    tiny_llama(0).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "bench.json"
    rc = main(["bench", "--target", str(model_dir), "--quantization", "none", "--device", "cpu",
               "--modes", "plain", "--categories", "qa,rag", "--limit-per-category", "1",
               "--max-new-tokens", "2", "--warmup-tokens", "0", "--no-progress",
               "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["config"]["questions_file"] == str(default_questions_path())
    assert set(result["modes"]["plain"]["by_category"]) == {"qa", "rag"}


def test_cli_bench_says_a_missing_question_file(tmp_path, capsys):
    from specchat.cli import main
    assert main(["bench", "--questions", str(tmp_path / "nope.jsonl")]) == 2
    assert "no question file at" in capsys.readouterr().err


def test_cli_end_to_end_on_a_saved_tiny_model(tmp_path, capsys):
    from specchat.cli import main
    model_dir = tmp_path / "tiny"
    tiny_llama(0).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    out = tmp_path / "out" / "bench.json"
    torch.manual_seed(0)
    rc = main(["bench", "--questions", str(questions), "--target", str(model_dir),
               "--quantization", "none", "--device", "cpu", "--modes", "plain,ngram,hf-pld",
               "--max-new-tokens", "6", "--warmup-tokens", "0", "--no-progress",
               "--ignore-stop-strings", "--samplers", "none",
               "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "overall" in printed and "hf-pld" in printed
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"plain", "ngram", "hf-pld"}
    assert result["config"]["questions_file"] == str(questions)
    assert result["config"]["max_new_tokens"] == 6 and result["config"]["peak_rss_mb"] > 0
    assert result["config"]["stop_strings"] is False
    assert set(result["greedy_identical"]) == {"plain", "ngram", "hf-pld"}


def test_bench_decodes_every_engine_mode_with_the_samplers_and_says_so():
    engine, draft = tiny_engine()
    samplers = dict(dry_multiplier=0.8, repeat_penalty=1.3, min_p=0.05)
    settings = BenchSettings(modes=("plain", "ngram", "model"), max_new_tokens=16,
                             warmup_tokens=0, samplers=samplers)
    result = bench(engine, QUESTIONS, settings, assistant=draft, progress=False)
    unshaped = bench(engine, QUESTIONS, BenchSettings(modes=("plain",), max_new_tokens=16,
                                                      warmup_tokens=0), progress=False)
    texts = {r["mode"]: r["text"] for r in result["runs"] if r["question_id"] == 2}
    assert texts["ngram"] == texts["model"] == texts["plain"]  # lossless with the samplers on
    assert texts["plain"] != next(r["text"] for r in unshaped["runs"] if r["question_id"] == 2)
    assert result["config"]["samplers"] == samplers
    assert "samplers: dry_multiplier=0.8, repeat_penalty=1.3, min_p=0.05" in format_report(result)


def test_bench_refuses_transformers_modes_with_penalties(capsys):
    from specchat.cli import main
    assert main(["bench", "--modes", "plain,hf-plain", "--dry-multiplier", "0.8"]) == 2
    assert "hf-plain run transformers' generate" in capsys.readouterr().err


def test_the_bench_measures_real_use_by_default_and_labels_the_stress_mode(tmp_path, capsys):
    """By default every mode samples as the page's examples do, stop strings on; the report
    says which regime it measured, with decode-only tokens/s and the prefill share."""
    from specchat.cli import main
    from specchat.core.settings import ANTI_LOOP
    model_dir = tmp_path / "tiny"
    tiny_llama(0).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    base = ["bench", "--questions", str(questions), "--target", str(model_dir),
            "--quantization", "none", "--device", "cpu", "--modes", "plain,ngram",
            "--max-new-tokens", "6", "--warmup-tokens", "0", "--no-progress"]
    out = tmp_path / "real.json"
    assert main(base + ["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["config"]["samplers"] == ANTI_LOOP and result["config"]["stop_strings"]
    assert printed.startswith("regime: real use")
    overall = result["modes"]["plain"]["overall"]
    assert 0 < overall["prefill_share"] < 1
    assert overall["decode_tokens_per_s"] > overall["tokens_per_s"]
    assert main(base + ["--ignore-stop-strings", "--min-p", "0.1"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("regime: LOOPING TEXT")
    assert "min_p=0.1" in printed and "dry_multiplier=0.8" in printed


def test_the_completion_format_sends_each_turn_as_plain_text_with_no_stop_strings():
    """--format completion measures the page's Completion mode: the turn's text alone, no chat
    format and no stop strings, every mode alike; the report names the regime."""
    from specchat.core.text import chat_prompt, raw_prompt
    engine, draft = tiny_engine()
    tok = engine.tokenizer
    settings = BenchSettings(modes=("plain", "ngram"), turns="all", max_new_tokens=5,
                             warmup_tokens=0, prompt_format="completion")
    result = bench(engine, QUESTIONS, settings, progress=False)
    turns = {(q["question_id"], i + 1): t for q in QUESTIONS for i, t in enumerate(q["turns"])}
    for r in result["runs"]:
        text = turns[(r["question_id"], r["turn"])]
        assert r["prompt_tokens"] == len(raw_prompt(tok, text))  # no history, no preamble
        assert r["prompt_tokens"] < len(chat_prompt(tok, [{"role": "user", "content": text}])[0])
    chat = bench(engine, QUESTIONS[1:], BenchSettings(modes=("plain",), max_new_tokens=5,
                                                      warmup_tokens=0), progress=False)
    assert chat["runs"][0]["prompt_tokens"] == len(
        chat_prompt(tok, [{"role": "user", "content": QUESTIONS[1]["turns"][0]}])[0])
    texts = {(r["question_id"], r["turn"], r["mode"]): r["text"] for r in result["runs"]}
    assert all(texts[(q, t, "ngram")] == texts[(q, t, "plain")] for q, t in turns)
    assert result["config"]["prompt_format"] == "completion"
    assert format_report(result).startswith("regime: Completion")


def test_every_mode_meets_the_prefix_store_as_its_question_found_it():
    """A long question's pages, once a mode encoded them, must not make the next modes' first
    turns cheaper: each mode encodes the same tokens of its prompt."""
    engine, draft = tiny_engine()
    long_question = [{"question_id": 3, "category": "rag",
                      "turns": ["Read this and answer: " + "the lighthouse keeper wrote. " * 12]}]
    settings = BenchSettings(modes=("plain", "ngram", "model"), max_new_tokens=4,
                             warmup_tokens=0, repeats=2)
    result = bench(engine, long_question, settings, assistant=draft, progress=False)
    encoded = {(r["mode"], r["repeat"]): r["prefill_tokens"] for r in result["runs"]}
    assert len(set(encoded.values())) == 1 and min(encoded.values()) > 300, encoded


def test_bench_requests_are_built_and_checked_as_the_pages_are():
    from specchat.bench.config import BenchSettings
    from specchat.core.inputs import InputError

    s = BenchSettings(samplers={"dry_multiplier": 0.8, "min_p": 0.05}, tree_nodes=6)
    cfg = s.generate_config("head-tree", ("\nUser:",), ["ngram", "head"])
    assert (cfg.drafter, cfg.tree_nodes, cfg.dry_multiplier, cfg.min_p, cfg.stop) == \
        ("head", 6, 0.8, 0.05, ("\nUser:",))
    assert not s.generate_config("plain", (), ["ngram"]).speculation
    with pytest.raises(InputError, match="Draft length"):
        BenchSettings(draft_len=40).generate_config("ngram", (), ["ngram"])
    with pytest.raises(ValueError, match="Temperature capped"):
        BenchSettings(temperature=5.0).generate_config("ngram", (), ["ngram"])
    with pytest.raises(InputError, match="not loaded"):
        s.generate_config("head", (), ["ngram"])


def test_the_profile_accounts_for_every_millisecond_of_a_plain_token():
    """`--profile`: plain decoding timed again with hooks; the rows of the forward add up to the
    forward, the forward and the host's rows to the step, and the report shows them. The tiny
    target has no NF4 layers and ties no LM head of its own: those rows are 0 or the head's."""
    from specchat.bench.profile import FORWARD_ROWS, HOST_ROWS, profile_lines, profile_plain
    from specchat.bench.run import prompt_of

    engine, _ = tiny_engine()
    samplers = dict(dry_multiplier=0.8, repeat_penalty=1.3, min_p=0.05)
    settings = BenchSettings(modes=("plain",), max_new_tokens=24, samplers=samplers,
                             stop_strings=False)
    prompts = [prompt_of(engine.tokenizer, [{"role": "user", "content": q["turns"][0]}],
                         settings) for q in QUESTIONS]
    ids, stops = prompts[0]
    first = [e.id for e in engine.stream(ids, settings.generate_config("plain", stops, []))
             if hasattr(e, "kind")]
    asked = []  # plain decoding asks no drafter for anything
    for drafter in engine.drafters.values():
        for name in ("propose", "propose_tree", "draft_class"):
            setattr(drafter, name, lambda *a, _n=name, **k: asked.append(_n))
    found = profile_plain(engine, prompts, settings)
    rows = found["ms_per_token"]
    assert found["tokens"] == len(QUESTIONS) * 22  # every decode step after the first
    assert set(rows) == set(FORWARD_ROWS + HOST_ROWS) and min(rows.values()) >= 0
    assert rows["NF4 layers"] == 0 and rows["attention"] > 0 and rows["LM head"] > 0
    assert rows["masks and penalties"] > 0 and rows["sampling"] > 0
    assert not asked  # (its drafting row is the empty step's bookkeeping alone)
    for drafter in engine.drafters.values():
        for name in ("propose", "propose_tree", "draft_class"):
            delattr(drafter, name)
    forward = sum(rows[r] for r in FORWARD_ROWS)
    assert forward == pytest.approx(found["forward_ms"], rel=1e-6)
    assert forward + sum(rows[r] for r in HOST_ROWS) == pytest.approx(found["step_ms"],
                                                                      rel=1e-6)
    # the hooks and timers go: the engine is as it was, and writes the reply it wrote before
    assert not {"forward", "_chain_distribution", "_draft"} & (set(vars(engine))
                                                               | set(vars(engine.runner)))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in engine.model.modules())
    ids, stops = prompts[0]
    cfg = settings.generate_config("plain", stops, [])
    assert [e.id for e in engine.stream(ids, cfg) if hasattr(e, "kind")] == first
    lines = "\n".join(profile_lines(found, llama_ms=12.5))
    assert "where a plain decoding token goes" in lines and "llama.cpp, a plain token" in lines
    assert f"{found['step_ms']:.2f}" in lines


# Nodes of llama.cpp's forward on the embedded GGUF, as its profile program names them.
LLAMA_NODES = [  # (op, name, weight) -> row
    (("MUL_MAT", "result_output", "token_embd.weight"), "LM head"),
    (("MUL_MAT", "ffn_up", "blk.ffn_up.weight"), "NF4 layers"),
    (("MUL_MAT", "Qcur", "blk.attn_q.weight"), "NF4 layers"),
    (("MUL_MAT", "node", "blk.attn_output.weight"), "NF4 layers"),
    (("GET_ROWS", "inp_embd", "token_embd.weight"), "embedding"),
    (("DUP", "node", "inp_mixed_embd"), "embedding"),
    (("MUL", "inp_scaled", "node"), "embedding"),
    (("RMS_NORM", "norm", "l_out"), "norms"),
    (("MUL", "attn_norm", "norm"), "norms"),
    (("MUL", "Kcur_normed", "norm"), "norms"),
    (("ROPE", "Kcur", "Kcur_normed"), "attention"),
    (("FLASH_ATTN_EXT", "node", "node (view) (permuted)"), "attention"),
    (("MUL_MAT", "kq", "k"), "attention"),
    (("SOFT_MAX", "kq_soft_max", "kq"), "attention"),
    (("GEGLU", "ffn_geglu", "ffn_gate"), "MLP activation"),
    (("ADD", "l_out", "ffn_post_norm"), "rest of the forward"),
]


def test_llama_cpps_nodes_land_in_the_rows_of_specchats_profile():
    from specchat.bench.profile import llama_row

    for (op, name, weight), row in LLAMA_NODES:
        assert llama_row(op, name, weight) == row, (op, name, weight)


def test_llama_cpps_side_splits_its_measured_forward_by_the_nodes_shares():
    """The forward's rows: its time per token (the unsplit pass) in the nodes' shares; the
    sampler chain's own time; what the race's decode-only time per token holds beyond both is
    the server's loop; the rows add up to the token."""
    from specchat.bench.profile import FORWARD_ROWS, HOST_ROWS, llama_rows, profile_lines

    found = {"tokens": 100, "forward_s": 2.0, "sample_s": 0.1, "split_tokens": 100,
             "split_forward_s": 2.6,
             "nodes": [{"op": "MUL_MAT", "name": "result_output", "weight": "token_embd.weight",
                        "seconds": 1.2, "count": 100},
                       {"op": "MUL_MAT", "name": "ffn_up", "weight": "blk.ffn_up.weight",
                        "seconds": 0.6, "count": 1800},
                       {"op": "ADD", "name": "l_out", "weight": "x", "seconds": 0.2,
                        "count": 1800}]}
    got = llama_rows(found, race_ms=22.0)
    rows = got["ms_per_token"]
    assert rows["LM head"] == pytest.approx(12.0) and rows["NF4 layers"] == pytest.approx(6.0)
    assert rows["rest of the forward"] == pytest.approx(2.0) and rows["attention"] == 0
    assert rows["sampling"] == pytest.approx(1.0) and rows["masks and penalties"] == 0
    assert rows["streaming and stats"] == pytest.approx(1.0)  # 22 - 20 - 1
    assert sum(rows[r] for r in FORWARD_ROWS + HOST_ROWS) == pytest.approx(got["step_ms"])
    assert got["split_ms"] == pytest.approx(26.0)
    # no race figure: the token is the forward and the chain
    assert llama_rows(found, None)["step_ms"] == pytest.approx(21.0)
    ours = {"ms_per_token": {r: 1.0 for r in FORWARD_ROWS + HOST_ROWS}, "tokens": 50,
            "step_ms": len(FORWARD_ROWS + HOST_ROWS) * 1.0, "forward_ms": 8.0, "host_ms": 4.0,
            "llama": got}
    text = "\n".join(profile_lines(ours, llama_ms=22.0))
    assert "specchat" in text and "llama.cpp" in text and "12.00" in text and "22.00" in text
    assert "llama.cpp, a plain token" not in text  # its token is in the table's column


def test_llama_cpps_side_says_why_it_is_missing(tmp_path):
    """A llama-server built without the profile program: the profile says how to get it, and
    the report prints it beside specchat's rows."""
    from specchat.bench.profile import FORWARD_ROWS, HOST_ROWS, profile_lines, profile_llama

    server = tmp_path / "llama-server"
    server.write_text("")
    found = profile_llama(server, [([1, 2, 3], ())], BenchSettings(modes=("plain",)), [], 2,
                          None)
    assert "llama-specchat-profile" in found["missing"] and "build" in found["missing"]
    ours = {"ms_per_token": {r: 1.0 for r in FORWARD_ROWS + HOST_ROWS}, "tokens": 5,
            "step_ms": 12.0, "llama": found}
    assert found["missing"] in "\n".join(profile_lines(ours))


@pytest.mark.slow
def test_llama_cpps_profile_program_times_the_embedded_gguf():
    """The program built beside the cached llama-server decodes a prompt with llama.cpp's code
    and times its forward by node: the LM head and the layers' products are the largest rows."""
    from specchat.backends import llama_cpp, llama_profile
    from specchat.bench.profile import llama_rows

    server = llama_cpp.cached_server()
    tool = llama_profile.beside(server) if server else None
    if tool is None:
        pytest.skip("no llama.cpp profile program built (python -m specchat.backends.llama_cpp "
                    "build)")
    found = llama_profile.run(tool, llama_cpp.embedded_gguf(), [[2, 818, 5279, 529, 7001]],
                              threads=2, max_new_tokens=12,
                              sampling={"temperature": 0.0, "repeat_penalty": 1.1},
                              stop=["\nUser:"])
    assert found["tokens"] == found["split_tokens"] > 0
    rows = llama_rows(found, None)["ms_per_token"]
    assert rows["LM head"] > rows["norms"] and rows["NF4 layers"] > rows["norms"] > 0


def test_the_kernels_ab_reads_a_revisions_sources_from_git(tmp_path, capsys):
    """`bench.kernels_ab` compares the working tree's C sources with a git revision's: the
    revision's files come out of git whole (at HEAD of a clean checkout: the working tree's)."""
    import subprocess

    from specchat import kernels
    from specchat.bench import kernels_ab

    try:
        changed = subprocess.run(["git", "status", "--porcelain", "--", str(kernels.CSRC)],
                                 capture_output=True, text=True, check=True,
                                 cwd=kernels.CSRC).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    kernels_ab._sources_at("HEAD", tmp_path)
    got = sorted(p.name for p in tmp_path.iterdir())
    assert "decoder.c" in got and "specchat.h" in got
    assert got == sorted(p.name for p in kernels.CSRC.iterdir() if p.suffix in (".c", ".h"))
    if not changed:
        for name in got:
            assert (tmp_path / name).read_bytes() == (kernels.CSRC / name).read_bytes(), name
    with pytest.raises(SystemExit) as done:
        kernels_ab.main(["--help"])
    assert done.value.code == 0 and "--base" in capsys.readouterr().out


def test_the_kernels_ab_takes_two_integer_kernels_this_cpu_runs(capsys):
    """`--kernels A,B` forces two integer kernels of one build; anything else is refused with
    the kernels it takes, before a model loads."""
    from specchat import kernels
    from specchat.bench import kernels_ab

    if not kernels.runs_here("avx2"):
        pytest.skip("the A/B needs the SIMD build")
    for bad in ("vnni", "vnni,ref", "vnni,nope"):
        assert kernels_ab.main(["--kernels", bad]) == 2
        err = capsys.readouterr().err
        assert "--kernels takes two of" in err and repr(bad) in err
    lib = kernels.load("avx2")
    forced = kernels.with_i8_kernel(lib, "avx2")
    assert forced.decoder_forward_i8.__name__ == "decoder_forward_i8_avx2"
    assert forced.q8_0_rows_matmul_i8.__name__ == "q8_0_rows_matmul_i8_avx2"
