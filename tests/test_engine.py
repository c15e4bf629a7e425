"""The engine on tiny random fp32 models: speculation must reproduce plain greedy exactly."""

import collections
import random
import threading

import pytest
import torch
from tiny import byte_tokenizer, loaded, tiny_gemma3, tiny_llama

from specchat.core.drafter import Drafter
from specchat.core.engine import Engine
from specchat.core.events import GenerationStats, StepRecord, TokenEvent
from specchat.core.request import TREE_NODES, GenerateConfig, default_tree_nodes
from specchat.core.sampling import SamplingParams
from specchat.core.text import tokens_until_stop
from specchat.core.tree import DraftTree
from specchat.drafters.model import ModelDrafter
from specchat.drafters.ngram import NgramDrafter
from specchat.models.vocab import vocab_mismatch

TOK = byte_tokenizer()
REPETITIVE = "the cat sat on the mat. the cat sat on the mat. the cat sat on"


def run(engine, prompt, **cfg):
    ids = TOK(prompt)["input_ids"] if isinstance(prompt, str) else prompt
    events = list(engine.stream(ids, GenerateConfig(**{"max_new_tokens": 48, **cfg})))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    steps = [e for e in events if isinstance(e, StepRecord)]
    assert isinstance(events[-1], GenerationStats)
    return tokens, steps, events[-1]


