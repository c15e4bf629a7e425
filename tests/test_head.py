"""The EAGLE draft head: shapes, the reduced vocabulary, lossless verification with its q,
greedy equivalence in the engine, a tiny training run, and refusing a head for another target."""

import collections
import itertools
import json
import operator

import pytest
import torch
import torch.nn.functional as F
from tiny import byte_tokenizer, dense_probs, loaded, tiny_gemma3, tiny_llama

from specchat import kernels
from specchat.bench.config import BenchSettings
from specchat.bench.run import available_modes
from specchat.bench.run import bench as run_bench
from specchat.core.engine import Engine
from specchat.core.events import StepRecord, TokenEvent
from specchat.core.request import GenerateConfig
from specchat.core.sampling import Noise, SamplingParams, draw, sample_row, verify
from specchat.drafters.combined import CombinedDrafter
from specchat.drafters.head import HeadDrafter
from specchat.drafters.ngram import NgramDrafter
from specchat.loader import head_drafters
from specchat.models.eagle import DraftHead, HeadConfig, target_features
from specchat.models.eagle_files import (
    HeadMismatchError,
    load_head,
    read_header,
    save_head,
    target_identity,
)
from specchat.runners.hf.features import FeatureTap
from specchat.runners.hf.kvcache import new_cache
from specchat.train import cli as train_cli
from specchat.train import config as train_config
from specchat.train import data as train_data
from specchat.train import features as train_features
from specchat.train import fit as train_fit
from specchat.train import replies as train_replies

TOK = byte_tokenizer()
TEXT = "the cat sat on the mat. the dog sat on the log. the cat"
VOCAB_IDS = torch.arange(40, 104)  # a reduced vocabulary of 64 of the 259 byte tokens


pytestmark = pytest.mark.usefixtures("one_thread")


def random_head(target, seed=0, vocab_ids=VOCAB_IDS) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(HeadConfig.for_target(target, len(vocab_ids)))
    head.vocab_ids = vocab_ids.clone()
    return head.attach(target).eval()


def ids_of(text):
    return TOK(text)["input_ids"]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_forward_shapes_and_reduced_head_is_the_targets(make):
    target = make(0)
    head = random_head(target)
    B, T, d = 2, 5, target.config.hidden_size
    pred, logits, cache = head(torch.randn(B, T, d), torch.randn(B, T, d), torch.arange(T))
    assert pred.shape == (B, T, d) and logits.shape == (B, T, len(VOCAB_IDS))
    assert cache[0].shape[2] == T  # keys of every position
    # The reduced LM head is the target's own rows: through it, true features give exactly the
    # target's logits of those tokens.
    ids = ids_of(TEXT)
    feats = target_features(target, ids)  # [len, d]
    with torch.no_grad():
        full = target(torch.tensor([ids])).logits[0]  # [len, vocab]
    assert torch.allclose(head.logits(feats), full[:, VOCAB_IDS], atol=1e-4)


def test_drafts_stay_in_the_reduced_vocabulary_and_q_is_zero_outside():
    target = tiny_llama(0)
    drafter = HeadDrafter(random_head(target), target, len(TOK))
    ids, q = drafter.propose(ids_of(TEXT), 4, SamplingParams(1.0), Noise(0))
    assert q is None and torch.isin(ids, VOCAB_IDS).all()  # coupled drafts: verified one-hot
    drafter.coupled = False
    ids, q = drafter.propose(ids_of(TEXT), 4, SamplingParams(1.0), Noise(0))
    assert ids.shape == (4,) and q.shape == (4, len(TOK))
    assert torch.isin(ids, VOCAB_IDS).all()
    outside = torch.ones(len(TOK), dtype=torch.bool)
    outside[VOCAB_IDS] = False
    assert float(q[:, outside].abs().sum()) == 0.0
    assert torch.allclose(q.sum(-1), torch.ones(4)) and (q[torch.arange(4), ids] > 0).all()
    greedy, none = drafter.propose(ids_of(TEXT), 3, SamplingParams(0.0), None)
    assert none is None and torch.isin(greedy, VOCAB_IDS).all()


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_incremental_cache_and_rollback_match_a_fresh_drafter(make):
    target = make(0)
    head = random_head(target)
    kept = HeadDrafter(head, target, len(TOK))
    contexts = [ids_of(TEXT), ids_of(TEXT + " and"), ids_of(TEXT + " and the"),
                ids_of(TEXT[:20] + " something else"), ids_of(TEXT + "!")]
    for params in (SamplingParams(0.0), SamplingParams(0.9, top_p=0.95)):
        for ctx in contexts:
            a = kept.propose(ctx, 4, params, Noise(1))
            b = HeadDrafter(head, target, len(TOK)).propose(ctx, 4, params, Noise(1))
            assert torch.equal(a[0], b[0]) and a[1] is None and b[1] is None


