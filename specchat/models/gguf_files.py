"""A GGUF file the user already has (`--target FILE.gguf`, `--draft-model DIR` holding one),
converted once into a bf16 HF checkpoint in specchat's cache and then loaded like any model.

The checkpoint runs what llama.cpp runs from the file:
- the config comes from the metadata through transformers' table of GGUF keys
  (`GGUF_TO_TRANSFORMERS_MAPPING`) and what its `load_gguf_checkpoint` sets per architecture,
  plus what llama.cpp reads that the table leaves out: Qwen 3's head width, Gemma 2's soft-caps,
  Gemma's attention scale, a rotary width below the head's, and RoPE scaling (the `rope.scaling`
  keys; Llama 3's as a `rope_freqs` tensor; Phi 3's long-context factors as two tensors);
- the weights are dequantized by the gguf package, put back in HF's layout by transformers'
  `TENSOR_PROCESSORS` (Llama's q/k rows un-permuted, Gemma's 1 + w norms turned back into w) and
  written one tensor at a time into bf16 safetensors shards: memory holds the shard being built
  and the tensor being converted, in float32 and bf16 (Llama 3 8B's embedding: about 3 GB), never
  the whole model;
- the tokenizer is transformers' GGUF tokenizer builder's, chat template included, and the
  generation config ends a reply on the tokens llama.cpp ends one on.

The header and tensor table are read by `read_gguf` (the vocabulary's strings skipped, only
counted), which checks every tensor's type and extent against the file before anything is
converted; the embedded model's conversion (models/embedded.py) reads its file the same way.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from specchat.models.gguf_header import (  # noqa: F401 (read_gguf: this module's API too)
    WHAT_WORKS,
    GgufHeader,
    ModelLoadError,
    Tensor,
    read_gguf,
)
from specchat.paths import cache_dir

# GGUF architectures (`general.architecture`) -> transformers model types. llama.cpp writes
# Llama 2/3.x, SmolLM 2 and Mistral 7B / Nemo as "llama", which a Llama config runs as llama.cpp
# does (no sliding window).
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
            "gemma3": "gemma3_text", "phi3": "phi3"}
# Tensors llama.cpp writes that hold RoPE parameters, not weights: read into the config.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
SHARD_BYTES = 2 << 30  # bf16 bytes a safetensors shard holds at most (one larger tensor alone)
CHUNK_VALUES = 1 << 23  # values dequantized at a time (32 MB of float32)
# The token texts llama.cpp ends a reply on besides the file's end-of-text ids (llama-vocab.cpp,
# its end-of-generation tokens found by text): a chat model's end of turn.
END_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
             "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>", "<end_of_utterance>",
             "<|return|>", "<|call|>")
CONVERTING = "Converting {name} from GGUF into a checkpoint in specchat's cache (first use only)..."


# -- which file, and is it one specchat converts ---------------------------------------------

def is_gguf(path: Path) -> bool:
    """Whether a --target path names a GGUF model: a file ending in .gguf or starting with
    GGUF's magic bytes, or a folder with a .gguf file and no HF weights (a GGUF repo may carry
    its base model's config.json beside the file)."""
    path = Path(path).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return True
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    if path.is_dir():
        weights = any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))
        return not weights and any(p.suffix.lower() == ".gguf" for p in path.iterdir())
    return False


def model_file(path: Path) -> Path:
    """The GGUF file a --target path names: the file, or a folder's one model file (vision
    projectors, `mmproj*.gguf`, set aside)."""
    path = Path(path).expanduser()
    if path.is_file():
        return path
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf")
    models = [p for p in found if not p.name.lower().startswith("mmproj")]
    if not models:
        raise ModelLoadError(f"{path} holds no model GGUF, only a vision projector "
                             f"({', '.join(p.name for p in found)}): {WHAT_WORKS}")
    if len(models) > 1:
        if all(SPLIT_NAME.search(p.name) for p in models):
            _refuse_split(models[0])
        raise ModelLoadError(f"{path} holds several GGUF models "
                             f"({', '.join(p.name for p in models)}): pass the file you mean")
    return models[0]


