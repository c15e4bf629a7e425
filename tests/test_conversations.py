"""Conversations to come back to: listed, searched, reopened and continued (after a restart
too, with the same next reply), renamed, deleted, exported; a visitor reaches only their own."""

from __future__ import annotations

import json
import threading

import pytest
from tiny import byte_tokenizer, loaded, tiny_llama

from specchat.core.engine import Engine
from specchat.core.race import lanes
from specchat.core.request import GenerateConfig
from specchat.drafters.model import ModelDrafter
from specchat.drafters.ngram import NgramDrafter
from specchat.stats.store import StatsStore
from specchat.ui import conversations
from specchat.ui.access import Access
from specchat.ui.handlers import ChatApp
from specchat.ui.state import Session, Settings

CHAT = Settings(max_new_tokens=12, seed=0, adaptive=False, mode="chat", temperature=0.0,
                drafter="ngram", repeat_penalty=1.1, system="Be brief.")


def _engine() -> Engine:
    tok = byte_tokenizer()
    return Engine(loaded(tiny_llama(0), tok),
                  {"ngram": NgramDrafter(), "model": ModelDrafter(tiny_llama(0), len(tok))})


@pytest.fixture(scope="module")
def engine():
    return _engine()


def _say(app: ChatApp, session: Session, text: str, settings: Settings = CHAT,
         request=None, browser=None) -> str:
    box, _, session, notice = app.user(text, session, request, settings)
    assert box == "" and notice == "", notice
    for _ in app.bot(session, settings, request, browser):
        pass
    app.writer.flush(5)
    return session.turns[-1].reply


class Visitor:
    """A gradio request of a visitor of a shared page (one tab)."""

    def __init__(self, tab: str):
        self.session_hash, self.username = tab, None


def test_a_reopened_conversation_continues_with_its_turns_and_settings(engine, tmp_path):
    store = StatsStore(tmp_path / "stats.db")
    app = ChatApp(engine, store, min_interval=0.0)
    session = Session()
    first = _say(app, session, "the cat sat on the mat")
    _say(app, session, "and then?")
    [entry] = conversations.entries(store, None)
    assert entry.turns == 2 and entry.title == "the cat sat on the mat"
    found = conversations.reopen(store, None, entry.id)
    assert [t.user for t in found.session.turns] == ["the cat sat on the mat", "and then?"]
    assert found.session.turns[0].reply == first
    assert found.settings == CHAT  # mode, drafter, samplers, penalties, system prompt
    # the turns come back with what the page showed: their tokens' kinds and their figures
    assert [t.kind for t in found.session.turns[0].tokens] == \
        [t.kind for t in session.turns[0].tokens]
    assert found.session.turns[1].speedup.label() == session.turns[1].speedup.label()
    # its next turn is appended to it, not to a new conversation
    _say(app, found.session, "more", found.settings)
    assert [t["prompt"] for t in store.turns(entry.id)] == \
        ["the cat sat on the mat", "and then?", "more"]
    assert len(store.conversations()) == 1


@pytest.mark.parametrize("speculation", [True, False])
def test_after_a_restart_the_next_reply_is_the_one_the_first_session_would_give(
        tmp_path, speculation):
    settings = Settings(**{**CHAT.__dict__, "speculation": speculation})
    path = tmp_path / "stats.db"
    first_engine = _engine()
    app = ChatApp(first_engine, StatsStore(path), min_interval=0.0)
    session = Session()
    _say(app, session, "the cat sat on the mat", settings)
    _say(app, session, "and the dog?", settings)
    app.writer.close()
    app.store.close()
    # the first session goes on...
    kept = Session(turns=list(session.turns))
    expected = _say(ChatApp(first_engine, StatsStore(":memory:"), min_interval=0.0), kept,
                    "what next?", settings)
    # ...and the same conversation, reopened in a fresh process's app, gives the same reply
    store = StatsStore(path)
    again = ChatApp(_engine(), store, min_interval=0.0)
    [entry] = conversations.entries(store, None)
    found = conversations.reopen(store, None, entry.id)
    assert _say(again, found.session, "what next?", found.settings) == expected


