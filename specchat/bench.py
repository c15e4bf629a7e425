"""`python -m specchat bench`: Spec-Bench style benchmark of the engine against transformers.

    python -m specchat bench --limit-per-category 5 --max-new-tokens 128 \
        --modes plain,ngram,hf-plain,hf-pld --json out/bench.json

Every mode runs on the same loaded target, interleaved per question (the mode order rotates from
one question to the next) so machine drift hits all modes alike:
  plain        our engine, speculation off (the very same decode loop with k = 0)
  ngram/model  our engine, speculation on with that drafter
  hf-plain     transformers `generate`, no assistance
  hf-pld       transformers `generate(prompt_lookup_num_tokens=...)` (prompt lookup decoding)
  hf-assisted  transformers `generate(assistant_model=...)`, when a draft model is loaded
All modes get the same prompt ids and the same stop condition (max new tokens, EOS, and the chat
format's stop string unless --ignore-stop-strings), and their tokens are counted alike: the tokens
shown to the user (the engine's `new_tokens`; transformers' output goes through the engine's own
ReplyText, so EOS and a stop string's tokens do not count). Every first turn starts from an empty
KV cache, so prefill is paid by every mode; with `--turns all` a follow-up turn reuses the
engine's cached history (what the chat does) and its time to first token is reported separately.

Numbers (the pure functions below, tested on synthetic step records in tests/test_bench.py):
- tokens/s of a category = sum of new tokens / sum of seconds over its (question, turn) items,
  each item's tokens and seconds being medians over `--repeats`; speedup = that over `plain`'s on
  the same items. Counts (drafted, accepted, target calls) pool every repeat.
- alpha = accepted / (accepted + rejections): the per-position acceptance estimate of Leviathan et
  al. 2022 (DESIGN.md's definition); c = draft seconds per drafted token / seconds of a plain
  target step; verify ratio = seconds of a speculative step's target forward (k + 1 tokens fed)
  / the plain step's. A draft tree (tree.py) counts as a chain as long as its depth: k is the
  depth, alpha the chance the accepted path goes one level further, c the draft seconds per
  level; its verify ratio is measured at its real width.
  Leviathan et al. 2022, expected walltime improvement:
  (1 - alpha^(k+1)) / ((1 - alpha)(c k + verify_ratio)), where this engine's verify cost for
  k + 1 tokens is measured instead of assumed equal to one step's. The formula covers decoding
  only; "+prefill" adds the prompt's encoding, unchanged by speculation (Amdahl's law with the
  share of plain's time spent in the first forward), to predict the end-to-end speedup measured.
- Time inside the target's forward is measured with forward hooks for every mode, so "overhead per
  token" (wall time outside the model's forward) compares the two decode loops directly.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specchat.engine import TREE_NODES
from specchat.events import TARGET, GenerationStats, StepRecord, TokenEvent, summarize

ENGINE_MODES = ("plain", "ngram", "model")  # "plain" = speculation off; others name a drafter
HF_MODES = ("hf-plain", "hf-pld", "hf-assisted")
ALL_MODES = (*ENGINE_MODES, *HF_MODES)
HEAD_MODES = ("head", "combined",  # engine drafters that exist once `train-draft` made a head
              "head-tree", "combined-tree")  # ... drafting trees of --tree-nodes (tree.py)
NEEDS_DRAFT = ("model", "hf-assisted")
QUESTIONS_REL = Path("benchmarks") / "spec_bench" / "question.jsonl"


@dataclass
class BenchSettings:
    modes: tuple[str, ...] = ("plain", "ngram", "hf-plain", "hf-pld")
    turns: str = "first"  # first | all
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0  # the same seed for every run: repeats decode the same text
    draft_len: int = 4  # k for our engine (the most draft tokens per step)
    adaptive: bool = True  # let the engine adapt k (never above draft_len)
    hf_pld_tokens: int = 0  # prompt_lookup_num_tokens for hf-pld (0: the same as draft_len)
    tree_nodes: int = TREE_NODES  # draft-tree size of the "-tree" modes
    repeats: int = 1  # runs per (question, mode); timings are medians over them
    warmup_tokens: int = 16  # one short unrecorded run per mode before the first question
    stop_strings: bool = True  # stop at the chat format's stop strings (False: EOS and length)


@dataclass
class Run:
    """One mode on one turn of one question, one repeat."""
    question_id: int | str
    category: str
    turn: int  # from 1
    mode: str
    repeat: int
    new_tokens: int
    seconds: float  # request to last token, prefill included
    ttft_s: float  # request to first token
    prompt_tokens: int
    prefill_tokens: int  # prompt tokens actually encoded (the rest came from the prefix cache)
    target_calls: int  # target forwards, prefill included
    forward_s: float  # seconds inside the target's forward (hooks)
    steps: list[StepRecord] = field(default_factory=list)  # decode steps, prefill excluded
    text: str = ""
    stop_reason: str = ""
    error: str = ""
    prefill_s: float = 0.0  # seconds of the first target forward: the prompt's encoding


# ---------------------------------------------------------------------------------------------
# Questions


def default_questions_path(start: Path | None = None) -> Path | None:
    """Spec-Bench's question.jsonl in a `shared/` folder next to (or above) the repository."""
    repo = Path(__file__).resolve().parents[1]
    bases = [repo, *repo.parents, Path.cwd(), *Path.cwd().parents]
    if start is not None:
        bases.insert(0, start)
    for base in bases:
        for candidate in (base / "shared" / QUESTIONS_REL, base / QUESTIONS_REL):
            if candidate.is_file():
                return candidate
    return None


