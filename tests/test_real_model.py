"""The embedded Gemma 3 270M, for real (slow: ~1-2 min; the first run converts the GGUF)."""

import re
from dataclasses import replace

import pytest
import torch

from specchat.core.events import KINDS, GenerationStats, TokenEvent
from specchat.core.request import GenerateConfig
from specchat.core.text import chat_prompt
from specchat.loader import load_engine
from specchat.models import runtime
from specchat.runners.cpu.runner import CpuRunner
from specchat.runners.hf.attention import is_row_exact
from specchat.runners.hf.kvcache import new_cache

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "List the days of the week, then list them again."}]


@torch.inference_mode()
def logit_mismatches(model) -> int:
    """Positions of 24 new tokens whose logits differ between one-token steps and 6-token
    forwards (bit for bit), after a 30-token prompt."""
    prompt, new = list(range(1000, 1030)), list(range(2000, 2024))
    logits = []
    for width in (1, 6):
        cache = new_cache(model, paged=is_row_exact(model))
        model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        logits.append(torch.cat([
            model(torch.tensor([new[i:i + width]]), past_key_values=cache,
                  use_cache=True).logits[0] for i in range(0, len(new), width)]))
    return int((logits[0] != logits[1]).any(-1).sum())


def collect(engine, cfg):
    ids, stops = chat_prompt(engine.tokenizer, PROMPT)
    events = list(engine.stream(ids, replace(cfg, stop=stops)))
    return [e for e in events if isinstance(e, TokenEvent)], events[-1]


def test_embedded_nf4_ngram_speculation_and_fp32_greedy_equivalence():
    nf4 = load_engine("embedded", quantization="nf4").engine
    assert nf4.target.quantization == "nf4"
    tokens, stats = collect(nf4, GenerateConfig(max_new_tokens=48, drafter="ngram"))
    assert isinstance(stats, GenerationStats) and stats.new_tokens > 0
    assert all(t.kind in KINDS for t in tokens)
    reply = "".join(t.text for t in tokens)
    assert reply.strip()
    assert reply == nf4.tokenizer.decode([t.id for t in tokens], skip_special_tokens=False)

    # Row-exact attention: speculation gives plain greedy's tokens on the NF4 target too.
    cfg = dict(max_new_tokens=48, adaptive=False, draft_len=4)
    plain, _ = collect(nf4, GenerateConfig(speculation=False, **cfg))
    for drafter in ("ngram", "combined"):
        spec, s = collect(nf4, GenerateConfig(speculation=True, drafter=drafter, **cfg))
        assert [t.id for t in spec] == [t.id for t in plain], drafter
        assert s.accepted > 0
    # Sampled too: with the keyed random numbers every drafter (the shipped head racing its
    # drafts, n-gram lookup, trees) gives plain sampling's reply for a seed.
    sampled = dict(cfg, temperature=0.7, top_p=0.95, seed=5)
    plain, _ = collect(nf4, GenerateConfig(speculation=False, **sampled))
    for drafter, tree_nodes in (("combined", 0), ("head", 0), ("head", 10)):
        spec, s = collect(nf4, GenerateConfig(drafter=drafter, tree_nodes=tree_nodes, **sampled))
        assert [t.id for t in spec] == [t.id for t in plain], (drafter, tree_nodes)
        assert s.drafted > 0
    model = nf4.model
    assert nf4.target.runtime.row_exact and logit_mismatches(model) == 0
    exact = model.config.get_text_config()._attn_implementation
    model.set_attn_implementation("sdpa")  # transformers' own: wide forwards differ in the last bits
    try:
        assert logit_mismatches(model) > 0
    finally:
        model.set_attn_implementation(exact)

    fp32 = load_engine("embedded", quantization="none").engine
    cfg = dict(max_new_tokens=48, adaptive=False, draft_len=4)
    plain, _ = collect(fp32, GenerateConfig(speculation=False, **cfg))
    spec, s = collect(fp32, GenerateConfig(speculation=True, drafter="ngram", **cfg))
    assert [t.id for t in spec] == [t.id for t in plain]
    assert s.drafted > 0


def _runnable() -> list[str]:
    from specchat import kernels
    return [p.name for p in runtime.candidates(forced="")
            if p.kernels is None or kernels.load(p.kernels) is not None]


