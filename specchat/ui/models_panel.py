"""The Models tab: the models on this machine (`models/catalog.py`), what is loaded now, and a
load that swaps the page's models without a restart.

It is the local owner's alone (`Access.manages_models`): a page only this machine reaches,
without a login, or a login named by `--admin`. Elsewhere the tab is not built
(`Access.models_offered`), or built hidden and shown to the admins when their page loads; every
handler checks the visitor again on the server, whatever the page shows.

A load waits its turn in the engine's line (`engine_queue.py`) like a reply, then runs on the
engine's thread (`run_reply`: the `EngineLoop` under `app.py`), so no reply runs while models
are swapped. The new models load, prove themselves and warm up whole; only then does the slot
serve them (`ModelSlot.swap`), and the page, its handlers and the API follow the slot. A load
that fails leaves the current models serving and says why. Replies already waiting for the old
models when the swap comes run on them (their prompts were made for them), and the old models
are freed once none holds them.

    panel = ModelPanel(app)                   # the handlers, without gradio: tests drive these
    panel.listing(request)                    # the catalog's entries (Refused: not the owner)
    load = panel.start(target, draft, "nf4", request)   # a Load: its lines, state and error
"""

from __future__ import annotations

import html
import sys
import threading
import time
from dataclasses import dataclass, field

import gradio as gr

from specchat.core.engine import Engine
from specchat.core.prefix import PREFIX_CACHE_TOKENS
from specchat.drafters import LABELS as DRAFTER_LABELS
from specchat.engine_queue import EngineQueue, Finished, run_reply
from specchat.loader import load_engine, release_memory
from specchat.models import catalog
from specchat.models.loaded import ModelLoadError
from specchat.ui.handlers import ChatApp, warm_up

KEPT = "The current models go on serving."
NOT_THE_OWNER = ("Only this machine's owner may change the models: a page opened on this "
                 "machine without a login, or a login named by --admin.")
EMBEDDED = "embedded"  # load_engine's name for the embedded default
QUANTIZATIONS = [("NF4 (4-bit)", "nf4"), ("None (the checkpoint's own dtype)", "none")]
COLUMNS = ["Name", "Family", "Parameters", "Quantization", "Size", "Source", "Opens", "Path"]
POLL_S = 0.5  # how often the tab reads a running load's lines


class Refused(Exception):
    """A request the panel does not carry out; the message says why, for the page."""


@dataclass
class Load:
    """One load from the tab: what it loads, its progress lines, and how it ended."""
    target: str
    draft: str = ""
    quantization: str = "nf4"
    lines: list[str] = field(default_factory=list)
    state: str = "waiting"  # waiting (for the engine) | loading | done | failed
    error: str = ""
    started: float = field(default_factory=time.monotonic)
    finished: threading.Event = field(default_factory=threading.Event, repr=False)

    def progress(self, message: str) -> None:
        """A line for the tab, and for the server's log."""
        message = str(message).strip()
        if message:
            self.lines.append(message)
            print(f"specchat: {message}", file=sys.stderr, flush=True)

    @property
    def running(self) -> bool:
        return not self.finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.finished.wait(timeout)

    @property
    def what(self) -> str:
        return f"target {self.target}" + (f" and draft {self.draft}" if self.draft else "")