def _refuse_split(file: Path) -> None:
    raise ModelLoadError(
        f"{file} is one part of a split GGUF: merge the parts into one file first, e.g. "
        f"`llama-gguf-split --merge {file.name} merged.gguf` (llama.cpp's tool, given the "
        "first part), then pass merged.gguf")


def checkpoint_dir(file: Path) -> Path:
    """Where a file's checkpoint lives in the cache: named by the file's stem and a hash of
    its identity (absolute path, size, modification time, first and last MiB), so that another
    file, or this one changed, gets a checkpoint of its own."""
    stat = file.stat()
    digest = hashlib.sha256(f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    with open(file, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, stat.st_size - (1 << 20)))
        digest.update(f.read(1 << 20))
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", file.stem)[:80]
    return cache_dir() / "models" / f"gguf-{stem}-{digest.hexdigest()[:12]}"


def gguf_checkpoint(path: Path, progress=print) -> Path:
    """A GGUF file (or a folder holding one) as a HF checkpoint directory, converted on first
    use; later uses find it in the cache without reading the file's weights."""
    file = model_file(path)
    if SPLIT_NAME.search(file.name):
        _refuse_split(file)
    out = checkpoint_dir(file)
    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    header = check_gguf(file)
    progress(CONVERTING.format(name=file.name))
    return write_checkpoint(out, lambda tmp: convert(header, tmp))


def write_checkpoint(out: Path, write) -> Path:
    """`write(folder)` into a sibling of `out`, renamed to `out` once whole: a failed or killed
    conversion never leaves a half checkpoint, and two processes converting at once both end
    with the one that won the rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # per process: two may convert at once
    shutil.rmtree(tmp, ignore_errors=True)  # a killed conversion's, under a reused process id
    try:
        write(tmp)
        tmp.rename(out)  # atomic
    except OSError:
        if not (out / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed conversion's, or one that lost the race
    return out


def check_gguf(file: Path) -> GgufHeader:
    """The file's header, once it is known to be one model whole (not a split part), of a
    supported family, with tensors of types the gguf package dequantizes."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    header = read_gguf(file)
    if header.metadata.get("split.count", 1) > 1:
        _refuse_split(file)
    if header.arch not in FAMILIES:
        raise ModelLoadError(f"{file}: GGUF architecture {header.arch!r} is not supported; "
                             f"specchat converts {', '.join(FAMILIES)}")
    if "tokenizer.ggml.tokens" not in header.metadata:
        raise ModelLoadError(f"{file} holds no tokenizer (tokenizer.ggml.tokens), which "
                             "specchat takes from the file")
    for kind in {t.kind for t in header.tensors.values()}:
        ggml = GGMLQuantizationType(kind)
        try:  # one block of zeros: whether the gguf package has this type's dequantizer
            gguf_dequantize(np.zeros((1, GGML_QUANT_SIZES[ggml][1]), np.uint8), ggml)
        except NotImplementedError:
            raise ModelLoadError(f"{file} holds {ggml.name} tensors, which the gguf package "
                                 "cannot dequantize; re-quantize it (e.g. Q4_K_M, Q8_0)") from None
    return header


# -- config ----------------------------------------------------------------------------------

# What llama.cpp reads from a file that transformers' table leaves out: GGUF key (under the
# architecture) -> config field. A table entry for the same field wins.
_MORE_KEYS = {"attention.key_length": "head_dim",  # Qwen 3's head is not hidden / heads wide
              "attn_logit_softcapping": "attn_logit_softcapping",  # Gemma 2
              "final_logit_softcapping": "final_logit_softcapping"}
