"""A user's GGUF file as --target or --draft-model (models/gguf_files.py): each family converts
into a checkpoint with the logits of the model the file was made from, the file's tokenizer and
chat template; a second use finds it in the cache; a bad file is refused, named, with what is
wrong, and leaves nothing in the cache.

The files are written here (tests/gguf_writer.py) from tiny random HF models as llama.cpp's
convert_hf_to_gguf.py writes them (Llama's q/k permuted, Gemma's norms as 1 + w, RoPE scaling
as llama.cpp stores it): the reference is the model a file came from, its weights rounded to
bf16 as the checkpoint stores them."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_writer import (
    CHAT_TEMPLATE,
    GEMMA_TEMPLATE,
    llama3_rope_freqs,
    permute,
    rounded,
    tiny_model,
    vocab_size,
    write_gguf,
)

from specchat.models import gguf_files
from specchat.models.gguf_files import (
    gguf_checkpoint,
    is_gguf,
    llama3_rope_scaling,
    model_file,
)
from specchat.models.loaded import ModelLoadError

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent
IDS = torch.tensor([[276, 104, 101, 108, 108, 111, 259, 262, 273, 11, 3, 40, 77, 150, 200, 33,
                     9, 18, 99, 275, 240, 120, 64, 5]])  # [1, 24] token ids every vocabulary has
FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """specchat's cache for this test alone."""
    monkeypatch.setenv("SPECCHAT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits  # [1, 24, vocab]


def converted(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_checkpoint(path, lambda _: None),
                                                dtype=torch.float32).eval()


def quiet(path: Path) -> Path:
    return gguf_checkpoint(path, lambda _: None)


@pytest.mark.parametrize("arch", FAMILIES)
def test_each_family_converts_to_the_logits_of_the_model_it_came_from(arch, tmp_path):
    model = tiny_model(arch)
    ours = converted(write_gguf(tmp_path / f"tiny-{arch}.gguf", model))
    assert type(ours) is type(model)
    assert torch.equal(logits(ours), logits(rounded(model)))
    tied = ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    assert tied == model.config.tie_word_embeddings


def test_llamas_q_and_k_rows_are_put_back_in_hf_order(tmp_path):
    """The file's rows taken as they are give other logits: the comparison above sees whether
    llama.cpp's permutation was undone."""
    model = tiny_model("llama")
    ours = converted(write_gguf(tmp_path / "tiny.gguf", model))
    cfg = model.config
    with torch.no_grad():
        for layer in ours.model.layers:
            q, k = layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight
            q.copy_(torch.from_numpy(permute(q.numpy(), cfg.num_attention_heads,
                                             cfg.num_attention_heads)))
            k.copy_(torch.from_numpy(permute(k.numpy(), cfg.num_attention_heads,
                                             cfg.num_key_value_heads)))
    assert (logits(ours) - logits(rounded(model))).abs().max() > 0.05


def test_a_llama_file_named_mistral_runs_as_llama_cpp_runs_it(tmp_path):
    """llama.cpp writes Mistral 7B as "llama" and runs it so (no sliding window); transformers
    renames a file named "mistral" to a Mistral config, where a Llama one is what ran."""
    model = tiny_model("llama")
    ours = converted(write_gguf(tmp_path / "mistral.gguf", model, name="mistral"))
    assert ours.config.model_type == "llama"
    assert torch.equal(logits(ours), logits(rounded(model)))


# What the checkpoint's config says where transformers' own GGUF config says otherwise: what
# llama.cpp reads from the file (Qwen 3's head width, Gemma's attention scale) or leaves unset.
LLAMA_CPP_FIELDS = {"llama": set(), "qwen2": set(), "qwen3": {"head_dim"},
                    "gemma2": {"query_pre_attn_scalar"}, "gemma3": {"query_pre_attn_scalar"},
                    "phi3": {"pad_token_id"}}


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_config_is_transformers_gguf_config_but_for_what_llama_cpp_reads(arch, tmp_path):
    from transformers import AutoConfig

    model = tiny_model(arch)
    file = write_gguf(tmp_path / "tiny.gguf", model)
    ours = AutoConfig.from_pretrained(quiet(file)).to_dict()
    theirs = AutoConfig.from_pretrained(tmp_path, gguf_file=file.name).to_dict()
    # what saving adds, and where each was read from
    records = {"architectures", "dtype", "transformers_version", "_name_or_path"}
    differ = {k for k in ours.keys() | theirs.keys()
              if k not in records and ours.get(k) != theirs.get(k)}
    assert differ == LLAMA_CPP_FIELDS[arch]
    original = model.config.to_dict()
    assert {k: ours[k] for k in differ} == {k: original[k] for k in differ}
    assert ours["dtype"] == "bfloat16" and ours["architectures"] == [type(model).__name__]


@pytest.mark.parametrize("theta, head_dim, factor, low, high, original", [
    (500000.0, 128, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 8B and 70B, 3.3
    (500000.0, 64, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B
    (500000.0, 128, 16.0, 1.0, 2.5, 4096),  # other constants: fitted
    (10000.0, 128, 4.0, 2.0, 8.0, 16384),  # the same frequencies as Meta's constants give
])
def test_llama3_rope_scaling_is_read_back_from_rope_freqs(theta, head_dim, factor, low, high,
                                                          original):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def frequencies(scaling):
        config = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
                             max_position_embeddings=1 << 20, rope_theta=theta,
                             rope_scaling=dict(scaling))
        return ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]

    stored = llama3_rope_freqs(theta, head_dim, factor, low, high, original)
    scaling = llama3_rope_scaling(stored, theta, head_dim)
    assert scaling["factor"] == factor and scaling["rope_type"] == "llama3"
    truth = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
             "high_freq_factor": high, "original_max_position_embeddings": original}
    torch.testing.assert_close(frequencies(scaling), frequencies(truth), rtol=1e-5, atol=0)
    if (low, high, original) in ((1.0, 4.0, 8192), (1.0, 2.5, 4096)):
        assert scaling == truth