def make_engine(make=tiny_llama, draft_seed=1):
    target, other = make(0), make(draft_seed)
    return Engine(loaded(target, TOK), {
        "ngram": NgramDrafter(),
        "model": ModelDrafter(other, len(TOK)),
        "self": ModelDrafter(make(0), len(TOK)),  # same weights as the target
    })


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
@pytest.mark.parametrize("drafter", ["self", "model", "ngram"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculation_equals_plain_greedy(make, drafter, k):
    engine = make_engine(make)
    plain, _, _ = run(engine, REPETITIVE, speculation=False)
    spec, _, stats = run(engine, REPETITIVE, speculation=True, drafter=drafter, draft_len=k,
                         adaptive=False)
    assert [t.id for t in spec] == [t.id for t in plain]
    kinds = collections.Counter(t.kind for t in spec)
    if drafter == "self":  # draft == target: everything passes
        assert set(kinds) <= {"accepted", "bonus", "target"} and kinds["accepted"] > 0
        assert stats.alpha == 1.0
    if drafter == "model":  # an unrelated random model: mostly rejected
        assert kinds["resampled"] > kinds["accepted"]
    if drafter == "ngram":  # the prompt repeats itself, lookup finds continuations
        assert kinds["accepted"] > 0
    assert stats.target_calls < len(plain) + 1 or drafter == "model"


def test_plain_tokens_are_all_target_kind():
    tokens, steps, stats = run(make_engine(), REPETITIVE, speculation=False)
    assert {t.kind for t in tokens} == {"target"}
    assert stats.target_calls == len(tokens)  # prefill emits the first, then one per token
    assert stats.drafted == 0 and not stats.speculation


def test_cache_holds_exactly_the_accepted_context():
    engine = make_engine()
    ids = TOK(REPETITIVE)["input_ids"]
    for event in engine.stream(ids, GenerateConfig(max_new_tokens=30, drafter="model",
                                                   draft_len=4, adaptive=False)):
        if isinstance(event, StepRecord):
            # Invariant: every context token but the newest is cached, none of the rejected.
            assert engine._cache.get_seq_length() == len(engine._cache_ids)
        if isinstance(event, GenerationStats):
            assert event.rejections > 0


def test_long_generation_past_sliding_window_matches_plain():
    # Window 16, prompt of 62 tokens: rollback must work once sliding layers are full.
    engine = make_engine(tiny_gemma3, draft_seed=3)
    plain, _, _ = run(engine, REPETITIVE, speculation=False, max_new_tokens=120)
    engine.reset_cache()
    spec, _, stats = run(engine, REPETITIVE, drafter="model", draft_len=5, adaptive=False,
                         max_new_tokens=120)
    assert stats.rejections > 10
    assert [t.id for t in spec] == [t.id for t in plain]


def test_follow_up_turn_reuses_cached_prefix():
    """A chat's history is encoded once while its page line stays put; a follow-up whose prompt
    fills a new page re-encodes from the old page line (those tokens were decoded row by row,
    and a fresh encoding computes them as a whole page). Either way the reply is a fresh
    engine's."""
    engine = make_engine(tiny_gemma3)
    opening = REPETITIVE + " the mat."  # 71 tokens: a whole page of 64, then 7
    first, _, s1 = run(engine, opening, drafter="ngram", max_new_tokens=16)
    history = TOK(opening)["input_ids"] + [t.id for t in first]
    follow = history + TOK(" and then?")["input_ids"]  # 97 tokens: the line stays at 64
    second, _, s2 = run(engine, follow, drafter="ngram")
    assert s1.prefill_tokens == len(TOK(opening)["input_ids"])
    assert s2.prefill_tokens <= len(TOK(" and then?")["input_ids"]) + 1
    engine.reset_cache()
    fresh, _, _ = run(engine, follow, speculation=False)
    assert [t.id for t in second] == [t.id for t in fresh]
    longer = follow + [t.id for t in second] + TOK(" and?")["input_ids"]  # 150: two pages
    third, _, s3 = run(engine, longer, drafter="ngram")
    assert s3.prefill_tokens == len(longer) - 64
    engine.reset_cache()
    engine.prefixes.clear()
    fresh, _, _ = run(engine, longer, speculation=False)
    assert [t.id for t in third] == [t.id for t in fresh]


def test_texts_concatenate_to_the_reply_and_multibyte_is_never_split():
    engine = make_engine()
    tokens, _, _ = run(engine, "héllo wörld ✓ ünïcödé " * 3, speculation=False, max_new_tokens=60)
    # A random model emits arbitrary bytes; whatever they are, the texts add up to the reply.
    assert "".join(t.text for t in tokens) == TOK.decode([t.id for t in tokens])
    # Valid UTF-8 fed one byte-token at a time: no delta ever holds half a character.
    from specchat.core.text import Detokenizer
    text = "héllo wörld ✓ 日本語 🙂"
    detok = Detokenizer(TOK, TOK("x")["input_ids"])
    deltas = [detok.add(i) for i in TOK(text)["input_ids"]]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 5  # bytes of multi-byte chars were held back


def test_stop_string_ends_the_reply_and_is_not_shown():
    engine = make_engine()
    tokens, _, _ = run(engine, REPETITIVE, speculation=False, max_new_tokens=40)
    full = "".join(t.text for t in tokens)
    stop = full[10:13]
    cut, _, stats = run(engine, REPETITIVE, speculation=True, drafter="ngram", stop=(stop,),
                        max_new_tokens=40)
    assert stats.stop_reason == "stop_string"
    assert stats.new_tokens == len(cut)  # tokens of the stop string are not counted
    assert "".join(t.text for t in cut) == full[:full.find(stop)]


def test_a_reply_cut_by_its_limit_drops_the_start_of_a_stop_string():
    engine = make_engine()
    tokens, _, _ = run(engine, REPETITIVE, speculation=False, max_new_tokens=12)
    full = "".join(t.text for t in tokens)
    stop = full[-3:] + "<never>"  # the reply's last 3 characters start this stop string
    cut, _, stats = run(engine, REPETITIVE, speculation=False, max_new_tokens=12, stop=(stop,))
    assert stats.stop_reason == "length"
    assert "".join(t.text for t in cut) == full[:-3] and stats.new_tokens == len(cut)
    # Ended another way (EOS, or stopped by the user): everything held back is shown.
    from specchat.core.text import ReplyText
    ids = TOK(REPETITIVE)["input_ids"]
    reply = ReplyText(TOK, ids, (stop,))
    shown = [e for t in tokens for e in reply.push(TokenEvent(t.id, "", "target", 1, 0, 0))[0]]
    assert "".join(e.text for e in shown + reply.finish()) == full


def test_reply_text_shows_exactly_the_text_before_the_first_stop_string():
    """Random byte streams (multi-byte characters split across tokens included) against stop
    strings that start with common and rare characters: what is shown, at every push and at
    the end, is the reply's text up to its first stop string, and nothing past what is known."""
    from specchat.core.text import ReplyText
    rng = random.Random(0)
    alphabet = ["a", "b", "\n", "U", "é", "€", " "]
    for trial in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = TOK(text, add_special_tokens=False)["input_ids"]  # a token a byte
        assert len(ids) == len(text.encode())
        stops = rng.choice([(), ("\nU",), ("ab", "\n\n"), ("€a",), ("b",)])
        reply = ReplyText(TOK, TOK("x", add_special_tokens=False)["input_ids"], stops)
        shown, hit = "", False
        for i, token in enumerate(ids):
            released, hit = reply.push(TokenEvent(token, "", "target", 1, 0, 0))
            shown += "".join(e.text for e in released)
            known = TOK.decode(ids[:i + 1]).rstrip("\ufffd")
            assert known.startswith(shown), (text, stops)
            if hit:
                break
        if not hit:
            shown += "".join(e.text for e in reply.finish())
        cut = [text.find(s) for s in stops if s in text]
        assert shown == (text[:min(cut)] if cut else text), (text, stops)


def test_tokens_until_stop_keeps_drafts_up_to_the_stop_string():
    ids = lambda text: TOK(text)["input_ids"]  # noqa: E731 (byte-level: a token a byte)
    context = ids("Answer: yes")
    assert tokens_until_stop(TOK, context, ids(" and no\nUser: why?"), ("\nUser:",)) == 13
    assert tokens_until_stop(TOK, context, ids(" and no, why?"), ("\nUser:",)) == 13  # all
    assert tokens_until_stop(TOK, context, ids(" and no\nUser: why?"), ()) == 18
    # a stop string begun in the context and completed by the draft
    assert tokens_until_stop(TOK, ids("yes\nUs"), ids("er: why?"), ("\nUser:",)) == 3
    # one already in the context does not count (the prompt may hold stop strings)
    assert tokens_until_stop(TOK, ids("\nUser:"), ids(" hi there"), ("\nUser:",)) == 9


class ScriptedDrafter(NgramDrafter):
    """Always proposes the same text (one-hot drafts)."""

    def __init__(self, text):
        super().__init__()
        self.ids = TOK(text)["input_ids"]

    def propose(self, context, k, params, noise):
        return torch.tensor(self.ids[:k], dtype=torch.long), None


def test_drafts_are_cut_after_a_stop_string():
    engine = make_engine()
    engine.drafters["scripted"] = ScriptedDrafter("ab\nUser: more words")
    _, steps, _ = run(engine, REPETITIVE, speculation=True, drafter="scripted", draft_len=12,
                      adaptive=False, stop=("\nUser:",), max_new_tokens=30)
    assert max(s.drafted for s in steps) == 8  # "ab\nUser:" (fewer near max_new_tokens)
    _, steps, _ = run(engine, REPETITIVE, speculation=True, drafter="scripted", draft_len=12,
                      adaptive=False, max_new_tokens=30)
    assert max(s.drafted for s in steps) == 12


def test_max_new_tokens_and_stop_event():
    engine = make_engine()
    tokens, _, stats = run(engine, REPETITIVE, drafter="ngram", max_new_tokens=7)
    assert len(tokens) == 7 and stats.stop_reason == "length"
    stop = threading.Event()
    ids = TOK(REPETITIVE)["input_ids"]
    got = []
    for event in engine.stream(ids, GenerateConfig(max_new_tokens=100, drafter="ngram"), stop):
        if isinstance(event, TokenEvent):
            got.append(event)
            stop.set()
        last = event
    assert last.stop_reason == "stopped" and 1 <= len(got) <= 8


def test_sampling_is_reproducible_with_a_seed():
    # Reproducible for a fixed k (the adaptive k follows measured timings, so it is not).
    engine = make_engine()
    cfg = dict(temperature=0.8, top_p=0.9, seed=7, drafter="model", adaptive=False)
    a, _, _ = run(engine, REPETITIVE, **cfg)
    b, _, _ = run(engine, REPETITIVE, **cfg)
    c, _, _ = run(engine, REPETITIVE, **{**cfg, "seed": 8})
    assert [t.id for t in a] == [t.id for t in b] != [t.id for t in c]


def test_adaptive_draft_length_stops_drafting_a_useless_draft():
    engine = make_engine()
    _, steps, stats = run(engine, REPETITIVE, drafter="model", draft_len=4, max_new_tokens=60)
    # Draft never agrees: after a few probes most steps run plain.
    assert sum(1 for s in steps if s.drafted == 0) > len(steps) // 2


def test_probes_back_off_while_drafts_keep_failing_and_return_when_they_pay():
    """Drafts that always fail: a probe every 8th step, then every 16th, 32nd, 32nd; a probe
    whose draft passes brings the gap back to 8, and drafting resumes once it pays."""
    from specchat.core.policy import DraftLengthPolicy

    policy = DraftLengthPolicy()
    drafted = []
    for _ in range(260):
        k = policy.choose(4)
        policy.update(k + 1, 0.01 * (1 + 0.3 * k), k, 0, 0.002 * k)  # every draft refused
        drafted.append(k > 0)
    start = drafted.index(False)  # the prior's optimism spent: plain steps, and probes
    probes = [i for i in range(start, len(drafted)) if drafted[i]]
    gaps = [b - a for a, b in zip([start - 1] + probes, probes)]
    assert gaps[:4] == [8, 16, 32, 32]
    while not policy.choose(4):  # the next probe's draft passes
        policy.update(1, 0.01, 0, 0, 0.0)
    policy.update(2, 0.013, 1, 1, 0.002)
    assert policy.probe_gap() == policy.probe_every
    # and so do the drafts after it: the probes' passes outweigh the failures' decayed weight
    # (ALPHA_DECAY) within about fifteen probes, then the drafts' own
    for _ in range(160):
        k = policy.choose(4)
        policy.update(k + 1, 0.01 * (1 + 0.3 * k), k, k, 0.002 * k)
    assert policy.choose(4) > 0


def test_a_drafter_whose_tokens_cost_more_than_they_save_probes_rarely():
    """Drafts that pass 60% of the time but cost 1.2 plain steps a token (a head catching up
    over the steps it skipped): a probe is expected to lose 1.16 + 1.2 - 1.6 = 0.76 plain
    steps, so probes come at least 0.76 / PROBE_BUDGET steps apart, whether their drafts pass
    or not; a drafter that costs nothing is probed every 8 to 32 steps as before."""
    from specchat.core.policy import DraftLengthPolicy

    def gaps(draft_cost: float) -> list[int]:
        policy, probes = DraftLengthPolicy(), []
        for i in range(3000):
            k = policy.choose(4)
            passed = min(k, 1) if len(probes) % 5 < 3 else 0  # 3 probes in 5 pass
            policy.update(k + 1, 0.01 * (1 + 0.16 * k), k, passed, draft_cost * k)
            if k:
                probes.append(i)
        return [b - a for a, b in zip(probes[20:], probes[21:])]

    needed = 0.76 / DraftLengthPolicy.PROBE_BUDGET  # at the true alpha; the estimate wanders
    costly = gaps(0.012)
    assert len(costly) > 10 and 0.85 * needed <= sum(costly) / len(costly) <= 1.15 * needed
    assert min(costly) >= 0.6 * needed and max(costly) <= DraftLengthPolicy.MAX_COST_GAP
    assert max(gaps(0.0)) <= 32


def test_drafting_that_runs_without_proposing_counts_in_the_draft_cost():
    """A drafter that was asked and proposed nothing (a head under its confidence bar) still
    ran: its seconds count per drafted token, so drafts that pass 90% of the time but are
    made on one step in ten, for a head run on every step, no longer look worth it."""
    from specchat.core.policy import DraftLengthPolicy

    def trained(asked_for_nothing: bool):
        policy = DraftLengthPolicy(probe_every=1000)
        for i in range(200):
            policy.update(1, 0.10, 0, 0, 0.0)  # plain steps: 0.1 s
            if i % 10 == 0:
                policy.update(2, 0.11, 1, 1 if i % 100 else 0, 0.008)  # passes 90%
            elif asked_for_nothing:
                policy.update(1, 0.10, 0, 0, 0.008, asked=True)  # ran, proposed nothing
        return policy

    assert trained(False).draft_token_s() == pytest.approx(0.008)
    assert 0.06 < trained(True).draft_token_s() < 0.2  # about 10 runs per draft, decayed
    assert trained(False).choose(1) == 1 and trained(True).choose(1) == 0


def test_mismatched_tokenizers_are_refused_with_the_difference():
    other = byte_tokenizer(extra=["<extra>"])
    problem = vocab_mismatch(TOK, other, 259, 260)
    assert "tokenizer size 259 vs 260" in problem
    shuffled = byte_tokenizer()
    assert vocab_mismatch(TOK, shuffled, 259, 259) is None


def test_draft_length_policy_sizes_k_per_draft_class():
    """Reliable 3-token n-gram matches earn long drafts while 1-token matches, which fail here,
    fall back to plain steps: acceptance is kept per class, the cost curve is shared."""
    from specchat.core.policy import DraftLengthPolicy
    policy = DraftLengthPolicy(probe_every=1000)
    for _ in range(30):
        policy.update(1, 0.10, 0, 0, 0.0)  # plain steps: 0.1 s
        policy.update(9, 0.12, 8, 8, 0.0008, cls=3)  # 8 of 8 accepted
        policy.update(5, 0.11, 4, 0, 0.0004, cls=1)  # none accepted
    assert policy.alpha(3) > 0.9 and policy.alpha(1) < 0.2
    assert policy.choose(8, cls=3) == 8
    assert policy.choose(8, cls=1) == 0
    assert policy.choose(8, cls=2) > 0  # an unseen class starts from the prior


def test_a_cheap_draft_class_does_not_make_another_class_probe_often():
    """The combined drafter's lookups cost a tenth of a millisecond, its head's drafts two
    plain steps (a probe's catch-up): each class's drafting cost is its own, so the head's
    probes stay as rare as its own cost asks, however often the lookups draft."""
    from specchat.core.policy import DraftLengthPolicy

    def head_gaps(lookups: bool) -> list[int]:
        policy, probes = DraftLengthPolicy(), []
        for i in range(6000):
            if lookups and i % 4 == 0:  # a reliable 3-token match, drafted cheaply
                k = policy.choose(4, cls=3)
                policy.update(k + 1, 0.01 * (1 + 0.16 * k), k, k, 0.0001 * k, cls=3)
                continue
            k = policy.choose(4, cls="head")
            passed = min(k, 1) if len(probes) % 5 < 3 else 0  # 3 probes in 5 pass
            policy.update(k + 1, 0.01 * (1 + 0.16 * k), k, passed, 0.02 * k, cls="head")
            if k:
                probes.append(i)
        assert policy.draft_token_s("head") == pytest.approx(0.02)
        return [b - a for a, b in zip(probes[10:], probes[11:])]

    alone, beside = head_gaps(False), head_gaps(True)
    assert len(beside) > 5 and min(beside) > 50
    assert sum(beside) / len(beside) >= 0.7 * sum(alone) / len(alone)

def test_a_probes_catch_up_prices_the_probes_not_the_drafts():
    """A head that sat out many steps catches up when it probes: two plain steps' worth, where
    a draft on the step after a draft costs a twentieth of one. While its drafts fail, the
    probes' own cost spaces them as PROBE_BUDGET asks; when the text turns and they pass (nine
    in ten), a probe that passes turns drafting back on."""
    from specchat.core.policy import DraftLengthPolicy
    policy, last, probes, drafting = DraftLengthPolicy(), 0, [], 0
    for i in range(4000):
        k = policy.choose(4)
        draft_s = (0.02 if last == 0 else 0.0005 * k) if k else 0.0
        passed = (k if i % 10 else 0) if i >= 2000 else 0
        policy.update(k + 1, 0.01 * (1 + 0.16 * k), k, passed, draft_s, asked=k > 0)
        if k and last == 0 and i < 2000:
            probes.append(i)
        drafting += i >= 2000 and k > 0
        last = k
    gaps = [b - a for a, b in zip(probes[3:], probes[4:])]
    assert len(gaps) > 5 and min(gaps) > 100
    assert drafting > 500  # (plain with probes only: a dozen)


def test_a_one_off_cost_in_the_first_draft_does_not_rest_a_drafter_for_good():
    """The first proposal paid a one-off cost (thirty plain steps): drafting looks dear and the
    class rests. Its probes cost what a draft costs; cheaper than the drafts' price, they bring
    that price down until drafting pays again, as it does (drafts pass 90% of the time)."""
    from specchat.core.policy import DraftLengthPolicy
    policy, drafting = DraftLengthPolicy(), []
    policy.update(1, 0.01, 0, 0, 0.0)
    for i in range(600):
        k = policy.choose(4)
        draft_s = (0.3 if i == 0 else 0.0005 * k)
        passed = k if i % 10 else max(k - 1, 0)
        policy.update(k + 1, 0.01 * (1 + 0.05 * k), k, passed, draft_s, asked=k > 0)
        drafting.append(k > 0)
    assert not all(drafting[1:20])  # rested at first
    assert sum(drafting[-100:]) > 90  # and drafting again


def test_ngram_draft_class_is_the_match_length():
    drafter = NgramDrafter(max_n=3)
    ids = TOK(REPETITIVE)["input_ids"]
    drafter.begin(ids)
    assert drafter.draft_class(ids) == 3  # "...the cat sat on" occurred before
    novel = ids + TOK("Q")["input_ids"]
    assert drafter.draft_class(novel) == 0  # "Q" never occurred
    assert drafter.propose(novel, 4, None, None)[0].numel() == 0


def test_draft_length_policy_does_not_draft_for_a_marginal_gain():
    """Drafting that is expected to beat plain decoding by less than the margin is not worth the
    risk: the policy decodes plainly (and probes now and then) instead."""
    from specchat.core.policy import DraftLengthPolicy
    policy = DraftLengthPolicy(probe_every=1000, margin=0.05)
    for _ in range(30):
        policy.update(1, 0.10, 0, 0, 0.0)
        policy.update(2, 0.118, 1, 0, 0.0, cls="weak")  # 1 draft, 18% dearer, ~1 in 6 accepted
        policy.update(2, 0.118, 1, 0, 0.0, cls="weak")
        policy.update(2, 0.118, 1, 0, 0.0, cls="weak")
        policy.update(2, 0.118, 1, 0, 0.0, cls="weak")
        policy.update(2, 0.118, 1, 0, 0.0, cls="weak")
        policy.update(2, 0.118, 1, 1, 0.0, cls="weak")
    gain = policy.expected_rate(1, "weak") / policy.expected_rate(0, "weak")
    assert 1.0 < gain < 1.05  # drafting would pay, but barely
    assert policy.choose(4, cls="weak") == 0
    policy.margin = 0.0
    assert policy.choose(4, cls="weak") == 1


class ArgmaxDrafter(ModelDrafter):
    """One-hot drafts from a model: its argmax, as n-gram lookup drafts one-hot continuations."""
    name = "argmax"

    def propose(self, context, k, params, noise):
        ids, _ = super().propose(context, k, SamplingParams(), noise)
        return ids, None


@pytest.mark.parametrize("sampling", [dict(temperature=1.0, top_p=0.95),
                                      dict(temperature=0.8), dict(temperature=1.2, top_k=8)])
@pytest.mark.parametrize("k", [1, 4])
def test_sampled_one_hot_speculation_replays_plain_sampling(sampling, k):
    # One draw y ~ p per position decides acceptance and the resample, the draw plain decoding
    # makes: with the same seed, one-hot speculation gives plain decoding's very reply.
    def peaked():  # sharp distributions (a random tiny model's are nearly flat): drafts pass
        model = tiny_llama(0)
        with torch.no_grad():
            model.lm_head.weight.mul_(20)
        return model
    engine = Engine(loaded(peaked(), TOK), {"argmax": ArgmaxDrafter(peaked(), len(TOK)),
                                            "ngram": NgramDrafter()})
    greedy, _, _ = run(engine, REPETITIVE, speculation=False, max_new_tokens=64)
    accepted = 0
    for seed in (1, 2):
        plain, _, _ = run(engine, REPETITIVE, speculation=False, seed=seed, max_new_tokens=64,
                          **sampling)
        assert [t.id for t in plain] != [t.id for t in greedy]  # really sampled
        for drafter in ("argmax", "ngram"):
            spec, _, stats = run(engine, REPETITIVE, drafter=drafter, draft_len=k, seed=seed,
                                 adaptive=False, max_new_tokens=64, **sampling)
            assert [t.id for t in spec] == [t.id for t in plain]
            accepted += stats.accepted
    assert accepted > 0


def test_verify_cost_line_has_a_fixed_part():
    """A 2-token verify costing 1.2 steps and an 11-token one 1.9 (a one-token
    step's LM head is a cheaper matrix-vector product) is a line with a fixed part, not a
    line through the one-token step."""
    from specchat.core.policy import DraftLengthPolicy
    policy = DraftLengthPolicy()
    for _ in range(20):
        policy.update(1, 0.10, 0, 0, 0.0)
        for m in (2, 3, 5, 8, 11):
            policy.update(m, 0.10 * (1 + 0.13 + 0.07 * (m - 1)), m - 1, 0, 0.0)
    fixed, slope = policy.verify_line
    assert fixed == pytest.approx(0.13, abs=0.01) and slope == pytest.approx(0.07, abs=0.005)
    assert policy._verify_cost(2) == pytest.approx(0.12, rel=0.02)
    assert policy._verify_cost(1) == pytest.approx(0.10, rel=0.02)
    only_two = DraftLengthPolicy()  # one width seen: its level from the data, slope the prior
    for _ in range(5):
        only_two.update(1, 0.10, 0, 0, 0.0)
        only_two.update(2, 0.12, 1, 1, 0.0)
    assert only_two._verify_cost(2) == pytest.approx(0.12, rel=0.02)


def test_verify_costs_off_the_line_are_priced_per_width():
    """Float32 products padded to 4 columns: 2-4 tokens cost one step, 5-8 about 1.8. The
    line through them would price 4 tokens at ~1.3 steps; widths measured often enough are
    priced by their own measurements, and k follows (here: 3 drafts; the line says 2)."""
    from specchat.core.policy import DraftLengthPolicy
    cost = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.02, 5: 1.8, 6: 1.85, 7: 1.9, 8: 1.95}
    policy = DraftLengthPolicy(probe_every=1000)
    for _ in range(20):
        for m, c in cost.items():
            policy.update(m, 0.10 * c, m - 1, (m - 1) // 2, 0.0)  # alpha ~0.66
    fixed, slope = policy.verify_line
    assert 1 + fixed + 3 * slope > 1.2  # the line's price of 4 tokens
    assert policy._verify_cost(4) == pytest.approx(0.102, rel=0.02)
    assert policy._verify_cost(5) == pytest.approx(0.18, rel=0.02)
    assert policy._verify_cost(10) == pytest.approx(0.10 * (1 + fixed + 9 * slope))  # unseen
    assert policy.choose(7) == 3


class TopKTreeDrafter(Drafter):
    """Draft trees from a model's own top-`width` tokens at each node, expanding two nodes a
    level, siblings shuffled. With the target's weights most levels hold the target's token
    somewhere; `noise` replaces a level's tokens at random so paths also break early."""

    name = "tree"
    supports_trees = True

    def __init__(self, model, width=3, depth=4, noise=0.3, seed=0):
        self.model, self.width, self.depth, self.noise = model, width, depth, noise
        self.rng = random.Random(seed)

    def propose(self, context, k, params, noise):
        raise AssertionError("asked for trees: the engine calls propose_tree")

    @torch.inference_mode()
    def propose_tree(self, context, k, params, nodes, noise=None):
        tokens, parents, frontier = [], [], [(-1, [])]
        for _ in range(min(k, self.depth)):
            grown = []
            for node, path in frontier:
                logits = self.model(torch.tensor([context + path])).logits[0, -1]
                top = logits.topk(self.width).indices.tolist()
                if self.rng.random() < self.noise:
                    top = self.rng.sample(range(3, logits.shape[-1]), self.width)
                self.rng.shuffle(top)
                for t in top:
                    tokens.append(t)
                    parents.append(node)
                    grown.append((len(tokens) - 1, path + [t]))
            frontier = self.rng.sample(grown, min(2, len(grown)))
            frontier.sort()  # keep parents before children
        return DraftTree(torch.tensor(tokens, dtype=torch.long), parents)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_greedy_tree_speculation_equals_plain_greedy(make):
    """Past the sliding window too (16 positions on tiny_gemma3): masks count positions."""
    engine = make_engine(make)
    engine.drafters["tree"] = TopKTreeDrafter(make(0))
    plain, _, _ = run(engine, REPETITIVE, speculation=False)
    spec, steps, stats = run(engine, REPETITIVE, speculation=True, drafter="tree", draft_len=4,
                             adaptive=False, tree_nodes=20)
    assert [t.id for t in spec] == [t.id for t in plain]
    kinds = collections.Counter(t.kind for t in spec)
    assert kinds["accepted"] > 0 and kinds["resampled"] > 0 and kinds["bonus"] > 0
    assert max(s.drafted for s in steps) > 4  # trees, not chains
    assert stats.target_calls < len(plain) / 2
    # the cache holds exactly the context but the newest token, in order
    assert engine._cache_ids == TOK(REPETITIVE)["input_ids"] + [t.id for t in spec][:-1]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9)])
