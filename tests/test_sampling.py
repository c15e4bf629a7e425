"""Verification step: exact cases on hand-written logits, and distribution equality; the keyed
random numbers and the races drawn from them."""

import itertools
import math

import pytest
import numpy as np
import torch
from tiny import dense_probs

from specchat.core.sampling import Noise, SamplingParams, draw, sample_row, verify

GREEDY = SamplingParams(temperature=0.0)
T1 = SamplingParams(temperature=1.0)
BIG = 30.0  # a logit that makes its token certain after softmax


def peaked(ids, vocab=8):
    """[len(ids), vocab] logits whose argmax (and, at T=1, almost all mass) is ids[i]."""
    logits = torch.zeros(len(ids), vocab)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = BIG
    return logits


@pytest.mark.parametrize("params", [GREEDY, T1])
def test_accept_all_then_bonus(params):
    drafts = torch.tensor([3, 1, 4])
    v = verify(drafts, None, peaked([3, 1, 4, 5]), params, Noise(0))
    assert (v.n_accepted, v.next_token, v.bonus) == (3, 5, True)


@pytest.mark.parametrize("params", [GREEDY, T1])
def test_reject_first(params):
    drafts = torch.tensor([3, 1, 4])
    v = verify(drafts, None, peaked([6, 1, 4, 5]), params, Noise(0))
    assert (v.n_accepted, v.next_token, v.bonus) == (0, 6, False)


@pytest.mark.parametrize("params", [GREEDY, T1])
def test_reject_middle(params):
    drafts = torch.tensor([3, 1, 4])
    v = verify(drafts, None, peaked([3, 2, 4, 5]), params, Noise(0))
    assert (v.n_accepted, v.next_token, v.bonus) == (1, 2, False)


def test_a_refused_one_hot_drafts_p_is_left_to_the_caller_when_it_asks():
    """`refused_p=False` (the engine, whose evidence computes p natively): the same verdict
    with p None; by default the refused draft's p under sampling, q 1."""
    from specchat.core.sampling import prob_of
    drafts, logits = torch.tensor([3, 1, 4]), peaked([3, 2, 4, 5]) * 0.1
    params = SamplingParams(temperature=0.8, min_p=0.05)
    for picks in (None, [3, 2, 4, 5]):
        kept = verify(drafts, None, logits, params, Noise(0), picks=picks)
        left = verify(drafts, None, logits, params, Noise(0), picks=picks, refused_p=False)
        assert (left.n_accepted, left.next_token, left.bonus) == \
            (kept.n_accepted, kept.next_token, kept.bonus)
        assert left.p is None and left.q == kept.q == 1.0
        n = kept.n_accepted
        assert n < 3 and kept.p == prob_of(logits[n], params, int(drafts[n]))


def test_no_drafts_is_plain_sampling():
    v = verify(torch.zeros(0, dtype=torch.long), None, peaked([7]), T1, Noise(0))
    assert (v.n_accepted, v.next_token) == (0, 7)


def test_draft_probs_used_in_ratio():
    # p(x)=0.25, q(x)=1.0 -> accept with probability 0.25; u is the seed's ACCEPT number.
    target = torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.25] * 4]))
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    accepted = sum(verify(torch.tensor([0]), q, target, T1, Noise(s))
                   .n_accepted for s in range(4000))
    assert abs(accepted / 4000 - 0.25) < 0.03


def tv(a, b):
    return 0.5 * float((a - b).abs().sum())


def emitted_first_token_distribution(target_logits, draft_probs, params, draws=10000, k=1):
    """Draw a draft from q, verify, record the first emitted token; return its histogram."""
    vocab = target_logits.shape[-1]
    gen = torch.Generator().manual_seed(1234)
    noise = Noise(1234)
    counts = torch.zeros(vocab)
    for i in range(draws):
        if draft_probs is None:  # deterministic (one-hot) drafter, as n-gram lookup
            drafts = torch.tensor([2] * k)
        else:
            drafts = torch.multinomial(draft_probs, 1, generator=gen).squeeze(-1)[:k]
        v = verify(drafts, draft_probs[:k] if draft_probs is not None else None,
                   target_logits, params, noise, position=i)
        counts[int(drafts[0]) if v.n_accepted > 0 else v.next_token] += 1
    return counts / draws


@pytest.mark.parametrize("params,one_hot", [
    (SamplingParams(temperature=1.0), False),
    (SamplingParams(temperature=1.0), True),
    (SamplingParams(temperature=0.6, top_p=0.9), True),
    (SamplingParams(temperature=0.7, top_k=5), True),
    (SamplingParams(temperature=1.3, top_p=0.8), False),
    (SamplingParams(temperature=0.9, top_k=6, top_p=0.9), True),
])
def test_emitted_distribution_equals_target(params, one_hot):
    torch.manual_seed(0)
    vocab = 8
    target_logits = torch.randn(2, vocab) * 1.5
    draft_logits = torch.randn(2, vocab) * 1.5
    draft_probs = None if one_hot else dense_probs(draft_logits, params)
    got = emitted_first_token_distribution(target_logits, draft_probs, params)
    want = dense_probs(target_logits[:1], params)[0]
    assert tv(got, want) < 0.025, (got, want)


