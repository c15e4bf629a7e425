"""The Stats tab's handlers on a seeded database: tables, plot data, read-only replay, delete,
CSV, and visitor isolation (a visitor sees only their own conversations, by login or browser)."""

from __future__ import annotations

import asyncio
import csv
import time

import gradio as gr
import pytest
from gradio.state_holder import SessionState

from specchat.core.events import GenerationStats, StepRecord
from specchat.stats.speedup import estimate
from specchat.stats.store import StatsStore
from specchat.ui import stats_tab
from specchat.ui.access import LOCAL, NOBODY, Access, new_browser_id


def spec(new_tokens, seconds=1.0, drafted_by=(4, 3), accepted_by=(3, 1), stop="eos"):
    drafted, accepted = sum(drafted_by), sum(accepted_by)
    return GenerationStats(new_tokens=new_tokens, seconds=seconds, speculation=True,
                           drafter="model", draft_len=len(drafted_by), drafted=drafted,
                           accepted=accepted, rejections=drafted_by[0] - accepted_by[-1],
                           drafted_by_position=list(drafted_by),
                           accepted_by_position=list(accepted_by), stop_reason=stop)


def plain(new_tokens, seconds=1.0):
    return GenerationStats(new_tokens=new_tokens, seconds=seconds, stop_reason="eos")


# The steps "And 3+3?" kept: 5 steps of 3 tokens (10 ms each), then 3 plain steps (8 ms each).
STEPS = [StepRecord(i + 1, 2, 2, 3, 0.0, 0.010).to_json() for i in range(5)] + \
    [StepRecord(6 + i, 0, 0, 1, 0.0, 0.008).to_json() for i in range(3)]
ESTIMATE = estimate(STEPS)  # 18 tokens in 74 ms against 8 ms a plain step: about 1.95x


@pytest.fixture
def seeded():
    """Visitor A: one conversation of 5 turns; visitor B: one; the local owner: one, empty."""
    store = StatsStore(":memory:")
    a = store.new_conversation("A's chat", "user:alice", "Qwen2.5-7B", "Qwen2.5-0.5B", "nf4", "cuda")
    store.record_turn(a, "What is 2+2?", "4", plain(10))  # 10 tok/s
    store.record_turn(a, "And 3+3?", "6", spec(25), steps=STEPS)  # estimated from its steps
    store.record_turn(a, "Why?", "Because", spec(15, drafted_by=(2, 2), accepted_by=(2, 0),
                                                   stop="stopped"))  # interrupted: no figure
    replay = store.record_turn(a, "Why?", "Because", plain(12))  # a race's plain run
    store.record_turn(a, "Why?", "Because", spec(30), baseline_turn_id=replay)  # 2.5x
    b = store.new_conversation("B's chat", "user:bob", "gemma", "ngram")
    store.record_turn(b, "secret", "reply", spec(20))
    mine = store.new_conversation("owner's chat", "local", "gemma")
    yield store, a, b, mine
    store.close()


def test_conversation_table_for_the_owner(seeded):
    store, a, b, mine = seeded
    table = stats_tab.conversation_table(store, owner=None)
    assert list(table.columns) == stats_tab.CONVERSATION_COLUMNS
    assert list(table["id"]) == [mine, b, a]  # newest first
    row = table.set_index("id").loc[a]
    assert row["title"] == "A's chat" and row["models"] == "Qwen2.5-7B + Qwen2.5-0.5B"
    assert row["turns"] == 5
    # One A/B pair (30 over 12 tok/s) and one estimate: the mean is the A/B pair's, and says so.
    assert row["mean speedup"] == "2.50x"
    assert row["mean of"] == "geometric mean of 1 A/B pair (1 other turn only estimated, left out)"
    assert row["acceptance"] == f"{100 * (4 + 2 + 4) / (7 + 4 + 7):.1f}%"
    assert row["date"].endswith("UTC")
    assert table.set_index("id").loc[mine]["mean speedup"] == "—"
    assert table.set_index("id").loc[mine]["mean of"] == "no speculative turn"
    # B's only turn kept no steps and has no A/B run: no figure, and why.
    assert table.set_index("id").loc[b]["mean speedup"] == "—"
    assert table.set_index("id").loc[b]["mean of"] == "too few steps to estimate from (0)"


