"""The live view of a streaming reply: compact token records, drawn by a small script in the
page, instead of the whole reply re-rendered on every repaint.

A repaint of the Chatbot sends the reply's whole HTML and the browser rebuilds the message
(hundreds of spans, sanitized), a cost that grows with the reply and that the engine pays too
on a machine whose cores the browser shares. So while a reply streams the page sends only the
tokens that came since the last repaint, as JSON in a hidden textbox (`#sc-live`); `LIVE_JS`
appends them to the reply's element as colored spans (text and titles set as text, never as
markup). The first render (the echo, a place in the line) and the last (markup, ghost text,
charts and step cards) go through the Chatbot as before.
"""

from __future__ import annotations

import json

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


# Appends a batch to its reply, before the cursor; a batch that does not follow the tokens
# already drawn (`from`) is dropped, and the reply's final render replaces them all.
LIVE_JS = """(batch) => {
  if (!batch) return;
  let data;
  try { data = JSON.parse(batch); } catch (e) { return; }
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
}"""
