"""The page's layout and event wiring, its theme and launch options."""

from __future__ import annotations

import html
from dataclasses import asdict, dataclass, replace

import gradio as gr
from starlette.middleware import Middleware

from specchat.core.engine import Engine
from specchat.core.settings import MAX_DRAFT_LEN, MAX_TEMPERATURE, SETTINGS
from specchat.drafters import LABELS as DRAFTER_LABELS
from specchat.loader import LoadReport
from specchat.stats.store import StatsStore
from specchat.ui import live, models_panel, sidebar, stats_tab
from specchat.ui.access import Access, new_browser_id
from specchat.ui.examples import (
    EXAMPLES,
    SAMPLER_CHOICES,
    SAMPLER_FIELDS,
    SAMPLER_PRESETS,
    sampler_preset,
)
from specchat.ui.handlers import ChatApp
from specchat.ui.head import FRAMES_SCRIPT, HeadScript
from specchat.ui.render import ASSETS, asset, header_html, race_placeholders, status_html
from specchat.ui.state import Limits, ModelSlot, Session, Settings

# ---------------------------------------------------------------------------------------------
# Layout: what the page shows. Wiring: what each control does.

def build_ui(source: Engine | LoadReport | ModelSlot, store: StatsStore | None = None,
             limits: Limits | None = None, access: Access | None = None,
             min_interval: float = 0.05, defaults: Settings | None = None) -> gr.Blocks:
    """The page. `source`: a ready Engine/LoadReport, or a ModelSlot still loading; `access`
    says who owns which conversations (default: one local user who sees all); `defaults`:
    the controls' first values (default: `page_defaults`, which follow the model's kind).
    Pass the result to `launch` (which adds the CSS and theme)."""
    return page(ChatApp(source, store, limits, access, min_interval), defaults)


@dataclass
class View:
    """The page's components that events read or write."""
    session: gr.State
    browser: gr.BrowserState
    header: gr.HTML
    status: gr.HTML
    chat: gr.Chatbot
    live: gr.Textbox  # a streaming reply's token records (ui/live.py)
    box: gr.Textbox
    send: gr.Button
    stop: gr.Button
    notice: gr.Markdown
    examples: gr.Dataset
    samplers: gr.Radio  # the switch between the examples' samplers and none
    retry: gr.Button
    undo: gr.Button
    new: gr.Button
    race: gr.Button
    race_runs: gr.HTML
    verdict: gr.HTML
    ghosts: gr.Checkbox
    timer: gr.Timer
    controls: dict[str, gr.components.Component]  # Settings field -> its control

    @property
    def new_outputs(self) -> list:
        return [self.box, self.chat, self.session, self.notice, self.race_runs, self.verdict]


def page(self: ChatApp, defaults: Settings | None = None) -> gr.Blocks:
    """The chat page, wired to `self`'s handlers."""
    d = page_defaults(self.slot, defaults)
    # delete_cache: gradio's copies of served files (CSV exports) go after an hour.
    with gr.Blocks(title="specchat · speculative decoding you can see",
                   delete_cache=(600, 3600)) as demo:
        session = gr.State(Session())
        # The visitor's browser id (`access`): kept in the browser across reloads.
        browser = gr.BrowserState(None, storage_key="specchat-browser-id")
        with gr.Row(equal_height=False, elem_id="sc-top"):
            header = gr.HTML(header_html(self.slot), elem_id="sc-header", scale=4, min_width=300)
            status = gr.HTML(status_html(self.slot), elem_id="sc-status", scale=1,
                             min_width=160)
        with gr.Sidebar(label="Conversations", open=True, elem_id="sc-sidebar", width=250):
            bar = sidebar.layout()
        with gr.Tabs() as tabs:
            with gr.Tab("Chat", id="chat"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=3, min_width=320):
                        parts = _chat_column(self)
                    with gr.Column(scale=1, min_width=260, elem_id="sc-settings"):
                        ghosts, samplers, controls = _settings_column(self, d)
            with gr.Tab("Stats", id="stats") as tab:
                stats = stats_tab.build_stats_tab(self.store, self.access, browser, demo,
                                                  self.writer, self.slot.redact, self.forget)
                stats.refresh_on(tab.select)
            models = models_panel.layout(self)  # the local owner's alone (None elsewhere)
        timer = gr.Timer(1.0, active=self.slot.state not in ("ready", "failed"))
        view = View(session, browser, header, status, samplers=samplers, ghosts=ghosts,
                    timer=timer, controls=controls, **parts)
        finished = _wire(self, demo, view, d, follow_model=defaults is None)
        sidebar.wire(self, bar, view, tabs, samplers, finished)
        models_panel.wire(demo, models, timer)
        demo.load(None, None, None, js=sidebar.CLOSE_ON_PHONE)
    return demo


