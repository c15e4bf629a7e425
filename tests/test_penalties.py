"""Samplers that fight loops (repetition/frequency/presence penalties, DRY, min-p): their
definitions against plain reference code, and losslessness with every one of them on."""

import collections

import numpy as np
import pytest
import torch
from test_engine import REPETITIVE, TOK, ArgmaxDrafter, TopKTreeDrafter, make_engine, run
from tiny import loaded, most_repeats, tiny_gemma3, tiny_llama

from specchat.core.engine import Engine
from specchat.core.penalties import Penalties, Shaper
from specchat.core.sampling import SamplingParams, nucleus
from specchat.drafters.ngram import NgramDrafter
from specchat.ui.inspector import step_card

EVERY_PENALTY = dict(repeat_penalty=1.3, repeat_last_n=32, frequency_penalty=0.4,
                     presence_penalty=0.3, dry_multiplier=0.8, dry_base=1.75,
                     dry_allowed_length=2)
EVERY_SAMPLER = dict(EVERY_PENALTY, temperature=0.9, top_p=0.95, top_k=40, min_p=0.02)


def reference_dry(prefix: list[int], breakers: set[int]) -> dict[int, int]:
    """DRY's match lengths the slow, obvious way: for every earlier place i of the last token,
    the longest run of equal tokens going back from i and from the end, no breaker inside."""
    out: dict[int, int] = {}
    n = len(prefix)
    if n < 2 or prefix[-1] in breakers:
        return out
    for i in range(n - 1):
        if prefix[i] != prefix[-1] or prefix[i + 1] in breakers:
            continue
        length = 1
        while (length < 64 and i - length >= 0 and prefix[i - length] == prefix[n - 1 - length]
               and prefix[i - length] not in breakers):
            length += 1
        out[prefix[i + 1]] = max(out.get(prefix[i + 1], 0), length)
    return out


def test_dry_matches_the_reference_on_random_and_looping_texts():
    shaper = Shaper(Penalties(dry_multiplier=1.0), TOK)
    newline = TOK("\n")["input_ids"][0]
    rng = np.random.default_rng(0)
    texts = [list(rng.integers(3, 9, size=n)) for n in (2, 5, 40, 120)]
    texts.append(TOK(REPETITIVE)["input_ids"])
    texts.append(TOK("a: b\na: b\na: b\na:")["input_ids"])
    texts.append([3, 4, 5, 6, 7, 8, 9] * 40 + [3, 4])  # matches longer than DRY measures
    texts.append(TOK("one two, three: one two, three: one two")["input_ids"] * 3)
    for text in texts:
        breakers = {t for t in set(text) if shaper.is_breaker(int(t))}
        got = shaper.dry_matches(np.asarray(text, dtype=np.int64))
        assert got == reference_dry([int(t) for t in text], breakers)
    assert shaper.is_breaker(newline)
    # The looping prompt: after "the cat sat on", " the" continues a 14-token repeat.
    loop = shaper.dry_matches(np.asarray(TOK(REPETITIVE)["input_ids"]))
    assert max(loop.values()) >= 14


def test_penalties_follow_their_definitions():
    logits = torch.linspace(-2, 3, 20)
    prefix = [5, 7, 7, 15, 7, 5]  # 7 three times, 5 twice, 15 once
    pen = Penalties(repeat_penalty=2.0, repeat_last_n=4, frequency_penalty=0.5,
                    presence_penalty=0.25)
    out = Shaper(pen, TOK).shape(logits[None], prefix, [[]])[0]
    window = collections.Counter(prefix[-4:])  # 7 twice, 15 and 5 once
    expected = logits.clone()
    for token, count in window.items():
        x = float(logits[token])
        x = x / 2.0 if x > 0 else x * 2.0
        expected[token] = x - 0.5 * count - 0.25
    assert torch.equal(out, expected)
    # DRY subtracts multiplier * base ** (length - allowed) from the continuing token
    dry = Penalties(dry_multiplier=0.5, dry_base=2.0, dry_allowed_length=2)
    logits = torch.linspace(-2, 3, len(TOK))
    text = TOK("xyzabxy")["input_ids"]  # "x y" repeats; it was followed by z
    z = TOK("z")["input_ids"][0]
    out = Shaper(dry, TOK).shape(logits[None], text, [[]])[0]
    assert float(logits[z] - out[z]) == pytest.approx(0.5 * 2.0 ** 0)
    others = torch.arange(len(TOK)) != z
    assert torch.equal(out[others], logits[others])
    # one more repeated token doubles the penalty; a breaker in between ends the match
    text = TOK("wxyzabwxy")["input_ids"]
    out = Shaper(dry, TOK).shape(logits[None], text, [[]])[0]
    assert float(logits[z] - out[z]) == pytest.approx(0.5 * 2.0 ** 1)
    text = TOK("w:xyzabw:xy")["input_ids"]
    out = Shaper(dry, TOK).shape(logits[None], text, [[]])[0]
    assert float(logits[z] - out[z]) == pytest.approx(0.5 * 2.0 ** 0)


