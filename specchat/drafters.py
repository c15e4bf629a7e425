"""Drafters: whatever proposes the next few tokens for the target to verify.

One small protocol, like transformers' candidate generators: the engine never knows whether the
drafts came from a model or from n-gram lookup.

    begin(prompt_ids)                      a new request starts from this context
    propose(context, k, params, noise) -> (draft_ids [k'], draft_probs [k', vocab] | None)
                                           k' <= k; None probs mean one-hot drafts (the target's
                                           own draw decides); or a tree.DraftTree at most k
                                           levels deep. Draft i is for reply position
                                           len(context) + i: a drafter that samples uses
                                           `noise` at that position (sampling.Noise).
    feedback(n_drafted, n_accepted)        called after each verification

Optional: `draft_class(context)` names the kind of proposal coming next (the n-gram match length)
so the engine sizes k per kind; `needs_features = True` plus `observe(start, ids, features)` gets
the target's hidden states of accepted positions (the EAGLE head, specchat/head.py).

`context` is the full token list so far (prompt + emitted reply); it only grows within a request.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specchat.sampling import Noise, SamplingParams, sample_logits


class Drafter(Protocol):
    name: str

    def begin(self, prompt_ids: list[int]) -> None: ...

    def propose(self, context: list[int], k: int, params: SamplingParams,
                noise: Noise | None) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def feedback(self, n_drafted: int, n_accepted: int) -> None: ...


_EMPTY = torch.zeros(0, dtype=torch.long)


class NgramDrafter:
    """Prompt lookup: find the last n tokens (n = max_n..1) earlier in the conversation and
    propose what followed them there. Drafts are one-hot: q(x) = 1 for the proposed token.

    An index {n-gram: position after its latest occurrence} is updated incrementally, so a
    proposal costs O(k) however long the conversation is.
    """

    name = "ngram"

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self._index: list[dict[tuple[int, ...], int]] = []
        self._indexed = 0  # positions < this are in the index

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

    def draft_class(self, context: list[int]) -> int:
        """The length of the match the next proposal will copy from (0: none). Longer matches
        are accepted far more often; the engine keeps acceptance per class to size k."""
        return self._match(context)[0] if len(context) >= 2 else 0

    def propose(self, context, k, params, noise):
        if k <= 0 or len(context) < 2:
            return _EMPTY, None
        n, start = self._match(context)
        if not n:
            return _EMPTY, None
        # What followed the match, continued periodically: in text that repeats itself the
        # latest match sits one period back, and its continuation runs into the present;
        # extending by the period keeps proposing the full k tokens.
        period = len(context) - start
        draft = [context[start + i % period] for i in range(k)]
        return torch.tensor(draft, dtype=torch.long), None

    def feedback(self, n_drafted, n_accepted):
        pass


class ModelDrafter:
    """A small causal LM sharing the target's vocabulary, with its own KV cache.

    It samples with the same SamplingParams transform as the target, so the q it returns is the
    distribution each draft token was really drawn from (required for losslessness).
    """

    name = "model"

    def __init__(self, model, vocab_size: int, min_confidence: float = 0.0):
        self.model = model
        self.vocab_size = vocab_size  # the target's logits width; the draft's is cut/padded to it
        self.min_confidence = min_confidence  # greedy only: stop drafting under this top prob
        self.device = next(model.parameters()).device
        self.cache = None
        self.cached_ids: list[int] = []  # tokens whose keys/values are in self.cache

    def begin(self, prompt_ids):
        from specchat.kvcache import new_cache
        self.cache = new_cache(self.model)
        self.cached_ids = []

    def _sync(self, context: list[int]) -> list[int]:
        """Crop the cache to the longest prefix it shares with `context`; return the rest."""
        from specchat.kvcache import crop_to
        keep = _common_prefix_len(self.cached_ids, context)
        keep = min(keep, len(context) - 1)  # always feed at least one token to get logits
        crop_to(self.cache, len(self.cached_ids), keep)
        self.cached_ids = self.cached_ids[:keep]
        return context[keep:]

    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> torch.Tensor:
        out = self.model(torch.tensor([ids], device=self.device), past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        self.cached_ids.extend(ids)
        return out.logits[0, -1:, :self.vocab_size]  # [1, vocab], on the draft's device

    def propose(self, context, k, params, noise):
        if k <= 0:
            return _EMPTY, None
        feed = self._sync(context)
        ids, probs = [], []
        for i in range(k):
            logits = self._forward(feed)
            token, p = sample_logits(logits, params, noise, len(context) + i)
            if params.greedy and self.min_confidence > 0 and i > 0:
                if float(torch.softmax(logits.float(), -1).max()) < self.min_confidence:
                    break
            ids.append(int(token))
            if p is not None:
                probs.append(p[0])
            feed = [int(token)]
        draft_ids = torch.tensor(ids, dtype=torch.long)
        return draft_ids, (torch.stack(probs) if probs else None)

    def feedback(self, n_drafted, n_accepted):
        pass  # the cache is re-synced against the real context at the next propose()


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    # Fast path: the usual case is "b extends a" or "differs only near the end".
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search for the first difference on prefix equality
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
