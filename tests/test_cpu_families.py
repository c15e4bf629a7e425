"""specchat's CPU forward on every family it runs (`runners.family`): Llama (Llama 3's RoPE
scaling), SmolLM 2 (a tied head), Mistral (a window on every layer), Qwen 2 (q, k and v biases,
a windowed layer), Qwen 3 (per-head norms), Gemma 2 (soft-caps on the attention's scores and
the logits), Gemma 3 and Phi-3 (q|k|v and gate|up fused, split at load), each a tiny random model: it computes what transformers' forward
computes, proves row-exact at load, gives a token the same logits in a chain, a page and a
tree, the same bits on every integer kernel, and speculation replays plain decoding. Forced on
every kernels path this machine runs."""

import pytest
import torch
from tiny import i8_kernels

from specchat import kernels, runners
from specchat.core.engine import Engine
from specchat.core.events import TokenEvent
from specchat.core.request import GenerateConfig
from specchat.drafters.ngram import NgramDrafter
from specchat.models import runtime
from specchat.models.load import load_model
from specchat.models.synthetic import FAMILY_MODELS, byte_tokenizer, save, tiny_family
from specchat.runners import family as families
from specchat.runners.cpu import runner as cpu_runner
from specchat.runners.hf.runner import HFRunner
from specchat.runners.memory import _file_mappings

pytestmark = pytest.mark.usefixtures("one_thread")

KERNEL_PATHS = [p.name for p in runtime.candidates(forced="")
                if p.kernels and not p.fused_nf4 and kernels.load(p.kernels) is not None]
INT8_PATH = next((p for p in KERNEL_PATHS if runtime.BY_NAME[p].int8), None)
FLOAT_PATH = next((p for p in KERNEL_PATHS if not runtime.BY_NAME[p].int8), None)
IDS = [(7 + 37 * i) % 250 + 3 for i in range(300)]  # past the windows and the cache's first slots


@pytest.fixture(scope="module", params=FAMILY_MODELS)
def checkpoint(request, tmp_path_factory):
    pytest.importorskip("bitsandbytes")
    model = tiny_family(request.param).to(torch.bfloat16)
    return save(model, byte_tokenizer(), tmp_path_factory.mktemp(request.param))


def load(checkpoint, path, monkeypatch, runner=""):
    monkeypatch.setenv(runtime.ENV, path)
    monkeypatch.setenv(runners.CPU_RUNNER_ENV, runner)
    return load_model(str(checkpoint), "nf4", "cpu", progress=lambda *a: None)


def logits_in_pages(runner, ids, page=64):
    cache = runner.new_cache()
    return torch.cat([runner.forward(cache, ids[s:s + page], s, len(ids[s:s + page]))
                      for s in range(0, len(ids), page)])


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_each_family_computes_what_transformers_computes(checkpoint, path, monkeypatch):
    ours = load(checkpoint, path, monkeypatch)
    assert isinstance(ours.runner, cpu_runner.CpuRunner), cpu_runner.unsupported(ours.model)
    assert "decoder forward" in ours.label and ours.runtime.row_exact, ours.runtime.proof
    theirs = load(checkpoint, path, monkeypatch, runner="transformers")
    assert isinstance(theirs.runner, HFRunner)
    got, want = logits_in_pages(ours.runner, IDS), logits_in_pages(theirs.runner, IDS)
    if runtime.BY_NAME[path].int8:  # within the int8 roundings of activations and NF4's table
        assert (got - want).norm() <= 0.04 * want.norm(), (got - want).norm() / want.norm()
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got[-1].argmax() == want[-1].argmax()


@pytest.mark.parametrize("path", [p for p in (INT8_PATH, FLOAT_PATH) if p])
def test_each_family_gives_a_token_its_logits_alone_in_a_chain_a_page_and_a_tree(
        checkpoint, path, monkeypatch):
    runner = load(checkpoint, path, monkeypatch).runner
    pages = logits_in_pages(runner, IDS)
    for width in (1, 5, 17):
        cache = runner.new_cache()
        runner.forward(cache, IDS[:200], 0, 1)
        rows = torch.cat([runner.forward(cache, IDS[s:min(s + width, 260)], s,
                                         len(IDS[s:min(s + width, 260)]))
                          for s in range(200, 260, width)])
        assert torch.equal(rows, pages[200:260]), width
    # a tree (root - 21 - 31, root - 22) in one forward: each node its path's logits
    cache = runner.new_cache()
    runner.forward(cache, IDS[:40], 0, 1)
    tree = runner.forward_tree(cache, [11, 21, 22, 31], [-1, -1, 0], 40)  # (parents of 1..)
    for node, chain in ((3, [11, 21, 31]), (2, [11, 22])):
        fresh = runner.new_cache()
        runner.forward(fresh, IDS[:40], 0, 1)
        assert torch.equal(runner.forward(fresh, chain, 40, len(chain))[-1], tree[node])