def test_turn_table_and_plots(seeded):
    store, a, _, _ = seeded
    turns = stats_tab.turn_table(store, None, a)
    assert list(turns.columns) == stats_tab.TURN_COLUMNS
    assert list(turns["turn"]) == [1, 2, 3, 4, 5]
    assert list(turns["speculation"]) == ["off", "on", "on", "off", "on"]
    assert list(turns["tokens/s"]) == ["10.0", "25.0", "15.0", "12.0", "30.0"]
    estimated = (f"≈{ESTIMATE.value:.2f}x est. ({ESTIMATE.low:.2f}–{ESTIMATE.high:.2f}x)")
    assert list(turns["speedup"]) == ["—", estimated, "—", "—", "2.50x"]
    assert list(turns["speedup vs"]) == [
        "plain turn (a baseline)", ESTIMATE.note,
        "stopped: a partial reply is not compared", "plain turn (a baseline)",
        "vs its A/B plain run of the same prompt and settings: 12.0 tok/s"]
    assert turns["stop"][2] == "stopped (interrupted)"
    assert turns["acceptance"][1] == f"{100 * 4 / 7:.1f}%"

    frames = stats_tab.plot_frames(store, None, a)
    speedup = frames.speedup.frame
    assert list(speedup["turn"]) == [2, 5]
    assert list(speedup["speedup"]) == pytest.approx([ESTIMATE.value, 2.5], abs=0.005)
    assert list(speedup["basis"]) == ["est.", "A/B"]
    # Pooled over the turns: position 1 accepted 3+2+3 of 4+2+4, position 2: 1+0+1 of 3+2+3.
    acceptance = frames.acceptance.frame
    assert list(acceptance["position"]) == [1, 2]
    assert list(acceptance["acceptance"]) == pytest.approx([8 / 10, 2 / 8])
    assert list(acceptance["drafted"]) == [10, 8]
    tokens = frames.tokens_per_s.frame
    assert list(tokens["speculation"]) == ["off", "on", "on", "off", "on"]
    assert list(tokens["tokens/s"]) == pytest.approx([10, 25, 15, 12, 30])
    # Every value fits under its chart's top, with room to spare; 1x stays in view.
    assert frames.speedup.y_lim == [0.0, 2.9] and frames.tokens_per_s.y_lim == [0.0, 35.0]
    assert frames.acceptance.y_lim[1] > 1
    assert frames.speedup.caption.startswith("2.50x: geometric mean of 1 A/B pair")
    assert "3 speculative (on) and 2 plain (off)" in frames.tokens_per_s.caption

    empty = stats_tab.plot_frames(store, None, None)
    for chart in (empty.speedup, empty.acceptance, empty.tokens_per_s):
        assert chart.frame.empty and chart.caption == "Pick a conversation."


def test_reopened_conversation_is_chatbot_messages(seeded):
    store, a, _, _ = seeded
    messages = stats_tab.chat_history(store, None, a)
    assert len(messages) == 10
    assert [m["role"] for m in messages[:2]] == ["user", "assistant"]
    assert messages[0]["content"] == '<div class="sc-user">What is 2+2?</div>'
    # formatted first; the stored text as written a click away (no tokens were kept)
    assert '<div class="sc-md"><p>4</p>' in messages[1]["content"]
    assert '<div class="sc-tokens-view"><div class="sc-text">4</div></div>' \
        in messages[1]["content"]
    assert "speculation off" in messages[1]["content"]
    assert "2.50x" in messages[9]["content"] and "k=2" in messages[9]["content"]
    assert "stopped" in messages[5]["content"]


def test_visitor_isolation(seeded):
    store, a, b, mine = seeded
    assert list(stats_tab.conversation_table(store, "user:alice")["id"]) == [a]
    assert [v for _, v in stats_tab.conversation_choices(store, "user:alice")] == [a]
    # A asks for B's conversation by id: nothing comes back.
    assert stats_tab.turn_table(store, "user:alice", b).empty
    assert stats_tab.chat_history(store, "user:alice", b) == []
    assert stats_tab.plot_frames(store, "user:alice", b).tokens_per_s.frame.empty
    assert stats_tab.export_csv(store, "user:alice", b) is None
    assert "not yours" in stats_tab.delete_conversation(store, "user:alice", b)
    assert stats_tab.delete_conversation(store, "user:alice", mine).startswith("Nothing deleted")
    assert {c["id"] for c in store.conversations()} == {a, b, mine}
    # A request without a session sees nothing.
    assert stats_tab.conversation_table(store, NOBODY).empty
    # Each visitor can delete their own.
    assert stats_tab.delete_conversation(store, "user:bob", b) == "Conversation deleted."
    assert {c["id"] for c in store.conversations()} == {a, mine}


