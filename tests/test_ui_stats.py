"""The Stats tab's handlers on a seeded database: tables, plot data, read-only replay, delete,
CSV, and visitor isolation (a visitor of a shared link sees only their own session's chats)."""

from __future__ import annotations

import asyncio
import csv

import gradio as gr
import pytest
from gradio.state_holder import SessionState

from specchat.core.events import GenerationStats
from specchat.stats.store import StatsStore
from specchat.ui import stats_tab


def spec(new_tokens, seconds=1.0, drafted_by=(4, 3), accepted_by=(3, 1), stop="eos"):
    drafted, accepted = sum(drafted_by), sum(accepted_by)
    return GenerationStats(new_tokens=new_tokens, seconds=seconds, speculation=True,
                           drafter="model", draft_len=len(drafted_by), drafted=drafted,
                           accepted=accepted, rejections=drafted_by[0] - accepted_by[-1],
                           drafted_by_position=list(drafted_by),
                           accepted_by_position=list(accepted_by), stop_reason=stop)


def plain(new_tokens, seconds=1.0):
    return GenerationStats(new_tokens=new_tokens, seconds=seconds, stop_reason="eos")


@pytest.fixture
def seeded():
    """Visitor A: one conversation of 4 turns; visitor B: one; the local owner: one, empty."""
    store = StatsStore(":memory:")
    a = store.new_conversation("A's chat", "sess-a", "Qwen2.5-7B", "Qwen2.5-0.5B", "nf4", "cuda")
    store.record_turn(a, "What is 2+2?", "4", plain(10))  # 10 tok/s
    store.record_turn(a, "And 3+3?", "6", spec(25))  # 2.5x
    store.record_turn(a, "Why?", "Because", spec(15, drafted_by=(2, 2), accepted_by=(2, 0),
                                                   stop="stopped"))  # 1.5x, interrupted
    replay = store.record_turn(a, "Why?", "Because", plain(12))  # an A/B replay
    store.record_turn(a, "Why?", "Because", spec(30), baseline_turn_id=replay)  # 2.5x
    b = store.new_conversation("B's chat", "sess-b", "gemma", "ngram")
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
    # Speedups 2.5 (vs the plain 10 tok/s... and 12: mean 11), 15/11, and 30/12 from the replay.
    assert row["mean speedup"] == f"{(25 / 11 + 15 / 11 + 30 / 12) / 3:.2f}x"
    assert row["acceptance"] == f"{100 * (4 + 2 + 4) / (7 + 4 + 7):.1f}%"
    assert row["date"].endswith("UTC")
    assert table.set_index("id").loc[mine]["mean speedup"] == "-"


def test_turn_table_and_plots(seeded):
    store, a, _, _ = seeded
    turns = stats_tab.turn_table(store, None, a)
    assert list(turns.columns) == stats_tab.TURN_COLUMNS
    assert list(turns["turn"]) == [1, 2, 3, 4, 5]
    assert list(turns["speculation"]) == ["off", "on", "on", "off", "on"]
    assert list(turns["tokens/s"]) == ["10.0", "25.0", "15.0", "12.0", "30.0"]
    assert list(turns["speedup"]) == ["-", f"{25 / 11:.2f}x", f"{15 / 11:.2f}x", "-", "2.50x"]
    assert turns["stop"][2] == "stopped (interrupted)"
    assert turns["acceptance"][1] == f"{100 * 4 / 7:.1f}%"

    frames = stats_tab.plot_frames(store, None, a)
    assert list(frames.speedup["turn"]) == [2, 3, 5]
    assert list(frames.speedup["speedup"]) == pytest.approx([25 / 11, 15 / 11, 2.5], abs=0.005)
    # Pooled over the turns: position 1 accepted 3+2+3 of 4+2+4, position 2: 1+0+1 of 3+2+3.
    assert list(frames.acceptance["position"]) == ["1", "2"]
    assert list(frames.acceptance["acceptance"]) == pytest.approx([8 / 10, 2 / 8])
    assert list(frames.acceptance["drafted"]) == [10, 8]
    assert list(frames.tokens_per_s["speculation"]) == ["off", "on", "on", "off", "on"]
    assert list(frames.tokens_per_s["tokens/s"]) == pytest.approx([10, 25, 15, 12, 30])

    empty = stats_tab.plot_frames(store, None, None)
    assert empty.speedup.empty and empty.acceptance.empty and empty.tokens_per_s.empty