def test_rows_are_shaped_for_their_own_prefix():
    pen = Penalties(**{k: v for k, v in EVERY_PENALTY.items()})
    shaper = Shaper(pen, TOK)
    logits = torch.randn(3, len(TOK))
    context, extras = [10, 11, 12, 10, 11], [[], [12], [12, 10]]
    rows = shaper.shape(logits, context, extras)
    for r, extra in enumerate(extras):
        alone = shaper.shape(logits[r:r + 1], context + extra, [[]])
        assert torch.equal(rows[r], alone[0])


@pytest.mark.parametrize("params", [SamplingParams(1.0, min_p=0.05),
                                    SamplingParams(0.7, top_p=0.9, min_p=0.1),
                                    SamplingParams(1.3, top_k=30, min_p=0.3)])
def test_min_p_keeps_the_tokens_within_its_ratio_of_the_top_one(params):
    torch.manual_seed(0)
    logits = torch.randn(5000) * 3
    ids, probs = nucleus(logits, params)
    without, _ = nucleus(logits, SamplingParams(params.temperature, params.top_p, params.top_k))
    x = logits / params.temperature
    ratio = torch.exp(x - x.max())
    pool = set(range(5000)) if without is None else set(without.tolist())
    expected = {i for i in pool if ratio[i] >= params.min_p}
    assert set(ids.tolist()) == expected
    assert 1 < len(expected) < len(pool)
    assert float(probs.sum()) == pytest.approx(1.0)


def test_penalties_change_the_reply_and_break_its_loops():
    engine = make_engine(tiny_llama)
    plain, _, _ = run(engine, REPETITIVE, speculation=False, max_new_tokens=64)
    shaped, _, stats = run(engine, REPETITIVE, speculation=False, max_new_tokens=64,
                           **EVERY_PENALTY)
    assert [t.id for t in shaped] != [t.id for t in plain]
    assert stats.samplers and any("DRY" in s for s in stats.samplers)
    assert most_repeats([t.id for t in plain], 4) > 2  # the random model loops
    assert most_repeats([t.id for t in shaped], 4) < most_repeats([t.id for t in plain], 4)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
@pytest.mark.parametrize("drafter", ["self", "model", "ngram"])
def test_greedy_speculation_with_every_penalty_equals_plain(make, drafter):
    engine = make_engine(make)
    plain, _, _ = run(engine, REPETITIVE, speculation=False, **EVERY_PENALTY)
    spec, _, stats = run(engine, REPETITIVE, drafter=drafter, draft_len=4, adaptive=False,
                         **EVERY_PENALTY)
    assert [t.id for t in spec] == [t.id for t in plain]
    if drafter == "self":
        assert stats.accepted > 0


def _peaked(make=tiny_llama):
    model = make(0)
    with torch.no_grad():  # sharp distributions, so drafts pass (a random model's are flat)
        model.lm_head.weight.mul_(20)
    return model


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_greedy_trees_with_every_penalty_equal_plain(make):
    engine = make_engine(make)
    engine.drafters["tree"] = TopKTreeDrafter(make(0))
    plain, _, _ = run(engine, REPETITIVE, speculation=False, **EVERY_PENALTY)
    spec, steps, _ = run(engine, REPETITIVE, drafter="tree", draft_len=4, adaptive=False,
                         tree_nodes=20, **EVERY_PENALTY)
    assert [t.id for t in spec] == [t.id for t in plain]
    assert max(s.drafted for s in steps) > 4


@pytest.mark.parametrize("seed", [1, 2])
def test_seeded_speculation_with_every_sampler_replays_plain_sampling(seed):
    engine = Engine(loaded(_peaked(), TOK), {"argmax": ArgmaxDrafter(_peaked(), len(TOK)),
                                             "ngram": NgramDrafter()})
    plain, _, stats = run(engine, REPETITIVE, speculation=False, seed=seed, max_new_tokens=64,
                          **EVERY_SAMPLER)
    greedy, _, _ = run(engine, REPETITIVE, speculation=False, max_new_tokens=64,
                       **EVERY_PENALTY)
    assert [t.id for t in plain] != [t.id for t in greedy]  # really sampled
    assert "min-p 0.02" in stats.samplers
    accepted = 0
    for drafter in ("argmax", "ngram"):
        spec, _, s = run(engine, REPETITIVE, drafter=drafter, draft_len=4, adaptive=False,
                         seed=seed, max_new_tokens=64, **EVERY_SAMPLER)
        assert [t.id for t in spec] == [t.id for t in plain]
        accepted += s.accepted
    assert accepted > 0


def test_seeded_trees_with_every_sampler_replay_plain_sampling():
    engine = make_engine(tiny_gemma3)
    engine.model.lm_head.weight.data.mul_(20)
    engine.drafters["tree"] = TopKTreeDrafter(_peaked(tiny_gemma3), noise=0.1)
    plain, _, _ = run(engine, REPETITIVE, speculation=False, seed=3, **EVERY_SAMPLER)
    spec, _, _ = run(engine, REPETITIVE, drafter="tree", draft_len=4, adaptive=False, seed=3,
                     tree_nodes=20, **EVERY_SAMPLER)
    assert [t.id for t in spec] == [t.id for t in plain]