class ModelPanel:
    """The tab's handlers over a ChatApp's model slot."""

    def __init__(self, app: ChatApp):
        self.app = app
        self.load: Load | None = None  # the latest load
        self._lock = threading.Lock()

    def check(self, request) -> None:
        """Raise Refused unless the visitor behind `request` may change the models."""
        if not self.app.access.manages_models(request):
            raise Refused(NOT_THE_OWNER)

    def listing(self, request=None) -> list[catalog.Entry]:
        """The models on disk, for the owner."""
        self.check(request)
        return catalog.list_models()

    def loaded(self, request=None) -> list[list[str]]:
        """What serves now, for the owner: [what, which] rows."""
        self.check(request)
        return loaded_rows(self.app.slot)

    def start(self, target: str, draft: str = "", quantization: str = "nf4", request=None,
              device: str | None = None) -> Load:
        """Load `target` (and `draft`, "" for none) in the engine's turn, in the background;
        -> the Load to follow. Raises Refused for a visitor who is not the owner, while the
        first models or another load are under way, or without a target."""
        self.check(request)
        target, draft = (target or "").strip(), (draft or "").strip()
        if not target:
            raise Refused("Pick a target model first.")
        if quantization not in dict(QUANTIZATIONS).values():
            raise Refused(f"Unknown quantization {quantization!r}.")
        slot = self.app.slot
        if slot.state == "loading":
            raise Refused("The models are still loading; pick others once they are ready.")
        with self._lock:
            if self.load is not None and self.load.running:
                raise Refused(f"A load is under way already ({self.load.what}).")
            load = self.load = Load(target, draft, quantization)
        owner = self.app.access.viewer(request).owner
        engine = slot.engine
        if device is None and isinstance(engine, Engine):  # where the current models run
            device = engine.device.type
        options = dict(device=device,
                       prefix_tokens=getattr(getattr(engine, "prefixes", None), "max_tokens",
                                             PREFIX_CACHE_TOKENS))
        if engine is not None and hasattr(engine, "max_prompt_tokens"):
            options["max_prompt_tokens"] = engine.max_prompt_tokens
        threading.Thread(target=self._in_turn, args=(load, owner, engine, options),
                         name="specchat-model-wait", daemon=True).start()
        return load

    def _in_turn(self, load: Load, owner: str, engine, options: dict) -> None:
        """Wait for the engine in its line (the replies ahead finish first), then load on the
        engine's thread while holding it."""
        ticket = None
        try:
            # No engine yet (the first load failed): a line of its own, granted at once.
            queue = EngineQueue.of(engine) if engine is not None else EngineQueue()
            ticket = queue.join(owner=owner)  # no limit: an owner's load always gets a place
            said = 0
            for report in ticket.reports():
                if report.ahead and report.ahead != said:
                    said = report.ahead
                    replies = "reply" if said == 1 else "replies"
                    about = f" (about {report.seconds:.0f} s)" \
                        if report.seconds and report.seconds >= 1 else ""
                    load.progress(f"Waiting for the {said} {replies} ahead to end{about}…")
        except Exception as e:  # noqa: BLE001 - said in the tab
            if ticket is not None:
                ticket.leave()
            self._failed(load, e)
            load.finished.set()
            return

        def put(item) -> None:
            if isinstance(item, Exception):
                self._failed(load, item)
            elif isinstance(item, Finished):
                load.finished.set()

        try:
            # (the load yields nothing: run_reply hands on its error, then Finished)
            run_reply(ticket, lambda: self._load_and_swap(load, options) or (), put,
                      "specchat-model-load")
        except Exception as e:  # noqa: BLE001 - the load could not start (run_reply left it)
            self._failed(load, e)
            load.finished.set()

    def _load_and_swap(self, load: Load, options: dict) -> None:
        """On the engine's thread, holding it: the new models whole (loaded, proved, warmed
        up), then swapped into the slot and the old ones freed."""
        load.state = "loading"
        load.progress(f"Loading {load.what} ({load.quantization})…")
        report = load_engine(load.target, load.draft, load.quantization, "auto",
                             progress=load.progress, strict_draft=True, **options)
        for note in report.notes:
            load.progress(note)
        load.progress("Warming up the target…")
        warm_up(report.engine)
        old = self.app.slot.swap(report, load.what)
        load.state = "done"
        load.progress(f"Ready in {time.monotonic() - load.started:.0f} s: "
                      f"{report.engine.target.label} serves the page and the API.")
        del old, report  # replies still waiting for the old models hold them until they end
        release_memory()

    @staticmethod
    def _failed(load: Load, error: Exception) -> None:
        load.state = "failed"
        # ModelLoadError says why in words a user can act on; anything else, what it was.
        load.error = str(error) if isinstance(error, ModelLoadError) else \
            f"{type(error).__name__}: {error}"
        load.progress(f"Failed: {load.error}")
        load.progress(KEPT)
        release_memory()  # what the failed load had built


# ---------------------------------------------------------------------------------------------
# What the tab shows: plain rows for its Dataframes, (label, value) choices for its Dropdowns


def human(n: int | None, size: bool = False) -> str:
    """1236000000 -> "1.24B"; a size: 253037344 -> "253 MB"; None -> "-"."""
    if n is None:
        return "-"
    units = (" B", " KB", " MB", " GB", " TB") if size else ("", "K", "M", "B")
    k = 0
    while k + 1 < len(units) and n >= 0.9995 * 1000 ** (k + 1):
        k += 1
    return f"{n}{units[0]}" if k == 0 else f"{n / 1000 ** k:.3g}{units[k]}"