def _chat_column(self: ChatApp) -> dict:
    """The legend, the chat, the message box, the examples, the turn buttons and the race's
    results and runs right under its button."""
    ready = self.slot.state == "ready"
    gr.HTML(asset("legend.html"))
    # Empty, the chat is short: a laptop's first screen holds the message box and the examples.
    # With messages it takes most of the window (specchat.css, `#sc-chat:has(.message-row)`).
    chat = gr.Chatbot(
        label="Chat", show_label=False, elem_id="sc-chat", height="max(260px, 100vh - 540px)",
        render_markdown=False, sanitize_html=True, latex_delimiters=[], feedback_options=None,
        autoscroll=True, buttons=[],
        placeholder="Ask something, or try an example below. Replies stream in as the target "
                    "verifies each batch of draft tokens.")
    with gr.Row(equal_height=True, elem_id="sc-input-row"):
        box = gr.Textbox(show_label=False, placeholder="Message (Enter to send, Shift+Enter "
                         "for a new line)", lines=1, max_lines=10, scale=6, min_width=240,
                         autofocus=True, elem_id="sc-input", interactive=ready)
        with gr.Column(elem_id="sc-send-col", scale=1, min_width=150):
            with gr.Row():
                send = gr.Button("Send", variant="primary", elem_id="sc-send",
                                 interactive=ready, min_width=70)
                stop = gr.Button("Stop", variant="stop", elem_id="sc-stop", min_width=70)
    # the name of a streaming reply's feed, for the page's script (ui/live.py); never shown
    live_feed = gr.Textbox("", elem_id="sc-live", show_label=False, container=False,
                           interactive=False, lines=1)
    notice = gr.Markdown("", elem_id="sc-notice", elem_classes="sc-notice")
    examples = gr.Dataset(
        components=[gr.Textbox(visible=False)], samples=[[e.text] for e in EXAMPLES],
        label="Try an example (each starts a new conversation)", elem_id="sc-examples",
        samples_per_page=len(EXAMPLES), type="index", layout="gallery")
    with gr.Row(elem_id="sc-turn-buttons"):
        retry = gr.Button("↻ Retry", size="sm", elem_id="sc-retry", min_width=80)
        undo = gr.Button("↶ Undo", size="sm", elem_id="sc-undo", min_width=80)
        new = gr.Button("✚ New conversation", size="sm", elem_id="sc-new", min_width=80)
        race = gr.Button("⚑ Race drafters", size="sm", variant="secondary", elem_id="sc-race",
                       interactive=ready, min_width=80)
    with gr.Group():  # (no elem_id: gradio writes a Group's id on two nested elements)
        runs_empty, verdict_empty = race_placeholders()
        verdict = gr.HTML(verdict_empty, elem_id="sc-race-verdict")
        race_runs = gr.HTML(runs_empty, elem_id="sc-race-runs")
    return dict(chat=chat, live=live_feed, box=box, send=send, stop=stop, notice=notice,
                examples=examples,
                retry=retry, undo=undo, new=new, race=race,
                race_runs=race_runs, verdict=verdict)