def test_the_step_card_names_the_samplers_and_shows_the_shaped_distribution():
    engine = make_engine(tiny_llama)
    _, steps, _ = run(engine, REPETITIVE, drafter="self", draft_len=3, adaptive=False,
                      **EVERY_PENALTY)
    evidence = [s.evidence for s in steps if s.evidence is not None]
    assert evidence and all(any("DRY" in n for n in e.samplers) for e in evidence)
    # greedy: the emitted token is the argmax of the shaped row, shown first in target_top
    assert all(e.target_top[0].id == e.token for e in evidence)
    card = step_card(next(s for s in steps if s.evidence is not None))
    assert "after the samplers" in card and "DRY 0.8 (base 1.75, allowed length 2)" in card


def test_a_reduced_vocabulary_row_is_shaped_as_the_same_tokens_of_a_full_row():
    shaper = Shaper(Penalties(**EVERY_PENALTY), TOK)
    vocab_ids = torch.tensor([7, 10, 11, 12, 40, 41, 200])  # a drafter's reduced vocabulary
    index = torch.full((len(TOK),), -1, dtype=torch.long)
    index[vocab_ids] = torch.arange(len(vocab_ids))
    full = torch.randn(len(TOK))
    for prefix in ([10, 11, 12, 10, 11, 12, 10, 11], [40, 41, 3, 40, 41, 3, 40, 5, 200]):
        want = full.clone()
        shaper.shape_row(want, np.asarray(prefix))
        got = full[vocab_ids].clone()
        shaper.shape_row(got, np.asarray(prefix), index)
        assert torch.equal(got, want[vocab_ids])
        assert not torch.equal(got, full[vocab_ids])  # the penalties did reach the row


def reference_shape_row(shaper: Shaper, row: torch.Tensor, prefix: np.ndarray,
                        index: torch.Tensor | None = None) -> None:
    """The penalties in plain torch, one operation per step of their definitions."""
    pen = shaper.penalties
    if pen.windowed:
        ids, counts = np.unique(prefix[-pen.repeat_last_n:], return_counts=True)
        ids_t, counts_t = torch.from_numpy(ids), torch.from_numpy(counts).float()
        if index is not None:
            ids_t = index[ids_t]
            ids_t, counts_t = ids_t[ids_t >= 0], counts_t[ids_t >= 0]
        values = row[ids_t]
        values = torch.where(values > 0, values / pen.repeat_penalty, values * pen.repeat_penalty)
        row[ids_t] = values - counts_t * pen.frequency_penalty - pen.presence_penalty
    if pen.dry:
        for token, length in shaper.dry_matches(prefix).items():
            at = token if index is None else int(index[token])
            if length >= pen.dry_allowed_length and at >= 0:
                row[at] -= pen.dry_multiplier * pen.dry_base ** (length - pen.dry_allowed_length)


@pytest.mark.parametrize("penalties", [
    EVERY_PENALTY, dict(repeat_penalty=1.1, repeat_last_n=64, dry_multiplier=0.8),
    dict(repeat_penalty=0.9, repeat_last_n=8), dict(frequency_penalty=0.7, repeat_last_n=16),
    dict(presence_penalty=-0.4, repeat_last_n=16), dict(dry_multiplier=2.5, dry_base=1.1,
                                                        dry_allowed_length=1)])
def test_shaping_a_row_equals_the_reference_to_the_bit(penalties):
    shaper = Shaper(Penalties(**penalties), TOK)
    rng = np.random.default_rng(1)
    vocab_ids = torch.tensor(sorted(rng.choice(len(TOK), 120, replace=False).tolist()))
    index = torch.full((len(TOK),), -1, dtype=torch.long)
    index[vocab_ids] = torch.arange(len(vocab_ids))
    loops = TOK(REPETITIVE)["input_ids"]
    for trial in range(40):
        # loops, random text over few tokens (long DRY matches), and over the reduced vocabulary
        if trial % 3 == 0:
            prefix = np.asarray(loops[:rng.integers(2, len(loops))], dtype=np.int64)
        elif trial % 3 == 1:
            prefix = rng.integers(3, 12, size=int(rng.integers(2, 200)))
        else:
            prefix = rng.choice(vocab_ids.numpy(), size=int(rng.integers(2, 200)))
        full = torch.randn(len(TOK)) * float(rng.choice([0.01, 1.0, 30.0]))
        want, got = full.clone(), full.clone()
        reference_shape_row(shaper, want, prefix)
        shaper.shape_row(got, prefix)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        want, got = full[vocab_ids].clone(), full[vocab_ids].clone()
        reference_shape_row(shaper, want, prefix, index)
        shaper.shape_row(got, prefix, index)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