# Gemma's attention scale in llama.cpp (llama-model.cpp): 1 / sqrt(head_dim), but
# 1 / sqrt(hidden / heads) for the 27B models, known by their layer counts.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def gguf_config(header: GgufHeader):
    """The model's config from the GGUF's metadata, as `AutoConfig.from_pretrained(...,
    gguf_file=...)` builds it from transformers' table of GGUF keys, with what llama.cpp reads
    that the table leaves out (`_MORE_KEYS`, the attention scale, the rotary width, RoPE
    scaling)."""
    from transformers import AutoConfig

    if header.arch not in FAMILIES:
        raise ModelLoadError(f"{header.path}: GGUF architecture {header.arch!r} is not "
                             f"supported; specchat converts {', '.join(FAMILIES)}")
    try:
        return AutoConfig.for_model(**_config_fields(header))
    except KeyError as e:
        raise ModelLoadError(f"{header.path}: its metadata lacks {e}") from e
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"{header.path}: its metadata does not describe a {header.arch} "
                             f"model ({str(e).splitlines()[0]})") from e


def _config_fields(header: GgufHeader) -> dict:
    """The fields `gguf_config` makes its config of."""
    from transformers.modeling_gguf_pytorch_utils import (
        GGUF_CONFIG_DEFAULTS_MAPPING,
        GGUF_TO_TRANSFORMERS_MAPPING,
    )

    metadata, arch = header.metadata, header.arch
    model_type = FAMILIES[arch]
    config = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {}))
    # No separate output weight: the LM head is the token embedding.
    config["tie_word_embeddings"] = "output.weight" not in header.tensors
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        name = renames.get(prefix, {}).get(rest)
        if name not in (None, -1):
            config[name] = value
    for key, name in _MORE_KEYS.items():
        if f"{arch}.{key}" in metadata:
            config.setdefault(name, metadata[f"{arch}.{key}"])
    config["model_type"] = model_type
    config.setdefault("vocab_size", metadata["tokenizer.ggml.tokens"])  # its length
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        config[name] = metadata.get(f"tokenizer.ggml.{key}")  # absent: none, not a default's
    heads_dim = config["hidden_size"] // config["num_attention_heads"]
    head_dim = config.get("head_dim", heads_dim)
    rotary = metadata.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        config["partial_rotary_factor"] = rotary / head_dim
    if arch in _GEMMA_27B_LAYERS:
        big = config["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
        config["query_pre_attn_scalar"] = heads_dim if big else head_dim
    scaling = _rope_scaling(header, config)
    if scaling:
        config["rope_scaling"] = scaling
        if "original_max_position_embeddings" in scaling and arch == "phi3":
            # Phi 3's config holds it beside the scaling as well
            config["original_max_position_embeddings"] = \
                scaling["original_max_position_embeddings"]
    return config


def _rope_scaling(header: GgufHeader, config: dict) -> dict | None:
    """The file's RoPE scaling as transformers' `rope_scaling`: from the `rope.scaling` keys
    (linear, YaRN), Llama 3's `rope_freqs` tensor, or Phi 3's long and short factor tensors."""
    from gguf import Keys

    metadata, arch = header.metadata, header.arch
    key = {name: getattr(Keys.Rope, name).format(arch=arch)
           for name in ("SCALING_TYPE", "SCALING_FACTOR", "SCALING_ORIG_CTX_LEN",
                        "SCALING_ATTN_FACTOR", "SCALING_YARN_BETA_FAST", "SCALING_YARN_BETA_SLOW")}
    if "rope_factors_long.weight" in header.tensors:
        scaling = {"rope_type": "longrope",
                   "long_factor": _small_tensor(header, "rope_factors_long.weight").tolist(),
                   "short_factor": _small_tensor(header, "rope_factors_short.weight").tolist(),
                   "original_max_position_embeddings":
                       metadata.get(key["SCALING_ORIG_CTX_LEN"], config["max_position_embeddings"])}
        if key["SCALING_ATTN_FACTOR"] in metadata:
            scaling["attention_factor"] = metadata[key["SCALING_ATTN_FACTOR"]]
        return scaling
    if "rope_freqs.weight" in header.tensors:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return llama3_rope_scaling(_small_tensor(header, "rope_freqs.weight"),
                                   config.get("rope_theta", 10000.0), head_dim, header.path)
    kind = metadata.get(key["SCALING_TYPE"], "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": metadata[key["SCALING_FACTOR"]]}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": metadata[key["SCALING_FACTOR"]]}
        for name, field in (("SCALING_ORIG_CTX_LEN", "original_max_position_embeddings"),
                            ("SCALING_YARN_BETA_FAST", "beta_fast"),
                            ("SCALING_YARN_BETA_SLOW", "beta_slow")):
            if key[name] in metadata:
                scaling[field] = metadata[key[name]]
        return scaling
    if kind != "none":
        raise ModelLoadError(f"{header.path}: RoPE scaling {kind!r} is not supported "
                             "(linear, yarn, Llama 3's and Phi 3's are)")
    return None


def llama3_rope_scaling(freq_factors: np.ndarray, theta: float, head_dim: int,
                        path: Path | str = "") -> dict | None:
    """Llama 3's RoPE scaling (transformers' "llama3" parameters) from the divisors llama.cpp
    stores for each frequency (`rope_freqs`): `factor` divides the low frequencies, 1 the high
    ones, and between them the divisor is 1 / ((1 - s) / factor + s) for s linear in the
    frequency. Meta's constants (low 1, high 4, 8192 positions) are tried first, else s's line
    is fitted; either is kept only if transformers' own "llama3" frequencies then equal the
    file's."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    factors = np.asarray(freq_factors, np.float64)
    factor = float(factors.max())
    if np.allclose(factors, 1):
        return None
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    inside = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    tries = [(1.0, 4.0, 8192)]
    if inside.sum() >= 2:
        smooth = (1 / factors[inside] - 1 / factor) / (1 - 1 / factor)
        slope, offset = np.polyfit(freqs[inside], smooth, 1)  # s = slope * freq + offset
        high = 1 - 1 / offset  # with low = 1: offset = -low / (high - low)
        high = round(float(high), 4)
        tries.append((1.0, high, round(slope * 2 * math.pi * (high - 1))))
    expected = torch.from_numpy(freqs / factors).float()
    for low, high, original in tries:
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                   "high_freq_factor": high, "original_max_position_embeddings": original}
        config = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
                             max_position_embeddings=int(original * factor), rope_theta=theta,
                             rope_scaling=dict(scaling))
        inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        if torch.allclose(inv_freq, expected, rtol=1e-4, atol=0):
            return scaling
    raise ModelLoadError(f"{path}: its rope_freqs tensor is not Llama 3's RoPE scaling, "
                         "which is the only one specchat reads from that tensor")


def _small_tensor(header: GgufHeader, name: str) -> np.ndarray:
    with open(header.path, "rb") as f:
        return read_values(f, header.tensors[name], header.path)


# -- weights ---------------------------------------------------------------------------------

def tensor_names(header: GgufHeader, model) -> dict[str, str]:
    """GGUF tensor name -> `model`'s parameter name for every tensor of the file, by the gguf
    package's table of names (llama.cpp's "blk.3.attn_q" for "model.layers.3.self_attn.q_proj"),
    as transformers' GGUF loading maps them. Refuses a file whose tensors do not fit `model`
    (one missing, one with no place in it, or of another shape), naming them."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = {name: enum for enum, name in MODEL_ARCH_NAMES.items()}[header.arch]
    table = get_tensor_name_map(arch, model.config.num_hidden_layers)
    params = model.state_dict()
    places = {}
    for name in params:
        module, _, kind = name.rpartition(".")
        gguf_name = table.get_name(module)
        if gguf_name is not None:
            places[f"{gguf_name}.{kind}"] = name
    names = {g: places[g] for g in header.tensors if g in places}
    file = header.path
    unplaced = [g for g in header.tensors if g not in places and g not in ROPE_TENSORS]
    if unplaced:
        raise ModelLoadError(f"{file}: tensors a {header.arch} model has no place for: "
                             f"{', '.join(unplaced[:6])}{' ...' if len(unplaced) > 6 else ''}")
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(set(params) - set(names.values()) - tied)
    if missing:
        raise ModelLoadError(f"{file}: weights its metadata's model needs and the file lacks: "
                             f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    for gguf_name, name in names.items():
        shape, expected = header.tensors[gguf_name].shape, tuple(params[name].shape)
        if shape != expected:
            raise ModelLoadError(f"{file}: tensor {gguf_name} is {shape}, where the model its "
                                 f"metadata describes has {name} {expected}")
    return names


def gguf_weights(header: GgufHeader, model, names: dict[str, str]):
    """(parameter name, bf16 values) of each tensor in `names`, in the file's order, read and
    dequantized one at a time; each is rounded from its float32 values, as
    `model.to(torch.bfloat16)` would round them."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    # Llama's processor un-permutes q and k (llama.cpp interleaves each head's rotary halves);
    # Gemma's turns the GGUF's RMSNorm weights (llama.cpp stores 1 + w) back into w.
    processor = TENSOR_PROCESSORS.get(header.arch, TensorProcessor)(config=model.config.to_dict())
    with open(header.path, "rb") as f:
        for gguf_name, tensor in header.tensors.items():
            if gguf_name in names:
                values = read_values(f, tensor, header.path)
                values = processor.process(weights=values, name=gguf_name).weights
                yield names[gguf_name], \
                    torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16)


def read_values(f, tensor: Tensor, path: Path | str = "") -> np.ndarray:
    """A tensor's float32 values from the open file `f`, read and dequantized a few rows at a
    time (`CHUNK_VALUES`): the gguf package's dequantizers make several whole-size temporaries,
    so a 2 GB embedding never needs more than its own float32 copy."""
    cols = tensor.shape[-1] if tensor.shape else 1
    rows = math.prod(tensor.shape[:-1])
    row_bytes = tensor.size // rows
    out = np.empty((rows, cols), np.float32)
    step = max(1, CHUNK_VALUES // cols)
    raw = np.empty(min(step, rows) * row_bytes, np.uint8)
    f.seek(tensor.start)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        part = raw[:n * row_bytes]
        if f.readinto(part) != part.nbytes:
            raise ModelLoadError(f"{path} is truncated: it ends inside a tensor's data")
        out[r:r + n] = dequantize(part, Tensor((n, cols), tensor.kind, 0, part.nbytes))
    return out.reshape(tensor.shape)


_Q8_0 = 8  # ggml's type number of Q8_0: blocks of an fp16 scale and 32 int8 values


def dequantize(raw: np.ndarray, tensor: Tensor) -> np.ndarray:
    """A tensor's float32 values from its bytes, as the gguf package computes them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quant_shape_to_byte_shape

    if tensor.kind != _Q8_0:
        kind = GGMLQuantizationType(tensor.kind)
        return gguf_dequantize(raw.reshape(quant_shape_to_byte_shape(tensor.shape, kind)), kind)
    # Q8_0 (often the token embedding): the gguf package's products (int8 value times float32
    # scale, one rounding each), on torch's threads: a few times faster.
    blocks = torch.from_numpy(raw).view(-1, 34)
    scale = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)
    return (blocks[:, 2:].view(torch.int8).to(torch.float32) * scale).view(tensor.shape).numpy()


