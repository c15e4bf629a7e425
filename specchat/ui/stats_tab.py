"""The Stats tab: past conversations, their turns, speedup plots, read-only replay, delete, CSV.

The handler logic lives in plain functions of (store, owner, ...) so tests call them without a
browser; `build_stats_tab` only wires them to gradio components. `owner` is None for a viewer who
sees everything (`access.Viewer.filter`) and the viewer's owner key otherwise: every read,
delete and export is filtered by it in SQL, on the server. Stored prompts are shown
escaped, as text; replies as their formatted view (ui/markdown.py), where whatever markup the
model wrote stays text too.
"""

from __future__ import annotations

import atexit
import html
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import pandas as pd

from specchat.core.events import StepRecord, TokenEvent
from specchat.stats.format import fmt_date, fmt_figure, fmt_mean, fmt_number, fmt_percent
from specchat.stats.speedup import AB, ESTIMATE, conversation_speedup
from specchat.stats.store import StatsStore
from specchat.stats.writer import StatsWriter
from specchat.ui.access import Access
from specchat.ui.markdown import markdown_html
from specchat.ui.render import has_views, inspected, reply_views, user_html, view_switch

CONVERSATION_COLUMNS = ["title", "date", "models", "turns", "mean speedup", "mean of",
                        "acceptance", "id"]
# The conversations table's column widths (px): each header fits on one line, and all of
# them together fit a 1280 px window; longer cells end with an ellipsis (specchat.css) and show
# their whole text as a tooltip (tooltips.js). Narrower windows scroll the table sideways.
CONVERSATION_WIDTHS = {"title": 250, "date": 200, "models": 100, "turns": 70,
                       "mean speedup": 130, "mean of": 200, "acceptance": 110, "id": 90}
TURN_COLUMNS = ["turn", "speculation", "drafter", "k", "temperature", "tokens", "seconds",
                "ttft s", "tokens/s", "acceptance", "mean accepted len", "speedup", "speedup vs",
                "stop"]
HEADROOM = 1.15  # a chart's y axis reaches this far above its highest value
MIN_X_SPAN = 3  # turns (or draft positions) a chart's x axis spans at least: whole-number ticks
EXPORT_KEEP_S = 600  # an export's file is removed this long after it was made


# ---------------------------------------------------------------------------------------------
# Plain handlers: (store, owner, ...) -> data. No gradio in here.

def conversation_table(store: StatsStore, owner: str | None) -> pd.DataFrame:
    """One row per visible conversation, newest first (the numbers `specchat stats` prints)."""
    rows = [[r["title"], fmt_date(r["created"]), r["models"], r["turns"],
             fmt_mean(r["mean_speedup"], r["speedup_basis"]), r["speedup_note"],
             fmt_percent(r["acceptance"]), r["id"]]
            for r in store.summary_rows(owner)]
    return pd.DataFrame(rows, columns=CONVERSATION_COLUMNS)


def conversation_choices(store: StatsStore, owner: str | None) -> list[tuple[str, str]]:
    """(label, id) pairs for the conversation picker."""
    return [(f"{fmt_date(r['created'])} · {r['title'][:60]}", r["id"])
            for r in store.summary_rows(owner)]


def turn_table(store: StatsStore, owner: str | None, conversation_id: str | None) -> pd.DataFrame:
    rows = [_turn_cells(t) for t in _turns(store, owner, conversation_id)]
    return pd.DataFrame(rows, columns=TURN_COLUMNS)


def _turn_cells(t: dict) -> list:
    spec = t["speculation"]
    stop = (t["stop_reason"] or "") + (" (interrupted)" if t["interrupted"] else "")
    return [t["idx"], "on" if spec else "off", t["drafter"] if spec else "",
            t["draft_len"] if spec else "", fmt_number(t["temperature"], 2), t["new_tokens"],
            fmt_number(t["seconds"], 2), fmt_number(t["ttft_s"], 2),
            fmt_number(t["tokens_per_s"]), fmt_percent(t["acceptance_rate"]),
            fmt_number(t["mean_accepted_len"], 2), _figure(t), t["speedup_note"] or "", stop]


