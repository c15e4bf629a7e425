"""The conversations sidebar: the viewer's conversations beside the chat (a drawer on a phone,
gradio's Sidebar), searched, reopened to continue, renamed, deleted and exported.

The logic is in ui/conversations.py; here are the components and their events. Every handler
asks `Access.viewer` who is asking, on the server: the list's values come from the browser, so
an id is only a question, answered for the viewer's own conversations alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import gradio as gr

from specchat.ui import conversations
from specchat.ui.examples import sampler_preset
from specchat.ui.render import race_placeholders, render_history
from specchat.ui.state import Session
from specchat.ui.stats_tab import Exports

DELETE, CONFIRM = "Delete", "Confirm delete"
EMPTY = "None yet: each conversation you have is kept here to come back to."
# The sidebar starts open only on a wide screen: on a laptop the chat keeps its width (the
# list is one click away, the chevron at the top left), and on a phone the sidebar is a drawer
# over the page. It closes when the window narrows past that.
CLOSE_ON_PHONE = """() => {
  const narrow = window.matchMedia('(max-width: 1439px)');
  const close = () => {
    const bar = document.getElementById('sc-sidebar');
    if (bar && bar.classList.contains('open') && narrow.matches)
      bar.querySelector('.toggle-button')?.click();
  };
  close();
  narrow.addEventListener('change', close);
}"""
FLUSH_S = 2.0  # how long a refresh waits for the turn just finished to be saved


@dataclass
class Sidebar:
    search: gr.Textbox
    picker: gr.Radio  # the conversations; its value is the open one's id
    title: gr.Textbox
    rename: gr.Button
    delete: gr.Button
    asked: gr.State  # the conversation a first click on Delete asked to confirm
    export_md: gr.Button
    export_json: gr.Button
    file: gr.File
    message: gr.Markdown


def layout() -> Sidebar:
    """Inside `gr.Sidebar`: the search box, the list, then what acts on the open one."""
    search = gr.Textbox(show_label=False, placeholder="Search conversations", lines=1,
                        max_lines=1, elem_id="sc-conv-search", container=False)
    picker = gr.Radio([], value=None, label="Your conversations", info=EMPTY,
                      elem_id="sc-conversations", elem_classes="sc-conversations")
    with gr.Accordion("This conversation", open=False, elem_id="sc-conv-actions"):
        title = gr.Textbox(label="Title", lines=1, max_lines=1, elem_id="sc-conv-title")
        with gr.Row():
            rename = gr.Button("Rename", size="sm", elem_id="sc-conv-rename", min_width=60)
            delete = gr.Button(DELETE, size="sm", variant="stop", elem_id="sc-conv-delete",
                               min_width=60)
        with gr.Row():
            export_md = gr.Button("Export Markdown", size="sm", elem_id="sc-conv-md",
                                  min_width=60)
            export_json = gr.Button("Export JSON", size="sm", elem_id="sc-conv-json",
                                    min_width=60)
        file = gr.File(label="Export", interactive=False, visible=False,
                       elem_id="sc-conv-file")
    message = gr.Markdown("", elem_id="sc-conv-message")
    return Sidebar(search, picker, title, rename, delete, gr.State(None), export_md,
                   export_json, file, message)


def wire(app, bar: Sidebar, view, tabs: gr.Tabs, samplers_switch: gr.Radio,
         finished: list) -> None:
    """The sidebar's events. `view`: the page's View; `finished`: the page's events after
    which the list is refreshed (a reply saved, a new conversation)."""
    store, access = app.store, app.access
    exports = Exports()
    private = dict(api_visibility="private")
    instant = dict(concurrency_limit=None, show_progress="hidden", **private)

    def owner(request, browser_id):
        return access.viewer(request, browser_id).filter

    def listing(query: str, session: Session | None, browser_id, request: gr.Request):
        """The list: choices for the viewer, the open conversation selected."""
        app.writer.flush(FLUSH_S)  # the reply that just ended is in the list
        found = conversations.entries(store, owner(request, browser_id), query or "")
        current = session.conversation_id if session is not None else None
        ids = {e.id for e in found}
        empty = "No conversation holds that text." if query and query.strip() else EMPTY
        return gr.Radio(choices=[(e.label, e.id) for e in found],
                        value=current if current in ids else None,
                        info=None if found else empty)

    list_in = [bar.search, view.session, view.browser]
    for event in finished:
        event.then(listing, list_in, bar.picker, **instant)
    bar.search.change(listing, list_in, bar.picker, **instant)

    controls = list(view.controls.values())
    open_out = [view.session, view.chat, view.notice, bar.title, bar.message, bar.asked,
                bar.delete, tabs, samplers_switch, view.race_runs, view.verdict,
                bar.file, *controls]

    def on_open(picked: str | None, session: Session, browser_id, request: gr.Request):
        """Continue a stored conversation: its turns, mode, drafter and samplers come back."""
        keep = {c: gr.skip() for c in open_out}
        keep[bar.asked], keep[bar.delete] = None, gr.Button(value=DELETE)
        if not picked:
            return keep
        if app.busy(request):
            return {**keep, bar.message: "Wait for the reply to end (or Stop it) before "
                                         "opening another conversation."}
        found = conversations.reopen(store, owner(request, browser_id), picked)
        if found is None:
            return {**keep, bar.message: conversations.NOT_FOUND}
        note = ""
        engine = app.slot.engine
        loaded = app.slot.redact(engine.target.name) if engine is not None else ""
        if found.target and loaded and found.target != loaded:
            note = (f"This conversation was held with {found.target}; its next replies come "
                    f"from {loaded}.")
        runs, verdict = race_placeholders()
        out = {**keep, view.session: found.session, view.chat: render_history(found.session),
               view.notice: note, bar.title: found.session.conversation["title"],
               bar.message: "", tabs: gr.Tabs(selected="chat"), view.race_runs: runs,
               view.verdict: verdict, bar.file: gr.File(visible=False)}
        if found.settings is not None:
            values = asdict(found.settings)
            choices = app.drafters()
            for name, control in view.controls.items():
                if name == "drafter" and values[name] not in choices:
                    continue  # not loaded now: the page's own choice stays
                out[control] = values[name]
            out[samplers_switch] = sampler_preset(values)
        return out

    bar.picker.input(on_open, [bar.picker, view.session, view.browser], open_out, **instant)

    def on_rename(picked, title, query, session, browser_id, request: gr.Request):
        said = conversations.rename(store, owner(request, browser_id), picked or "", title)
        if said == "Renamed." and session.conversation_id == picked and session.conversation:
            session.conversation["title"] = " ".join(title.split())[:conversations.TITLE_CHARS]
        return said, listing(query, session, browser_id, request)

    bar.rename.click(on_rename, [bar.picker, bar.title, *list_in],
                     [bar.message, bar.picker], **instant)
    bar.title.submit(on_rename, [bar.picker, bar.title, *list_in],
                     [bar.message, bar.picker], **instant)

    def on_delete(picked, asked, query, session, browser_id, request: gr.Request):
        """A first click asks; a second on the same conversation deletes it. The chat, if it
        shows that conversation, starts afresh."""
        keep = {c: gr.skip() for c in delete_out}
        if not picked:
            return {**keep, bar.message: "Pick a conversation first."}
        if asked != picked:
            return {**keep, bar.asked: picked, bar.delete: gr.Button(value=CONFIRM),
                    bar.message: f"Delete it and all its turns? This cannot be undone: click "
                                 f"**{CONFIRM}**, or pick another conversation to keep it."}
        if session.conversation_id == picked and app.busy(request):
            return {**keep, bar.message: "Wait for the reply to end (or Stop it) before "
                                         "deleting this conversation."}
        viewer = access.viewer(request, browser_id)
        deleted = store.delete_conversation(picked, viewer.filter)
        app.forget(viewer.owner)  # nothing of the deleted text stays draftable
        out = {**keep, bar.asked: None, bar.delete: gr.Button(value=DELETE),
               bar.message: "Conversation deleted." if deleted else conversations.NOT_FOUND,
               bar.title: "", bar.file: gr.File(visible=False)}
        if deleted and session.conversation_id == picked:
            session = Session()
            out.update({view.session: session, view.chat: []})
        out[bar.picker] = listing(query, session, browser_id, request)
        return out

    delete_out = [bar.message, bar.asked, bar.delete, bar.title, bar.file, bar.picker,
                  view.session, view.chat]
    bar.delete.click(on_delete, [bar.picker, bar.asked, *list_in], delete_out, **instant)

    def exporter(kind: str):
        def on_export(picked, browser_id, request: gr.Request):
            if not picked:
                return gr.File(visible=False), "Pick a conversation first."
            render = conversations.as_markdown if kind == "md" else conversations.as_json
            text = render(store, owner(request, browser_id), picked)
            if text is None:
                return gr.File(visible=False), conversations.NOT_FOUND
            path = exports.new_path(f"specchat-{picked[:8]}.{kind}")
            path.write_text(text, encoding="utf-8")
            return gr.File(value=str(path), visible=True), ""
        return on_export

    for button, kind in ((bar.export_md, "md"), (bar.export_json, "json")):
        button.click(exporter(kind), [bar.picker, view.browser], [bar.file, bar.message],
                     **instant)
