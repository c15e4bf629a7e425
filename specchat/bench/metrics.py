"""Bench metrics: speedups, acceptance, costs, and the speedup the measured costs predict."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable

from specchat.bench.config import ENGINE_MODES, HEAD_MODES, REMOTE_PLAIN, Run
from specchat.core.events import GenerationStats, StepRecord, summarize

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
    # Every second spent drafting, also where the drafter proposed nothing (a head under its
    # confidence bar has run all the same), per drafted token.
    out["c"] = sum(s.draft_s for s in steps) / sum(s.levels for s in spec) / plain_s
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


def width_costs(steps: list[StepRecord], plain_s: float) -> dict[int, float]:
    """Verify cost by tokens fed, in plain steps, pooled over `steps` (every engine mode of a
    run: between them they feed many widths), with one token fed costing one step."""
    by_fed: dict[int, list[float]] = defaultdict(list)
    for s in steps:
        if s.drafted:
            by_fed[s.drafted + 1].append(s.verify_s)
    out = {m: sum(v) / len(v) / plain_s for m, v in sorted(by_fed.items())} if plain_s else {}
    return {1: 1.0, **out}


def _cost_at(widths: dict[int, float], m: int) -> float:
    """widths' cost at m: measured, else linear between the measured widths around it (past
    the widest, along the last two)."""
    if m in widths:
        return widths[m]
    xs = sorted(widths)
    lo = max((x for x in xs if x < m), default=xs[0])
    hi = min((x for x in xs if x > m), default=None)
    if hi is None:
        if len(xs) < 2:
            return widths[lo]
        lo, hi = xs[-2], xs[-1]
    return widths[lo] + (widths[hi] - widths[lo]) * (m - lo) / (hi - lo)


def hindsight_speedup(steps: list[StepRecord], c: float | None,
                      widths: dict[int, float]) -> tuple[float | None, float | None]:
    """The most these drafts could give. (hindsight, bound):

    hindsight: each step drafts exactly the tokens that then passed, and nothing where none
      passed (a plain step), at the measured verify cost for that width and c per draft;
    bound: tokens per target call, as if drafts and verifies cost no more than a plain step.

    Run with --fixed-draft-len so every step drafts its full k: an adaptive run's steps were
    cut short by the policy, which caps what hindsight sees."""
    if not steps or c is None:
        return None, None
    tokens = cost = 0.0
    for s in steps:
        n = s.accepted
        tokens += n + 1
        cost += 1.0 if n == 0 else _cost_at(widths, n + 1) + c * n
    return tokens / cost, tokens / len(steps)


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
            "forward_s": (None if any(r.forward_s is None for r in runs)  # a server's
                          else statistics.median(r.forward_s for r in runs)),
            "prefill_s": statistics.median(r.prefill_s for r in runs),
            "prompt_tokens": statistics.median(r.prompt_tokens for r in runs),
            "prefill_tokens": statistics.median(r.prefill_tokens for r in runs)}


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
    prefill_s = sum(m["prefill_s"] for m in med.values())
    decode_s = seconds - prefill_s
    second = [(q, turn) for (q, turn) in med if turn == 2]
    out = {
        "tokens_per_s": tps,
        # after the prompt's encoding: the tokens after each reply's first, over the time after
        # its prompt's forwards
        "decode_tokens_per_s": (tokens - len(med)) / decode_s if decode_s > 0 else None,
        "prefill_share": prefill_s / seconds if seconds > 0 else None,
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
        "overhead_ms_per_token": (
            1000 * (seconds - sum(m["forward_s"] for m in med.values())) / tokens
            if tokens and all(m["forward_s"] is not None for m in med.values()) else None),
    }
    if second:
        t2 = [rs for key, rs in items.items() if key[2] == 2]
        out["turn2_ttft_s"] = statistics.mean(_median_item(rs)["ttft_s"] for rs in t2)
        out["turn2_prompt_tokens"] = statistics.mean(rs[0].prompt_tokens for rs in t2)
        out["turn2_prefill_tokens"] = statistics.mean(rs[0].prefill_tokens for rs in t2)
    return out


def noise_floor(plain_runs: list[Run]) -> dict | None:
    """Plain decoding against itself: per category, the tokens/s of one repeat over another's
    (every ordered pair of repeats), the lowest and highest of those ratios, and the category
    of the widest spread. A speedup within that band may be the machine, not the mode. A
    repeat whose plain replies in a category were all empty has no rate: it is left out, and
    the category named under "empty". None with fewer than two repeats."""
    by_category: dict[str, list[float]] = defaultdict(list)
    empty = set()
    for (cat, _), rate in _category_repeat_rates(plain_runs).items():
        if rate > 0:
            by_category[cat].append(rate)
        else:
            empty.add(cat)
    per: dict[str, tuple[float, float]] = {}
    for cat, rates in by_category.items():
        if len(rates) >= 2:
            ratios = [a / b for i, a in enumerate(rates) for j, b in enumerate(rates) if i != j]
            per[cat] = (min(ratios), max(ratios))
    if not per:
        return {"empty": sorted(empty)} if empty else None
    widest = min(per, key=lambda c: per[c][0])
    return {"low": min(lo for lo, _ in per.values()), "high": max(hi for _, hi in per.values()),
            "widest": widest, "by_category": per, "empty": sorted(empty)}


def _category_repeat_rates(runs: list[Run]) -> dict[tuple[str, int], float]:
    """Tokens/s of each (category, repeat): its runs' tokens over their seconds."""
    sums: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0])
    for r in runs:
        total = sums[(r.category, r.repeat)]
        total[0] += r.new_tokens
        total[1] += r.seconds
    return {key: t / sec for key, (t, sec) in sums.items() if sec > 0}