def test_observed_features_replace_the_extra_target_forward():
    """What the engine patch does: a FeatureTap on the target's final norm during its cached
    forwards gives the same features as a full forward, and a drafter fed by observe() needs
    no target forward of its own."""
    target = tiny_gemma3(0)
    head = random_head(target)
    fed, computed = HeadDrafter(head, target, len(TOK)), HeadDrafter(head, target, len(TOK))
    ids = ids_of(TEXT)
    cache, tap = new_cache(target), FeatureTap(target)
    with torch.inference_mode():
        target(torch.tensor([ids[:30]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        fed.observe(0, ids[:30], tap.features(30))
        target(torch.tensor([ids[30:-1]]), past_key_values=cache, use_cache=True,
               logits_to_keep=1)
        fed.observe(30, ids[30:-1], tap.features(len(ids) - 31))
    tap.close()
    a = fed.propose(ids, 4, SamplingParams(0.0), None)[0]  # stores what it observed
    assert torch.allclose(fed.feats[:len(ids) - 1], target_features(target, ids[:-1]), atol=1e-5)
    b = computed.propose(ids, 4, SamplingParams(0.0), None)[0]
    assert torch.equal(a, b) and fed.computed == 0 and computed.computed > 0


def test_features_observed_a_token_at_a_time_are_stored_in_batches_and_in_order():
    """Plain decoding with the head loaded: every step's features are kept, stored a few dozen
    at a time (never more than PENDING_FEATURES wait), and a rollback's overwrite lands last."""
    from specchat.drafters.head import PENDING_FEATURES

    target = tiny_gemma3(0)
    drafter = HeadDrafter(random_head(target), target, len(TOK))
    ids = ids_of(TEXT)[:PENDING_FEATURES + 12]
    want = target_features(target, ids)
    noise = torch.randn_like(want)
    for t in range(len(ids)):
        if t == 20:  # a verify's row that was refused: its features come again, right
            drafter.observe(t, ids[t:t + 1], noise[t:t + 1])
        drafter.observe(t, ids[t:t + 1], want[t:t + 1])
        assert len(drafter._pending) < PENDING_FEATURES
    drafter._ensure_features(ids)
    assert drafter.computed == 0 and torch.equal(drafter.feats[:len(ids)], want)


def tv(a, b):
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_p=0.9)])
def test_reduced_vocab_drafts_keep_verification_lossless(params):
    """Coupled (the default): each draft is the race over the head's q with the target's own
    numbers at that position, and the emitted token is the target's draw there, every time,
    tokens the head can never propose included. With q (coupled = False): q rows are the
    distribution the drafts were drawn from, zero outside the reduced vocabulary, and
    Leviathan's test with them emits the target's distribution (the residual brings in the
    tokens the head cannot propose)."""
    torch.manual_seed(0)
    target = tiny_llama(0)
    drafter = HeadDrafter(random_head(target, vocab_ids=torch.arange(40, 56)), target, len(TOK))
    ctx = ids_of(TEXT)
    # The target's mass on 12 tokens: 6 the head can propose, 6 it cannot.
    target_logits = torch.full((1, len(TOK)), -30.0)
    support = torch.tensor([41, 44, 47, 50, 53, 55, 3, 20, 120, 180, 200, 250])
    target_logits[0, support] = torch.randn(12)
    rows = torch.cat([target_logits, target_logits])
    want = dense_probs(target_logits, params)[0]
    assert want[support[6:]].sum() > 0.2
    at = len(ctx)  # the draft is for reply position len(ctx)

    drafter.coupled = False
    # The first call runs the head over the whole context; later ones re-feed one position,
    # through the int8 one-row weights (quantize_for_drafting): q is the same from then on.
    drafter.propose(ctx, 1, params, Noise(0))
    drafted, q0 = torch.zeros(len(TOK)), None
    for seed in range(1500):
        ids, q = drafter.propose(ctx, 1, params, Noise(seed))
        q0 = q[0] if q0 is None else q0
        assert torch.allclose(q[0], q0, atol=1e-6)  # same context, same q
        drafted[ids[0]] += 1
    assert tv(drafted / 1500, q0) < 0.06  # drafts are drawn from the q returned
    outside = torch.ones(len(TOK), dtype=torch.bool)
    outside[40:56] = False
    assert float(q0[outside].sum()) == 0.0
    emitted, draws = torch.zeros(len(TOK)), 10000
    for seed, draft in enumerate(torch.multinomial(q0, draws, replacement=True)):
        v = verify(draft[None], q0[None], rows, params, Noise(seed), at)
        emitted[int(draft) if v.n_accepted else v.next_token] += 1
    assert tv(emitted / draws, want) < 0.03

    # Coupled: every emitted token is plain sampling's own draw at that seed, so the reply's
    # distribution is plain's exactly (whose own is tested in test_sampling.py); the tokens the
    # head cannot propose come out too.
    drafter.coupled = True
    kept = q0.nonzero()[:, 0]
    emitted = set()
    for seed in range(2000):
        if seed < 300:  # the head's draft is the race over q with the target's numbers
            ids, q = drafter.propose(ctx, 1, params, Noise(seed))
            assert q is None and int(ids[0]) == draw(kept, q0[kept], Noise(seed), at)
        draft = draw(kept, q0[kept], Noise(seed), at)
        v = verify(torch.tensor([draft]), None, rows, params, Noise(seed), at)
        token = draft if v.n_accepted else v.next_token
        assert token == sample_row(target_logits[0], params, Noise(seed), at)  # plain's draw
        emitted.add(token)
    assert emitted & set(support[6:].tolist())  # beyond the head's vocabulary


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_with_a_random_head_equals_plain_greedy(make, k):
    target = make(0)
    drafter = HeadDrafter(random_head(target), target, len(TOK))
    engine = Engine(loaded(target, TOK), {"head": drafter,
                                          "combined": CombinedDrafter(NgramDrafter(), drafter)})
    prompt = ids_of(TEXT)

    def run(**cfg):
        events = engine.stream(prompt, GenerateConfig(max_new_tokens=30, adaptive=False, **cfg))
        return [e.id for e in events if isinstance(e, TokenEvent)]

    plain = run(speculation=False)
    assert run(drafter="head", draft_len=k) == plain
    assert run(drafter="combined", draft_len=k) == plain
    # The engine hands the verify forwards' features over (observe): the drafter never had to
    # run the target itself.
    assert drafter.computed == 0


def test_a_prompt_from_the_prefix_store_brings_the_heads_features():
    """A prompt whose first pages come from the prefix store (the engine's cache held another
    conversation in between) hands the head those pages' features as encoding them would: the
    head never runs the target itself, and its features are a fresh engine's, bit for bit."""
    target = tiny_llama(0)

    def engine_with_head():
        drafter = HeadDrafter(random_head(target), target, len(TOK))
        return Engine(loaded(target, TOK), {"head": drafter}), drafter

    def reply(engine, ids):
        list(engine.stream(ids, GenerateConfig(max_new_tokens=6, drafter="head", draft_len=2,
                                               adaptive=False)))

    preamble = ids_of(TEXT * 3)  # two pages of 64 and 41 tokens
    first, other, last = preamble + ids_of(" one"), ids_of("something else " * 5), \
        preamble + ids_of(" two")
    engine, drafter = engine_with_head()
    for ids in (first, other, last):
        reply(engine, ids)
    assert engine.prefixes.hits == 1 and drafter.computed == 0
    fresh_engine, fresh = engine_with_head()
    reply(fresh_engine, last)
    drafter._flush()
    fresh._flush()
    assert drafter.tokens[:len(last)] == fresh.tokens[:len(last)] == last
    assert torch.equal(drafter.feats[:len(last)], fresh.feats[:len(last)])


def test_the_inspector_shows_the_heads_top_tokens_at_the_refused_draft():
    """The head's most likely tokens at a draft position, computed when the inspector reads
    them (the first refused draft of a step): led by the token it drafted there (greedy), all
    in its reduced vocabulary, probabilities descending."""
    target = tiny_llama(0)
    drafter = HeadDrafter(random_head(target), target, len(TOK))
    engine = Engine(loaded(target, TOK), {"head": drafter})
    events = list(engine.stream(ids_of(TEXT), GenerateConfig(
        max_new_tokens=30, drafter="head", draft_len=3, adaptive=False)))
    refused = [e.evidence for e in events if isinstance(e, StepRecord) and e.evidence
               and e.evidence.rejected is not None]
    assert refused
    for evidence in refused:
        assert evidence.draft_top[0].id == evidence.rejected
        assert all(c.id in drafter.vocabulary for c in evidence.draft_top)
        probs = [c.prob for c in evidence.draft_top]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6
    # and names the head's kind under the reply
    stats = events[-1]
    assert stats.draft_head == "EAGLE-1 draft head"


def test_sampled_speculation_with_a_random_head_replays_plain_sampling():
    # The head races its drafts with the target's keyed numbers and the target's own draw
    # decides: for a seed, chains and trees, head and combined, give plain sampling's reply.
    target = tiny_llama(0)
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # sharper than a random model's: drafts sometimes pass
    drafter = HeadDrafter(random_head(target), target, len(TOK))
    engine = Engine(loaded(target, TOK), {"head": drafter,
                                          "combined": CombinedDrafter(NgramDrafter(), drafter)})
    prompt = ids_of(TEXT)
    accepted = 0

    def run(**cfg):
        nonlocal accepted
        out = []
        for e in engine.stream(prompt, GenerateConfig(max_new_tokens=40, seed=11, **cfg)):
            if isinstance(e, TokenEvent):
                out.append(e.id)
            elif isinstance(e, StepRecord):
                accepted += e.accepted
        return out

    for sampling in (dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)):
        plain = run(speculation=False, **sampling)
        for name in ("head", "combined"):
            for tree_nodes in (0, 6):
                assert run(drafter=name, draft_len=3, tree_nodes=tree_nodes, adaptive=False,
                           **sampling) == plain
    assert accepted > 0