def load_questions(path: str | Path, categories: Iterable[str] | None = None,
                   limit_per_category: int | None = None) -> list[dict]:
    """JSONL, one question a line with `turns` (list of user messages) and `category`.
    Keeps file order; the first `limit_per_category` of each category."""
    wanted = list(categories or [])
    out, seen = [], defaultdict(int)
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            q = json.loads(line)
            turns = q.get("turns")
            if isinstance(turns, str):
                turns = [turns]
            if not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError(f"{path}:{n}: a question needs `turns`, a list of strings")
            cat = str(q.get("category", "all"))
            if wanted and cat not in wanted:
                continue
            if limit_per_category is not None and seen[cat] >= limit_per_category:
                continue
            seen[cat] += 1
            out.append({"question_id": q.get("question_id", n), "category": cat, "turns": turns})
    missing = [c for c in wanted if not seen[c]]
    if missing:
        raise ValueError(f"no questions in categories {', '.join(missing)} in {path}")
    return out


# ---------------------------------------------------------------------------------------------
# Arithmetic: pure functions over runs and step records


def spec_counts(steps: list[StepRecord]) -> GenerationStats:
    """drafted, accepted, rejections, alpha, acceptance rate... of a list of steps."""
    return summarize(steps, GenerationStats())


def leviathan_speedup(alpha: float, k: float, c: float, verify_ratio: float = 1.0) -> float:
    """Expected speedup of k drafts per step over plain decoding: Leviathan et al. 2022's
    walltime improvement factor, with the target's cost for k + 1 tokens measured
    (`verify_ratio` plain steps) instead of assumed equal to one step's."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    cost = c * k + verify_ratio
    return tokens / cost if cost > 0 else 0.0


def step_costs(steps: list[StepRecord], plain_steps: list[StepRecord]) -> dict:
    """Measured cost model of a speculative mode, in units of one plain target step.

    steps:       the mode's decode steps (with and without drafts)
    plain_steps: steps of plain decoding (speculation off) on the same target
    """
    spec = [s for s in steps if s.drafted > 0]
    counts = spec_counts(steps)
    base = [s.verify_s + s.draft_s for s in plain_steps if s.drafted == 0]
    plain_s = sum(base) / len(base) if base else 0.0
    out = {"alpha": counts.alpha if spec else None,
           "acceptance_rate": counts.acceptance_rate if spec else None,
           "plain_step_s": plain_s, "spec_steps": len(spec), "steps": len(steps),
           "k_mean": sum(s.levels for s in spec) / len(spec) if spec else 0.0,
           "c": None, "verify_ratio": None, "verify_ratio_by_fed": {}}
    if not spec or plain_s <= 0:
        return out
    out["c"] = sum(s.draft_s for s in spec) / sum(s.levels for s in spec) / plain_s
    out["verify_ratio"] = sum(s.verify_s for s in spec) / len(spec) / plain_s
    by_fed = defaultdict(list)
    for s in steps:
        by_fed[s.drafted + 1].append(s.verify_s)
    out["verify_ratio_by_fed"] = {m: sum(v) / len(v) / plain_s for m, v in sorted(by_fed.items())}
    return out


def predicted_speedup(costs: dict) -> float | None:
    """Leviathan's formula at the mode's measured alpha, mean k, c and verify ratio."""
    if costs.get("alpha") is None or costs.get("c") is None:
        return None
    return leviathan_speedup(costs["alpha"], costs["k_mean"], costs["c"], costs["verify_ratio"])


def predicted_speedup_steps(steps: list[StepRecord], costs: dict) -> float | None:
    """The same model applied step by step: each step with k_i drafts is expected to emit
    (1 - alpha^(k_i+1)) / (1 - alpha) tokens at a cost of c k_i + verify_ratio(k_i + 1) plain
    steps; steps with nothing to draft (k_i = 0) emit one token at about one step's cost. Fairer
    than the one-k formula when the drafter often has nothing to propose or k adapts."""
    alpha, c, ratios = costs.get("alpha"), costs.get("c"), costs.get("verify_ratio_by_fed")
    if alpha is None or c is None or not steps:
        return None
    tokens = cost = 0.0
    for s in steps:
        k = s.levels
        tokens += k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
        cost += c * k + ratios.get(s.drafted + 1, 1.0)
    return tokens / cost if cost > 0 else None


def with_prefill(speedup: float | None, prefill_share: float | None) -> float | None:
    """Amdahl's law on a decoding speedup: speculation leaves the prompt's encoding as it is, so
    a reply whose plain time is a fraction `prefill_share` prefill ends up only
    1 / (share + (1 - share) / speedup) faster. Predicts end-to-end tokens/s, as measured."""
    if speedup is None or prefill_share is None or speedup <= 0:
        return None
    return 1.0 / (prefill_share + (1.0 - prefill_share) / speedup)


def prefill_share(runs: list[Run]) -> float | None:
    """Fraction of these runs' time (medians per item) spent encoding prompts."""
    med = [_median_item(rs) for rs in group_items(runs).values()]
    seconds = sum(m["seconds"] for m in med)
    return sum(m["prefill_s"] for m in med) / seconds if seconds > 0 else None