def test_retry_undo_and_the_race_stay_out_of_the_reopened_turns(engine):
    store = StatsStore(":memory:")
    app = ChatApp(engine, store, min_interval=0.0)
    session = Session()
    _say(app, session, "one")
    _say(app, session, "two")
    app.undo(session)  # "two" taken back
    _say(app, session, "three")
    list(app.race(session, CHAT))  # runs of "three", kept for the stats only
    app.writer.flush(5)
    conversation_id = session.conversation_id
    raced = len(lanes(engine, GenerateConfig()))  # plain, then each drafter
    assert [t["prompt"] for t in store.turns(conversation_id)] == \
        ["one", "two", "three"] + ["three"] * raced
    found = conversations.reopen(store, None, conversation_id)
    assert [t.user for t in found.session.turns] == ["one", "three"]
    # Retry takes its reply back too
    app.retry(found.session)
    for _ in app.bot(found.session, CHAT):
        pass
    app.writer.flush(5)
    assert [t.user for t in conversations.reopen(store, None, conversation_id).session.turns] \
        == ["one", "three"]


def test_search_rename_delete_and_exports(engine):
    store = StatsStore(":memory:")
    app = ChatApp(engine, store, min_interval=0.0)
    a, b = Session(), Session()
    _say(app, a, "about zebras")
    _say(app, b, "about 100% of owls_")
    ids = {e.title: e.id for e in conversations.entries(store, None)}
    assert [e.title for e in conversations.entries(store, None, "ZEBRA")] == ["about zebras"]
    # LIKE's wildcards are searched as text
    assert [e.title for e in conversations.entries(store, None, "100%")] == \
        ["about 100% of owls_"]
    assert conversations.entries(store, None, "z_") == []  # not "z" and any letter
    assert conversations.rename(store, None, ids["about zebras"], "  Zebra   notes ") == \
        "Renamed."
    assert {e.title for e in conversations.entries(store, None)} == \
        {"Zebra notes", "about 100% of owls_"}
    assert conversations.rename(store, None, ids["about zebras"], "   ").startswith("Type")
    markdown = conversations.as_markdown(store, None, ids["about zebras"])
    assert markdown.startswith("# Zebra notes") and "## You\n\nabout zebras" in markdown
    exported = json.loads(conversations.as_json(store, None, ids["about zebras"]))
    assert exported["title"] == "Zebra notes"
    assert [t["prompt"] for t in exported["turns"]] == ["about zebras"]
    assert exported["turns"][0]["settings"]["system"] == "Be brief."
    assert store.delete_conversation(ids["about zebras"])
    assert [e.title for e in conversations.entries(store, None)] == ["about 100% of owls_"]


def test_a_visitor_reaches_only_their_own_conversations(engine):
    store = StatsStore(":memory:")
    app = ChatApp(engine, store, access=Access(exposed=True), min_interval=0.0)
    mine, theirs = "a" * 40, "b" * 40
    viewer = app.access.viewer(None, mine).filter
    other = app.access.viewer(None, theirs).filter
    session = Session()
    _say(app, session, "my secret plan", request=Visitor("tab-1"), browser=mine)
    [entry] = conversations.entries(store, viewer)
    assert conversations.entries(store, other) == []
    assert conversations.entries(store, other, "secret") == []
    # a foreign id gets the answer a missing one gets, and changes nothing
    for guessed in (entry.id, "0" * 32):
        assert conversations.reopen(store, other, guessed) is None
        assert conversations.rename(store, other, guessed, "mine now") == conversations.NOT_FOUND
        assert conversations.as_markdown(store, other, guessed) is None
        assert conversations.as_json(store, other, guessed) is None
        assert not store.delete_conversation(guessed, other)
    assert conversations.entries(store, viewer)[0].title == "my secret plan"
    assert conversations.reopen(store, viewer, entry.id) is not None


