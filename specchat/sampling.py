"""Logits -> probabilities, sampling, and the lossless speculative verification step.

Leviathan et al. 2022 / Chen et al. 2023: draft token x_i (drawn from the draft's q_i) is kept
with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the target emits a token
from normalize(max(0, p_i - q_i)); if all k drafts pass it emits a bonus token from p_{k+1}.
The emitted tokens are then distributed exactly as if sampled from the target alone.

Both distributions go through the same `SamplingParams` transform (temperature, top-k, top-p)
before the test, so q is the distribution the draft really sampled from and p is the
distribution plain decoding would sample from. Temperature 0 is greedy: the test becomes
"draft == target argmax" and every draw is an argmax.

One-hot drafts (n-gram lookup: q(x) = 1) need no separate test: keep x with probability p(x),
else emit a token from p without x. A single draw y ~ p does both (P(y = x) = p(x), and given
y != x, y is distributed as p without x), and it is the very draw plain decoding makes at that
position. So with one-hot drafts every emitted token costs one uniform from the generator, as in
plain decoding, and a seeded reply is the same with speculation on or off.

Sampling inverts the CDF of the kept tokens with one uniform. Only the tokens within a few nats
of the most likely one (`_SPANS`) are sorted and walked: with real logits, a few dozen to a
thousand of Gemma's 262k, and they hold the whole top-p nucleus and top-k set (checked every
draw; wider spans or the full vocabulary are used when they do not). A draw costs about 2 ms
here. The previous way, probabilities for all 262k tokens and `torch.multinomial` (which draws a
random number per token of the vocabulary), cost 15.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specchat.events import ACCEPTED, BONUS, RESAMPLED  # noqa: F401  (kinds, for readers)

# Candidates: tokens whose logit (after temperature) is within a span of the largest; the
# narrowest span that holds the whole top-p nucleus / top-k set is used. A token 8 nats down
# has 1/3000 of the top token's probability; on Gemma's logits at T = 0.7 the tokens within 8
# nats held at least 97.6% of the mass, and a few dozen to a thousand tokens of 262k.
_SPANS = (8.0, 16.0)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept (1 = off)
    top_k: int = 0  # keep the k most likely tokens (0 = off)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def nucleus(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None,
                                                                    torch.Tensor]:
    """One row of logits [vocab] -> (ids [m], probs [m] float64 summing to 1): the tokens
    sampling can pick after temperature, top-k and top-p, and their probabilities. ids None:
    the whole vocabulary, in order (no truncation).

    Exact: a token is kept iff the reference (sort everything) implementation keeps it, up to
    the order of exact ties.
    """
    x, z, top, total = _scaled(logits, params)
    vocab = x.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if not top_k and params.top_p >= 1.0:
        return None, z.double() / total

    ids, mass = _candidates(x, z, top, total, top_k, params.top_p)
    if top_k:
        top_logits, order = torch.topk(x[ids], top_k)  # sorted descending
        ids = ids[order]
        probs = torch.softmax(top_logits.double(), -1)  # top-k renormalizes before top-p
    else:
        probs, order = torch.sort(mass, descending=True)
        ids = ids[order]
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = int(((torch.cumsum(probs, 0) - probs) < params.top_p).sum())
        ids, probs = ids[:keep], probs[:keep]
    return ids, probs / probs.sum()


def _scaled(logits: torch.Tensor, params: SamplingParams):
    """-> (x = logits / temperature [vocab] float32, exp(x - max x), max x, their sum)."""
    x = logits.float().cpu() / max(params.temperature, 1e-5)
    top = float(x.max())
    z = torch.exp(x - top)
    return x, z, top, float(z.sum())


def _candidates(x, z, top: float, total: float, top_k: int, top_p: float):
    """Every token within the narrowest span of the top logit that holds the top-k set (at
    least top_k tokens) or the top-p nucleus (at least top_p of the mass), else all of them:
    -> (ids [m], their probabilities [m] float64)."""
    for span in _SPANS:
        ids = (x >= top - span).nonzero()[:, 0]
        mass = z[ids].double() / total
        if (len(ids) >= top_k) if top_k else (float(mass.sum()) >= top_p):
            return ids, mass
    return torch.arange(x.shape[-1]), z.double() / total


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """An index drawn from probs [m] (summing to 1) with one uniform: the inverse CDF."""
    cdf = torch.cumsum(probs.double(), 0)
    u = torch.rand((), dtype=torch.float64, generator=generator) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    return min(i, int(torch.searchsorted(cdf, cdf[-1])))  # rounding: never past the last mass


def sample_row(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None) -> int:
    """One row of logits [vocab] -> a token id drawn from the transformed distribution."""
    if params.top_p >= 1.0 and not 0 < params.top_k < logits.shape[-1]:
        return _sample_untruncated(logits, params, generator)
    ids, probs = nucleus(logits, params)
    return int(ids[draw(probs, generator)])


def _sample_untruncated(logits, params, generator) -> int:
    """Temperature only: the whole vocabulary can come out. One uniform u; the CDF is walked
    over the likely tokens first, and over the other ~262k only when u falls past them."""
    x, z, top, total = _scaled(logits, params)
    u = float(torch.rand((), dtype=torch.float64, generator=generator)) * total
    inside = x >= top - _SPANS[0]
    ids = inside.nonzero()[:, 0]
    cdf = torch.cumsum(z[ids].double(), 0)
    if u >= float(cdf[-1]) and len(ids) < len(x):
        u -= float(cdf[-1])
        ids = (~inside).nonzero()[:, 0]
        cdf = torch.cumsum(z[ids].double(), 0)
    return int(ids[min(int(torch.searchsorted(cdf, u, right=True)), len(ids) - 1)])


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] float32 probabilities after temperature/top-k/top-p."""
    return torch.stack([_dense(*nucleus(row, params), logits.shape[-1]) for row in logits])


