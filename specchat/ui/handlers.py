"""The chat page: streaming replies colored by how each token was produced, the race of drafters, stats.

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

import html
import random
import threading
import time
import uuid
from collections.abc import Generator, Iterator
from concurrent.futures import Future
from dataclasses import asdict, replace

import gradio as gr

from specchat.core.engine import Engine
from specchat.core.events import GenerationStats, StepRecord, TokenEvent
from specchat.core.inputs import InputError, clean_text
from specchat.core.race import PLAIN
from specchat.core.race import lanes as race_lanes
from specchat.core.request import GenerateConfig
from specchat.core.settings import SETTINGS, build_config, request
from specchat.drafters import LABELS as DRAFTER_LABELS
from specchat.drafters import NAMES as DRAFTER_NAMES
from specchat.engine_queue import (
    MAX_PER_OWNER,
    MAX_WAITING,
    EngineQueue,
    Finished,
    Mailbox,
    QueueFull,
    Waiting,
    run_reply,
)
from specchat.loader import LoadReport
from specchat.stats.format import fmt_speedup
from specchat.stats.race import standings
from specchat.stats.race import Entry as RaceEntry
from specchat.stats.race import winner as race_winner
from specchat.stats.speedup import Speedup, plain_step_times, turn_speedup
from specchat.stats.store import StatsStore
from specchat.stats.writer import StatsWriter
from specchat.ui import live as feeds
from specchat.ui.access import NOBODY, Access
from specchat.ui.render import race_panel, race_panels, race_placeholders, render_history
from specchat.ui.state import Limits, ModelSlot, Session, Settings, Turn

# What a message sent while the models load is told; it goes once they are ready.
STILL_LOADING = "The models are still loading; your message is kept, send it when ready."
# What a tab is told when it asks for a second reply (a message, Retry, Undo, the race) while its
# first is running; a message stays in the box.
BUSY = "Wait for the reply being written, or stop it: one reply at a time in a tab."
ONE_AT_A_TIME = BUSY + " Your message is still in the box."
# Seconds between a race run's progress lines: the runs are timed without repaints.
PROGRESS_S = 0.5
# A repaint waits this many times the last one's cost (measured from the yield to the next
# request): the server's share of a repaint is about half of it where the browser shares the
# machine (its own render is as long again, unseen here), so the page takes about a tenth of
# the time at most.
REPAINT_SPACING = 19


# ---------------------------------------------------------------------------------------------
# The app: handlers over (Session, Settings)

class ChatApp:
    def __init__(self, source: Engine | LoadReport | ModelSlot, store: StatsStore | None = None,
                 limits: Limits | None = None, access: Access | None = None,
                 min_interval: float = 0.05):
        self.slot = ModelSlot.of(source)
        self.store = store or StatsStore.open_or_disabled("off")
        self.writer = StatsWriter(self.store)  # saves turns off the reply path
        self.limits = limits or Limits()
        self.access = access or Access()
        self.min_interval = min_interval  # seconds between repaints while streaming
        self._stops: dict[str, threading.Event] = {}  # session key -> the running reply's flag
        self._stops_lock = threading.Lock()
        # Session keys (one per tab) with a reply or a race running: one at a time each, so
        # a reply's prompt always holds the whole of the replies before it.
        self._busy: set[str] = set()
        # Every reply joins the engine's line (engine_queue.py) with the API's limits.
        self.max_waiting, self.max_per_owner = MAX_WAITING, MAX_PER_OWNER

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

    def _claim(self, request) -> bool:
        """This tab's one running reply: False when it has one already."""
        with self._stops_lock:
            if self._key(request) in self._busy:
                return False
            self._busy.add(self._key(request))
            return True

    def _unclaim(self, request) -> None:
        with self._stops_lock:
            self._busy.discard(self._key(request))

    def busy(self, request: gr.Request | None = None) -> bool:
        """Whether this tab has a reply (or a race) running."""
        with self._stops_lock:
            return self._key(request) in self._busy

    def stop(self, request: gr.Request | None = None) -> str:
        """Ask this browser's running reply (or race) to end after the current step."""
        with self._stops_lock:
            event = self._stops.get(self._key(request))
        if event is None or event.is_set():
            return ""
        event.set()
        return "Stopping after the current step…"

    def forget(self, owner: str) -> None:
        """Drop the engine's drafting history of `owner` (core/history.py)."""
        history = getattr(self.slot.engine, "history", None)
        if history is not None:
            history.forget(owner)

    def greedy_trees(self) -> tuple[str, ...]:
        """The loaded drafters that draft trees when greedy by default (`Engine.greedy_trees`)."""
        engine = self.slot.engine
        return () if engine is None else engine.greedy_trees

    def drafters(self) -> list[str]:
        """Loaded drafters, best first."""
        engine = self.slot.engine
        if engine is None:
            return []
        return sorted(engine.drafters, key=lambda d: (DRAFTER_NAMES + (d,)).index(d))

    def config(self, s: Settings) -> tuple[GenerateConfig, list[str]]:
        """Settings -> GenerateConfig (`core.settings.build_config`: raises InputError), capped
        server-side; notes say which caps applied. A random seed is drawn here, so the reply's
        stats and its race name it."""
        values = {name: getattr(s, name) for name in SETTINGS if hasattr(s, name)}
        available = self.drafters()
        # A choice made before the models changed may name a drafter no longer loaded: the
        # page goes on with the best loaded one and says so.
        drafter = s.drafter if s.drafter in available else ""
        values.update(speculation=s.speculation, drafter=drafter, adaptive=s.adaptive)
        cfg, notes = build_config(values, available, max_new_cap=self.limits.max_new_tokens_cap,
                                  greedy_trees=self.greedy_trees())
        if s.drafter and s.drafter != drafter and cfg.speculation:
            notes.insert(0, f"Drafter {DRAFTER_LABELS.get(s.drafter, s.drafter)!r} is not "
                            f"loaded: using {DRAFTER_LABELS.get(cfg.drafter, cfg.drafter)}.")
        if cfg.seed is None:
            cfg = replace(cfg, seed=random.randrange(2**31 - 1))
        return cfg, notes

    def system_prompt(self, s: Settings, notes: list[str]) -> str:
        """The system prompt, cut to the message cap (a note says so)."""
        system, cap = clean_text(s.system).strip(), self.limits.max_input_chars
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

    def prompt_ids(self, session: Session, upto: int, settings: Settings, notes: list[str]
                   ) -> tuple[list[int], tuple[str, ...]]:
        """The token ids the reply to turn `upto` continues, and its stop strings. Chat: the
        conversation in the model's chat format. Completion: the message as plain text, which
        the model continues (what a base model is good at); no history, no system prompt."""
        engine = self.slot.engine
        if settings.mode == "completion":
            return engine.text_prompt(session.turns[upto].user)
        system = self.system_prompt(settings, notes)
        messages, dropped = self.prompt_messages(session, upto, system)
        if dropped:
            notes.append(f"{dropped} older exchange(s) left out of the prompt "
                         f"(history limit {self.limits.max_history_chars:,} characters).")
        ids, stops = engine.chat_prompt(messages)
        return ids, tuple(stops)

    def _drive(self, ids: list[int], cfg: GenerateConfig, stop: threading.Event,
               tokens: list[TokenEvent], steps: list[StepRecord] | None = None,
               owner: str | None = None, every: float | None = None
               ) -> Iterator[GenerationStats | Waiting | None]:
        """One generation in its turn: the engine's queue, shared with the API's requests and
        fair between visitors (`owner`, by default `cfg.owner`), with the API's limits, yields
        Waiting reports while replies are ahead. Then the reply runs in a thread of its own
        (`engine_queue.run_reply`) and this generator appends its TokenEvents to `tokens` (and
        StepRecords to `steps`) when it wakes, yielding None when a repaint is due (`every`:
        every so many seconds while tokens come, with no spacing rule), the GenerationStats
        last. An engine error becomes stats with `error` set; a place the line refuses
        (QueueFull), stats with stop_reason REFUSED and the reason as `error`: nothing ran.
        Closed early (a closed tab), the reply is stopped at its next step and the engine goes
        to the next in line when it has."""
        engine = self.slot.engine
        stats, error = None, ""
        queue = EngineQueue.of(engine)
        try:  # fair turns per visitor, with the API's limits
            ticket = queue.join(self.max_waiting, owner=cfg.owner if owner is None else owner,
                                per_owner=self.max_per_owner)
        except QueueFull as full:
            yield GenerationStats.for_config(cfg, stop_reason=REFUSED,
                                             error=refusal(full, queue.expected_wait(1)))
            return
        try:
            yield from ticket.reports(stop)
        except BaseException:
            ticket.leave()
            raise
        if ticket.ahead:  # stopped before its turn came: the engine never ran
            ticket.leave()
            stats = GenerationStats.for_config(cfg, stop_reason="stopped")
        else:
            stats, error = yield from self._stream(ticket, engine, ids, cfg, stop, tokens, steps,
                                                   every)
        if stats is None:
            stats = GenerationStats.for_config(
                cfg, new_tokens=len(tokens), stop_reason="error",
                error=error or "the engine ended without a result")
        if stats.error:
            stats.error = readable_error(stats.error)
        yield stats

    def _stream(self, ticket, engine, ids, cfg, stop, tokens, steps, every: float | None = None
                ) -> Generator[None, None, tuple[GenerationStats | None, str]]:
        """The engine's reply in its own thread while this generator sleeps between repaints;
        yields None when a repaint is due and returns (its stats or None, the error).

        A repaint costs the server the page's render plus gradio's diff and send, and the
        engine shares the cores with it (and with the browser, on one machine). So repaints
        are spaced to keep that cost a tenth of the time at most: the next comes after
        `min_interval`, or after `REPAINT_SPACING` times the last repaint's cost where that is
        longer. With `every` (seconds), the generator wakes that often while tokens come,
        whatever its caller does with them."""
        def produce():
            events = engine.stream(ids, cfg, stop_event=stop)
            try:
                yield from events
            except Exception:  # keep the app alive; the engine's cache may be inconsistent
                engine.reset_cache()
                raise
            finally:
                events.close()  # ends at a step boundary, before the next reply gets the engine

        box = Mailbox()
        run_reply(ticket, produce, box.put, "specchat-page-reply")
        stats, error, finished, wait = None, "", False, every or self.min_interval
        try:
            while not finished:
                fresh = False
                for item in box.take(wait):
                    if isinstance(item, TokenEvent):
                        tokens.append(item)
                        fresh = True
                    elif isinstance(item, StepRecord):
                        if steps is not None:
                            steps.append(item)
                    elif isinstance(item, GenerationStats):
                        stats = item
                    elif isinstance(item, Finished):
                        finished = True
                    elif isinstance(item, Exception):
                        stats, error = None, f"{type(item).__name__}: {item}"
                if fresh and not finished:
                    began = time.perf_counter()
                    yield None  # the caller renders, gradio diffs and sends, then asks again
                    cost = time.perf_counter() - began
                    wait = every or max(self.min_interval, REPAINT_SPACING * cost)
        except GeneratorExit:  # the tab was closed: the reply stops at its next step
            stop.set()
            raise
        return stats, error

    def figure(self, stats: GenerationStats, steps: list[StepRecord],
               baseline: GenerationStats | None = None) -> Speedup:
        """The speedup of a reply that just ended, fixed from then on (shown, and stored with
        the turn): over its race's plain run when it has one, else estimated from its own steps
        against the plain steps timed on this engine in this process (stats/speedup.py). Its
        own plain steps then price later replies' estimates."""
        times = plain_step_times(self.slot.engine)
        result = turn_speedup(stats, baseline, steps, times.recent())
        times.add(steps)
        return result

    def _record(self, session: Session, viewer_owner: str, prompt: str, reply: str,
                stats: GenerationStats, baseline: Future | None = None,
                tokens: list[TokenEvent] = (), steps: list[StepRecord] = (),
                speedup: Speedup | None = None, settings: Settings | None = None,
                replay: bool = False) -> Future | None:
        """Queue the turn for the stats database (never waits on it); the future of its row id.
        The conversation is created with its first saved turn; `speedup` is the figure the
        page showed for it; `settings` what the page asked it with, kept so the conversation
        continues as it was held; `replay`: a run of a race, not a turn of the
        conversation."""
        if not self.store.enabled or viewer_owner == NOBODY or stats.stop_reason == REFUSED or \
                (stats.stop_reason == "error" and not reply):
            return None
        if session.conversation_id is None:
            engine, report = self.slot.engine, self.slot.report
            session.conversation_id = uuid.uuid4().hex
            session.conversation = dict(
                title=prompt[:60], owner=viewer_owner, target=self.slot.redact(engine.target.name),
                draft=self.slot.redact(report.draft.name) if report.draft is not None else "",
                quantization=engine.target.quantization, device=engine.device.type)
        return self.writer.submit(session.conversation_id, prompt, reply, stats.to_json(),
                                  session.conversation, baseline,
                                  [t.to_json() for t in tokens], [r.to_json() for r in steps],
                                  speedup=speedup, settings=stored_settings(settings, replay))

    def _not_ready(self) -> str:
        if self.slot.state == "failed":
            return "⚠ The models failed to load, so the chat cannot answer: " + self.slot.error
        return STILL_LOADING

    def notice_once_ready(self, notice: str | None):
        """The notice line when the page learns the models are ready: a "still loading"
        refusal (a message or an example sent while loading) no longer holds, so it goes;
        any other notice stays."""
        if self.slot.state == "ready" and notice == STILL_LOADING:
            return ""
        return gr.skip()

    # -- chat handlers -------------------------------------------------------------------------

    def user(self, text: str, session: Session, request: gr.Request | None = None,
             settings: Settings | None = None):
        """Echo a message into the chat (instant), or say why not and keep it in the box.
        -> (box, chat, session, notice)"""
        text = text or ""
        refused = built = None
        if not text.strip():
            refused = "Type a message first: an empty message was not sent."
        elif len(text) > self.limits.max_input_chars:
            refused = (f"Your message is {len(text):,} characters; the limit here is "
                       f"{self.limits.max_input_chars:,}. Shorten it and send again "
                       "(it is still in the box).")
        elif self.slot.state != "ready":
            refused = self._not_ready()
        elif self.busy(request):
            refused = ONE_AT_A_TIME
        elif settings is not None:
            try:  # the message's request, built once: its reply runs with it
                built = self.config(settings)
            except InputError as e:
                refused = f"{e} Your message is still in the box."
        if refused:
            return text, render_history(session), session, _notice(refused, request)
        session.pending = clean_text(text)
        session.pending_request = built
        return "", render_history(session), session, ""

    def bot(self, session: Session, settings: Settings, request: gr.Request | None = None,
            browser_id: str | None = None, live: bool = False):
        """Stream the reply to the pending message. Yields (chat, session, notice).

        `live`: the reply's tokens go to the page by its own feed (ui/live.py), whose name the
        turn holds from the echo on (`Turn.feed`), and nothing is yielded while they stream."""
        if session.pending is None or self.slot.engine is None:
            yield render_history(session), session, gr.skip()
            return
        built, session.pending_request = session.pending_request, None
        if built is not None and built[0].speculation and \
                built[0].drafter not in self.slot.engine.drafters:
            built = None  # the models changed since the message was sent: build it anew
        try:  # the request `user` built with the message, else built here once
            cfg, notes = built or self.config(settings)
        except InputError as e:
            yield render_history(session), session, _notice(str(e), request)
            return
        if not self._claim(request):  # `user` refuses first; this guards direct calls
            yield render_history(session), session, _notice(BUSY, request)
            return
        try:
            turn = Turn(session.pending)
            session.pending = None
            session.turns.append(turn)
            turn.notes = list(notes)
            owner = self.access.viewer(request, browser_id).owner
            yield from self._reply(session, turn, cfg, settings, request, owner, live)
        finally:
            self._unclaim(request)

    def _reply(self, session: Session, turn: Turn, cfg: GenerateConfig, settings: Settings,
               request, owner: str, live: bool = False):
        ids, stop = self.prompt_ids(session, len(session.turns) - 1, settings, turn.notes)
        # drafts may copy this visitor's earlier turns, no one else's
        cfg = replace(cfg, owner=owner, stop=stop)
        notice = " ".join(turn.notes)
        stop = self._stop_event(request)
        feed = None
        if live:
            turn.feed, feed = feeds.open_feed(turn.key, turn.tokens, turn.steps, stop)
        drive = self._drive(ids, cfg, stop, turn.tokens, turn.steps,
                            every=feeds.LIVE_S if live else None)
        started = time.perf_counter()
        said = None  # the last place in line shown
        try:
            yield render_history(session, streaming=True), session, notice
            for result in drive:
                if result is None:
                    if not live:
                        yield render_history(session, streaming=True), session, gr.skip()
                elif isinstance(result, Waiting):  # other replies have the engine first
                    message = result.message() or notice
                    # (a report that says nothing new sends nothing: one every quarter second)
                    yield (gr.skip(), session, gr.skip()) if message == said else \
                        (render_history(session, streaming=True), session, message)
                    said = message
                else:
                    turn.stats = result
                    if result.stop_reason == REFUSED:
                        notice = _notice(result.error, request)
            if feed is not None and feed.left.is_set() and turn.stats.stop_reason == "stopped":
                turn.stats = replace(turn.stats, stop_reason="cancelled")  # the page went away
        except GeneratorExit:  # the tab was closed or the reply cancelled: gradio closes us
            drive.close()  # the engine stops at the step boundary it is at, cache consistent
            turn.stats = cut_short(cfg, turn.tokens, time.perf_counter() - started)
            turn.speedup = self.figure(turn.stats, turn.steps)
            turn.saved = self._record(session, owner, turn.user, turn.reply, turn.stats,
                                      None, turn.tokens, turn.steps, turn.speedup, settings)
            raise
        finally:
            self._release(request, stop)
            if feed is not None:
                feeds.close_feed(turn.feed)
        turn.speedup = self.figure(turn.stats, turn.steps)
        turn.saved = self._record(session, owner, turn.user, turn.reply, turn.stats, None,
                                  turn.tokens, turn.steps, turn.speedup, settings)
        yield render_history(session), session, notice

    def generate(self, prompt: str, mode: str = "completion", temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 128, seed: int = 0,
                 speculation: bool = True, drafter: str = "", draft_len: int = 8,
                 min_p: float = 0.0, repeat_penalty: float = 1.0,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 dry_multiplier: float = 0.0,
                 request: gr.Request | None = None) -> Iterator[list[dict]]:
        """The page's public API endpoint (`gradio_client`, "Use via API"): one stateless
        reply to `prompt` (continued as text, or as one chat message with mode="chat"), with
        the page's checks and caps and the samplers' defaults where not given. Yields every
        token so far as {id, text, kind, step}."""
        if self.slot.engine is None:
            raise gr.Error(self._not_ready())
        text = clean_text(prompt)
        if not text.strip() or len(text) > self.limits.max_input_chars:
            raise gr.Error(f"The prompt must be 1 to {self.limits.max_input_chars:,} "
                           "characters.")
        settings = Settings(speculation=speculation, drafter=drafter, draft_len=draft_len,
                            temperature=temperature, top_p=top_p, top_k=top_k,
                            max_new_tokens=max_new_tokens, seed=seed,
                            mode="chat" if mode == "chat" else "completion", min_p=min_p,
                            repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                            presence_penalty=presence_penalty, dry_multiplier=dry_multiplier)
        try:
            cfg, notes = self.config(settings)
        except InputError as e:
            raise gr.Error(str(e)) from None
        session = Session(turns=[Turn(text)])
        ids, stop = self.prompt_ids(session, 0, settings, notes)
        cfg = replace(cfg, stop=stop)
        turn = session.turns[0]
        owner = self.access.viewer(request, None).owner
        for result in self._drive(ids, cfg, threading.Event(), turn.tokens, turn.steps,
                                  owner=owner):
            if isinstance(result, GenerationStats):
                turn.stats = result
                if result.stop_reason == REFUSED:
                    raise gr.Error(result.error)
            yield [{"id": t.id, "text": t.text, "kind": t.kind, "step": t.step}
                   for t in turn.tokens]
        self._record(session, owner, text, turn.reply, turn.stats, None, turn.tokens,
                     turn.steps, self.figure(turn.stats, turn.steps), settings)

    def retry(self, session: Session, request: gr.Request | None = None):
        """Drop the last reply and queue its message again. -> (chat, session, notice)"""
        if self.busy(request):
            return render_history(session), session, BUSY
        if not session.turns:
            return render_history(session), session, "Nothing to retry yet."
        turn = session.turns.pop()
        self._withdraw(turn)
        session.pending = turn.user
        return render_history(session), session, ""

    def undo(self, session: Session, request: gr.Request | None = None):
        """Remove the last exchange; its message goes back into the box.
        -> (box, chat, session, notice)"""
        if self.busy(request):
            return gr.skip(), render_history(session), session, BUSY
        if not session.turns:
            return gr.skip(), render_history(session), session, "Nothing to undo."
        turn = session.turns.pop()
        self._withdraw(turn)
        return turn.user, render_history(session), session, ""

    def _withdraw(self, turn: Turn) -> None:
        """A reply taken back: its stored turn stays in the stats, out of the conversation."""
        if turn.saved is None:
            return
        try:
            turn_id = turn.saved.result(timeout=WITHDRAW_WAIT_S)
        except Exception:  # noqa: BLE001 (not saved, or not yet: nothing to take back)
            return
        if turn_id is not None:
            self.store.withdraw_turn(turn_id)

    def new_conversation(self, session: Session | None = None):
        """-> (box, chat, session, notice, race runs, race results)"""
        fresh = Session()
        return ("", [], fresh, "", *race_placeholders())

    # -- the race ----------------------------------------------------------------------------

    def race(self, session: Session, settings: Settings, request: gr.Request | None = None,
             browser_id: str | None = None):
        """Replay the last prompt with speculation off, then with each drafter the engine has
        (core/race.py: the same seed and settings, no drafting history). Yields (the runs'
        panels, the results, chat, session, notice)."""
        empty = race_placeholders()
        if self.slot.engine is None:
            yield *empty, gr.skip(), session, self._not_ready()
            return
        if not session.turns:
            yield (*empty, gr.skip(), session,
                   "Send a message first: the race replays the last prompt.")
            return
        try:
            cfg, notes = self.config(replace(settings, speculation=True))
        except InputError as e:
            yield *empty, gr.skip(), session, _notice(str(e), request)
            return
        if not cfg.speculation:
            yield (*empty, gr.skip(), session,
                   "No drafter is available, so there is nothing to race.")
            return
        last = len(session.turns) - 1
        prompt = session.turns[last].user
        ids, stop = self.prompt_ids(session, last, settings, notes)
        cfg = replace(cfg, stop=stop)
        if not self._claim(request):
            yield *empty, gr.skip(), session, _notice(BUSY, request)
            return
        stop = self._stop_event(request)
        notice = " ".join(notes)
        owner = self.access.viewer(request, browser_id).owner
        try:
            yield from self._race_runs(session, owner, prompt, ids, cfg, stop, notice, settings)
        finally:
            self._release(request, stop)
            self._unclaim(request)

    def _race_runs(self, session, owner, prompt, ids, cfg, stop, notice, settings=None):
        engine = self.slot.engine
        lanes = race_lanes(engine, cfg)
        runs: dict[str, tuple[list[TokenEvent], list[StepRecord], GenerationStats | None]] = {}

        def panels(live: str | None = None) -> str:
            return race_panels([race_panel(lane.mode, lane.label, tokens, stats,
                                           live == lane.mode, steps)
                                for lane in lanes if lane.mode in runs
                                for tokens, steps, stats in (runs[lane.mode],)])

        plain = None  # the plain run's saved turn: each drafter's run is timed against it
        for lane in lanes:
            tokens: list[TokenEvent] = []
            steps: list[StepRecord] = []
            runs[lane.mode] = (tokens, steps, None)
            # Timed as the bench times a reply: no repaint while it runs, a progress line only
            drive = self._drive(ids, lane.cfg, stop, tokens, steps, owner=owner,
                                every=PROGRESS_S)
            started = time.perf_counter()
            lane_settings = None if settings is None else replace(
                settings, speculation=lane.cfg.speculation,
                drafter=lane.cfg.drafter if lane.cfg.speculation else settings.drafter)
            try:
                yield (panels(lane.mode), _race_progress(lane, tokens, lanes), gr.skip(),
                       session, gr.skip())
                for result in drive:
                    if result is None:
                        yield (gr.skip(), _race_progress(lane, tokens, lanes), gr.skip(),
                               session, gr.skip())
                    elif isinstance(result, Waiting):  # other replies have the engine first
                        yield (gr.skip(), '<div class="sc-verdict">' + html.escape(
                            result.message() or f"Racing: {lane.label}…") + "</div>",
                            gr.skip(), session, gr.skip())
                    else:
                        runs[lane.mode] = (tokens, steps, result)
            except GeneratorExit:  # closed tab or cancel: keep what ran, marked interrupted
                drive.close()
                stats = cut_short(lane.cfg, tokens, time.perf_counter() - started)
                self._record(session, owner, prompt, "".join(t.text for t in tokens), stats,
                             plain if lane.cfg.speculation else None, tokens, steps,
                             self.figure(stats, steps), lane_settings, replay=True)
                raise
            stats = runs[lane.mode][2]
            reply = "".join(t.text for t in tokens)
            if lane.mode == PLAIN:
                plain = self._record(session, owner, prompt, reply, stats, None, tokens, steps,
                                     self.figure(stats, steps), lane_settings, replay=True)
            else:  # timed against the plain run of the same prompt and settings
                self._record(session, owner, prompt, reply, stats, plain, tokens, steps,
                             self.figure(stats, steps, runs[PLAIN][2]), lane_settings,
                             replay=True)
            if stats.stop_reason == REFUSED:
                notice = stats.error
            if stop.is_set() or stats.stop_reason in ("error", REFUSED):
                break
        entries = [RaceEntry(lane.mode, runs[lane.mode][2], runs[lane.mode][1],
                             [(t.id, t.text) for t in runs[lane.mode][0]])
                   for lane in lanes if lane.mode in runs and runs[lane.mode][2] is not None]
        verdict = race_verdict(lanes, entries, cfg, engine.target.quantization, engine.row_exact)
        # The chat is unchanged: its replies keep the figures they were shown with.
        yield panels(), verdict, gr.skip(), session, notice