def _figure(t: dict) -> str:
    """A stored turn's speedup as every view shows it ("2.47x", "≈2.10x est. (1.80–2.50x)")."""
    return fmt_figure(t["speedup"], t["speedup_basis"], t["speedup_low"], t["speedup_high"])


@dataclass
class Chart:
    frame: pd.DataFrame  # numeric axes (int turn or position, float value), even when empty
    x_lim: list[float]  # half a step beyond the first and last turn (or position)
    y_lim: list[float]  # from 0 to above the highest value: nothing is clipped
    caption: str  # what the chart shows, or why it is empty


@dataclass
class PlotFrames:
    speedup: Chart  # turn, speedup, basis, vs: turns with a speedup (stats.speedup)
    acceptance: Chart  # position, acceptance, drafted: pooled over the conversation's turns
    tokens_per_s: Chart  # turn, tokens/s, speculation ("on" / "off"): every timed turn


def _frame(columns: dict[str, str], rows: list[list]) -> pd.DataFrame:
    """A frame with these dtypes whatever the rows: gradio types a chart's axes by dtype, and
    an empty frame would otherwise be all "object" (a categorical axis)."""
    frame = pd.DataFrame(rows, columns=list(columns))
    return frame.astype(columns)


def _x_lim(last: int) -> list[float]:
    """1 .. last with half a step of margin, and at least MIN_X_SPAN wide: the axis then ticks
    whole numbers (a narrower span ticks halves, which whole-number labels would repeat)."""
    return [0.5, max(last, MIN_X_SPAN) + 0.5]


def _y_top(values: list[float], at_least: float = 0.0) -> float:
    """The highest value plus headroom, rounded up to two significant digits."""
    top = max([*values, at_least]) * HEADROOM
    if top <= 0:
        return 1.0
    step = 10.0 ** (math.floor(math.log10(top)) - 1)
    return round(math.ceil(round(top / step, 6)) * step, 10)


def plot_frames(store: StatsStore, owner: str | None, conversation_id: str | None) -> PlotFrames:
    turns = _turns(store, owner, conversation_id)
    if not turns:
        why = "Pick a conversation." if not conversation_id else "No turns in this conversation."
        return PlotFrames(_speedup_chart([], why), _acceptance_chart([], why),
                          _tokens_chart([], why))
    return PlotFrames(_speedup_chart(turns), _acceptance_chart(turns), _tokens_chart(turns))


BASIS_WORDS = {AB: "A/B", ESTIMATE: "est."}  # the speedup chart's series


def _speedup_chart(turns: list[dict], empty: str = "") -> Chart:
    rows = [[t["idx"], round(t["speedup"], 2), BASIS_WORDS.get(t["speedup_basis"], "?"),
             _figure(t) + ": " + (t["speedup_note"] or "")]
            for t in turns if t["speedup"] is not None]
    frame = _frame({"turn": "int64", "speedup": "float64", "basis": "str", "vs": "str"},
                   rows)
    # 1x (plain decoding's speed) stays in view, so a slowdown reads as one.
    y_lim = [0.0, _y_top(list(frame["speedup"]), at_least=1.0)]
    mean = conversation_speedup(turns)
    if rows:
        caption = (f"{mean.label()}: {mean.note}. 1.00x is plain decoding's speed; A/B: "
                   "measured against a plain run of the same prompt and settings; est.: "
                   "estimated from the turn's own steps (tokens per target pass, step times), "
                   "with its band in the tooltip.")
    elif empty:
        caption = empty
    elif not mean.speculative:
        caption = "No speculative turn in this conversation yet."
    else:
        caption = (f"No speedup yet ({mean.note}): turn speculation off for one reply, or "
                   "race the drafters.")
    return Chart(frame, _x_lim(max((t["idx"] for t in turns), default=0)), y_lim, caption)