@pytest.mark.parametrize("wide_bf16", [False, True], ids=["fp32-wide", "bf16-wide"])
@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0)])
def test_drafting_stops_where_the_heads_own_chance_of_passing_falls_below_min_gain(params,
                                                                                 wide_bf16):
    """Each drafter below starts fresh and drafts from the same catch-up as `full`: a drafter
    that caught up once catches up the next time over fewer rows, through other products (int8
    or Q8_0 against bf16 or float32), and its drafts may move a little (verification stays
    exact), so no comparison here rests on two such paths agreeing."""
    target = tiny_llama(0)
    head = random_head(target, vocab_ids=torch.arange(40, 44))  # 4 tokens: confident enough
    context, k = ids_of(TEXT), 8

    def drafter(min_gain=0.0):
        return HeadDrafter(head, target, len(TOK), min_gain, wide_bf16=wide_bf16)

    full, _ = drafter().propose(context, k, params, Noise(1))
    assert len(full) == k  # min_gain 0: every draft asked for

    # Replay the drafts with the head's probabilities: the gated drafter keeps exactly the
    # prefix whose running product stays at or above min_gain (and the first draft whatever its
    # chance: it costs only a wider verify), and does not run the head for the draft after one
    # whose product fell under lookahead x min_gain.
    ungated = drafter()
    chances = []
    spy = ungated._sample
    ungated._sample = lambda *a: (lambda r: (chances.append(r[2]), r)[1])(spy(*a))
    ungated.propose(context, k, params, Noise(1))
    running = list(itertools.accumulate(chances, operator.mul))
    for min_gain, lookahead in ((running[2], 1.0), (running[0] + 1e-6, 1.0),
                                (running[4], running[1] / running[4] * 1.001)):
        gated = drafter(min_gain)
        gated.lookahead = lookahead
        forwards = []
        hook = gated.head.register_forward_hook(lambda *_: forwards.append(1))
        drafts, q = gated.propose(context, k, params, Noise(1))
        hook.remove()
        keep = sum(r >= min_gain for r in running)
        ahead = 1 + sum(r >= lookahead * min_gain for r in running[:k - 1])
        keep = max(1, min(keep, ahead))
        assert 1 <= keep < k and drafts.tolist() == full[:keep].tolist() and q is None
        assert len(forwards) == min(sum(r >= min_gain for r in running) + 1, ahead)
        fixed = drafter(min_gain)
        fixed.stop_early(False)  # a fixed-k request: every draft asked for
        assert fixed.propose(context, k, params, Noise(1))[0].tolist() == full.tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gated_head_drafts_keep_speculation_lossless(temperature):
    target = tiny_llama(0)
    drafter = HeadDrafter(random_head(target, vocab_ids=torch.arange(40, 44)), target, len(TOK),
                          min_gain=0.3)
    engine = Engine(loaded(target, TOK), {"head": drafter})
    prompt = ids_of(TEXT)
    cfg = dict(max_new_tokens=30, temperature=temperature, seed=3)

    def run(**more):
        out, steps = [], []
        for e in engine.stream(prompt, GenerateConfig(**cfg, **more)):
            if isinstance(e, TokenEvent):
                out.append(e.id)
            elif isinstance(e, StepRecord) and e.step:
                steps.append((e.drafted, e.k))
        return out, steps

    plain, _ = run(speculation=False)
    spec, steps = run(drafter="head", draft_len=4)
    assert any(d < k for d, k in steps if k)  # the gate cut drafts short of the policy's k
    assert spec == plain  # seeded: plain decoding's reply, at any temperature
    fixed, steps = run(drafter="head", draft_len=4, adaptive=False)
    assert all(d == k for d, k in steps)  # a fixed k: no gate
    assert fixed == plain


def tiny_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"say something about {w}"} for w in
            ["cats", "dogs", "rain", "bread", "maps", "ships", "tea", "snow", "jazz", "owls",
             "sand", "kites"]]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_tiny_training_run_lowers_the_loss_and_saves_a_loadable_head(tmp_path):
    torch.manual_seed(0)
    model = tiny_llama(0)
    with torch.no_grad():  # a random model is nearly uniform: give it something to teach
        model.lm_head.weight.mul_(20)
    target = loaded(model, TOK)
    # seq_len: the byte tokenizer spends a token per character of the chat preamble
    cfg = train_config.TrainConfig(out=tmp_path / "run", minutes=5, prompt_files=[tiny_prompts(tmp_path)],
                         max_new_tokens=24, gen_batch=4, seq_len=1024, draft_vocab=48,
                         batch_tokens=256, lr=3e-3, warmup_steps=5, max_steps=40, noise=0.0)
    path, summary = train_cli.run(target, cfg, progress=lambda m: None)
    assert summary["steps"] == 40 and summary["train_positions"] > 200
    head = load_head(path, target.model, TOK)
    records = train_features.load_features(cfg.out)
    batch = train_fit.collate([r for r in records if not r["heldout"]][:8], target.device)
    embed = target.model.get_input_embeddings()
    fresh = DraftHead(head.cfg)
    fresh.load_state_dict({k: v for k, v in head.state_dict().items()
                           if k in ("vocab_ids", "norm_scale", "feat_std")}, strict=False)
    fresh.attach(target.model)
    with torch.no_grad():
        before, _ = train_fit.head_loss(fresh, embed, batch, cfg, train=False)
        after, _ = train_fit.head_loss(head, embed, batch, cfg, train=False)
    assert float(after) < 0.7 * float(before), (float(before), float(after))
    # Resumable: the same command again continues from the checkpoint.
    again = train_config.TrainConfig(**{**cfg.__dict__, "max_steps": 45})
    _, summary2 = train_cli.run(target, again, progress=lambda m: None)
    assert summary2["steps"] == 45
    # Fine-tuning: a new work directory starting from the saved head (--init) keeps its
    # vocabulary, starts from its loss, not a fresh head's, and moves its weights.
    tuned_cfg = train_config.TrainConfig(**{**cfg.__dict__, "out": tmp_path / "tuned",
                                            "init": path, "max_steps": 3, "lr": 1e-3})
    tuned_path, tuned = train_cli.run(target, tuned_cfg, progress=lambda m: None)
    assert tuned["steps"] == 3
    recorded = read_header(tuned_path)["meta"]["config"]  # names, not this machine's paths
    assert (recorded["out"], recorded["init"]) == ("tuned", path.name)
    assert tuned["config"]["out"] == str(tmp_path / "tuned")  # summary.json stays local
    tuned_head = load_head(tuned_path, target.model, TOK)
    assert torch.equal(tuned_head.vocab_ids, head.vocab_ids)
    assert not torch.equal(tuned_head.fc.weight, head.fc.weight)
    with torch.no_grad():
        start, _ = train_fit.head_loss(tuned_head, embed, batch, cfg, train=False)
    assert float(start) < 0.8 * float(before)
    # The saved head drafts in the engine (found through head_drafters with an explicit path).
    drafters, notes = head_drafters(target, NgramDrafter(), path)
    assert set(drafters) == {"head", "combined"} and not notes
    events = Engine(target, drafters).stream(ids_of(TEXT), GenerateConfig(
        max_new_tokens=8, drafter="head", adaptive=False))
    assert sum(isinstance(e, TokenEvent) for e in events) == 8


def test_the_target_invents_prompts_from_training_prompts_only(tmp_path):
    """`train-draft --invent N`: the target writes N distinct one-line prompts, each after a
    few of the prompt set's training prompts (never a held-out one), kept in the work
    directory: a resumed run keeps them and writes only the missing ones; every tenth is held
    out, as in a prompt file."""
    from specchat.train import invent
    model = tiny_llama(2).eval()
    newline = TOK("\n", add_special_tokens=False)["input_ids"][-1]
    # a target that ends its lines: a few dozen characters on average
    model.lm_head.register_forward_hook(
        lambda m, args, out: out.index_add(-1, torch.tensor([newline]),
                                           torch.full((*out.shape[:-1], 1), 2.0)))
    target = loaded(model, TOK)
    prompts = train_data.load_prompts([tiny_prompts(tmp_path)])
    held = {p["prompt"] for p in prompts if p["heldout"]}
    pool = invent.example_pool(prompts)
    assert held and not held & set(pool) and len(pool) == len(prompts) - len(held)
    shown = invent.examples_text(pool, 3, seed=0)
    assert shown == invent.examples_text(pool, 3, seed=0) != invent.examples_text(pool, 4, 0)
    assert shown.startswith(invent.HEADER) and shown.endswith("\n-") and not any(
        h in shown for h in held)
    cfg = train_config.TrainConfig(out=tmp_path / "run", gen_batch=4)
    cfg.out.mkdir()
    made = invent.invent_prompts(target, prompts, 6, cfg, deadline=float("inf"))
    assert [r["key"] for r in made] == [f"invented:{i}" for i in range(6)]
    texts = [r["prompt"] for r in made]
    assert len(set(texts)) == 6 and not set(texts) & {p["prompt"] for p in prompts}
    assert all("\n" not in t and len(t) >= invent.MIN_PROMPT_CHARS for t in texts)
    more = invent.invent_prompts(target, prompts, 11, cfg, deadline=float("inf"))
    assert more[:6] == made and len(more) == 11
    assert [r["heldout"] for r in more] == [i % 10 == 9 for i in range(11)]
    assert invent.invent_prompts(target, prompts, 4, cfg, deadline=0.0) == made[:4]