def test_each_familys_integer_forward_is_the_same_bits_on_every_kernel(checkpoint, monkeypatch):
    if FLOAT_PATH is None:
        pytest.skip("no kernels path runs here")
    model = load(checkpoint, FLOAT_PATH, monkeypatch).model
    outs = {name: logits_in_pages(cpu_runner.CpuRunner(model, lib, int8=True), IDS[:130])
            for name, lib in i8_kernels().items()}
    first = outs.pop("portable-ref")
    for name, got in outs.items():
        assert torch.equal(got, first), name


def test_the_reference_build_computes_each_familys_simd_bits(checkpoint, monkeypatch):
    if "cpu-fp32-avx2" not in KERNEL_PATHS or "cpu-fp32-ref" not in KERNEL_PATHS:
        pytest.skip(f"needs the AVX2 and the reference paths ({runtime.cpu_kind().describe()})")
    simd = logits_in_pages(load(checkpoint, "cpu-fp32-avx2", monkeypatch).runner, IDS[:130])
    ref = logits_in_pages(load(checkpoint, "cpu-fp32-ref", monkeypatch).runner, IDS[:130])
    assert torch.equal(simd, ref)


def test_greedy_and_seeded_speculation_replay_plain_decoding_in_each_family(checkpoint,
                                                                            monkeypatch):
    path = INT8_PATH or FLOAT_PATH
    if path is None:
        pytest.skip("no kernels path runs here")
    engine = Engine(load(checkpoint, path, monkeypatch), {"ngram": NgramDrafter()})
    prompt = list(b"abcabcabcabd abcabcabcabd abcabc")
    for temperature in (0.0, 0.8):
        cfg = dict(max_new_tokens=40, adaptive=False, draft_len=4, temperature=temperature,
                   seed=3)
        plain = [e.id for e in engine.stream(prompt, GenerateConfig(speculation=False, **cfg))
                 if isinstance(e, TokenEvent)]
        spec = [e.id for e in engine.stream(prompt, GenerateConfig(drafter="ngram", **cfg))
                if isinstance(e, TokenEvent)]
        assert spec == plain and len(plain) == 40


def test_a_family_outside_the_table_is_named_with_the_ones_it_runs():
    from transformers import AutoConfig

    why = families.unsupported(AutoConfig.for_model("granite"))
    assert "granite is not a family it runs" in why and "Llama" in why and "Phi-3" in why
    config = AutoConfig.for_model("llama", partial_rotary_factor=0.5)
    assert "partial RoPE" in families.unsupported(config)
    long = AutoConfig.for_model("phi3", rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48,
        "original_max_position_embeddings": 4096}, max_position_embeddings=131072)
    assert "longrope RoPE" in families.unsupported(long)
    assert "activation" in families.unsupported(AutoConfig.for_model("llama", hidden_act="gelu"))


