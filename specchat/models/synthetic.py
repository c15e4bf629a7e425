"""Models built in code with random weights, and a byte-level tokenizer: no download, no file.

The tests build tiny ones; the device check (`specchat/check.py`) builds small ones to check
every path on a new device, and one of a real size to time it (speed does not depend on the
weights' values). `save` writes a model with its tokenizer as a checkpoint directory, so it
loads through `models.load.load_model` like any model, NF4 included.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

SPECIALS = ["<pad>", "<bos>", "<eos>"]


def byte_tokenizer(extra: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: 3 specials + 256 bytes (+ extra tokens). Any text encodes."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIALS + sorted(alphabet) + (extra or []))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>")


def tiny_llama(seed: int, vocab: int = 259, layers: int = 2, hidden: int = 32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, eos_token_id=2, bos_token_id=1,
                      pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma3(seed: int, vocab: int = 259, sliding_window: int = 16,
                hidden: int = 32, head_dim: int = 16) -> Gemma3ForCausalLM:
    """Gemma 3 style: sliding-window layers mixed with a full-attention layer. With hidden and
    head_dim multiples of 64, every layer is one specchat's NF4 kernel takes once quantized."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=head_dim, sliding_window=sliding_window,
                           layer_types=["sliding_attention", "sliding_attention",
                                        "full_attention"],
                           max_position_embeddings=2048, eos_token_id=2, bos_token_id=1,
                           pad_token_id=0)
    return Gemma3ForCausalLM(cfg).eval()


# What `tiny_family` builds: each family specchat's CPU forward runs (`runners.family`), with
# what sets it apart switched on (Llama 3's RoPE scaling, Mistral's window, Qwen 2's biases,
# Qwen 3's per-head norms, SmolLM 2's tied head, Gemma 2's soft-caps, Phi-3's fused q|k|v and
# gate|up)
FAMILY_MODELS = ("llama", "smollm2", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")


def tiny_family(kind: str, seed: int = 0, hidden: int = 128, head_dim: int = 64,
                vocab: int = 272, window: int = 16):
    """A tiny model of a `FAMILY_MODELS` family, widths multiples of 64 (so every layer is one
    specchat's NF4 kernel takes), with random norm weights and biases where the family has them
    (fresh ones are constants, which would hide a norm or a bias read in the wrong place). The
    vocabulary leaves room past `byte_tokenizer`'s 259 tokens: Qwen's tokenizer class, loaded
    back from a checkpoint, adds its own end-of-text token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if kind == "gemma3":
        model = tiny_gemma3(seed, vocab, sliding_window=window, hidden=hidden,
                            head_dim=head_dim)
    else:
        shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_hidden_layers=2, num_attention_heads=hidden // head_dim * 2,
                     num_key_value_heads=hidden // head_dim, head_dim=head_dim,
                     max_position_embeddings=2048, eos_token_id=2, bos_token_id=1,
                     pad_token_id=0,
                     tie_word_embeddings=kind in ("smollm2", "qwen3", "gemma2"))
        extra = {"llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64},
                               rope_theta=500000.0),
                 "smollm2": dict(rope_theta=100000.0),
                 "mistral": dict(sliding_window=window),
                 "qwen2": dict(use_sliding_window=True, sliding_window=window,
                               max_window_layers=1),  # layer 1 windowed, layer 0 not
                 "qwen3": dict(),
                 # caps small enough to bend a tiny random model's scores and logits
                 "gemma2": dict(sliding_window=window, query_pre_attn_scalar=48,
                                attn_logit_softcapping=0.5, final_logit_softcapping=0.25,
                                hidden_activation="gelu_pytorch_tanh"),
                 "phi3": dict(sliding_window=window, hidden_act="silu")}[kind]
        model_type = "llama" if kind == "smollm2" else kind
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(model_type, **shape, **extra)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                base = 0.0 if kind.startswith("gemma") else 1.0  # Gemma scales by 1 + weight
                p.copy_(base + 0.5 * torch.randn(p.shape, generator=generator))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))
    return model


def llama_1b_config(small: bool = False) -> LlamaConfig:
    """Llama 3.2 1B's shape (16 layers, d 2048, GQA 32/8, MLP 8192, 128,256-token vocabulary,
    tied embeddings); `small`: the same layout a few hundred times smaller, for CPUs."""
    if small:
        shape = dict(vocab_size=8192, hidden_size=256, intermediate_size=1024,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
    else:
        shape = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8)
    return LlamaConfig(**shape, max_position_embeddings=8192, rope_theta=500000.0,
                       tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
                       pad_token_id=0)


def llama_8b_config() -> LlamaConfig:
    """Llama 3.1 8B's shape (32 layers, d 4096, GQA 32/8, MLP 14,336, 128,256-token vocabulary,
    untied LM head)."""
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rope_theta=500000.0,
                       tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
                       pad_token_id=0)


def shape_config(name: str):
    """The config of a real model's shape (`SHAPES`), for random weights: layers, widths, heads,
    vocabulary, tied or untied head and RoPE as the model's own config has them."""
    from transformers import AutoConfig

    if name == "llama-3.2-1b":
        return llama_1b_config()
    if name == "llama-3.1-8b":
        return llama_8b_config()
    ids = dict(eos_token_id=2, bos_token_id=1, pad_token_id=0)
    if name.startswith("qwen2.5-"):
        shape = {"qwen2.5-0.5b": (896, 4864, 24, 14), "qwen2.5-1.5b": (1536, 8960, 28, 12)}[name]
        hidden, inter, layers, heads = shape
        return AutoConfig.for_model("qwen2", vocab_size=151936, hidden_size=hidden,
                                    intermediate_size=inter, num_hidden_layers=layers,
                                    num_attention_heads=heads, num_key_value_heads=2,
                                    max_position_embeddings=32768, rope_theta=1000000.0,
                                    tie_word_embeddings=True, **ids)
    if name == "gemma-3-1b":
        return Gemma3TextConfig(vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                                num_hidden_layers=26, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=256, sliding_window=512,
                                query_pre_attn_scalar=256, max_position_embeddings=32768,
                                rope_theta=1000000.0, **ids)
    raise ValueError(f"no shape {name!r}: the shapes are {', '.join(SHAPES)}")


SHAPES = ("llama-3.2-1b", "llama-3.1-8b", "qwen2.5-0.5b", "qwen2.5-1.5b", "gemma-3-1b")


def random_model(config, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.bfloat16):
    """A causal LM of `config` with random weights, built directly on `device`."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def save(model, tokenizer, directory: str | Path) -> Path:
    """Write `model` and `tokenizer` as a checkpoint directory `load_model` reads."""
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