def _settings_column(self: ChatApp, d: Settings) -> tuple[gr.Checkbox, gr.Radio, dict]:
    """Mode, the samplers switch, speculation, sampling and the penalties: -> (the ghosts
    toggle, the samplers switch, Settings field -> control)."""
    c = {}
    c["mode"] = gr.Radio([("Chat", "chat"), ("Completion", "completion")],
                         value=default_mode(self.slot, d), label="Mode",
                         info=MODE_HELP[default_mode(self.slot, d)], elem_id="sc-mode")
    samplers = gr.Radio(SAMPLER_CHOICES, value=sampler_preset(asdict(d)),
                        label="Samplers against loops", info=SAMPLERS_HELP,
                        elem_id="sc-samplers")
    ghosts = gr.Checkbox(value=True, label="Show refused drafts", elem_id="sc-ghosts")
    with gr.Accordion("Speculation", open=True, elem_id="sc-spec-settings"):
        c["speculation"] = gr.Checkbox(value=d.speculation, label="Speculative decoding",
                                       elem_id="sc-speculation")
        choices = self.drafters() or ["ngram"]
        c["drafter"] = gr.Radio([(DRAFTER_LABELS.get(x, x), x) for x in choices],
                                value=d.drafter if d.drafter in choices else choices[0],
                                label="Drafter", elem_id="sc-drafter")
        c["draft_len"] = gr.Slider(1, MAX_DRAFT_LEN, value=d.draft_len, step=1,
                                   label="Draft length k (most drafts per step)")
        c["adaptive"] = gr.Checkbox(value=d.adaptive,
                                    label="Adapt k to measured acceptance and cost")
    with gr.Accordion("Sampling", open=True, elem_id="sc-sampling"):
        c["temperature"] = gr.Slider(0, MAX_TEMPERATURE, value=d.temperature, step=0.05,
                                     label="Temperature (0 = greedy)")
        c["top_p"] = gr.Slider(0.05, 1, value=d.top_p, step=0.05, label="Top-p")
        c["top_k"] = gr.Slider(0, 200, value=d.top_k, step=1, label="Top-k (0 = off)")
        c["min_p"] = _slider("min_p", d, 0, 0.5, 0.01)
        cap = self.limits.max_new_tokens_cap
        c["max_new_tokens"] = gr.Slider(1, cap, value=min(d.max_new_tokens, cap), step=1,
                                        label=f"Max new tokens (cap {cap})",
                                        elem_id="sc-max-new")
        c["seed"] = gr.Number(value=d.seed, precision=0, label="Seed (-1 = random each reply)")
    with gr.Accordion("Penalties (stop loops; lossless)", open=False, elem_id="sc-penalties"):
        c["repeat_penalty"] = _slider("repeat_penalty", d, 1, 2, 0.05)
        c["repeat_last_n"] = _slider("repeat_last_n", d, 0, 512, 1)
        c["frequency_penalty"] = _slider("frequency_penalty", d, -2, 2, 0.05)
        c["presence_penalty"] = _slider("presence_penalty", d, -2, 2, 0.05)
        c["dry_multiplier"] = _slider("dry_multiplier", d, 0, 2, 0.05)
        c["dry_base"] = _slider("dry_base", d, 1, 3, 0.05)
        c["dry_allowed_length"] = _slider("dry_allowed_length", d, 1, 8, 1)
    c["system"] = gr.Textbox(value=d.system, label="System prompt", lines=3,
                             placeholder="Optional instructions for the model")
    return ghosts, samplers, c


def _slider(name: str, d: Settings, low: float, high: float, step: float) -> gr.Slider:
    """A slider for one of `core.settings`' rows: its label and help come from the table."""
    row = SETTINGS[name]
    return gr.Slider(low, high, value=getattr(d, name), step=step, label=row.label,
                     info=row.help)