def _median_item(runs: list[Run]) -> dict:
    return {"new_tokens": statistics.median(r.new_tokens for r in runs),
            "seconds": statistics.median(r.seconds for r in runs),
            "ttft_s": statistics.median(r.ttft_s for r in runs),
            "forward_s": statistics.median(r.forward_s for r in runs),
            "prefill_s": statistics.median(r.prefill_s for r in runs)}


def group_items(runs: list[Run]) -> dict[tuple, list[Run]]:
    """(mode, question_id, turn) -> the runs of that item, one per repeat."""
    items: dict[tuple, list[Run]] = defaultdict(list)
    for r in runs:
        items[(r.mode, r.question_id, r.turn)].append(r)
    return items


def metrics(runs: list[Run], plain_runs: list[Run] | None = None) -> dict:
    """The per-category / overall numbers of one mode (see the module docstring)."""
    items = group_items(runs)
    med = {key[1:]: _median_item(rs) for key, rs in items.items()}
    tokens = sum(m["new_tokens"] for m in med.values())
    seconds = sum(m["seconds"] for m in med.values())
    tps = tokens / seconds if seconds > 0 else 0.0
    speedup = None
    if plain_runs is not None:
        plain_med = {key[1:]: _median_item(rs) for key, rs in group_items(plain_runs).items()}
        shared = [k for k in med if k in plain_med]
        p_tok = sum(plain_med[k]["new_tokens"] for k in shared)
        p_sec = sum(plain_med[k]["seconds"] for k in shared)
        m_tok = sum(med[k]["new_tokens"] for k in shared)
        m_sec = sum(med[k]["seconds"] for k in shared)
        if p_tok and p_sec > 0 and m_sec > 0:
            speedup = (m_tok / m_sec) / (p_tok / p_sec)
    steps = [s for r in runs for s in r.steps]
    counts = spec_counts(steps)
    all_tokens = sum(r.new_tokens for r in runs)
    first = [m for (q, turn), m in med.items() if turn == 1]
    second = [(q, turn) for (q, turn) in med if turn == 2]
    out = {
        "tokens_per_s": tps,
        "speedup": speedup,
        "acceptance_rate": counts.acceptance_rate if counts.drafted else None,
        "mean_accepted_len": counts.mean_accepted_len if counts.drafted else None,
        "target_calls_per_token": (sum(r.target_calls for r in runs) / all_tokens
                                   if all_tokens else None),
        "ttft_s": statistics.mean(m["ttft_s"] for m in first) if first else None,
        "alpha": counts.alpha if counts.drafted else None,
        "questions": len({q for q, _ in med}),
        "new_tokens": tokens,
        "seconds": seconds,
        "overhead_ms_per_token": (1000 * (seconds - sum(m["forward_s"] for m in med.values()))
                                  / tokens if tokens else None),
    }
    if second:
        t2 = [rs for key, rs in items.items() if key[2] == 2]
        out["turn2_ttft_s"] = statistics.mean(_median_item(rs)["ttft_s"] for rs in t2)
        out["turn2_prompt_tokens"] = statistics.mean(rs[0].prompt_tokens for rs in t2)
        out["turn2_prefill_tokens"] = statistics.mean(rs[0].prefill_tokens for rs in t2)
    return out


def greedy_identical(runs: list[Run], modes: Iterable[str]) -> dict[str, float | None]:
    """Fraction of questions whose reply texts (every turn, first repeat) equal plain's."""
    texts: dict[tuple, dict[int, str]] = defaultdict(dict)
    for r in runs:
        if r.repeat == 0:
            texts[(r.mode, r.question_id)][r.turn] = r.text
    out = {}
    for mode in modes:
        qids = [q for (m, q) in texts if m == mode and ("plain", q) in texts]
        out[mode] = (sum(texts[(mode, q)] == texts[("plain", q)] for q in qids) / len(qids)
                     if qids else None)
    return out


def same_text_speedup(runs: list[Run], plain_runs: list[Run]) -> dict:
    """Speedup over the items whose reply text equals plain's. Greedy NF4 replies can diverge
    between modes (see README); a diverged reply of another length moves tokens/s through the
    fixed cost of prefill alone, so this is the like-for-like view of decoding speed."""
    texts = {(r.question_id, r.turn): r.text for r in plain_runs if r.repeat == 0}
    same = {(r.question_id, r.turn) for r in runs
            if r.repeat == 0 and texts.get((r.question_id, r.turn)) == r.text}
    keep = [r for r in runs if (r.question_id, r.turn) in same]
    base = [r for r in plain_runs if (r.question_id, r.turn) in same]
    return {"same_text_items": len(same),
            "same_text_speedup": metrics(keep, base)["speedup"] if same else None}


