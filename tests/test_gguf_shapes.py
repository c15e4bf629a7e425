"""Real models' shapes as GGUF files of random weights (specchat/bench/gguf_shapes.py): the file
holds llama.cpp's tensors for the shape (names, shapes, types, the shape's vocabulary); specchat
converts it into a checkpoint with the logits of the same random weights quantized and
dequantized; its tokenizer round-trips text; Gemma 3's runs on specchat's C forward on the
integer path as transformers runs it; and llama.cpp, where a build is cached, loads it, counts
the same parameters and tokenizes text as specchat's tokenizer does.

Files are written from tiny configs of each family; the real shapes' tensor tables are checked
from their plans, without writing gigabytes."""

import json
import urllib.request

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from transformers import AutoConfig

from specchat import kernels
from specchat.backends import llama_cpp
from specchat.bench import gguf_shapes
from specchat.bench.gguf_shapes import file_metadata, plan, tensor_values, write_shape
from specchat.models import runtime
from specchat.models.gguf_files import gguf_checkpoint, read_gguf
from specchat.models.synthetic import shape_config
from specchat.runners.cpu.q6_k_head import quantize_q6_k

pytestmark = pytest.mark.usefixtures("one_thread")
LLAMA_BENCH = llama_cpp.cached_tool("llama-bench")  # found before a test moves the cache
LLAMA_SERVER = llama_cpp.cached_tool("llama-server")
# the integer path whose kernels this CPU runs, built (or found) in the real cache, before a
# test moves it: `kernels.load` keeps its build for the process
INT8_PATH = next((p.name for p in runtime.candidates(forced="")
                  if p.int8 and kernels.load(p.kernels) is not None), None)
TEXT = "hello world, the cat sat.\n  Ünïcode ✓ 123"
LAYER = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
         "ffn_up", "ffn_down"}
GEMMA_LAYER = LAYER | {"attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"}
FAMILIES = ["llama", "qwen2", "gemma3_text"]
# each family, and a head of whole Q6_K superblocks (256 wide), untied and tied
WIDTHS = [(family, 64) for family in FAMILIES] + [("llama", 256), ("qwen2", 256)]
ARCH = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}  # general.architecture


def tiny(family: str, **extra):
    """A small config of a family: widths multiples of Q4_0's 32-value blocks, a vocabulary
    with room for unused tokens, Llama's head untied and Qwen's and Gemma's tied as their shapes
    have them. Gemma 3's: six layers (five sliding-window ones, then a global one, llama.cpp's
    pattern) with a window of 8, each head 32 wide with 32 as its attention scalar, one kv
    head, RoPE bases 1e6 (global) and transformers' default 1e4 (local)."""
    shape = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 rope_theta=500000.0, tie_word_embeddings=family != "llama")
    if family == "gemma3_text":
        shape.update(num_hidden_layers=6, num_key_value_heads=1, head_dim=32,
                     query_pre_attn_scalar=32, sliding_window=8, rope_theta=1e6)
    return AutoConfig.for_model(family, **{**shape, **extra})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """specchat's cache for this test alone."""
    monkeypatch.setenv("SPECCHAT_CACHE", str(tmp_path / "cache"))


def tensors_of(config, seed=0, std=0.02) -> dict[str, np.ndarray]:
    """The HF model's parameters as the file holds them once dequantized, by parameter name."""
    out = {}
    for e in plan(config):
        values = np.concatenate([c for _, c in tensor_values(e, seed, std)])
        if e.kind == T.Q6_K:
            values = dequantize(quantize_q6_k(torch.from_numpy(values)).numpy(), T.Q6_K)
        elif e.kind != T.F32:
            values = dequantize(quantize(values, T(e.kind)), T(e.kind))
        out[e.param] = values
    return out