def _acceptance_chart(turns: list[dict], empty: str = "") -> Chart:
    # Acceptance at draft position i = accepted there / proposed there, pooled over the turns:
    # the curve Leviathan et al.'s alpha^i model predicts, so a steep drop says "lower k".
    width = max((len(t["drafted_by_position"]) for t in turns), default=0)
    drafted, accepted = [0] * width, [0] * width
    for t in turns:
        for i, (d, a) in enumerate(zip(t["drafted_by_position"], t["accepted_by_position"])):
            drafted[i] += d
            accepted[i] += a
    frame = _frame({"position": "int64", "acceptance": "float64", "drafted": "int64"},
                   [[i + 1, accepted[i] / drafted[i], drafted[i]]
                    for i in range(width) if drafted[i]])
    spec = sum(1 for t in turns if t["drafted"])
    caption = (f"Accepted / drafted at each draft position, over {spec} speculative turns."
               if len(frame) else empty or "Nothing drafted in this conversation yet.")
    return Chart(frame, _x_lim(width), [0.0, 1.05], caption)


def _tokens_chart(turns: list[dict], empty: str = "") -> Chart:
    rows = [[t["idx"], round(t["tokens_per_s"], 1), "on" if t["speculation"] else "off"]
            for t in turns if (t["tokens_per_s"] or 0) > 0]
    frame = _frame({"turn": "int64", "tokens/s": "float64", "speculation": "str"}, rows)
    on = sum(1 for row in rows if row[2] == "on")
    off = len(rows) - on
    if not rows:
        caption = empty or "No timed turn in this conversation yet."
    else:
        caption = f"{on} speculative (on) and {off} plain (off) turns."
        if not off:
            caption += " No plain turn to compare with yet."
    return Chart(frame, _x_lim(max((t["idx"] for t in turns), default=0)),
                 [0.0, _y_top(list(frame["tokens/s"]))], caption)


def chat_history(store: StatsStore, owner: str | None, conversation_id: str | None
                 ) -> list[dict]:
    """The conversation as Chatbot messages (escaped HTML), each reply formatted, with its
    tokens (or its plain text) a click away, and footed with how it was decoded."""
    messages = []
    for t in _turns(store, owner, conversation_id):
        mode = f"speculation on ({t['drafter']}, k={t['draft_len']})" if t["speculation"] \
            else "speculation off"
        footer = f"{mode} · {fmt_number(t['tokens_per_s'])} tok/s"
        if t["speculation"]:
            footer += f" · speedup {_figure(t)} ({t['speedup_note']})"
        if t["interrupted"]:
            footer += f" · {t['stop_reason']}"
        messages.append({"role": "user", "content": user_html(t["prompt"] or "")})
        reply = t["reply"] or ""
        # Formatted first, as in the chat; the other view is the tokens with their inspector
        # where they were kept with their steps, else the stored text as it was written.
        tokens = [TokenEvent(*token) for token in t["tokens"] or []]
        if tokens:
            steps = [StepRecord.from_json(r) for r in store.steps(t["id"], owner)]
            body, switch = (reply_views(tokens, steps), view_switch()) if has_views(tokens) \
                else (inspected(tokens, steps), "")
        elif reply.strip():
            body = (f'{markdown_html(reply)}<div class="sc-tokens-view"><div class="sc-text">'
                    f"{html.escape(reply, quote=False)}</div></div>")
            switch = view_switch("Plain text")
        else:
            body, switch = f'<div class="sc-text">{html.escape(reply, quote=False)}</div>', ""
        css = " sc-has-views" if switch else ""
        messages.append({"role": "assistant", "content":
                         f'<div class="sc-turn sc-turn-t{t["id"]}{css}">{body}'
                         f'<div class="sc-stats">{switch}<span>{html.escape(footer)}</span>'
                         "</div></div>"})
    return messages


DELETE, CONFIRM = "Delete conversation", "Confirm delete"


def delete_conversation(store: StatsStore, owner: str | None, conversation_id: str | None) -> str:
    if not conversation_id:
        return "Pick a conversation first."
    if store.delete_conversation(conversation_id, owner):
        return "Conversation deleted."
    return "Nothing deleted: that conversation is not yours or no longer exists."


