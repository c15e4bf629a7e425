"""Tiny random-config models and a byte-level tokenizer, built in-process (no downloads)."""

from __future__ import annotations

import collections

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from specchat.core.sampling import nucleus
from specchat.models.loaded import LoadedModel

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


def tiny_llama(seed: int, vocab: int = 259, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, eos_token_id=2, bos_token_id=1,
                      pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma3(seed: int, vocab: int = 259, sliding_window: int = 16) -> Gemma3ForCausalLM:
    """Gemma 3 style: sliding-window layers mixed with a full-attention layer."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, sliding_window=sliding_window,
                           layer_types=["sliding_attention", "sliding_attention",
                                        "full_attention"],
                           max_position_embeddings=2048, eos_token_id=2, bos_token_id=1,
                           pad_token_id=0)
    return Gemma3ForCausalLM(cfg).eval()


def loaded(model, tokenizer=None, name="tiny") -> LoadedModel:
    return LoadedModel(model, tokenizer or byte_tokenizer(), name, "none",
                       torch.device("cpu"), 0.0)


def dense_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] float32 probabilities after temperature/top-k/top-p:
    the reference distribution the sampler's draws must follow."""
    rows = []
    for row in logits:
        ids, probs = nucleus(row, params)
        rows.append(probs.float() if ids is None
                    else torch.zeros(logits.shape[-1]).index_put_((ids,), probs.float()))
    return torch.stack(rows)


def most_repeats(seq, n: int = 6) -> int:
    """How many times the most frequent n-gram of `seq` occurs (0 when shorter than n)."""
    grams = collections.Counter(tuple(seq[i:i + n]) for i in range(len(seq) - n + 1))
    return max(grams.values(), default=0)