def test_identity_is_the_login_whatever_the_address():
    logins = Access(auth=True, exposed=False, admins={"root"})
    alice = logins.viewer(gr.Request(username="alice", session_hash="s1"))
    assert alice.owner == "user:alice" and alice.filter == "user:alice"
    # The same login from another browser (or after a reload) is the same owner.
    assert logins.viewer(gr.Request(username="alice", session_hash="s2")) == alice
    assert logins.viewer(gr.Request(username="bob")).filter == "user:bob"
    assert logins.viewer(gr.Request(username="root")).filter is None  # --admin sees all
    assert logins.viewer(gr.Request(session_hash="s3")).filter == NOBODY  # no login: nothing
    assert logins.viewer(None).filter == NOBODY


def test_identity_without_a_login():
    local = Access(auth=False, exposed=False)
    assert local.viewer(gr.Request(session_hash="s1")).owner == LOCAL
    assert local.viewer(None).filter is None  # the one local user is the owner
    shared = Access(auth=False, exposed=True)
    browser = new_browser_id()
    visitor = shared.viewer(gr.Request(session_hash="s1"), browser)
    assert visitor.owner.startswith("browser:") and browser not in visitor.owner  # a hash
    assert shared.viewer(gr.Request(session_hash="s2"), browser) == visitor  # after a reload
    assert shared.viewer(gr.Request(), new_browser_id()) != visitor
    for forged in (None, "", "local", "x" * 10, "<script>" * 8, 42):
        assert shared.viewer(gr.Request(), forged).filter == NOBODY


def test_export_csv_file(seeded):
    store, a, _, _ = seeded
    path = stats_tab.export_csv(store, "user:alice", a)
    assert path.endswith(f"specchat-{a[:8]}.csv")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["idx"] for r in rows] == ["1", "2", "3", "4", "5"]
    everything = stats_tab.export_csv(store, None, None)
    with open(everything, newline="") as f:
        assert len(list(csv.DictReader(f))) == 6


def test_disabled_store_shows_why():
    store = StatsStore.open_or_disabled("off")
    assert "off" in stats_tab.status_text(store)
    assert stats_tab.conversation_table(store, None).empty


def test_tab_wiring_runs_the_handlers_per_request(seeded):
    """Build the tab in a Blocks and run its events the way gradio's server does, with
    requests from alice, bob and an admin (logins, on a loopback page)."""
    store, a, b, mine = seeded
    with gr.Blocks() as demo:
        browser = gr.BrowserState(None)
        with gr.Tab("Stats") as tab:
            tab_ui = stats_tab.build_stats_tab(store, Access(auth=True, admins={"owner"}),
                                               browser, demo)
        tab_ui.refresh_on(tab.select)
    # The read-only conversation's title is a heading above it, not a label floating over it.
    assert tab_ui.history.show_label is False
    blocks = list(demo.blocks.values())
    heading = blocks[blocks.index(tab_ui.history) - 1]
    assert isinstance(heading, gr.Markdown) and "Conversation (read-only)" in heading.value
    fns = {fn.name: fn for fn in demo.fns.values()}
    sessions = {}  # session hash -> its browser state (e.g. the picker's current choices)

    def call(name, inputs, request):
        state = sessions.setdefault(request.session_hash, SessionState(demo))
        return asyncio.run(demo.process_api(block_fn=fns[name], inputs=[*inputs, None],
                                            state=state, request=request))["data"]

    alice = gr.Request(username="alice", session_hash="sess-a")
    status, table, picker = call("on_refresh", [None], alice)
    assert status == "" and [row[-1] for row in table["data"]] == [a]
    assert picker["value"] == a  # the newest visible conversation is picked
    owner = gr.Request(username="owner", session_hash="sess-o")
    _, table, _ = call("on_refresh", [None], owner)
    assert [row[-1] for row in table["data"]] == [mine, b, a]

    turns, speedup, acceptance, tokens, history, _ = call("on_pick", [a], alice)
    assert len(turns["data"]) == 5 and len(history) == 10
    assert [len(plot["data"]) for plot in (speedup, acceptance, tokens)] == [2, 2, 5]
    for plot in (speedup, acceptance, tokens):  # numeric axes
        x = "position" if "position" in plot["columns"] else "turn"
        assert plot["datatypes"][x] == plot["datatypes"][plot["columns"][1]] == "quantitative"
    # Then the plots' ranges and captions, which make gradio redraw them for the new data.
    for plot in call("on_plot_settings", [a], alice):
        assert plot["y_lim"][0] == 0 and plot["x_lim"][0] == 0.5 and plot["caption"]
    (path,) = call("on_export", [a], alice)
    assert path["path"].endswith(".csv")

    # Bob's browser never lists alice's conversation, so it cannot even submit its id.
    bob = gr.Request(username="bob", session_hash="sess-b")
    _, table, picker = call("on_refresh", [None], bob)
    assert [row[-1] for row in table["data"]] == [b] and picker["value"] == b
    with pytest.raises(gr.Error):
        call("on_delete", [a, a], bob)
    with pytest.raises(gr.Error):
        call("on_pick", [a], bob)
    assert store.conversation(a) is not None
    # Delete asks first; only a second click on the same conversation deletes it.
    message, asked, button = call("on_delete", [a, None], alice)
    assert "cannot be undone" in message and button["value"] == "Confirm delete"
    assert store.conversation(a) is not None
    message, asked, button = call("on_delete", [a, a], alice)
    assert message == "Conversation deleted." and store.conversation(a) is None
    assert button["value"] == "Delete conversation"


