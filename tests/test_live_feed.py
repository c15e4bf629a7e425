"""A streaming reply's own feed (ui/live.py): the page's script reads the reply's tokens as
server-sent events, gradio carries only the echo and the end, and a page that leaves mid-reply
stops it (recorded as cancelled). On the tiny random pair, with starlette's test client."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient
from test_ui import char_kinds_from_html, engine, make_app, store  # noqa: F401 - fixtures
from tiny import served_on_loopback

from specchat.core.events import TokenEvent
from specchat.ui import live
from specchat.ui.state import Session, Settings


@pytest.fixture
def client():
    with TestClient(Starlette(routes=live.routes())) as c:
        yield c


def read(client: TestClient, name: str, last: str | None = None) -> tuple[int, list[tuple]]:
    """(status, [(event, id, data)]) of one request for the feed `name`."""
    headers = {"Last-Event-ID": last} if last is not None else {}
    events, event = [], {}
    with client.stream("GET", f"/specchat/live/{name}", headers=headers) as r:
        for line in r.iter_lines():
            if not line:  # (a block without data, such as `retry`, dispatches nothing)
                if "data" in event:
                    events.append((event.get("event", "message"), event.get("id"),
                                   event["data"]))
                event = {}
            else:
                field, _, value = line.partition(": ")
                event[field] = value
        return r.status_code, events


def test_the_feed_carries_the_reply_while_gradio_carries_only_its_echo_and_end(
        engine, store, client):  # noqa: F811
    app = make_app(engine, store)
    session = Session()
    app.user("tell me a story", session)
    updates = app.bot(session, Settings(max_new_tokens=200, seed=3, adaptive=False), live=True)
    echo, _, _ = next(updates)
    turn = session.turns[-1]
    assert turn.feed and "sc-cursor" in echo[-1]["content"]
    assert json.loads(live.announce(turn.key, turn.feed)) == {"key": turn.key, "feed": turn.feed}
    rest: list = []
    reply = threading.Thread(target=lambda: rest.extend(updates))
    reply.start()
    status, events = read(client, turn.feed)
    reply.join()
    assert status == 200 and events[-1][0] == "end"
    drawn = []
    for kind, last_id, data in events[:-1]:
        assert kind == "message"
        batch = json.loads(data)
        assert batch["key"] == turn.key and batch["from"] == len(drawn)
        drawn.extend(batch["tokens"])
        assert int(last_id) == len(drawn)
    assert [(t.text, t.kind) for t in turn.tokens] == [(text, kind) for text, kind, _, _ in drawn]
    assert len(rest) == 1  # no repaint through gradio mid-reply: the final render only
    chat = rest[0][0]
    assert "".join(ch for ch, _ in char_kinds_from_html(chat[-1]["content"])) == turn.reply
    assert turn.stats.stop_reason == "length"
    assert read(client, turn.feed) == (204, [])  # ended: the browser does not reconnect


def test_a_reconnecting_browser_gets_what_it_missed_and_strangers_get_nothing(client):
    tokens = [TokenEvent(i, f"t{i}", "target", i, 0, 0) for i in range(5)]
    name, feed = live.open_feed("k1", tokens, [], threading.Event())
    try:
        feed.done = True  # every token is in: the stream sends them and ends
        status, events = read(client, name, last="3")
        assert status == 200 and [e[0] for e in events] == ["message", "end"]
        batch = json.loads(events[0][2])
        assert batch["from"] == 3 and [t[0] for t in batch["tokens"]] == ["t3", "t4"]
        assert events[0][1] == "5"
        assert read(client, name, last="x") == (204, [])  # a malformed id reads nothing
        assert read(client, name + "x") == (204, [])  # nor does a name never given out
    finally:
        live.close_feed(name)
    assert read(client, name) == (204, [])


def test_a_page_that_leaves_mid_reply_stops_it_and_the_turn_says_cancelled(engine, store):  # noqa: F811
    app = make_app(engine, store)
    session = Session()
    app.user("tell me a long story", session)
    updates = app.bot(session, Settings(max_new_tokens=400, seed=3, speculation=False),
                      live=True)
    next(updates)
    feed = live._feeds[session.turns[-1].feed]
    feed.left.set()  # what the route does when the page's stream closes before the end
    feed.stop.set()
    chat, _, _ = list(updates)[-1]
    turn = session.turns[-1]
    assert turn.stats.stop_reason == "cancelled" and len(turn.tokens) < 400
    assert "sc-cursor" not in chat[-1]["content"]
    assert app.writer.flush(10)
    row = store.turns(session.conversation_id)[-1]
    assert row["interrupted"] and row["stop_reason"] == "cancelled"


def test_a_dropped_feed_that_reconnects_keeps_its_reply_and_one_left_for_good_stops_it(
        monkeypatch):
    """Over real sockets (uvicorn on loopback): a stream that drops is a page that may come
    back; its reply stops only when no stream has read the feed for GRACE_S."""
    monkeypatch.setattr(live, "GRACE_S", 0.5)
    tokens = [TokenEvent(i, f"t{i}", "target", i, 0, 0) for i in range(3)]
    stop = threading.Event()
    name, feed = live.open_feed("k2", tokens, [], stop)
    try:
        with served_on_loopback(Starlette(routes=live.routes())) as url, httpx.Client() as web:
            for _ in range(2):  # read a batch, then drop the stream; the next comes at once
                with web.stream("GET", f"{url}/specchat/live/{name}") as r:
                    assert any(line.startswith("data:") for line in r.iter_lines())
            with web.stream("GET", f"{url}/specchat/live/{name}",
                            headers={"Last-Event-ID": "3"}):
                time.sleep(1.0)  # open past the grace of the drops before
                assert not stop.is_set() and not feed.left.is_set()
            deadline = time.monotonic() + 10
            while not stop.is_set() and time.monotonic() < deadline:
                time.sleep(0.05)
        assert stop.is_set() and feed.left.is_set()  # nobody came back: the reply stops
    finally:
        live.close_feed(name)
