"""Tiny GGUF files written as llama.cpp's convert_hf_to_gguf.py writes them, from tiny random HF
models built here: the file a user would have, for a model whose true logits the test knows.

`tiny_model(arch)` builds a random model of one family (llama, qwen2, qwen3, gemma2, gemma3,
phi3); `write_gguf(path, model)` writes it under llama.cpp's tensor names and metadata keys,
with llama.cpp's changes to the values (Llama's q/k rows permuted for its rotary layout, Gemma's
norms stored as 1 + w, Llama 3's RoPE scaling as a `rope_freqs` tensor, Phi-3's long-context
RoPE as two factor tensors) and a small tokenizer: byte-level BPE (GPT-2's byte alphabet, a few
merges, Llama 3's special tokens) or, for Gemma, a sentencepiece vocabulary.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

# A chat template in Llama 3's format, written into every file: the converted tokenizer must
# carry the file's own.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{{ message['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

# Byte-level BPE: merges in the order they apply, then the special tokens (marked CONTROL).
MERGES = ["h e", "l l", "Ġ t", "Ġt he", "e r", "o n", "Ġ a", "i n", "he ll", "hell o", "Ġ w",
          "o r", "Ġw or", "l d", "Ġwor ld", "Ġ c", "a t", "Ġc at", "Ġ s", "Ġs at"]
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>"]
# Sentencepiece (Gemma): control tokens, 256 byte fallbacks, then pieces.
SP_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
SP_PIECES = ["▁", "a", "b", "c", "e", "h", "l", "o", "t", "w", "r", "d", "▁t", "he", "▁the",
             "ll", "▁a", "or", "ld", "▁w", "▁wor", "▁world", "hell", "hello", "▁hello"]
NORMAL, CONTROL, BYTE = 1, 3, 6

# Each family's HF config of a tiny model; its vocabulary size is filled in by `tiny_model`.
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def byte_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE vocabulary, as llama.cpp stores one:
    the 256 bytes in GPT-2's printable spelling, each merge's result, then the specials."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    tokens += ["".join(m.split(" ")) for m in MERGES]
    types = [NORMAL] * len(tokens) + [CONTROL] * len(SPECIAL)
    return tokens + SPECIAL, types, MERGES


def sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    """(tokens, token types, scores) of a Gemma-style vocabulary with byte fallback."""
    tokens = SP_SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + SP_PIECES
    types = [CONTROL] * len(SP_SPECIAL) + [BYTE] * 256 + [NORMAL] * len(SP_PIECES)
    scores = [0.0] * (len(SP_SPECIAL) + 256) + [-float(i) for i in range(len(SP_PIECES))]
    return tokens, types, scores


def vocab_size(arch: str) -> int:
    return len(sentencepiece_vocab()[0] if arch.startswith("gemma") else byte_vocab()[0])


def tiny_model(arch: str, seed: int = 0, **config):
    """A small float32 model of one family (2 layers, Gemma 3's 6) with random weights (norms
    too, in steps of 1/64, so that llama.cpp's 1 + w and its inverse are exact), its vocabulary
    the test file's."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )
    from transformers import AutoModelForCausalLM

    ids = (dict(bos_token_id=2, eos_token_id=1, pad_token_id=0) if arch.startswith("gemma")
           else dict(bos_token_id=len(byte_vocab()[0]) - len(SPECIAL),
                     eos_token_id=len(byte_vocab()[0]) - 1, pad_token_id=None))
    kinds = {
        "llama": (LlamaConfig, dict(rope_theta=500000.0, tie_word_embeddings=False)),
        "qwen2": (Qwen2Config, dict(rope_theta=1e6, tie_word_embeddings=True)),
        "qwen3": (Qwen3Config, dict(head_dim=32, rope_theta=1e6, tie_word_embeddings=False)),
        "gemma2": (Gemma2Config, dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=64,
                                      attn_logit_softcapping=50.0,
                                      final_logit_softcapping=30.0)),
        # 6 layers: llama.cpp's pattern of 5 sliding-window layers, then a global one
        "gemma3": (Gemma3TextConfig, dict(head_dim=32, query_pre_attn_scalar=32,
                                          sliding_window=64, rope_theta=1e6,
                                          num_hidden_layers=6)),
        "phi3": (Phi3Config, dict(rope_theta=10000.0, tie_word_embeddings=False)),
    }
    cls, extra = kinds[arch]
    cfg = cls(**{**SHAPE, **ids, **extra, **config, "vocab_size": vocab_size(arch)})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gemma = arch.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's norms scale by 1 + w, the others' by w
                steps = torch.randint(-16, 17, p.shape).float() / 64
                p.copy_(steps if gemma else 1 + steps)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:  # large enough that attention is far from uniform: a wrong q/k order shows
                p.normal_(0, 0.25 if "self_attn" in name else 0.08)
    return model