WITHDRAW_WAIT_S = 2.0  # how long Retry/Undo waits for the reply it takes back to be saved
REFUSED = "refused"  # the stop reason of a reply the engine's line had no place for


def stored_settings(settings: Settings | None, replay: bool = False) -> dict | None:
    """What the store keeps of a turn's settings (None: none given); `replay` marks a run
    of a race, which a reopened conversation leaves out of its turns."""
    if settings is None:
        return None
    return {**asdict(settings), **({"replay": True} if replay else {})}


def _race_progress(lane, tokens: list[TokenEvent], lanes) -> str:
    at = next(i for i, other in enumerate(lanes) if other.mode == lane.mode) + 1
    return (f'<div class="sc-verdict">Racing {at} of {len(lanes)}, {html.escape(lane.label)}: '
            f"{len(tokens)} tokens… (timed as the bench times it: the page shows each run "
            "once it has ended)</div>")


def refusal(full: QueueFull, expected: float | None) -> str:
    """What a visitor whose reply the line refused is told (the reply was not sent)."""
    if full.mine:
        return (f"Not sent: {full.waiting} replies of yours are waiting for the model already "
                "(in other tabs, or through the API), the most one visitor may have. Send it "
                "again (↻ Retry) when one of them is done.")
    about = f" (about {max(1, round(expected))} s each)" if expected else ""
    return (f"Not sent: the model is busy, {full.waiting} replies are waiting already, one of "
            f"them yours{about}. Send it again (↻ Retry) when yours is done.")


