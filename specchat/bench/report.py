"""The bench's text report."""

from __future__ import annotations

from specchat.bench.config import HF_MODES, REMOTE_PLAIN
from specchat.bench.profile import profile_lines, rows_lines

# ---------------------------------------------------------------------------------------------
# Report text


def _f(x, fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _runtime_lines(runtime: dict | None) -> list[str]:
    """The path the target ran on and the CPU kind, first: every figure below belongs to them."""
    if not runtime:
        return []
    exact = "verifies row-exact (proved at load)" if runtime["row_exact"] else \
        f"NOT row-exact: {runtime['proof']}"
    return [f"runtime: {runtime['path']} on {runtime['cpu']}; {exact}", ""]


def _sampler_lines(samplers: dict | None) -> list[str]:
    """The penalties and min-p every mode decoded with, when any is on."""
    if not samplers:
        return []
    return ["samplers: " + ", ".join(f"{k}={v}" for k, v in samplers.items()), ""]


def format_report(result: dict) -> str:
    """The text report: the per-category table, then one section each for follow-up turns, the
    cost model, llama.cpp, identical replies and memory, where the result has them."""
    vs = result.get("versus_llama_cpp")
    return "\n".join([*_regime_lines(result["config"]),
                      *_runtime_lines(result["config"].get("runtime")),
                      *_sampler_lines(result["config"].get("samplers")),
                      *_versus_lines(vs, result["config"].get("prompt_cache", "warm"),
                                     result["config"].get("llama_cpp_build")),
                      *profile_lines(result.get("profile"), _llama_ms(vs)),
                      *rows_lines((result.get("profile") or {}).get("by_rows")),
                      *_table_lines(result),
                      *_noise_lines(result.get("noise_floor")),
                      *_paired_lines(result.get("paired")),
                      *_turn2_lines(result),
                      *_cost_model_lines(result),
                      *_identical_lines(result, vs),
                      *_footer_lines(result["config"])])


def _regime_lines(cfg: dict) -> list[str]:
    """Which regime the figures are from: real use, or the looping-text stress mode."""
    history = (" + one user's history: drafts may copy the earlier questions' prompts and "
               "replies (--history)" if cfg.get("history") else "")
    if cfg.get("prompt_format") == "completion":
        return ["regime: Completion (each question as plain text to continue, as the page's "
                "Completion mode sends it: no chat format, no stop strings, every reply runs "
                "to the token limit)" + history, ""]
    if cfg.get("stop_strings", True):
        return ["regime: real use (the chat format, its stop strings on)" + history, ""]
    return ["regime: LOOPING TEXT, a stress mode (--ignore-stop-strings): replies run to the "
            "token limit and repeat themselves, which any n-gram drafter predicts; not real "
            "use" + history, ""]


def _table_lines(result: dict) -> list[str]:
    """Per category and overall, one row per mode."""
    modes = list(result["modes"])
    w = max([12] + [len(m) for m in modes])  # the mode column
    head = (f"{'category':<15} {'mode':<{w}} {'tok/s':>7} {'speedup':>8} {'decode':>7} "
            f"{'accept':>7} {'acc.len':>7} {'calls/tok':>9} {'TTFT s':>7} {'prefill':>7} "
            f"{'ovh ms/tok':>10}")
    lines = [head, "-" * len(head)]

    def rows(label: str, get) -> None:
        for i, mode in enumerate(modes):
            m = get(result["modes"][mode])
            if m is not None:
                lines.append(_table_row(label if i == 0 else "", mode, w, m))

    categories = list(dict.fromkeys(c for m in result["modes"].values() for c in m["by_category"]))
    for cat in categories:
        rows(cat, lambda e, cat=cat: e["by_category"].get(cat))
    lines.append("-" * len(head))
    rows("overall", lambda e: e["overall"])
    return lines


def _table_row(label: str, mode: str, w: int, m: dict) -> str:
    return (f"{label:<15} {mode:<{w}} {m['tokens_per_s']:>7.1f} "
            f"{_f(m['speedup'], '.2f') + 'x' if m['speedup'] is not None else '-':>8} "
            f"{_f(m.get('decode_tokens_per_s'), '.1f'):>7} "
            f"{_f(m['acceptance_rate'], '.0%'):>7} {_f(m['mean_accepted_len'], '.2f'):>7} "
            f"{_f(m['target_calls_per_token'], '.2f'):>9} {_f(m['ttft_s'], '.3f'):>7} "
            f"{_f(m.get('prefill_share'), '.0%'):>7} "
            f"{_f(m['overhead_ms_per_token'], '.1f'):>10}")


def _turn2_lines(result: dict) -> list[str]:
    """Follow-up turns, which reuse the cached history, apart from first turns."""
    turn2 = [(mode, e["overall"]) for mode, e in result["modes"].items()
             if "turn2_ttft_s" in e["overall"]]
    if not turn2:
        return []
    lines = ["", "follow-up turns (turn 2): mean TTFT, prompt tokens, tokens encoded"]
    for mode, o in turn2:
        lines.append(f"  {mode:<12} TTFT {o['turn2_ttft_s']:.3f} s  prompt "
                     f"{o['turn2_prompt_tokens']:.0f}  prefilled "
                     f"{o['turn2_prefill_tokens']:.0f}  (turn 1 TTFT "
                     f"{_f(o['ttft_s'], '.3f')} s)")
    return lines


def _cost_model_lines(result: dict) -> list[str]:
    """The predicted speedups of each speculative mode beside the achieved one."""
    analysed = [(mode, e["analysis"]) for mode, e in result["modes"].items() if "analysis" in e]
    if not analysed:
        return []
    lines = [
        "",
        "cost model (Leviathan et al.: (1 - a^(k+1)) / ((1 - a)(c k + verify)),"
        " costs in plain target steps)",
        "  formula: at the mean k of drafting steps; per-step: the same model summed"
        " over every step's own k, steps with nothing to draft included;",
        "  +prefill: per-step with the prompt's encoding, which speculation does not"
        " speed up (Amdahl, prefill share of plain's time)",
        f"  {'mode':<12} {'alpha':>6} {'k mean':>6} {'c':>7} {'verify':>7} "
        f"{'formula':>8} {'per-step':>8} {'prefill':>7} {'+prefill':>8} "
        f"{'achieved':>8} {'ach/form':>8} {'ach/step':>8} {'ach/+pf':>8}"]
    for mode, a in analysed:
        lines += [_cost_row(mode, a), _verify_costs_line(mode, a)]
    return lines + _hindsight_lines(analysed)


def _hindsight_lines(analysed: list[tuple[str, dict]]) -> list[str]:
    """What the drafts of each mode could give at most (metrics.hindsight_speedup)."""
    rows = [(mode, a) for mode, a in analysed if a.get("hindsight_speedup")]
    if not rows:
        return []
    lines = ["",
             "ceiling of these drafts (hindsight: each step drafts exactly the tokens that "
             "passed, at the measured",
             "  verify cost of that width; bound: tokens per target call, verifies and drafts "
             "free; +prefill: Amdahl;",
             "  with --fixed-draft-len every step shows its drafts' full reach)",
             f"  {'mode':<12} {'hindsight':>9} {'+prefill':>8} {'bound':>7} {'+prefill':>8} "
             f"{'achieved':>8}"]
    for mode, a in rows:
        lines.append(f"  {mode:<12} {_x(a['hindsight_speedup']):>9} "
                     f"{_x(a.get('hindsight_speedup_e2e')):>8} {_x(a['bound_speedup']):>7} "
                     f"{_x(a.get('bound_speedup_e2e')):>8} {_x(a['achieved_speedup']):>8}")
    return lines


def _cost_row(mode: str, a: dict) -> str:
    ach, pred, step, e2e = (a["achieved_speedup"], a["predicted_speedup"],
                            a["predicted_speedup_steps"], a.get("predicted_speedup_e2e"))
    return (f"  {mode:<12} {_f(a['alpha'], '.3f'):>6} {a['k_mean']:>6.2f} "
            f"{_f(a['c'], '.4f'):>7} {_f(a['verify_ratio'], '.3f'):>7} "
            f"{_x(pred):>8} {_x(step):>8} {_f(a.get('prefill_share'), '.0%'):>7} "
            f"{_x(e2e):>8} {_x(ach):>8} "
            f"{_f(ach / pred if ach and pred else None, '.0%'):>8} "
            f"{_f(ach / step if ach and step else None, '.0%'):>8} "
            f"{_f(ach / e2e if ach and e2e else None, '.0%'):>8}")


def _verify_costs_line(mode: str, a: dict) -> str:
    """The verify ratio per width fed, or why there is none."""
    by_fed = " ".join(f"{m}:{r:.2f}" for m, r in a["verify_ratio_by_fed"].items())
    if by_fed:
        return (f"  {'':<12} verify cost by tokens fed: {by_fed}  "
                f"(plain step {1000 * a['plain_step_s']:.1f} ms)")
    base = "hf-plain" if mode in HF_MODES else "plain"
    return f"  {'':<12} (no costs: run {base} too for a baseline step)"


def llama_decode_ms(result: dict) -> float | None:
    """llama.cpp's plain decode-only milliseconds per token in a bench's race, if it ran."""
    return _llama_ms(result.get("versus_llama_cpp"))


def _llama_ms(vs: dict | None) -> float | None:
    """llama.cpp's plain decode-only milliseconds per token in the race, if it ran."""
    rate = ((vs or {}).get("per_mode") or {}).get(REMOTE_PLAIN, {}).get("decode_tokens_per_s")
    return 1000 / rate if rate else None


def _versus_lines(vs: dict | None, cache: str = "warm", build: dict | None = None) -> list[str]:
    """specchat's plain and best modes against llama.cpp's, side by side: end to end,
    decode-only, the first token, and what each engine encoded of a first turn's prompt (the
    rest came from its prompt cache). First in the report, when the bench raced a server."""
    if not vs:
        return []
    how = ("prompt caches warm: each engine keeps what the questions before left it, "
           "specchat's prefix store and llama-server's prompt cache" if cache == "warm" else
           "prompt caches cold: both emptied before every first turn (--prompt-cache cold)")
    lines = [f"specchat vs llama.cpp on the same {vs['items']} items; {how}"]
    if build:
        lines.append(f"  llama.cpp {build.get('version') or '(version unknown)'}, built for "
                     f"{build.get('flags')}")
    lines.append(f"  {'mode':<26} {'end to end':>11} {'decode-only':>12} {'TTFT s':>7} "
                 f"{'prompt encoded':>17}")
    per_mode = vs.get("per_mode") or {}
    shown = ["plain", vs["best"], REMOTE_PLAIN, vs["their_best"]]
    for mode in dict.fromkeys(m for m in shown if m in per_mode):
        f = per_mode[mode]
        who = "" if mode.startswith("llama.cpp") else "specchat "
        best = " (best)" if mode in (vs["best"], vs["their_best"]) else ""
        encoded = (f"{f['encoded_tokens']:.0f} of {f['prompt_tokens']:.0f}"
                   if f.get("prompt_tokens") else "-")
        lines.append(f"  {who + mode + best:<26} {f['tokens_per_s']:>7.1f} t/s "
                     f"{_f(f.get('decode_tokens_per_s'), '.1f'):>8} t/s "
                     f"{_f(f.get('ttft_s'), '.3f'):>7} {encoded:>17}")
    if vs.get("plain_ratio") is not None:
        decode = (f", decode-only {_x(vs['plain_decode_ratio'])}"
                  if vs.get("plain_decode_ratio") is not None else "")
        lines.append(f"  plain vs plain: end to end {_x(vs['plain_ratio'])}{decode}")
    lines.append(f"  best vs best: specchat {vs['best']} / {vs['their_best']} = "
                 f"{_x(vs['best_ratio'])} end to end (llama.cpp modes: speedup over its own "
                 "plain decoding, text compared with its replies)")
    return lines + [""]


def _noise_lines(floor: dict | None) -> list[str]:
    """How far plain decoding's repeats differ from each other: the band that is noise."""
    if not floor:
        return []
    lines = [""]
    if "widest" in floor:
        widest = floor["by_category"][floor["widest"]]
        lines.append(f"noise: plain against itself, repeat over repeat, per category "
                     f"{_x(floor['low'])}..{_x(floor['high'])} (widest: {floor['widest']}, "
                     f"{_x(widest[0])}..{_x(widest[1])}); a category's speedup within this "
                     "band may be the machine, not the mode")
    if floor.get("empty"):
        lines.append(f"noise: plain's replies were all empty in a repeat of "
                     f"{', '.join(floor['empty'])}: no rate there (left out of the band)")
    return lines


SLOWER = 0.98  # a mode this far below plain in every repeat of a category costs there


def _paired_lines(paired: dict | None) -> list[str]:
    """Each mode against plain in the same repeat, per category: where it was slower in every
    repeat, and the range of the others."""
    if not paired:
        return []
    lines = ["paired with plain in the same repeat, per category (lowest..highest over the "
             "repeats):"]
    for mode, cats in paired.items():
        if not cats:
            continue
        slower = [f"{c} {_x(lo)}..{_x(hi)}" for c, (lo, hi) in cats.items() if hi < SLOWER]
        low = min(lo for lo, _ in cats.values())
        high = max(hi for _, hi in cats.values())
        lines.append(f"  {mode}: {_x(low)}..{_x(high)}; below {SLOWER:.2f}x in every repeat: "
                     + (", ".join(slower) if slower else "no category"))
    return lines


def _identical_lines(result: dict, vs: dict | None) -> list[str]:
    """The share of replies identical to plain's, and the speedup on those alone."""
    ident = {m: v for m, v in result.get("identical_to_plain", {}).items() if v is not None}
    if not ident:
        return []
    to = "; llama.cpp modes: to llama.cpp's" if vs else ""
    lines = ["", f"text identical to plain (same seed{to}): " +
             ", ".join(f"{m} {v:.0%}" for m, v in ident.items())]
    same = [(m, e["overall"]) for m, e in result["modes"].items()
            if m != "plain" and e["overall"].get("same_text_speedup") is not None]
    if same:
        lines.append("speedup on those identical replies only: " + ", ".join(
            f"{m} {_x(o['same_text_speedup'])} ({o['same_text_items']})" for m, o in same))
    return lines


def _footer_lines(cfg: dict) -> list[str]:
    """Memory, and how much of the question set an interrupted run measured."""
    lines = []
    if cfg.get("peak_rss_mb"):
        after = (f" (after loading: peak {cfg['peak_rss_after_load_mb']:.0f} MB, resident "
                 f"{cfg['rss_after_load_mb']:.0f} MB)" if cfg.get("rss_after_load_mb") else "")
        lines.append(f"peak RSS {cfg['peak_rss_mb']:.0f} MB{after}")
    if cfg.get("interrupted"):
        lines.append(f"interrupted: {cfg.get('questions_done', 0)} of "
                     f"{cfg.get('questions_planned', 0)} questions measured")
    return lines
