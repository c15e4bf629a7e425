"""Wires models and drafters into an Engine: the target, every drafter that can work with it,
and what the user should know about what was refused."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

from specchat.core.engine import MAX_PROMPT_TOKENS, Engine
from specchat.core.prefix import PREFIX_CACHE_TOKENS
from specchat.drafters.combined import CombinedDrafter
from specchat.drafters.head import HeadDrafter
from specchat.models.eagle3 import fetch, is_eagle3, is_hub_id, load_eagle3
from specchat.models.eagle_files import (
    HeadMismatchError,
    any_heads,
    find_head,
    load_head,
    target_identity,
)
from specchat.runners.memory import drop_read_pages, limit_malloc_arenas, release_freed_memory


@dataclass
class LoadReport:
    engine: Engine
    draft: object | None  # models.LoadedModel of the draft, when one loaded and fits
    notes: list[str]  # things the user should know (fallbacks, refused drafts)


def load_engine(target: str = "embedded", draft_model: str = "", quantization: str = "nf4",
                draft_quantization: str = "auto", device: str | None = None,
                progress=print, head: str | None = None,
                prefix_tokens: int = PREFIX_CACHE_TOKENS,
                max_prompt_tokens: int | None = MAX_PROMPT_TOKENS,
                strict_draft: bool = False) -> LoadReport:
    """Load a target (and optionally a draft model) and build an Engine with every drafter that
    can work: n-gram lookup always, the draft model when its vocabulary matches the target's,
    `head` and `combined` when a draft head trained for this target exists (`head`: a file
    from `train-draft`, or a public EAGLE-3 head's directory; default: the one trained or
    shipped for this target, if any).
    `draft_quantization` "auto": NF4 on a CPU (where the draft then runs specchat's own forward,
    a C call a token on the target's integer kernels), unquantized elsewhere; "nf4-head": NF4
    with the LM head in NF4 too on the integer path, where a target's stays the file's own
    type or Q8_0.
    `prefix_tokens`: the engine's prefix store (core/prefix.py), in tokens;
    `max_prompt_tokens`: the longest prompt a request may bring (0 or None: no limit but the
    model's context window).
    `strict_draft`: a draft model whose vocabulary does not match the target's raises
    ModelLoadError saying what differs (the page's Models tab: nothing is swapped in), rather
    than being left out with a note."""
    from specchat.drafters.model import ModelDrafter
    from specchat.drafters.ngram import NgramDrafter
    from specchat.models.load import load_model
    from specchat.models.vocab import vocab_mismatch

    limit_malloc_arenas()  # before the replies' threads: their arenas would keep freed memory
    tgt = load_model(target, quantization, device, progress)
    notes: list[str] = []
    # Before the engine: an EAGLE-3 head may move the target to another runner.
    found, head_notes = head_drafters(tgt, NgramDrafter(), head or None)
    engine = Engine(tgt, {"ngram": NgramDrafter(), **found},  # "head", "combined"
                    prefix_tokens, max_prompt_tokens)
    notes += head_notes
    draft = None
    if draft_model:
        # "nf4-head": the LM head in NF4 too, on the integer path (fewer bytes a draft token,
        # fewer of its tokens accepted: docs/performance.md, "A draft's LM head in NF4")
        four_bit_head = draft_quantization == "nf4-head"
        if four_bit_head:
            draft_quantization = "nf4"
        if draft_quantization == "auto":
            draft_quantization = "nf4" if tgt.device.type == "cpu" else "none"
        draft = load_model(draft_model, draft_quantization, device, progress,
                           nf4_head=four_bit_head)
        problem = vocab_mismatch(tgt.tokenizer, draft.tokenizer, _logits_width(tgt.model),
                                 _logits_width(draft.model))
        if problem and strict_draft:
            from specchat.models.loaded import ModelLoadError
            raise ModelLoadError(f"Draft model {draft.name} refused: its vocabulary does not "
                                 f"match the target's ({problem}).")
        if problem:
            notes.append(f"Draft model {draft.name} refused, n-gram drafter used instead: "
                         f"its vocabulary does not match the target's ({problem}).")
            draft = None
        else:
            engine.drafters["model"] = ModelDrafter(draft.model, engine.vocab_size,
                                                    paged=draft.paged_cache,
                                                    runner=draft.runner)
    # What the steps after the weights' loading freed (the head's quantization's temporaries)
    # back to the OS, which glibc would keep: about 80 MB on the embedded target; and the
    # pages loading read of a table that decoding reads a row at a time (docs/performance.md).
    gc.collect()
    release_freed_memory()
    drop_read_pages(tgt.model)
    if draft is not None:
        drop_read_pages(draft.model)
    return LoadReport(engine, draft, notes)


def release_memory() -> None:
    """What models no longer referenced held, back to the OS: their objects collected, the
    freed buffers that glibc would keep returned, CUDA's cached blocks emptied (after the
    page's Models tab swapped a model out, or a load that failed)."""
    import torch
    gc.collect()
    release_freed_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def connect_backend(url: str, plain_url: str | None = None, api_key: str | None = None,
                    model: str | None = None) -> LoadReport:
    """A serving engine behind an OpenAI-compatible API as the engine (backends/remote.py);
    the note says how much of each token's provenance that server reports."""
    from specchat.backends.remote import BackendError, RemoteEngine
    from specchat.models.loaded import ModelLoadError
    try:
        engine = RemoteEngine(url, api_key, model, plain_url)
    except BackendError as e:
        raise ModelLoadError(str(e)) from None
    notes = [engine.provenance]
    if engine.speculates is False:
        notes.append(f"The {engine.target.server} server does not speculate (no draft was "
                     "given at its launch): every token is a plain target token.")
    return LoadReport(engine, None, notes)


def _logits_width(model) -> int:
    return model.config.get_text_config().vocab_size


# A draft token costs a head step and widens the verify (together a small fraction of a target
# step, as the bench's c and verify ratio show); below this estimated chance of passing it does
# not pay for itself.
MIN_GAIN = 0.15


def head_drafters(target, ngram, path: str | Path | None = None,
                  min_gain: float = MIN_GAIN) -> tuple[dict, list[str]]:
    """Drafters `head` and `combined` for a models.LoadedModel target, when a head for it exists
    (or `path` names one: a specchat head file, or a public EAGLE-3 head's directory or hub
    id).
    Returns (drafters, notes for the user)."""
    if path is not None and (is_eagle3(path) or is_hub_id(path)):
        return _eagle3_drafters(target, ngram, path, min_gain)
    if path is None and not any_heads():
        return {}, []
    identity = target_identity(target.model, target.tokenizer, target.name)
    path = path or find_head(identity)
    if path is None:
        return {}, []
    try:
        head = load_head(path, target.model, target.tokenizer, identity)
    except HeadMismatchError as e:
        return {}, [f"Draft head refused: {e}"]
    release_freed_memory()  # the file's and the LM rows' buffers: before the copies below
    runtime = target.runtime
    drafter = HeadDrafter(head, target.model, len(target.tokenizer), min_gain,
                          lib=runtime.kernels if runtime is not None else None)
    return {"head": drafter, "combined": CombinedDrafter(ngram, drafter)}, []


def _eagle3_drafters(target, ngram, path, min_gain: float) -> tuple[dict, list[str]]:
    """`head` and `combined` drafting with a public EAGLE-3 head (models/eagle3.py). The head
    reads hidden states of the target's decoder layers: a runner that gives only the final
    norm's (`Runner.layer_features` False: specchat's CUDA runtime) gives way to transformers'
    forward, which hooks read."""
    from specchat.models.load import use_transformers_forward
    try:
        head = load_eagle3(fetch(str(path)) if is_hub_id(path) else path, target.model)
    except HeadMismatchError as e:
        return {}, [f"Draft head refused: {e}"]
    notes = []
    if not target.runner.layer_features:
        before = type(target.runner).__name__
        lossless = use_transformers_forward(target)
        notes.append(f"The EAGLE-3 head reads the target's layers {list(head.feature_layers)}, "
                     f"which {before} does not give: the target runs on transformers' forward "
                     f"instead{'; ' + lossless if lossless else ''}.")
    runtime = target.runtime
    drafter = HeadDrafter(head, target.model, len(target.tokenizer), min_gain,
                          lib=runtime.kernels if runtime is not None else None)
    drafter.source = str(path)  # the hub id or directory the user named
    return {"head": drafter, "combined": CombinedDrafter(ngram, drafter)}, notes