def summarize_bench(runs: list[Run], modes: Iterable[str], config: dict) -> dict:
    """The report: {"config", "modes": {MODE: {"overall", "by_category", "analysis"}},
    "greedy_identical": {MODE: fraction}} (see issue 5 for the shape)."""
    modes = list(modes)
    by_mode: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        by_mode[r.mode].append(r)
    plain = by_mode.get("plain")
    categories = list(dict.fromkeys(r.category for r in runs))  # file order
    plain_steps = [s for r in (plain or []) for s in r.steps]
    out_modes = {}
    for mode in modes:
        mruns = by_mode.get(mode, [])
        entry = {"overall": metrics(mruns, plain),
                 "by_category": {}}
        for cat in categories:
            cruns = [r for r in mruns if r.category == cat]
            if cruns:
                entry["by_category"][cat] = metrics(
                    cruns, [r for r in plain if r.category == cat] if plain else None)
        steps = [s for r in mruns for s in r.steps]
        if mode not in ("plain", "hf-plain") and any(s.drafted for s in steps):
            costs = step_costs(steps, plain_steps if mode in ENGINE_MODES + HEAD_MODES else
                               [s for r in by_mode.get("hf-plain", []) for s in r.steps])
            costs["predicted_speedup"] = predicted_speedup(costs)
            costs["predicted_speedup_steps"] = predicted_speedup_steps(steps, costs)
            base = plain if mode in ENGINE_MODES + HEAD_MODES else by_mode.get("hf-plain")
            qids = {r.question_id for r in mruns}
            costs["prefill_share"] = prefill_share([r for r in base or [] if r.question_id in qids])
            costs["predicted_speedup_e2e"] = with_prefill(costs["predicted_speedup_steps"],
                                                          costs["prefill_share"])
            costs["achieved_speedup"] = entry["overall"]["speedup"]
            entry["analysis"] = costs
        out_modes[mode] = entry
    # Same text as plain: greedy, every engine mode should match; sampled too, but for a draft
    # model (its drafts take Leviathan's test with random numbers of their own).
    identical = greedy_identical(runs, modes)
    if plain:
        for mode in modes:
            out_modes[mode]["overall"].update(same_text_speedup(by_mode.get(mode, []), plain))
    greedy = config.get("temperature", 0.0) <= 0
    return {"config": config, "modes": out_modes,
            "greedy_identical": identical if greedy else {m: None for m in modes},
            "identical_to_plain": identical}


# ---------------------------------------------------------------------------------------------
# Report text