def test_reopened_conversation_is_chatbot_messages(seeded):
    store, a, _, _ = seeded
    messages = stats_tab.chat_history(store, None, a)
    assert len(messages) == 10
    assert [m["role"] for m in messages[:2]] == ["user", "assistant"]
    assert messages[0]["content"] == "What is 2+2?"
    assert messages[1]["content"].startswith("4\n\n*speculation off")
    assert "2.50x" in messages[9]["content"] and "k=2" in messages[9]["content"]
    assert "stopped" in messages[5]["content"]


def test_visitor_isolation(seeded):
    store, a, b, mine = seeded
    assert list(stats_tab.conversation_table(store, "sess-a")["id"]) == [a]
    assert [v for _, v in stats_tab.conversation_choices(store, "sess-a")] == [a]
    # A asks for B's conversation by id: nothing comes back.
    assert stats_tab.turn_table(store, "sess-a", b).empty
    assert stats_tab.chat_history(store, "sess-a", b) == []
    assert stats_tab.plot_frames(store, "sess-a", b).tokens_per_s.empty
    assert stats_tab.export_csv(store, "sess-a", b) is None
    assert "not yours" in stats_tab.delete_conversation(store, "sess-a", b)
    assert stats_tab.delete_conversation(store, "sess-a", mine).startswith("Nothing deleted")
    assert {c["id"] for c in store.conversations()} == {a, b, mine}
    # A request without a session sees nothing.
    assert stats_tab.conversation_table(store, stats_tab.NOBODY).empty
    # Each visitor can delete their own.
    assert stats_tab.delete_conversation(store, "sess-b", b) == "Conversation deleted."
    assert {c["id"] for c in store.conversations()} == {a, mine}


def test_owner_resolution_from_requests():
    visitor = gr.Request(session_hash="sess-a")
    owner = gr.Request(username="alice", session_hash="sess-o")
    is_owner = lambda request: request.username is not None  # noqa: E731 (authenticated = owner)
    assert stats_tab.viewer_owner(visitor, is_owner) == "sess-a"
    assert stats_tab.viewer_owner(owner, is_owner) is None
    assert stats_tab.viewer_owner(None, is_owner) == stats_tab.NOBODY
    assert stats_tab.viewer_owner(gr.Request(), is_owner) == stats_tab.NOBODY
    assert stats_tab.conversation_owner(visitor, is_owner) == "sess-a"
    assert stats_tab.conversation_owner(owner, is_owner) == "alice"
    assert stats_tab.conversation_owner(None, is_owner) == "local"


def test_export_csv_file(seeded):
    store, a, _, _ = seeded
    path = stats_tab.export_csv(store, "sess-a", a)
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
    requests from visitor A, visitor B and the owner."""
    store, a, b, mine = seeded
    with gr.Blocks() as demo:
        with gr.Tab("Stats") as tab:
            tab_ui = stats_tab.build_stats_tab(
                store, lambda request: request.username == "owner", demo)
        tab_ui.refresh_on(tab.select)
    fns = {fn.name: fn for fn in demo.fns.values()}
    sessions = {}  # session hash -> its browser state (e.g. the picker's current choices)

    def call(name, inputs, request):
        state = sessions.setdefault(request.session_hash, SessionState(demo))
        return asyncio.run(demo.process_api(block_fn=fns[name], inputs=inputs, state=state,
                                            request=request))["data"]

    visitor_a = gr.Request(session_hash="sess-a")
    status, table, picker = call("on_refresh", [None], visitor_a)
    assert status == "" and [row[-1] for row in table["data"]] == [a]
    assert picker["value"] == a  # the newest visible conversation is picked
    owner = gr.Request(username="owner", session_hash="sess-o")
    _, table, _ = call("on_refresh", [None], owner)
    assert [row[-1] for row in table["data"]] == [mine, b, a]

    turns, speedup, acceptance, tokens, history, _ = call("on_pick", [a], visitor_a)
    assert len(turns["data"]) == 5 and len(speedup["data"]) == 3 and len(acceptance["data"]) == 2
    assert len(tokens["data"]) == 5 and len(history) == 10
    (path,) = call("on_export", [a], visitor_a)
    assert path["path"].endswith(".csv")

    # B's browser never lists A's conversation, so it cannot even submit its id.
    visitor_b = gr.Request(session_hash="sess-b")
    _, table, picker = call("on_refresh", [None], visitor_b)
    assert [row[-1] for row in table["data"]] == [b] and picker["value"] == b
    with pytest.raises(gr.Error):
        call("on_delete", [a], visitor_b)
    assert store.conversation(a) is not None
    (message,) = call("on_delete", [a], visitor_a)
    assert message == "Conversation deleted." and store.conversation(a) is None
