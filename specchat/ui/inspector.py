"""The speculation inspector: what each step drafted, what the target kept, and why it refused.

Pure functions from the engine's `StepRecord`s to HTML (every model-written text escaped):
- `ghost_html`: the drafts a step refused, shown right after the token that replaced them;
- `step_cards`: one hidden card per speculative step (the proposal as a chain or a small tree
  with the kept path marked, the target's top candidates against the draft's, the test that
  decided, the step's timing). assets/inspector.js opens a card when its tokens are clicked or
  focused;
- `step_charts`: under each reply, acceptance by draft position, the k of every step, and
  where the time went (prefill, drafting, verifying).
"""

from __future__ import annotations

import html

from specchat.core.events import Candidate, Evidence, GenerationStats, StepRecord


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _num(p: float | None) -> str:
    """A probability with its digits: 0.42, 0.003, 2.1e-05."""
    if p is None:
        return "?"
    return f"{p:.3f}" if p >= 0.001 or p == 0 else f"{p:.1e}"


def _tok(text: str) -> str:
    """A token's text made visible: spaces and newlines shown, never markup."""
    shown = text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥")
    return _e(shown) if shown else "∅"


def refused_drafts(record: StepRecord) -> list[str]:
    """The drafted texts a step did not keep (a chain's drafts from the refused one on; a
    tree's refused children at the decisive node), empty when every draft passed."""
    evidence = record.evidence
    if evidence is None or evidence.rejected is None:
        return []
    if record.parents is None:
        return record.proposal_text[record.accepted:]
    decisive = record.path[-1] if record.path else -1
    return [record.proposal_text[i] for i, p in enumerate(record.parents) if p == decisive]


def ghost_html(record: StepRecord) -> str:
    refused = refused_drafts(record)
    if not refused:
        return ""
    joined = "".join(refused) if record.parents is None else " | ".join(refused)
    title = (f"refused draft{'s' if len(refused) > 1 else ''} of step {record.step}: "
             + " ".join(repr(t) for t in refused))
    return (f'<span class="sc-ghost" title="{_e(title)}">'
            f"{html.escape(joined, quote=False)}</span>")


# ---------------------------------------------------------------------------------------------
# Step cards

def _bars(title: str, candidates: list[Candidate], mark: set[int]) -> str:
    rows = "".join(
        f'<div class="sc-bar{" sc-bar-mark" if c.id in mark else ""}">'
        f'<span class="sc-bar-label">{_tok(c.text)}</span>'
        f'<span class="sc-bar-track"><span class="sc-bar-fill" '
        f'style="width:{max(1.0, 100 * c.prob):.1f}%"></span></span>'
        f'<span class="sc-bar-value">{c.prob:.2f}</span></div>' for c in candidates)
    return f'<div class="sc-bars"><div class="sc-bars-title">{_e(title)}</div>{rows}</div>'


def _chain(record: StepRecord) -> str:
    n = record.accepted
    chips = []
    for i, text in enumerate(record.proposal_text):
        css = "sc-p-kept" if i < n else "sc-p-refused" if i == n else "sc-p-untested"
        chips.append(f'<span class="sc-p {css}">{_tok(text)}</span>')
    return f'<div class="sc-proposal">{"".join(chips)}</div>'


def _tree(record: StepRecord) -> str:
    """Nested lists, one level per depth; the kept path in the kept color, the decisive node's
    refused children in the refused one."""
    kept = set(record.path)
    decisive = record.path[-1] if record.path else -1
    children: dict[int, list[int]] = {}
    for i, p in enumerate(record.parents or []):
        children.setdefault(p, []).append(i)

    def level(parent: int) -> str:
        items = []
        for i in children.get(parent, []):
            css = "sc-p-kept" if i in kept else "sc-p-refused" if parent == decisive \
                else "sc-p-untested"
            items.append(f'<li><span class="sc-p {css}">{_tok(record.proposal_text[i])}</span>'
                         f"{level(i)}</li>")
        return f"<ul>{''.join(items)}</ul>" if items else ""

    return f'<div class="sc-proposal sc-tree">{level(-1)}</div>'


def _test(e: Evidence) -> str:
    chosen = f"the target's token <code>{_tok(e.token_text)}</code>"
    if e.rejected is None:
        return (f"Every draft passed; {chosen} follows as a bonus, drawn from the target "
                "alone.")
    refused = f"<code>{_tok(e.rejected_text)}</code>"
    if e.greedy:
        p = f" (its probability under the target: {_num(e.p)})" if e.p is not None else ""
        return (f"Greedy: the draft {refused}{p} is not the target's most likely token, so "
                f"{chosen} replaces it.")
    if e.q == 1.0:
        return (f"The draft {refused} could be kept only with the target's probability for "
                f"it, p = {_num(e.p)}: it is verified as a one-hot draft (q = 1 in the test, "
                f"min(1, p/q) = {_num(e.accept_prob)}; the drafter's own probabilities, in its "
                f"bars, only chose it); it was refused: the target's draw fell elsewhere, on "
                f"{chosen}.")
    return (f"Leviathan's test for {refused}: p = {_num(e.p)} (target), q = {_num(e.q)} "
            f"(draft), kept with probability min(1, p/q) = {_num(e.accept_prob)}; it failed, and "
            f"{chosen} was drawn from (p − q)+.")


