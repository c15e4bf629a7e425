"""HTML for the page: colored tokens, stats lines, headers, the race's panels."""

from __future__ import annotations

import bisect
import html
import re
import time

from specchat.core.events import (
    ACCEPTED,
    BONUS,
    RESAMPLED,
    TARGET,
    GenerationStats,
    StepRecord,
    TokenEvent,
)
from specchat.paths import assets_dir
from specchat.stats.speedup import AB, ESTIMATE, Speedup
from specchat.ui.inspector import ghost_html, step_cards, step_charts
from specchat.ui.markdown import markdown_html
from specchat.ui.state import ModelSlot, Session, Turn

KIND_WORDS = {ACCEPTED: "accepted", RESAMPLED: "resampled", BONUS: "bonus", TARGET: "target"}


# ---------------------------------------------------------------------------------------------
# Rendering (pure functions of tokens and stats)

def token_title(tok: TokenEvent) -> str:
    kind = KIND_WORDS.get(tok.kind, tok.kind)
    if tok.step == 0:
        return f"{kind} · prefill (first token)"
    if tok.step_drafted == 0:
        return f"{kind} · step {tok.step} · no draft"
    return f"{kind} · step {tok.step} · accepted {tok.step_accepted}/{tok.step_drafted}"


_INLINE = [(re.compile(r"`[^`\n]+`"), "sc-icode"), (re.compile(r"\*\*[^*\n]+?\*\*"), "sc-bold")]


def markup_ranges(text: str) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]]:
    """Blocks [(start, end, "text"|"code")] covering `text`, and styled ranges
    [(start, end, css class)]: fence lines, inline code, bold. A fence still open while
    streaming runs to the end of the text."""
    blocks, marks = [], []
    start, pos, in_code = 0, 0, False
    for line in text.splitlines(keepends=True):
        end = pos + len(line)
        if line.lstrip(" \t").startswith("```"):
            marks.append((pos, end, "sc-fence"))
            if in_code:
                blocks.append((start, end, "code"))
                start = end
            else:
                if pos > start:
                    blocks.append((start, pos, "text"))
                start = pos
            in_code = not in_code
        pos = end
    if start < len(text):
        blocks.append((start, len(text), "code" if in_code else "text"))
    for s, e, kind in blocks:
        if kind == "text":
            for pattern, css in _INLINE:
                marks.extend((s + m.start(), s + m.end(), css) for m in pattern.finditer(text[s:e]))
    return blocks, marks


_OPEN = {"text": '<div class="sc-text">', "code": '<pre class="sc-code"><code>'}
_CLOSE = {"text": "</div>", "code": "</code></pre>"}


def render_tokens(tokens: list[TokenEvent], streaming: bool = False,
                  steps: dict[int, StepRecord] | None = None) -> str:
    """A reply as HTML: one span per token (split where markup starts or ends). With the
    steps' records, tokens of speculative steps open their step card (click or keyboard), and
    the drafts a step refused follow the token that replaced them as ghost text."""
    text = "".join(t.text for t in tokens)
    blocks, marks = markup_ranges(text)
    cuts = sorted({0, len(text), *(p for b in blocks for p in b[:2]),
                   *(p for m in marks for p in m[:2])})
    # Between two cuts nothing changes: one block kind and one set of classes per interval.
    kinds, extras = {}, {c: "" for c in cuts}
    for start, end, kind in blocks:
        for c in cuts[bisect.bisect_left(cuts, start):bisect.bisect_left(cuts, end)]:
            kinds[c] = kind
    for start, end, css in marks:
        for c in cuts[bisect.bisect_left(cuts, start):bisect.bisect_left(cuts, end)]:
            extras[c] += f" {css}"
    out, current, pos = ['<div class="sc-reply">'], None, 0
    # One tab stop a reply: its first drafted token that shows something (a token of blank
    # lines is an invisible place to land), else its first drafted token.
    drafted = [t for t in tokens if t.text and steps and steps.get(t.step) is not None
               and steps[t.step].drafted]
    stop = next((t for t in drafted if t.text.strip()), drafted[0] if drafted else None)
    for tok in tokens:
        record = steps.get(tok.step) if steps else None
        if not tok.text:  # an incomplete multi-byte character: its text comes with the next token
            if record is not None and tok.kind == RESAMPLED:
                out.append(ghost_html(record))
            continue
        a, b = pos, pos + len(tok.text)
        pos = b
        css = f"tk tk-{tok.kind}"
        title = html.escape(token_title(tok), quote=True)
        # (gradio's sanitizer keeps classes, not data- attributes: the step is a class)
        if record and record.drafted:
            css += f" sc-step sc-step-{tok.step}"
        # The arrow keys move between steps from the tab stop (assets/inspector.js), so a long
        # reply is not hundreds of tab stops.
        attrs = ""
        if record and record.drafted:
            attrs = ' tabindex="0"' if tok is stop else ' tabindex="-1"'
        i = bisect.bisect_right(cuts, a)
        edges = [a]
        while i < len(cuts) and cuts[i] < b:
            edges.append(cuts[i])
            i += 1
        edges.append(b)
        for s, e in zip(edges, edges[1:]):
            at = cuts[bisect.bisect_right(cuts, s) - 1]  # the interval this piece lies in
            kind = kinds[at]
            if kind != current:
                if current:
                    out.append(_CLOSE[current])
                out.append(_OPEN[kind])
                current = kind
            out.append(f'<span class="{css}{extras[at]}" title="{title}"{attrs}>'
                       f'{html.escape(text[s:e], quote=False)}</span>')
        if record is not None and tok.kind == RESAMPLED:
            out.append(ghost_html(record))
    if streaming:
        if current is None:
            out.append(_OPEN["text"])
            current = "text"
        out.append('<span class="sc-cursor"></span>')
    if current:
        out.append(_CLOSE[current])
    out.append("</div>")
    return "".join(out)