def paired_ratios(runs: list[Run], plain_runs: list[Run]) -> dict[str, tuple[float, float]]:
    """Per category, a mode's tokens/s over plain decoding's in the same repeat (a question's
    repeat runs every mode in turn before the next, so a pair shares the machine's moment):
    the lowest and highest of those ratios over the repeats. Where even the highest is below
    plain's, the mode was slower in every repeat: beyond what the repeats' spread shows."""
    ours, base = _category_repeat_rates(runs), _category_repeat_rates(plain_runs)
    per: dict[str, list[float]] = defaultdict(list)
    for (cat, repeat), rate in ours.items():
        if base.get((cat, repeat)):  # (a repeat whose plain replies were all empty: no pair)
            per[cat].append(rate / base[(cat, repeat)])
    return {cat: (min(v), max(v)) for cat, v in per.items()}


def greedy_identical(runs: list[Run], modes: Iterable[str], base: str = "plain",
                     ) -> dict[str, float | None]:
    """Fraction of questions whose reply texts (every turn, first repeat) equal `base`'s."""
    texts: dict[tuple, dict[int, str]] = defaultdict(dict)
    for r in runs:
        if r.repeat == 0:
            texts[(r.mode, r.question_id)][r.turn] = r.text
    out = {}
    for mode in modes:
        qids = [q for (m, q) in texts if m == mode and (base, q) in texts]
        out[mode] = (sum(texts[(mode, q)] == texts[(base, q)] for q in qids) / len(qids)
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


def versus(by_mode: dict[str, list[Run]], ours: Iterable[str], theirs: Iterable[str]
           ) -> dict | None:
    """specchat's modes against another engine's (llama.cpp) on the items both ran: the best
    mode of each by tokens/s, their ratio, and the two plain decodings' ratio; per mode, end to
    end and decode-only tokens/s (after each reply's first token, over the time after its
    prompt's forwards; for a server, after its first token) and how much of a first turn's
    prompt each engine encoded (the rest came from its prompt cache)."""
    def figures(mode: str, keys: set) -> dict:
        med = {k[1:]: _median_item(rs) for k, rs in group_items(by_mode[mode]).items()
               if k[1:] in keys}
        seconds = sum(m["seconds"] for m in med.values())
        tokens = sum(m["new_tokens"] for m in med.values())
        decode_s = seconds - sum(m["prefill_s"] for m in med.values())
        first = [m for (q, turn), m in med.items() if turn == 1]
        return {"tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                "decode_tokens_per_s": (tokens - len(med)) / decode_s if decode_s > 0 else None,
                "prompt_tokens": (statistics.mean(m["prompt_tokens"] for m in first)
                                  if first else None),
                "encoded_tokens": (statistics.mean(m["prefill_tokens"] for m in first)
                                   if first else None),
                "ttft_s": statistics.mean(m["ttft_s"] for m in first) if first else None}

    ours = [m for m in ours if by_mode.get(m)]
    theirs = [m for m in theirs if by_mode.get(m)]
    if not ours or not theirs:
        return None
    keys = set.intersection(*({(r.question_id, r.turn) for r in by_mode[m]}
                              for m in ours + theirs))
    if not keys:
        return None
    per_mode = {m: figures(m, keys) for m in ours + theirs}
    ours_tps = {m: per_mode[m]["tokens_per_s"] for m in ours}
    theirs_tps = {m: per_mode[m]["tokens_per_s"] for m in theirs}
    best_ours = max(ours_tps, key=ours_tps.get)
    best_theirs = max(theirs_tps, key=theirs_tps.get)
    out = {"items": len(keys), "tokens_per_s": {**ours_tps, **theirs_tps},
           "per_mode": per_mode,
           "best": best_ours, "best_tokens_per_s": ours_tps[best_ours],
           "their_best": best_theirs, "their_best_tokens_per_s": theirs_tps[best_theirs],
           "best_ratio": (ours_tps[best_ours] / theirs_tps[best_theirs]
                          if theirs_tps[best_theirs] else None)}
    if "plain" in ours_tps and REMOTE_PLAIN in theirs_tps and theirs_tps[REMOTE_PLAIN]:
        out["plain_ratio"] = ours_tps["plain"] / theirs_tps[REMOTE_PLAIN]
        ours_d = per_mode["plain"]["decode_tokens_per_s"]
        theirs_d = per_mode[REMOTE_PLAIN]["decode_tokens_per_s"]
        if ours_d and theirs_d:
            out["plain_decode_ratio"] = ours_d / theirs_d
    return out


def summarize_bench(runs: list[Run], modes: Iterable[str], config: dict,
                    remote_modes: Iterable[str] = ()) -> dict:
    """The report: {"config", "modes": {MODE: {"overall", "by_category", "analysis"}},
    "greedy_identical": {MODE: fraction}, "identical_to_plain", "versus_llama_cpp"}.
    `remote_modes` are served by another engine (llama.cpp): their speedups are over that
    engine's own plain decoding (REMOTE_PLAIN) and their texts are compared with its replies."""
    modes = list(modes)
    remote_modes = [m for m in modes if m in set(remote_modes)]
    by_mode: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        by_mode[r.mode].append(r)
    plain = by_mode.get("plain")
    remote_plain = by_mode.get(REMOTE_PLAIN)
    categories = list(dict.fromkeys(r.category for r in runs))  # file order
    plain_steps = [s for r in (plain or []) for s in r.steps]
    base_s = [s.verify_s + s.draft_s for s in plain_steps if s.drafted == 0]
    widths = width_costs([s for r in runs if r.mode in ENGINE_MODES + HEAD_MODES
                          for s in r.steps], sum(base_s) / len(base_s) if base_s else 0.0)
    out_modes = {}
    for mode in modes:
        mruns = by_mode.get(mode, [])
        base_runs = remote_plain if mode in remote_modes else plain
        entry = {"overall": metrics(mruns, base_runs),
                 "by_category": {}}
        for cat in categories:
            cruns = [r for r in mruns if r.category == cat]
            if cruns:
                entry["by_category"][cat] = metrics(
                    cruns, [r for r in base_runs if r.category == cat] if base_runs else None)
        steps = [s for r in mruns for s in r.steps]
        if mode not in ("plain", "hf-plain") and mode not in remote_modes \
                and any(s.drafted for s in steps):
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
            hindsight, bound = hindsight_speedup(steps, costs["c"], widths)
            costs["hindsight_speedup"], costs["bound_speedup"] = hindsight, bound
            costs["hindsight_speedup_e2e"] = with_prefill(hindsight, costs["prefill_share"])
            costs["bound_speedup_e2e"] = with_prefill(bound, costs["prefill_share"])
            entry["analysis"] = costs
        out_modes[mode] = entry
    # Same text as plain: greedy, every engine mode should match; sampled too, but for a draft
    # model (its drafts take Leviathan's test with random numbers of their own).
    local = [m for m in modes if m not in remote_modes]
    identical = greedy_identical(runs, local)
    if plain:
        for mode in local:
            out_modes[mode]["overall"].update(same_text_speedup(by_mode.get(mode, []), plain))
    # Another engine's modes are compared with its own plain replies (another quantization of
    # the weights writes other texts than ours).
    identical |= greedy_identical(runs, remote_modes, base=REMOTE_PLAIN)
    greedy = config.get("temperature", 0.0) <= 0
    out = {"config": config, "modes": out_modes,
           "greedy_identical": identical if greedy else {m: None for m in modes},
           "identical_to_plain": identical}
    if remote_modes:
        out["versus_llama_cpp"] = versus(by_mode, local, remote_modes)
    floor = noise_floor(plain or [])
    if floor:
        out["noise_floor"] = floor
    if plain and max((r.repeat for r in plain), default=0) >= 1:
        out["paired"] = {m: paired_ratios(by_mode.get(m, []), plain)
                         for m in local if m != "plain"}
    return out
