"""The chat page: streaming replies colored by how each token was produced, A/B replay, stats.

    demo = build_ui(engine_or_report_or_slot, store=StatsStore.open_or_disabled(None))
    launch(demo, server_port=7860)

The engine yields events (TokenEvent, StepRecord, GenerationStats); this module renders them.
Handlers are plain methods of `ChatApp` over a per-browser `Session` (a `gr.State`), so tests
drive them without a browser (gradio's chatbot_streaming pattern: `submit(user).then(bot)`).
Nothing here touches torch or transformers: model code stays behind `specchat.engine`.

Rendering: the Chatbot runs with render_markdown=False and gets our own HTML, one span per token
(`tk tk-<kind>` plus a title tooltip). Token text is HTML-escaped; fenced code, inline code and
**bold** are recognized on the reply text and styled by splitting token spans at their edges, so
markup never hides a token and a token never breaks the markup.
"""

from __future__ import annotations

import bisect
import html
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import gradio as gr

from specchat import ui_stats
from specchat.engine import (DRAFTER_PREFERENCE, Engine, GenerateConfig, LoadReport,
                             default_tree_nodes)
from specchat.events import ACCEPTED, BONUS, RESAMPLED, TARGET, GenerationStats, StepRecord, \
    TokenEvent
from specchat.models import ModelLoadError
from specchat.stats import StatsStore
from specchat.text import chat_prompt

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DRAFTER_LABELS = {"model": "Draft model", "ngram": "N-gram lookup (prompt)",
                  "head": "Draft head (EAGLE)", "combined": "N-gram + head"}
MAX_DRAFT_LEN = 16
KIND_WORDS = {ACCEPTED: "accepted", RESAMPLED: "resampled", BONUS: "bonus", TARGET: "target"}


def asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Settings and per-browser state

@dataclass
class Limits:
    """Server-side caps: a visitor of a shared link cannot go past these from the page or API."""
    max_input_chars: int = 4000  # one user message
    max_new_tokens_cap: int = 1024  # per reply
    max_history_chars: int = 24000  # older turns beyond this are left out of the prompt


@dataclass
class Settings:
    """What the page's controls say for one request (raw values: `ChatApp.config` checks them)."""
    system: str = ""  # system prompt
    speculation: bool = True
    drafter: str = ""  # "model" | "combined" | "ngram" | "head"; "" = the engine's default
    draft_len: int = 4  # k
    adaptive: bool = True  # let k follow measured acceptance
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    seed: int = -1  # -1: a fresh random seed per reply (shown in the stats line)


@dataclass
class Turn:
    user: str
    tokens: list[TokenEvent] = field(default_factory=list)  # as the engine emitted them
    stats: GenerationStats | None = None  # None while streaming
    notes: list[str] = field(default_factory=list)  # caps applied, fallbacks
    turn_id: int | None = None  # row id in the stats store
    body_html: str = field(default="", repr=False)  # rendered tokens, cached once finished

    @property
    def reply(self) -> str:
        return "".join(t.text for t in self.tokens)


@dataclass
class Session:
    """One browser's conversation (a gr.State: visitors never see each other's)."""
    turns: list[Turn] = field(default_factory=list)
    pending: str | None = None  # a user message echoed in the chat, waiting for its reply
    conversation_id: str | None = None  # in the stats store, created with the first turn
    ab_plain: list[GenerationStats] = field(default_factory=list)  # A/B plain runs: baselines


# ---------------------------------------------------------------------------------------------
# Models: loaded in the background while the page is already up

class ModelSlot:
    """The models the page serves: loading (with progress lines), ready, or failed."""

    def __init__(self, report: LoadReport | None = None, description: str = ""):
        self.report = report
        self.description = description  # what is being loaded, shown while loading
        self.error = ""
        self.lines: list[str] = []
        self.started = time.monotonic()
        self.share_note = ""  # set by the launcher when a share link could not be made

    @classmethod
    def of(cls, source: Engine | LoadReport | ModelSlot) -> ModelSlot:
        if isinstance(source, ModelSlot):
            return source
        if isinstance(source, Engine):
            source = LoadReport(source, None, [])
        return cls(source)

    @property
    def state(self) -> str:
        return "ready" if self.report else "failed" if self.error else "loading"

    @property
    def engine(self) -> Engine | None:
        return self.report.engine if self.report else None

    def progress(self, message: str) -> None:
        message = str(message).strip()
        if message:
            self.lines.append(message)
            print(f"specchat: {message}", file=sys.stderr, flush=True)

    def load(self, loader: Callable[[Callable[[str], None]], LoadReport]) -> threading.Thread:
        """Run loader(progress) in a daemon thread; the page polls `state`."""
        def run():
            try:
                self.report = loader(self.progress)
                self.progress(f"Ready in {time.monotonic() - self.started:.0f} s.")
            except ModelLoadError as e:  # says why, in words a user can act on
                self.error = str(e)
            except Exception as e:  # anything else: say what it was
                self.error = f"{type(e).__name__}: {e}"
            if self.error:
                print(f"specchat: model loading failed: {self.error}", file=sys.stderr)

        self.started = time.monotonic()
        thread = threading.Thread(target=run, name="specchat-load", daemon=True)
        thread.start()
        return thread


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