def test_sampled_tree_speculation_replays_plain_sampling(make, sampling):
    engine = make_engine(make)
    sharp = make(0)
    with torch.no_grad():  # sharper distributions, so trees are often right
        sharp.lm_head.weight.mul_(20)
        engine.model.lm_head.weight.mul_(20)
    engine.drafters["tree"] = TopKTreeDrafter(sharp, noise=0.1)
    plain, _, _ = run(engine, REPETITIVE, speculation=False, seed=5, **sampling)
    spec, _, _ = run(engine, REPETITIVE, speculation=True, drafter="tree", draft_len=4,
                     adaptive=False, seed=5, tree_nodes=20, **sampling)
    assert [t.id for t in spec] == [t.id for t in plain]
    assert collections.Counter(t.kind for t in spec)["accepted"] > 0


def test_trees_by_default_for_the_drafters_the_engine_names_when_greedy():
    assert default_tree_nodes(0.0, "head") == TREE_NODES
    assert default_tree_nodes(0.0, "combined") == default_tree_nodes(0.7, "head") == 0
    assert default_tree_nodes(0.0, "head", greedy_trees=()) == 0  # where chains are faster
    assert default_tree_nodes(0.0, "combined", greedy_trees=("head", "combined")) == TREE_NODES
    assert default_tree_nodes(0.7, "combined", greedy_trees=("head", "combined")) == 0


