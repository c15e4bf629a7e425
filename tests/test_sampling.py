"""Verification step: exact cases on hand-written logits, and distribution equality."""

import itertools
import math

import pytest
import torch

from specchat.sampling import SamplingParams, draw, logits_to_probs, sample_row, verify

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
    v = verify(drafts, None, peaked([3, 1, 4, 5]), params, torch.Generator().manual_seed(0))
    assert (v.n_accepted, v.next_token, v.bonus) == (3, 5, True)


@pytest.mark.parametrize("params", [GREEDY, T1])
def test_reject_first(params):
    drafts = torch.tensor([3, 1, 4])
    v = verify(drafts, None, peaked([6, 1, 4, 5]), params, torch.Generator().manual_seed(0))
    assert (v.n_accepted, v.next_token, v.bonus) == (0, 6, False)


@pytest.mark.parametrize("params", [GREEDY, T1])
def test_reject_middle(params):
    drafts = torch.tensor([3, 1, 4])
    v = verify(drafts, None, peaked([3, 2, 4, 5]), params, torch.Generator().manual_seed(0))
    assert (v.n_accepted, v.next_token, v.bonus) == (1, 2, False)


def test_no_drafts_is_plain_sampling():
    v = verify(torch.zeros(0, dtype=torch.long), None, peaked([7]), T1, torch.Generator())
    assert (v.n_accepted, v.next_token) == (0, 7)


def test_draft_probs_used_in_ratio():
    # p(x)=0.25, q(x)=1.0 -> accept with probability 0.25; u is drawn from the seeded generator.
    vocab = 4
    target = torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.25] * 4]))
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    accepted = sum(verify(torch.tensor([0]), q, target, T1, torch.Generator().manual_seed(s))
                   .n_accepted for s in range(4000))
    assert abs(accepted / 4000 - 0.25) < 0.03


def tv(a, b):
    return 0.5 * float((a - b).abs().sum())


def emitted_first_token_distribution(target_logits, draft_probs, params, draws=20000, k=1):
    """Draw a draft from q, verify, record the first emitted token; return its histogram."""
    vocab = target_logits.shape[-1]
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(vocab)
    for _ in range(draws):
        if draft_probs is None:  # deterministic (one-hot) drafter, as n-gram lookup
            drafts = torch.tensor([2] * k)
        else:
            drafts = torch.multinomial(draft_probs, 1, generator=gen).squeeze(-1)[:k]
        v = verify(drafts, draft_probs[:k] if draft_probs is not None else None,
                   target_logits, params, gen)
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
    draft_probs = None if one_hot else logits_to_probs(draft_logits, params)
    got = emitted_first_token_distribution(target_logits, draft_probs, params)
    want = logits_to_probs(target_logits[:1], params)[0]
    assert tv(got, want) < 0.02, (got, want)


def test_logits_to_probs_matches_reference_top_p_top_k():
    torch.manual_seed(0)
    # Flat rows (most tokens are candidates), sharp rows like a real LM's (a few dozen are),
    # and top-k wider than the candidates (the full vocabulary is searched).
    for logits, params in itertools.product(
            (torch.randn(3, 5000) * 3, torch.randn(3, 5000) * 12),
            (SamplingParams(0.7, 0.95, 0), SamplingParams(1.0, 0.5, 50),
             SamplingParams(1.0, 1.0, 20), SamplingParams(2.0, 0.999, 0),
             SamplingParams(0.5, 1.0, 0), SamplingParams(0.3, 0.9, 400))):
        got = logits_to_probs(logits, params)
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


def test_draw_inverts_the_cdf():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(20000)]), minlength=4)
    assert counts[1] == 0  # a token without mass is never drawn
    assert tv(counts / 20000, probs) < 0.02


def test_sampling_a_row_draws_one_uniform():
    # Plain decoding and one-hot verification both consume exactly one uniform per token.
    logits = torch.randn(1000) * 8
    gen = torch.Generator().manual_seed(3)
    sample_row(logits, SamplingParams(0.7, 0.95, 0), gen)
    after = torch.Generator().manual_seed(3)
    torch.rand((), dtype=torch.float64, generator=after)
    assert torch.equal(gen.get_state(), after.get_state())


def test_untruncated_sampling_reaches_the_long_tail():
    # Temperature only: 5000 tokens 10 nats below the top one hold 18.5% of the mass together,
    # though each is outside the candidates the sampler sorts first.
    logits = torch.zeros(5001)
    logits[0] = 10.0
    gen = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample_row(logits, SamplingParams(1.0), gen) for _ in range(20000)])
    share = math.exp(10) / (math.exp(10) + 5000)
    assert abs(float((draws == 0).float().mean()) - share) < 0.01
    assert len(draws[draws != 0].unique()) > 2000
