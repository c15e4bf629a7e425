"""The Stats tab: past conversations, their turns, speedup plots, read-only replay, delete, CSV.

The handler logic lives in plain functions of (store, owner, ...) so tests call them without a
browser; `build_stats_tab` only wires them to gradio components. Visitor isolation: `owner` is
None for the app's owner (sees everything) and the browser session id for a visitor of a shared
link (sees and deletes only conversations recorded under that session id).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import pandas as pd

from specchat.stats.format import fmt_date, fmt_number, fmt_percent, fmt_speedup
from specchat.stats.store import StatsStore

CONVERSATION_COLUMNS = ["title", "date", "models", "turns", "mean speedup", "acceptance", "id"]
TURN_COLUMNS = ["turn", "speculation", "drafter", "k", "temperature", "tokens", "seconds",
                "ttft s", "tokens/s", "acceptance", "mean accepted len", "speedup", "stop"]
NOBODY = ""  # owner filter for a request with no session: matches no conversation


# ---------------------------------------------------------------------------------------------
# Who is asking

def viewer_owner(request: gr.Request | None, is_owner_fn: Callable[[gr.Request], bool]
                 ) -> str | None:
    """None (see all) for the owner; else the visitor's session id. Fails closed: a request
    without a session sees nothing rather than everything."""
    if request is not None and is_owner_fn(request):
        return None
    return (request.session_hash if request is not None else None) or NOBODY


def conversation_owner(request: gr.Request | None, is_owner_fn: Callable[[gr.Request], bool]
                       ) -> str:
    """What the chat tab should pass as `owner=` to `StatsStore.new_conversation`, so that this
    tab shows the conversation to the same person: the owner's conversations are "local" (or
    their login name), a visitor's are keyed by their browser session."""
    if request is None:
        return "local"
    if is_owner_fn(request):
        return request.username or "local"
    return request.session_hash or "local"


# ---------------------------------------------------------------------------------------------
# Plain handlers: (store, owner, ...) -> data. No gradio in here.

def conversation_table(store: StatsStore, owner: str | None) -> pd.DataFrame:
    """One row per visible conversation, newest first (the numbers `specchat stats` prints)."""
    rows = [[r["title"], fmt_date(r["created"]), r["models"], r["turns"],
             fmt_speedup(r["mean_speedup"]), fmt_percent(r["acceptance"]), r["id"]]
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
            fmt_number(t["mean_accepted_len"], 2), fmt_speedup(t["speedup"]), stop]


@dataclass
class PlotFrames:
    speedup: pd.DataFrame  # turn, speedup: speculative turns with a measured speedup
    acceptance: pd.DataFrame  # position, acceptance, drafted: over all of its turns
    tokens_per_s: pd.DataFrame  # turn, tokens/s, speculation ("on" / "off")


def plot_frames(store: StatsStore, owner: str | None, conversation_id: str | None) -> PlotFrames:
    turns = _turns(store, owner, conversation_id)
    speedup = pd.DataFrame([[t["idx"], round(t["speedup"], 2)] for t in turns
                            if t["speedup"] is not None],
                           columns=["turn", "speedup"])
    # Acceptance at draft position i = accepted there / proposed there, pooled over the turns:
    # the curve Leviathan et al.'s alpha^i model predicts, so a steep drop says "lower k".
    width = max((len(t["drafted_by_position"]) for t in turns), default=0)
    drafted, accepted = [0] * width, [0] * width
    for t in turns:
        for i, (d, a) in enumerate(zip(t["drafted_by_position"], t["accepted_by_position"])):
            drafted[i] += d
            accepted[i] += a
    acceptance = pd.DataFrame(
        [[str(i + 1), accepted[i] / drafted[i], drafted[i]] for i in range(width) if drafted[i]],
        columns=["position", "acceptance", "drafted"])
    tokens_per_s = pd.DataFrame(
        [[t["idx"], round(t["tokens_per_s"] or 0.0, 1), "on" if t["speculation"] else "off"]
         for t in turns],
        columns=["turn", "tokens/s", "speculation"])
    return PlotFrames(speedup, acceptance, tokens_per_s)


def chat_history(store: StatsStore, owner: str | None, conversation_id: str | None
                 ) -> list[dict]:
    """The conversation as Chatbot messages, each reply footed with how it was decoded."""
    messages = []
    for t in _turns(store, owner, conversation_id):
        mode = f"speculation on ({t['drafter']}, k={t['draft_len']})" if t["speculation"] \
            else "speculation off"
        footer = f"{mode} · {fmt_number(t['tokens_per_s'])} tok/s"
        if t["speedup"] is not None:
            footer += f" · {fmt_speedup(t['speedup'])}"
        if t["interrupted"]:
            footer += f" · {t['stop_reason']}"
        messages.append({"role": "user", "content": t["prompt"]})
        messages.append({"role": "assistant", "content": f"{t['reply']}\n\n*{footer}*"})
    return messages


def delete_conversation(store: StatsStore, owner: str | None, conversation_id: str | None) -> str:
    if not conversation_id:
        return "Pick a conversation first."
    if store.delete_conversation(conversation_id, owner):
        return "Conversation deleted."
    return "Nothing deleted: that conversation is not yours or no longer exists."