@pytest.mark.ci
def test_every_path_this_machine_runs_is_exact_on_the_embedded_target(monkeypatch):
    """CI's real-model test. Each CPU path this machine can run, forced in turn on the embedded
    NF4 target: the load-time proof passes, 24 tokens verified 6 at a time give the one-token
    logits bit for bit, and greedy speculation gives plain greedy's reply. On the path a user
    gets (the first), a chat request also gives the same reply whatever ran before it."""
    paths = _runnable()
    assert paths[-1] == "cpu-fp32-dense" and len(paths) >= 2  # the plain C kernels build here
    for name in paths:
        monkeypatch.setenv(runtime.ENV, name)
        engine = load_engine("embedded", quantization="nf4").engine
        rt = engine.target.runtime
        assert rt.path == name
        on_kernels = runtime.BY_NAME[name].kernels and not runtime.BY_NAME[name].fused_nf4
        assert isinstance(engine.target.runner, CpuRunner) == bool(on_kernels), name
        if not rt.row_exact:  # only torch's own products may fail; the proof saw what is so
            assert name == "cpu-fp32-dense" and logit_mismatches(engine.model) > 0, rt.proof
            continue
        assert logit_mismatches(engine.model) == 0, name
        cfg = dict(max_new_tokens=32, adaptive=False, draft_len=4)
        plain, _ = collect(engine, GenerateConfig(speculation=False, **cfg))
        spec, s = collect(engine, GenerateConfig(drafter="ngram", **cfg))
        assert [t.id for t in spec] == [t.id for t in plain] and s.accepted > 0, name
        if on_kernels:  # the image ids at the vocabulary's end: never computed in a step
            assert engine.target.runner._logits_upto == 255999, name
        if name == paths[0]:
            _same_reply_whatever_ran_before(engine)
        del engine


@pytest.fixture(scope="module")
def embedded():
    return load_engine("embedded", quantization="nf4").engine


def test_the_embedding_table_stays_in_the_checkpoints_mapping(embedded):
    """The embedded target's table is read a row at a time (its LM head is the GGUF's Q8_0
    copy), so it stays in the checkpoint's file mapping with the pages loading read dropped:
    its 320 MB of bf16 are not the process's own memory, and under pressure the kernel may take
    back what decoding reads of it (docs/performance.md)."""
    from specchat.runners.memory import _file_mappings
    table = embedded.target.model.get_input_embeddings().weight
    assert table.dtype == torch.bfloat16 and table.numel() * 2 > 300e6
    assert any(start <= table.data_ptr() < end for start, end in _file_mappings())


# The integer path's greedy reply to PROMPT (the chat format), 32 tokens: its integer products
# are exact, and its float parts (norms, RoPE, attention, softmax) are one C source compiled with
# the same flags on every x86 CPU (no contraction, one reduction order, one expf), so every CPU
# kind gives these tokens. The RoPE tables come from torch's float32 cos/sin, the same bits with
# its AVX2 and AVX-512 kernels (its scalar build, on CPUs without AVX2, rounds some differently).
INTEGER_REPLY = [669, 2668, 529, 506, 2069, 659, 49597, 236761, 107, 2887, 236787, 2900, 563,
                 506, 7488, 7626, 528, 506, 10321, 1458, 236881, 107, 74314, 236787, 669, 7488,
                 7626, 528, 506, 10321, 1458, 563]


@pytest.mark.ci
def test_the_integer_path_gives_the_recorded_reply_on_every_kernel(embedded):
    """`cpu-int8`'s decoder stack on each integer kernel this CPU runs (AMX, VNNI, AVX2; the
    portable reference where no SIMD kernel runs), forced whatever this CPU would pick: greedy
    decoding gives the reply recorded above, on whatever CPU kind runs the test."""
    from tiny import i8_kernels

    ids, _ = chat_prompt(embedded.tokenizer, PROMPT)
    found = i8_kernels()
    fast = {name: lib for name, lib in found.items() if not name.endswith("ref")}
    for name, lib in (fast or found).items():  # (the references' bits: test_cpu_runner.py)
        runner = CpuRunner(embedded.model, lib, int8=True)
        cache, reply = runner.new_cache(), []
        logits = runner.forward(cache, ids, 0, 1)
        while len(reply) < len(INTEGER_REPLY):
            reply.append(int(logits[-1].argmax()))
            logits = runner.forward(cache, reply[-1:], len(ids) + len(reply) - 1, 1)
        assert reply == INTEGER_REPLY, (name, embedded.tokenizer.decode(reply))


def _reply(engine, ids, cfg) -> tuple[list[int], str]:
    tokens = [e for e in engine.stream(ids, cfg) if isinstance(e, TokenEvent)]
    return [t.id for t in tokens], "".join(t.text for t in tokens)


def test_the_same_chat_request_gives_the_same_reply_whatever_ran_before(embedded):
    _same_reply_whatever_ran_before(embedded)