def test_logits_to_probs_matches_reference_top_p_top_k():
    torch.manual_seed(0)
    # Flat rows (most tokens are candidates), sharp rows like a real LM's (a few dozen are),
    # and top-k wider than the candidates (the full vocabulary is searched).
    for logits, params in itertools.product(
            (torch.randn(3, 5000) * 3, torch.randn(3, 5000) * 12),
            (SamplingParams(0.7, 0.95, 0), SamplingParams(1.0, 0.5, 50),
             SamplingParams(1.0, 1.0, 20), SamplingParams(2.0, 0.999, 0),
             SamplingParams(0.5, 1.0, 0), SamplingParams(0.3, 0.9, 400))):
        got = dense_probs(logits, params)
        # Reference: full sort, as transformers' TopK then TopP warpers.
        x = logits / params.temperature
        if params.top_k:
            kth = torch.topk(x, params.top_k).values[:, -1:]
            x = x.masked_fill(x < kth, -math.inf)
        probs = torch.softmax(x, -1)
        if params.top_p < 1:
            sp, si = torch.sort(probs, descending=True)
            drop = (torch.cumsum(sp, -1) - sp) >= params.top_p
            probs = probs.scatter(-1, si, sp.masked_fill(drop, 0))
            probs = probs / probs.sum(-1, keepdim=True)
        assert torch.allclose(got, probs, atol=1e-6)


def test_race_draws_each_token_with_its_probability():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2], dtype=torch.float64)
    noise = Noise(0)
    counts = torch.bincount(torch.tensor([draw(None, probs, noise, i) for i in range(20000)]),
                            minlength=4)
    assert counts[1] == 0  # a token without mass never wins
    assert tv(counts / 20000, probs) < 0.02


def test_keyed_uniforms_are_uniform_independent_and_reproducible():
    ids = torch.arange(200_000)
    noise = Noise(0)
    a = noise.uniforms(0, ids)
    assert 0 < float(a.min()) and float(a.max()) < 1
    assert torch.equal(a, Noise(0).uniforms(0, ids))  # a key always gives the same number
    assert torch.equal(a[5:9], noise.uniforms(0, ids[5:9]))  # whatever else is asked with it

    def chi2(x, y):  # 8 x 8 bins of pairs: 63 degrees of freedom, mean 63, sd 11
        hist = torch.histogramdd(torch.stack([x, y], 1).float(), bins=[8, 8],
                                 range=[0.0, 1.0, 0.0, 1.0]).hist
        expected = len(x) / 64
        return float(((hist - expected) ** 2 / expected).sum())

    # Neighbouring token ids, positions, streams and seeds: no visible dependence.
    others = [a.roll(1), noise.uniforms(1, ids), noise.uniforms(0, ids, stream=1),
              Noise(1).uniforms(0, ids), Noise(2**40).uniforms(0, ids)]
    for b in others:
        assert chi2(a, b) < 120
    assert chi2(a, a ** 2) > 10_000  # the check does see a dependence when there is one


def test_a_few_ids_get_the_same_numbers_as_many():
    # A handful of ids is keyed in Python integers, more with numpy: the same bits either way.
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.tensor([0, 1, 2**31 - 1, 262143]),
                     torch.randint(0, 2**31 - 1, (60,), generator=g)])
    for seed, position, stream in ((0, 0, 0), (2**40 + 7, 123456, 3), (5, 2**33, 1)):
        noise = Noise(seed)
        many = noise.uniforms(position, ids, stream)
        for start in range(0, len(ids), 3):
            few = noise.uniforms(position, ids[start:start + 3], stream)
            assert torch.equal(few, many[start:start + 3])


def test_a_draw_depends_on_its_position_and_nothing_else():
    logits = torch.randn(1000) * 4
    params = SamplingParams(0.7, 0.95, 0)
    noise = Noise(3)
    first = [sample_row(logits, params, noise, t) for t in range(50)]
    sample_row(logits, params, noise, 1000)  # other draws in between change nothing
    assert [sample_row(logits, params, noise, t) for t in range(50)] == first
    assert len(set(first)) > 5  # and positions do differ


def test_a_sampled_draft_raced_with_the_targets_numbers_is_coupled_and_lossless():
    # The head's way at temperature > 0: draft x = race over q with the numbers the target uses
    # at that position, then verify x one-hot. The emitted token is always the target's own draw
    # (lossless, whatever q), and x is that draw far more often than an independent sample.
    torch.manual_seed(0)
    vocab, params = 12, SamplingParams(1.0)
    target_logits = torch.randn(2, vocab) * 2
    p = dense_probs(target_logits[:1], params)[0]
    q = dense_probs(target_logits[:1] + torch.randn(1, vocab) * 0.5, params)[0]
    emitted, accepted, n = torch.zeros(vocab), 0, 8000
    for i in range(n):
        noise = Noise(i)
        x = draw(None, q, noise, 7)
        v = verify(torch.tensor([x]), None, target_logits, params, noise, position=7)
        token = x if v.n_accepted else v.next_token
        assert token == sample_row(target_logits[0], params, noise, 7)
        emitted[token] += 1
        accepted += v.n_accepted
    assert tv(emitted / n, p) < 0.03
    overlap = float(torch.minimum(p, q).sum())  # the best any coupling can do: 1 - TV
    independent = float((p * q).sum())
    rate = accepted / n
    assert overlap / (2 - overlap) - 0.02 < rate <= overlap + 0.02  # Gumbel coupling's bounds
    assert rate > independent + 0.1