def export_csv(store: StatsStore, owner: str | None, conversation_id: str | None) -> str | None:
    """CSV of the picked conversation (all visible ones when none is picked); its path."""
    if conversation_id and store.conversation(conversation_id, owner) is None:
        return None
    name = f"specchat-{conversation_id[:8]}.csv" if conversation_id else "specchat-stats.csv"
    # A fresh folder per export: gradio serves the file by path, and visitors must not get
    # each other's files by name.
    path = Path(tempfile.mkdtemp(prefix="specchat-csv-")) / name
    store.export_csv(path, conversation_id, owner)
    return str(path)


def status_text(store: StatsStore) -> str:
    return f"⚠️ {store.error}" if store.error else ""


def _turns(store: StatsStore, owner: str | None, conversation_id: str | None) -> list[dict]:
    return store.turns(conversation_id, owner) if conversation_id else []


# ---------------------------------------------------------------------------------------------
# Gradio wiring

@dataclass
class StatsTab:
    refresh: gr.Button
    conversations: gr.Dataframe
    picker: gr.Dropdown
    turns: gr.Dataframe
    history: gr.Chatbot
    on_refresh: Callable  # (picked, request) -> list outputs
    list_outputs: list

    def refresh_on(self, listener: Callable) -> None:
        """Also refresh on another event, e.g. `stats.refresh_on(stats_tab.select)` so the tab
        is current whenever it is opened."""
        listener(self.on_refresh, self.picker, self.list_outputs, api_visibility="private")


def build_stats_tab(store: StatsStore, is_owner_fn: Callable[[gr.Request], bool],
                    demo: gr.Blocks | None = None) -> StatsTab:
    """Lay out the Stats tab inside the caller's open `gr.Blocks()` / `gr.Tab("Stats")`.
    Pass `demo` to fill the tab when the page loads; `StatsTab.refresh_on(tab.select)` also
    refreshes it whenever it is opened."""
    status = gr.Markdown(status_text(store))
    with gr.Row():
        refresh = gr.Button("Refresh", scale=0)
        picker = gr.Dropdown(label="Conversation", choices=[], value=None, interactive=True,
                             scale=3)
    conversations = gr.Dataframe(label="Past conversations", headers=CONVERSATION_COLUMNS,
                                 interactive=False, wrap=True)
    turns = gr.Dataframe(label="Turns", headers=TURN_COLUMNS, interactive=False)
    with gr.Row():
        speedup_plot = gr.LinePlot(x="turn", y="speedup", title="Speedup per turn",
                                   y_title="speedup (x plain)", label="Speedup per turn",
                                   y_lim=[0, None])
        acceptance_plot = gr.BarPlot(x="position", y="acceptance", y_lim=[0, 1],
                                     title="Acceptance by draft position",
                                     label="Acceptance by draft position")
        tokens_plot = gr.BarPlot(x="speculation", y="tokens/s", y_aggregate="mean", y_lim=[0, None],
                                 color="speculation", title="Mean tokens/s, speculation on vs off",
                                 label="Tokens/s, speculation on vs off")
    history = gr.Chatbot(label="Conversation (read-only)", height=360)
    with gr.Row():
        export_button = gr.Button("Export CSV")
        delete_button = gr.Button("Delete conversation", variant="stop")
    csv_file = gr.File(label="CSV export", interactive=False)
    message = gr.Markdown()

    def on_refresh(picked: str | None, request: gr.Request):
        owner = viewer_owner(request, is_owner_fn)
        choices = conversation_choices(store, owner)
        if picked not in {value for _, value in choices}:
            picked = choices[0][1] if choices else None
        return (status_text(store), conversation_table(store, owner),
                gr.Dropdown(choices=choices, value=picked))

    def on_pick(picked: str | None, request: gr.Request):
        owner = viewer_owner(request, is_owner_fn)
        frames = plot_frames(store, owner, picked)
        return (turn_table(store, owner, picked), frames.speedup, frames.acceptance,
                frames.tokens_per_s, chat_history(store, owner, picked), None)

    def on_row_select(evt: gr.SelectData):
        return evt.row_value[-1] if evt.row_value else gr.skip()  # "id" is the last column

    def on_delete(picked: str | None, request: gr.Request):
        return delete_conversation(store, viewer_owner(request, is_owner_fn), picked)

    def on_export(picked: str | None, request: gr.Request):
        return export_csv(store, viewer_owner(request, is_owner_fn), picked)

    list_outputs = [status, conversations, picker]
    detail_outputs = [turns, speedup_plot, acceptance_plot, tokens_plot, history, csv_file]
    # api_visibility="private": these act on the caller's session; keep them off the public API.
    refresh.click(on_refresh, picker, list_outputs, api_visibility="private")
    picker.change(on_pick, picker, detail_outputs, api_visibility="private")
    conversations.select(on_row_select, None, picker, api_visibility="private")
    delete_button.click(on_delete, picker, message, api_visibility="private").then(
        on_refresh, picker, list_outputs, api_visibility="private")
    export_button.click(on_export, picker, csv_file, api_visibility="private")
    if demo is not None:
        demo.load(on_refresh, picker, list_outputs, api_visibility="private")
    return StatsTab(refresh, conversations, picker, turns, history, on_refresh, list_outputs)