def test_prompt_past_the_context_window_is_refused_and_replies_stop_at_it():
    model = tiny_gemma3(0)
    model.config.max_position_embeddings = 40
    engine = Engine(loaded(model))
    with pytest.raises(ValueError, match="the prompt is 40 tokens; tiny reads at most 40"):
        list(engine.stream([5] * 40, GenerateConfig(max_new_tokens=8, speculation=False)))
    events = list(engine.stream([5] * 36, GenerateConfig(max_new_tokens=50, speculation=False)))
    stats = events[-1]
    assert stats.new_tokens <= 4 and stats.stop_reason in ("length", "eos")


# ---------------------------------------------------------------------------------------------
# Step records that explain (the inspector's data)

def _step_tokens(tokens, steps):
    """{step number: its TokenEvents}"""
    by_step = collections.defaultdict(list)
    for t in tokens:
        by_step[t.step].append(t)
    return by_step


def _check_chain_records(tokens, steps):
    by_step = _step_tokens(tokens, steps)
    rejections = 0
    for record in steps:
        emitted = by_step[record.step]
        if not record.drafted:
            assert record.evidence is None and [t.kind for t in emitted] == ["target"]
            continue
        n, evidence = record.accepted, record.evidence
        assert len(record.proposal) == record.drafted == len(record.proposal_text)
        assert record.path == list(range(n)) and record.parents is None
        assert [t.id for t in emitted[:n]] == record.proposal[:n]
        assert {t.kind for t in emitted[:n]} <= {"accepted"}
        if len(emitted) == n + 1:  # (a stop may end the step early)
            assert emitted[n].id == evidence.token
            assert emitted[n].kind == ("bonus" if n == record.drafted else "resampled")
        assert evidence.position == n
        if n < record.drafted:
            rejections += 1
            assert evidence.rejected == record.proposal[n] != evidence.token
            assert evidence.rejected_text == TOK.decode([evidence.rejected])
        else:
            assert evidence.rejected is None and evidence.p is None
        assert 1 <= len(evidence.target_top) <= 5
        assert record.k >= record.drafted
    return rejections