def test_untruncated_sampling_reaches_the_long_tail():
    # Temperature only: 5000 tokens 10 nats below the top one hold 18.5% of the mass together,
    # though each is outside the candidates the sampler sorts first.
    logits = torch.zeros(5001)
    logits[0] = 10.0
    noise = Noise(0)
    draws = torch.tensor([sample_row(logits, SamplingParams(1.0), noise, t) for t in range(20000)])
    share = math.exp(10) / (math.exp(10) + 5000)
    assert abs(float((draws == 0).float().mean()) - share) < 0.01
    assert len(draws[draws != 0].unique()) > 2000


def test_blockwise_argmax_and_top_candidates_are_torchs_answers():
    from specchat.core.sampling import argmax, argmax_row, top_candidates

    g = torch.Generator().manual_seed(0)
    for vocab in (262144, 4096, 300):  # blocked, blocked, too narrow to block
        rows = torch.randn(4, vocab, generator=g) * 4
        rows[1] = rows[1].round()  # many ties: the first place wins, as in torch.argmax
        rows[2, :vocab // 2] = -torch.inf  # a masked half
        rows[3, [7, vocab - 1]] = rows[3].max() + 1  # a tie between the first and last block
        assert torch.equal(argmax(rows), rows.argmax(-1))
        assert torch.equal(argmax(rows[0]), rows[0].argmax())
        assert [argmax_row(row) for row in rows] == rows.argmax(-1).tolist()
        assert argmax_row(rows[2:3]) == int(rows[2].argmax())
        top, _ = top_candidates(rows[0], SamplingParams(0.0), 5)
        values, ids = torch.topk(rows[0], 5)
        assert [i for i, _ in top] == ids.tolist()
        assert [p for _, p in top] == pytest.approx(torch.softmax(rows[0], -1)[ids].tolist(),
                                                    rel=1e-4)


def whole_row_min_p(logits: torch.Tensor, params: SamplingParams):
    """min-p the straightforward way, as `min_p_draw` defines it: every logit scaled in float32,
    the floor float32(top + log(min_p)), each kept token's weight exp(x - top) in double, the
    probabilities over the weights' sum in increasing id order."""
    t = np.float32(max(params.temperature, 1e-5))
    x = logits.float().numpy() / t
    top = x.max()
    ids = np.flatnonzero(x >= np.float32(float(top) + math.log(params.min_p)))
    weights = [math.exp(float(x[i] - top)) for i in ids]
    total = 0.0
    for w in weights:
        total += w
    return torch.from_numpy(ids), torch.tensor(weights, dtype=torch.float64) / total


def whole_row_min_p_draw(logits: torch.Tensor, params: SamplingParams, noise: Noise,
                         position: int) -> int:
    """The race of every kept token, least -log(u) / p first, its uniforms keyed by id."""
    ids, probs = whole_row_min_p(logits, params)
    times = -torch.log(noise.uniforms(position, ids)) / probs
    return int(ids[int(times.argmin())])


def test_min_p_alone_keeps_and_draws_what_the_whole_row_pass_does_to_the_bit():
    from specchat.core.sampling import nucleus

    g = torch.Generator().manual_seed(0)
    for vocab in (262144, 4096):
        rows = torch.randn(6, vocab, generator=g) * 2
        rows[0, torch.randint(0, vocab, (3,), generator=g)] += 15  # peaked, like a real LM's
        rows[1] = (rows[1] * 3).round()  # ties everywhere
        rows[2, :vocab // 2] = -torch.inf  # a masked half
        rows[3, [5, vocab - 2]] = rows[3].max() + 0.01  # kept tokens in the first, last block
        rows[4] = rows[4] * 0.01  # flat: most blocks hold kept tokens
        rows[5, 1000] = 1e4  # one certain token
        if vocab > 4096:  # a flat row keeps most tokens: the narrower vocabulary checks it,
            rows = rows[[0, 1, 2, 3, 5]]  # since the reference's Python loop over 262k is slow
        for row, t, min_p in itertools.product(rows, (0.3, 1.0, 1.6), (0.05, 0.5, 1e-4)):
            params = SamplingParams(t, min_p=min_p)
            ids, probs = nucleus(row, params)
            want_ids, want_probs = whole_row_min_p(row, params)
            assert torch.equal(ids, want_ids)
            assert torch.equal(probs, want_probs)
            noise = Noise(int(t * 10))
            for position in range(2):
                # the same winner: -log(u) / weight and -log(u) / p order the tokens alike (but
                # for exact ties of times, which these draws do not meet)
                assert sample_row(row, params, noise, position) == whole_row_min_p_draw(
                    row, params, noise, position)