def test_both_generation_paths_give_the_same_greedy_replies(tmp_path, monkeypatch):
    """train-draft's phase 1: the batched loop with features (sdpa, eager) and transformers'
    `generate` (other attention) write the same greedy replies; only the loop's are in the
    feature shards already."""
    from specchat.train import batched
    model = tiny_llama(4).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    target = loaded(model, TOK)
    prompts = [p for p in train_data.load_prompts([tiny_prompts(tmp_path)]) if not train_data._sampled(p["key"])]
    replies = {}
    for path in ("loop", "generate"):
        monkeypatch.setattr(batched, "supported", lambda m, ok=(path == "loop"): ok)
        # seq_len: the byte tokenizer spends a token per character of the chat preamble
        cfg = train_config.TrainConfig(out=tmp_path / path, max_new_tokens=12, gen_batch=3,
                                       seq_len=1024)
        cfg.out.mkdir()
        assert train_replies.generate_replies(target, prompts, cfg, deadline=float("inf")) == len(prompts)
        rows = train_data.read_jsonl(cfg.out / "generated.jsonl")
        replies[path] = {r["key"]: r["ids"] for r in rows}
        shards = train_features.load_features(cfg.out)
        assert len(shards) == (len(prompts) if path == "loop" else 0)
    # The loop does not feed a reply's last token (cut at the cap): one token shorter.
    assert {k: v[:-1] for k, v in replies["generate"].items()} == replies["loop"]


def test_reduced_vocabulary_takes_predicted_tokens_first_then_fills():
    from specchat.train.fit import choose_vocab
    rec = {"ids": torch.tensor([50, 50, 60, 70], dtype=torch.int32),
           "top1": torch.tensor([60, 60, 80, -1], dtype=torch.int32), "start": 0}
    vocab, coverage = choose_vocab([rec], 3)
    assert set(vocab.tolist()) == {60, 80, 50} and coverage == 1.0  # predicted, then inputs
    vocab, _ = choose_vocab([rec], 10, TOK)
    # ... then the lowest ids that are not special tokens (<pad> <bos> <eos> are 0, 1, 2)
    assert set(vocab.tolist()) == {60, 80, 50, 70, 3, 4, 5, 6, 7, 8}


def test_a_head_for_another_target_is_refused(tmp_path):
    target = tiny_llama(0)
    path = tmp_path / "head.safetensors"
    save_head(path, random_head(target), target_identity(target, TOK, "tiny-a"))
    assert load_head(path, target, TOK).cfg.draft_vocab == len(VOCAB_IDS)
    with pytest.raises(HeadMismatchError, match="weights differ"):
        load_head(path, tiny_llama(1), TOK)  # same architecture and vocabulary, other weights
    with pytest.raises(HeadMismatchError, match="vocabulary differs"):
        load_head(path, target, byte_tokenizer(extra=["<x>"]))
    with pytest.raises(HeadMismatchError, match="architecture differs"):
        load_head(path, tiny_llama(0, layers=3), TOK)
    drafters, notes = head_drafters(loaded(tiny_llama(1), TOK), NgramDrafter(), path)
    assert drafters == {} and "trained for tiny-a" in notes[0] and "train-draft" in notes[0]
    (tmp_path / "junk.safetensors").write_bytes(b"not a head")
    with pytest.raises(HeadMismatchError, match="not a readable draft head"):
        load_head(tmp_path / "junk.safetensors", target, TOK)


def test_identity_ignores_quantization_and_dtype():
    a = tiny_llama(0)
    b = tiny_llama(0).to(torch.bfloat16)
    from specchat.models.eagle_files import identity_problem
    assert identity_problem(target_identity(a, TOK), target_identity(b, TOK)) is None


def test_train_draft_command_line():
    import argparse

    from specchat.train.cli import add_cli
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train-draft", "--minutes", "2", "--out", "x", "--data", "a.txt"])
    assert args.minutes == 2 and args.out == "x" and args.data == ["a.txt"]
    assert args.func.__name__ == "cmd_train_draft"
    assert args.formats == ("chat", "system", "completion")
    args = parser.parse_args(["train-draft", "--formats", "chat, completion"])
    assert args.formats == ("chat", "completion")
    with pytest.raises(SystemExit):
        parser.parse_args(["train-draft", "--formats", "chat,poem"])


def test_bench_runs_the_head_modes():
    """head and combined are bench modes, and greedy they write plain's text."""
    target = tiny_llama(0)
    drafter = HeadDrafter(random_head(target), target, len(TOK))
    engine = Engine(loaded(target, TOK), {"ngram": NgramDrafter(), "head": drafter,
                                          "combined": CombinedDrafter(NgramDrafter(), drafter)})
    assert {"head", "combined"} <= set(available_modes(engine, None))
    questions = [{"question_id": 1, "category": "qa", "turns": ["Repeat: abc abc abc abc"]}]
    settings = BenchSettings(modes=("plain", "head", "combined"), max_new_tokens=10,
                                   warmup_tokens=2)
    result = run_bench(engine, questions, settings, progress=False)
    assert set(result["modes"]) == {"plain", "head", "combined"}
    assert result["greedy_identical"] == {"plain": 1.0, "head": 1.0, "combined": 1.0}


def test_combined_drafter_uses_lookup_for_matches_of_two_tokens_and_the_head_otherwise():
    target = tiny_llama(0)
    head = HeadDrafter(random_head(target), target, len(TOK))
    combined = CombinedDrafter(NgramDrafter(), head)
    ids = ids_of(TEXT)  # ends in " the cat": a long match
    combined.begin(ids)
    assert combined.draft_class(ids) == 3
    drafts, _ = combined.propose(ids, 4, SamplingParams(), None)
    assert drafts.tolist() == ids_of(" sat")  # what followed " the cat" before
    weak = ids + ids_of("Zt")  # only "t" occurred before: a 1-token match
    assert combined.draft_class(weak) == "head"
    drafts, _ = combined.propose(weak, 3, SamplingParams(), None)
    assert len(drafts) == 3 and set(drafts.tolist()) <= set(VOCAB_IDS.tolist())  # the head's


def test_gumbel_top_k_samples_the_tempered_top_k_distribution():
    """train-draft's sampler: argmax of top-k logits / T plus Gumbel noise is a draw from
    softmax(top-k logits / T), and nothing outside the top k is ever drawn."""
    from specchat.train.replies import GumbelTopK
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.5, 0.3, -1.0, 1.0, 0.0])
    draws = 40000
    picks = GumbelTopK(3, 0.7)(None, logits.repeat(draws, 1)).argmax(-1)
    freq = torch.bincount(picks, minlength=6).float() / draws
    top = logits.topk(3).indices
    want = torch.zeros(6)
    want[top] = torch.softmax(logits[top] / 0.7, -1)
    assert freq[[2, 3, 5]].sum() == 0
    assert 0.5 * (freq - want).abs().sum() < 0.01


def test_a_one_wide_tree_is_the_greedy_chain():
    """Tree rows see the context and their ancestors, at the right positions: with one child a
    node and one node expanded a level, the tree is exactly the chain the head drafts."""
    target = tiny_gemma3(0, sliding_window=8)
    head = random_head(target, vocab_ids=torch.arange(40, 44))
    context, k = ids_of(TEXT), 6
    chain, _ = HeadDrafter(head, target, len(TOK)).propose(context, k, SamplingParams(0.0), None)
    drafter = HeadDrafter(head, target, len(TOK), tree_width=1, tree_beam=1, tree_min_score=0.0)
    drafter.native_chain = False  # EAGLE-2's tree, a torch forward a level
    tree = drafter.propose_tree(context, k, SamplingParams(0.0), k)
    assert tree.parents == list(range(-1, k - 1))
    assert tree.tokens.tolist() == chain.tolist()


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "min-p"])
@pytest.mark.parametrize("width, min_score, nodes", [(3, 0.0, 20), (2, 0.05, 20), (3, 0.0, 5),
                                                     (0, 0.0, 20)])