def test_greedy_chain_records_name_the_refused_draft_and_the_argmax():
    engine = make_engine()
    tokens, steps, _ = run(engine, REPETITIVE, speculation=True, drafter="model", draft_len=4,
                           adaptive=False)
    assert _check_chain_records(tokens, steps) > 0
    for record in steps:
        evidence = record.evidence
        if evidence is None:
            continue
        assert evidence.greedy and evidence.target_top[0].id == evidence.token  # the argmax
        probs = [c.prob for c in evidence.target_top]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6
        if evidence.rejected is not None:
            assert evidence.accept_prob is None and 0 <= evidence.p <= probs[0]
            # The draft model has a distribution: its top-5 at the decisive position, led by
            # the token it proposed (greedy).
            assert evidence.draft_top[0].id == evidence.rejected


def test_sampled_records_carry_the_p_and_q_the_test_used(monkeypatch):
    from specchat.core import engine as engine_module
    verdicts = []
    real = engine_module.verify

    def spy(*args, **kwargs):
        verdicts.append(real(*args, **kwargs))
        return verdicts[-1]

    monkeypatch.setattr(engine_module, "verify", spy)
    engine = make_engine()
    tokens, steps, _ = run(engine, REPETITIVE, speculation=True, drafter="model", draft_len=4,
                           adaptive=False, temperature=0.9, seed=3, max_new_tokens=64)
    assert _check_chain_records(tokens, steps) > 0
    spec_verdicts = iter(verdicts[1:])  # the first is the prefill's plain draw
    for record in steps:
        verdict = next(spec_verdicts)
        evidence = record.evidence
        if evidence is None or evidence.rejected is None:
            continue
        assert not evidence.greedy
        assert (evidence.p, evidence.q) == (verdict.p, verdict.q)
        assert evidence.accept_prob == pytest.approx(min(1.0, verdict.p / verdict.q))
        assert 0 <= evidence.p <= 1 and 0 < evidence.q <= 1