STOP_WORDS = {"eos": "", "stop_string": "", "length": "max tokens reached",
              "stopped": "stopped by you", "error": "error"}


def stats_line(stats: GenerationStats, figure: Speedup | None = None,
               show_speedup: bool = True, lead: str = "") -> str:
    """The line under a reply: speed, tokens, acceptance, target passes, and the reply's
    speedup `figure` as it was fixed when the reply ended (`speedup_chip`); `lead` (HTML, the
    reply's `view_switch`) comes first."""
    def chip(value: str, label: str = "", css: str = "", title: str = "") -> str:
        attrs = (f' class="{css}"' if css else "") + \
            (f' title="{html.escape(title, quote=True)}"' if title else "")
        label = f" {html.escape(label)}" if label else ""
        return f"<span{attrs}><b>{html.escape(value)}</b>{label}</span>"

    parts = [chip(f"{stats.tokens_per_s:.1f}", "tok/s"), chip(str(stats.new_tokens), "tokens"),
             chip(f"{stats.seconds:.2f} s")]
    if stats.speculation and getattr(stats, "drafts_reported", True) is False:
        # a served reply whose server sent no draft counts (backends/remote.py): no acceptance,
        # no speedup to claim
        parts.append(chip("this server does not report drafts", "", "",
                          "its tokens are shown as 'served': how each was produced is unknown"))
    elif stats.speculation:
        parts += [chip(f"{stats.acceptance_rate:.0%}", "accepted", "",
                       f"{stats.accepted} of {stats.drafted} draft tokens accepted"),
                  chip(f"{stats.mean_accepted_len:.2f}", "mean accepted length", "",
                       "tokens emitted per speculative step (accepted drafts + 1)")]
        if stats.target_calls:  # 0: a server that does not say
            parts.append(chip(str(stats.target_calls), "target passes", "",
                              "target forward passes, prefill included"))
        if show_speedup:  # (an A/B panel's run: its verdict shows the figure)
            parts.append(speedup_chip(figure or Speedup(note="no figure for this reply")))
        k = f"k≤{stats.draft_len}"
        if stats.tree_nodes:
            k += f", trees of ≤{stats.tree_nodes}"
        parts.append(chip(stats.drafter, f"drafter, {k}"))
    else:
        if stats.target_calls:
            parts.append(chip(str(stats.target_calls), "target passes"))
        parts.append(chip("speculation off"))
    if stats.seed is not None:
        parts.append(chip(str(stats.seed), "seed"))
    word = STOP_WORDS.get(stats.stop_reason, stats.stop_reason)
    if word:
        parts.append(chip(word, "", "sc-stop"))
    return f'<div class="sc-stats">{lead}{"".join(parts)}</div>'


def speedup_chip(figure: Speedup) -> str:
    """A reply's speedup as the chat line shows it: measured against its A/B plain run
    ("2.47× vs its A/B plain run"), or estimated from its own steps and labelled so, with its
    band ("≈2.10× est. (1.80–2.50×)"), or "—" with the reason in the tooltip."""
    note = html.escape(figure.note, quote=True)
    if figure.basis == AB:
        return (f'<span class="sc-speedup" title="{note}"><b>{figure.label("×")}</b> '
                "vs its A/B plain run</span>")
    if figure.basis == ESTIMATE:
        title = html.escape(f"{figure.note}. An estimate, not a measurement: Race drafters "
                            "runs this prompt without speculation to measure it.", quote=True)
        band = f" ({figure.low:.2f}–{figure.high:.2f}×)" \
            if figure.low is not None and figure.high is not None else ""
        return (f'<span class="sc-speedup-est" title="{title}"><b>≈{figure.value:.2f}×</b> '
                f"est.{band}</span>")
    return f'<span title="{note}"><b>—</b> speedup</span>'