def _f(x, fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def format_report(result: dict) -> str:
    modes = list(result["modes"])
    head = (f"{'category':<15} {'mode':<12} {'tok/s':>7} {'speedup':>8} {'accept':>7} "
            f"{'acc.len':>7} {'calls/tok':>9} {'TTFT s':>7} {'ovh ms/tok':>10}")
    lines = [head, "-" * len(head)]

    def rows(label: str, get) -> None:
        for i, mode in enumerate(modes):
            m = get(result["modes"][mode])
            if m is None:
                continue
            lines.append(
                f"{label if i == 0 else '':<15} {mode:<12} {m['tokens_per_s']:>7.1f} "
                f"{_f(m['speedup'], '.2f') + 'x' if m['speedup'] is not None else '-':>8} "
                f"{_f(m['acceptance_rate'], '.0%'):>7} {_f(m['mean_accepted_len'], '.2f'):>7} "
                f"{_f(m['target_calls_per_token'], '.2f'):>9} {_f(m['ttft_s'], '.3f'):>7} "
                f"{_f(m['overhead_ms_per_token'], '.1f'):>10}")

    categories = list(dict.fromkeys(c for m in result["modes"].values() for c in m["by_category"]))
    for cat in categories:
        rows(cat, lambda e, cat=cat: e["by_category"].get(cat))
    lines.append("-" * len(head))
    rows("overall", lambda e: e["overall"])

    turn2 = [(mode, e["overall"]) for mode, e in result["modes"].items()
             if "turn2_ttft_s" in e["overall"]]
    if turn2:
        lines.append("")
        lines.append("follow-up turns (turn 2): mean TTFT, prompt tokens, tokens encoded")
        for mode, o in turn2:
            lines.append(f"  {mode:<12} TTFT {o['turn2_ttft_s']:.3f} s  prompt "
                         f"{o['turn2_prompt_tokens']:.0f}  prefilled "
                         f"{o['turn2_prefill_tokens']:.0f}  (turn 1 TTFT "
                         f"{_f(o['ttft_s'], '.3f')} s)")

    analysed = [(mode, e["analysis"]) for mode, e in result["modes"].items() if "analysis" in e]
    if analysed:
        lines.append("")
        lines.append("cost model (Leviathan et al.: (1 - a^(k+1)) / ((1 - a)(c k + verify)),"
                     " costs in plain target steps)")
        lines.append("  formula: at the mean k of drafting steps; per-step: the same model summed"
                     " over every step's own k, steps with nothing to draft included;")
        lines.append("  +prefill: per-step with the prompt's encoding, which speculation does not"
                     " speed up (Amdahl, prefill share of plain's time)")
        lines.append(f"  {'mode':<12} {'alpha':>6} {'k mean':>6} {'c':>7} {'verify':>7} "
                     f"{'formula':>8} {'per-step':>8} {'prefill':>7} {'+prefill':>8} "
                     f"{'achieved':>8} {'ach/form':>8} {'ach/step':>8} {'ach/+pf':>8}")
        for mode, a in analysed:
            ach, pred, step, e2e = (a["achieved_speedup"], a["predicted_speedup"],
                                    a["predicted_speedup_steps"], a.get("predicted_speedup_e2e"))
            lines.append(
                f"  {mode:<12} {_f(a['alpha'], '.3f'):>6} {a['k_mean']:>6.2f} "
                f"{_f(a['c'], '.4f'):>7} {_f(a['verify_ratio'], '.3f'):>7} "
                f"{_x(pred):>8} {_x(step):>8} {_f(a.get('prefill_share'), '.0%'):>7} "
                f"{_x(e2e):>8} {_x(ach):>8} "
                f"{_f(ach / pred if ach and pred else None, '.0%'):>8} "
                f"{_f(ach / step if ach and step else None, '.0%'):>8} "
                f"{_f(ach / e2e if ach and e2e else None, '.0%'):>8}")
            by_fed = " ".join(f"{m}:{r:.2f}" for m, r in a["verify_ratio_by_fed"].items())
            if by_fed:
                lines.append(f"  {'':<12} verify cost by tokens fed: {by_fed}  "
                             f"(plain step {1000 * a['plain_step_s']:.1f} ms)")
            else:
                base = "hf-plain" if mode in HF_MODES else "plain"
                lines.append(f"  {'':<12} (no costs: run {base} too for a baseline step)")
    ident = {m: v for m, v in result.get("identical_to_plain", {}).items() if v is not None}
    if ident:
        lines.append("")
        lines.append("text identical to plain (same seed): " +
                     ", ".join(f"{m} {v:.0%}" for m, v in ident.items()))
        same = [(m, e["overall"]) for m, e in result["modes"].items()
                if m != "plain" and e["overall"].get("same_text_speedup") is not None]
        if same:
            lines.append("speedup on those identical replies only: " + ", ".join(
                f"{m} {_x(o['same_text_speedup'])} ({o['same_text_items']})" for m, o in same))
    cfg = result["config"]
    if cfg.get("peak_rss_mb"):
        after = (f" (after loading: peak {cfg['peak_rss_after_load_mb']:.0f} MB, resident "
                 f"{cfg['rss_after_load_mb']:.0f} MB)" if cfg.get("rss_after_load_mb") else "")
        lines.append(f"peak RSS {cfg['peak_rss_mb']:.0f} MB{after}")
    if cfg.get("interrupted"):
        lines.append(f"interrupted: {cfg.get('questions_done', 0)} of "
                     f"{cfg.get('questions_planned', 0)} questions measured")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Running the modes


class _Probe:
    """Times the target's forward (hooks) and, as a transformers streamer, when tokens come out."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.calls: list[tuple[int, float]] = []  # (tokens fed, seconds in forward)
        self.puts: list[tuple[int, float]] = []  # (tokens streamed, perf_counter)
        self._prompt_seen = False
        self._t = 0.0
        self._fed = 0

    def attach(self, model) -> list:
        return [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                model.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._fed = int(ids.shape[-1]) if ids is not None else 0
        self._t = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        self.calls.append((self._fed, time.perf_counter() - self._t))

    # transformers' BaseStreamer protocol: the prompt first, then each step's new tokens
    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.puts.append((int(value.numel()), time.perf_counter()))

    def end(self) -> None:
        pass


def hf_steps(calls: list[tuple[int, float]], puts: list[tuple[int, float]],
             prompt_len: int) -> list[StepRecord]:
    """Step records of a transformers `generate` call, from its target forwards (tokens fed) and
    what it streamed after each (accepted + 1 tokens). The first call (prefill, which in assisted
    generation may also verify drafts) is left out, like the engine's prefill."""
    if len(calls) != len(puts):
        return []  # not one stream per forward: no per-step view
    steps = []
    for i in range(1, len(calls)):
        fed, forward_s = calls[i]
        drafted = fed - 1
        emitted = puts[i][0]
        steps.append(StepRecord(i, drafted, max(0, min(drafted, emitted - 1)), emitted, 0.0,
                                forward_s))
    return steps


class _StopText:
    """transformers stopping criterion: the reply so far contains a stop string."""

    def __init__(self, tokenizer, stops, prompt_len: int):
        self.tokenizer, self.prompt_len = tokenizer, prompt_len
        self.stops = [s for s in stops if s]

    def __call__(self, input_ids, scores, **kwargs):
        import torch
        text = self.tokenizer.decode(input_ids[0, self.prompt_len:].tolist(),
                                     skip_special_tokens=False)
        hit = any(s in text for s in self.stops)
        return torch.full((input_ids.shape[0],), hit, dtype=torch.bool, device=input_ids.device)


def run_engine_mode(engine, probe: _Probe, ids: list[int], stops, mode: str, s: BenchSettings,
                    fresh: bool, max_new_tokens: int | None = None) -> dict:
    from specchat.engine import GenerateConfig
    if fresh:
        engine.reset_cache()  # every first turn pays its prefill, as generate() does
    cfg = GenerateConfig(max_new_tokens=max_new_tokens or s.max_new_tokens,
                         temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
                         speculation=mode != "plain",
                         drafter=mode.removesuffix("-tree") if mode != "plain" else "ngram",
                         draft_len=s.draft_len, adaptive=s.adaptive, stop=tuple(stops),
                         tree_nodes=s.tree_nodes if mode.endswith("-tree") else 0)
    probe.reset()
    text, steps, stats = [], [], None
    for ev in engine.stream(ids, cfg):
        if isinstance(ev, TokenEvent):
            text.append(ev.text)
        elif isinstance(ev, StepRecord):
            steps.append(ev)
        elif isinstance(ev, GenerationStats):
            stats = ev
    return dict(new_tokens=stats.new_tokens, seconds=stats.seconds, ttft_s=stats.ttft_s,
                prompt_tokens=stats.prompt_tokens, prefill_tokens=stats.prefill_tokens,
                target_calls=stats.target_calls, forward_s=sum(t for _, t in probe.calls),
                prefill_s=probe.calls[0][1] if probe.calls else 0.0,
                steps=steps, text="".join(text), stop_reason=stats.stop_reason,
                error=stats.error)


def run_hf_mode(engine, probe: _Probe, ids: list[int], stops, mode: str, s: BenchSettings,
                assistant=None, max_new_tokens: int | None = None) -> dict:
    """transformers `generate` on the engine's target with the same prompt and stop condition."""
    import torch

    from specchat.text import ReplyText

    model, tok = engine.model, engine.tokenizer
    input_ids = torch.tensor([ids], device=engine.device)
    eos = sorted(engine.eos_ids)
    kwargs: dict = dict(max_new_tokens=max_new_tokens or s.max_new_tokens,
                        do_sample=s.temperature > 0, eos_token_id=eos,
                        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos[0],
                        attention_mask=torch.ones_like(input_ids), streamer=probe)
    if s.temperature > 0:
        kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    if stops:
        # Not generate(stop_strings=...): assisted generation hands those to the assistant's own
        # generate(), which then refuses to run without a tokenizer of its own.
        from transformers import StoppingCriteriaList
        kwargs["stopping_criteria"] = StoppingCriteriaList([_StopText(tok, stops, len(ids))])
    if mode == "hf-pld":
        kwargs["prompt_lookup_num_tokens"] = s.hf_pld_tokens or s.draft_len
    elif mode == "hf-assisted":
        kwargs["assistant_model"] = assistant
    probe.reset()
    start = time.perf_counter()
    with torch.inference_mode():
        if s.temperature > 0:
            torch.manual_seed(s.seed)
        out = model.generate(input_ids, **kwargs)
    seconds = time.perf_counter() - start
    # Count and cut exactly as the engine does: tokens shown to the user (not EOS, not a stop
    # string's), text through the engine's own ReplyText.
    reply, shown, hit, stop_reason = ReplyText(tok, ids, stops), [], False, "length"
    for t in out[0, len(ids):].tolist():
        if t in engine.eos_ids:
            stop_reason = "eos"
            break
        released, hit = reply.push(TokenEvent(t, "", TARGET, 0, 0, 0))
        shown.extend(released)
        if hit:
            stop_reason = "stop_string"
            break
    if not hit:
        shown.extend(reply.finish())
    ttft = probe.puts[0][1] - start if probe.puts else seconds
    return dict(new_tokens=len(shown), seconds=seconds, ttft_s=ttft, prompt_tokens=len(ids),
                prefill_tokens=len(ids), target_calls=len(probe.calls),
                forward_s=sum(t for _, t in probe.calls),
                prefill_s=probe.calls[0][1] if probe.calls else 0.0,
                steps=hf_steps(probe.calls, probe.puts, len(ids)),
                text="".join(e.text for e in shown),
                stop_reason=stop_reason, error="")


def available_modes(engine, assistant) -> list[str]:
    return [m for m in ALL_MODES
            if m not in NEEDS_DRAFT or ("model" in engine.drafters and assistant is not None)] \
        + [m for m in HEAD_MODES if m.removesuffix("-tree") in engine.drafters]


def bench(engine, questions: list[dict], s: BenchSettings, assistant=None,
          progress: bool = True, log: Callable[[str], None] | None = None,
          extra_config: dict | None = None) -> dict:
    """Run every mode on every question (interleaved), return summarize_bench's report.
    Ctrl-C stops early and returns what was measured: whole questions only, so every mode is
    compared on the same ones."""
    from specchat.text import chat_prompt
    from tqdm import tqdm

    log = log or (lambda msg: print(msg, file=sys.stderr))
    for m in s.modes:
        if m not in ALL_MODES + HEAD_MODES:
            raise ValueError(f"unknown mode {m!r}; modes: {', '.join(ALL_MODES + HEAD_MODES)}")
        if m in HEAD_MODES and m.removesuffix("-tree") not in engine.drafters:
            raise ValueError(f"mode {m!r} needs a draft head for this target: "
                             f"python -m specchat train-draft")
        if m in ENGINE_MODES[1:] and m not in engine.drafters:
            raise ValueError(f"mode {m!r} needs the {m!r} drafter (load a --draft-model)")
        if m == "hf-assisted" and assistant is None:
            raise ValueError("mode 'hf-assisted' needs a draft model (--draft-model)")
    probe, draft_probe = _Probe(), _Probe()
    hooks = probe.attach(engine.model) + (draft_probe.attach(assistant) if assistant is not None
                                          else [])
    runs: list[Run] = []
    bar = None
    done = 0
    interrupted = False
    started = time.time()

    def run_mode(mode, ids, stops, fresh, max_new=None) -> dict:
        if mode in ENGINE_MODES + HEAD_MODES:
            return run_engine_mode(engine, probe, ids, stops, mode, s, fresh, max_new)
        draft_probe.reset()
        r = run_hf_mode(engine, probe, ids, stops, mode, s, assistant, max_new)
        if mode == "hf-assisted":  # spread the assistant's forward time over the drafts
            drafted = sum(st.drafted for st in r["steps"])
            per_token = sum(t for _, t in draft_probe.calls) / drafted if drafted else 0.0
            for st in r["steps"]:
                st.draft_s = st.drafted * per_token
        return r

    try:
        if s.warmup_tokens and questions:
            ids, stops = chat_prompt(engine.tokenizer,
                                     [{"role": "user", "content": questions[0]["turns"][0]}])
            for mode in s.modes:
                run_mode(mode, ids, stops, True, s.warmup_tokens)
        bar = tqdm(questions, desc="bench", unit="question", file=sys.stderr, disable=not progress,
                   dynamic_ncols=True)
        for qi, q in enumerate(bar):
            turns = q["turns"] if s.turns == "all" else q["turns"][:1]
            q_runs: list[Run] = []
            for rep in range(s.repeats):
                shift = (qi + rep) % len(s.modes)
                for mode in s.modes[shift:] + s.modes[:shift]:
                    bar.set_postfix_str(f"{q['category']} {mode}", refresh=False)
                    messages: list[dict] = []
                    for ti, user in enumerate(turns):
                        messages.append({"role": "user", "content": user})
                        ids, stops = chat_prompt(engine.tokenizer, messages)
                        r = run_mode(mode, ids, stops if s.stop_strings else (), fresh=ti == 0)
                        if r["error"]:
                            log(f"bench: {mode} on question {q['question_id']}: {r['error']}")
                        q_runs.append(Run(q["question_id"], q["category"], ti + 1, mode, rep,
                                          **r))
                        messages.append({"role": "assistant", "content": r["text"]})
            runs.extend(q_runs)
            done += 1
        bar.close()
    except KeyboardInterrupt:
        interrupted = True
        if bar is not None:
            bar.close()
        log("bench: interrupted; reporting the questions measured so far")
    finally:
        for h in hooks:
            h.remove()
    config = {**asdict(s), "modes": list(s.modes),
              "questions_planned": len(questions), "questions_done": done,
              "interrupted": interrupted, "wall_s": time.time() - started,
              "peak_rss_mb": peak_rss_mb(), **(extra_config or {})}
    return summarize_bench(runs, s.modes, config) | {"runs": [_run_json(r) for r in runs]}


def _run_json(r: Run) -> dict:
    d = asdict(r)
    # compact: [drafted, accepted, draft_s, verify_s(, tree depth)] per step
    d["steps"] = [[st["drafted"], st["accepted"], round(st["draft_s"], 6),
                   round(st["verify_s"], 6)] + ([st["tree_depth"]] if st["tree_depth"] else [])
                  for st in d["steps"]]
    return d


def peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024  # bytes vs KiB


def current_rss_mb() -> float | None:
    """Resident memory now (Linux), to tell a loading spike from what decoding holds."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def machine_config() -> dict:
    import os

    import torch
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


# ---------------------------------------------------------------------------------------------
# CLI


def _modes_arg(value: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(m.strip() for m in value.split(",") if m.strip()))
    bad = [m for m in modes if m not in ALL_MODES + HEAD_MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(bad) or '(none)'}; choose from "
            f"{', '.join(ALL_MODES + HEAD_MODES)}")
    return modes


def add_cli(subparsers) -> argparse.ArgumentParser:
    from specchat.cli import add_model_arguments
    p = subparsers.add_parser(
        "bench", help="benchmark decoding modes on a question set (Spec-Bench)",
        description="Run a JSONL question set (Spec-Bench's by default) in several decoding "
                    "modes side by side on one loaded target, interleaved per question, and "
                    "report tokens/s, speedup over plain decoding, acceptance, target calls per "
                    "token and time to first token, per category and overall.")
    p.add_argument("--questions", default=None,
                   help="JSONL file, one question a line with `turns` and `category` (default: "
                        "../shared/benchmarks/spec_bench/question.jsonl next to the repository)")
    p.add_argument("--categories", nargs="+", default=None,
                   help="only these categories (space or comma separated)")
    p.add_argument("--limit-per-category", type=int, default=None, metavar="N",
                   help="the first N questions of each category")
    p.add_argument("--turns", choices=["first", "all"], default="first",
                   help="first turns only, or every turn (follow-ups reuse the cached history)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", type=_modes_arg, default=None,
                   help=f"comma separated, from {','.join(ALL_MODES + HEAD_MODES)} (default: "
                        "every mode the loaded models allow)")
    p.add_argument("--draft-len", type=int, default=4, help="k: most draft tokens per step")
    p.add_argument("--fixed-draft-len", action="store_true",
                   help="always draft k tokens (default: the engine adapts k)")
    p.add_argument("--tree-nodes", type=int, default=TREE_NODES, metavar="N",
                   help="draft-tree size of the head-tree and combined-tree modes "
                        "(default: %(default)s)")
    p.add_argument("--hf-pld-tokens", type=int, default=0, metavar="N",
                   help="prompt_lookup_num_tokens for hf-pld (default: --draft-len)")
    p.add_argument("--repeats", type=int, default=1, help="runs per question and mode; "
                                                          "timings are medians")
    p.add_argument("--ignore-stop-strings", action="store_true",
                   help="stop at EOS and --max-new-tokens only, not at the chat format's stop "
                        "strings (longer replies: decoding speed rather than short answers)")
    p.add_argument("--warmup-tokens", type=int, default=16,
                   help="tokens of one unrecorded warm-up run per mode (0: none)")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch CPU threads (default: torch's choice). On a machine shared with "
                        "other busy processes, 1 avoids threads waiting on each other")
    p.add_argument("--json", metavar="OUT", default=None, help="write the full report here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p


def cmd_bench(args) -> int:
    from specchat.cli import load_from_args
    from specchat.models import ModelLoadError

    path = args.questions or default_questions_path()
    if path is None:
        print("specchat: no question file given and Spec-Bench's question.jsonl was not found "
              "next to the repository; pass --questions FILE.", file=sys.stderr)
        return 2
    categories = [c for arg in (args.categories or []) for c in arg.split(",") if c]
    try:
        questions = load_questions(path, categories, args.limit_per_category)
    except (OSError, ValueError) as e:
        print(f"specchat: {e}", file=sys.stderr)
        return 2
    if not questions:
        print(f"specchat: no questions in {path}", file=sys.stderr)
        return 2
    for name, ok in (("--max-new-tokens", args.max_new_tokens >= 1),
                     ("--repeats", args.repeats >= 1),
                     ("--draft-len", 1 <= args.draft_len <= 16),
                     ("--temperature", args.temperature >= 0),
                     ("--top-p", 0 < args.top_p <= 1), ("--top-k", args.top_k >= 0)):
        if not ok:
            print(f"specchat: {name} out of range", file=sys.stderr)
            return 2
    if args.threads > 0:
        import torch
        torch.set_num_threads(args.threads)
    try:
        report = load_from_args(args, lambda msg: print(msg, file=sys.stderr))
    except ModelLoadError as e:
        print(f"specchat: {e}", file=sys.stderr)
        return 1
    for note in report.notes:
        print(f"specchat: {note}", file=sys.stderr)
    loaded_peak_mb, loaded_rss_mb = peak_rss_mb(), current_rss_mb()
    engine = report.engine
    assistant = report.draft.model if report.draft else None
    modes = args.modes or tuple(available_modes(engine, assistant))
    try:
        import transformers
        transformers.logging.set_verbosity_error()  # generate()'s per-call advice, not results
    except Exception:  # noqa: BLE001
        pass
    settings = BenchSettings(modes=modes, turns=args.turns, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                             seed=args.seed, draft_len=args.draft_len,
                             adaptive=not args.fixed_draft_len, hf_pld_tokens=args.hf_pld_tokens,
                             tree_nodes=args.tree_nodes,
                             repeats=args.repeats, warmup_tokens=args.warmup_tokens,
                             stop_strings=not args.ignore_stop_strings)
    extra = {"questions_file": str(path), "categories": categories or None,
             "limit_per_category": args.limit_per_category,
             "target": engine.target.label, "draft": report.draft.label if report.draft else None,
             "command": "python -m specchat " + " ".join(sys.argv[1:]),
             "peak_rss_after_load_mb": loaded_peak_mb, "rss_after_load_mb": loaded_rss_mb,
             **machine_config()}
    try:
        result = bench(engine, questions, settings, assistant, progress=not args.no_progress,
                       extra_config=extra)
    except ValueError as e:
        print(f"specchat: {e}", file=sys.stderr)
        return 2
    print(format_report(result))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"report written to {out}", file=sys.stderr)
    return 130 if result["config"]["interrupted"] else 0