class Exports:
    """CSV exports in one folder of the app's, each in a fresh subfolder (gradio serves a file
    by its path: visitors must not reach each other's by name), removed `keep_s` after they were
    made and when the app exits. gradio serves its own copy from its cache."""

    def __init__(self, keep_s: float = EXPORT_KEEP_S):
        self.root = Path(tempfile.mkdtemp(prefix="specchat-csv-"))
        self.keep_s = keep_s
        atexit.register(self.close)

    def new_path(self, name: str) -> Path:
        self.sweep()
        return Path(tempfile.mkdtemp(dir=self.root)) / name

    def sweep(self, now: float | None = None) -> None:
        cutoff = (time.time() if now is None else now) - self.keep_s
        for folder in self.root.iterdir():
            if folder.stat().st_mtime < cutoff:
                shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def export_csv(store: StatsStore, owner: str | None, conversation_id: str | None,
               exports: Exports | None = None) -> str | None:
    """CSV of the picked conversation (all visible ones when none is picked); its path."""
    if conversation_id and store.conversation(conversation_id, owner) is None:
        return None
    name = f"specchat-{conversation_id[:8]}.csv" if conversation_id else "specchat-stats.csv"
    path = (exports or _default_exports()).new_path(name)
    store.export_csv(path, conversation_id, owner)
    return str(path)


_EXPORTS: list[Exports] = []


def _default_exports() -> Exports:
    if not _EXPORTS:
        _EXPORTS.append(Exports())
    return _EXPORTS[0]


def status_text(store: StatsStore, writer: StatsWriter | None = None,
                redact: Callable[[str], str] = str) -> str:
    error = (writer.error if writer is not None else "") or store.error
    return f"⚠️ {redact(error)}" if error else ""


def _turns(store: StatsStore, owner: str | None, conversation_id: str | None) -> list[dict]:
    return store.turns(conversation_id, owner) if conversation_id else []


# ---------------------------------------------------------------------------------------------
# Gradio wiring

SPECULATION_COLORS = {"on": "#16a34a", "off": "#9ca3af"}  # the accepted tokens' green; gray
BASIS_COLORS = {"A/B": "#16a34a", "est.": "#64748b"}  # measured in green; estimates in slate

# gradio draws a Clear button in every Chatbot's toolbar (and share and copy buttons unless
# `buttons=[]`). Clearing the read-only view would not touch the stored conversation, so its
# toolbar is hidden; Delete conversation is the way to remove one. (Added to the page's CSS by
# `page.launch_kwargs`.)
READ_ONLY_CSS = "#sc-stats-history .icon-button-wrapper.top-panel { display: none; }\n"


def chart_settings(chart: Chart) -> dict:
    """A plot's ranges and caption. Sent after its data: gradio's plot swaps new data into
    its drawn axes, and redraws axes, axis types and series only when a setting like these
    changes, from the data it holds then."""
    return gr.update(x_lim=chart.x_lim, y_lim=chart.y_lim, caption=chart.caption)


@dataclass
class StatsTab:
    refresh: gr.Button
    conversations: gr.Dataframe
    picker: gr.Dropdown
    turns: gr.Dataframe
    history: gr.Chatbot
    on_refresh: Callable  # (picked, browser id, request) -> list outputs
    list_outputs: list
    inputs: list | None = None  # [picker, browser id]
    exports: Exports | None = None
    message: gr.Markdown | None = None  # what Delete says

    def refresh_on(self, listener: Callable) -> None:
        """Also refresh on another event, e.g. `stats.refresh_on(stats_tab.select)` so the tab
        is current whenever it is opened."""
        listener(self.on_refresh, self.inputs, self.list_outputs, api_visibility="private")


def build_stats_tab(store: StatsStore, access: Access, browser: gr.BrowserState,
                    demo: gr.Blocks | None = None, writer: StatsWriter | None = None,
                    redact: Callable[[str], str] = str,
                    forget: Callable[[str], None] | None = None) -> StatsTab:
    """Lay out the Stats tab inside the caller's open `gr.Blocks()` / `gr.Tab("Stats")`.
    `browser` holds the visitor's browser id (see `access`). Pass `demo` to fill the tab when
    the page loads; `StatsTab.refresh_on(tab.select)` also refreshes it whenever it is
    opened. `forget(owner)`: drop what the engine remembers of an owner's text (its drafting
    history), called when they delete a conversation."""
    exports = Exports()
    view = _layout(status_text(store, writer, redact))
    handlers = _Handlers(store, access, writer, redact, exports, forget)
    _wire(view, handlers, browser, demo)
    tab = StatsTab(view.refresh, view.conversations, view.picker, view.turns, view.history,
                   handlers.on_refresh, view.list_outputs)
    tab.inputs, tab.exports, tab.message = [view.picker, browser], exports, view.message
    return tab