def write_shards(header: GgufHeader, model, names: dict[str, str], out: Path) -> None:
    """The file's weights as bf16 safetensors in `out`: `model.safetensors`, or shards of at
    most `SHARD_BYTES` with `model.safetensors.index.json`, as `save_pretrained` lays them
    out. A shard is written once its last tensor is converted, and then dropped."""
    from safetensors.torch import save_file
    from transformers.utils.logging import tqdm

    order = [g for g in header.tensors if g in names]
    sizes = {g: math.prod(header.tensors[g].shape) * 2 for g in order}
    shards, size = [[]], 0
    for g in order:
        if shards[-1] and size + sizes[g] > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += sizes[g]
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    shard_of = {g: i for i, shard in enumerate(shards) for g in shard}
    last = {shard[-1] for shard in shards}
    pending: dict[str, torch.Tensor] = {}
    weights = gguf_weights(header, model, names)
    with tqdm(total=len(order), desc=f"Converting {header.path.name}", unit="tensor") as bar:
        for g, (name, values) in zip(order, weights):
            pending[name] = values
            bar.update()
            if g in last:
                save_file(pending, out / files[shard_of[g]], metadata={"format": "pt"})
                pending = {}
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {names[g]: files[shard_of[g]] for g in sorted(order, key=names.get)}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# -- tokenizer -------------------------------------------------------------------------------

