"""What each owner said before: an n-gram index over their past prompts and replies, so that
phrasing repeated across conversations drafts well (SuffixDecoding, Oliaro et al. 2024;
llama.cpp's `ngram-cache`).

    history = History()
    history.add("user:ada", prompt_ids + reply_ids)       # a finished reply, with its prompt
    n, draft = history.lookup("user:ada", context, k=4)   # what followed context's last n tokens

Per owner, always: a lookup reads only the asking owner's own text, so neither a draft nor the
speed of a reply can reveal what another visitor wrote. Drafts from here are verified like any
other, so replies stay plain decoding's text. Memory is bounded: each owner keeps their latest
`max_tokens`, and the owners added to least recently go once all of them hold more than
`max_total` tokens (about 0.5 kB of index per token: 32 MB at the default).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

HISTORY_TOKENS = 8_192  # per owner
HISTORY_TOTAL = 65_536  # all owners together
MIN_MATCH = 2  # shorter matches across conversations are guesses


class _Index:
    """One owner's documents, concatenated, and {n-gram: position after its latest end}."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.tokens: list[int] = []
        self.starts: list[int] = []  # where each document starts in `tokens`
        self.grams: dict[tuple[int, ...], int] = {}

    def add(self, ids: list[int], max_tokens: int) -> None:
        self.starts.append(len(self.tokens))
        self.tokens.extend(ids)
        if len(self.tokens) > max_tokens:
            # Drop whole documents, oldest first, down to 3/4 of the bound (so the re-index
            # comes once in a while, not with every reply), then index what is left.
            room = max_tokens * 3 // 4
            keep = next((s for s in self.starts if len(self.tokens) - s <= room), None)
            if keep is None:  # the newest document alone is too long: its tail
                keep = len(self.tokens) - max_tokens
            self.tokens = self.tokens[keep:]
            self.starts = [max(0, s - keep) for s in self.starts if s - keep >= 0] or [0]
            self.grams = {}
            self._index(0)
        else:
            self._index(self.starts[-1])

    def _index(self, first: int) -> None:
        # n-grams ending before a document's last token (so a hit has a continuation), never
        # across two documents
        bounds = self.starts + [len(self.tokens)]
        for start, end in zip(bounds, bounds[1:]):
            if end <= first:
                continue
            for stop in range(max(start, first) + MIN_MATCH, end):
                for n in range(MIN_MATCH, min(self.max_n, stop - start) + 1):
                    self.grams[tuple(self.tokens[stop - n:stop])] = stop


class History:
    def __init__(self, max_tokens: int = HISTORY_TOKENS, max_total: int = HISTORY_TOTAL,
                 max_n: int = 4):
        self.max_tokens, self.max_total, self.max_n = max_tokens, max_total, max_n
        self._owners: OrderedDict[str, _Index] = OrderedDict()
        # The engine adds and looks up under its own lock; the page forgets from other threads.
        self._lock = threading.Lock()

    def add(self, owner: str, ids: list[int]) -> None:
        """Remember `ids` (a prompt and its reply) as `owner`'s."""
        if not owner or len(ids) <= MIN_MATCH or self.max_tokens <= 0:
            return
        with self._lock:
            index = self._owners.pop(owner, None) or _Index(self.max_n)
            self._owners[owner] = index  # the most recently used last
            index.add(list(ids), self.max_tokens)
            total = sum(len(i.tokens) for i in self._owners.values())
            while total > self.max_total and len(self._owners) > 1:
                total -= len(self._owners.popitem(last=False)[1].tokens)

    def lookup(self, owner: str, context: list[int], k: int) -> tuple[int, list[int]]:
        """(n, up to k tokens): what followed the longest suffix of `context` (n tokens, n from
        max_n down to MIN_MATCH) in `owner`'s history, up to the end of that document; (0, [])
        when nothing matches."""
        index = self._owners.get(owner) if owner else None
        if index is None or k <= 0:
            return 0, []
        for n in range(min(self.max_n, len(context)), MIN_MATCH - 1, -1):
            at = index.grams.get(tuple(context[-n:]))
            if at is not None:
                end = next((s for s in index.starts if s > at), len(index.tokens))
                return n, index.tokens[at:min(at + k, end)]
        return 0, []

    def forget(self, owner: str) -> None:
        with self._lock:
            self._owners.pop(owner, None)

    def clear(self) -> None:
        with self._lock:
            self._owners.clear()

    def tokens(self, owner: str) -> int:
        index = self._owners.get(owner)
        return len(index.tokens) if index else 0