@dataclass
class _View:
    """The tab's components that events read or write."""
    status: gr.Markdown
    refresh: gr.Button
    picker: gr.Dropdown
    conversations: gr.Dataframe
    turns: gr.Dataframe
    speedup_plot: gr.ScatterPlot
    acceptance_plot: gr.BarPlot
    tokens_plot: gr.BarPlot
    history: gr.Chatbot
    export_button: gr.Button
    delete_button: gr.Button
    pending: gr.State  # the conversation a first click on Delete asked to confirm
    csv_file: gr.File
    message: gr.Markdown

    @property
    def list_outputs(self) -> list:
        return [self.status, self.conversations, self.picker]

    @property
    def plots(self) -> list:
        return [self.speedup_plot, self.acceptance_plot, self.tokens_plot]


def _layout(status_line: str) -> _View:
    """The status line, the picker, the tables, the charts, the read-only conversation and
    the export and delete buttons, top to bottom."""
    status = gr.Markdown(status_line)
    with gr.Row():
        refresh = gr.Button("Refresh", scale=0)
        picker = gr.Dropdown(label="Conversation", choices=[], value=None, interactive=True,
                             scale=3, elem_id="sc-stats-picker")
    # One line a row, in fixed columns (`CONVERSATION_WIDTHS`).
    conversations = gr.Dataframe(
        label="Past conversations", headers=CONVERSATION_COLUMNS, interactive=False,
        wrap=False, column_widths=[CONVERSATION_WIDTHS[c] for c in CONVERSATION_COLUMNS],
        elem_id="sc-stats-conversations")
    turns = gr.Dataframe(label="Turns", headers=TURN_COLUMNS, interactive=False)
    with gr.Row():
        # Turns and positions on numeric axes with whole-number ticks ("d"); each pick sends
        # the data, then the ranges and captions (`chart_settings`). Points for speedups: a
        # line through a single turn would draw nothing.
        speedup_plot = gr.ScatterPlot(x="turn", y="speedup", y_title="speedup (x plain)",
                                      color="basis", color_map=BASIS_COLORS,
                                      x_axis_format="d", tooltip=["vs"],
                                      label="Speedup per turn", elem_id="sc-stats-speedup")
        acceptance_plot = gr.BarPlot(x="position", y="acceptance", x_title="draft position",
                                     x_axis_format="d", y_lim=[0, 1.05],
                                     label="Acceptance by draft position",
                                     elem_id="sc-stats-acceptance")
        tokens_plot = gr.BarPlot(x="turn", y="tokens/s", color="speculation",
                                 color_map=SPECULATION_COLORS, x_axis_format="d",
                                 label="Tokens/s per turn, speculation on vs off",
                                 elem_id="sc-stats-tokens")
    # The Chatbot's own label floats over its first message: a heading above it instead.
    gr.Markdown("**Conversation (read-only)**", elem_id="sc-stats-history-label")
    # Read-only: no share, copy or feedback buttons (and its Clear button hidden by
    # READ_ONLY_CSS): none of them would act on the stored conversation.
    history = gr.Chatbot(label="Conversation (read-only)", show_label=False, height=360,
                         render_markdown=False, sanitize_html=True, latex_delimiters=[],
                         buttons=[], feedback_options=None, elem_id="sc-stats-history")
    with gr.Row():
        export_button = gr.Button("Export CSV")
        delete_button = gr.Button(DELETE, variant="stop")
    pending = gr.State(None)
    csv_file = gr.File(label="CSV export", interactive=False)
    message = gr.Markdown()
    return _View(status, refresh, picker, conversations, turns, speedup_plot, acceptance_plot,
                 tokens_plot, history, export_button, delete_button, pending, csv_file,
                 message)