def _dense(ids: torch.Tensor | None, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    if ids is None:
        return probs.float()
    return torch.zeros(vocab).index_put_((ids,), probs.float())


def sample_logits(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[n, vocab] logits -> ([n] ids, [n, vocab] probs they were drawn from; None when greedy)."""
    if params.greedy:
        return logits.argmax(-1).cpu(), None
    tokens, rows = [], []
    for row in logits:
        ids, probs = nucleus(row, params)
        i = draw(probs, generator)
        tokens.append(i if ids is None else int(ids[i]))
        rows.append(_dense(ids, probs, logits.shape[-1]))
    return torch.tensor(tokens), torch.stack(rows)


def _draw_dense(row: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn from a full-vocabulary probability row [vocab] (mostly zeros)."""
    ids = row.nonzero()[:, 0]
    return int(ids[draw(row[ids], generator)])


@dataclass
class Verdict:
    n_accepted: int  # drafts kept, 0..k
    next_token: int  # the token the target adds after them (resampled, or bonus)
    bonus: bool  # True when all k drafts passed and next_token came from p_{k+1}


def verify(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
           target_logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> Verdict:
    """One speculative step over k draft positions (k = 0: plain decoding).

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

    if draft_probs is None:  # one-hot drafts: one draw y ~ p per position (module docstring)
        for i in range(k + 1):
            token = sample_row(target_logits[i], params, generator)
            if i == k or token != int(draft_ids[i]):
                return Verdict(i, token, bonus=i == k)

    # Sampled drafts: row by row, so a step pays for the target rows it reaches, not all k + 1.
    vocab = target_logits.shape[-1]
    for i in range(k):
        ids, probs = nucleus(target_logits[i], params)
        x = int(draft_ids[i])
        p = float(probs[x]) if ids is None else float(probs[ids == x].sum())
        u = float(torch.rand((), generator=generator))
        if u * float(draft_probs[i, x]) <= p:  # u < p/q  <=>  accept
            continue
        target_probs = _dense(ids, probs, vocab)
        residual = torch.clamp(target_probs - draft_probs[i].float(), min=0.0)  # (p - q)+
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had ~0 probability
            residual = target_probs
        return Verdict(i, _draw_dense(residual, generator), bonus=False)
    return Verdict(k, sample_row(target_logits[k], params, generator), bonus=True)
