"""Prompt lookup: propose what followed the latest earlier occurrence of the last few tokens."""

from __future__ import annotations

import torch

from specchat.core.drafter import NO_DRAFT, Drafter


class NgramDrafter(Drafter):
    """Prompt lookup: find the last n tokens (n = max_n..1) earlier in the conversation and
    propose what followed them there. Drafts are one-hot: q(x) = 1 for the proposed token.
    Where the conversation has no match of two tokens or more, the owner's earlier
    conversations are looked up (`use_history`, core/history.py): their class is
    "history-<n>", so the engine keeps their acceptance apart.

    An index {n-gram: position after its latest occurrence} is updated incrementally, so a
    proposal costs O(k) however long the conversation is.
    """

    name = "ngram"

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self._index: list[dict[tuple[int, ...], int]] = []
        self._indexed = 0  # positions < this are in the index
        self._history = None  # lookup(context, k) over the owner's past text, or None

    def use_history(self, lookup) -> None:
        self._history = lookup

    def begin(self, prompt_ids: list[int]) -> None:
        self._index = [dict() for _ in range(self.max_n + 1)]
        self._indexed = 0

    def _extend_index(self, context: list[int]) -> None:
        # Index every n-gram ending strictly before the last token, so a hit always has a
        # continuation, and the context's own suffix never matches itself.
        for end in range(max(self._indexed, 1), len(context)):
            for n in range(1, min(self.max_n, end) + 1):
                self._index[n][tuple(context[end - n:end])] = end
        self._indexed = max(self._indexed, len(context))

    def _match(self, context: list[int]) -> tuple[int, int]:
        """(n, start): the longest n <= max_n whose last-n-token suffix occurred before, and the
        position after its latest occurrence; (0, -1) when even the last token is new."""
        self._extend_index(context)
        for n in range(min(self.max_n, len(context) - 1), 0, -1):
            start = self._index[n].get(tuple(context[-n:]))
            if start is not None:
                return n, start
        return 0, -1

    def draft_class(self, context: list[int]) -> int | str:
        """The length of the match the next proposal will copy from (0: none), or
        "history-<n>" for a match in the owner's history. Longer matches are accepted far more
        often; the engine keeps acceptance per class to size k."""
        if len(context) < 2:
            return 0
        n = self._match(context)[0]
        if n < 2 and self._history is not None:
            found = self._history(context, 1)[0]
            if found:
                return f"history-{found}"
        return n

    def propose(self, context, k, params, noise):
        if k <= 0 or len(context) < 2:
            return NO_DRAFT, None
        n, start = self._match(context)
        if n < 2 and self._history is not None:
            found, draft = self._history(context, k)
            if found:
                return torch.tensor(draft, dtype=torch.long), None
        if not n:
            return NO_DRAFT, None
        # What followed the match, continued periodically: in text that repeats itself the
        # latest match sits one period back, and its continuation runs into the present;
        # extending by the period keeps proposing the full k tokens.
        period = len(context) - start
        draft = [context[start + i % period] for i in range(k)]
        return torch.tensor(draft, dtype=torch.long), None

