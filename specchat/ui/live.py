"""The live view of a streaming reply: the page's own stream of compact token records, drawn by
a small script in the page, instead of the whole reply re-rendered through gradio.

Every message gradio sends a page costs the server its hand-over and send and the browser its
handling (some 30-40 ms of CPU together), on cores the engine decodes on when the browser shares
the machine. So a streaming reply reaches the page by a stream of its own: at the reply's start
the page gets the name of its feed (one unguessable token, through gradio, in the hidden textbox
`#sc-live`), and its script (`LIVE_JS`) reads the feed's server-sent events
(`/specchat/live/<feed>`): every `LIVE_S` seconds, the tokens that came since the last batch,
which it appends to the reply's element as colored spans (text and titles set as text, never as
markup). The reply's thread never waits for the page, nor gradio for the engine. The first
render (the echo, a place in the line) and the last (markup, ghost text, charts and step cards)
go through the Chatbot as before. A page that goes away mid-reply closes its feed, and the
reply stops at its next step once no page has read the feed for `GRACE_S` (a dropped stream
reconnects within a second, from the last token it had).

The feed's name is the capability: it goes only to the page whose reply it is (through that
page's own gradio session, behind its login where there is one), and it names no other data.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from specchat.core.events import RESAMPLED, StepRecord, TokenEvent
from specchat.ui.inspector import refused_drafts
from specchat.ui.render import token_title


def records(key: str, tokens: list[TokenEvent], start: int,
            steps: dict[int, StepRecord]) -> str:
    """The tokens from `start` on of the turn `key`, as the page's script takes them:
    {"key", "from", "tokens": [[text, kind, title, ghost], ...]} (ghost: the drafts a
    resampled token's step refused, "" for none)."""
    out = []
    for tok in tokens[start:]:
        record = steps.get(tok.step)
        ghost = ""
        if tok.kind == RESAMPLED and record is not None:
            refused = refused_drafts(record)
            ghost = "".join(refused) if record.parents is None else " | ".join(refused)
        out.append([tok.text, tok.kind, token_title(tok), ghost])
    return json.dumps({"key": key, "from": start, "tokens": out}, ensure_ascii=False)


LIVE_S = 0.2  # seconds between two batches of a streaming reply's feed
# A page whose feed dropped (a network blip) reconnects within a second (the stream's `retry`);
# a reply stops only when no page has read its feed for this long.
GRACE_S = 3.0
ROUTE = "/specchat/live/{feed}"


@dataclass
class Feed:
    """One streaming reply's tokens for its page: the lists its reader fills (read here, never
    written), the reply's stop flag, and `left`, set when the page went away mid-reply."""
    key: str
    tokens: list[TokenEvent]
    steps: list[StepRecord]
    stop: threading.Event
    done: bool = False  # the reply ended: the stream sends what is left and ends
    left: threading.Event = field(default_factory=threading.Event)
    readers: int = 0  # streams open on it (counted on the server's event loop)


_feeds: dict[str, Feed] = {}
_feeds_lock = threading.Lock()


def open_feed(key: str, tokens: list[TokenEvent], steps: list[StepRecord],
              stop: threading.Event) -> tuple[str, Feed]:
    """A feed for the reply `key` whose tokens come into `tokens`: -> (its name, the feed)."""
    name = secrets.token_urlsafe(18)
    feed = Feed(key, tokens, steps, stop)
    with _feeds_lock:
        _feeds[name] = feed
    return name, feed


def close_feed(name: str) -> None:
    """The reply ended: its stream sends what is left and ends; the name is forgotten."""
    with _feeds_lock:
        feed = _feeds.pop(name, None)
    if feed is not None:
        feed.done = True


def announce(key: str, name: str) -> str:
    """What the page's script takes to open the reply's feed."""
    return json.dumps({"key": key, "feed": name})


async def stream(request: Request) -> Response:
    """GET /specchat/live/<feed>: the feed's records as server-sent events, from the token the
    browser last had (`Last-Event-ID`, when it reconnects), then `end`. A feed that has ended
    or never was: 204, which tells the browser not to reconnect."""
    with _feeds_lock:
        feed = _feeds.get(request.path_params["feed"])
    last = request.headers.get("last-event-id", "0")
    if feed is None or not last.isdigit():
        return Response(status_code=204)

    async def events():
        sent = min(int(last), len(feed.tokens))
        feed.readers += 1
        try:
            yield "retry: 1000\n\n"
            while True:
                done, count = feed.done, len(feed.tokens)
                if count > sent:
                    steps = {r.step: r for r in list(feed.steps)}
                    batch = records(feed.key, feed.tokens[:count], sent, steps)
                    yield f"id: {count}\ndata: {batch}\n\n"
                    sent = count
                if done:
                    yield "event: end\ndata: \n\n"
                    return
                await asyncio.sleep(LIVE_S)
        finally:  # ended early: the page went away, or its stream dropped and it reconnects
            feed.readers -= 1
            if not feed.done:
                asyncio.get_running_loop().call_later(GRACE_S, _unread, feed)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def _unread(feed: Feed) -> None:
    """No page has read the feed for GRACE_S: the page went away, and its reply stops at its
    next step (recorded as cancelled)."""
    if not feed.done and feed.readers == 0:
        feed.left.set()
        feed.stop.set()


def routes() -> list[Route]:
    """The feed's route, for the page's app."""
    return [Route(ROUTE, stream, methods=["GET"])]


# Opens the reply's feed (closing the one before) and appends each batch to the reply, before
# the cursor; a batch that does not follow the tokens already drawn (`from`) is dropped (the
# reply's final render replaces them all), and so is a batch once the reply has no cursor.
LIVE_JS = """(announced) => {
  if (!announced) return;
  let feed;
  try { feed = JSON.parse(announced); } catch (e) { return; }
  if (window.scLiveFeed) window.scLiveFeed.close();
  if (!feed.feed) return;
  const draw = (data) => {
    const turn = document.querySelector('#sc-chat .sc-turn-' + CSS.escape(data.key));
    const reply = turn && turn.querySelector('.sc-reply');
    const cursor = reply && reply.querySelector('.sc-cursor');
    if (!cursor || Number(reply.dataset.drawn || 0) !== data.from) return;
    const log = document.querySelector('#sc-chat [role=log]');
    const follow = log && log.scrollHeight - log.scrollTop - log.clientHeight < 40;
    const frag = document.createDocumentFragment();
    for (const [text, kind, title, ghost] of data.tokens) {
      if (text) {
        const span = document.createElement('span');
        span.className = 'tk tk-' + kind;
        span.title = title;
        span.textContent = text;
        frag.appendChild(span);
      }
      if (ghost) {
        const g = document.createElement('span');
        g.className = 'sc-ghost';
        g.textContent = ghost;
        frag.appendChild(g);
      }
    }
    cursor.before(frag);
    reply.dataset.drawn = String(data.from + data.tokens.length);
    if (follow) log.scrollTop = log.scrollHeight;
  };
  // the page's own folder (a page served under a path keeps it, with or without its slash)
  const folder = location.origin + location.pathname.replace(/\\/?$/, '/');
  const source = new EventSource(folder + 'specchat/live/' + encodeURIComponent(feed.feed));
  window.scLiveFeed = source;
  source.onmessage = (message) => {
    try { draw(JSON.parse(message.data)); } catch (e) { /* the final render follows */ }
  };
  source.addEventListener('end', () => source.close());
}"""
