"""The native sampler (csrc/sample.c, `kernels.shape_pick`): the mask, the penalties and the
draw over a forward's rows in one call compute the bits of the Python definitions
(`Shaper`, `argmax`, `min_p_draw`), on every kernels build this machine runs; and the engine
replies the same text with it as without it, plain and speculative."""

import collections
import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

from specchat import kernels
from specchat.core.engine import Engine
from specchat.core.events import TokenEvent
from specchat.core.penalties import Penalties, Shaper
from specchat.core.request import GenerateConfig
from specchat.core.sampling import DRAW, Noise, SamplingParams, argmax, min_p_draw
from specchat.drafters.ngram import NgramDrafter
from specchat.models import runtime
from specchat.models.load import load_model
from specchat.models.synthetic import byte_tokenizer, save, tiny_gemma3
from specchat.runners.cpu import runner as cpu_runner

# Every build this machine runs: the SIMD kernels of each width, the SIMD build's references,
# and the portable build.
BUILDS = {name: lib for name, lib in (
    ("avx512", kernels.load("avx512")), ("avx2", kernels.load("avx2")), ("ref", kernels.load("ref")),
    ("avx2 build's ref", kernels.reference("avx2", portable=False))) if lib is not None}


class Breakers:
    """A tokenizer stand-in for DRY: every 17th id's text is a newline (a breaker)."""

    def decode(self, ids):
        return "\n" if ids[0] % 17 == 0 else "x"


PENALTIES = [
    Penalties(repeat_penalty=1.1, repeat_last_n=64, dry_multiplier=0.8),  # the examples'
    Penalties(repeat_penalty=0.9, repeat_last_n=7, frequency_penalty=0.3, presence_penalty=-0.2),
    Penalties(dry_multiplier=2.0, dry_base=1.3, dry_allowed_length=1),
    None,
]