def _wire(self: ChatApp, demo: gr.Blocks, v: View, d: Settings, follow_model: bool) -> list:
    """The chat's events: send, examples, turn buttons, the race, stop, the samplers switch; then
    the page's own (`follow_model`: the sampler controls take the loaded model's defaults).
    -> the events after which the conversations' list changes (a reply saved, a new
    conversation, the browser's id known)."""
    settings_in = {v.session, v.browser, *v.controls.values()}

    def settings_of(data: dict) -> Settings:
        return Settings(**{name: data[c] for name, c in v.controls.items()})

    # A set of inputs arrives as one dict; gradio injects `request` into a named, annotated
    # positional parameter.
    def on_bot(data: dict, request: gr.Request):
        # The chat is drawn whole at the echo (and while the reply waits its turn) and at the
        # end; in between, the reply's tokens reach the page's script by the reply's own feed
        # (ui/live.py), whose name goes to the page with the echo.
        announced = ""
        for chat, session, notice in self.bot(data[v.session], settings_of(data), request,
                                              data[v.browser], live=True):
            turn = session.turns[-1] if session.turns else None
            if turn is not None and turn.feed and turn.feed != announced:
                announced = turn.feed
                yield chat, session, notice, live.announce(turn.key, turn.feed)
                continue
            yield chat, session, notice, gr.skip()

    def on_race(data: dict, request: gr.Request):
        yield from self.race(data[v.session], settings_of(data), request, data[v.browser])

    def on_user(data: dict, request: gr.Request):
        return self.user(data[v.box], data[v.session], request, settings_of(data))

    def on_stop(request: gr.Request):
        return self.stop(request) or gr.skip()

    def on_retry(session: Session, request: gr.Request):
        return self.retry(session, request)

    def on_undo(session: Session, request: gr.Request):
        return self.undo(session, request)

    def on_example(index: int, current: Session):
        """An example starts a conversation of its own (one example's turns never become
        another's context), with the example's text and every setting it names (the others
        back to their defaults)."""
        example = EXAMPLES[index]
        fresh = dict(zip(v.new_outputs, self.new_conversation(current)))
        fresh[v.box] = example.text
        values = {**asdict(d), **example.settings}
        return {**fresh, v.samplers: sampler_preset(values),
                **{c: values[name] for name, c in v.controls.items()
                   if name not in ("system", "speculation", "drafter")}}

    sampler_controls = [v.controls[name] for name in SAMPLER_FIELDS]

    def on_samplers(choice: str):
        """The switch, set by the visitor: the controls take the chosen values ("custom"
        leaves them as they are)."""
        preset = SAMPLER_PRESETS.get(choice)
        return [gr.skip() if preset is None else preset[name] for name in SAMPLER_FIELDS]

    def on_sampler_edit(*values):
        """A sampler control moved by the visitor: the switch says what they now hold."""
        return sampler_preset(dict(zip(SAMPLER_FIELDS, values)))

    private = dict(api_visibility="private")
    # Replies wait for the engine in its fair line (engine_queue.py), not in gradio's queue:
    # the lane lets ENGINE_LANE of them through at once (one per tab at most, each owner's
    # bounded by the line's limits), so gradio's first-come order applies only past that.
    engine_lane = dict(concurrency_id="engine", concurrency_limit=ENGINE_LANE, **private)
    instant = dict(concurrency_limit=None, show_progress="hidden", **private)
    chat_out = [v.chat, v.session, v.notice]
    user_out = [v.box, v.chat, v.session, v.notice]
    bot = dict(fn=on_bot, inputs=settings_in, outputs=[*chat_out, v.live],
               show_progress="hidden", **engine_lane)
    v.live.change(None, v.live, None, js=live.LIVE_JS)

    finished = [v.examples.click(on_example, [v.examples, v.session],
                                 [*v.new_outputs, v.samplers, *v.controls.values()],
                                 **instant).then(
        on_user, {v.box, *settings_in}, user_out, **instant).then(**bot)]
    v.ghosts.change(None, v.ghosts, None,
                    js="(show) => { document.body.classList.toggle('sc-hide-ghosts', !show); }")
    v.controls["mode"].change(lambda m: gr.Radio(info=MODE_HELP[m]), v.controls["mode"],
                              v.controls["mode"], **instant)
    # `input`, not `change`: only what the visitor does, so the two never set each other off.
    v.samplers.input(on_samplers, v.samplers, sampler_controls, **instant)
    gr.on([c.input for c in sampler_controls], on_sampler_edit, sampler_controls, v.samplers,
          **instant)
    for trigger in (v.box.submit, v.send.click):
        finished.append(trigger(on_user, {v.box, *settings_in}, user_out, **instant).then(**bot))
    finished.append(v.retry.click(on_retry, v.session, chat_out, **instant).then(**bot))
    finished.append(v.undo.click(on_undo, v.session, user_out, **instant))
    finished.append(v.new.click(self.new_conversation, v.session, v.new_outputs, **instant))
    finished.append(v.chat.clear(self.new_conversation, v.session, v.new_outputs, **instant))
    # Once the race is done, its results (under its button, often below the fold) are
    # scrolled into view; the page does not move when it is in view already.
    v.race.click(on_race, settings_in, [v.race_runs, v.verdict, v.chat, v.session, v.notice],
                 show_progress="minimal", **engine_lane).then(
        None, None, None, js=SHOW_VERDICT)
    v.stop.click(on_stop, None, v.notice, queue=False, **private)
    # The one public endpoint: a stateless reply for gradio_client and "Use via API".
    gr.api(self.generate, api_name="generate", concurrency_id="engine",
           concurrency_limit=ENGINE_LANE)
    finished.append(_wire_page(self, demo, v, d, instant, follow_model))
    return finished