def rounded(model):
    """`model` with its weights rounded to bf16 and back, the precision of the converted
    checkpoint: the same logits are expected from both."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return out


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's q/k row order for Llama (convert_hf_to_gguf.py, `LlamaModel.permute`): each
    head's rotary halves interleaved, as its RoPE kernel pairs neighbouring values."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def llama3_rope_freqs(theta: float, dim: int, factor: float, low: float, high: float,
                      original: int) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp writes for Llama 3's RoPE scaling (each frequency's
    divisor), as convert_hf_to_gguf.py's `LlamaModel.generate_extra_tensors` computes it."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path: Path, model, *, name: str = "Tiny", kinds: dict | None = None,
               chat_template: str | None = None, metadata: dict | None = None,
               drop: tuple[str, ...] = (), extra: dict | None = None,
               architecture: str | None = None) -> Path:
    """Write `model` as llama.cpp would. kinds: GGUF tensor name -> ggml type (F32 where unsaid;
    norms and biases always F32, as llama.cpp keeps 1-D tensors; K-quants as random blocks,
    `kquant_blocks`); metadata: extra or replaced keys (key -> value, or None to leave a key
    out); drop: tensors left out; extra: tensors added as they are (name -> numpy array, its
    dtype the ggml type); architecture: the `general.architecture` written, where not the
    model's."""
    import gguf
    from gguf import GGMLQuantizationType as T

    cfg = model.config
    arch = {"gemma3_text": "gemma3"}.get(cfg.model_type, cfg.model_type)
    gemma = arch.startswith("gemma")
    writer = gguf.GGUFWriter(str(path), architecture or arch)
    keys = _metadata(arch, cfg)
    if gemma:
        tokens, types, scores = sentencepiece_vocab()
        keys.update({"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
                     "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
                     "tokenizer.ggml.token_type": types, "tokenizer.ggml.add_space_prefix": False,
                     "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0})
    else:
        tokens, types, merges = byte_vocab()
        keys.update({"tokenizer.ggml.model": "gpt2",
                     "tokenizer.ggml.pre": "qwen2" if arch.startswith("qwen") else "llama-bpe",
                     "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                     "tokenizer.ggml.merges": merges})
    keys.update({"general.name": name, "tokenizer.ggml.bos_token_id": cfg.bos_token_id,
                 "tokenizer.ggml.eos_token_id": cfg.eos_token_id,
                 "tokenizer.ggml.add_bos_token": True,
                 "tokenizer.chat_template": chat_template
                 or (GEMMA_TEMPLATE if gemma else CHAT_TEMPLATE)})
    keys.update(metadata or {})
    for key, value in keys.items():
        if value is not None and key != "general.architecture":
            _add(writer, key, value)
    for gguf_name, values in _tensors(arch, model):
        if gguf_name in drop:
            continue
        kind = T.F32 if values.ndim == 1 else (kinds or {}).get(gguf_name, T.F32)
        if kind == T.F32:
            writer.add_tensor(gguf_name, values)
        elif kind in KQUANT_SCALES:
            writer.add_tensor(gguf_name, kquant_blocks(*values.shape, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    for gguf_name, values in (extra or {}).items():
        writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Where each K-quant's fp16 scales lie in its block (ggml-common.h: block_q4_K's d and dmin
# first, block_q6_K's d last).
KQUANT_SCALES = {12: (0, 2), 13: (0, 2), 14: (208,)}  # Q4_K, Q5_K, Q6_K


def kquant_blocks(rows: int, cols: int, kind: int, seed: int = 0) -> np.ndarray:
    """[rows, bytes] of K-quant blocks with random codes under small finite scales: the gguf
    package has no K-quant quantizer, and a test compares the conversion with its dequantizer
    rather than with the model's values."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // block, block_bytes), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, (rows, cols // block, 2)).astype(np.float16)
    for i, at in enumerate(KQUANT_SCALES[kind]):
        blocks[..., at:at + 2] = scales[..., i:i + 1].view(np.uint8)
    return blocks.reshape(rows, -1)


def _metadata(arch: str, cfg) -> dict:
    """The model's keys as convert_hf_to_gguf.py's `set_gguf_parameters` writes them."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    keys = {
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        f"{arch}.rope.freq_base": rope["rope_theta"],
        "general.file_type": 0,
    }
    if getattr(cfg, "head_dim", None) is not None:  # stated by the HF config
        keys[f"{arch}.attention.key_length"] = head_dim
        keys[f"{arch}.attention.value_length"] = head_dim
    if arch in ("llama", "qwen2", "qwen3"):
        keys[f"{arch}.rope.dimension_count"] = head_dim
    if arch == "llama":
        keys["llama.vocab_size"] = cfg.vocab_size
    if arch.startswith("gemma"):
        keys[f"{arch}.attention.sliding_window"] = cfg.sliding_window
    if arch == "gemma2":
        keys["gemma2.attn_logit_softcapping"] = cfg.attn_logit_softcapping
        keys["gemma2.final_logit_softcapping"] = cfg.final_logit_softcapping
        del keys["gemma2.rope.freq_base"]  # llama.cpp writes none for Gemma 2
    if arch == "gemma3" and rope.get("rope_type") == "linear":
        keys["gemma3.rope.scaling.type"] = "linear"
        keys["gemma3.rope.scaling.factor"] = rope["factor"]
    if arch == "phi3":
        keys["phi3.rope.dimension_count"] = int(rope.get("partial_rotary_factor", 1.0)
                                                * head_dim)
        keys["phi3.attention.sliding_window"] = cfg.sliding_window
        if rope.get("rope_type") == "longrope":
            original = rope["original_max_position_embeddings"]
            scale = cfg.max_position_embeddings / original
            keys["phi3.rope.scaling.original_context_length"] = original
            keys["phi3.rope.scaling.attn_factor"] = (
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    return keys


def _tensors(arch: str, model):
    """(GGUF name, float32 values) of every tensor llama.cpp writes for `model`."""
    import gguf

    cfg = model.config
    names = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    table = gguf.get_tensor_name_map(names[arch], cfg.num_hidden_layers)
    tied = cfg.tie_word_embeddings
    for hf_name, tensor in model.state_dict().items():
        module, _, kind = hf_name.rpartition(".")
        gguf_name = table.get_name(module)
        if gguf_name is None or (tied and hf_name == "lm_head.weight"):
            continue  # a tied head: llama.cpp writes the embedding only
        values = tensor.float().numpy()
        if arch == "llama" and module.endswith("q_proj"):
            values = permute(values, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and module.endswith("k_proj"):
            values = permute(values, cfg.num_attention_heads, cfg.num_key_value_heads)
        elif arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            values = values + 1
        yield f"{gguf_name}.{kind}", np.ascontiguousarray(values, dtype=np.float32)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", llama3_rope_freqs(
            rope["rope_theta"], head_dim, rope["factor"], rope["low_freq_factor"],
            rope["high_freq_factor"], rope["original_max_position_embeddings"])
    if rope.get("rope_type") == "longrope":
        yield "rope_factors_long.weight", np.array(rope["long_factor"], np.float32)
        yield "rope_factors_short.weight", np.array(rope["short_factor"], np.float32)


def _add(writer, key: str, value) -> None:
    """One metadata entry, typed as llama.cpp types it (counts u32, ratios f32)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))