def test_a_fan_is_the_c_chain_with_the_heads_next_likeliest_tokens_beside_it(
        sampled, width, min_score, nodes):
    """Where the chain runs in C, a tree is that chain (the same drafts, the same cache after)
    with leaves: at each draft, the head's next likeliest tokens there, each scored by the
    head's probability of the chain before it and its own; at most `width` a level, none under
    `min_score`, the best `nodes` in all, level by level."""
    target = tiny_gemma3(0)
    head = random_head(target, vocab_ids=torch.arange(40, 56))
    with torch.no_grad():  # flatter rows: leaves at every level
        head.fc.weight.mul_(0.05)
    context, k = ids_of(TEXT), 4
    params = SamplingParams(0.8, min_p=0.01) if sampled else SamplingParams(0.0)
    noise = Noise(3) if sampled else None
    chain_drafter = HeadDrafter(head, target, len(TOK), 0.0, lib=kernels.load("ref"))
    chain, _ = chain_drafter.propose(context, k, params, noise)
    rows = [torch.log_softmax(row.float(), -1) for row in chain_drafter._chain(
        context, k, params, noise)[1]]
    drafter = HeadDrafter(head, target, len(TOK), 0.0, lib=kernels.load("ref"),
                          fan_width=width, fan_min_score=min_score)
    assert drafter.chains_in_c
    tree = drafter.propose_tree(context, k, params, nodes, noise)
    m = len(chain)
    assert tree.tokens[:m].tolist() == chain.tolist() and tree.parents[:m] == list(range(-1, m - 1))
    assert all(torch.equal(a, b) for a, b in zip(drafter.cache, chain_drafter.cache))
    place = {int(t): i for i, t in enumerate(head.vocab_ids)}
    want, reach = [], 1.0
    for level, token in enumerate(chain.tolist()):
        p = rows[level].exp()
        alts = sorted((t for t in range(40, 56) if t != token), key=lambda t: -p[place[t]])
        for t in alts[:width]:
            if reach * p[place[t]] < min_score:
                break
            want.append((float(reach * p[place[t]]), level, t))
        reach *= float(p[place[token]])
    want = sorted(want, reverse=True)[:max(0, nodes - m)]
    want.sort(key=lambda leaf: (leaf[1], -leaf[0]))
    leaves = list(zip(tree.tokens[m:].tolist(), tree.parents[m:]))
    assert leaves == [(t, level - 1) for _, level, t in want]
    if width and min_score == 0.0 and nodes >= m * (width + 1):
        assert len({parent for _, parent in leaves}) == m  # flat rows: leaves at every level


@pytest.mark.parametrize("nodes", [1, 5, 12])
def test_head_tree_is_the_likeliest_nodes_parents_first(nodes):
    target = tiny_llama(0)
    drafter = HeadDrafter(random_head(target, vocab_ids=torch.arange(40, 48)), target, len(TOK),
                          tree_width=3, tree_beam=2, tree_min_score=0.0)
    context = ids_of(TEXT)
    tree = drafter.propose_tree(context, 4, SamplingParams(0.0), nodes)
    assert len(tree) == nodes and 1 <= tree.depth <= 4
    assert all(p < i for i, p in enumerate(tree.parents))
    assert set(tree.tokens.tolist()) <= set(range(40, 48))
    siblings = collections.defaultdict(list)
    for token, p in zip(tree.tokens.tolist(), tree.parents):
        siblings[p].append(token)
    assert all(len(set(s)) == len(s) for s in siblings.values())
    # The tree's rows are gone from the head cache: the next proposal matches a fresh drafter's.
    assert drafter.cache[0].shape[2] == len(context) - 1
    fresh = HeadDrafter(drafter.head, target, len(TOK), tree_width=3, tree_beam=2,
                        tree_min_score=0.0)
    again = drafter.propose_tree(context + [50], 4, SamplingParams(0.0), nodes)
    other = fresh.propose_tree(context + [50], 4, SamplingParams(0.0), nodes)
    assert again.tokens.tolist() == other.tokens.tolist() and again.parents == other.parents


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_head_tree_speculation_replays_plain_decoding(make, temperature):
    target = make(0)
    drafter = HeadDrafter(random_head(target, vocab_ids=torch.arange(40, 48)), target, len(TOK),
                          tree_min_score=0.0)
    engine = Engine(loaded(target, TOK), {"head": drafter,
                                          "combined": CombinedDrafter(NgramDrafter(), drafter)})
    cfg = dict(max_new_tokens=30, adaptive=False, temperature=temperature, seed=4)

    def run(**more):
        events = list(engine.stream(ids_of(TEXT), GenerateConfig(**cfg, **more)))
        return [e.id for e in events if isinstance(e, TokenEvent)], events

    plain, _ = run(speculation=False)
    for name in ("head", "combined"):
        spec, events = run(drafter=name, draft_len=4, tree_nodes=8)
        assert spec == plain
        assert max(getattr(e, "drafted", 0) for e in events) > 4  # trees were verified
    assert drafter.computed == 0


def test_int8_drafting_linear_is_close_and_wide_or_training_calls_stay_float():
    from specchat.models.eagle import INT8_ROWS, Int8Drafting
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    fast = Int8Drafting(linear)
    with torch.no_grad():
        for rows in (1, 3, INT8_ROWS):  # a draft token, a catch-up, a tree level
            x = torch.randn(1, rows, 64)
            exact = linear(x)
            assert fast(x).shape == exact.shape
            assert float((fast(x) - exact).abs().max()) < 0.02 * float(exact.abs().max())
        wide = torch.randn(1, INT8_ROWS + 1, 64)
        assert torch.equal(fast(wide), linear(wide))
        # CPUs with native bf16: wide calls through a bf16 copy (forced here on any CPU)
        wide_bf16 = Int8Drafting(linear, wide_bf16=True)
        exact = linear(wide)
        assert torch.equal(wide_bf16(x := torch.randn(1, 3, 64)), fast(x))  # narrow: int8
        assert float((wide_bf16(wide) - exact).abs().max()) < 0.02 * float(exact.abs().max())
        assert not torch.equal(wide_bf16(wide), exact)
    x = torch.randn(1, 2, 64, requires_grad=True)  # training
    assert torch.equal(fast(x), linear(x))
    assert torch.equal(Int8Drafting(linear, wide_bf16=True)(x), linear(x))