@dataclass
class _Handlers:
    """The tab's event handlers: the plain functions above, for the viewer of each request."""
    store: StatsStore
    access: Access
    writer: StatsWriter | None
    redact: Callable[[str], str]
    exports: Exports
    forget: Callable[[str], None] | None = None

    def owner(self, request: gr.Request, browser_id: str | None) -> str | None:
        return self.access.viewer(request, browser_id).filter

    def on_refresh(self, picked: str | None, browser_id: str | None, request: gr.Request):
        choices = conversation_choices(self.store, self.owner(request, browser_id))
        if picked not in {value for _, value in choices}:
            picked = choices[0][1] if choices else None
        return (status_text(self.store, self.writer, self.redact),
                conversation_table(self.store, self.owner(request, browser_id)),
                gr.Dropdown(choices=choices, value=picked))

    def on_pick(self, picked: str | None, browser_id: str | None, request: gr.Request):
        who = self.owner(request, browser_id)
        frames = plot_frames(self.store, who, picked)
        return (turn_table(self.store, who, picked), frames.speedup.frame,
                frames.acceptance.frame, frames.tokens_per_s.frame,
                chat_history(self.store, who, picked), None)

    def on_plot_settings(self, picked: str | None, browser_id: str | None,
                         request: gr.Request):
        frames = plot_frames(self.store, self.owner(request, browser_id), picked)
        return [chart_settings(chart) for chart in
                (frames.speedup, frames.acceptance, frames.tokens_per_s)]

    @staticmethod
    def on_row_select(evt: gr.SelectData):
        return evt.row_value[-1] if evt.row_value else gr.skip()  # "id" is the last column

    def on_delete(self, picked: str | None, asked: str | None, browser_id: str | None,
                  request: gr.Request):
        """A first click asks; a second on the same conversation deletes it."""
        if not picked:
            return "Pick a conversation first.", None, gr.Button(value=DELETE)
        if asked != picked:
            return ("Delete this conversation and all its turns? This cannot be undone: click "
                    f"**{CONFIRM}** to delete it, or pick another conversation to keep it.",
                    picked, gr.Button(value=CONFIRM))
        said = delete_conversation(self.store, self.owner(request, browser_id), picked)
        if self.forget is not None:  # nothing of the deleted text stays draftable
            self.forget(self.access.viewer(request, browser_id).owner)
        return said, None, gr.Button(value=DELETE)

    @staticmethod
    def on_pick_reset():
        """The visitor picked another conversation: a pending Delete question no longer
        applies, and neither does the last message."""
        return None, gr.Button(value=DELETE), ""

    def on_export(self, picked: str | None, browser_id: str | None, request: gr.Request):
        return export_csv(self.store, self.owner(request, browser_id), picked, self.exports)


def _wire(v: _View, h: _Handlers, browser: gr.BrowserState, demo: gr.Blocks | None) -> None:
    """Every event of the tab. api_visibility="private": these act on the caller's data; keep
    them off the public API."""
    private = dict(api_visibility="private")
    inputs = [v.picker, browser]
    detail_outputs = [v.turns, *v.plots, v.history, v.csv_file]
    v.refresh.click(h.on_refresh, inputs, v.list_outputs, **private)
    v.picker.change(h.on_pick, inputs, detail_outputs, **private).then(
        h.on_plot_settings, inputs, v.plots, **private)
    # Delete's question and message go when the visitor picks another conversation (`input`
    # and a row click), not when the list moves the picker by itself: after a deletion the
    # refreshed list picks the next conversation, and "Conversation deleted." stays in view.
    reset = dict(fn=h.on_pick_reset, inputs=None,
                 outputs=[v.pending, v.delete_button, v.message], **private)
    v.picker.input(**reset)
    v.conversations.select(h.on_row_select, None, v.picker, **private).then(**reset)
    v.delete_button.click(h.on_delete, [v.picker, v.pending, browser],
                          [v.message, v.pending, v.delete_button], **private).then(
        h.on_refresh, inputs, v.list_outputs, **private)
    v.export_button.click(h.on_export, inputs, v.csv_file, **private)
    if demo is not None:
        demo.load(h.on_refresh, inputs, v.list_outputs, **private)