def _same_reply_whatever_ran_before(embedded) -> None:
    """A chat turn (the few-shot preamble, ~150 tokens: two whole pages and a narrow rest) at
    the examples' samplers, greedy: the same reply fresh, right after itself, after another
    chat turn that shares the preamble, and after a completion; speculation off and on."""
    from specchat.core.settings import ANTI_LOOP
    ids, stops = embedded.chat_prompt([{"role": "user",
                                        "content": "Tell me a fun fact about octopuses."}])
    other, _ = embedded.chat_prompt([{"role": "user", "content": "What is photosynthesis?"}])
    plain_text, _ = embedded.text_prompt("The Eiffel Tower is")
    cfg = dict(max_new_tokens=48, temperature=0.0, seed=0, stop=stops, **ANTI_LOOP)
    embedded.reset_cache()
    fresh, text = _reply(embedded, ids, GenerateConfig(speculation=False, **cfg))
    assert len(fresh) > 5, text
    for before in ([ids], [other], [plain_text], [other, ids]):
        for speculation in (False, True):
            for prompt in before:
                _reply(embedded, prompt, GenerateConfig(speculation=not speculation, **cfg))
            got, _ = _reply(embedded, ids, GenerateConfig(speculation=speculation,
                                                           drafter="combined", **cfg))
            assert got == fresh, (len(before), speculation)


def test_every_sampler_on_keeps_speculation_lossless_on_the_embedded_target(embedded):
    """Penalties, DRY and min-p reshape each verified row from its own prefix: greedy and
    seeded replies with speculation are plain decoding's, token for token."""
    from specchat.core.settings import ANTI_LOOP
    ids, _ = embedded.text_prompt("Photosynthesis is the process by which plants")
    samplers = dict(ANTI_LOOP, frequency_penalty=0.2, presence_penalty=0.1)
    for sampling in (dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, top_k=50)):
        cfg = dict(max_new_tokens=64, seed=7, adaptive=False, draft_len=4, **samplers, **sampling)
        plain, _ = _reply(embedded, ids, GenerateConfig(speculation=False, **cfg))
        for drafter in ("ngram", "combined"):
            spec, _ = _reply(embedded, ids, GenerateConfig(drafter=drafter, **cfg))
            assert spec == plain, (drafter, sampling)


@pytest.mark.parametrize("index", range(5))
def test_each_example_reads_without_loops_and_stays_on_topic(embedded, index):
    """What a newcomer's first click shows (ui/examples.py, with its own settings): no 6-token
    sequence more than twice, and at least two of the example's topic words."""
    from tiny import most_repeats

    from specchat.core.settings import build_config
    from specchat.ui.examples import EXAMPLES
    example = EXAMPLES[index]
    settings = dict(example.settings)
    if settings.pop("mode") == "chat":
        ids, stops = embedded.chat_prompt([{"role": "user", "content": example.text}])
    else:
        ids, stops = embedded.text_prompt(example.text)
    cfg, _ = build_config(settings, list(embedded.drafters))
    cfg = replace(cfg, stop=stops)
    tokens, text = _reply(embedded, ids, cfg)
    assert len(tokens) >= 20, text
    assert most_repeats(tokens, 6) <= 2, text
    words = set(re.findall(r"[a-z]+", text.lower()))
    assert len(words & set(example.topic)) >= 2, text


CHAT_QUESTIONS = [("Why is the sky blue?", ("sky", "sun", "light", "blue", "air")),
                  ("What is the capital of Australia?", ("capital", "australia", "city")),
                  ("How many legs does a spider have?", ("legs", "spider", "spiders", "eight")),
                  ("What is photosynthesis?", ("plants", "light", "energy", "sun", "food")),
                  ("Who wrote Romeo and Juliet?", ("shakespeare", "william", "play", "wrote"))]


def test_chat_on_the_base_model_answers_simple_questions_on_topic(embedded):
    """A base model has no chat format: its chat is a few-shot transcript (core/text.py).
    Five simple questions, greedy with the examples' anti-loop samplers: each answer is a
    short, loop-free reply on the question's subject, and no two answers are the same."""
    from tiny import most_repeats

    from specchat.core.settings import ANTI_LOOP
    answers = set()
    for question, topic in CHAT_QUESTIONS:
        ids, stops = embedded.chat_prompt([{"role": "user", "content": question}])
        cfg = GenerateConfig(max_new_tokens=64, stop=stops, **ANTI_LOOP)
        tokens, text = _reply(embedded, ids, cfg)
        words = set(re.findall(r"[a-z]+", text.lower()))
        assert text.strip() and most_repeats(tokens, 6) <= 2, (question, text)
        assert words & set(topic), (question, text)
        answers.add(text.strip())
    assert len(answers) == len(CHAT_QUESTIONS)