def _samplers(e: Evidence) -> str:
    """Which samplers shaped the target's distribution the test and the bars use."""
    if not e.samplers:
        return "The target's distribution as the model gives it (greedy, no sampler on)."
    return ("The target's distribution after the samplers, in order: "
            f"{_e(' · '.join(e.samplers))} (the same at every verified position as in plain "
            "decoding).")


def step_card(record: StepRecord) -> str:
    e = record.evidence
    head = (f"Step {record.step}: drafted {record.drafted}, kept {record.accepted} · "
            f"draft {1000 * record.draft_s:.1f} ms, verify {1000 * record.verify_s:.1f} ms")
    policy = ""
    if record.alpha is not None:
        gain = f", expecting {record.expected_gain:.2f}× plain" \
            if record.expected_gain is not None else ""
        if record.expected_gain is not None and record.expected_gain < 1 and record.drafted:
            gain += (" (a probe: drafting that is not expected to pay is still tried now and "
                     "then, so the estimate follows the text)")
        policy = (f'<div class="sc-card-policy">k ≤ {record.k}: estimated acceptance '
                  f"{record.alpha:.2f}{_e(gain)}</div>")
    proposal = _tree(record) if record.parents is not None else _chain(record)
    parts = [f'<div class="sc-card-head">{_e(head)}</div>', policy, proposal]
    if e is not None:
        parts.append(f'<div class="sc-card-test">{_test(e)}</div>')
        if e.in_draft_vocab is False:
            parts.append(f'<div class="sc-card-vocab">The target\'s token '
                         f'<code>{_tok(e.token_text)}</code> is outside the drafter\'s '
                         "vocabulary: no draft could have matched it here.</div>")
        parts.append(f'<div class="sc-card-samplers">{_samplers(e)}</div>')
        mark = {e.token} | ({e.rejected} if e.rejected is not None else set())
        where = f"at draft position {e.position + 1}"
        charts = [_bars(f"target {where}", e.target_top, mark)]
        if e.draft_top:
            charts.append(_bars(f"draft {where}", e.draft_top, mark))
        parts.append(f'<div class="sc-card-bars">{"".join(charts)}</div>')
    return (f'<div class="sc-card sc-card-{record.step}" hidden role="note" '
            f'aria-label="Step {record.step}: what was drafted and what decided">'
            f'{"".join(parts)}</div>')


def step_cards(steps: list[StepRecord]) -> str:
    cards = "".join(step_card(r) for r in steps if r.drafted)
    return f'<div class="sc-cards">{cards}</div>' if cards else ""


# ---------------------------------------------------------------------------------------------
# Charts under a reply (inline HTML: they update with every repaint while streaming)

def step_charts(steps: list[StepRecord], stats: GenerationStats | None) -> str:
    spec = [r for r in steps if r.drafted]
    if not spec:
        return ""
    tallest = max(max(r.k, r.drafted) for r in spec) or 1
    k_bars = "".join(
        f'<span class="sc-kbar" title="step {r.step}: k ≤ {r.k}, drafted {r.drafted}, kept '
        f'{r.accepted}" style="height:{24 * r.drafted / tallest:.0f}px">'
        f'<span class="sc-kbar-kept" style="height:{24 * r.accepted / tallest:.0f}px"></span>'
        "</span>" for r in spec[-120:])
    width = max(r.tree_depth or r.drafted for r in spec)
    tested = [sum(1 for r in spec if (r.tree_depth or r.drafted) > i) for i in range(width)]
    kept = [sum(1 for r in spec if r.accepted > i) for i in range(width)]
    position_bars = "".join(
        f'<span class="sc-pos" title="position {i + 1}: {kept[i]} of {tested[i]} kept">'
        f'<span class="sc-pos-fill" style="height:{24 * kept[i] / tested[i]:.0f}px"></span>'
        f"<small>{i + 1}</small></span>" for i in range(width) if tested[i])
    draft_s = sum(r.draft_s for r in steps)
    verify_s = sum(r.verify_s for r in steps)
    prefill_s = stats.ttft_s if stats is not None else 0.0
    total = draft_s + verify_s + prefill_s or 1.0
    split = "".join(
        f'<span class="sc-split-{name}" style="width:{100 * s / total:.1f}%" '
        f'title="{name} {s:.2f} s"></span>'
        for name, s in (("prefill", prefill_s), ("draft", draft_s), ("verify", verify_s)) if s)
    legend = " · ".join(f"{name} {s:.2f} s" for name, s in
                        (("prefill", prefill_s), ("draft", draft_s), ("verify", verify_s)) if s)
    if stats is not None and stats.draft_head:
        legend += f" · drafts by the {_e(stats.draft_head)}"
    if stats is not None and stats.draft_vocab_coverage is not None:
        legend += (f" · the drafter's {stats.draft_vocab:,}-token vocabulary holds "
                   f"{100 * stats.draft_vocab_coverage:.0f}% of this reply's tokens")
    return ('<div class="sc-charts">'
            f'<div class="sc-chart"><div class="sc-chart-title">k per step (kept)</div>'
            f'<div class="sc-kbars">{k_bars}</div></div>'
            f'<div class="sc-chart"><div class="sc-chart-title">acceptance by position</div>'
            f'<div class="sc-posbars">{position_bars}</div></div>'
            f'<div class="sc-chart sc-chart-wide"><div class="sc-chart-title">time: {legend}'
            f'</div><div class="sc-split">{split}</div></div></div>')