def render_tokens(tokens: list[TokenEvent], streaming: bool = False) -> str:
    """A reply as HTML: one span per token (split where markup starts or ends)."""
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
    for tok in tokens:
        if not tok.text:
            continue  # an incomplete multi-byte character: its text arrives with the next token
        a, b = pos, pos + len(tok.text)
        pos = b
        css = f"tk tk-{tok.kind}"
        title = html.escape(token_title(tok), quote=True)
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
            out.append(f'<span class="{css}{extras[at]}" title="{title}">'
                       f'{html.escape(text[s:e], quote=False)}</span>')
    if streaming:
        if current is None:
            out.append(_OPEN["text"])
            current = "text"
        out.append('<span class="sc-cursor"></span>')
    if current:
        out.append(_CLOSE[current])
    out.append("</div>")
    return "".join(out)


def plain_baseline(runs: list[GenerationStats], temperature: float) -> float | None:
    """Mean tokens/s of finished plain runs at this temperature (the stats store's rule)."""
    rates = [s.tokens_per_s for s in runs
             if not s.speculation and s.stop_reason not in ("stopped", "error")
             and s.tokens_per_s > 0 and round(s.temperature, 4) == round(temperature, 4)]
    return sum(rates) / len(rates) if rates else None


STOP_WORDS = {"eos": "", "stop_string": "", "length": "max tokens reached",
              "stopped": "stopped by you", "error": "error"}


def stats_line(stats: GenerationStats, baseline: float | None, speedup: bool = True) -> str:
    """The line under a reply: speed, tokens, acceptance, target passes, speedup."""
    def chip(value: str, label: str = "", css: str = "", title: str = "") -> str:
        attrs = (f' class="{css}"' if css else "") + \
            (f' title="{html.escape(title, quote=True)}"' if title else "")
        label = f" {html.escape(label)}" if label else ""
        return f"<span{attrs}><b>{html.escape(value)}</b>{label}</span>"

    parts = [chip(f"{stats.tokens_per_s:.1f}", "tok/s"), chip(str(stats.new_tokens), "tokens"),
             chip(f"{stats.seconds:.2f} s")]
    if stats.speculation:
        parts += [chip(f"{stats.acceptance_rate:.0%}", "accepted", "",
                       f"{stats.accepted} of {stats.drafted} draft tokens accepted"),
                  chip(f"{stats.mean_accepted_len:.2f}", "mean accepted length", "",
                       "tokens emitted per speculative step (accepted drafts + 1)"),
                  chip(str(stats.target_calls), "target passes", "",
                       "target forward passes, prefill included")]
        if not speedup:
            pass  # shown elsewhere (the A/B verdict)
        elif baseline:
            parts.append(chip(f"{stats.tokens_per_s / baseline:.2f}×", "vs plain", "sc-speedup",
                              f"tokens/s over this conversation's plain tokens/s "
                              f"({baseline:.1f} at the same temperature)"))
        else:
            parts.append(chip("no plain baseline yet", "", "",
                              "Speedup needs a plain reply at the same temperature in this "
                              "conversation: turn speculation off for a reply, or run A/B replay."))
        k = f"k≤{stats.draft_len}"
        if stats.tree_nodes:
            k += f", trees of ≤{stats.tree_nodes}"
        parts.append(chip(stats.drafter, f"drafter, {k}"))
    else:
        parts += [chip(str(stats.target_calls), "target passes"), chip("speculation off")]
    if stats.seed is not None:
        parts.append(chip(str(stats.seed), "seed"))
    word = STOP_WORDS.get(stats.stop_reason, stats.stop_reason)
    if word:
        parts.append(chip(word, "", "sc-stop"))
    return f'<div class="sc-stats">{"".join(parts)}</div>'


def render_turn(turn: Turn, baseline: float | None, streaming: bool = False) -> str:
    if streaming or not turn.stats:
        body = render_tokens(turn.tokens, streaming)
    elif turn.body_html:
        body = turn.body_html  # a finished reply never changes: render it once
    else:
        body = turn.body_html = render_tokens(turn.tokens) if turn.reply else \
            '<div class="sc-reply"><span class="sc-empty">(empty reply)</span></div>'
    parts = [body]
    if turn.stats and turn.stats.error:
        parts.append(f'<div class="sc-error">⚠ {html.escape(turn.stats.error)}</div>')
    if turn.stats:
        parts.append(stats_line(turn.stats, baseline))
    parts += [f'<div class="sc-note">{html.escape(n)}</div>' for n in turn.notes]
    return "".join(parts)


def user_html(text: str) -> str:
    return f'<div class="sc-user">{html.escape(text, quote=False)}</div>'


