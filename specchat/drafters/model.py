"""A draft model: a small causal LM sharing the target's vocabulary."""

from __future__ import annotations

import torch

from specchat.core.drafter import NO_DRAFT, Drafter, common_prefix_len
from specchat.core.events import TOP
from specchat.core.sampling import sample_logits, top_candidates


class ModelDrafter(Drafter):
    """A small causal LM sharing the target's vocabulary, with its own KV cache.

    It samples with the same SamplingParams transform as the target, so the q it returns is the
    distribution each draft token was really drawn from (required for losslessness).
    """

    name = "model"

    def __init__(self, model, vocab_size: int, paged: bool = False, runner=None):
        from specchat.runners.hf.runner import HFRunner
        self.model = model
        # What runs its forwards (core/runner.py): the draft's LoadedModel.runner, or
        # transformers' own (paged where the draft's attention needs it).
        self.runner = runner or HFRunner(model, paged)
        self.vocab_size = vocab_size  # the target's logits width; the draft's is cut/padded to it
        self.device = next(model.parameters()).device
        self.cache = None
        self.cached_ids: list[int] = []  # tokens whose keys/values are in self.cache
        self.shaper = None  # the request's penalties, applied to the draft's logits too

    def use_penalties(self, shaper):
        self.shaper = shaper

    def begin(self, prompt_ids):
        self.cache = self.runner.new_cache()
        self.cached_ids = []

    def _sync(self, context: list[int]) -> list[int]:
        """Crop the cache to the longest prefix it shares with `context`; return the rest."""
        keep = common_prefix_len(self.cached_ids, context)
        keep = min(keep, len(context) - 1)  # always feed at least one token to get logits
        if not self.runner.crop(self.cache, len(self.cached_ids), keep):
            self.cache, keep = self.runner.new_cache(), 0
        self.cached_ids = self.cached_ids[:keep]
        return context[keep:]

    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> torch.Tensor:
        logits = self.runner.forward(self.cache, ids, len(self.cached_ids), 1)
        self.cached_ids.extend(ids)
        return logits[-1:, :self.vocab_size]  # [1, vocab], on the draft's device

    def propose(self, context, k, params, noise):
        if k <= 0:
            return NO_DRAFT, None
        feed = self._sync(context)
        ids, probs = [], []
        self.last_top = []
        for i in range(k):
            logits = self._forward(feed)
            if self.shaper:  # the draft from the distribution the target's draw will use
                logits = self.shaper.shape(logits, context, [ids])
            self.last_top.append(top_candidates(logits[0], params, TOP)[0])
            token, p = sample_logits(logits, params, noise, len(context) + i)
            ids.append(int(token))
            if p is not None:
                probs.append(p[0])
            feed = [int(token)]
        draft_ids = torch.tensor(ids, dtype=torch.long)
        return draft_ids, (torch.stack(probs) if probs else None)

