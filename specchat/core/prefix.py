"""Whole pages of past prompts' keys and values, kept for the prompts that start the same way.

The engine's own cache holds one conversation: a request reuses what it shares with the last
one. This store keeps more: after each prompt, the keys and values of its whole pages (the
tokens `Engine._prefill` encodes a page at a time, from position 0), at most `max_tokens`
tokens in all. A later prompt that starts with the same pages (the chat format's few-shot
preamble, a system prompt, a shared document) takes them from here instead of encoding them,
on the page, the API, `generate` and the bench alike.

A page is kept once, under the tokens from position 0 to its end: prompts that share their
first pages share those pages' tensors (every chat shares the preamble's), and each adds only
the pages of its own. Least recently used pages go first, and a page is always used after the
pages that continue it, so a page leaves before the page it continues: what remains of a
prompt is always a run of pages from position 0.

With the keys and values a page keeps the target's features of its tokens (the final norm's
output) where a drafter reads them (the EAGLE head): a prompt that takes its pages from here
hands them to the drafter as a fresh encoding would, instead of leaving it to compute them
with a forward of its own.

Reuse is exact: a whole page's keys and values depend only on the tokens up to its end, and
every prompt encodes its whole pages the same way, so a page from here is the page a fresh
encoding would compute, bit for bit. The same request gives the same text with the store full
or empty.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

# Tokens kept by default: 8,192 is 300 MB of float32 keys and values for the embedded Gemma 3
# 270M (36 KB a token; 2.5 KB more of float32 features where the head reads them) and 460 MB
# of bf16 ones for an 8B Llama (56 KB a token; 8 KB more of bf16 features).
PREFIX_CACHE_TOKENS = 8192


class PrefixStore:
    def __init__(self, max_tokens: int = PREFIX_CACHE_TOKENS, page: int = 64):
        self.max_tokens, self.page = max_tokens, page
        # the tokens from position 0 to a page's end -> per layer that page's (keys, values)
        # [batch, heads, page, dim]
        self.pages: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = \
            OrderedDict()
        self.features: dict[tuple[int, ...], torch.Tensor] = {}  # page -> features [page, d]
        self.hits = 0  # prompts that took pages from here

    @property
    def tokens(self) -> int:
        return len(self.pages) * self.page

    @property
    def entries(self) -> list[tuple[int, ...]]:
        """The prompts held whole: the pages no other page continues, least recently used
        first (each one's earlier pages are held too)."""
        ends = {len(ids) for ids in self.pages}
        return [ids for ids in self.pages
                if len(ids) + self.page not in ends
                or not any(len(o) == len(ids) + self.page and o[:len(ids)] == ids
                           for o in self.pages)]

    def longest(self, prompt_ids: list[int], limit: int) -> tuple[tuple[int, ...] | None, int]:
        """The most whole pages of `prompt_ids` held, as (the tokens they cover, how many):
        at most `limit` tokens, a multiple of the page."""
        prompt, n = tuple(prompt_ids), 0
        while n + self.page <= limit and prompt[:n + self.page] in self.pages:
            n += self.page
        return (prompt[:n], n) if n else (None, 0)

    def _chain(self, ids: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
        return [ids[:end] for end in range(self.page, n + 1, self.page)]

    def _touch(self, chain: list[tuple[int, ...]]) -> None:
        for key in reversed(chain):  # the first page last: the most recently used
            self.pages.move_to_end(key)

    def restore(self, ids: tuple[int, ...], n: int, cache) -> torch.Tensor | None:
        """Write the first n tokens of `ids` (held, `longest`) into `cache`, an empty one.
        Returns their features [n, d] where every page kept them, else None."""
        chain = self._chain(ids, n)
        held = [self.pages[key] for key in chain]
        for layer in range(len(held[0])):
            cache.update(torch.cat([page[layer][0] for page in held], dim=2),
                         torch.cat([page[layer][1] for page in held], dim=2), layer)
        self._touch(chain)
        self.hits += 1
        features = [self.features.get(key) for key in chain]
        return None if any(f is None for f in features) else torch.cat(features)

    def add(self, prompt_ids: list[int], cache, n: int,
            features: dict[int, torch.Tensor] | None = None) -> None:
        """Keep the first n tokens of `cache` (whole pages of `prompt_ids`): the pages not
        held yet, each a copy of its own slots, and with each the features `features` has for
        it (page start -> [page, d], the pages this prompt encoded)."""
        if n <= 0 or n > self.max_tokens:
            return
        chain = self._chain(tuple(prompt_ids[:n]), n)
        for key in chain:
            a, b = len(key) - self.page, len(key)
            if key not in self.pages:
                self.pages[key] = [(layer.keys[:, :, a:b].clone(), layer.values[:, :, a:b].clone())
                                   for layer in cache.layers]
            if features and a in features and key not in self.features:
                self.features[key] = features[a].clone()
        self._touch(chain)
        while self.tokens > self.max_tokens:
            key, _ = self.pages.popitem(last=False)
            self.features.pop(key, None)

    def snapshot(self) -> tuple[OrderedDict, dict]:
        """The pages as they are now (the tensors shared, not copied), for `restore_snapshot`:
        the bench gives every mode the store one question found."""
        return OrderedDict(self.pages), dict(self.features)

    def restore_snapshot(self, held: tuple[OrderedDict, dict]) -> None:
        self.pages, self.features = OrderedDict(held[0]), dict(held[1])

    def clear(self) -> None:
        self.pages.clear()
        self.features.clear()