def render_history(session: Session, streaming: bool = False) -> list[dict]:
    """The session as Chatbot messages; the last turn shows a cursor while streaming."""
    plain = [t.stats for t in session.turns if t.stats] + session.ab_plain
    messages = []
    for i, turn in enumerate(session.turns):
        messages.append({"role": "user", "content": user_html(turn.user)})
        live = streaming and i == len(session.turns) - 1
        if turn.stats or live:
            baseline = plain_baseline(plain, turn.stats.temperature) if turn.stats else None
            messages.append({"role": "assistant", "content": render_turn(turn, baseline, live)})
    if session.pending is not None:
        messages.append({"role": "user", "content": user_html(session.pending)})
    return messages


# ---------------------------------------------------------------------------------------------
# The app: handlers over (Session, Settings)

class ChatApp:
    def __init__(self, source: Engine | LoadReport | ModelSlot, store: StatsStore | None = None,
                 limits: Limits | None = None, is_owner_fn: Callable[[gr.Request], bool] | None
                 = None, min_interval: float = 0.05):
        self.slot = ModelSlot.of(source)
        self.store = store or StatsStore.open_or_disabled("off")
        self.limits = limits or Limits()
        self.is_owner_fn = is_owner_fn or (lambda request: True)
        self.min_interval = min_interval  # seconds between repaints while streaming
        self._stops: dict[str, threading.Event] = {}  # session key -> the running reply's flag
        self._stops_lock = threading.Lock()

    # -- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _key(request: gr.Request | None) -> str:
        return (getattr(request, "session_hash", None) or "local") if request else "local"

    def _stop_event(self, request) -> threading.Event:
        event = threading.Event()
        with self._stops_lock:
            self._stops[self._key(request)] = event
        return event

    def _release(self, request, event: threading.Event) -> None:
        with self._stops_lock:
            if self._stops.get(self._key(request)) is event:
                del self._stops[self._key(request)]

    def stop(self, request: gr.Request | None = None) -> str:
        """Ask this browser's running reply (or A/B replay) to end after the current step."""
        with self._stops_lock:
            event = self._stops.get(self._key(request))
        if event is None or event.is_set():
            return ""
        event.set()
        return "Stopping after the current step…"

    def drafters(self) -> list[str]:
        """Loaded drafters, best first."""
        engine = self.slot.engine
        if engine is None:
            return []
        return sorted(engine.drafters, key=lambda d: (DRAFTER_PREFERENCE + (d,)).index(d))

    def config(self, s: Settings) -> tuple[GenerateConfig, list[str]]:
        """Settings -> GenerateConfig, clamped server-side; notes say which caps applied."""
        notes = []
        cap = self.limits.max_new_tokens_cap
        max_new = int(s.max_new_tokens or 1)
        if max_new > cap:
            notes.append(f"Max new tokens capped at {cap} by the server (asked {max_new}).")
        max_new = max(1, min(max_new, cap))
        available = self.drafters()
        drafter = s.drafter
        if s.speculation and drafter not in available:
            fallback = available[0] if available else "ngram"
            if drafter:
                notes.append(f"Drafter {DRAFTER_LABELS.get(drafter, drafter)!r} is not loaded: "
                             f"using {DRAFTER_LABELS.get(fallback, fallback)}.")
            drafter = fallback
        seed = int(s.seed) if s.seed is not None and int(s.seed) >= 0 else \
            random.randrange(2**31 - 1)
        temperature = min(max(float(s.temperature or 0.0), 0.0), 2.0)
        cfg = GenerateConfig(max_new_tokens=max_new, temperature=temperature,
                             top_p=min(max(float(s.top_p or 1.0), 0.01), 1.0),
                             top_k=max(int(s.top_k or 0), 0), seed=seed,
                             speculation=bool(s.speculation) and bool(available),
                             drafter=drafter,
                             draft_len=min(max(int(s.draft_len or 1), 1), MAX_DRAFT_LEN),
                             adaptive=bool(s.adaptive),
                             tree_nodes=default_tree_nodes(temperature, drafter))
        return cfg, notes

    def system_prompt(self, s: Settings, notes: list[str]) -> str:
        """The system prompt, cut to the message cap (a note says so)."""
        system, cap = (s.system or "").strip(), self.limits.max_input_chars
        if len(system) > cap:
            notes.append(f"System prompt cut to {cap:,} characters (server limit).")
            system = system[:cap]
        return system

    def prompt_messages(self, session: Session, upto: int, system: str) -> tuple[list[dict], int]:
        """Chat messages for the reply to turn `upto`: the system prompt, earlier turns (oldest
        dropped past the history cap), the user message. Returns (messages, turns left out)."""
        turns = session.turns[:upto]
        budget = self.limits.max_history_chars - len(session.turns[upto].user) - len(system)
        kept: list[Turn] = []
        for turn in reversed(turns):
            if not turn.reply:
                continue  # a failed or empty reply: leave the exchange out
            budget -= len(turn.user) + len(turn.reply)
            if budget < 0:
                break
            kept.insert(0, turn)
        dropped = sum(1 for t in turns if t.reply) - len(kept)
        messages = [{"role": "system", "content": system}] if system.strip() else []
        for turn in kept:
            messages += [{"role": "user", "content": turn.user},
                         {"role": "assistant", "content": turn.reply}]
        messages.append({"role": "user", "content": session.turns[upto].user})
        return messages, dropped

    def _drive(self, ids: list[int], cfg: GenerateConfig, stop: threading.Event,
               tokens: list[TokenEvent]) -> Iterator[GenerationStats | None]:
        """One generation: appends TokenEvents to `tokens`, yields None when a repaint is due,
        the GenerationStats last. An engine error becomes stats with `error` set."""
        engine = self.slot.engine
        last, stats, error = 0.0, None, ""
        try:
            for event in engine.stream(ids, cfg, stop_event=stop):
                if isinstance(event, TokenEvent):
                    tokens.append(event)
                elif isinstance(event, StepRecord):
                    now = time.monotonic()
                    if now - last >= self.min_interval:
                        last = now
                        yield None
                elif isinstance(event, GenerationStats):
                    stats = event
        except Exception as e:  # keep the app alive; the engine's cache may be inconsistent
            engine.reset_cache()
            stats, error = None, f"{type(e).__name__}: {e}"
        if stats is None:
            stats = GenerationStats(new_tokens=len(tokens), speculation=cfg.speculation,
                                    drafter=cfg.drafter if cfg.speculation else "none",
                                    draft_len=cfg.draft_len if cfg.speculation else 0,
                                    temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                    seed=cfg.seed, stop_reason="error",
                                    error=error or "the engine ended without a result")
        if stats.error:
            stats.error = readable_error(stats.error)
        yield stats

    def _record(self, session: Session, request, prompt: str, reply: str,
                stats: GenerationStats, baseline_turn_id: int | None = None) -> int | None:
        if not self.store.enabled or (stats.stop_reason == "error" and not reply):
            return None
        if session.conversation_id is None:
            engine, report = self.slot.engine, self.slot.report
            owner = ui_stats.conversation_owner(request, self.is_owner_fn)
            session.conversation_id = self.store.new_conversation(
                prompt[:60], owner, engine.target.name,
                report.draft.name if report.draft is not None else "",
                engine.target.quantization, engine.device.type)
        return self.store.record_turn(session.conversation_id, prompt, reply, stats.to_json(),
                                      baseline_turn_id=baseline_turn_id)

    def _not_ready(self) -> str:
        if self.slot.state == "failed":
            return "⚠ The models failed to load, so the chat cannot answer: " + self.slot.error
        return "The models are still loading; your message is kept, send it when ready."

    # -- chat handlers -------------------------------------------------------------------------

    def user(self, text: str, session: Session, request: gr.Request | None = None):
        """Echo a message into the chat (instant), or say why not and keep it in the box.
        -> (box, chat, session, notice)"""
        text = text or ""
        if not text.strip():
            return text, render_history(session), session, _notice(
                "Type a message first: an empty message was not sent.", request)
        if len(text) > self.limits.max_input_chars:
            return text, render_history(session), session, _notice(
                f"Your message is {len(text):,} characters; the limit here is "
                f"{self.limits.max_input_chars:,}. Shorten it and send again "
                "(it is still in the box).", request)
        if self.slot.state != "ready":
            return text, render_history(session), session, _notice(self._not_ready(), request)
        session.pending = text
        return "", render_history(session), session, ""

    def bot(self, session: Session, settings: Settings, request: gr.Request | None = None):
        """Stream the reply to the pending message. Yields (chat, session, notice)."""
        if session.pending is None or self.slot.engine is None:
            yield render_history(session), session, gr.skip()
            return
        turn = Turn(session.pending)
        session.pending = None
        session.turns.append(turn)
        yield from self._reply(session, turn, settings, request)

    def _reply(self, session: Session, turn: Turn, settings: Settings, request):
        engine = self.slot.engine
        cfg, turn.notes = self.config(settings)
        system = self.system_prompt(settings, turn.notes)
        messages, dropped = self.prompt_messages(session, len(session.turns) - 1, system)
        if dropped:
            turn.notes.append(f"{dropped} older exchange(s) left out of the prompt "
                              f"(history limit {self.limits.max_history_chars:,} characters).")
        notice = " ".join(turn.notes)
        ids, stops = chat_prompt(engine.tokenizer, messages)
        cfg.stop = tuple(stops)
        stop = self._stop_event(request)
        try:
            yield render_history(session, streaming=True), session, notice
            for result in self._drive(ids, cfg, stop, turn.tokens):
                if result is None:
                    yield render_history(session, streaming=True), session, gr.skip()
                else:
                    turn.stats = result
        finally:
            self._release(request, stop)
        turn.turn_id = self._record(session, request, turn.user, turn.reply, turn.stats)
        yield render_history(session), session, notice

    def retry(self, session: Session):
        """Drop the last reply and queue its message again. -> (chat, session, notice)"""
        if not session.turns:
            return render_history(session), session, "Nothing to retry yet."
        session.pending = session.turns.pop().user
        return render_history(session), session, ""

    def undo(self, session: Session):
        """Remove the last exchange; its message goes back into the box.
        -> (box, chat, session, notice)"""
        if not session.turns:
            return gr.skip(), render_history(session), session, "Nothing to undo."
        turn = session.turns.pop()
        return turn.user, render_history(session), session, ""

    def new_conversation(self, session: Session | None = None):
        """-> (box, chat, session, notice, A/B off, A/B on, verdict)"""
        fresh = Session()
        return ("", [], fresh, "", *ab_placeholders())

    def build(self, defaults: Settings | None = None) -> gr.Blocks:
        return _page(self, defaults)

    # -- A/B replay ------------------------------------------------------------------------

    def ab_replay(self, session: Session, settings: Settings, request: gr.Request | None = None):
        """Replay the last prompt with speculation off, then on (same seed and settings).
        Yields (off panel, on panel, verdict, chat, session, notice)."""
        if self.slot.engine is None:
            yield *ab_placeholders(), gr.skip(), session, self._not_ready()
            return
        if not session.turns:
            yield (*ab_placeholders(), gr.skip(), session,
                   "Send a message first: A/B replays the last prompt.")
            return
        engine = self.slot.engine
        cfg, notes = self.config(replace(settings, speculation=True))
        if not cfg.speculation:
            yield (*ab_placeholders(), gr.skip(), session,
                   "No drafter is available, so there is nothing to compare.")
            return
        last = len(session.turns) - 1
        prompt = session.turns[last].user
        messages, _ = self.prompt_messages(session, last, self.system_prompt(settings, notes))
        ids, stops = chat_prompt(engine.tokenizer, messages)
        cfg.stop = tuple(stops)
        stop = self._stop_event(request)
        notice = " ".join(notes)
        try:
            yield from self._ab_runs(session, request, prompt, ids, cfg, stop, notice)
        finally:
            self._release(request, stop)

    def _ab_runs(self, session, request, prompt, ids, cfg, stop, notice):
        engine = self.slot.engine
        runs: dict[str, tuple[list[TokenEvent], GenerationStats | None]] = {}

        def panels(live: str | None = None):
            return (ab_panel("Speculation off", *runs.get("off", ([], None)), live == "off"),
                    ab_panel(f"Speculation on ({cfg.drafter}, k≤{cfg.draft_len})",
                             *runs.get("on", ([], None)), live == "on"))

        plain_id = None
        for name, speculation in (("off", False), ("on", True)):
            tokens: list[TokenEvent] = []
            runs[name] = (tokens, None)
            run_cfg = replace(cfg, speculation=speculation)
            yield (*panels(name), f'<div class="sc-verdict">Replaying with speculation {name}…'
                   "</div>", gr.skip(), session, gr.skip())
            for result in self._drive(ids, run_cfg, stop, tokens):
                if result is None:
                    yield *panels(name), gr.skip(), gr.skip(), session, gr.skip()
                else:
                    runs[name] = (tokens, result)
            yield *panels(), gr.skip(), gr.skip(), session, notice
            reply = "".join(t.text for t in tokens)
            stats = runs[name][1]
            if name == "off":
                plain_id = self._record(session, request, prompt, reply, stats)
                if stats.stop_reason not in ("stopped", "error"):
                    session.ab_plain.append(stats)
            else:
                self._record(session, request, prompt, reply, stats, baseline_turn_id=plain_id)
            if stop.is_set() or stats.stop_reason == "error":
                break
        verdict = ab_verdict(runs, cfg, engine.target.quantization, engine.row_exact)
        # The plain run is a baseline for this conversation's speculative replies too.
        yield *panels(), verdict, render_history(session), session, notice


