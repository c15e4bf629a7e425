"""The embedded target's GGUF conversion (models/embedded.py) makes the checkpoint that
transformers' own GGUF loading makes: the same config, the same bf16 weights, the same tokenizer.

A tiny Gemma 3 GGUF written here (every tensor type the embedded file uses) is compared file by
file; the real file's tokenizer is compared on text in several scripts, special and control
tokens and the chat format's stop strings (`slow`, as it loads the real vocabulary)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specchat.models.embedded import convert_gguf
from specchat.models.gguf_files import dequantize, read_gguf

# Tokens of the tiny vocabulary: Gemma's special ones first, as in the real file, then byte
# fallbacks, then pieces (one of them a run of real spaces, which Gemma's files store as is).
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]", "<unused0>",
           "<start_of_turn>", "<end_of_turn>"]
PIECES = ["▁", "a", "b", "c", "H", "e", "l", "o", "\n", "▁a", "ab", "▁ab", "ll", "He", "llo",
          "Hello", "▁Hello", "  ", "User", ":", "▁User", "▁User:"]
CONTROL, USER_DEFINED, NORMAL, BYTE = 3, 4, 1, 6

SAMPLES = [
    "Hello, world!",
    "Grüße aus Köln: naïve café, Ærøskøbing",
    "日本語のテキストと、中文的句子。",
    "Привет, мир! Ελληνικά. עברית ומילים.",
    "مرحبا بالعالم",
    "emoji 🙂🚀 and a ZWJ family 👩‍👩‍👧",
    "  leading spaces,\ttabs\tand\n\nnewlines   ",
    "def f(x):\n    return x ** 2  # code\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><unk><mask>[multimodal]<unused0><unused99><start_of_image>",
    "\nUser: hello\nAssistant:",
    "1234567890 3.14159 1e-6",
    "\x00\x01\x7f bytes without pieces",
]


def transformers_conversion(gguf: Path, out: Path) -> None:
    """The reference: the GGUF loaded by transformers itself (`gguf_file=`), its config freed
    of the GGUF's quantization entry, saved in bf16 with the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    config = AutoConfig.for_model(**{k: v for k, v in model.config.to_dict().items()
                                     if k != "quantization_config"})
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(model.state_dict(), strict=False)
    clean.tie_weights()
    clean.to(torch.bfloat16)
    clean.save_pretrained(out)
    tokenizer.save_pretrained(out)


def assert_same_checkpoint(ours: Path, reference: Path) -> None:
    """Byte for byte, but for two entries of tokenizer_config.json that only record how
    `from_pretrained` found the files."""
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in reference.iterdir())
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "model.safetensors"):
        assert (ours / name).read_bytes() == (reference / name).read_bytes(), name
    ignored = ("is_local", "local_files_only")
    ours_config, reference_config = (
        {k: v for k, v in json.loads((d / "tokenizer_config.json").read_text()).items()
         if k not in ignored} for d in (ours, reference))
    assert ours_config == reference_config


def assert_same_tokenizer(ours, reference, texts) -> None:
    """The same ids, pieces and text back for every sample, with and without BOS, and the same
    special tokens."""
    assert len(ours) == len(reference)
    assert ours.all_special_tokens == reference.all_special_tokens
    assert [ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id] == \
        [reference.bos_token_id, reference.eos_token_id, reference.pad_token_id,
         reference.unk_token_id]
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == \
        {i: (t.content, t.special) for i, t in reference.added_tokens_decoder.items()}
    for text in texts:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == reference(text, add_special_tokens=special)["input_ids"], text
            assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == \
                    reference.decode(ids, skip_special_tokens=skip), text