def test_sampled_records_match_probabilities_recomputed_from_the_models():
    from specchat.core.sampling import nucleus
    engine = make_engine()
    prompt = TOK(REPETITIVE)["input_ids"]
    params = dict(temperature=0.9, seed=4, max_new_tokens=48)
    tokens, steps, _ = run(engine, prompt, speculation=True, drafter="model", draft_len=4,
                           adaptive=False, **params)
    by_step = _step_tokens(tokens, steps)
    context = list(prompt)
    checked = 0
    for record in steps:
        evidence = record.evidence
        if evidence is not None and evidence.rejected is not None:
            at = context + [t.id for t in by_step[record.step][:record.accepted]]
            sampling = SamplingParams(0.9)
            with torch.no_grad():
                target = engine.model(torch.tensor([at])).logits[0, -1]
                draft = engine.drafters["model"].model(torch.tensor([at])).logits[0, -1]
            p_ids, p = nucleus(target, sampling)
            q_ids, q = nucleus(draft, sampling)
            # (a cached forward and a fresh one round differently in the last digits)
            assert evidence.p == pytest.approx(float(p[evidence.rejected]), rel=1e-2)
            assert evidence.q == pytest.approx(float(q[evidence.rejected]), rel=1e-2)
            checked += 1
        context += [t.id for t in by_step[record.step]]
    assert checked > 0