def inspected(tokens: list[TokenEvent], steps: list[StepRecord], streaming: bool = False,
              stats: GenerationStats | None = None) -> str:
    """A reply with its inspector: colored tokens and ghost text, and once finished the charts
    under it and the step cards its tokens open (rendered once, at the end: a repaint while
    streaming costs what the tokens cost)."""
    by_step = {r.step: r for r in steps}
    body = render_tokens(tokens, streaming, by_step) if tokens or streaming else \
        '<div class="sc-reply"><span class="sc-empty">(empty reply)</span></div>'
    return body + ("" if streaming else step_charts(steps, stats) + step_cards(steps))


def has_views(tokens: list[TokenEvent]) -> bool:
    """Whether a finished reply gets its two views: it shows some text."""
    return any(t.text.strip() for t in tokens)


def view_switch(other: str = "Tokens") -> str:
    """A finished reply's switch between its views (assets/markdown.js): two buttons, the
    pressed one the view shown, Formatted first. `other` names the second view."""
    return ('<span class="sc-view-switch" role="group" title="How this reply is shown">'
            '<button type="button" class="sc-view sc-view-md" aria-pressed="true">Formatted'
            '</button><button type="button" class="sc-view sc-view-tk" aria-pressed="false">'
            f"{html.escape(other)}</button></span>")


def reply_views(tokens: list[TokenEvent], steps: list[StepRecord],
                stats: GenerationStats | None = None) -> str:
    """A finished reply's two views: formatted (its text as Markdown, `markdown.markdown_html`),
    shown by default, and tokens (the colored spans with their inspector, `inspected`, as the
    reply streamed). Both are in the message; the turn's class `sc-view-tokens`, set by
    assets/markdown.js, says which one shows."""
    text = "".join(t.text for t in tokens)
    return (f'{markdown_html(text)}<div class="sc-tokens-view">'
            f"{inspected(tokens, steps, stats=stats)}</div>")


def render_turn(turn: Turn, streaming: bool = False) -> str:
    views = not streaming and turn.stats is not None and has_views(turn.tokens)
    if streaming or not turn.stats:
        body = inspected(turn.tokens, turn.steps, streaming=True)
    elif turn.body_html:
        body = turn.body_html  # a finished reply never changes: render it once
    else:
        body = turn.body_html = reply_views(turn.tokens, turn.steps, turn.stats) if views \
            else inspected(turn.tokens, turn.steps, stats=turn.stats)
    css = " sc-has-views" if views else ""
    parts = [f'<div class="sc-turn sc-turn-{turn.key}{css}">', body]
    if turn.stats and turn.stats.error:
        parts.append(f'<div class="sc-error">⚠ {html.escape(turn.stats.error)}</div>')
    if turn.stats and turn.stats.stop_reason != "refused":  # (a refused reply never ran)
        parts.append(stats_line(turn.stats, turn.speedup, lead=view_switch() if views else ""))
    parts += [f'<div class="sc-note">{html.escape(n)}</div>' for n in turn.notes]
    return "".join(parts) + "</div>"


def user_html(text: str) -> str:
    return f'<div class="sc-user">{html.escape(text, quote=False)}</div>'


def render_history(session: Session, streaming: bool = False) -> list[dict]:
    """The session as Chatbot messages; the last turn shows a cursor while streaming."""
    messages = []
    for i, turn in enumerate(session.turns):
        messages.append({"role": "user", "content": user_html(turn.user)})
        live = streaming and i == len(session.turns) - 1
        if turn.stats or live:
            messages.append({"role": "assistant", "content": render_turn(turn, live)})
    if session.pending is not None:
        messages.append({"role": "user", "content": user_html(session.pending)})
    return messages


RACE_HINT = ("Race drafters replays the last prompt with the same seed and settings: "
             "speculation off, then each drafter the model has, and says which was fastest.")


def race_placeholders() -> tuple[str, str]:
    """(the runs' panels, the results) before any race."""
    return f'<div class="sc-race-placeholder">{RACE_HINT}</div>', ""


def race_panel(mode: str, title: str, tokens: list[TokenEvent],
               stats: GenerationStats | None, live: bool,
               steps: list[StepRecord] | None = None) -> str:
    """One run of a race: its reply with its own inspector (the step cards of its steps,
    keyed by the run), its stats line. Named by classes (sc-race-MODE), never by id."""
    mode_css = re.sub(r"[^a-z0-9-]", "", mode.lower())
    body = (f'<div class="sc-turn sc-turn-race-{mode_css}">'
            f"{inspected(tokens, steps or [], live, stats)}</div>")
    line = stats_line(stats, show_speedup=False) if stats else ""
    error = f'<div class="sc-error">⚠ {html.escape(stats.error)}</div>' \
        if stats and stats.error else ""
    return (f'<div class="sc-race-run sc-race-{mode_css}"><h3>{html.escape(title)}</h3>'
            f"{body}{error}{line}</div>")