def readable_error(error: str) -> str:
    """An engine error as a sentence a user can act on; the chat goes on after it."""
    if "out of memory" in error.lower():
        return (f"Out of memory while generating ({error}). The reply so far is kept; try fewer "
                "max new tokens, a shorter conversation (New conversation), or a smaller model.")
    return f"Engine error: {error}. The reply so far is kept; you can retry or go on chatting."


def _notice(message: str, request) -> str:
    if request is not None and message:
        gr.Warning(message)  # a toast as well as the line under the box
    return message


def ab_placeholders() -> tuple[str, str, str]:
    hint = ('<div class="sc-ab-placeholder">A/B replay runs the last prompt with speculation '
            'off, then on, with the same seed and settings.</div>')
    return (ab_panel("Speculation off", [], None, False, hint),
            ab_panel("Speculation on", [], None, False, hint), "")


def ab_panel(title: str, tokens: list[TokenEvent], stats: GenerationStats | None,
             live: bool, placeholder: str = "") -> str:
    body = placeholder or render_tokens(tokens, live)
    line = stats_line(stats, None, speedup=False) if stats else ""
    error = f'<div class="sc-error">⚠ {html.escape(stats.error)}</div>' \
        if stats and stats.error else ""
    return f'<div class="sc-ab-panel"><h3>{html.escape(title)}</h3>{body}{error}{line}</div>'


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, None when the sequences are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def ab_verdict(runs: dict, cfg: GenerateConfig, quantization: str,
               row_exact: bool = False) -> str:
    (off_tokens, off), (on_tokens, on) = runs.get("off", ([], None)), runs.get("on", ([], None))
    if off is None or on is None:
        return '<div class="sc-verdict">Replay stopped before both runs finished.</div>'
    speedup = on.tokens_per_s / off.tokens_per_s if off.tokens_per_s > 0 else 0.0
    rows = [("", "speculation off", "speculation on"),
            ("latency", f"{off.seconds:.2f} s", f"{on.seconds:.2f} s"),
            ("first token", f"{off.ttft_s:.2f} s", f"{on.ttft_s:.2f} s"),
            ("tokens/s", f"{off.tokens_per_s:.1f}", f"{on.tokens_per_s:.1f}"),
            ("tokens", str(off.new_tokens), str(on.new_tokens)),
            ("target passes", str(off.target_calls), str(on.target_calls))]
    # A grid of divs, not a <table>: the theme's table styles fight ours.
    table = "".join(f'<span class="{"sc-h" if i == 0 or j == 0 else ""}">{html.escape(c)}</span>'
                    for i, row in enumerate(rows) for j, c in enumerate(row))
    off_ids, on_ids = [t.id for t in off_tokens], [t.id for t in on_tokens]
    diff = first_difference(off_ids, on_ids)
    if "stopped" in (off.stop_reason, on.stop_reason):
        same = "One run was stopped, so the texts are not compared."
    elif diff is None:
        same = ('<span class="sc-same">✓ Identical texts</span>: speculation changed the '
                "speed, not the output.")
    else:
        def piece(tokens):
            return html.escape(repr(tokens[diff].text)) if diff < len(tokens) else "(end)"
        # Every drafter but a draft model replays plain sampling per seed: n-gram lookup and
        # trees are one-hot, the head races with the target's own keyed numbers
        # (sampling.Noise). A draft model's drafts take Leviathan's test, its own way.
        if cfg.temperature > 0 and cfg.drafter == "model":
            why = ("At temperature > 0 both runs sample from the same distribution, but a draft "
                   "model's drafts pass Leviathan's test with random numbers of their own: the "
                   "texts may differ while being equally likely (lossless in distribution, not "
                   "per seed; the other drafters replay plain sampling per seed).")
        elif quantization == "none" or row_exact:
            how = ("row-exact attention: a verify pass computes the same logits as one-token "
                   "passes, bit for bit" if row_exact else "unquantized weights")
            what = "every emitted token being plain sampling's draw at its position" \
                if cfg.temperature > 0 else "greedy decoding"
            why = (f"With {how}, and {what}, the texts should match: this divergence is "
                   "unexpected (a bug worth reporting).")
        else:
            why = (f"Decoding on a {html.escape(quantization)} target on this device: a verify "
                   "pass over several tokens rounds slightly differently from one-token passes, "
                   "so a near-tie can flip. Both texts are faithful samples of the model (on "
                   "CPU, specchat's row-exact attention makes them match).")
        same = (f'<span class="sc-diff">≠ Texts differ from token {diff}</span> '
                f"(off: {piece(off_tokens)}, on: {piece(on_tokens)}). {why}")
    return (f'<div class="sc-verdict"><b>Speedup: {speedup:.2f}×</b> '
            f'(tokens/s on ÷ off)<div class="sc-ab-grid">{table}</div>{same}</div>')


