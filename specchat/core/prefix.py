"""Whole pages of past prompts' keys and values, kept for the prompts that start the same way.

The engine's own cache holds one conversation: a request reuses what it shares with the last
one. This store keeps more: after each prompt, the keys and values of its whole pages (the
tokens `Engine._prefill` encodes a page at a time, from position 0), least recently used out
first, at most `max_tokens` tokens in all. A later prompt that starts with the same pages (the
chat format's few-shot preamble, a system prompt, a shared document) takes them from here
instead of encoding them, on the page, the API, `generate` and the bench alike.

Reuse is exact: a whole page's keys and values depend only on the tokens up to its end, and
every prompt encodes its whole pages the same way, so a page from here is the page a fresh
encoding would compute, bit for bit. The same request gives the same text with the store full
or empty.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from specchat.core.drafter import common_prefix_len

# Tokens kept by default: 8,192 is 300 MB of float32 keys and values for the embedded Gemma 3
# 270M (36 KB a token) and 460 MB of bf16 ones for an 8B Llama (56 KB a token).
PREFIX_CACHE_TOKENS = 8192


class PrefixStore:
    def __init__(self, max_tokens: int = PREFIX_CACHE_TOKENS, page: int = 64):
        self.max_tokens, self.page = max_tokens, page
        # prompt tokens of whole pages -> per layer (keys, values) [batch, heads, tokens, dim]
        self.entries: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = \
            OrderedDict()
        self.hits = 0  # prompts that took pages from here

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.entries)

    def longest(self, prompt_ids: list[int], limit: int) -> tuple[tuple[int, ...] | None, int]:
        """The entry sharing the most whole pages with `prompt_ids`, and how many tokens of it
        to take: at most `limit`, a multiple of the page."""
        best, most, prompt = None, 0, tuple(prompt_ids)
        for ids in self.entries:
            n = min(common_prefix_len(ids, prompt), limit) // self.page * self.page
            if n > most:
                best, most = ids, n
        return best, most

    def restore(self, ids: tuple[int, ...], n: int, cache) -> None:
        """Write the first n tokens of entry `ids` into `cache`, an empty one."""
        for layer, (keys, values) in enumerate(self.entries[ids]):
            cache.update(keys[:, :, :n], values[:, :, :n], layer)
        self.entries.move_to_end(ids)
        self.hits += 1

    def add(self, prompt_ids: list[int], cache, n: int) -> None:
        """Keep the first n tokens of `cache` (whole pages of `prompt_ids`), unless an entry
        holds them already; entries they extend are dropped."""
        ids = tuple(prompt_ids[:n])
        if n <= 0 or n > self.max_tokens:
            return
        for held in self.entries:
            if held[:n] == ids:
                self.entries.move_to_end(held)
                return
        for held in [h for h in self.entries if ids[:len(h)] == h]:
            del self.entries[held]
        self.entries[ids] = [(layer.keys[:, :, :n].clone(), layer.values[:, :, :n].clone())
                             for layer in cache.layers]
        while self.tokens > self.max_tokens:
            self.entries.popitem(last=False)

    def snapshot(self) -> OrderedDict:
        """The entries as they are now (the tensors shared, not copied), for `restore_snapshot`:
        the bench gives every mode the store one question found."""
        return OrderedDict(self.entries)

    def restore_snapshot(self, entries: OrderedDict) -> None:
        self.entries = OrderedDict(entries)

    def clear(self) -> None:
        self.entries.clear()
