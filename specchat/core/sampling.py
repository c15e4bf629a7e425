"""Logits -> probabilities, sampling, and the lossless speculative verification step.

Leviathan et al. 2022 / Chen et al. 2023: draft token x_i (drawn from the draft's q_i) is kept
with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the target emits a token
from normalize(max(0, p_i - q_i)); if all k drafts pass it emits a bonus token from p_{k+1}.
The emitted tokens are then distributed exactly as if sampled from the target alone.

Both distributions go through the same `SamplingParams` transform (temperature, top-k, top-p)
before the test, so q is the distribution the draft really sampled from and p is the
distribution plain decoding would sample from. Temperature 0 is greedy: the test becomes
"draft == target argmax" and every draw is an argmax.

One-hot drafts (n-gram lookup, the draft head, trees: q(x) = 1 for the proposed token) need no
separate test: keep x with probability p(x), else emit a token from p without x. A single draw
y ~ p does both (P(y = x) = p(x), and given y != x, y is distributed as p without x), and it is
the very draw plain decoding makes at that position. Every emitted token is then plain
decoding's own draw, whatever was drafted.

Random numbers are keyed, not drawn in order (`Noise`, a counter-based generator like JAX's):
the draw at position t of a reply is a function of (seed, t, token id) alone, an exponential
race: each candidate token x gets E_x ~ Exp(1) and the token with the least E_x / p(x) wins
(the Gumbel-max trick; it picks x with probability p(x)). So a seeded reply is the same text
with speculation on or off, whatever the drafter and however many positions a step verified.
A drafter that samples its proposal from its own q with the same E_x (the head:
`race` over q) proposes exactly the target's token whenever the two races agree, which for
close distributions is most of the time (Gumbel coupling; Daliri et al. 2024, "Coupling without
communication and drafter-invariant speculative decoding"). Drafts that come with their q (a
draft model) take Leviathan's test above, with their own keyed uniforms.

Only the tokens within a few nats of the most likely one (`_SPANS`) race at first: with real
logits, a few dozen to a thousand of Gemma's 262k, and they hold the whole top-p nucleus and
top-k set (checked every draw; wider spans or the full vocabulary are used when they do not).
Without truncation the other tokens race as one entrant holding their total mass, and only when
it wins (rarely: docs/performance.md, "Sampling's candidate spans") do they race one by one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# Candidates: tokens whose logit (after temperature) is within a span of the largest; the
# narrowest span that holds the whole top-p nucleus / top-k set is used. A token 8 nats down
# has 1/3000 of the top token's probability; how much of Gemma's mass the spans hold is in
# docs/performance.md, "Sampling's candidate spans".
_SPANS = (8.0, 16.0)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept (1 = off)
    top_k: int = 0  # keep the k most likely tokens (0 = off)
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the top one (0 = off)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def nucleus(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None,
                                                                    torch.Tensor]:
    """One row of logits [vocab] -> (ids [m], probs [m] float64 summing to 1): the tokens
    sampling can pick after temperature, top-k, top-p and min-p, and their probabilities. ids
    None: the whole vocabulary, in order (no truncation).

    min-p keeps the tokens whose probability is at least min_p times the top token's, that is
    whose scaled logit is within -log(min_p) of the largest: it commutes with top-k and top-p
    (both keep the ratios of the tokens they keep), so it is applied last.

    Exact: a token is kept iff the reference (sort everything) implementation keeps it, up to
    the order of exact ties.
    """
    vocab = logits.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if not top_k and params.top_p >= 1.0 and params.min_p > 0 and blocked(logits):
        return _min_p_only(logits, params)
    x, z, top, total = _scaled(logits, params)
    floor = top + math.log(params.min_p) if params.min_p > 0 else None
    if not top_k and params.top_p >= 1.0:
        if floor is None:
            return None, z.double() / total
        ids = (x >= floor).nonzero()[:, 0]
        probs, order = torch.sort(z[ids].double(), descending=True)
        return ids[order], probs / probs.sum()

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
    if floor is not None:
        keep = x[ids] >= floor  # holds the top token: ids are in descending order
        ids, probs = ids[keep], probs[keep]
    return ids, probs / probs.sum()


def _min_p_only(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor,
                                                                        torch.Tensor]:
    """`nucleus` with min-p alone, on a CPU row whose width is whole blocks: the tokens
    `min_p_draw` races and their probabilities, in increasing id order: each token's weight
    exp(x - top) in double over the weights' sum in that order. Only the blocks whose largest
    logit clears the floor are scaled, not the whole vocabulary."""
    ids, weights = _min_p_candidates(logits, params)
    total = 0.0
    for w in weights:
        total += w
    return torch.from_numpy(ids), torch.tensor(weights, dtype=torch.float64) / total


def _min_p_floor(top, params: SamplingParams) -> np.float32:
    """min-p's bar on scaled logits x: a token is kept when x >= float32(top + log(min_p)),
    top the largest x."""
    return np.float32(float(top) + math.log(params.min_p))


def _min_p_weights(kept: np.ndarray, top) -> list[float]:
    """The kept scaled logits' weights exp(x - top), as Python floats (the float32 differences
    are exact as doubles)."""
    return [math.exp(d) for d in (kept - top).tolist()]


def _keyed_race(keys: list[int], weights: list[float], noise: Noise, position: int
                ) -> tuple[int, float]:
    """The race of min-p's draws: candidate i takes -log(u) / weights[i], u the position's
    keyed uniform for keys[i] (a token id); the least time wins (the earlier candidate on a
    tie). -> (the winner's index, the weights' sum in candidate order)."""
    k1, k2 = noise.keys(position, DRAW)
    best, best_time, total = -1, math.inf, 0.0
    for i, (key, w) in enumerate(zip(keys, weights)):
        total += w
        time = -math.log(_uniform(key & _M32, k1, k2)) / w
        if best < 0 or time < best_time:
            best, best_time = i, time
    return best, total


def _min_p_candidates(logits: torch.Tensor, params: SamplingParams
                      ) -> tuple[np.ndarray, list[float]]:
    """min-p's candidates of a blocked CPU row: (ids in increasing order, their weights
    `_min_p_weights`), x = logit / temperature in float32, kept as `_min_p_floor` says."""
    temperature = np.float32(max(params.temperature, 1e-5))
    blocks = logits.float().numpy().reshape(-1, ARGMAX_BLOCK)  # [B, 512]
    # x / t rounds monotonically: a block's largest scaled logit is its largest logit's
    peaks = blocks.max(1) / temperature  # [B]
    top = peaks.max()
    floor = _min_p_floor(top, params)
    chosen = np.flatnonzero(peaks >= floor)  # the blocks holding a kept token
    x = blocks[chosen] / temperature  # [m, 512]
    rows, cols = np.nonzero(x >= floor)  # in order: ids ascend
    return chosen[rows] * ARGMAX_BLOCK + cols, _min_p_weights(x[rows, cols], top)


def min_p_draw(logits: torch.Tensor, params: SamplingParams, noise: Noise,
               position: int) -> int:
    """min-p's draw on a blocked CPU row: the candidates of `_min_p_candidates` race
    (`_keyed_race`, each keyed by its id). One definition in double-precision scalars
    (Python's math, the C library's exp and log), which the native sampler (csrc/sample.c)
    computes to the bit."""
    ids, weights = _min_p_candidates(logits, params)
    ids = ids.tolist()
    return ids[_keyed_race(ids, weights, noise, position)[0]]


def min_p_place(logits: torch.Tensor, params: SamplingParams, noise: Noise, position: int,
                ids: list[int]) -> tuple[int, float] | None:
    """min-p's draw over a drafter's reduced vocabulary: logits [width] (a CPU row) where
    logits[j] is the logit of token ids[j]. The same race as `min_p_draw`'s, each candidate
    keyed by its token id as the target's draw keys it, so a drafter drawing here proposes the
    target's token whenever the two distributions' races agree (Gumbel coupling). Returns
    (the winner's place, its probability among the candidates: its weight over their sum in
    place order), or None where the row holds no finite logit. csrc/sample.c's `min_p_place`
    computes the same bits."""
    temperature = np.float32(max(params.temperature, 1e-5))
    v = logits.float().numpy()
    v_max = v.max()
    if not math.isfinite(float(v_max)):
        return None
    top = v_max / temperature
    x = v / temperature
    places = np.flatnonzero(x >= _min_p_floor(top, params)).tolist()  # ascending
    weights = _min_p_weights(x[places], top)
    best, total = _keyed_race([ids[place] for place in places], weights, noise, position)
    return places[best], weights[best] / total


def blocked(logits: torch.Tensor) -> bool:
    """A CPU row that `argmax` and `_min_p_only` take in blocks."""
    vocab = logits.shape[-1]
    return logits.device.type == "cpu" and vocab % ARGMAX_BLOCK == 0 and \
        vocab >= 4 * ARGMAX_BLOCK


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


# Independent streams of keyed numbers at one position.
DRAW, ACCEPT, RESIDUAL, TAIL = range(4)
_M32 = 0xFFFFFFFF


def _mix32(x):
    """A bijection of 32-bit integers that scatters nearby inputs (lowbias32, C. Wellons), on a
    Python int or a uint32 numpy array (whose products wrap mod 2^32 by themselves)."""
    if isinstance(x, int):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & _M32
        x ^= x >> 15
        x = (x * 0x846CA68B) & _M32
        return x ^ (x >> 16)
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


class Noise:
    """Uniforms keyed by (seed, position, stream, token id): the same key always gives the same
    number, and different keys give independent-looking ones. The engine samples the token at
    reply position t from the keys (seed, t, DRAW, every candidate id), so what a step drafted
    or how many positions it verified never shifts the random numbers of later positions."""

    def __init__(self, seed: int):
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF

    def keys(self, position: int, stream: int) -> tuple[int, int]:
        """The two 32-bit keys of (position, stream): `uniforms` hashes each id with them."""
        k = _mix32(_mix32(self.seed & _M32) ^ (self.seed >> 32))
        k = _mix32(k ^ (position & _M32))
        k = _mix32(k ^ (((stream + 1) * 0x9E3779B9) & _M32))
        return k, _mix32(k ^ 0x85EBCA6B)

    def uniforms(self, position: int, ids: torch.Tensor, stream: int = DRAW) -> torch.Tensor:
        """ids [m] (token ids, >= 0) -> [m] float64 uniforms in (0, 1), 53 random bits each."""
        if len(ids) <= _FEW:  # Python's integers beat numpy's calls on a handful of ids
            k1, k2 = self.keys(position, stream)
            return torch.tensor([_uniform(x & _M32, k1, k2) for x in ids.tolist()],
                                dtype=torch.float64)
        k1, k2 = (np.uint32(k) for k in self.keys(position, stream))
        x = ids.cpu().numpy().astype(np.uint32)
        # Keyed twice: one xor-then-mix leaves pairs of keys' outputs slightly correlated.
        hi = _mix32(_mix32(x ^ k1) ^ k1) >> np.uint32(11)  # 21 bits
        lo = _mix32(_mix32(x ^ k2) ^ k2)  # 32 bits
        u = (hi.astype(np.float64) * 2.0 ** 32 + lo + 0.5) * 2.0 ** -53
        return torch.from_numpy(u)

    def exponentials(self, position: int, ids: torch.Tensor, stream: int = DRAW) -> torch.Tensor:
        return -torch.log(self.uniforms(position, ids, stream))

    def uniform(self, position: int, stream: int) -> float:
        return float(self.uniforms(position, _ZERO, stream)[0])


_ZERO = torch.zeros(1, dtype=torch.long)
_FEW = 8  # ids that `Noise.uniforms` keys one by one


def _uniform(x: int, k1: int, k2: int) -> float:
    """`Noise.uniforms`' number for one id x, in Python integers and floats: the same uint32
    mixing and the same float64 operations in the same order, so the same bits."""
    hi = _mix32(_mix32(x ^ k1) ^ k1) >> 11
    lo = _mix32(_mix32(x ^ k2) ^ k2)
    return (hi * 2.0 ** 32 + lo + 0.5) * 2.0 ** -53


def race(ids: torch.Tensor, probs: torch.Tensor, noise: Noise, position: int,
         stream: int = DRAW) -> int:
    """The index i in [m] of the token that wins the exponential race among ids [m] with
    probabilities probs [m] (any positive scale): least E / p, E ~ Exp(1) keyed by token id. Index
    i wins with probability probs[i] / probs.sum(); a token without mass never wins."""
    times = noise.exponentials(position, ids, stream) / probs.double()  # p = 0: inf
    return int(times.argmin())


def draw(ids: torch.Tensor | None, probs: torch.Tensor, noise: Noise, position: int,
         stream: int = DRAW) -> int:
    """A token id drawn from probs over ids (None: probs covers the whole vocabulary)."""
    if ids is None:
        ids = torch.arange(probs.shape[-1])
    return int(ids[race(ids, probs, noise, position, stream)])


def sample_row(logits: torch.Tensor, params: SamplingParams, noise: Noise,
               position: int) -> int:
    """One row of logits [vocab] -> the token plain decoding draws at reply position
    `position`, from the transformed distribution."""
    if params.top_p >= 1.0 and not 0 < params.top_k < logits.shape[-1]:
        if params.min_p <= 0:
            return _sample_untruncated(logits, params, noise, position)
        if blocked(logits):
            return min_p_draw(logits, params, noise, position)
    ids, probs = nucleus(logits, params)
    return draw(ids, probs, noise, position)


def _sample_untruncated(logits, params, noise: Noise, position: int) -> int:
    """Temperature only: the whole vocabulary can come out. The likely tokens race one by one;
    the other ~262k as one entrant with their total mass m (its time is Exp(m), from its own
    key), and only if that entrant wins do they race among themselves. The winner is distributed
    exactly as in a race of every token (an exponential race's least time and its winner are
    independent), at the cost of a thousand keyed numbers, not 262k."""
    x, z, top, total = _scaled(logits, params)
    inside = x >= top - _SPANS[0]
    ids = inside.nonzero()[:, 0]
    times = noise.exponentials(position, ids) * total / z[ids].double()
    best = int(times.argmin())
    rest = total - float(z[ids].double().sum())
    if len(ids) < len(x) and rest > 0:
        tail_time = float(noise.exponentials(position, _ZERO, TAIL)[0]) * total / rest
        if tail_time < float(times[best]):
            tail = (~inside).nonzero()[:, 0]
            return draw(tail, z[tail], noise, position)
    return int(ids[best])


def prob_of(logits: torch.Tensor, params: SamplingParams, token: int) -> float:
    """The probability sampling gives `token` under `params` (0 outside top-k / top-p)."""
    ids, probs = nucleus(logits, params)
    return float(probs[token]) if ids is None else float(probs[ids == token].sum())


def top_candidates(logits: torch.Tensor, params: SamplingParams, n: int,
                   also: int | None = None, native=None
                   ) -> tuple[list[tuple[int, float]], float | None]:
    """The n most likely tokens of one row [vocab] and their probabilities at the sampling
    temperature (1 when greedy), before top-k / top-p: what the page shows of a distribution;
    and the probability of token `also` the same way. One top-k and one logsumexp: cheap beside
    a forward. `native`: a runner's `row_top`, for contiguous float32 CPU rows."""
    x = logits.float()
    if params.temperature > 0 and params.temperature != 1.0:
        x = x / params.temperature
    n = min(n, x.shape[-1])
    if native is not None and x.dtype is torch.float32 and x.device.type == "cpu" \
            and x.is_contiguous() and x.dim() == 1:
        ids, values, norm = native(x, n)
        extra = math.exp(float(x[also]) - norm) if also is not None else None
        return [(i, math.exp(v - norm)) for i, v in zip(ids, values)], extra
    vocab = x.shape[-1]
    if vocab % ARGMAX_BLOCK == 0 and vocab >= ARGMAX_BLOCK * n:
        # topk over 262k logits is slow: the n largest lie in the n blocks of largest maxima.
        blocks = x.view(-1, ARGMAX_BLOCK)
        chosen = torch.topk(blocks.amax(-1), n).indices
        values, order = torch.topk(blocks[chosen].reshape(-1), n)
        ids = chosen[order // ARGMAX_BLOCK] * ARGMAX_BLOCK + order % ARGMAX_BLOCK
    else:
        values, ids = torch.topk(x, n)
    norm = torch.logsumexp(x, -1)
    probs = torch.exp(values - norm)
    extra = float(torch.exp(x[also] - norm)) if also is not None else None
    return list(zip(ids.tolist(), probs.tolist())), extra


def _dense(ids: torch.Tensor | None, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    if ids is None:
        return probs.float()
    return torch.zeros(vocab).index_put_((ids,), probs.float())


ARGMAX_BLOCK = 512  # columns per block of `argmax` and `top_candidates`


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., vocab] -> the index of each row's largest value, the first where several
    tie: `torch.argmax`'s answer. On a CPU, torch's argmax over a 262k-token row takes ten times
    longer than its max, so the row is taken in blocks: the first block holding the row's
    maximum (the blocks' maxima, then their argmax), then the first place in that block."""
    vocab = logits.shape[-1]
    if not blocked(logits):
        return logits.argmax(-1)
    rows = logits.reshape(-1, vocab // ARGMAX_BLOCK, ARGMAX_BLOCK)
    block = rows.amax(-1).argmax(-1)  # [n]
    within = rows[torch.arange(len(rows)), block].argmax(-1)
    return (block * ARGMAX_BLOCK + within).reshape(logits.shape[:-1])


def argmax_row(row: torch.Tensor) -> int:
    """`argmax` of one row ([vocab] or [1, vocab]), as a Python int: plain greedy decoding's
    token. On a CPU float32 row, numpy's argmax (vectorized, the first place where several
    tie, as torch's): one call where `argmax` takes seven, and each call costs tens of
    microseconds right after a forward, with cold caches."""
    if row.device.type == "cpu" and row.dtype == torch.float32:
        return int(row.numpy().argmax())
    return int(argmax(row))


def sample_logits(logits: torch.Tensor, params: SamplingParams, noise: Noise,
                  position: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[n, vocab] logits for reply positions position.. -> ([n] ids, [n, vocab] probs they were
    drawn from; None when greedy)."""
    if params.greedy:
        return argmax(logits).cpu(), None
    tokens, rows = [], []
    for r, row in enumerate(logits):
        ids, probs = nucleus(row, params)
        tokens.append(draw(ids, probs, noise, position + r))
        rows.append(_dense(ids, probs, logits.shape[-1]))
    return torch.tensor(tokens), torch.stack(rows)


@dataclass
class Verdict:
    n_accepted: int  # drafts kept, 0..k
    next_token: int  # the token the target adds after them (resampled, or bonus)
    bonus: bool  # True when all k drafts passed and next_token came from p_{k+1}
    # At a rejection when sampling: the target's p(x) and the draft's q(x) of the refused draft
    # x that the test used (q = 1 for one-hot drafts). None when greedy or all passed.
    p: float | None = None
    q: float | None = None


def verify(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
           target_logits: torch.Tensor, params: SamplingParams, noise: Noise | None,
           position: int = 0, picks: list[int] | None = None,
           refused_p: bool = True) -> Verdict:
    """One speculative step over k draft positions (k = 0: plain decoding).

    draft_ids:     [k]            tokens the drafter proposed, for reply positions position..
    draft_probs:   [k, vocab]     q the drafts were sampled from, or None for one-hot drafts
                                  (n-gram lookup, the head: the target's own draw decides)
    target_logits: [k + 1, vocab] the target's logits at the k draft positions and the next one
    noise:         the request's keyed random numbers (unused when greedy)
    picks:         [k + 1] plain decoding's draw at each row, where the caller made them already
                   (the engine's native sampler: the same tokens), else None
    refused_p:     whether a refused one-hot draft's Verdict.p is computed (a pass over its
                   row; False: None, for a caller that computes it later, as the engine's
                   evidence does in the same native call as the row's top candidates)
    """
    if picks is not None and len(picks) == 1 and (params.greedy or draft_probs is None):
        return Verdict(0, picks[0], bonus=True)  # plain decoding (no torch call: a step's cost)
    k = draft_ids.shape[0]
    if picks is not None and (params.greedy or draft_probs is None):
        drafted = draft_ids.tolist()
        n = next((i for i in range(k) if drafted[i] != picks[i]), k)
        if n == k or params.greedy:
            return Verdict(n, picks[n], bonus=n == k)
        return Verdict(n, picks[n], False,
                       prob_of(target_logits[n], params, drafted[n]) if refused_p else None, 1.0)
    if params.greedy and k == 0:  # plain decoding: the argmax
        return Verdict(0, argmax_row(target_logits), bonus=True)
    if params.greedy:  # argmax where the logits are (GPU or CPU); move k + 1 ids, not k+1 rows
        target_ids = argmax(target_logits).cpu()  # [k + 1]
        mismatch = (draft_ids != target_ids[:k]).int()
        n = int(mismatch.argmax()) if bool(mismatch.any()) else k
        return Verdict(n, int(target_ids[n]), bonus=n == k)

    if draft_probs is None:  # one-hot drafts: plain decoding's draw y ~ p per position
        for i in range(k + 1):
            token = sample_row(target_logits[i], params, noise, position + i)
            if i == k:
                return Verdict(i, token, bonus=True)
            if token != int(draft_ids[i]):  # x passed with probability p(x): q(x) = 1
                return Verdict(i, token, False, prob_of(target_logits[i], params,
                                                       int(draft_ids[i])) if refused_p else None,
                               1.0)

    # Sampled drafts: row by row, so a step pays for the target rows it reaches, not all k + 1.
    vocab = target_logits.shape[-1]
    for i in range(k):
        ids, probs = nucleus(target_logits[i], params)
        x = int(draft_ids[i])
        p = float(probs[x]) if ids is None else float(probs[ids == x].sum())
        u = noise.uniform(position + i, ACCEPT)
        if u * float(draft_probs[i, x]) <= p:  # u < p/q  <=>  accept
            continue
        target_probs = _dense(ids, probs, vocab)
        residual = torch.clamp(target_probs - draft_probs[i].float(), min=0.0)  # (p - q)+
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had ~0 probability
            residual = target_probs
        support = residual.nonzero()[:, 0]
        token = draw(support, residual[support], noise, position + i, RESIDUAL)
        return Verdict(i, token, False, p, float(draft_probs[i, x]))
    return Verdict(k, sample_row(target_logits[k], params, noise, position + k), bonus=True)