def warm_up(engine: Engine) -> None:
    """A 4-token plain generation right after loading: the first forward passes pay one-time
    costs (about 2.5 s on the embedded CPU model) that would otherwise land on the first reply
    and make it look slow. Plain decoding only, so no drafter's timing policy sees it."""
    ids, stops = chat_prompt(engine.tokenizer, [{"role": "user", "content": "Hello"}])
    for _ in engine.stream(ids, GenerateConfig(max_new_tokens=4, speculation=False, seed=0,
                                               stop=tuple(stops))):
        pass


# ---------------------------------------------------------------------------------------------
# Header and status

def header_html(slot: ModelSlot) -> str:
    logo = asset("logo.svg")
    top = (f'<div class="sc-header">{logo}<div><h1>specchat</h1><div class="sc-tagline">'
           "Speculative decoding you can see: a small draft proposes, the target verifies, "
           "every token is colored by how it was produced.</div></div></div>")
    return top + models_html(slot)


def models_html(slot: ModelSlot) -> str:
    if slot.report is None:
        what = html.escape(slot.description or "the models")
        verb = "Could not load" if slot.state == "failed" else "Loading"
        return f'<div class="sc-models"><span>{verb} {what}</span></div>'
    engine, report = slot.report.engine, slot.report
    drafters = []
    if report.draft is not None:
        drafters.append(f"<code>{html.escape(report.draft.label)}</code>")
    elif "model" in engine.drafters:
        drafters.append("<code>draft model</code>")
    if "ngram" in engine.drafters:
        drafters.append("<code>n-gram prompt lookup</code>")
    if "head" in engine.drafters:
        drafters.append("<code>draft head (EAGLE, trained for this target)</code>")
    notes = "".join(f'<div class="sc-note">⚠ {html.escape(n)}</div>' for n in report.notes)
    return (f'<div class="sc-models"><span>Target: <code>{html.escape(engine.target.label)}'
            f"</code></span><span>Draft: {' + '.join(drafters) or 'none'}</span></div>{notes}")