def _wire_page(self: ChatApp, demo: gr.Blocks, v: View, d: Settings, instant: dict,
               follow_model: bool):
    """The page's own events: its first load, the loading timer, the browser id (-> the
    event that sets it)."""
    slot = self.slot
    sampler_controls = [v.controls[name] for name in SAMPLER_FIELDS]

    def on_page(notice: str | None, request: gr.Request):
        now_ready = slot.state == "ready"
        choices = self.drafters() or ["ngram"]
        # A failed load is also said in the chat itself, where the user looks.
        failed = [{"role": "assistant", "content": '<div class="sc-error">⚠ The models '
                   f"failed to load: {html.escape(slot.redact(slot.error))}</div>"}]
        mode = default_mode(slot, d)
        out = {v.header: header_html(slot), v.status: status_html(slot),
               v.chat: failed if slot.state == "failed" else gr.skip(),
               v.controls["drafter"]: gr.Radio(
                   choices=[(DRAFTER_LABELS.get(x, x), x) for x in choices],
                   value=d.drafter if d.drafter in choices else choices[0]),
               v.box: gr.Textbox(interactive=now_ready),
               v.send: gr.Button(interactive=now_ready), v.race: gr.Button(interactive=now_ready),
               v.timer: gr.Timer(active=slot.state == "loading"),
               v.controls["mode"]: gr.Radio(value=mode, info=MODE_HELP[mode]),
               v.notice: self.notice_once_ready(notice)}
        # Once the model is known, the sampler controls start where its kind starts.
        preset = default_samplers(slot)
        for name, control in zip(SAMPLER_FIELDS, sampler_controls):
            out[control] = SAMPLER_PRESETS[preset][name] if follow_model and now_ready \
                else gr.skip()
        out[v.samplers] = preset if follow_model and now_ready else gr.skip()
        return out

    def on_browser(browser_id):
        """Give a browser its id on its first visit; keep the one it has."""
        return browser_id if self.access.valid_browser_id(browser_id) else new_browser_id()

    page_out = [v.header, v.status, v.chat, v.controls["drafter"], v.box, v.send, v.race,
                v.timer, v.controls["mode"], v.notice, v.samplers, *sampler_controls]
    v.timer.tick(on_page, v.notice, page_out, **instant)
    demo.load(on_page, v.notice, page_out, **instant)
    return demo.load(on_browser, v.browser, v.browser, **instant)


# How many page replies (and `generate` calls) gradio lets through to the engine's line at
# once. There each owner holds at most MAX_PER_OWNER waiting places, and a place the line
# refuses, or a tab's second reply, ends at once: 16 hold the engine and the places of many
# visitors. Past 16, replies wait in gradio's queue in the order they came.
ENGINE_LANE = 16


SHOW_VERDICT = ("() => { document.getElementById('sc-race-verdict')"
                "?.scrollIntoView({block: 'nearest'}); }")


MODE_HELP = {
    "chat": "Chat: your turns in the model's chat format (a base model gets a short example "
            "conversation to continue).",
    "completion": "Completion: the model continues your text as is (what a base model is "
                  "good at); no history.",
}


SAMPLERS_HELP = ("Lossless with speculation. A small base model loops without them, so the "
                 "page starts one at the examples' samplers; None turns them all off.")


def default_samplers(slot: ModelSlot) -> str:
    """The samplers a page starts with: the examples' ("examples") for a base model (no chat
    template; the embedded default is one, and counts as one while the models load), none
    ("none") for a chat-tuned model."""
    engine = slot.engine
    return "none" if engine is not None and engine.chats else "examples"


