"""Tiny GGUF files written as llama.cpp's convert_hf_to_gguf.py writes them, from tiny random HF
models built here: the file a user would have, for a model whose true logits the test knows.

`tiny_model(arch)` builds a random model of one family (llama, qwen2, qwen3, gemma2, gemma3,
phi3); `write_gguf(path, model)` writes it under llama.cpp's tensor names and metadata keys,
with llama.cpp's changes to the values (Llama's q/k rows permuted for its rotary layout, Gemma's
norms stored as 1 + w, Llama 3's RoPE scaling as a `rope_freqs` tensor, Phi-3's long-context
RoPE as two factor tensors) and a small tokenizer: byte-level BPE (GPT-2's byte alphabet, a few
merges, Llama 3's special tokens) or, for Gemma, a sentencepiece vocabulary. Both
vocabularies, the metadata keys and llama.cpp's q/k order are `specchat.bench.gguf_shapes`',
which writes real models' shapes with them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# CHAT_TEMPLATE, GEMMA_TEMPLATE, llama3_rope_freqs and permute: test_gguf_files imports them
# from here
from specchat.bench.gguf_shapes import (  # noqa: F401
    CHAT_TEMPLATE,
    GEMMA_TEMPLATE,
    SPECIAL,
    add_key,
    byte_vocab,
    llama3_rope_freqs,
    metadata_keys,
    permute,
    sentencepiece_vocab,
)

# Each family's HF config of a tiny model; its vocabulary size is filled in by `tiny_model`.
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


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
    keys = metadata_keys(arch, cfg)
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
            add_key(writer, key, value)
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