@pytest.mark.parametrize("variant", ["ref", "avx2", "avx512"])
def test_q8_0_drafting_reads_the_blocks_through_specchats_kernel(variant):
    """With specchat's kernels, every drafting call (one row to a wide catch-up) and the reduced
    LM head read Q8_0 copies through the integer product: the kernel's own result on those
    blocks, close to the float one; with native bf16, wide calls keep the bf16 copy."""
    from specchat.models.eagle import INT8_ROWS, Int8Drafting, _q8_0
    from specchat import kernels
    lib = kernels.load(variant)
    if lib is None:
        pytest.skip(f"no {variant} kernels on this CPU")
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    q, d = _q8_0(linear.weight)
    assert q.dtype == torch.int8 and d.shape == (48, 2)
    blocks = (q.view(48, 2, 32).float() * d.float()[..., None]).view(48, 64)
    assert float((blocks - linear.weight).abs().max()) <= float(d.float().max()) / 2 + 1e-7
    fast = Int8Drafting(linear, lib=lib)
    packed = Int8Drafting(linear, lib=lib, packed=True)  # for the VNNI kernel (any CPU: its ref)
    assert not fast.packed and packed.packed
    qp = q.clone()
    dw = kernels.q8_0_i8_pack(lib, qp, d)
    with torch.no_grad():
        for rows in (1, 3, INT8_ROWS, INT8_ROWS + 30):
            x = torch.randn(1, rows, 64)
            exact = linear(x)
            want = kernels.q8_0_matmul_i8(lib, x, q, d) + linear.bias
            assert torch.equal(fast(x), want)
            assert float((fast(x) - exact).abs().max()) < 0.02 * float(exact.abs().max())
            want = kernels.q8_0_rows_matmul_i8(lib, x, qp, dw) + linear.bias
            assert torch.equal(packed(x), want)
            assert float((packed(x) - exact).abs().max()) < 0.02 * float(exact.abs().max())
        wide = torch.randn(1, INT8_ROWS + 1, 64)
        native = Int8Drafting(linear, wide_bf16=True, lib=lib)
        assert torch.equal(native(wide), F.linear(wide.bfloat16(), linear.weight.bfloat16()).float()
                           + linear.bias)
        assert torch.equal(native(x := torch.randn(1, 3, 64)), fast(x))
    target = tiny_llama(0)
    feats = torch.randn(1, 4, target.config.hidden_size)
    for packed in (False, True):
        head = random_head(target)
        exact = head.logits(feats)
        head.quantize_for_drafting(lib=lib, packed=packed)
        assert head._q8_packed == packed
        q, d = _q8_0(head.lm_rows)
        want = kernels.q8_0_rows_matmul_i8(lib, feats, q, kernels.q8_0_i8_pack(lib, q, d)) \
            if packed else kernels.q8_0_matmul_i8(lib, feats, q, d)
        q8 = head.logits(feats)
        assert torch.equal(q8, want)
        assert float((q8 - exact).abs().max()) < 0.02 * float(exact.abs().max())


def test_head_cache_appends_in_place_and_equals_concatenation():
    from specchat.models.eagle import appended
    torch.manual_seed(0)
    a, b, c = (torch.randn(2, 3, n, 4) for n in (5, 1, 2))
    ab = appended(a, b)  # a fresh tensor has no room: a new buffer with spare slots
    assert torch.equal(ab, torch.cat([a, b], 2))
    abc = appended(ab, c)  # written into ab's buffer: no copy of the cached slots
    assert abc.data_ptr() == ab.data_ptr() and torch.equal(abc, torch.cat([a, b, c], 2))
    cropped = appended(abc[:, :, :5], c)  # a crop keeps the buffer; later slots are rewritten
    assert cropped.data_ptr() == ab.data_ptr() and torch.equal(cropped, torch.cat([a, c], 2))
    v = torch.randn(2, 3, 4, 7).permute(0, 1, 3, 2)  # not a buffer's prefix: copied
    assert torch.equal(appended(v, c), torch.cat([v, c], 2)) and v.shape == (2, 3, 7, 4)


def test_loss_at_trained_positions_only_equals_the_loss_over_full_logits():
    """head_loss takes the logits only where a position has a loss (packed); the value is the
    plain EAGLE loss over the full [B, T, N] logits, masked, unrolled steps included."""
    from specchat.train.fit import smooth_l1
    target = tiny_llama(0).eval()
    head = random_head(target)
    embed = target.get_input_embeddings()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, start in ((20, 5), (13, 0), (9, 7)):
        rows.append({"ids": torch.randint(3, 259, (n,), generator=gen),
                     "feats": torch.randn(n, 32, generator=gen),
                     "top1": torch.randint(40, 104, (n,), generator=gen), "start": start})
    batch = train_fit.collate(rows, "cpu")
    cfg = train_config.TrainConfig(out=None, unroll=2, noise=0.0)
    with torch.no_grad():
        packed, metrics = train_fit.head_loss(head, embed, batch, cfg, train=False)
        feats, T = batch["feats"], batch["feats"].shape[1] - 1
        emb = embed(batch["ids"][:, 1:]).float()
        probs = torch.softmax(head.logits(feats[:, 1:]), -1)
        valid = batch["trained"][:, :-1]
        inputs, pos, want = feats[:, :-1], torch.arange(T), 0.0
        for step in range(2):
            pred, logits, _ = head(inputs, emb, pos)
            ce = -(probs[:, step:] * torch.log_softmax(logits, -1)).sum(-1)
            fl = smooth_l1(pred, feats[:, 1 + step:], head.feat_std)
            v = valid[:, step:]
            want += 0.5 ** step * (ce + 0.1 * fl)[v].mean()
            inputs, emb, pos = pred[:, :-1], emb[:, 1:], pos[1:]
    assert torch.allclose(packed, want, rtol=1e-5), (float(packed), float(want))
    assert metrics["top1@1"][1] == int(valid.sum())


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_head_drafts_from_the_penalized_distribution_and_stays_lossless(make):
    from specchat.core.penalties import Penalties, Shaper

    target = make(0)
    drafter = HeadDrafter(random_head(target), target, len(TOK))
    context = ids_of(TEXT)
    pred, logits = drafter._catch_up(context)
    # The head's favourite is a token the text repeats: the penalties must move the draft off it.
    repeated = int((VOCAB_IDS == context[-2]).nonzero()[0, 0])  # "a" of "the cat" in 40..103
    favoured = logits.detach().clone()
    favoured[0, 0, repeated] = favoured.max() + 1.0
    drafter._catch_up = lambda ctx: (pred, favoured)
    drafter.use_penalties(Shaper(Penalties(repeat_penalty=50.0, dry_multiplier=5.0), TOK))
    shaped = drafter._penalized(favoured[0], context, [[]])
    assert int(favoured[0].argmax()) == repeated != int(shaped.argmax())
    # On a CPU the penalties run natively (`kernels.shape_reduced`): Python's bits, with drafts
    # appended to the context too
    assert drafter._lib is not None
    two = torch.cat([favoured[0], favoured[0]])
    extras = [[], [context[-3], context[-2]]]
    native = drafter._penalized(two, context, extras)
    drafter._lib = None
    assert torch.equal(native, drafter._penalized(two, context, extras))
    assert not torch.equal(native[0], native[1])
    drafter._lib = kernels.load()
    first = drafter.propose(context, 1, SamplingParams(0.0), None)[0]
    assert int(first[0]) == int(VOCAB_IDS[int(shaped.argmax())])
    del drafter._catch_up

    engine = Engine(loaded(target, TOK), {"head": drafter})

    def run(**cfg):
        events = engine.stream(context, GenerateConfig(
            max_new_tokens=30, repeat_penalty=1.5, dry_multiplier=0.8, **cfg))
        return [e.id for e in events if isinstance(e, TokenEvent)]

    plain = run(speculation=False)
    assert run(drafter="head", draft_len=3, adaptive=False) == plain
    assert run(drafter="head", draft_len=3, adaptive=False, tree_nodes=6) == plain
    assert run(drafter="head", draft_len=3, adaptive=False, temperature=0.8, seed=2) == \
        run(speculation=False, temperature=0.8, seed=2)


def test_the_heads_vocabulary_coverage_is_reported_and_shown():
    from specchat.ui.inspector import step_card, step_charts

    target = tiny_llama(0)
    drafter = HeadDrafter(random_head(target), target, len(TOK))
    engine = Engine(loaded(target, TOK), {"head": drafter, "ngram": NgramDrafter()})
    prompt = ids_of(TEXT)
    events = list(engine.stream(prompt, GenerateConfig(max_new_tokens=30, drafter="head",
                                                       draft_len=2, adaptive=False)))
    stats = events[-1]
    reply = [e.id for e in events if isinstance(e, TokenEvent)]
    inside = sum(t in set(VOCAB_IDS.tolist()) for t in reply)
    assert stats.draft_vocab == len(VOCAB_IDS)
    assert stats.draft_vocab_coverage == pytest.approx(inside / len(reply))
    steps = [e for e in events if isinstance(e, StepRecord) and e.evidence is not None]
    assert {s.evidence.in_draft_vocab for s in steps} <= {True, False}
    assert all(s.evidence.in_draft_vocab == (s.evidence.token in set(VOCAB_IDS.tolist()))
               for s in steps)
    outside = [s for s in steps if s.evidence.in_draft_vocab is False]
    assert outside and "outside the drafter" in step_card(outside[0])
    assert f"{len(VOCAB_IDS)}-token vocabulary holds" in step_charts(steps, stats)
    plain_lookup = list(engine.stream(prompt, GenerateConfig(max_new_tokens=10, drafter="ngram")))
    assert plain_lookup[-1].draft_vocab is None and plain_lookup[-1].draft_vocab_coverage is None


