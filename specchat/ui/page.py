"""The page's layout and event wiring, its theme and launch options."""

from __future__ import annotations

import html

import gradio as gr

from specchat.core.engine import Engine
from specchat.core.settings import MAX_DRAFT_LEN
from specchat.drafters import LABELS as DRAFTER_LABELS
from specchat.loader import LoadReport
from specchat.stats.store import StatsStore
from specchat.ui import stats_tab
from specchat.ui.access import Access, new_browser_id
from specchat.ui.handlers import ChatApp
from specchat.ui.render import ASSETS, ab_placeholders, asset, header_html, status_html
from specchat.ui.state import Limits, ModelSlot, Session, Settings

# ---------------------------------------------------------------------------------------------
# Gradio wiring

def build_ui(source: Engine | LoadReport | ModelSlot, store: StatsStore | None = None,
             limits: Limits | None = None, access: Access | None = None,
             min_interval: float = 0.05, defaults: Settings | None = None) -> gr.Blocks:
    """The page. `source`: a ready Engine/LoadReport, or a ModelSlot still loading; `access`
    says who owns which conversations (default: one local user who sees all).
    Pass the result to `launch` (which adds the CSS and theme)."""
    return page(ChatApp(source, store, limits, access, min_interval), defaults)


def page(self: ChatApp, defaults: Settings | None = None) -> gr.Blocks:
    """The chat page, wired to `self`'s handlers."""
    d = defaults or Settings()
    limits, slot = self.limits, self.slot
    ready = slot.state == "ready"
    # delete_cache: gradio's copies of served files (CSV exports) go after an hour.
    with gr.Blocks(title="specchat · speculative decoding you can see",
                   delete_cache=(600, 3600)) as demo:
        session = gr.State(Session())
        # The visitor's browser id (`access`): kept in the browser across reloads.
        browser = gr.BrowserState(None, storage_key="specchat-browser-id")
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
                        examples = gr.Dataset(
                            components=[gr.Textbox(visible=False), gr.Textbox(visible=False)],
                            samples=[[text, label] for text, label, _ in EXAMPLES],
                            headers=["Try an example (one click runs it)", "mode"],
                            elem_id="sc-examples", samples_per_page=len(EXAMPLES),
                            type="index")
                        with gr.Row():
                            retry_btn = gr.Button("↻ Retry", size="sm", elem_id="sc-retry")
                            undo_btn = gr.Button("↶ Undo", size="sm", elem_id="sc-undo")
                            new_btn = gr.Button("✚ New conversation", size="sm",
                                                elem_id="sc-new")
                            ab_btn = gr.Button("⇄ A/B replay", size="sm", variant="secondary",
                                               elem_id="sc-ab", interactive=ready)
                    with gr.Column(scale=1, min_width=260):
                        mode = gr.Radio([("Chat", "chat"), ("Completion", "completion")],
                                        value=default_mode(slot, d), label="Mode",
                                        info="Chat: your turns in the model's chat "
                                             "format. Completion: the model continues your "
                                             "text as is (what a base model is good at)",
                                        elem_id="sc-mode")
                        ghosts = gr.Checkbox(value=True, label="Show refused drafts",
                                             elem_id="sc-ghosts")
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
                                                          f"{limits.max_new_tokens_cap})",
                                            elem_id="sc-max-new")
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
            with gr.Tab("Stats", id="stats") as tab:
                stats = stats_tab.build_stats_tab(self.store, self.access, browser, demo,
                                                  self.writer, slot.redact)
                stats.refresh_on(tab.select)
        timer = gr.Timer(1.0, active=not ready and slot.state != "failed")

        # In the order of Settings' fields.
        controls = [system, speculation, drafter, draft_len, adaptive, temperature, top_p, top_k,
                    max_new, seed, mode]

        # Explicit parameters: gradio injects `request` only into a named, annotated one.
        def on_bot(state, browser_id, system, speculation, drafter, draft_len, adaptive,
                   temperature, top_p, top_k, max_new_tokens, seed, mode, request: gr.Request):
            yield from self.bot(state, Settings(system, speculation, drafter, draft_len, adaptive,
                                                temperature, top_p, top_k, max_new_tokens, seed,
                                                mode), request, browser_id)

        def on_ab(state, browser_id, system, speculation, drafter, draft_len, adaptive,
                  temperature, top_p, top_k, max_new_tokens, seed, mode, request: gr.Request):
            yield from self.ab_replay(state, Settings(system, speculation, drafter, draft_len,
                                                      adaptive, temperature, top_p, top_k,
                                                      max_new_tokens, seed, mode),
                                      request, browser_id)

        def on_user(text, state, system, speculation, drafter, draft_len, adaptive, temperature,
                    top_p, top_k, max_new_tokens, seed, mode, request: gr.Request):
            return self.user(text, state, request,
                             Settings(system, speculation, drafter, draft_len, adaptive,
                                      temperature, top_p, top_k, max_new_tokens, seed, mode))

        def on_browser(browser_id):
            """Give a browser its id on its first visit; keep the one it has."""
            return browser_id if self.access.valid_browser_id(browser_id) else new_browser_id()

        def on_stop(request: gr.Request):
            return self.stop(request) or gr.skip()

        def on_page(request: gr.Request):
            now_ready = slot.state == "ready"
            choices = self.drafters() or ["ngram"]
            # A failed load is also said in the chat itself, where the user looks.
            failed = [{"role": "assistant", "content": '<div class="sc-error">⚠ The models '
                       f"failed to load: {html.escape(slot.redact(slot.error))}</div>"}]
            return (header_html(slot), status_html(slot),
                    failed if slot.state == "failed" else gr.skip(),
                    gr.Radio(choices=[(DRAFTER_LABELS.get(c, c), c) for c in choices],
                             value=d.drafter if d.drafter in choices else choices[0]),
                    gr.Textbox(interactive=now_ready), gr.Button(interactive=now_ready),
                    gr.Button(interactive=now_ready), gr.Timer(active=slot.state == "loading"),
                    gr.Radio(value=default_mode(slot, d)))

        private = dict(api_visibility="private")
        engine_lane = dict(concurrency_id="engine", concurrency_limit=1, **private)
        instant = dict(concurrency_limit=None, show_progress="hidden", **private)
        chat_out = [chat, session, notice]

        def on_example(index: int, current: Session):
            """An example starts a conversation of its own (one example's turns never become
            another's context), with the example's text and settings."""
            text, _, settings = EXAMPLES[index]
            fresh = self.new_conversation(current)
            return (text, *fresh[1:], settings["mode"], settings["temperature"],
                    settings["seed"], settings["max_new_tokens"])

        new_outputs = [box, chat, session, notice, ab_off, ab_on, verdict]
        examples.click(on_example, [examples, session],
                       [*new_outputs, mode, temperature, seed, max_new], **instant).then(
            on_user, [box, session, *controls], [box, chat, session, notice], **instant).then(
            on_bot, [session, browser, *controls], chat_out, show_progress="minimal",
            **engine_lane)
        ghosts.change(None, ghosts, None,
                      js="(show) => { document.body.classList.toggle('sc-hide-ghosts', !show); }")

        for trigger in (box.submit, send.click):
            trigger(on_user, [box, session, *controls], [box, chat, session, notice],
                    **instant).then(on_bot, [session, browser, *controls], chat_out,
                                    show_progress="minimal", **engine_lane)
        retry_btn.click(self.retry, session, chat_out, **instant).then(
            on_bot, [session, browser, *controls], chat_out, show_progress="minimal",
            **engine_lane)
        undo_btn.click(self.undo, session, [box, chat, session, notice], **instant)
        new_btn.click(self.new_conversation, session, new_outputs, **instant)
        chat.clear(self.new_conversation, session, new_outputs, **instant)
        ab_btn.click(on_ab, [session, browser, *controls],
                     [ab_off, ab_on, verdict, chat, session, notice],
                     show_progress="minimal", **engine_lane)
        stop_btn.click(on_stop, None, notice, queue=False, **private)
        page_out = [header, status, chat, drafter, box, send, ab_btn, timer, mode]
        # The one public endpoint: a stateless reply for gradio_client and "Use via API".
        gr.api(self.generate, api_name="generate", concurrency_id="engine",
               concurrency_limit=1)
        timer.tick(on_page, None, page_out, **instant)
        demo.load(on_page, None, page_out, **instant)
        demo.load(on_browser, browser, browser, **instant)
    return demo