def _rows(vocab: int, g: torch.Generator) -> torch.Tensor:
    rows = torch.randn(4, vocab, generator=g) * 3
    rows[0, 100] += 20  # peaked
    rows[1] = (rows[1] * 2).round()  # ties everywhere
    rows[2] *= 0.01  # flat
    rows[3, :vocab // 2] = -torch.inf
    return rows


@pytest.fixture
def threads(request):
    """torch's thread count for the test (the sampler scans a wide row in that many pieces)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("build, threads", [(build, 1) for build in BUILDS] + [
    (build, 3) for build in list(BUILDS)[:1]], indirect=["threads"])
def test_the_native_sampler_computes_the_python_definitions_bits(build, threads):
    """Every build whole, and the first (this CPU's default kernels) scanning a wide row in
    pieces on several threads."""
    lib = BUILDS[build]
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    for vocab, pen, repetitive in itertools.product((65536, 4096, 2061), PENALTIES,
                                                    (True, False)):
        n = int(rng.integers(3, 400))
        # a few distinct tokens make long repeats (DRY's matches); many make none
        seq = rng.integers(0, 30 if repetitive else vocab, n).astype(np.int64)
        seq[-5:] = seq[10:15] if repetitive and n > 20 else seq[-5:]
        shaper = Shaper(pen, Breakers()) if pen else None
        breaks = torch.tensor([shaper.is_breaker(int(t)) if shaper else 0 for t in seq],
                              dtype=torch.uint8)
        rows = _rows(vocab, g)
        lengths = [n - 3, n - 2, n - 1, n]
        runs = [(5, 9), (vocab - 300, vocab)]
        want = rows.clone()
        for start, end in runs:
            want[:, start:end] = -torch.inf
        if shaper:
            for r, length in enumerate(lengths):
                shaper.shape_row(want[r], seq[:length])
        seq = torch.from_numpy(seq)
        shaped = rows.clone()
        assert kernels.shape_pick(lib, shaped, runs, seq, breaks, lengths, pen) == []
        assert torch.equal(shaped, want)
        greedy = kernels.shape_pick(lib, rows.clone(), runs, seq, breaks, lengths, pen,
                                    kernels.PICK_GREEDY)
        assert greedy == argmax(want).tolist()
        # min-p's draws (slow in Python on rows that keep many tokens): with the examples'
        # penalties and with none
        for t, min_p in ((0.7, 0.05), (1.5, 1e-3), (0.2, 0.5)) if pen in (PENALTIES[0], None) \
                else ():
            params, noise = SamplingParams(t, min_p=min_p), Noise(n)
            keys = [noise.keys(40 + r, DRAW) for r in range(4)]
            picks = kernels.shape_pick(lib, rows.clone(), runs, seq, breaks, lengths, pen,
                                       kernels.PICK_MIN_P, t, min_p, keys)
            if vocab % 512 == 0:  # rows `min_p_draw` takes (the engine asks only for those)
                assert picks == [min_p_draw(want[r], params, noise, 40 + r) for r in range(4)]
            assert all(want[r, p] > -torch.inf for r, p in enumerate(picks))
            assert kernels.shape_pick(lib, rows.clone(), runs, seq, breaks, lengths, pen,
                                      kernels.PICK_MIN_P, t, min_p, keys,
                                      block_maxima(rows)) == picks
        # From the head's block maxima (reading only the blocks that can hold the pick): the
        # same picks and the same shaped rows.
        shaped = rows.clone()
        assert kernels.shape_pick(lib, shaped, runs, seq, breaks, lengths, pen,
                                  kernels.PICK_GREEDY, maxima=block_maxima(rows)) == greedy
        assert torch.equal(shaped, want)


def block_maxima(rows: torch.Tensor, extra: int = 0) -> torch.Tensor:
    """The rows' block maxima as the LM head writes them (`kernels.q8_0_matmul_i8`), with
    `extra` more blocks than the rows need (a head wider than the logits the engine keeps)."""
    width = kernels.head_blocks(rows.shape[1]) * kernels.HEAD_BLOCK
    padded = torch.full((rows.shape[0], width + extra * kernels.HEAD_BLOCK), 1e30)
    padded[:, :rows.shape[1]] = rows  # past the row: values the sampler must not read
    return padded.view(rows.shape[0], -1, kernels.HEAD_BLOCK).amax(-1).contiguous()


@pytest.mark.parametrize("build", list(BUILDS))
def test_picks_from_block_maxima_are_the_whole_rows_picks(build):
    """Ties across blocks, rows all -inf, a NaN, masks covering whole blocks and parts, a head
    wider than the logits: the picks from the block maxima are the whole-row scans' picks."""
    lib = BUILDS[build]
    g = torch.Generator().manual_seed(3)
    seq, breaks = torch.tensor([7, 64, 65, 300, 64]), torch.zeros(5, dtype=torch.uint8)
    pen = PENALTIES[0]
    for width in (4096, 2061, 64 * 5 + 1):
        rows = (torch.randn(6, width, generator=g) * 2).round()  # ties, in many blocks
        rows[1] = -torch.inf
        rows[2, width // 2] = torch.nan
        rows[3, 64:128] = 50.0  # the largest, a whole block of it, then masked below
        rows[4, [3, 300, width - 1]] = 40.0  # one tie penalized (300: in the window)
        rows[5] = 0.0
        runs = [(64, 128), (130, 131), (width - 70, width)]
        lengths = [5] * 6
        for extra in (0, 2):
            maxima = block_maxima(rows, extra)
            greedy = kernels.shape_pick(lib, rows.clone(), runs, seq, breaks, lengths, pen,
                                        kernels.PICK_GREEDY)
            assert kernels.shape_pick(lib, rows.clone(), runs, seq, breaks, lengths, pen,
                                      kernels.PICK_GREEDY, maxima=maxima) == greedy, width
            keys = [Noise(width).keys(r, DRAW) for r in range(6)]
            drawn = kernels.shape_pick(lib, rows.clone(), runs, seq, breaks, lengths, pen,
                                       kernels.PICK_MIN_P, 0.8, 0.05, keys)
            assert kernels.shape_pick(lib, rows.clone(), runs, seq, breaks, lengths, pen,
                                      kernels.PICK_MIN_P, 0.8, 0.05, keys, maxima) == drawn
        # Maxima that leave out row 0's largest value (100 at id 2000, block 31): the pick comes
        # from the blocks they name, so the sampler did read them.
        if width == 4096:
            rows[0, 2000] = 100.0
            lie = block_maxima(rows)
            lie[0, 31] = -torch.inf
            (pick, *_) = kernels.shape_pick(lib, rows.clone(), runs, seq, breaks, lengths, pen,
                                            kernels.PICK_GREEDY, maxima=lie)
            assert pick != 2000 and pick // 64 != 31


def test_the_native_sampler_knows_every_sampler_setting():
    """A new penalty or truncation must reach csrc/sample.c (or stay on the Python side): the
    native call reads these fields and no others."""
    assert {f.name for f in dataclasses.fields(Penalties)} == {
        "repeat_penalty", "repeat_last_n", "frequency_penalty", "presence_penalty",
        "dry_multiplier", "dry_base", "dry_allowed_length", "dry_sequence_breakers"}
    assert {f.name for f in dataclasses.fields(SamplingParams)} == {
        "temperature", "top_p", "top_k", "min_p"}


def test_the_native_sampler_refuses_what_it_cannot_take():
    lib = next(iter(BUILDS.values()), None)
    if lib is None:
        pytest.skip("no kernels build runs here")
    seq, breaks = torch.arange(10), torch.zeros(10, dtype=torch.uint8)
    with pytest.raises(ValueError, match="float32"):
        kernels.shape_pick(lib, torch.zeros(2, 64, dtype=torch.float64), [], seq, breaks, [1, 2])
    with pytest.raises(ValueError, match="longer"):
        kernels.shape_pick(lib, torch.zeros(1, 64), [], seq, breaks, [11])
    with pytest.raises(ValueError, match="int64"):
        kernels.shape_pick(lib, torch.zeros(1, 64), [], seq.int(), breaks, [1])
    with pytest.raises(ValueError, match="int64"):  # (numpy arrays: tensors are what it takes)
        kernels.shape_pick(lib, torch.zeros(1, 64), [], seq.numpy(), breaks, [1])


KERNEL_PATHS = [p.name for p in runtime.candidates(forced="")
                if p.kernels and not p.fused_nf4 and kernels.load(p.kernels) is not None]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Gemma 3 on specchat's C forward whose vocabulary (2,048) is whole blocks, so that
    min-p's draws take the blocked path the embedded model's do."""
    pytest.importorskip("bitsandbytes")
    tok = byte_tokenizer([f"<w{i}>" for i in range(2048 - 259)])
    model = tiny_gemma3(0, vocab=len(tok), hidden=128, head_dim=64)
    for m in model.modules():
        if type(m).__name__ == "Gemma3RMSNorm":
            torch.nn.init.normal_(m.weight, std=0.5)
    return save(model.to(torch.bfloat16), tok, tmp_path_factory.mktemp("gemma3"))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_replies_are_the_same_with_the_native_sampler_and_without(checkpoint, path,
                                                                   monkeypatch):
    monkeypatch.setenv(runtime.ENV, path)
    loaded = load_model(str(checkpoint), "nf4", "cpu", progress=lambda *a: None)
    assert isinstance(loaded.runner, cpu_runner.CpuRunner)
    engine = Engine(loaded, {"ngram": NgramDrafter()})
    native = engine.runner.shape_pick
    modes = []

    def counted(*args):
        modes.append(args[6])
        return native(*args)

    prompt = list(b"abcabcabcabd abcabcabcabd abcabc")
    examples = dict(repeat_penalty=1.1, repeat_last_n=64, dry_multiplier=0.8)
    for sampling, mode in ((dict(temperature=0.0), "greedy"),
                           (dict(temperature=0.8, min_p=0.05), "min_p"),
                           (dict(temperature=0.8, top_p=0.9), None)):  # it shapes, Python draws
        cfg = dict(max_new_tokens=40, adaptive=False, draft_len=4, seed=3, **examples,
                   **sampling)
        replies = []
        for with_native, spec in itertools.product((True, False), (False, True)):
            monkeypatch.setattr(engine, "_native_sampler", counted if with_native else None)
            modes.clear()
            replies.append([e.id for e in engine.stream(prompt, GenerateConfig(
                speculation=spec, drafter="ngram", **cfg)) if isinstance(e, TokenEvent)])
            assert set(modes) == ({mode} if with_native else set())
        assert len(replies[0]) == 40 and all(r == replies[0] for r in replies), sampling


@pytest.mark.parametrize("threads", [1, 3], indirect=True)
def test_row_top_is_the_rows_largest_logits_and_its_log_sum_exp(threads):
    """What the inspector reads of a step's row, in one native call: its largest logits in the
    order a stable sort gives them (the first id among equal values), and its log-sum-exp
    within a hundred-thousandth; every build the same bits; the engine's evidence
    the same candidates with it as without it."""
    from specchat.core.sampling import top_candidates
    rows = _rows(70_000, torch.Generator().manual_seed(5))  # 3 threads: the row in 3 pieces
    for row in rows:
        order = torch.sort(row, descending=True, stable=True).indices[:kernels.TOP_MAX]
        found = [kernels.row_top(lib, row, kernels.TOP_MAX) for lib in BUILDS.values()]
        ids, values, lse = found[0]
        assert all(f == found[0] for f in found[1:])
        live = int(row.isfinite().sum())
        assert ids == order[:live].tolist() and values == row[order[:live]].tolist()
        assert lse == pytest.approx(float(torch.logsumexp(row.double(), -1)), rel=1e-5)
        for params in (SamplingParams(0.0), SamplingParams(0.7)):
            native = top_candidates(row, params, 5, 17, lambda r, n: kernels.row_top(
                BUILDS[next(iter(BUILDS))], r, n))
            plain = top_candidates(row, params, 5, 17)
            assert [i for i, _ in native[0]] == [i for i, _ in plain[0]] or row.unique().numel() \
                < row.numel()  # torch's topk orders equal values as it likes
            assert [p for _, p in native[0]] == pytest.approx([p for _, p in plain[0]], rel=1e-5)
            assert native[1] == pytest.approx(plain[1], rel=1e-5, abs=1e-30)
    with_nan = rows[0].clone()
    with_nan[7] = torch.nan
    assert np.isnan(kernels.row_top(BUILDS[next(iter(BUILDS))], with_nan, 3)[2])
    all_masked = torch.full((1000,), -torch.inf)
    assert kernels.row_top(BUILDS[next(iter(BUILDS))], all_masked, 3) == ([], [], -np.inf)
    with pytest.raises(ValueError, match="at most 16"):
        kernels.row_top(BUILDS[next(iter(BUILDS))], rows[0], 17)


@pytest.mark.parametrize("threads", [1, 3], indirect=True)
def test_row_evidence_is_row_top_at_the_temperature_with_a_tokens_probability(threads):
    """The inspector's evidence in one native call: `row_top` of row / t (torch's float32
    division) and a token's probability at t and under min-p, the probabilities sampling
    gives (`prob_of`) within a hundred-thousandth; every build the same bits; the evidence's
    numbers with it those without it."""
    from specchat.core.evidence import _decisive
    from specchat.core.sampling import prob_of, top_candidates
    rows = _rows(70_000, torch.Generator().manual_seed(6))
    first = BUILDS[next(iter(BUILDS))]
    for row, t, min_p in itertools.product(rows, (1.0, 0.7, 1.3), (0.0, 0.05, 0.3)):
        scaled = row / t
        order = torch.sort(row, descending=True, stable=True).indices[:kernels.TOP_MAX]
        live = int(row.isfinite().sum())
        for also in (int(order[0]), int(order[3]), 17, int(row.argmin())):
            found = [kernels.row_evidence(lib, row, kernels.TOP_MAX, t, min_p, also)
                     for lib in BUILDS.values()]
            ids, values, lse, p_at, p_kept = found[0]
            assert all(f == found[0] for f in found[1:])
            assert ids == order[:live].tolist() and values == scaled[ids].tolist()
            assert lse == pytest.approx(float(torch.logsumexp(scaled.double(), -1)), rel=1e-5)
            assert p_at == pytest.approx(math.exp(float(scaled[also]) - lse), rel=1e-5,
                                         abs=1e-30)
            params = SamplingParams(t, min_p=min_p)
            assert p_kept == pytest.approx(prob_of(row, params, also), rel=1e-5, abs=1e-30)
            for params in (params, SamplingParams(0.0), SamplingParams(t, top_p=0.9)):
                native = _decisive(row, params, also, lambda *a: kernels.row_evidence(first, *a))
                plain = _decisive(row, params, also, None)
                assert [p for _, p in native[0]] == pytest.approx([p for _, p in plain[0]],
                                                                  rel=1e-5)
                assert native[1] == pytest.approx(plain[1], rel=1e-5, abs=1e-30)
                if params.top_p < 1:  # top-p leaves the sampled probability to `prob_of`
                    assert native[2] is None
                else:
                    assert native[2] == pytest.approx(
                        native[1] if params.greedy else prob_of(row, params, also), rel=1e-5,
                        abs=1e-30)
    assert kernels.row_evidence(first, rows[0], 3, 0.7, 0.05, None)[3:] == (None, None)
    with pytest.raises(ValueError, match="temperature"):
        kernels.row_evidence(first, rows[0], 3, 0.0, 0.05, 1)


def test_a_drafters_reduced_row_gets_the_python_penalties_bits():
    """`kernels.shape_reduced`: the request's penalties on a row of a drafter's reduced
    vocabulary (token t at row[index[t]], -1 for tokens it lacks) in one native call, the bits
    of `Shaper.shape_row` with that index, whichever tokens of the prefix the row holds."""
    lib = next(iter(BUILDS.values()))
    rng = np.random.default_rng(3)
    vocab = 5000
    for pen, repetitive in itertools.product([p for p in PENALTIES if p], (True, False)):
        kept = np.sort(rng.choice(vocab, 700, replace=False))  # the reduced vocabulary's ids
        index = torch.full((vocab,), -1, dtype=torch.int64)
        index[torch.from_numpy(kept)] = torch.arange(len(kept))
        n = int(rng.integers(2, 300))
        pool = kept[:20] if repetitive else np.arange(vocab)  # repeats of tokens the row holds
        seq = rng.choice(pool, n).astype(np.int64)
        shaper = Shaper(pen, Breakers())
        row = torch.randn(len(kept), generator=torch.Generator().manual_seed(n)) * 3
        want = row.clone()
        shaper.shape_row(want, seq, index)
        got = row.clone()
        breaks = torch.tensor([shaper.is_breaker(int(t)) for t in seq], dtype=torch.uint8)
        kernels.shape_reduced(lib, got, index, torch.from_numpy(seq), breaks, pen)
        assert torch.equal(got, want), (pen, repetitive)
        assert repetitive is False or not torch.equal(got, row)  # the penalties moved something


@pytest.mark.parametrize("build", list(BUILDS))
def test_a_drafters_min_p_draw_over_its_vocabulary_is_the_python_definition(build):
    """A drafter's min-p draw over a reduced vocabulary (`kernels.min_p_place`, the head's
    sampled chain in C) gives `sampling.min_p_place`'s place and probability to the bit, on
    rows of any width, with ties, -inf and a row with no finite logit; keyed by token id, so
    over the whole vocabulary in order it is the target's own draw (`min_p_draw`)."""
    from specchat.core.sampling import min_p_place
    lib = BUILDS[build]
    g = torch.Generator().manual_seed(5)
    for width, (t, min_p) in itertools.product((16, 100, 1024, 8192),
                                               ((0.7, 0.05), (1.5, 1e-3), (0.2, 0.5), (1.0, 1.0))):
        ids = torch.randperm(262_144, generator=g)[:width].to(torch.int64)
        row = torch.randn(width, generator=g) * 3
        row[::7] = -torch.inf
        row[1] = row[2] = row.max()  # a tie at the top
        params = SamplingParams(t, min_p=min_p)
        for position in range(6):
            noise = Noise(width + position)
            want = min_p_place(row, params, noise, position, ids.tolist())
            got = kernels.min_p_place(lib, row, ids, t, min_p, noise.keys(position, DRAW))
            assert got == want and want[0] >= 0 and row[want[0]] > -torch.inf
        whole = torch.arange(width, dtype=torch.int64)
        if width % 512 == 0 and width >= 2048:  # rows `min_p_draw` takes
            for position in range(6):
                noise = Noise(position)
                assert min_p_place(row, params, noise, position, whole.tolist())[0] == \
                    min_p_draw(row, params, noise, position)
    dead = torch.full((64,), -torch.inf)
    ids = torch.arange(64, dtype=torch.int64)
    assert kernels.min_p_place(lib, dead, ids, 0.7, 0.05, (1, 2)) is None
    assert min_p_place(dead, SamplingParams(0.7, min_p=0.05), Noise(0), 0, ids.tolist()) is None


def test_a_drafters_min_p_draw_follows_min_p_distribution():
    """Over many positions, the draw picks each candidate as often as min-p's distribution
    says (the truncated softmax at the temperature), and never a token outside it."""
    from specchat.core.sampling import min_p_place, nucleus
    row = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -3.0, -8.0, 0.9])
    ids = [11, 5, 900, 3, 70_000, 42, 8, 1]
    params = SamplingParams(0.8, min_p=0.1)
    kept, probs = nucleus(row, params)
    expected = dict(zip(kept.tolist(), probs.tolist()))
    counts = collections.Counter()
    n = 20_000
    for position in range(n):
        place, prob = min_p_place(row, params, Noise(9), position, ids)
        assert prob == pytest.approx(expected[place], rel=1e-6)
        counts[place] += 1
    assert set(counts) == set(expected)
    for place, p in expected.items():  # within 4.5 standard deviations
        assert abs(counts[place] / n - p) < 4.5 * (p * (1 - p) / n) ** 0.5, (place, p)