def race_panels(panels: list[str]) -> str:
    return f'<div class="sc-race-runs">{"".join(panels)}</div>'


# ---------------------------------------------------------------------------------------------
# Header and status

def header_html(slot: ModelSlot) -> str:
    logo = asset("logo.svg")
    top = (f'<div class="sc-header">{logo}<div><h1>specchat</h1><div class="sc-tagline">'
           "Speculative decoding you can see: a small draft proposes, the target verifies, "
           "every token is colored by how it was produced.</div></div></div>")
    return top + models_html(slot)


SHORT_DRAFTER_NAMES = {"model": "draft model", "ngram": "n-gram", "head": "EAGLE head",
                       "combined": "n-gram + head", "server": "the server's"}


def models_html(slot: ModelSlot) -> str:
    if slot.report is None:
        what = html.escape(slot.redact(slot.description or "the models"))
        verb = "Could not load" if slot.state == "failed" else "Loading"
        return f'<div class="sc-models"><span>{verb} {what}</span></div>'
    engine, report = slot.report.engine, slot.report
    drafters = []
    if report.draft is not None:
        drafters.append(f"<code>{html.escape(slot.redact(report.draft.label))}</code>")
    elif "model" in engine.drafters:
        drafters.append("<code>draft model</code>")
    if "ngram" in engine.drafters:
        drafters.append("<code>n-gram prompt lookup</code>")
    if "head" in engine.drafters:
        label = getattr(engine.drafters["head"], "label", "draft head")
        drafters.append(f"<code>{html.escape(slot.redact(label))}</code>")
    if "server" in engine.drafters:
        drafters.append("<code>the server's own speculation</code>")
    warnings = "".join(f'<div class="sc-note">⚠ {html.escape(slot.redact(n))}</div>'
                       for n in report.notes)
    runtime = getattr(engine.target, "runtime", None)  # None for a serving backend
    if runtime is not None and not runtime.row_exact:
        warnings += f'<div class="sc-note">⚠ {html.escape(runtime.lossless_note)}</div>'
    base = ""
    if not engine.chats:
        base = ('<div class="sc-note sc-base">This target is a small <b>base model</b>: it '
                "continues text, so <b>Completion</b> mode suits it best; Chat gives it a short "
                "example conversation to continue. Real chat needs an instruct model: a preset "
                "on a GPU, e.g. <code>python app.py --preset qwen2.5-7b</code>.</div>")
    label = slot.redact(engine.target.label)
    target, short = html.escape(label), html.escape(re.split(r" [(\[]", label)[0])
    cpu = (f'<span title="{html.escape(runtime.proof)}">Runs on: <code>'
           f"{html.escape(runtime.cpu)}</code></span>" if runtime is not None else "")
    where = f" · {html.escape(runtime.cpu.split(' (')[0])}" if runtime is not None else ""
    # One line by default (the page's first screen belongs to the chat); the details open.
    names = " + ".join(SHORT_DRAFTER_NAMES.get(d, d) for d in engine.drafters
                       if d != "combined") or "none"  # combined is n-gram + head
    kind = " · base model" if base else ""
    summary = f"<summary><b>{short}</b>{kind} · drafts: {names}{where}</summary>"
    return (f'<details class="sc-models">{summary}<div class="sc-models-full"><span>Target: '
            f"<code>{target}</code></span><span>Draft: {' + '.join(drafters) or 'none'}"
            f"</span>{cpu}</div>{base}</details>{warnings}")


def status_html(slot: ModelSlot) -> str:
    share = f'<div class="sc-note">{html.escape(slot.share_note)}</div>' if slot.share_note else ""
    if slot.state == "ready":
        return f'<div class="sc-status sc-status-ready">● Ready</div>{share}'
    if slot.state == "failed":
        return (f'<div class="sc-status sc-status-failed">✖ The models failed to load; the chat '
                f"is disabled.<pre>{html.escape(slot.redact(slot.error))}</pre></div>{share}")
    elapsed = time.monotonic() - slot.started
    last = html.escape(slot.redact(slot.lines[-1])) if slot.lines else "starting…"
    return (f'<div class="sc-status sc-status-loading"><span class="sc-spinner"></span>Loading '
            f"models… {elapsed:.0f} s ({last})</div>{share}")

ASSETS = assets_dir()


def asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")