def test_tree_records_hold_the_tree_the_path_and_the_refused_children():
    engine = make_engine()
    engine.drafters["tree"] = TopKTreeDrafter(tiny_llama(0))
    tokens, steps, _ = run(engine, REPETITIVE, speculation=True, drafter="tree", draft_len=4,
                           adaptive=False, tree_nodes=20)
    by_step = _step_tokens(tokens, steps)
    refused = 0
    for record in steps:
        if not record.drafted:
            continue
        emitted, evidence = by_step[record.step], record.evidence
        assert len(record.parents) == len(record.proposal) == record.drafted
        assert [record.proposal[i] for i in record.path] == [t.id for t in emitted][
            :len(record.path)]
        for parent, child in zip([-1, *record.path], record.path):  # a path down the tree
            assert record.parents[child] == parent
        decisive = record.path[-1] if record.path else -1
        children = [i for i, p in enumerate(record.parents) if p == decisive]
        if evidence.rejected is not None:
            refused += 1
            assert evidence.rejected in [record.proposal[i] for i in children]
            assert evidence.token not in [record.proposal[i] for i in children]
        else:
            assert not children  # the path ended at a leaf: a bonus token
    assert refused > 0


def test_step_records_are_json():
    import json
    engine = make_engine()
    _, steps, _ = run(engine, REPETITIVE, speculation=True, drafter="model", draft_len=4)
    lines = [json.loads(json.dumps(s.to_json())) for s in steps]
    assert all(line["type"] == "step" for line in lines)
    spec = next(line for line in lines if line["drafted"])
    assert {"proposal", "proposal_text", "path", "k", "evidence"} <= set(spec)
    assert {"token", "rejected", "p", "q", "accept_prob", "target_top", "draft_top"} <= set(
        spec["evidence"])


def test_collect_sorts_a_stream_into_one_reply():
    from specchat.core.events import collect
    engine = make_engine()
    events = list(engine.stream(TOK(REPETITIVE)["input_ids"],
                                GenerateConfig(max_new_tokens=20, drafter="ngram")))
    reply = collect(iter(events))
    assert reply.tokens == [e for e in events if isinstance(e, TokenEvent)]
    assert reply.steps == [e for e in events if isinstance(e, StepRecord)]
    assert reply.stats is events[-1] and reply.text == "".join(t.text for t in reply.tokens)
    assert reply.ids == [t.id for t in reply.tokens] and len(reply.ids) == 20