@pytest.mark.usefixtures("one_thread")
def test_fan_trees_reply_plain_texts_with_the_native_sampler_and_without(checkpoint,
                                                                         monkeypatch):
    """The head's C chain with leaves beside it (`HeadDrafter._fan`), verified on the native
    sampler (the chain's rows in one call, a leaf's row where the walk reaches it, each from
    the head's block maxima) and on the Python definitions: plain decoding's reply, greedy and
    drawn by min-p, and leaves pass. The head's vocabulary is the tokens the target writes (as
    a trained head's is), so that its random guesses are sometimes the target's."""
    from specchat.core.events import StepRecord
    from specchat.drafters.head import HeadDrafter
    from specchat.models.eagle import DraftHead, HeadConfig
    loaded = load_model(str(checkpoint), "nf4", "cpu", progress=lambda *a: None)
    target = loaded.model
    prompt = list(b"abcabcabcabd abcabcabcabd abcabc")
    examples = dict(repeat_penalty=1.1, repeat_last_n=64, dry_multiplier=0.8)
    plain_engine = Engine(loaded, {})
    samplings = (dict(temperature=0.0), dict(temperature=0.8, min_p=0.05, seed=5))
    plain = [[e.id for e in plain_engine.stream(prompt, GenerateConfig(
        max_new_tokens=40, speculation=False, **examples, **s)) if isinstance(e, TokenEvent)]
        for s in samplings]
    torch.manual_seed(0)
    written = sorted(set(plain[0] + plain[1]))
    head = DraftHead(HeadConfig.for_target(target, len(written)))
    head.vocab_ids = torch.tensor(written)
    drafter = HeadDrafter(head.attach(target).eval(), target, 2048, fan_width=8,
                          fan_min_score=0.0)
    assert drafter.chains_in_c
    engine = Engine(loaded, {"head": drafter})
    walks, native = [], engine._verify_spine
    monkeypatch.setattr(engine, "_verify_spine", lambda *a: (walks.append(1), native(*a))[1])
    leaves = 0
    for sampling, want in zip(samplings, plain):
        for with_native in (True, False):
            monkeypatch.setattr(engine, "_native_sampler",
                                engine.runner.shape_pick if with_native else None)
            walks.clear()
            for tree_nodes in (0, 12):
                events = list(engine.stream(prompt, GenerateConfig(
                    max_new_tokens=40, drafter="head", draft_len=3, adaptive=False,
                    tree_nodes=tree_nodes, **examples, **sampling)))
                assert [e.id for e in events if isinstance(e, TokenEvent)] == want, \
                    (sampling, with_native, tree_nodes)
                for step in (e for e in events if isinstance(e, StepRecord)):
                    if step.parents:  # a tree: the chain first, each node the child of the one before
                        spine = next((i for i, p in enumerate(step.parents) if p != i - 1),
                                     len(step.parents))
                        assert all(p < spine for p in step.parents)
                        off = any(node >= spine for node in step.path)
                        leaves += off
                        # past a leaf the head's rows (its chain's) say nothing: none shown
                        assert not (off and step.evidence and step.evidence.draft_top)
            assert bool(walks) == with_native
    assert leaves > 0