@pytest.mark.parametrize("packed", [False, True], ids=["row-major", "packed"])
@pytest.mark.parametrize("variant", ["ref", "avx2", "avx512"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_a_drafting_chain_in_one_c_call_is_the_torch_forward(variant, make, packed):
    """Once its layers read Q8_0 copies, the head runs a chain of up to INT8_ROWS rows in one C
    call (csrc/head.c): the torch forward's features, logits and cache within float rounding,
    on the same cache the torch forward (trees, wide catch-ups) keeps extending; with the
    weights row-major or packed for the VNNI kernel (`q8_0_rows_matmul_i8`), both products
    forced on any CPU."""
    from specchat.models.eagle import INT8_ROWS
    from specchat import kernels
    lib = kernels.load(variant)
    if lib is None:
        pytest.skip(f"no {variant} kernels on this CPU")
    target = make(0)
    head = random_head(target)
    head.cfg.logit_softcap = 30.0 if make is tiny_gemma3 else 0.0
    head.quantize_for_drafting(lib=lib, packed=packed)
    assert head._step is not None and head._q8_packed == packed
    d = target.config.hidden_size

    blocks = []  # the torch block's forwards
    head.block.register_forward_hook(lambda *_: blocks.append(1))

    def run(c_step: bool, chunks):
        step, cache, out = head._step, None, []
        head._step = step if c_step else None
        torch.manual_seed(1)
        at = 0
        with torch.inference_mode():
            for n, last_only in chunks:
                feats, embeds = torch.randn(1, n, d), torch.randn(1, n, d)
                pos = torch.arange(at, at + n)
                pred, logits, cache = head(feats, embeds, pos, cache, last_only=last_only)
                out += [pred, logits]
                at += n
        head._step = step
        return out, cache

    # a catch-up, one-token steps, a rollback-free run of wider chains past the buffer's room
    chunks = [(5, True), (1, True), (1, False), (3, False), (INT8_ROWS, True)] + [(1, True)] * 3
    chunks += [(INT8_ROWS, False)] * 16
    torch_out, torch_cache = run(False, chunks)
    assert len(blocks) == len(chunks)
    c_out, c_cache = run(True, chunks)
    assert len(blocks) == len(chunks)  # no torch block ran: every chunk was one C call
    for want, got in zip(torch_out + list(torch_cache), c_out + list(c_cache)):
        assert got.shape == want.shape
        assert float((got - want).abs().max()) <= 1e-4 * max(1.0, float(want.abs().max()))
    # wider than INT8_ROWS, or a tree's mask: the torch forward on the same cache
    with torch.inference_mode():
        feats = torch.randn(1, INT8_ROWS + 1, d)
        pos = torch.arange(INT8_ROWS + 1) + c_cache[0].shape[2]
        pred, _, grown = head(feats, feats, pos, c_cache)
    assert grown[0].shape[2] == c_cache[0].shape[2] + INT8_ROWS + 1
    assert len(blocks) == len(chunks) + 1


@pytest.mark.parametrize("c_step", [False, True], ids=["torch", "c-step"])
def test_a_last_only_forward_is_the_full_forwards_last_row(c_step):
    """With last_only, the rows before the last stop at the cache (their keys and values: fc
    and the qkv product); the last row's prediction and logits are the full forward's, and so is
    the cache. The C step takes a catch-up of any length so, in chunks (CATCH_UP_CHUNK), with
    the same bits as its chain steps of up to INT8_ROWS rows (row-exact products); torch's
    forward within rounding of its full one."""
    from specchat.models.eagle import INT8_ROWS
    from specchat.runners.cpu.head_step import CATCH_UP_CHUNK
    from specchat import kernels
    lib = kernels.load()
    if lib is None and c_step:
        pytest.skip("no kernels on this CPU")
    target = tiny_gemma3(0)
    head = random_head(target)
    head.cfg.logit_softcap = 30.0
    if lib is not None:
        head.quantize_for_drafting(lib=lib)
    if not c_step:
        head._step = None
    d = target.config.hidden_size
    torch.manual_seed(3)
    n = 2 * CATCH_UP_CHUNK + 5 if c_step else 3 * INT8_ROWS
    feats, embeds = torch.randn(1, n + 2, d), torch.randn(1, n + 2, d)
    blocks = []  # the torch block's forwards
    head.block.register_forward_hook(lambda *_: blocks.append(1))
    with torch.inference_mode():
        runs = []
        for last_only in (False, True):
            _, _, cache = head(feats[:, :2], embeds[:, :2], torch.arange(2), None)
            # the full forward: in the C step, chains of INT8_ROWS rows at most
            width = INT8_ROWS if c_step and not last_only else n
            for at in range(2, n + 2, width):
                end = min(at + width, n + 2)
                pred, logits, cache = head(feats[:, at:end], embeds[:, at:end],
                                           torch.arange(at, end), cache, last_only=last_only)
            runs.append((pred, logits, cache))
    assert bool(blocks) != c_step  # the C step ran every row of both
    (pred, logits, cache), (pred1, logits1, cache1) = runs
    assert pred1.shape == (1, 1, d) and logits1.shape == (1, 1, logits.shape[-1])
    pairs = [(pred[:, -1:], pred1), (logits[:, -1:], logits1), (cache[0], cache1[0]),
             (cache[1], cache1[1])]
    for full, last in pairs:
        if c_step:
            assert torch.equal(full, last)
        else:
            assert float((full - last).abs().max()) <= 0.02 * max(1.0, float(full.abs().max()))


def test_the_head_drafts_on_the_kernels_it_is_handed():
    """The loader hands the head the kernels build its target's runtime runs on
    (`Runtime.kernels`); without one the head takes the default build."""
    from specchat import kernels
    for variant in ("ref", None):
        lib = kernels.load(variant) if variant else None
        if variant and lib is None:
            continue
        target = tiny_llama(0)
        drafter = HeadDrafter(random_head(target), target, 259, lib=lib)
        want = lib or kernels.load()
        if want is None:
            pytest.skip("no C compiler: no kernels to hand over")
        assert drafter.head._q8_lib is want and drafter.head._step.lib is want
        # packed for the VNNI kernel where the build runs one (AVX-512's or AVX-VNNI's; else
        # row-major AVX2)
        assert drafter.head._q8_packed == want.rows_i8_vnni
        assert want.rows_i8_vnni == (want.variant != "ref"
                                     and kernels.i8_kernel(want.variant == "avx512") != "avx2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_head_looks_its_tokens_up_in_c_with_the_modules_bits(dtype):
    """A Gemma 3 target's scaled embedding (float32 or bf16 table) is looked up in one C call
    (`embed_rows`), checked against the module when the drafter is made: the same bits as the
    module's lookup. Another module keeps its own lookup."""
    lib = kernels.load()
    if lib is None:
        pytest.skip("no kernels on this CPU")
    target = tiny_gemma3(0).to(dtype)
    drafter = HeadDrafter(random_head(target), target, len(TOK), lib=lib)
    assert drafter._c_embed is not None
    ids = [0, 5, 258, 77, 77]
    want = drafter.embed(torch.tensor([ids])).float()
    got = drafter._embed(ids)
    assert got.shape == want.shape and torch.equal(got, want)
    other = HeadDrafter(random_head(tiny_llama(0)), tiny_llama(0), len(TOK), lib=lib)
    assert other._c_embed is None
    assert torch.equal(other._embed(ids), other.embed(torch.tensor([ids])).float())


def test_a_greedy_draft_by_the_kernels_row_top_is_torchs_argmax():
    """Greedy, the head's draft and its chance come from one native call (`row_top`): the
    first of the largest logits, as torch's argmax picks it, and its softmax probability
    within float rounding."""
    lib = kernels.load()
    if lib is None:
        pytest.skip("no kernels on this CPU")
    target = tiny_llama(0)
    drafter = HeadDrafter(random_head(target), target, len(TOK), lib=lib)
    gen = torch.Generator().manual_seed(0)
    for r in range(20):
        row = torch.randn(1, len(drafter.head.vocab_ids), generator=gen) * (r + 1)
        if r % 4 == 0:
            row[0, 3] = row[0, 7] = row.max() + 1  # a tie: the first id
        native = drafter._sample(row, SamplingParams(0.0), None, 0)
        lib_, drafter._lib = drafter._lib, None
        plain = drafter._sample(row, SamplingParams(0.0), None, 0)
        drafter._lib = lib_
        assert native[0] == plain[0] and native[1] is plain[1] is None
        assert native[2] == pytest.approx(plain[2], rel=1e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["row-major", "packed"])
@pytest.mark.parametrize("variant", ["ref", "avx2", "avx512"])
def test_a_chain_in_one_c_call_is_the_python_loop(variant, packed):
    """Greedy or drawn by min-p, a proposal is one C call (`HeadStep.chain`): the catch-up,
    each draft's penalties (the context's and the drafts' own tokens, DRY's breakers among
    them), its pick and the next step. The same drafts, the same rows for the inspector and the
    same cache as the Python loop, with every stopping rule, on every kernel variant and both
    products."""
    from specchat.core.penalties import Penalties, Shaper
    lib = kernels.load(variant)
    if lib is None:
        pytest.skip(f"no {variant} kernels on this CPU")
    target = tiny_gemma3(0)
    context = ids_of(TEXT + ": the *cat*\n the")
    samplers = ((SamplingParams(0.0), None), (SamplingParams(0.8, min_p=0.05), Noise(3)),
                (SamplingParams(1.5, min_p=0.3), Noise(4)))
    for (params, noise), vocab in itertools.product(
            samplers, (VOCAB_IDS, torch.arange(40, 56))):  # 16 tokens: long chains
        head = random_head(target, vocab_ids=vocab)
        head.quantize_for_drafting(lib=lib, packed=packed)
        for penalties in (None, Penalties(repeat_penalty=1.3, dry_multiplier=0.8),
                          Penalties(repeat_penalty=50.0, dry_multiplier=5.0,
                                    dry_allowed_length=1)):
            for min_gain, lookahead, k in ((0.0, 2.0, 1), (0.0, 2.0, 6), (0.02, 2.0, 6),
                                           (0.1, 1.0, 4)):
                runs = []
                for native in (True, False):
                    drafter = HeadDrafter(head, target, len(TOK), min_gain, lib=lib)
                    assert drafter._c_embed is not None
                    drafter.native_chain, drafter.lookahead = native, lookahead
                    drafter.use_penalties(Shaper(penalties, TOK) if penalties else None)
                    calls = []
                    chain = head._step.chain
                    head._step.chain = lambda *a, **kw: (calls.append(1), chain(*a, **kw))[1]
                    drafts = []
                    # a fresh catch-up, a context grown by two, then by more than the
                    # drafter's buffers for the chain's inputs hold
                    for grown in ([], [3, 4], [3, 4] + context * 2):
                        ids, q = drafter.propose(context + grown, k, params, noise)
                        assert q is None
                        drafts.append((ids.tolist(), [list(t) for t in drafter.last_top],
                                       [c.clone() for c in drafter.cache]))
                    del head._step.chain
                    assert bool(calls) == native
                    runs.append(drafts)
                for (ids, top, cache), (ids_p, top_p, cache_p) in zip(*runs):
                    assert ids == ids_p and top == top_p, (params, penalties, min_gain, k)
                    assert all(torch.equal(a, b) for a, b in zip(cache, cache_p))
                    assert 1 <= len(ids) <= k and len(top) >= len(ids)


def test_the_heads_trees_are_the_default_where_they_pay():
    """Greedy replies of the head draft trees by default: fans where its chain is one C call
    (`HeadDrafter._fan`), EAGLE-2's trees where each draft is a torch forward; `combined`'s
    only where they are fans; sampled replies draft chains. The page, the API and the CLI build
    their requests so (`Engine.greedy_trees` -> `build_config`)."""
    from specchat.core.request import TREE_NODES
    from specchat.core.settings import build_config
    target = tiny_gemma3(0)
    drafter = HeadDrafter(random_head(target), target, len(TOK), lib=kernels.load("ref"))
    engine = Engine(loaded(target, TOK), {"head": drafter, "ngram": NgramDrafter(),
                                          "combined": CombinedDrafter(NgramDrafter(), drafter)})
    assert engine.trees_ok and drafter.chains_in_c

    def nodes(**values):
        cfg, _ = build_config({"drafter": "head", "temperature": 0, **values},
                              list(engine.drafters), greedy_trees=engine.greedy_trees)
        return cfg.tree_nodes

    assert engine.greedy_trees == ("head", "combined")
    assert nodes() == nodes(drafter="combined") == TREE_NODES
    assert nodes(temperature=0.7, min_p=0.05) == nodes(drafter="ngram") == 0
    drafter.native_chain = False  # the Python loop: a torch forward per draft
    assert engine.greedy_trees == ("head",)
    assert nodes() == TREE_NODES and nodes(drafter="combined") == 0
    cfg, _ = build_config({"drafter": "head", "tree_nodes": 6}, list(engine.drafters),
                          greedy_trees=())
    assert cfg.tree_nodes == 6  # asked for: trees wherever the drafter has them


@pytest.mark.parametrize("lib", ["ref", None], ids=["c-step", "torch"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "min-p"])
def test_a_fresh_drafters_first_prompt_of_two_tokens_gets_a_cache_that_holds_its_slots(
        lib, sampled):
    """A zero-slot tensor has the strides of a one-slot one over an empty storage: a fresh
    drafter whose first catch-up is one row (a prompt of two tokens) must not take those strides
    for room. Its drafts are then a warm drafter's."""
    target = tiny_gemma3(0)
    head = random_head(target, vocab_ids=torch.arange(40, 56))
    params = SamplingParams(0.8, min_p=0.01) if sampled else SamplingParams(0.0)
    prompt = ids_of("Hi")
    assert len(prompt) == 2
    fresh = HeadDrafter(head, target, len(TOK), 0.0, lib=kernels.load(lib) if lib else None)
    fresh.begin(prompt)
    drafts = [fresh.propose(prompt, k, params, Noise(3) if sampled else None)[0].tolist()
              for k in (1, 3)]
    warm = HeadDrafter(head, target, len(TOK), 0.0, lib=kernels.load(lib) if lib else None)
    warm.begin(ids_of(TEXT))
    warm.begin(prompt)
    assert drafts == [warm.propose(prompt, k, params, Noise(3) if sampled else None)[0].tolist()
                      for k in (1, 3)]
    keys, values = fresh.cache
    assert keys.untyped_storage().nbytes() >= keys.numel() * keys.element_size()


def test_a_cache_takes_in_place_only_the_slots_its_storage_holds():
    from specchat.models.eagle import extended, slots_held
    empty = torch.empty(1, 2, 0, 16)
    assert empty.stride(1) // 16 == 1 and slots_held(empty) == 0  # strides claim a slot
    assert extended(empty, 1).untyped_storage().nbytes() > 0
    buffer = torch.empty(1, 2, 8, 16)
    assert slots_held(buffer[:, :, :3]) == 8
    assert extended(buffer[:, :, :3], 5).data_ptr() == buffer.data_ptr()  # in place
    assert extended(buffer[:, :, :3], 6).data_ptr() != buffer.data_ptr()  # a new buffer
    assert slots_held(buffer[:, 1:]) == 0  # not a buffer's prefix
