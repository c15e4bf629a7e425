"""A real model's shape (`models.synthetic.SHAPES`) as a GGUF file of random weights, written as
llama.cpp's tools write one, and a race of specchat against llama.cpp on that one file.

    python -m specchat.bench.gguf_shapes --shape llama-3.2-1b --out DIR
    python -m specchat.bench.gguf_shapes race --shape llama-3.2-1b --workdir DIR
    python -m specchat.bench.gguf_shapes race --shape qwen2.5-1.5b --draft-shape qwen2.5-0.5b \
        --workdir DIR

The file holds what llama-quantize writes for Q4_0: the layers' matrices in Q4_0, the LM head
(an untied one, or the embedding it is tied to) in Q6_K (`runners.cpu.q6_k_head.quantize_q6_k`:
the gguf package has no K-quant quantizer), or Q8_0 where its rows are not whole superblocks of
256 (llama-quantize's fallback), an untied token embedding in Q8_0, norms and biases in F32.
Q4_0 stands in for the Q4_K_M files users download: 4.5 bits a layer weight where Q4_K_M's
average about 4.9 (some of them Q6_K), so llama.cpp reads a little less here than from a real
Q4_K_M file, and runs Q4_0's kernels rather than Q4_K's. Llama's q/k rows are permuted for llama.cpp's RoPE as
convert_hf_to_gguf.py permutes them; Gemma's norms, which scale by 1 + w, are stored as 1 + w
as it stores them.

The tokenizer of Llama and Qwen is GPT-2's byte-level BPE as llama.cpp stores one
(`tokenizer.ggml.model` "gpt2", the family's pre-tokenizer): the 256 bytes, a few merges, then
`[PADn]` tokens typed UNUSED up to the shape's vocabulary, as convert_hf_to_gguf.py pads a
vocabulary to the embedding's rows (neither llama.cpp nor transformers matches an unused token
in text, where CONTROL or USER_DEFINED tokens would each be searched for in every prompt), and
the family's special tokens last, where Llama 3's and Qwen 2.5's vocabularies have them.
Gemma's is SentencePiece as its files hold it (`tokenizer.ggml.model` "llama"): its control
tokens first, the 256 byte fallbacks, a few scored pieces, then the `[PADn]` tokens.

Each tensor's values come from a generator seeded by the file's seed and the tensor's name
(`tensor_values`), a chunk of rows at a time; each chunk is quantized into the tensor's bytes,
and the tensor is written before the next is made (`GGUFWriter.add_tensor_info` for the table,
then `write_tensor_data` one tensor at a time). Memory holds one tensor's quantized bytes and
one chunk in float32: Llama 3.1 8B's file (5.0 GB) is written in under 2 minutes on 2 cores,
1.2 GB resident at most, torch and transformers included.

The race runs llama.cpp's llama-bench on the file (pp512, pp328, and tg64 both from an empty
cache and after `shapes.CONTEXT` cached tokens, where specchat's step is timed), then
`shapes.measure` on the same file (converted once into a bf16 checkpoint, loaded as NF4), and
prints both side by side.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# ggml's token types (llama.cpp's llama_token_type)
NORMAL, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 3, 4, 5, 6

# Byte-level BPE: merges in the order they apply.
MERGES = ["h e", "l l", "Ġ t", "Ġt he", "e r", "o n", "Ġ a", "i n", "he ll", "hell o", "Ġ w",
          "o r", "Ġw or", "l d", "Ġwor ld", "Ġ c", "a t", "Ġc at", "Ġ s", "Ġs at"]
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>"]  # Llama 3's
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Chat templates in Llama 3's and Qwen's (ChatML) formats.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{{ message['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# SentencePiece (Gemma's, `tokenizer.ggml.model` "llama"): control tokens, 256 byte fallbacks,
# then pieces.
SP_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
SP_PIECES = ["▁", "a", "b", "c", "e", "h", "l", "o", "t", "w", "r", "d", "▁t", "he", "▁the",
             "ll", "▁a", "or", "ld", "▁w", "▁wor", "▁world", "hell", "hello", "▁hello"]

CHUNK_VALUES = 1 << 24  # float32 values generated and quantized at a time (64 MB)
PROMPT = 328  # the first token is timed after a prompt this long, as `shapes.measure` times it


@dataclass(frozen=True)
class Family:
    """What a family's file holds beyond its config's numbers."""

    arch: str  # general.architecture
    pre: str  # tokenizer.ggml.pre: the pre-tokenizer llama.cpp splits text with
    special: tuple[str, ...]  # special tokens: byte-level vocabularies' last, SentencePiece's first
    bos: str
    eos: str
    add_bos: bool
    template: str
    permute_qk: bool  # llama.cpp's rotary row order for q and k (Llama only)
    norm_plus_one: bool = False  # norms scale by 1 + w, stored by llama.cpp as 1 + w (Gemma)
    tokenizer: str = "gpt2"  # tokenizer.ggml.model: byte-level BPE, or "llama" (SentencePiece)


FAMILIES = {
    "llama": Family("llama", "llama-bpe", tuple(SPECIAL), "<|begin_of_text|>", "<|eot_id|>",
                    True, CHAT_TEMPLATE, True),
    "qwen2": Family("qwen2", "qwen2", tuple(QWEN_SPECIAL), "<|endoftext|>", "<|im_end|>",
                    False, CHATML_TEMPLATE, False),
    # Gemma's files hold its SentencePiece vocabulary, which transformers' Gemma tokenizer (the
    # one a converted Gemma checkpoint loads) assumes: a byte-level one would not load back.
    "gemma3_text": Family("gemma3", "default", tuple(SP_SPECIAL), "<bos>", "<eos>", True,
                          GEMMA_TEMPLATE, False, norm_plus_one=True, tokenizer="llama"),
}
SHAPE_FAMILIES = ("llama-3.2-1b", "llama-3.1-8b", "qwen2.5-0.5b", "qwen2.5-1.5b", "gemma-3-1b")


# -- what every GGUF's vocabulary holds (tests/gguf_writer.py writes its files with these too)

def byte_vocab(size: int | None = None, special=SPECIAL) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE vocabulary, as llama.cpp stores one:
    the 256 bytes in GPT-2's printable spelling, each merge's result, `[PADn]` unused tokens up
    to `size` (none without one), then the special tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["".join(m.split(" ")) for m in MERGES]
    types = [NORMAL] * len(tokens)
    if size is not None:
        pad = size - len(tokens) - len(special)
        if pad < 0:
            raise ValueError(f"a vocabulary of {size} tokens is smaller than the "
                             f"{len(tokens) + len(special)} a byte-level one needs")
        tokens += [f"[PAD{i}]" for i in range(pad)]
        types += [UNUSED] * pad
    return tokens + list(special), types + [CONTROL] * len(special), list(MERGES)


def sentencepiece_vocab(size: int | None = None) -> tuple[list[str], list[int], list[float]]:
    """(tokens, token types, scores) of a Gemma-style SentencePiece vocabulary with byte
    fallback: the control tokens, the 256 bytes as `<0xXX>`, pieces scored in their order, then
    `[PADn]` unused tokens scored -1000 up to `size` (none without one), as
    convert_hf_to_gguf.py pads a SentencePiece vocabulary to the embedding's rows."""
    tokens = SP_SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + SP_PIECES
    types = [CONTROL] * len(SP_SPECIAL) + [BYTE] * 256 + [NORMAL] * len(SP_PIECES)
    scores = [0.0] * (len(SP_SPECIAL) + 256) + [-float(i) for i in range(len(SP_PIECES))]
    if size is not None:
        pad = size - len(tokens)
        if pad < 0:
            raise ValueError(f"a vocabulary of {size} tokens is smaller than the "
                             f"{len(tokens)} a SentencePiece one with byte fallback needs")
        tokens += [f"[PAD{i}]" for i in range(pad)]
        types += [UNUSED] * pad
        scores += [-1000.0] * pad
    return tokens, types, scores


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