def reference(config, seed=0, std=0.02):
    """The model of the file's weights, rounded to bf16 as the converted checkpoint holds them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    values = tensors_of(config, seed, std)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(values[name]).to(torch.bfloat16).float())
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_the_file_holds_llama_cpps_tensors_for_the_shape(family, tmp_path):
    config = tiny(family)
    header = read_gguf(write_shape(config, tmp_path / "tiny.gguf", name="tiny"))
    meta, arch, layers = header.metadata, ARCH[family], config.num_hidden_layers
    assert header.arch == arch
    assert meta["tokenizer.ggml.tokens"] == config.vocab_size  # its length
    assert meta["general.file_type"] == 2  # mostly Q4_0
    assert meta[f"{arch}.block_count"] == layers and meta[f"{arch}.embedding_length"] == 64
    bias = {"attn_q.bias", "attn_k.bias", "attn_v.bias"} if family == "qwen2" else set()
    names = GEMMA_LAYER if family == "gemma3_text" else LAYER
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{t}" for i in range(layers) for t in {f"{n}.weight" for n in names} | bias}
    if family == "llama":
        expected.add("output.weight")  # untied
    assert set(header.tensors) == expected
    t = header.tensors
    kv = config.num_key_value_heads * (getattr(config, "head_dim", None) or 16)
    assert t["token_embd.weight"].shape == (400, 64) and t["token_embd.weight"].kind == T.Q8_0
    assert t["blk.1.attn_k.weight"].shape == (kv, 64) and t["blk.1.attn_k.weight"].kind == T.Q4_0
    assert t["blk.0.ffn_down.weight"].shape == (64, 128)
    assert t["blk.0.ffn_down.weight"].kind == T.Q4_0
    assert all(v.kind == T.F32 for k, v in t.items() if len(v.shape) == 1)
    if family == "llama":
        assert t["output.weight"].kind == T.Q8_0


@pytest.mark.parametrize("shape, vocab, layers, head", [
    ("llama-3.2-1b", 128256, 16, None), ("llama-3.1-8b", 128256, 32, (128256, 4096)),
    ("qwen2.5-0.5b", 151936, 24, None), ("qwen2.5-1.5b", 151936, 28, None),
    ("gemma-3-1b", 262144, 26, None)])
def test_a_real_shapes_file_plans_its_own_tensors_and_vocabulary(shape, vocab, layers, head):
    config = shape_config(shape)
    entries = {e.name: e for e in plan(config)}
    per_layer = len(GEMMA_LAYER if shape.startswith("gemma") else LAYER) + (
        3 if shape.startswith("qwen") else 0)
    assert len(entries) == 2 + per_layer * layers + (head is not None)
    assert entries["token_embd.weight"].shape == (vocab, config.hidden_size)
    assert ("output.weight" in entries) == (head is not None)
    if head:
        assert entries["output.weight"].shape == head
    # the head in Q6_K as llama-quantize writes a Q4_0 file's, or Q8_0 where its rows are not
    # whole superblocks (Qwen 2.5 0.5B's 896, Gemma 3 1B's 1152); an untied embedding Q8_0
    head_kind = T.Q6_K if config.hidden_size % 256 == 0 else T.Q8_0
    assert entries["output.weight" if head else "token_embd.weight"].kind == head_kind
    if head:
        assert entries["token_embd.weight"].kind == T.Q8_0
    assert entries["blk.0.ffn_up.weight"].shape == (config.intermediate_size, config.hidden_size)
    keys = file_metadata(config, shape)
    tokens = keys["tokenizer.ggml.tokens"]
    assert len(tokens) == vocab and len(set(tokens)) == vocab
    pre = {"qwen": "qwen2", "llama": "llama-bpe", "gemma": "default"}
    assert keys["tokenizer.ggml.pre"] == next(v for k, v in pre.items() if shape.startswith(k))
    assert tokens[keys["tokenizer.ggml.eos_token_id"]] in ("<|eot_id|>", "<|im_end|>", "<eos>")


def test_the_race_and_the_writer_offer_every_shape_and_refuse_others(capsys):
    from specchat.models.synthetic import SHAPES

    assert set(gguf_shapes.SHAPE_FAMILIES) == set(SHAPES)
    for argv in (["race", "--help"], ["--help"]):
        with pytest.raises(SystemExit):
            gguf_shapes.main(argv)
        assert "gemma-3-1b" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gguf_shapes.main(["race", "--shape", "gemma-3-27b"])
    assert "invalid choice: 'gemma-3-27b'" in capsys.readouterr().err


def test_gemma_3_1bs_file_holds_what_llama_cpps_gemma3_loader_reads():
    """llama.cpp's gemma3 loader reads the sliding window and the norm's epsilon and fixes the
    rest (every 6th layer global, the local RoPE base 1e4, the attention scale 1/sqrt(head
    width) below 27B): the file's keys and norms are those of the model transformers' config
    describes, its vocabulary SentencePiece as Gemma's files hold it."""
    config = shape_config("gemma-3-1b")
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 4 + \
        ["sliding_attention"] * 2
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert config.query_pre_attn_scalar == config.head_dim == 256
    assert config.final_logit_softcapping is None and config.attn_logit_softcapping is None
    keys = file_metadata(config, "gemma-3-1b")
    assert {k: keys[k] for k in keys if k.startswith("gemma3.")} == {
        "gemma3.context_length": 32768, "gemma3.embedding_length": 1152,
        "gemma3.block_count": 26, "gemma3.feed_forward_length": 6912,
        "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256, "gemma3.attention.value_length": 256,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.rope.freq_base": 1e6,
        "gemma3.attention.sliding_window": 512}
    assert keys["tokenizer.ggml.model"] == "llama" and keys["tokenizer.ggml.add_bos_token"]
    tokens = keys["tokenizer.ggml.tokens"]
    assert tokens[keys["tokenizer.ggml.bos_token_id"]] == "<bos>" and "<end_of_turn>" in tokens
    assert len(keys["tokenizer.ggml.scores"]) == len(tokens) == 262144
    norms = [e for e in plan(config) if e.name.endswith("norm.weight")]
    assert len(norms) == 6 * 26 + 1 and all(e.plus_one for e in norms)
    stored = gguf_shapes.tensor_bytes(norms[0], config)  # llama.cpp's 1 + w, w near 0
    held = next(tensor_values(norms[0]))[1]
    assert np.array_equal(stored, held + 1) and abs(held).max() <= 8 / 64