def status_html(slot: ModelSlot) -> str:
    share = f'<div class="sc-note">{html.escape(slot.share_note)}</div>' if slot.share_note else ""
    if slot.state == "ready":
        return f'<div class="sc-status sc-status-ready">● Ready</div>{share}'
    if slot.state == "failed":
        return (f'<div class="sc-status sc-status-failed">✖ The models failed to load; the chat '
                f"is disabled.<pre>{html.escape(slot.error)}</pre></div>{share}")
    elapsed = time.monotonic() - slot.started
    last = html.escape(slot.lines[-1]) if slot.lines else "starting…"
    return (f'<div class="sc-status sc-status-loading"><span class="sc-spinner"></span>Loading '
            f"models… {elapsed:.0f} s ({last})</div>{share}")


# ---------------------------------------------------------------------------------------------
# Gradio wiring

def build_ui(source: Engine | LoadReport | ModelSlot, store: StatsStore | None = None,
             limits: Limits | None = None, is_owner_fn: Callable[[gr.Request], bool] | None
             = None, min_interval: float = 0.05, defaults: Settings | None = None) -> gr.Blocks:
    """The page. `source`: a ready Engine/LoadReport, or a ModelSlot still loading.
    Pass the result to `launch` (which adds the CSS and theme)."""
    return ChatApp(source, store, limits, is_owner_fn, min_interval).build(defaults)