def metadata_keys(arch: str, cfg) -> dict:
    """A model's keys as convert_hf_to_gguf.py's `set_gguf_parameters` writes them."""
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


def add_key(writer, key: str, value) -> None:
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


# -- a shape's file ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Planned:
    """One tensor of a shape's file."""

    name: str  # llama.cpp's: "blk.3.attn_q.weight"
    param: str  # the HF model's: "model.layers.3.self_attn.q_proj.weight"
    shape: tuple[int, ...]  # torch's order
    kind: int  # ggml type
    plus_one: bool = False  # a norm the file holds as 1 + the HF weight (Gemma's)

    @property
    def nbytes(self) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(self.kind)]
        return math.prod(self.shape) // block * block_bytes


def family(config) -> Family:
    try:
        return FAMILIES[config.model_type]
    except KeyError:
        raise ValueError(f"no GGUF family for model type {config.model_type!r}: "
                         f"{', '.join(FAMILIES)} are written") from None


def plan(config) -> list[Planned]:
    """Every tensor llama.cpp's file of `config` holds, in the HF model's order, with its type:
    1-D ones F32, the LM head Q6_K (Q8_0 where its rows are not whole superblocks), an untied
    token embedding Q8_0, the other matrices Q4_0."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from transformers import AutoModelForCausalLM

    fam = family(config)
    with torch.device("meta"):  # names and shapes only
        model = AutoModelForCausalLM.from_config(config)
    arch = {name: enum for enum, name in gguf.MODEL_ARCH_NAMES.items()}[fam.arch]
    table = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    out = []
    for param, tensor in model.state_dict().items():
        if config.tie_word_embeddings and param == "lm_head.weight":
            continue  # a tied head: llama.cpp writes the embedding only
        module, _, kind = param.rpartition(".")
        name = table.get_name(module)
        if name is None:
            raise ValueError(f"{param} has no llama.cpp name in a {fam.arch} file")
        name = f"{name}.{kind}"
        head = name == "output.weight" or name == "token_embd.weight" \
            and config.tie_word_embeddings
        ggml = (T.F32 if tensor.ndim == 1 else
                (T.Q6_K if tensor.shape[-1] % 256 == 0 else T.Q8_0) if head else
                T.Q8_0 if name == "token_embd.weight" else T.Q4_0)
        plus_one = fam.norm_plus_one and name.endswith("norm.weight")
        out.append(Planned(name, param, tuple(tensor.shape), int(ggml), plus_one))
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        out.append(Planned("rope_freqs.weight", "", (head_dim // 2,), int(T.F32)))
    return out


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def tensor_values(entry: Planned, seed: int = 0, std: float = 0.02):
    """(first row, float32 [rows, cols]) chunks of a tensor's values as the HF model holds
    them (1-D ones: (0, the whole vector)), from a generator of its own: matrices and biases
    N(0, std), norms scaling by 1 + k/64 for k uniform in -8..8 (random, so that a norm read in
    the wrong place shows in the logits): weights 1 + k/64, or k/64 where the norm scales by
    1 + w (Gemma's)."""
    generator = torch.Generator().manual_seed(_seed(seed, entry.name))
    if len(entry.shape) == 1:
        if entry.name.endswith("norm.weight"):
            steps = torch.randint(-8, 9, entry.shape, generator=generator)
            yield 0, ((0 if entry.plus_one else 1) + steps.float() / 64).numpy()
        else:
            yield 0, (std * torch.randn(entry.shape, generator=generator)).numpy()
        return
    rows, cols = entry.shape
    step = max(1, CHUNK_VALUES // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        yield r, (std * torch.randn((n, cols), generator=generator)).numpy()


def tensor_bytes(entry: Planned, config, seed: int = 0, std: float = 0.02) -> np.ndarray:
    """A tensor's data as the file holds it: llama.cpp's layout, quantized to its type."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize as gguf_quantize

    from specchat.runners.cpu.q6_k_head import quantize_q6_k

    def quantize(values: np.ndarray, kind: int) -> np.ndarray:
        if kind == T.Q6_K:
            return quantize_q6_k(torch.from_numpy(values)).numpy()
        return gguf_quantize(values, kind)

    fam = family(config)
    if entry.name == "rope_freqs.weight":
        rope = config.rope_parameters
        return llama3_rope_freqs(rope["rope_theta"], entry.shape[0] * 2, rope["factor"],
                                 rope["low_freq_factor"], rope["high_freq_factor"],
                                 rope["original_max_position_embeddings"])
    chunks = tensor_values(entry, seed, std)
    if len(entry.shape) == 1:
        values = next(chunks)[1]
        return values + 1 if entry.plus_one else values  # exact: multiples of 1/64 near 0
    heads = {"attn_q": (config.num_attention_heads, config.num_attention_heads),
             "attn_k": (config.num_attention_heads, config.num_key_value_heads)}
    kind = entry.name.split(".")[-2]
    if fam.permute_qk and kind in heads:  # a row order across heads: the whole matrix at once
        whole = np.concatenate([c for _, c in chunks])
        return quantize(permute(whole, *heads[kind]), entry.kind)
    out = np.empty((entry.shape[0], entry.nbytes // entry.shape[0]), np.uint8)
    for r, chunk in chunks:
        out[r:r + len(chunk)] = quantize(chunk, entry.kind)
    return out


def file_metadata(config, name: str) -> dict:
    """The file's keys: the model's, its file type (mostly Q4_0) and its tokenizer."""
    from gguf import LlamaFileType

    fam = family(config)
    keys = metadata_keys(fam.arch, config)
    if fam.tokenizer == "llama":
        tokens, types, scores = sentencepiece_vocab(config.vocab_size)
        keys.update({"tokenizer.ggml.scores": scores, "tokenizer.ggml.add_space_prefix": False,
                     "tokenizer.ggml.unknown_token_id": tokens.index("<unk>"),
                     "tokenizer.ggml.padding_token_id": tokens.index("<pad>")})
    else:
        tokens, types, merges = byte_vocab(config.vocab_size, fam.special)
        keys["tokenizer.ggml.merges"] = merges
    keys.update({
        "general.name": name, "general.file_type": int(LlamaFileType.MOSTLY_Q4_0),
        "tokenizer.ggml.model": fam.tokenizer, "tokenizer.ggml.pre": fam.pre,
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": tokens.index(fam.bos),
        "tokenizer.ggml.eos_token_id": tokens.index(fam.eos),
        "tokenizer.ggml.add_bos_token": fam.add_bos,
        "tokenizer.chat_template": fam.template})
    return keys


def write_shape(config, path: str | Path, *, name: str = "random", seed: int = 0,
                std: float = 0.02, progress=None) -> Path:
    """Write a GGUF of `config` with random weights (`tensor_values`) at `path`, one tensor at a
    time; the file appears whole or not at all."""
    import gguf

    path = Path(path)
    entries = plan(config)
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), family(config).arch)
    for key, value in file_metadata(config, name).items():
        add_key(writer, key, value)
    for e in entries:
        writer.add_tensor_info(e.name, e.shape, np.dtype(np.float32), e.nbytes,
                               raw_dtype=gguf.GGMLQuantizationType(e.kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, e in enumerate(entries):
        if progress and (i + 1) % 50 == 0:
            progress(f"{path.name}: {i + 1} of {len(entries)} tensors written")
        writer.write_tensor_data(tensor_bytes(e, config, seed, std))
    writer.close()
    partial.rename(path)
    return path


def shape_file(shape: str, out: str | Path, progress=print) -> Path:
    """`out/<shape>-Q4_0.gguf`, written once."""
    from specchat.models.synthetic import shape_config

    if shape not in SHAPE_FAMILIES:
        raise ValueError(f"no GGUF shape {shape!r}: {', '.join(SHAPE_FAMILIES)} are written")
    path = Path(out) / f"{shape}-Q4_0.gguf"
    if not path.exists():
        progress(f"writing {path} (random weights)")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_shape(shape_config(shape), path, name=shape, seed=3, progress=progress)
    return path


# -- the race ----------------------------------------------------------------------------------

def llama_read_bytes(path: Path) -> int:
    """Bytes a one-token step of llama.cpp reads from the file: every tensor's, the embedding
    table aside (one row of it) unless the LM head is tied to it, when the head reads it whole."""
    from specchat.models.gguf_files import read_gguf

    tensors = read_gguf(path).tensors
    total = sum(t.size for t in tensors.values())
    return total - tensors["token_embd.weight"].size if "output.weight" in tensors else total


def cpu_model() -> str:
    """/proc/cpuinfo's model name (the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _others_cpu_s() -> float:
    """CPU-seconds every other program has used since boot (/proc/stat's busy time less this
    process's and its children's, llama-bench among them; 0 where there is no /proc/stat): a
    race is this CPU's only while nothing else runs on its cores."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    busy = sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7)) / os.sysconf("SC_CLK_TCK")
    ours = sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))
    return busy - ours


def _rate(results: list[dict], n_prompt: int, n_gen: int, n_depth: int = 0) -> float:
    found = [r["avg_ts"] for r in results
             if (r["n_prompt"], r["n_gen"], r.get("n_depth", 0)) == (n_prompt, n_gen, n_depth)]
    if not found:
        raise ValueError(f"llama-bench gave no pp{n_prompt} tg{n_gen} at depth {n_depth}")
    return found[0]


def race(shape: str, draft_shape: str | None, workdir: Path, threads: int,
         repetitions: int = 3, progress=print) -> dict:
    """llama.cpp's llama-bench and `shapes.measure` on one shape's file, side by side."""
    from specchat.backends import llama_cpp
    from specchat.bench.shapes import CONTEXT, measure
    from specchat.models.runtime import cpu_kind

    torch.set_num_threads(threads)
    started, others = time.monotonic(), _others_cpu_s()
    target = shape_file(shape, workdir, progress)
    draft = shape_file(draft_shape, workdir, progress) if draft_shape else None
    binary = llama_cpp.cached_tool("llama-bench") or \
        llama_cpp.build(log=progress) / "llama-bench"
    os.sync()  # a fresh file's pages written back now, not while llama-bench times its reads
    progress(f"llama-bench on {target.name}, {threads} threads")
    runs = [dict(prompts=(512, PROMPT), gen=64), dict(prompts=(0,), gen=64, depth=CONTEXT)]
    results, commands = [], []
    for run in runs:
        out, cmd = llama_cpp.llama_bench(binary, target, threads=threads,
                                         repetitions=repetitions, **run)
        results += out
        commands.append(" ".join(cmd))
    read = llama_read_bytes(target)
    pp328 = _rate(results, PROMPT, 0)
    llama = {"bytes_per_token_gb": round(read / 1e9, 3),
             "tg_tok_s": round(_rate(results, 0, 64, CONTEXT), 1),
             "tg_empty_cache_tok_s": round(_rate(results, 0, 64), 1),
             "pp512_tok_s": round(_rate(results, 512, 0), 1),
             "pp328_tok_s": round(pp328, 1), "prompt_s_328": round(PROMPT / pp328, 3),
             "build": llama_cpp.build_info(binary).get("flags"),
             "version": llama_cpp.build_info(binary).get("version"),
             "commands": commands}
    ours = measure(str(target), str(draft) if draft else None, workdir, progress=progress)
    others, seconds = _others_cpu_s() - others, time.monotonic() - started
    llama["memory_limit_tok_s"] = round(ours["read_gb_s"] * 1e9 / read, 1)
    llama["of_memory_limit"] = round(llama["tg_tok_s"] / llama["memory_limit_tok_s"], 3)
    return {"shape": shape, "draft_shape": draft_shape, "file": str(target),
            "draft_file": str(draft) if draft else None,
            "cpu": cpu_model(), "cpu_kind": cpu_kind().describe(), "threads": threads,
            "race_s": round(seconds), "others_cpu_s": round(others),
            "read_gb_s": ours["read_gb_s"], "llama_cpp": llama, "specchat": ours,
            "specchat_over_llama_cpp": {
                "tg": round(ours["tg_tok_s"] / llama["tg_tok_s"], 3),
                "pp512": round(ours["pp512_tok_s"] / llama["pp512_tok_s"], 3)}}


BUSY_CPU_S = 5  # other programs' CPU-seconds in a race past which its figures are not its own


def summary(r: dict) -> str:
    lc, sc, ratio = r["llama_cpp"], r["specchat"], r["specchat_over_llama_cpp"]
    lines = [
        f"{r['shape']} (Q4_0 file, random weights): {r['file']}",
        f"  CPU {r['cpu']} ({r['cpu_kind']}), {r['threads']} threads; reads run at "
        f"{r['read_gb_s']} GB/s; other programs took {r['others_cpu_s']} CPU-seconds of the "
        f"race's {r['race_s']} s" + (" (more than a few: its figures are not this CPU's own)"
                                     if r["others_cpu_s"] > BUSY_CPU_S else ""),
        f"  llama.cpp {lc['version']} ({lc['build']}); specchat {sc['runtime']['path']}: "
        f"{sc['label']}",
        f"  {'':24}{'llama.cpp':>12}{'specchat':>12}{'specchat/llama.cpp':>20}",
        f"  {'a token reads (GB)':24}{lc['bytes_per_token_gb']:>12}"
        f"{sc['bytes_per_token_gb']:>12}",
        f"  {'memory limit (tok/s)':24}{lc['memory_limit_tok_s']:>12}"
        f"{sc['memory_limit_tok_s']:>12}",
        f"  {'tg (tok/s), 256 cached':24}{lc['tg_tok_s']:>12}{sc['tg_tok_s']:>12}"
        f"{ratio['tg']:>20}",
        f"  {'pp512 (tok/s)':24}{lc['pp512_tok_s']:>12}{sc['pp512_tok_s']:>12}"
        f"{ratio['pp512']:>20}",
        f"  {'328-token prompt (s)':24}{lc['prompt_s_328']:>12}{sc['first_token_s_328']:>12}"
        "   (llama.cpp: 328 / pp328; specchat: request to first token)",
        f"  llama.cpp tg from an empty cache {lc['tg_empty_cache_tok_s']} tok/s; "
        f"of the memory limit: llama.cpp {lc['of_memory_limit']:.0%}, "
        f"specchat {sc.get('of_memory_limit', 0):.0%}",
        "  specchat verify (rows: plain steps) " + ", ".join(
            f"{n}: {v}" for n, v in sc["verify_vs_step"].items())]
    if "draft" in sc:
        lines.append(f"  draft {r['draft_shape']}: {sc['draft_step_ms']} ms a token, "
                     f"c = {sc['c']}; projected (random weights: no acceptance): " + ", ".join(
                         f"a={a}: {p['speedup']}x at k={p['k']}"
                         for a, p in sc["projected"].items()))
    lines.append(f"  specchat peak RSS {sc['peak_rss_gb']} GB while loading the target and "
                 f"stepping it, {sc.get('rss_gb')} GB resident after")
    lines += [f"  llama.cpp: {c}" for c in lc["commands"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["race"]:
        p = argparse.ArgumentParser(prog="python -m specchat.bench.gguf_shapes race",
                                    description="llama-bench and specchat on one shape's file")
        p.add_argument("--shape", required=True, choices=SHAPE_FAMILIES)
        p.add_argument("--draft-shape", default=None, choices=SHAPE_FAMILIES,
                       help="a draft's shape: its cost c and projected speedups (default: none)")
        p.add_argument("--workdir", type=Path, default=Path("shapes"),
                       help="where the files are written once (default: ./shapes)")
        p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                       help="threads of both sides (default: torch's, %(default)s)")
        p.add_argument("--repetitions", type=int, default=3, help="llama-bench's -r")
        p.add_argument("--json", action="store_true", help="one JSON line instead of the summary")
        args = p.parse_args(argv[1:])
        quiet = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
        result = race(args.shape, args.draft_shape, args.workdir, args.threads,
                      args.repetitions, progress=quiet)
        print(json.dumps(result) if args.json else summary(result))
        return 0
    p = argparse.ArgumentParser(prog="python -m specchat.bench.gguf_shapes",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, choices=SHAPE_FAMILIES)
    p.add_argument("--out", type=Path, required=True, help="the folder the file is written in")
    args = p.parse_args(argv)
    print(shape_file(args.shape, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