def test_a_rope_freqs_tensor_that_is_not_llama3s_is_refused():
    factors = np.linspace(1, 3, 64).astype(np.float32) ** 2  # no flat ends, no linear middle
    with pytest.raises(ModelLoadError, match="not Llama 3's RoPE scaling"):
        llama3_rope_scaling(factors, 500000.0, 128, "odd.gguf")
    assert llama3_rope_scaling(np.ones(64, np.float32), 500000.0, 128) is None


@pytest.mark.parametrize("arch, config", [
    ("llama", dict(max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})),  # rope_freqs.weight
    ("phi3", dict(max_position_embeddings=4096, original_max_position_embeddings=512,
                  rope_scaling={"rope_type": "longrope",
                                "long_factor": [1.0 + i for i in range(8)],
                                "short_factor": [1.0 + i / 4 for i in range(8)]})),
    ("phi3", dict(partial_rotary_factor=0.5)),  # Phi-4-mini's rotary width below the head's
    ("gemma3", dict(rope_scaling={"rope_type": "linear", "factor": 8.0})),  # Gemma 3 4B+
])
def test_rope_scaling_and_rotary_width_come_from_the_file(arch, config, tmp_path):
    model = tiny_model(arch, **config)
    ours = converted(write_gguf(tmp_path / "tiny.gguf", model))
    want = model.config.rope_parameters
    have = ours.config.rope_parameters
    if arch == "gemma3":
        want, have = want["full_attention"], have["full_attention"]
    assert {k: have.get(k) for k in want} == want
    assert torch.equal(logits(ours), logits(rounded(model)))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_the_tokenizer_and_chat_template_are_the_files(arch, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    model = tiny_model(arch)
    file = write_gguf(tmp_path / "tiny.gguf", model)
    out = quiet(file)
    ours = AutoTokenizer.from_pretrained(out)
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    texts = ["hello world, the cat sat", "Grüße aus Köln: naïve café", "日本語のテキスト 🙂🚀",
             "  two spaces,\ttabs\tand\n\nnewlines  ", "\x00\x7f bytes",
             "<|eot_id|> <end_of_turn> as text"]
    for text in texts:
        ids = ours(text, add_special_tokens=False)["input_ids"]
        assert ids == reference(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids) == text
    assert ours.chat_template == (GEMMA_TEMPLATE if arch == "gemma3" else CHAT_TEMPLATE)
    assert [ours.bos_token_id, ours.eos_token_id] == \
        [model.config.bos_token_id, model.config.eos_token_id]
    # No token past the model's rows (transformers' byte-level builder adds GPT-2's own).
    assert len(ours) == vocab_size(arch) == model.config.vocab_size
    end_of_turn = "<end_of_turn>" if arch == "gemma3" else "<|eot_id|>"
    ends = GenerationConfig.from_pretrained(out).eos_token_id
    assert ours.convert_tokens_to_ids(end_of_turn) in (ends if isinstance(ends, list) else [ends])
    prompt = ours.apply_chat_template([{"role": "user", "content": "hi"}],
                                      add_generation_prompt=True, tokenize=False)
    turn = "<start_of_turn>model\n" if arch == "gemma3" else \
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert prompt.startswith(ours.bos_token) and prompt.endswith(turn)


def test_a_second_use_finds_the_checkpoint_without_converting(tmp_path):
    from specchat.models.load import resolve

    file = write_gguf(tmp_path / "tiny.gguf", tiny_model("llama"))
    said = []
    out = Path(resolve(str(file), said.append))
    assert said == [gguf_files.CONVERTING.format(name="tiny.gguf")]
    assert out.parent.name == "models" and out.name.startswith("gguf-tiny-")
    written = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert Path(resolve(str(file), said.append)) == out
    assert Path(resolve(str(tmp_path), said.append)) == out  # the folder: the same file
    assert len(said) == 1 and {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == written
    assert not list(out.parent.glob("*.tmp-*"))
    stat = file.stat()
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file changed
    assert Path(resolve(str(file), said.append)) != out and len(said) == 2


def test_a_folder_gives_its_one_model_file_and_refuses_several(tmp_path):
    file = write_gguf(tmp_path / "tiny.gguf", tiny_model("llama"))
    shutil.copy(file, tmp_path / "mmproj-tiny-f16.gguf")  # a vision projector beside it
    (tmp_path / "config.json").write_text("{}")  # the base model's, as some GGUF repos carry
    assert is_gguf(tmp_path) and model_file(tmp_path) == file
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("config.json", "model.safetensors", "extra.gguf"):
        (hf / name).write_bytes(b"{}")
    assert not is_gguf(hf)  # a checkpoint directory, whatever else it holds
    shutil.copy(file, tmp_path / "other.gguf")
    with pytest.raises(ModelLoadError, match="several GGUF models") as e:
        model_file(tmp_path)
    assert "other.gguf" in str(e.value) and "tiny.gguf" in str(e.value)
    only = tmp_path / "projector"
    only.mkdir()
    shutil.copy(file, only / "mmproj-tiny-f16.gguf")
    with pytest.raises(ModelLoadError, match="holds no model GGUF"):
        model_file(only)


def _tiny(tmp_path, **kw) -> Path:
    return write_gguf(tmp_path / "tiny.gguf", tiny_model("llama"), **kw)


def _cut(tmp_path, keep) -> Path:
    file = _tiny(tmp_path)
    data = file.read_bytes()
    file.write_bytes(data[:keep(len(data))])
    return file


def _renamed(tmp_path, name) -> Path:
    return _tiny(tmp_path).rename(tmp_path / name)


def _type_patched(tmp_path) -> Path:
    """token_embd.weight's type number in the tensor table set to 99."""
    file = _tiny(tmp_path)
    data = bytearray(file.read_bytes())
    name = b"token_embd.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    data[at + 4 + 8 * n_dims:at + 8 + 8 * n_dims] = (99).to_bytes(4, "little")
    file.write_bytes(bytes(data))
    return file


def _not_gguf(tmp_path) -> Path:
    file = tmp_path / "tiny.gguf"
    file.write_bytes(b"PK\x03\x04" + bytes(4096))  # a zip archive's start
    return file


BAD_FILES = {
    "architecture": (lambda p: _tiny(p, architecture="mamba"),
                     ["architecture 'mamba' is not supported",
                      "llama, qwen2, qwen3, gemma2, gemma3, phi3"]),
    "split by name": (lambda p: _renamed(p, "tiny-00001-of-00003.gguf"),
                      ["split GGUF", "llama-gguf-split --merge tiny-00001-of-00003.gguf"]),
    "split by metadata": (lambda p: _tiny(p, metadata={"split.count": 3, "split.no": 0}),
                          ["split GGUF", "llama-gguf-split --merge"]),
    "truncated data": (lambda p: _cut(p, lambda n: n - 100),
                       ["is truncated: tensor", "past the file's end"]),
    "truncated header": (lambda p: _cut(p, lambda n: 300),
                         ["is truncated or corrupt"]),
    "not a GGUF": (_not_gguf, ["is not a GGUF file", "take a GGUF file"]),
    "unknown tensor type": (_type_patched, ["token_embd.weight has ggml type 99"]),
    "no dequantizer": (lambda p: _tiny(p, extra={"extra.weight": np.zeros(32, np.float64)}),
                       ["holds F64 tensors", "cannot dequantize"]),
    "a weight missing": (lambda p: _tiny(p, drop=("blk.1.ffn_up.weight",)),
                         ["the file lacks: model.layers.1.mlp.up_proj.weight"]),
    "a tensor with no place": (lambda p: _tiny(p, extra={
        "blk.0.attn_qkv.weight": np.zeros((128, 64), np.float32)}),
        ["no place for: blk.0.attn_qkv.weight"]),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_file_is_refused_by_name_and_leaves_nothing_in_the_cache(case, tmp_path, cache):
    make, phrases = BAD_FILES[case]
    file = make(tmp_path)
    with pytest.raises(ModelLoadError) as e:
        quiet(file)
    message = str(e.value)
    assert file.name in message
    for phrase in phrases:
        assert phrase in message
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())


def test_quantized_and_half_tensors_convert_as_the_gguf_package_dequantizes_them(tmp_path):
    """Every tensor type of the files users have (Q4_K_M is Q4_K and Q6_K, Q5_K_M Q5_K and
    Q6_K): each weight is the gguf package's dequantized value, rounded to bf16."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from safetensors.torch import load_file

    model = tiny_model("llama", hidden_size=256, intermediate_size=256)
    kinds = {"token_embd.weight": T.Q8_0, "output.weight": T.Q6_K,
             "blk.0.attn_q.weight": T.Q4_0, "blk.0.attn_k.weight": T.F16,
             "blk.0.attn_v.weight": T.BF16, "blk.0.attn_output.weight": T.Q8_0,
             "blk.0.ffn_gate.weight": T.Q4_K, "blk.0.ffn_up.weight": T.Q5_K,
             "blk.0.ffn_down.weight": T.Q6_K}
    file = write_gguf(tmp_path / "tiny.gguf", model, kinds=kinds)
    weights = load_file(quiet(file) / "model.safetensors")
    names = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
             "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
             "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
             "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
             "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight"}
    seen = set()
    for tensor in gguf.GGUFReader(str(file)).tensors:
        seen.add(tensor.tensor_type.name)
        if tensor.name in names:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            expected = torch.from_numpy(values.reshape(weights[names[tensor.name]].shape))
            assert torch.equal(weights[names[tensor.name]], expected.to(torch.bfloat16)), \
                tensor.name
    # q and k, stored permuted: the model's rows back, as the file's blocks round them
    attention = model.model.layers[0].self_attn
    for kind, hf, weight in ((T.Q4_0, "q_proj", attention.q_proj.weight),
                             (T.F16, "k_proj", attention.k_proj.weight)):
        stored = gguf.quants.quantize(weight.detach().numpy(), kind)
        values = gguf.quants.dequantize(stored, kind)  # row blocks: rows permute freely
        assert torch.equal(weights[f"model.layers.0.self_attn.{hf}.weight"],
                           torch.from_numpy(values).to(torch.bfloat16)), hf
    assert seen == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"}


def test_a_model_larger_than_a_shard_is_written_in_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_files, "SHARD_BYTES", 40_000)
    model = tiny_model("qwen2")
    file = write_gguf(tmp_path / "tiny.gguf", model)
    out = quiet(file)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == set(model.state_dict()) - {"lm_head.weight"}  # tied
    ours = converted(file)
    assert torch.equal(logits(ours), logits(rounded(model)))


def test_generate_runs_with_a_gguf_file_as_target_and_draft(tmp_path):
    file = write_gguf(tmp_path / "tiny.gguf", tiny_model("llama"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
           "SPECCHAT_CACHE": str(tmp_path / "cache"),
           "SPECCHAT_CPU_PATH": "cpu-fp32-dense"}  # no kernels to build in a fresh cache
    proc = subprocess.run([sys.executable, "-m", "specchat", "generate", "--target", str(file),
                           "--draft-model", str(file), "--prompt", "hi",
                           "--max-new-tokens", "4", "--json"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout.splitlines()[-1])
    assert stats["type"] == "stats" and 1 <= stats["new_tokens"] <= 4
    assert stats["target"].startswith(str(file)) and stats["drafter"] == "model"
    assert proc.stderr.count("Converting tiny.gguf") == 1  # the draft found the target's
    assert len(list((tmp_path / "cache" / "models").glob("gguf-tiny-*"))) == 1


@pytest.mark.parametrize("arch,head", [("llama", "output.weight"), ("qwen2", "token_embd.weight")])
def test_a_q8_0_head_runs_as_the_file_holds_it(arch, head, tmp_path, monkeypatch):
    """A file's Q8_0 LM head (its own, or the embedding it is tied to) is the CPU head's: the
    file's int8 values and fp16 scales, not their bf16 rounding quantized again; a head of
    another type is not taken for one."""
    from gguf import GGMLQuantizationType as T

    from specchat.models import runtime
    from specchat.models.gguf_head import read_q8_0
    from specchat.models.load import load_model
    from specchat.runners.cpu.q8_head import Q8Head

    pytest.importorskip("bitsandbytes")
    path = next((p.name for p in runtime.candidates(forced="") if p.int8), None)
    if path is None:
        pytest.skip("no integer path runs here")
    monkeypatch.setenv(runtime.ENV, path)
    model = tiny_model(arch, hidden_size=256, intermediate_size=256)
    file = write_gguf(tmp_path / f"{arch}.gguf", model, kinds={head: T.Q8_0})
    loaded = load_model(str(file), "nf4", "cpu", progress=lambda *a: None)
    assert "LM head from the GGUF's Q8_0" in loaded.label, loaded.label
    made = vars(loaded.model.get_output_embeddings())["forward"]
    q, d = read_q8_0(file, head)
    assert isinstance(made, Q8Head)
    assert torch.equal(made.dequantized(torch.arange(len(q))),
                       q.float() * d.float().repeat_interleave(32, 1))

    other = write_gguf(tmp_path / f"{arch}-q4.gguf", model, kinds={head: T.Q4_0})
    loaded = load_model(str(other), "nf4", "cpu", progress=lambda *a: None)
    assert "GGUF's Q8_0" not in loaded.label, loaded.label


@pytest.mark.parametrize("arch,head", [("llama", "output.weight"), ("qwen2", "token_embd.weight")])
def test_a_q6_k_head_runs_as_the_file_holds_it(arch, head, tmp_path, monkeypatch):
    """A file's Q6_K LM head (the type llama-quantize gives the head of Q4_K_M and Q4_0 files)
    is the CPU head's in its own 6.56 bits a weight, not a Q8_0 copy: its values are the gguf
    package's dequantization of the file's bytes, a step reads those bytes, and greedy and
    seeded speculation replay plain decoding."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    from specchat.core.engine import Engine
    from specchat.core.events import TokenEvent
    from specchat.core.request import GenerateConfig
    from specchat.drafters.ngram import NgramDrafter
    from specchat.models import runtime
    from specchat.models.gguf_files import read_gguf
    from specchat.models.load import load_model
    from specchat.runners.cpu.q6_k_head import Q6KHead

    pytest.importorskip("bitsandbytes")
    path = next((p.name for p in runtime.candidates(forced="") if p.int8), None)
    if path is None:
        pytest.skip("no integer path runs here")
    monkeypatch.setenv(runtime.ENV, path)
    model = tiny_model(arch, hidden_size=256, intermediate_size=256)
    file = write_gguf(tmp_path / f"{arch}.gguf", model, kinds={head: T.Q6_K})
    loaded = load_model(str(file), "nf4", "cpu", progress=lambda *a: None)
    assert "LM head from the GGUF's Q6_K" in loaded.label, loaded.label
    made = vars(loaded.model.get_output_embeddings())["forward"]
    assert isinstance(made, Q6KHead)
    tensor = read_gguf(file).tensors[head]
    raw = np.fromfile(file, np.uint8, tensor.size, offset=tensor.start)
    values = dequantize(raw.reshape(tensor.shape[0], -1), T.Q6_K)
    assert np.array_equal(made.dequantized(torch.arange(tensor.shape[0])).numpy(), values)
    assert made.q.nbytes == tensor.size  # read in the file's bytes: 210 for 256 values
    assert loaded.runner.bytes_per_token < sum(t.nbytes for t in loaded.runner._weights) \
        + tensor.shape[0] * tensor.shape[1]  # less than an 8-bit head would add

    engine = Engine(loaded, {"ngram": NgramDrafter()})
    prompt = list(b"abcabcabcabd abcabcabcabd abcabc")
    for temperature in (0.0, 0.8):
        cfg = dict(max_new_tokens=24, adaptive=False, draft_len=4, temperature=temperature,
                   seed=3)
        plain = [e.id for e in engine.stream(prompt, GenerateConfig(speculation=False, **cfg))
                 if isinstance(e, TokenEvent)]
        spec = [e.id for e in engine.stream(prompt, GenerateConfig(drafter="ngram", **cfg))
                if isinstance(e, TokenEvent)]
        assert spec == plain and len(plain) == 24