def catalog_rows(entries: list[catalog.Entry]) -> list[list[str]]:
    return [[e.name, e.family or "-", human(e.parameters), e.quantization or "-",
             human(e.size_bytes, size=True), e.source, "yes" if e.supported else f"no: {e.why}",
             e.path] for e in entries]


def model_choices(entries: list[catalog.Entry]) -> list[tuple[str, str]]:
    """The models specchat opens, as (label, path)."""
    return [(f"{e.name} ({e.source}, {e.quantization or '?'}, {human(e.size_bytes, True)})",
             e.path) for e in entries if e.supported]


def target_choices(entries: list[catalog.Entry]) -> list[tuple[str, str]]:
    return [("Gemma 3 270M (the embedded default)", EMBEDDED), *model_choices(entries)]


def draft_choices(entries: list[catalog.Entry]) -> list[tuple[str, str]]:
    return [("None (no draft model)", ""), *model_choices(entries)]


def loaded_rows(slot) -> list[list[str]]:
    """[what, which] rows of what the slot serves now."""
    report = slot.report
    if report is None:
        return [["State", f"failed: {slot.error}" if slot.state == "failed"
                 else f"loading {slot.description or 'the models'}…"]]
    engine = report.engine
    head = engine.drafters.get("head")
    drafters = ", ".join(DRAFTER_LABELS.get(d, d) for d in engine.drafters) or "none"
    rows = [["Target", engine.target.label],
            ["Draft model", report.draft.label if report.draft is not None else "none"],
            ["Draft head", (getattr(head, "label", "") or "loaded") if head is not None
             else "none"],
            ["Drafters", drafters]]
    return rows + [["Note", note] for note in report.notes]


def outcome_html(load: Load | None) -> str:
    """The line under the Load button: how the latest load stands, escaped."""
    if load is None:
        return ""
    what = html.escape(load.what)
    if load.state == "failed":
        error = load.error if load.error.endswith((".", "!", "?")) else load.error + "."
        return (f'<div class="sc-error" role="alert">✖ Could not load {what}: '
                f"{html.escape(error)} {KEPT}</div>")
    if load.state == "done":
        return f'<div class="sc-note" role="status">✔ Loaded {what}.</div>'
    verb = "Loading" if load.state == "loading" else \
        "Waiting for the replies ahead to end, then loading"
    return f'<div class="sc-note" role="status">{verb} {what}…</div>'


def _among(value: str | None, choices: list[tuple[str, str]]) -> str | None:
    return value if value in {v for _, v in choices} else None


def refusal_html(message: str) -> str:
    return f'<div class="sc-error" role="alert">✖ {html.escape(message)}</div>'


# ---------------------------------------------------------------------------------------------
# Components and wiring

@dataclass
class Panel:
    """The tab's components."""
    panel: ModelPanel
    tab: gr.Tab
    table: gr.Dataframe
    target: gr.Dropdown
    draft: gr.Dropdown
    quantization: gr.Radio
    load: gr.Button
    refresh: gr.Button
    outcome: gr.HTML
    lines: gr.Textbox
    loaded: gr.Dataframe
    timer: gr.Timer


def layout(app: ChatApp) -> Panel | None:
    """The Models tab, inside the page's gr.Tabs; None where no visitor may change the
    models. Built empty: its values come from its handlers, which only the owner gets answers
    from (a hidden tab's values would still reach every page's config)."""
    if not app.access.models_offered:
        return None
    # Shown at once on a local page without logins; behind logins, to the admins on load.
    with gr.Tab("Models", id="models", visible=not app.access.auth,
                elem_id="sc-models-tab") as tab:
        gr.Markdown("Models found on this machine (specchat's cache, the Hugging Face cache, "
                    "LM Studio, Ollama). Pick a target, and a draft model sharing its "
                    "vocabulary if you like, then Load: the page keeps serving the current "
                    "models until the new ones are ready.")
        table = gr.Dataframe(headers=COLUMNS, value=[], interactive=False, wrap=True,
                             max_height=360, label="Models on disk (click a row to pick it "
                             "as the target)", elem_id="sc-models-list")
        with gr.Row(equal_height=False):
            target = gr.Dropdown([], value=None, label="Target", allow_custom_value=True,
                                 info="or type a GGUF file, a folder or a hub id",
                                 elem_id="sc-models-target", scale=3)
            draft = gr.Dropdown([], value=None, label="Draft model (optional)",
                                allow_custom_value=True, info="must share the target's "
                                "vocabulary", elem_id="sc-models-draft", scale=3)
            quantization = gr.Radio(QUANTIZATIONS, value="nf4", label="Target quantization",
                                    elem_id="sc-models-quant", scale=2)
        with gr.Row():
            load = gr.Button("Load", variant="primary", elem_id="sc-models-load",
                             min_width=80)
            refresh = gr.Button("↻ Refresh the list", elem_id="sc-models-refresh",
                                min_width=80)
        outcome = gr.HTML("", elem_id="sc-models-outcome")
        lines = gr.Textbox("", label="Progress", lines=4, max_lines=12, interactive=False,
                           elem_id="sc-models-lines")
        loaded = gr.Dataframe(headers=["", "Loaded now"], value=[], interactive=False,
                              wrap=True, label="Loaded now", elem_id="sc-models-loaded")
        timer = gr.Timer(POLL_S, active=False)
    return Panel(ModelPanel(app), tab, table, target, draft, quantization, load,
                 refresh, outcome, lines, loaded, timer)