def gguf_tokenizer(gguf: Path, model_type: str):
    """The GGUF's tokenizer, built as `AutoTokenizer.from_pretrained(..., gguf_file=...)` builds
    it (transformers' GGUF tokenizer builder: the vocabulary, merges from the file or rebuilt
    from it, control tokens special, the pre-tokenizer its `tokenizer.ggml.pre` names, the chat
    template, BOS and EOS), of the class AutoTokenizer picks for `model_type`, without the
    model config that `AutoTokenizer` would first parse the whole file for."""
    return tokenizer_class(model_type)(name_or_path=str(gguf.parent), gguf_file=gguf.name)


def tokenizer_class(model_type: str):
    """The tokenizer class AutoTokenizer picks for a model type: its registered one, else the
    plain tokenizers backend."""
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    name = TOKENIZER_MAPPING_NAMES.get(model_type)
    return (tokenizer_class_from_name(name) if name else None) or TokenizersBackend


def end_ids(header: GgufHeader, tokenizer) -> list[int]:
    """The tokens that end a reply, as llama.cpp ends one: the file's end-of-text, end-of-turn
    and end-of-message ids, and its special tokens of `END_TEXTS`."""
    from gguf import Keys

    ids = [header.metadata.get(k) for k in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID,
                                            Keys.Tokenizer.EOM_ID)]
    special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    ids += [special[text] for text in END_TEXTS if text in special]
    return sorted({i for i in ids if i is not None})