def tiny_gemma3_gguf(path: Path) -> None:
    """A 2-layer Gemma 3 GGUF with a 287-token vocabulary, its tensors in each type the
    embedded file has (F32 norms, Q8_0 embedding, Q5_0, Q4_K and Q6_K projections)."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    rng = np.random.default_rng(0)
    tokens = SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [CONTROL] * len(SPECIAL) + [BYTE] * 256 + [NORMAL] * len(PIECES)
    types[SPECIAL.index("[multimodal]")] = USER_DEFINED
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("Tiny Gemma 3")
    writer.add_context_length(1024)
    writer.add_embedding_length(256)
    writer.add_block_count(2)
    writer.add_feed_forward_length(512)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_key_length(256)
    writer.add_value_length(256)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_sliding_window(512)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-1000.0] * len(SPECIAL) + [0.0] * 256
                            + [-float(i) for i in range(len(PIECES))])
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)

    def tensor(name, rows, cols, kind):
        if kind == T.F32:  # norms: stored as 1 + w
            writer.add_tensor(name, (1 + rng.normal(0, 0.1, cols)).astype(np.float32))
            return
        if kind in (T.Q8_0, T.Q5_0):
            values = rng.normal(0, 0.05, (rows, cols)).astype(np.float32)
            writer.add_tensor(name, quants.quantize(values, kind), raw_dtype=kind)
            return
        # K-quants (no quantizer in the gguf package): random codes under finite scales
        block_bytes = {T.Q4_K: 144, T.Q6_K: 210}[kind]
        blocks = rng.integers(0, 256, (rows, cols // 256, block_bytes), dtype=np.uint8)
        scales = rng.uniform(1e-3, 1e-2, (rows, cols // 256, 2)).astype(np.float16)
        for i, at in enumerate((0, 2) if kind == T.Q4_K else (208,)):  # fp16 d (and dmin)
            blocks[..., at:at + 2] = scales[..., i:i + 1].view(np.uint8)
        writer.add_tensor(name, blocks.reshape(rows, -1), raw_dtype=kind)

    tensor("token_embd.weight", len(tokens), 256, T.Q8_0)
    tensor("output_norm.weight", 1, 256, T.F32)
    for i in range(2):
        for norm in ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm",
                     "ffn_norm", "post_ffw_norm"):
            tensor(f"blk.{i}.{norm}.weight", 1, 256, T.F32)
        tensor(f"blk.{i}.attn_q.weight", 256, 256, T.Q4_K)
        tensor(f"blk.{i}.attn_k.weight", 256, 256, T.Q5_0)
        tensor(f"blk.{i}.attn_v.weight", 256, 256, T.Q6_K)
        tensor(f"blk.{i}.attn_output.weight", 256, 256, T.Q4_K)
        tensor(f"blk.{i}.ffn_gate.weight", 512, 256, T.Q5_0)
        tensor(f"blk.{i}.ffn_up.weight", 512, 256, T.Q4_K)
        tensor(f"blk.{i}.ffn_down.weight", 256, 512, T.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf"
    tiny_gemma3_gguf(path)
    return path


def test_the_header_and_every_tensor_type_read_as_the_gguf_package_reads_them(tiny_gguf):
    import gguf

    reader = gguf.GGUFReader(str(tiny_gguf))
    header = read_gguf(tiny_gguf)
    assert header.metadata["general.architecture"] == "gemma3"
    assert header.metadata["gemma3.block_count"] == 2
    assert header.metadata["tokenizer.ggml.tokens"] == len(SPECIAL) + 256 + len(PIECES)
    assert header.metadata["tokenizer.ggml.token_type"][:len(SPECIAL)] == \
        [CONTROL, CONTROL, CONTROL, CONTROL, CONTROL, USER_DEFINED, CONTROL, CONTROL, CONTROL]
    assert list(header.tensors) == [t.name for t in reader.tensors]
    kinds = set()
    for theirs in reader.tensors:
        ours = header.tensors[theirs.name]
        assert ours.kind == theirs.tensor_type
        assert ours.start == theirs.data_offset  # in the file
        raw = np.fromfile(tiny_gguf, np.uint8, ours.size, offset=ours.start)
        expected = gguf.quants.dequantize(theirs.data, theirs.tensor_type)
        values = dequantize(raw, ours)
        assert values.dtype == np.float32 and np.isfinite(values).all()
        assert values.shape == expected.reshape(ours.shape).shape
        assert np.array_equal(values, expected.reshape(ours.shape)), theirs.name
        kinds.add(theirs.tensor_type.name)
    assert kinds == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}


def test_a_tiny_gemma3_gguf_converts_as_transformers_loads_it(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    convert_gguf(tiny_gguf, tmp_path / "ours")
    transformers_conversion(tiny_gguf, tmp_path / "reference")
    assert_same_checkpoint(tmp_path / "ours", tmp_path / "reference")

    ours, reference = (AutoTokenizer.from_pretrained(tmp_path / name)
                       for name in ("ours", "reference"))
    assert_same_tokenizer(ours, reference, SAMPLES + ["Hello ab  c", "\nUser: abc"])
    assert ours("\nUser:", add_special_tokens=False)["input_ids"]  # a stop string's pieces
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    norm = model.model.layers[0].input_layernorm.weight
    assert norm.abs().mean() < 0.5, "the GGUF's 1 + w norms were not turned back into w"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.slow
def test_the_embedded_tokenizer_is_transformers_own_gguf_tokenizer(tmp_path):
    """The real 262k-token vocabulary: our conversion's tokenizer against the one transformers
    builds from the GGUF, on text in several scripts, special and control tokens, the chat
    format's stop strings and a whole chat prompt (~30 s on 2 cores, most of it transformers
    reading the file)."""
    from transformers import AutoTokenizer

    from specchat.core.text import PLAIN_STOPS, chat_prompt
    from specchat.models.embedded import gguf_path, gguf_tokenizer

    gguf = gguf_path()
    gguf_tokenizer(gguf).save_pretrained(tmp_path)
    ours = AutoTokenizer.from_pretrained(tmp_path)
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert len(ours) == 262144
    control = ["<start_of_turn>", "<end_of_turn>", "<unused0>", "<unused6241>", "[multimodal]",
               "<start_of_image>", "<end_of_image>"]
    assert_same_tokenizer(ours, reference, SAMPLES + control + list(PLAIN_STOPS))
    assert ours.convert_tokens_to_ids("<end_of_turn>") == 106
    messages = [{"role": "user", "content": "Wie spät ist es? 今何時ですか?"}]
    assert chat_prompt(ours, messages) == chat_prompt(reference, messages)


@pytest.mark.slow
def test_the_embedded_checkpoint_is_the_one_transformers_makes(tmp_path):
    """The whole real conversion against transformers' own (over a minute on 2 cores: transformers
    parses the file three times)."""
    from specchat.models.embedded import gguf_path

    convert_gguf(gguf_path(), tmp_path / "ours")
    transformers_conversion(gguf_path(), tmp_path / "reference")
    assert_same_checkpoint(tmp_path / "ours", tmp_path / "reference")