def page_defaults(slot: ModelSlot, defaults: Settings | None = None) -> Settings:
    """The controls' first values: `defaults` as given, else the settings table's defaults
    with the samplers of the model's kind (`default_samplers`)."""
    if defaults is not None:
        return defaults
    return replace(Settings(), **SAMPLER_PRESETS[default_samplers(slot)])


def default_mode(slot: ModelSlot, d: Settings) -> str:
    """Completion for a base model (no chat template), else the default settings' mode."""
    engine = slot.engine
    if engine is not None and not engine.chats:
        return "completion"
    return d.mode


def theme() -> gr.themes.Base:
    # Local font stacks only: the page must not wait on a font CDN when offline.
    return gr.themes.Soft(primary_hue="emerald", secondary_hue="blue", neutral_hue="slate",
                          font=["ui-sans-serif", "system-ui", "-apple-system", "Segoe UI",
                                "Roboto", "sans-serif"],
                          font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas",
                                     "monospace"]).set(
        block_title_background_fill="transparent", block_title_text_color="*neutral_700",
        block_title_text_color_dark="*neutral_200", block_label_background_fill="transparent",
        block_label_text_color="*neutral_500", block_title_padding="0",
        **CONTRAST)


# Every text on its fill at 4.5:1 or more in both themes (WCAG AA; tests/test_a11y.py runs
# axe-core on the page): Soft's emerald-500 fills under white text (2.5:1) become
# emerald-700 (5.5:1), its neutral-400 help texts and placeholders neutral-600/-500 (7.6 and
# 4.8:1 on white); in dark, the fills under white text stay dark enough for it.
CONTRAST = dict(
    button_primary_background_fill="*primary_700",
    button_primary_background_fill_dark="*primary_700",
    button_primary_background_fill_hover="*primary_800",
    button_primary_background_fill_hover_dark="*primary_800",
    button_secondary_background_fill_hover_dark="*neutral_500",
    checkbox_label_background_fill_selected="*primary_700",
    checkbox_label_background_fill_selected_dark="*primary_700",
    checkbox_label_text_color_selected_dark="white",
    body_text_color_subdued="*neutral_600",
    input_placeholder_color="*neutral_500",
    input_placeholder_color_dark="#b1bac4",  # (the page's muted gray, specchat.css)
    block_label_background_fill_dark="transparent",
    block_title_background_fill_dark="transparent",
)


# Page sessions whose state the server keeps, the least recently used dropped first. gradio keeps
# a closed tab's state an hour for a reconnect, and a session's copy of the page's config with
# it, some hundreds of KB a tab: at gradio's default of 10,000 a shared demo's memory would grow
# by gigabytes with its visitors. A dropped session's conversations stay in the stats store.
PAGE_SESSIONS = 256


def launch_kwargs() -> dict:
    """What `demo.launch` needs besides host/port/share/auth (gradio 6: theme/css live here)."""
    return dict(css=asset("specchat.css") + asset("markdown.css") + stats_tab.READ_ONLY_CSS,
                theme=theme(),
                favicon_path=str(ASSETS / "logo.svg"),
                footer_links=["gradio", "settings"],
                head=f"<script>{asset('inspector.js')}</script>"
                     f"<script>{asset('tooltips.js')}</script>"
                     f"<script>{asset('a11y.js')}</script>"
                     f"<script>{asset('markdown.js')}</script>")


def launch(demo: gr.Blocks, **kwargs):
    """demo.queue(...).launch(...) with specchat's CSS and theme, `head.FRAMES_SCRIPT` in every
    page and the streaming replies' feeds (ui/live.py); kwargs go to launch() (their
    `app_kwargs` middleware after the script's, their routes after the feeds')."""
    demo.queue(default_concurrency_limit=1, max_size=64)
    app_kwargs = dict(kwargs.pop("app_kwargs", None) or {})
    app_kwargs["middleware"] = [Middleware(HeadScript, script=FRAMES_SCRIPT),
                                *app_kwargs.get("middleware", [])]
    app_kwargs["routes"] = [*live.routes(), *app_kwargs.get("routes", [])]
    kwargs.setdefault("state_session_capacity", PAGE_SESSIONS)
    return demo.launch(**launch_kwargs(), app_kwargs=app_kwargs, **kwargs)