# -- the conversion --------------------------------------------------------------------------

def convert(header: GgufHeader, out: Path) -> None:
    """Write a checked GGUF (`check_gguf`) as a HF checkpoint directory `out`: config, bf16
    weight shards, generation config and tokenizer."""
    # Imported here, with what the tokenizer's thread will use: two threads importing modules
    # that import each other could see them half initialized.
    import transformers.integrations.gguf.gguf_tokenizer_mapping  # noqa: F401
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = gguf_config(header)
    with torch.device("meta"):  # the model's structure only: its parameters' names and shapes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    names = tensor_names(header, model)
    cls = tokenizer_class(config.model_type)
    out.mkdir(parents=True)
    # The tokenizer is pure Python; the weights are numpy and torch work that releases the GIL.
    with ThreadPoolExecutor(1) as pool:
        tokenizer = pool.submit(cls, name_or_path=str(header.path.parent),
                                gguf_file=header.path.name)
        write_shards(header, model, names, out)
        try:
            tokenizer = tokenizer.result()
        except (ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{header.path}: its tokenizer cannot be built "
                                 f"({str(e).splitlines()[0]})") from e
    config.architectures = [type(model).__name__]
    config.dtype = torch.bfloat16  # what the shards hold
    config.save_pretrained(out)
    generation = GenerationConfig.from_model_config(config)
    ends = [i for i in end_ids(header, tokenizer) if i < config.vocab_size]
    if ends:
        generation.eos_token_id = ends[0] if len(ends) == 1 else ends
    generation.save_pretrained(out)
    tokenizer.save_pretrained(out)
    drop_tokens_past(out, header.metadata["tokenizer.ggml.tokens"])


def drop_tokens_past(out: Path, count: int) -> None:
    """Drop from a saved tokenizer the tokens past the file's `count`, which have no row in the
    model's embedding or logits: the builder's classes add their default special tokens where
    the vocabulary has none (GPT-2's `<|endoftext|>` to Llama 3's, Gemma's `<mask>`)."""
    backend = out / "tokenizer.json"
    data = json.loads(backend.read_text(encoding="utf-8"))
    dropped = {t["content"] for t in data["added_tokens"] if t["id"] >= count}
    if not dropped:
        return
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < count]
    backend.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")
    settings = out / "tokenizer_config.json"
    config = json.loads(settings.read_text(encoding="utf-8"))
    for key, value in config.items():  # the special-token roles they held, now unfilled
        if isinstance(value, str) and value in dropped:
            config[key] = None
        elif isinstance(value, list):
            config[key] = [v for v in value if v not in dropped]
    settings.write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