def _page(self: ChatApp, defaults: Settings | None = None) -> gr.Blocks:
    d = defaults or Settings()
    limits, slot = self.limits, self.slot
    ready = slot.state == "ready"
    with gr.Blocks(title="specchat · speculative decoding you can see") as demo:
        session = gr.State(Session())
        with gr.Row(equal_height=False):
            header = gr.HTML(header_html(slot), elem_id="sc-header", scale=4)
            status = gr.HTML(status_html(slot), elem_id="sc-status", scale=1, min_width=200)
        with gr.Tabs():
            with gr.Tab("Chat", id="chat"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=3, min_width=380):
                        gr.HTML(asset("legend.html"))
                        chat = gr.Chatbot(
                            label="Chat", show_label=False, elem_id="sc-chat", height=540,
                            render_markdown=False,
                            sanitize_html=True, latex_delimiters=[], feedback_options=None,
                            autoscroll=True, buttons=[],
                            placeholder="Ask something. Replies stream in as the target verifies "
                                        "each batch of draft tokens.")
                        with gr.Row(equal_height=True):
                            box = gr.Textbox(show_label=False, placeholder="Message (Enter to "
                                             "send, Shift+Enter for a new line)", lines=1,
                                             max_lines=10, scale=6, autofocus=True,
                                             elem_id="sc-input", interactive=ready)
                            with gr.Column(scale=1, min_width=110):
                                send = gr.Button("Send", variant="primary", elem_id="sc-send",
                                                 interactive=ready)
                                stop_btn = gr.Button("Stop", variant="stop", elem_id="sc-stop")
                        notice = gr.Markdown("", elem_id="sc-notice", elem_classes="sc-notice")
                        with gr.Row():
                            retry_btn = gr.Button("↻ Retry", size="sm", elem_id="sc-retry")
                            undo_btn = gr.Button("↶ Undo", size="sm", elem_id="sc-undo")
                            new_btn = gr.Button("✚ New conversation", size="sm",
                                                elem_id="sc-new")
                            ab_btn = gr.Button("⇄ A/B replay", size="sm", variant="secondary",
                                               elem_id="sc-ab", interactive=ready)
                    with gr.Column(scale=1, min_width=260):
                        gr.Markdown("#### Speculation")
                        speculation = gr.Checkbox(value=d.speculation, label="Speculative decoding",
                                                  elem_id="sc-speculation")
                        choices = self.drafters() or ["ngram"]
                        drafter = gr.Radio(
                            [(DRAFTER_LABELS.get(c, c), c) for c in choices],
                            value=d.drafter if d.drafter in choices else choices[0],
                            label="Drafter", elem_id="sc-drafter")
                        draft_len = gr.Slider(1, MAX_DRAFT_LEN, value=d.draft_len, step=1,
                                              label="Draft length k (most drafts per step)")
                        adaptive = gr.Checkbox(value=d.adaptive, label="Adapt k to measured "
                                               "acceptance and cost")
                        gr.Markdown("#### Sampling")
                        temperature = gr.Slider(0, 2, value=d.temperature, step=0.05,
                                                label="Temperature (0 = greedy)")
                        top_p = gr.Slider(0.05, 1, value=d.top_p, step=0.05, label="Top-p")
                        top_k = gr.Slider(0, 200, value=d.top_k, step=1, label="Top-k (0 = off)")
                        max_new = gr.Slider(1, limits.max_new_tokens_cap,
                                            value=min(d.max_new_tokens, limits.max_new_tokens_cap),
                                            step=1, label=f"Max new tokens (cap "
                                                          f"{limits.max_new_tokens_cap})")
                        seed = gr.Number(value=d.seed, precision=0,
                                         label="Seed (-1 = random each reply)")
                        system = gr.Textbox(value=d.system, label="System prompt", lines=3,
                                            placeholder="Optional instructions for the model")
                with gr.Group():
                    with gr.Row(equal_height=False):
                        off_panel, on_panel, verdict_empty = ab_placeholders()
                        ab_off = gr.HTML(off_panel, elem_id="sc-ab-off")
                        ab_on = gr.HTML(on_panel, elem_id="sc-ab-on")
                    verdict = gr.HTML(verdict_empty, elem_id="sc-ab-verdict")
            with gr.Tab("Stats", id="stats") as stats_tab:
                stats = ui_stats.build_stats_tab(self.store, self.is_owner_fn, demo)
                stats.refresh_on(stats_tab.select)
        timer = gr.Timer(1.0, active=not ready and slot.state != "failed")

        controls = [system, speculation, drafter, draft_len, adaptive, temperature, top_p, top_k,
                    max_new, seed]

        # Explicit parameters: gradio injects `request` only into a named, annotated one.
        def on_bot(state, system, speculation, drafter, draft_len, adaptive, temperature, top_p,
                   top_k, max_new_tokens, seed, request: gr.Request):
            yield from self.bot(state, Settings(system, speculation, drafter, draft_len, adaptive,
                                                temperature, top_p, top_k, max_new_tokens, seed),
                                request)

        def on_ab(state, system, speculation, drafter, draft_len, adaptive, temperature, top_p,
                  top_k, max_new_tokens, seed, request: gr.Request):
            yield from self.ab_replay(state, Settings(system, speculation, drafter, draft_len,
                                                      adaptive, temperature, top_p, top_k,
                                                      max_new_tokens, seed), request)

        def on_user(text, state, request: gr.Request):
            return self.user(text, state, request)

        def on_stop(request: gr.Request):
            return self.stop(request) or gr.skip()

        def on_page(request: gr.Request):
            now_ready = slot.state == "ready"
            choices = self.drafters() or ["ngram"]
            # A failed load is also said in the chat itself, where the user looks.
            failed = [{"role": "assistant", "content": '<div class="sc-error">⚠ The models '
                       f"failed to load: {html.escape(slot.error)}</div>"}]
            return (header_html(slot), status_html(slot),
                    failed if slot.state == "failed" else gr.skip(),
                    gr.Radio(choices=[(DRAFTER_LABELS.get(c, c), c) for c in choices],
                             value=d.drafter if d.drafter in choices else choices[0]),
                    gr.Textbox(interactive=now_ready), gr.Button(interactive=now_ready),
                    gr.Button(interactive=now_ready), gr.Timer(active=slot.state == "loading"))

        private = dict(api_visibility="private")
        engine_lane = dict(concurrency_id="engine", concurrency_limit=1, **private)
        instant = dict(concurrency_limit=None, show_progress="hidden", **private)
        chat_out = [chat, session, notice]

        for trigger in (box.submit, send.click):
            trigger(on_user, [box, session], [box, chat, session, notice], **instant).then(
                on_bot, [session, *controls], chat_out, show_progress="minimal", **engine_lane)
        retry_btn.click(self.retry, session, chat_out, **instant).then(
            on_bot, [session, *controls], chat_out, show_progress="minimal", **engine_lane)
        undo_btn.click(self.undo, session, [box, chat, session, notice], **instant)
        new_outputs = [box, chat, session, notice, ab_off, ab_on, verdict]
        new_btn.click(self.new_conversation, session, new_outputs, **instant)
        chat.clear(self.new_conversation, session, new_outputs, **instant)
        ab_btn.click(on_ab, [session, *controls], [ab_off, ab_on, verdict, chat, session, notice],
                     show_progress="minimal", **engine_lane)
        stop_btn.click(on_stop, None, notice, queue=False, **private)
        page_out = [header, status, chat, drafter, box, send, ab_btn, timer]
        timer.tick(on_page, None, page_out, **instant)
        demo.load(on_page, None, page_out, **instant)
    return demo


def theme() -> gr.themes.Base:
    # Local font stacks only: the page must not wait on a font CDN when offline.
    return gr.themes.Soft(primary_hue="emerald", secondary_hue="blue", neutral_hue="slate",
                          font=["ui-sans-serif", "system-ui", "-apple-system", "Segoe UI",
                                "Roboto", "sans-serif"],
                          font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas",
                                     "monospace"]).set(
        block_title_background_fill="transparent", block_title_text_color="*neutral_700",
        block_title_text_color_dark="*neutral_200", block_label_background_fill="transparent",
        block_label_text_color="*neutral_500", block_title_padding="0")


def launch_kwargs() -> dict:
    """What `demo.launch` needs besides host/port/share/auth (gradio 6: theme/css live here)."""
    return dict(css=asset("specchat.css"), theme=theme(), favicon_path=str(ASSETS / "logo.svg"),
                footer_links=["gradio", "settings"])


def launch(demo: gr.Blocks, **kwargs):
    """demo.queue(...).launch(...) with specchat's CSS and theme; kwargs go to launch()."""
    demo.queue(default_concurrency_limit=1, max_size=64)
    return demo.launch(**launch_kwargs(), **kwargs)