def wire(demo: gr.Blocks, p: Panel | None, page_timer: gr.Timer) -> None:
    """The tab's events. `page_timer`: the page's own loading timer, set going once a load
    has swapped the models, so the header, the status and the drafters follow them."""
    if p is None:
        return
    panel = p.panel
    instant = dict(concurrency_limit=None, show_progress="hidden", api_visibility="private")

    def on_list(request: gr.Request):
        try:
            entries = panel.listing(request)
            loaded = panel.loaded(request)
        except Refused as e:
            return {p.outcome: refusal_html(str(e))}
        load = panel.load
        targets, drafts = target_choices(entries), draft_choices(entries)
        # The pickers start at what serves now, where it is one of their choices (a loaded
        # model's name may be a display name, such as the embedded default's).
        current = panel.app.slot.report
        target_now = current.engine.target.name if current is not None else None
        draft_now = current.draft.name if current is not None and \
            current.draft is not None else ""
        quantization = getattr(current.engine.target, "quantization", "") \
            if current is not None else ""
        return {p.table: catalog_rows(entries), p.loaded: loaded,
                p.target: gr.Dropdown(choices=targets, value=_among(target_now, targets)),
                p.draft: gr.Dropdown(choices=drafts, value=_among(draft_now, drafts) or ""),
                p.quantization: quantization if quantization in dict(QUANTIZATIONS).values()
                else gr.skip(),
                p.outcome: outcome_html(load),
                p.lines: "\n".join(load.lines) if load is not None else "",
                p.timer: gr.Timer(active=load is not None and load.running)}

    def on_pick(evt: gr.SelectData, request: gr.Request):
        """A row clicked: its model becomes the target, when specchat opens it."""
        row = evt.row_value
        if not panel.app.access.manages_models(request) or not isinstance(row, list) or \
                len(row) != len(COLUMNS) or row[COLUMNS.index("Opens")] != "yes":
            return gr.skip()
        return row[COLUMNS.index("Path")]

    def on_load(target: str, draft: str, quantization: str, request: gr.Request):
        try:
            load = panel.start(target, draft, quantization, request)
        except Refused as e:
            return {p.outcome: refusal_html(str(e))}
        return {p.outcome: outcome_html(load), p.lines: "\n".join(load.lines),
                p.timer: gr.Timer(active=True)}

    def on_tick(request: gr.Request):
        load = panel.load
        if load is None or not panel.app.access.manages_models(request):
            return {p.timer: gr.Timer(active=False)}
        out = {p.outcome: outcome_html(load), p.lines: "\n".join(load.lines)}
        if not load.running:
            out.update({p.timer: gr.Timer(active=False), p.loaded: loaded_rows(panel.app.slot)})
            if load.state == "done":
                out[page_timer] = gr.Timer(active=True)
        return out

    listed = [p.table, p.loaded, p.target, p.draft, p.quantization, p.outcome, p.lines,
              p.timer]
    p.tab.select(on_list, None, listed, **instant)
    p.refresh.click(on_list, None, listed, **instant)
    p.table.select(on_pick, None, p.target, **instant)
    p.load.click(on_load, [p.target, p.draft, p.quantization], [p.outcome, p.lines, p.timer],
                 **instant)
    p.timer.tick(on_tick, None, [p.outcome, p.lines, p.timer, p.loaded, page_timer],
                 **instant)

    def on_page(request: gr.Request):
        return gr.Tab(visible=panel.app.access.manages_models(request))

    if panel.app.access.auth:  # behind logins: the tab is shown to the admins alone
        demo.load(on_page, None, p.tab, **instant)