def test_the_q8_0_head_made_at_load_is_the_gguf_packages_q8_0():
    """`quantize_q8_0` gives the bits of the gguf package's Q8_0 (llama.cpp's reference),
    ties, zero blocks and bf16 weights included."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from specchat.runners.cpu.q8_head import quantize_q8_0

    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    weight[3, :32] = 0  # a block of zeros: scale 0, values 0
    weight[5, :32] = torch.arange(32) - 15.5  # x.5 steps before rounding: ties
    for w in (weight, weight.to(torch.bfloat16)):
        q, d = quantize_q8_0(w, chunk_rows=20)
        want = quantize(w.float().numpy(), GGMLQuantizationType.Q8_0).reshape(48, 3, 34)
        assert np.array_equal(d.numpy().view(np.uint8).reshape(48, 3, 2), want[..., :2])
        assert np.array_equal(q.numpy().view(np.uint8).reshape(48, 3, 32), want[..., 2:])


def test_the_integer_path_runs_each_familys_head_in_q8_0(checkpoint, monkeypatch):
    """On `cpu-int8` the LM head (tied or its own) is a Q8_0 copy of the checkpoint's, run by
    the integer kernel, and the label says so; the float paths keep the checkpoint's head."""
    from specchat.runners.cpu.q8_head import Q8Head, quantize_q8_0

    if INT8_PATH is None or FLOAT_PATH is None:
        pytest.skip("needs an integer and a float kernels path")
    loaded = load(checkpoint, INT8_PATH, monkeypatch)
    head = loaded.model.get_output_embeddings()
    made = vars(head).get("forward")
    assert isinstance(made, Q8Head) and "LM head in Q8_0 (quantized at load)" in loaded.label
    rows = torch.arange(head.weight.shape[0])
    q, d = quantize_q8_0(head.weight)
    want = (q.float().view(len(rows), -1, 32) * d.float()[..., None]).view(len(rows), -1)
    assert torch.equal(made.dequantized(rows), want)
    other = load(checkpoint, FLOAT_PATH, monkeypatch)
    assert not isinstance(vars(other.model.get_output_embeddings()).get("forward"), Q8Head)
    assert "Q8_0" not in other.label
    # The float table (and an untied head's float weight), which nothing reads whole any more,
    # stay in the checkpoint's mapping, read a row at a time; the float head reads its own.
    spans = _file_mappings(str(checkpoint))
    kept = {t.data_ptr(): t for t in (loaded.model.get_input_embeddings().weight, head.weight)}
    assert len(kept) == (1 if loaded.model.config.tie_word_embeddings else 2)
    assert all(any(s <= at < e for s, e in spans) for at in kept)
    table = other.model.get_input_embeddings().weight
    assert not any(s <= table.data_ptr() < e for s, e in _file_mappings(str(checkpoint)))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_draft_model_runs_on_the_same_forward_and_speculation_replays_plain(kind, tmp_path,
                                                                              monkeypatch):
    """`--draft-model` on a CPU: NF4 by default (`--draft-quantization auto`), on specchat's
    own forward with a cache of its own; greedy replies with the `model` drafter are plain
    decoding's. (Sampled drafts keep plain sampling's distribution, not its seeded text: that
    holds for one-hot drafts, tested above with n-gram lookup.)"""
    from specchat.loader import load_engine

    path = INT8_PATH or FLOAT_PATH
    if path is None:
        pytest.skip("no kernels path runs here")
    target = save(tiny_family(kind, seed=1, hidden=256).to(torch.bfloat16), byte_tokenizer(),
                  tmp_path / "target")
    draft = save(tiny_family(kind, seed=2).to(torch.bfloat16), byte_tokenizer(),
                 tmp_path / "draft")
    monkeypatch.setenv(runtime.ENV, path)
    report = load_engine(str(target), str(draft), device="cpu", progress=lambda *a: None)
    assert report.draft is not None and report.draft.quantization == "nf4"
    assert isinstance(report.draft.runner, cpu_runner.CpuRunner)
    drafter = report.engine.drafters["model"]
    assert drafter.runner is report.draft.runner
    prompt = list(b"The draft and the target share a vocabulary. The draft")
    cfg = dict(max_new_tokens=30, adaptive=False, draft_len=3, temperature=0.0)
    plain = [e.id for e in report.engine.stream(prompt, GenerateConfig(speculation=False, **cfg))
             if isinstance(e, TokenEvent)]
    spec = [e.id for e in report.engine.stream(prompt, GenerateConfig(drafter="model", **cfg))
            if isinstance(e, TokenEvent)]
    assert spec == plain and len(plain) == 30


def test_a_fused_layer_runs_split_by_rows_and_its_codes_come_back_whole(tmp_path, monkeypatch):
    """Phi-3's q|k|v and gate|up: the integer path packs each product's rows apart and lets go
    of the module's codes; read again, they come back as bitsandbytes held them, whole."""
    from specchat.runners.nf4 import codes_and_state

    if INT8_PATH is None:
        pytest.skip("no integer path runs here")
    path = save(tiny_family("phi3").to(torch.bfloat16), byte_tokenizer(), tmp_path / "phi3")
    ours = load(path, INT8_PATH, monkeypatch)
    assert isinstance(ours.runner, cpu_runner.CpuRunner)
    theirs = load(path, INT8_PATH, monkeypatch, runner="transformers")
    for name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        mine = ours.model.get_decoder().layers[1].get_submodule(name)
        assert mine.weight.data.numel() == 0, name
        want = vars(theirs.model.get_decoder().layers[1].get_submodule(name))["forward"].codes
        assert torch.equal(codes_and_state(mine)[0], want), name


def test_a_model_the_forward_does_not_run_takes_a_float_path_and_says_why(tmp_path,
                                                                         monkeypatch):
    """The integer products run inside the decoder forward: a Phi-4-mini-like target (Phi-3's
    layers, RoPE on half of each head, which the forward does not run) skips the integer paths,
    with why, instead of a label that claims them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if INT8_PATH is None or FLOAT_PATH is None:
        pytest.skip("needs an integer and a float kernels path")
    config = AutoConfig.for_model("phi3", vocab_size=272, hidden_size=128,
                                  intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2, partial_rotary_factor=0.5)
    torch.manual_seed(0)
    path = save(AutoModelForCausalLM.from_config(config), byte_tokenizer(), tmp_path / "phi3")
    monkeypatch.delenv(runtime.ENV, raising=False)
    loaded = load_model(str(path), "nf4", "cpu", progress=lambda *a: None)
    assert not runtime.BY_NAME[loaded.runtime.path].int8, loaded.runtime.path
    assert any(s.startswith(f"{INT8_PATH}: specchat's decoder forward does not run this model")
               and "partial RoPE" in s for s in loaded.runtime.skipped), loaded.runtime.skipped