def cut_short(cfg: GenerateConfig, tokens: list[TokenEvent], seconds: float) -> GenerationStats:
    """Stats for a reply whose page went away mid-stream (the engine's own summary never
    came): what was emitted, marked "cancelled", an interrupted turn like a stopped one."""
    return GenerationStats.for_config(cfg, new_tokens=len(tokens), seconds=seconds,
                                      stop_reason="cancelled")


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


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, None when the sequences are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def race_verdict(lanes, entries: list[RaceEntry], cfg: GenerateConfig, quantization: str,
                 row_exact: bool = False) -> str:
    """The race's results: a row per run (tok/s, its speedup over the plain run with the
    bootstrap band, acceptance, tokens a step, first token, whether its text is plain
    decoding's), the winner where its band clears every other's (stats/race.py), and why a
    text differs where one does."""
    if not entries or entries[0].mode != PLAIN:
        return '<div class="sc-verdict">The race stopped before its plain run finished.</div>'
    rows = standings(entries)
    labels = {lane.mode: lane.label for lane in lanes}
    best = race_winner(rows) if len(entries) == len(lanes) else None
    head = ("run", "tok/s", "speedup (band)", "acceptance", "tokens a step", "first token",
            "text")
    cells = list(head)
    for row in rows:
        if row.speedup is None:
            speedup = "1× (baseline)" if row.mode == PLAIN else "–"
        else:
            band = f" ({row.band[0]:.2f}–{row.band[1]:.2f})" if row.band else ""
            speedup = f"{fmt_speedup(row.speedup, '×')}{band}"
        if row.mode == PLAIN:
            same = "plain decoding"
        elif row.same_as_plain is None:
            same = "not compared" if row.stop_reason in ("stopped", "cancelled") else "–"
        else:
            same = "✓ identical" if row.same_as_plain else "≠ differs"
        cells += [labels.get(row.mode, row.mode) + (" ★" if row.mode == best else ""),
                  f"{row.tokens_per_s:.1f}", speedup,
                  "–" if row.acceptance is None else f"{row.acceptance:.0%}",
                  "–" if row.tokens_per_step is None else f"{row.tokens_per_step:.2f}",
                  f"{row.ttft_s:.2f} s", same]
    width = len(head)
    # A grid of divs, not a <table>: the theme's table styles fight ours. A row per run, its
    # cells named by their column (data-col), so a phone shows each run as a card of
    # labelled figures instead of seven squeezed columns.
    table = "".join(
        f'<div class="sc-race-row{" sc-h" if r == 0 else ""}'
        f'{" sc-win" if r and rows[r - 1].mode == best else ""}">' + "".join(
            f'<span data-col="{html.escape(head[j])}">{html.escape(c)}</span>'
            for j, c in enumerate(cells[r * width:(r + 1) * width])) + "</div>"
        for r in range(len(cells) // width))
    if len(entries) < len(lanes):
        headline = "Race stopped before every run finished: no winner is named."
    elif best == PLAIN:
        headline = ("Fastest: speculation off. Every drafter's band is below 1× on this "
                    "prompt: here drafting costs more than it saves.")
    elif best:
        row = next(r for r in rows if r.mode == best)
        headline = (f"Fastest: {labels.get(best, best)}, {row.speedup:.2f}× plain decoding; "
                    "its band clears every other run's.")
    else:
        headline = ("No run is measurably ahead of the rest: the leaders' bands overlap (a "
                    "bootstrap over each run's steps against the plain run's).")
    notes = []
    plain_tokens = list(entries[0].tokens)
    for entry, row in zip(entries, rows):
        if row.same_as_plain is False:
            diff = first_difference(plain_tokens, list(entry.tokens))
            piece = (lambda tokens: html.escape(repr(tokens[diff][1]))
                     if diff < len(tokens) else "(end)")
            notes.append(f'<div class="sc-note"><span class="sc-diff">≠ '
                         f"{html.escape(labels.get(entry.mode, entry.mode))}</span> differs "
                         f"from token {diff} (plain: {piece(plain_tokens)}, this run: "
                         f"{piece(list(entry.tokens))}). "
                         f"{why_texts_differ(entry.stats.drafter, cfg, quantization, row_exact)}"
                         "</div>")
    return (f'<div class="sc-verdict"><b>{html.escape(headline)}</b>'
            f'<div class="sc-race-grid">{table}</div>{"".join(notes)}'
            '<div class="sc-note">Every run replays the same prompt, seed and settings, drafts '
            "from the prompt alone (no history of earlier replies, as the bench runs), and is "
            "timed alike, the page repainting none while it runs. Each speedup is over the "
            "plain run; its band is how far chance could move it.</div></div>")


def why_texts_differ(drafter: str, cfg: GenerateConfig, quantization: str,
                     row_exact: bool = False) -> str:
    """Why a speculative run's text can differ from plain decoding's of the same request."""
    # Every drafter but a draft model replays plain sampling per seed: n-gram lookup and
    # trees are one-hot, the head races with the target's own keyed numbers
    # (sampling.Noise). A draft model's drafts take Leviathan's test, its own way.
    if quantization == "served":
        return ("Both runs were decoded by the server; it does not say why they differ (its "
                "verify passes may round differently from its plain steps).")
    if cfg.temperature > 0 and drafter == "model":
        return ("At temperature > 0 both runs sample from the same distribution, but a draft "
                "model's drafts pass Leviathan's test with random numbers of their own: the "
                "texts may differ while being equally likely (lossless in distribution, not "
                "per seed; the other drafters replay plain sampling per seed).")
    if quantization == "none" or row_exact:
        how = ("row-exact attention: a verify pass computes the same logits as one-token "
               "passes, bit for bit" if row_exact else "unquantized weights")
        what = "every emitted token being plain sampling's draw at its position" \
            if cfg.temperature > 0 else "greedy decoding"
        return (f"With {how}, and {what}, the texts should match: this divergence is "
                "unexpected (a bug worth reporting).")
    return (f"Decoding on a {html.escape(quantization)} target on this device: a verify "
            "pass over several tokens rounds slightly differently from one-token passes, "
            "so a near-tie can flip. Both texts are faithful samples of the model (on "
            "CPU, specchat's row-exact attention makes them match).")


def warm_up(engine: Engine) -> None:
    """A 6-token plain generation right after loading: the first forward passes pay one-time
    costs (seconds on a CPU) that would otherwise land on the first reply and make it look
    slow. Plain decoding only, so no drafter's timing policy sees it. Its one-token steps after
    the first are the process's first plain step timings, which price the estimated speedup of
    replies that have too few plain steps of their own (stats/speedup.py)."""
    ids, stops = engine.chat_prompt([{"role": "user", "content": "Hello"}])
    steps = [event for event in engine.stream(
        ids, request(max_new_tokens=6, stop=tuple(stops)))
        if isinstance(event, StepRecord)]
    plain_step_times(engine).add(steps[1:])