@pytest.mark.parametrize("family,width", WIDTHS)
def test_specchat_converts_it_to_the_logits_of_the_dequantized_weights(family, width, tmp_path,
                                                                       cache):
    from transformers import AutoModelForCausalLM

    config = tiny(family, hidden_size=width)
    std = 0.2  # attention far from uniform: a q/k row order gone wrong shows
    path = write_shape(config, tmp_path / "tiny.gguf", seed=5, std=std)
    ours = AutoModelForCausalLM.from_pretrained(gguf_checkpoint(path, lambda _: None),
                                                dtype=torch.float32).eval()
    ids = torch.tensor([[399, 104, 101, 108, 108, 111, 270, 262, 11, 3, 40, 77, 150, 200, 33]])
    with torch.no_grad():
        got, want = ours(ids).logits, reference(config, seed=5, std=std)(ids).logits
    assert torch.equal(got, want)
    with torch.no_grad():  # another seed's weights give other logits: the seed is in the file
        other = reference(config, seed=6, std=std)(ids).logits
    assert not torch.allclose(got, other, atol=1e-2)


@pytest.mark.parametrize("family", FAMILIES)
def test_its_tokenizer_round_trips_text(family, tmp_path, cache):
    from transformers import AutoTokenizer

    config = tiny(family)
    path = write_shape(config, tmp_path / "tiny.gguf")
    tokenizer = AutoTokenizer.from_pretrained(gguf_checkpoint(path, lambda _: None))
    tokens = file_metadata(config, "tiny")["tokenizer.ggml.tokens"]
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT
    world = "▁world" if family == "gemma3_text" else "Ġworld"
    assert tokens.index(world) in ids and tokens.index("hello") in ids  # merges applied
    assert all(not tokens[i].startswith("[PAD") for i in ids)
    end = {"llama": "<|eot_id|>", "qwen2": "<|im_end|>", "gemma3_text": "<end_of_turn>"}[family]
    assert tokenizer.convert_tokens_to_ids(end) == tokens.index(end) < config.vocab_size
    assert len(tokenizer) == config.vocab_size


