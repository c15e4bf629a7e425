"""What loading a model returns, and the error it raises."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specchat.models.gguf_header import ModelLoadError  # noqa: F401 (where loaders find it)
from specchat.models.runtime import Runtime
from specchat.runners.hf.attention import WIDE, is_row_exact


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str  # what the user asked for (id or path), for display and stats
    quantization: str  # "nf4" | "none" | "bf16 (NF4 unavailable: ...)"
    device: torch.device
    load_s: float
    compute: str = ""  # how it runs, where not obvious: "dequantized once to float32"
    runtime: Runtime | None = None  # the path taken and what it proved (models.runtime)
    # What runs its forwards for the engine (core/runner.py); None: transformers' own
    # (`HFRunner`), made on first use.
    runner_: object = None

    @property
    def runner(self):
        if self.runner_ is None:
            from specchat.runners.hf.runner import HFRunner
            self.runner_ = HFRunner(self.model, self.paged_cache)
        return self.runner_

    @property
    def label(self) -> str:
        how = f", {self.compute}" if self.compute else ""
        where = self.runtime.path if self.runtime is not None else self.device.type
        return f"{self.name} [{self.quantization}{how}, {where}]"

    # -- what the engine reads: capabilities, never CPU details -------------------------------

    @property
    def row_exact(self) -> bool:
        """A verify's logits are the one-token steps' logits, bit for bit: proved at load, or
        (a model built by hand, as in tests) promised by its row-exact attention."""
        if self.runtime is not None:
            return self.runtime.row_exact
        return is_row_exact(self.model)

    @property
    def paged_cache(self) -> bool:
        """Its caches must be `kvcache.PagedLayer`s (the row-exact attention reads keys in
        place, each at the same slot in every call)."""
        return is_row_exact(self.model)

    @property
    def narrow_rows(self) -> int:
        """The most rows a forward computes each exactly as a one-token step does (verifies,
        trees, a prompt's last partial page); wider forwards (a prompt's whole pages) take the
        stock products, faster for many rows."""
        return WIDE - 1

    @property
    def eos_ids(self) -> set[int]:
        """The tokens that end a reply: the model's generation config's and the tokenizer's."""
        ids = set()
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    @property
    def positions(self) -> int | None:
        """The most positions the model reads (its position embeddings), None where unsaid."""
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    @property
    def tree_masks(self) -> bool:
        """Its runner verifies a draft tree in one forward."""
        return self.runner.tree_masks