def test_logprobs_are_the_targets_own_and_the_same_with_speculation_on_or_off():
    """Each token's log-probability under the target (after the penalties, before temperature)
    and its likeliest alternatives: greedy, the token is the top alternative; speculation does
    not change them (bit for bit where the runtime proved verifies row-exact; a tiny model on
    stock torch rounds a verify's rows slightly differently)."""
    import math
    engine = make_engine()
    plain, _, _ = run(engine, REPETITIVE, speculation=False, logprobs=3)
    spec, _, _ = run(engine, REPETITIVE, drafter="self", draft_len=4, adaptive=False,
                     logprobs=3)
    assert [t.id for t in spec] == [t.id for t in plain]
    assert [t.logprob for t in spec] == pytest.approx([t.logprob for t in plain], abs=1e-5)
    assert [[i for i, _ in t.top_logprobs] for t in spec] == \
        [[i for i, _ in t.top_logprobs] for t in plain]
    for t in plain:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0][0] == t.id and t.top_logprobs[0][1] == t.logprob
        assert sum(math.exp(lp) for _, lp in t.top_logprobs) <= 1 + 1e-6
    assert "logprob" in plain[0].to_json() and "logprob" not in run(
        engine, REPETITIVE, speculation=False)[0][0].to_json()


def test_a_prompt_over_the_token_limit_is_refused_before_any_work():
    engine = make_engine()
    engine.max_prompt_tokens = 20
    ids = TOK(REPETITIVE)["input_ids"]  # 62 tokens
    with pytest.raises(ValueError, match="the prompt is 62 tokens .* at most 20"):
        run(engine, ids)
    assert engine._cache is None  # nothing was encoded
    tokens, _, _ = run(engine, ids[:20], max_new_tokens=4)
    assert len(tokens) == 4


class _Always(Drafter):
    """Drafts the same tokens at every step (chains; trees of one path)."""

    name = "always"
    supports_trees = True

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, context, k, params, noise):
        return torch.tensor(self.tokens[:k]), None

    def propose_tree(self, context, depth, params, nodes, noise=None):
        n = min(depth, len(self.tokens))
        return DraftTree(torch.tensor(self.tokens[:n]), list(range(-1, n - 1)))


def test_the_mask_fills_its_runs_of_ids_as_a_gather_of_every_id_does():
    from specchat.core.engine import _FEW_RUNS, _runs

    assert _runs([9, 2, 3, 10, 4, 2, 20]) == [(2, 5), (9, 11), (20, 21)]
    engine = make_engine(tiny_llama)
    width = len(TOK) + 5  # logits wider than the vocabulary, as in Gemma
    masked = torch.cat([engine.non_text, torch.arange(len(TOK), width)])
    logits = torch.randn(3, width)
    want = logits.clone().index_fill_(-1, masked, -torch.inf)
    got = logits.clone()
    engine._mask_(got)  # a few runs: slices
    assert torch.equal(got, want)
    engine.non_text = torch.arange(0, 2 * _FEW_RUNS + 2, 2)  # many runs: the gather
    engine._mask_key = None
    masked = torch.cat([engine.non_text, torch.arange(len(TOK), width)])
    got = logits.clone()
    engine._mask_(got)
    assert torch.equal(got, logits.clone().index_fill_(-1, masked, -torch.inf))


def test_non_text_tokens_are_never_sampled_nor_drafted():
    from specchat.core.text import non_text_ids

    tok = byte_tokenizer(extra=["<start_of_image>"])
    marker = tok.convert_tokens_to_ids("<start_of_image>")
    assert non_text_ids(tok, {tok.eos_token_id}) == sorted(
        {tok.pad_token_id, tok.bos_token_id, marker})
    target = tiny_llama(0, vocab=len(tok) + 5)  # logits wider than the vocabulary, as in Gemma
    bias = torch.zeros(len(tok) + 5)
    bias[marker] = bias[len(tok) + 2] = 50.0  # the marker and a padding row win every argmax
    target.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    engine = Engine(loaded(target, tok), {"always": _Always([marker, 65, 66])})
    ids = tok(REPETITIVE)["input_ids"]

    def reply(**cfg):
        events = list(engine.stream(ids, GenerateConfig(max_new_tokens=24, **cfg)))
        return [e.id for e in events if isinstance(e, TokenEvent)], events[-1]

    plain, _ = reply(speculation=False)
    assert marker not in plain and max(plain) < len(tok) and len(plain) == 24
    for trees in (False, True):
        spec, stats = reply(drafter="always", draft_len=3, adaptive=False,
                            tree_nodes=3 if trees else 0)
        assert spec == plain and stats.drafted == 0  # a draft is cut at its first non-text token
    sampled, _ = reply(speculation=False, temperature=1.0, seed=3)
    assert marker not in sampled and max(sampled) < len(tok)


def test_a_spine_is_a_chain_from_the_root_with_only_leaves_beside_it():
    """The trees the engine verifies on the native sampler (`Engine._verify_spine`): nodes
    0..m-1 a chain from the root, every other node a leaf of the root or of a chain node."""
    from specchat.core.engine import _spine
    assert _spine([-1, 0, 1]) == 3  # a chain
    assert _spine([-1, 0, 1, -1, 0, 1]) == 3  # leaves beside each draft
    assert _spine([-1, -1, -1]) == 1  # siblings of the first
    assert _spine([-1, 0, -1, 2]) == 0  # a leaf with a child: another tree
    assert _spine([-1, 0, 0, 1, 2]) == 0  # a node below a leaf
    assert _spine([]) == 0