def test_one_conversation_continued_in_two_tabs_at_once_loses_no_turn(engine):
    store = StatsStore(":memory:")
    app = ChatApp(engine, store, min_interval=0.0)
    first = Session()
    _say(app, first, "start", request=Visitor("tab-0"))
    tabs = [conversations.reopen(store, None, first.conversation_id).session for _ in range(2)]
    errors: list[BaseException] = []

    def continue_in(i: int) -> None:
        try:
            for n in range(3):
                _say(app, tabs[i], f"tab {i} turn {n}", request=Visitor(f"tab-{i + 1}"))
        except BaseException as error:  # noqa: BLE001 (reported by the assertion below)
            errors.append(error)

    threads = [threading.Thread(target=continue_in, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    app.writer.flush(5)
    prompts = [t["prompt"] for t in store.turns(first.conversation_id)]
    assert sorted(prompts) == sorted(["start"] + [f"tab {i} turn {n}" for i in range(2)
                                                  for n in range(3)])
    assert [t["idx"] for t in store.turns(first.conversation_id)] == list(range(1, 8))


# ---------------------------------------------------------------------------------------------
# In Chromium: the sidebar beside the chat

from test_browser import CHROMIUM, CHROMIUM_ARGS, WAIT_MS, _sync_playwright, served  # noqa: E402,F401


def _labels(page) -> list[str]:
    return page.locator("#sc-conversations label").all_inner_texts()


def test_the_sidebar_continues_searches_renames_deletes_and_exports(served):  # noqa: F811
    sync_playwright = _sync_playwright()
    url, store = served
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            # a laptop: the sidebar starts closed, one click away
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(WAIT_MS)
            page.goto(url)
            page.wait_for_selector("#sc-status .sc-status-ready")
            page.wait_for_selector("#sc-sidebar:not(.open)")
            page.click("#sc-sidebar .toggle-button")
            page.wait_for_selector("#sc-sidebar.open")
            box = page.locator("#sc-input textarea")
            for n, text in enumerate(["<i>zebra</i> notes", "owl facts"]):
                if n:
                    page.click("#sc-new")
                    page.wait_for_function("!document.querySelector('#sc-chat .sc-stats')")
                box.fill(text)
                box.press("Enter")
                page.wait_for_selector("#sc-chat .sc-stats")
                page.wait_for_function(
                    "t => [...document.querySelectorAll('#sc-conversations label')]"
                    ".some(l => l.innerText.startsWith(t))", arg=text)
            labels = _labels(page)
            assert labels[0].startswith("owl facts") and labels[1].startswith("<i>zebra</i>")
            assert page.locator("#sc-conversations i").count() == 0  # a title is text

            # Continue the first: its turn comes back, the next reply is appended to it.
            page.locator("#sc-conversations label").nth(1).click()
            page.wait_for_function("document.querySelector('#sc-chat').innerText"
                                   ".includes('<i>zebra</i> notes')")
            assert page.locator("#sc-chat .sc-stats").count() == 1
            box.fill("and more")
            box.press("Enter")
            page.wait_for_function("document.querySelectorAll('#sc-chat .sc-stats').length == 2")
            page.wait_for_function("document.querySelector('#sc-conversations label')"
                                   ".innerText.startsWith('<i>zebra</i>')")  # active: first
            zebra = next(c for c in store.conversations() if c["title"].startswith("<i>"))
            assert [t["prompt"] for t in store.turns(zebra["id"])] == \
                ["<i>zebra</i> notes", "and more"]

            # Search filters by text, in prompts and replies too.
            page.fill("#sc-conv-search input", "more")
            page.wait_for_function(
                "document.querySelectorAll('#sc-conversations label').length == 1")
            page.fill("#sc-conv-search input", "")
            page.wait_for_function(
                "document.querySelectorAll('#sc-conversations label').length == 2")

            # Rename, export, then delete (asked first) the open conversation.
            page.click("#sc-conv-actions button.label-wrap")
            page.fill("#sc-conv-title input", "Zebra, renamed")
            page.click("#sc-conv-rename")
            page.wait_for_function("document.querySelector('#sc-conversations label')"
                                   ".innerText.startsWith('Zebra, renamed')")
            page.click("#sc-conv-md")
            page.wait_for_selector("#sc-conv-file a[href*='.md']")
            page.click("#sc-conv-delete")
            page.wait_for_selector("#sc-conv-message:has-text('cannot be undone')")
            page.click("#sc-conv-delete")
            page.wait_for_selector("#sc-conv-message:has-text('Conversation deleted.')")
            page.wait_for_function(
                "document.querySelectorAll('#sc-conversations label').length == 1")
            assert page.locator("#sc-chat .sc-stats").count() == 0  # the chat starts afresh
            assert all(not c["title"].startswith("Zebra") for c in store.conversations())
        finally:
            browser.close()