# Prompts that make good demos on the embedded 270M base model (checked: sensible text, long
# enough for speculation to show). Completion suits a base model; chat needs an instruct one.
EXAMPLES = [
    ("Water is a chemical compound made of", "completion",
     dict(mode="completion", temperature=0.7, seed=2, max_new_tokens=96)),
    ("The Eiffel Tower is a wrought-iron lattice tower in Paris. It was", "completion",
     dict(mode="completion", temperature=0.7, seed=2, max_new_tokens=96)),
    ("Photosynthesis is the process by which plants", "completion (greedy)",
     dict(mode="completion", temperature=0.0, seed=0, max_new_tokens=128)),
    ("# A Python function that reverses a string\ndef reverse_string(s):", "completion",
     dict(mode="completion", temperature=0.7, seed=2, max_new_tokens=64)),
    ("Tell me a fun fact about octopuses.", "chat",
     dict(mode="chat", temperature=0.0, seed=0, max_new_tokens=64)),
]


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
        block_label_text_color="*neutral_500", block_title_padding="0")


def launch_kwargs() -> dict:
    """What `demo.launch` needs besides host/port/share/auth (gradio 6: theme/css live here)."""
    return dict(css=asset("specchat.css"), theme=theme(), favicon_path=str(ASSETS / "logo.svg"),
                footer_links=["gradio", "settings"],
                head=f"<script>{asset('inspector.js')}</script>")


def launch(demo: gr.Blocks, **kwargs):
    """demo.queue(...).launch(...) with specchat's CSS and theme; kwargs go to launch()."""
    demo.queue(default_concurrency_limit=1, max_size=64)
    return demo.launch(**launch_kwargs(), **kwargs)