@pytest.mark.skipif(LLAMA_BENCH is None, reason="no llama.cpp build cached (python -m "
                    "specchat.backends.llama_cpp build)")
@pytest.mark.parametrize("family,width", WIDTHS)
def test_llama_bench_loads_it_and_counts_the_same_parameters(family, width, tmp_path):
    config = tiny(family, hidden_size=width)
    path = write_shape(config, tmp_path / "tiny.gguf")
    results, _ = llama_cpp.llama_bench(LLAMA_BENCH, path, prompts=(8,), gen=4, threads=1,
                                       repetitions=1)
    assert {(r["n_prompt"], r["n_gen"]) for r in results} == {(8, 0), (0, 4)}
    assert all(r["avg_ts"] > 0 for r in results)
    params = sum(int(np.prod(e.shape)) for e in plan(config))
    assert results[0]["model_n_params"] == params
    assert results[0]["model_size"] == sum(t.size for t in read_gguf(path).tensors.values())
    assert gguf_shapes.llama_read_bytes(path) == results[0]["model_size"] - (
        0 if config.tie_word_embeddings else read_gguf(path).tensors["token_embd.weight"].size)


@pytest.mark.skipif(LLAMA_SERVER is None, reason="no llama.cpp build cached (python -m "
                    "specchat.backends.llama_cpp build)")
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_server_tokenizes_as_specchats_tokenizer(family, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    path = write_shape(tiny(family), tmp_path / "tiny.gguf")
    with llama_cpp.LlamaServer(LLAMA_SERVER, path, port=8097, threads=1, context=256) as url:
        request = urllib.request.Request(f"{url}/tokenize", method="POST",
                                         data=json.dumps({"content": TEXT}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            theirs = json.loads(r.read())["tokens"]
    monkeypatch.setenv("SPECCHAT_CACHE", str(tmp_path / "cache"))
    tokenizer = AutoTokenizer.from_pretrained(gguf_checkpoint(path, lambda _: None))
    assert tokenizer.encode(TEXT, add_special_tokens=False) == theirs


@pytest.mark.skipif(INT8_PATH is None, reason="no integer CPU path runs here")
def test_gemmas_file_runs_on_the_c_forward_as_transformers_runs_it(tmp_path, monkeypatch):
    """Gemma 3's file converted, then loaded as NF4 on the integer path: specchat's C decoder
    forward takes it (family gemma3_text), proves row-exact at load, and computes what
    transformers' forward computes on the same weights, within the int8 roundings of
    activations and NF4's table (as tests/test_cpu_families.py bounds them), past the window
    and through the global layer."""
    from specchat import runners
    from specchat.models.load import load_model
    from specchat.runners.cpu.runner import CpuRunner

    config = tiny("gemma3_text")
    path = write_shape(config, tmp_path / "tiny.gguf", seed=5)
    with monkeypatch.context() as m:  # the conversion in a cache of its own; the kernels' build
        m.setenv("SPECCHAT_CACHE", str(tmp_path / "cache"))  # stays the real cache's
        checkpoint = gguf_checkpoint(path, lambda _: None)
    monkeypatch.setenv(runtime.ENV, INT8_PATH)
    monkeypatch.delenv(runners.CPU_RUNNER_ENV, raising=False)
    loaded = load_model(str(checkpoint), "nf4", "cpu", progress=lambda *a: None)
    assert loaded.model.config.model_type == "gemma3_text"
    assert isinstance(loaded.runner, CpuRunner) and "decoder forward" in loaded.label
    assert loaded.runtime.path == INT8_PATH and loaded.runtime.row_exact, loaded.runtime.proof
    ids = [(7 + 37 * i) % 390 + 6 for i in range(40)]  # five windows of 8
    got = loaded.runner.forward(loaded.runner.new_cache(), ids, 0, len(ids))
    runners.use_transformers_forward(loaded)  # the same weights, on transformers' forward
    want = loaded.runner.forward(loaded.runner.new_cache(), ids, 0, len(ids))
    assert (got - want).norm() <= 0.04 * want.norm(), (got - want).norm() / want.norm()
    assert got[-1].argmax() == want[-1].argmax()
