"""Logits -> probabilities, sampling, and the lossless speculative verification step.

Leviathan et al. 2022 / Chen et al. 2023: draft token x_i (drawn from the draft's q_i) is kept
with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the target emits a token
from normalize(max(0, p_i - q_i)); if all k drafts pass it emits a bonus token from p_{k+1}.
The emitted tokens are then distributed exactly as if sampled from the target alone.

Both distributions go through the same `SamplingParams` transform (temperature, top-k, top-p)
before the test, so q is the distribution the draft really sampled from and p is the
distribution plain decoding would sample from. Temperature 0 is greedy: the test becomes
"draft == target argmax" and every draw is an argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specchat.events import ACCEPTED, BONUS, RESAMPLED  # noqa: F401  (kinds, for readers)

# Top-p needs the sorted head of the distribution; sorting all 262k logits of Gemma's vocab
# every token is the single most expensive sampling op. We sort only the top `_NUCLEUS_PROBE`
# candidates and fall back to a full sort in the rare case their mass is below top_p.
_NUCLEUS_PROBE = 1024


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept (1 = off)
    top_k: int = 0  # keep the k most likely tokens (0 = off)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] float32 probabilities after temperature/top-k/top-p.

    Exact: a token is kept iff the reference (sort everything) implementation keeps it.
    """
    logits = logits.float() / max(params.temperature, 1e-5)
    vocab = logits.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if top_k == 0 and params.top_p >= 1.0:
        return torch.softmax(logits, dim=-1)

    if top_k:
        top_logits, top_ids = torch.topk(logits, top_k, dim=-1)  # [n, k], sorted descending
        head_probs = torch.softmax(top_logits, dim=-1)  # top-k renormalizes before top-p
    else:
        probs = torch.softmax(logits, dim=-1)  # [n, vocab]
        head_probs, top_ids = torch.topk(probs, min(vocab, _NUCLEUS_PROBE), dim=-1)
        if bool((head_probs.sum(-1) < params.top_p).any()):  # nucleus wider than the probe
            head_probs, top_ids = torch.sort(probs, dim=-1, descending=True)
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        mass_before = torch.cumsum(head_probs, dim=-1) - head_probs
        head_probs = head_probs.masked_fill(mass_before >= params.top_p, 0.0)
    head_probs = head_probs / head_probs.sum(-1, keepdim=True)
    probs = torch.zeros_like(logits)
    return probs.scatter_(-1, top_ids, head_probs)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[n, vocab] probs -> [n] token ids."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_logits(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[n, vocab] logits -> ([n] ids, [n, vocab] probs or None when greedy)."""
    if params.greedy:
        return logits.argmax(-1).cpu(), None
    probs = logits_to_probs(logits.float().cpu(), params)
    return sample(probs, generator), probs


@dataclass
class Verdict:
    n_accepted: int  # drafts kept, 0..k
    next_token: int  # the token the target adds after them (resampled, or bonus)
    bonus: bool  # True when all k drafts passed and next_token came from p_{k+1}


def verify(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
           target_logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> Verdict:
    """One speculative step, vectorized over the k draft positions.

    draft_ids:     [k]            tokens the drafter proposed
    draft_probs:   [k, vocab]     q the drafts were sampled from, or None for one-hot drafts
                                  (deterministic drafters such as n-gram lookup)
    target_logits: [k + 1, vocab] the target's logits at the k draft positions and the next one
    """
    k = draft_ids.shape[0]
    if params.greedy:  # argmax where the logits are (GPU or CPU); move k + 1 ids, not k+1 rows
        target_ids = target_logits.argmax(-1).cpu()  # [k + 1]
        mismatch = (draft_ids != target_ids[:k]).int()
        n = int(mismatch.argmax()) if bool(mismatch.any()) else k
        return Verdict(n, int(target_ids[n]), bonus=n == k)

    target_probs = logits_to_probs(target_logits.float().cpu(), params)  # [k + 1, vocab]
    rows = torch.arange(k)
    p = target_probs[rows, draft_ids]  # [k]
    q = draft_probs[rows, draft_ids] if draft_probs is not None else torch.ones(k)  # [k]
    u = torch.rand(k, generator=generator)
    rejected = u * q > p  # u < p/q  <=>  accept;  written without division by q
    n = int(rejected.int().argmax()) if bool(rejected.any()) else k
    if n == k:
        return Verdict(k, int(sample(target_probs[k:], generator)), bonus=True)

    if draft_probs is not None:
        residual = torch.clamp(target_probs[n] - draft_probs[n], min=0.0)  # [vocab]
    else:  # q is one-hot on the draft token: (p - q)+ is p without that token
        residual = target_probs[n].clone()
        residual[draft_ids[n]] = 0.0
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had ~0 probability
        residual = target_probs[n]
    return Verdict(n, int(sample(residual[None], generator)), bonus=False)