def test_exports_are_removed_after_a_while(seeded, tmp_path):
    store, a, _, _ = seeded
    exports = stats_tab.Exports(keep_s=60)
    first = stats_tab.export_csv(store, None, a, exports)
    second = stats_tab.export_csv(store, None, a, exports)
    assert first != second  # a fresh folder each: no visitor reaches another's by name
    exports.sweep(now=time.time() + 61)
    assert not any(exports.root.iterdir())
    exports.close()
    assert not exports.root.exists()


def test_reopened_conversation_is_escaped_text(seeded):
    store, a, _, _ = seeded
    payload = ('Hi <img src="http://127.0.0.1:8999/x.png?who=alice"> '
               '<a href="http://evil.example/">Session expired - log in again</a>')
    store.record_turn(a, payload, payload, plain(3))
    user, reply = stats_tab.chat_history(store, None, a)[-2:]
    for message in (user, reply):
        assert "<img" not in message["content"] and "<a " not in message["content"]
        assert "&lt;img src=" in message["content"]


def _tab_in_blocks(store):
    with gr.Blocks() as demo:
        browser = gr.BrowserState(None)
        with gr.Tab("Stats"):
            tab_ui = stats_tab.build_stats_tab(store, Access(), browser, demo)
    return demo, tab_ui


def _events_after(demo, component, event: str) -> list[dict]:
    """The tab's dependencies an `event` of `component` runs, with everything chained after."""
    dependencies = demo.config["dependencies"]
    run = [d for d in dependencies if (component._id, event) in map(tuple, d["targets"])]
    for d in run:
        run += [after for after in dependencies
                if after["trigger_after"] == d["id"] and after not in run]
    return run


def test_the_deleted_message_stays_when_the_list_moves_to_the_next_conversation(seeded):
    store, a, _, _ = seeded
    demo, tab_ui = _tab_in_blocks(store)
    message = tab_ui.message._id
    # Deleting writes the message, then refreshes the list, which moves the picker to the
    # next conversation (a `change`): nothing that change runs writes the message again.
    assert not any(message in d["outputs"] for d in _events_after(demo, tab_ui.picker, "change"))
    # Picking another conversation by hand (`input`, a row click) clears it.
    assert any(message in d["outputs"] for d in _events_after(demo, tab_ui.picker, "input"))
    assert any(message in d["outputs"]
               for d in _events_after(demo, tab_ui.conversations, "select"))
    # The handlers themselves: the second click deletes and says so.
    # The engine forgets the deleter's drafting history (core/history.py), no one else's.
    from specchat.core.history import History
    history = History()
    history.add("local", [1, 2, 3, 4])
    history.add("user:bob", [1, 2, 3, 4])
    handlers = stats_tab._Handlers(store, Access(), None, str, stats_tab.Exports(),
                                   history.forget)
    request = gr.Request(session_hash="local")
    text, asked, _ = handlers.on_delete(a, None, None, request)
    assert history.tokens("local") == 4  # only asked, nothing deleted yet
    text, asked, _ = handlers.on_delete(a, asked, None, request)
    assert text == "Conversation deleted." and store.conversation(a) is None
    assert history.tokens("local") == 0 and history.tokens("user:bob") == 4


def test_the_read_only_conversation_has_no_buttons_that_would_not_act_on_it(seeded):
    from specchat.ui.page import launch_kwargs
    store, _, _, _ = seeded
    _, tab_ui = _tab_in_blocks(store)
    assert tab_ui.history.buttons == [] and tab_ui.history.feedback_options is None
    # gradio always draws a Clear button in a Chatbot's toolbar: the page's CSS hides it here.
    assert stats_tab.READ_ONLY_CSS in launch_kwargs()["css"]
    assert "#sc-stats-history" in stats_tab.READ_ONLY_CSS
