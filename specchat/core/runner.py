"""The seam between the decode loop and the model that runs the target.

The engine never calls a model directly: it asks its runner for a cache, feeds tokens at
positions, rolls back, keeps a draft tree's path, and reads the features the EAGLE head drafts
from. Three rooms implement it under `runners/`, as ggml-cpu and ggml-cuda sit behind ggml-backend:

| runner                        | runs                                                           |
| ----------------------------- | -------------------------------------------------------------- |
| `runners.hf.runner.HFRunner`   | transformers' forward with a `DynamicCache` (any model on any device) |
| `runners.cpu.runner.CpuRunner` | a Gemma 3 target's decoder stack in one C call on the CPU kernel paths |
| `runners.cuda.runner.CudaRunner` | specchat's own forward on CUDA: a static cache, one padded decode width, CUDA graphs, Triton kernels |

`models.load.load_model` loads the weights and `runners.use_cpu_runner` / `use_cuda_runtime` pick
one (`LoadedModel.runner`).

Every runner subclasses `Runner`. What a runner may or may not do is declared here with the
value that means "not supported", as ggml-backend declares its optional entries NULL: a runner
overrides the capabilities it has, and the engine reads them as attributes, never by probing.
"""

from __future__ import annotations

from typing import Any

import torch


class Runner:
    # -- capabilities: "not supported" unless a runner says otherwise -------------------------

    tree_masks: bool = False  # forward_tree is supported (draft trees verified in one forward)
    # forward's and forward_tree's logits are a new float32 CPU tensor each call, the caller's
    # own to change: the engine masks and penalizes them in place instead of copying a row of
    # the whole vocabulary first. False: they may be a buffer the runner reuses, or on a GPU.
    owned_logits: bool = False
    # the most tokens (prompt + reply) its cache holds: a static cache's slots; None: it grows
    context: int | None = None
    # A native sampler over its own logits (`CpuRunner.shape_pick`, csrc/sample.c), for runners
    # with `owned_logits`; None: the engine's Python sampler.
    shape_pick = None
    # `row_evidence(row, n, temperature, min_p, also)`: what the inspector shows of a step's
    # decisive row of its own logits, natively (`CpuRunner.row_evidence`); None: torch's.
    row_evidence = None
    # `watch_features(layers)` with layers: the hidden states entering chosen decoder layers
    # (an EAGLE-3 head's features). False: only the final norm's output.
    layer_features: bool = False

    def skip_logits_from(self, start: int) -> bool:
        """Ids start.. to the vocabulary's end are never sampled: True where the runner then
        returns their logits as -inf (uncomputed); False where it computes them all."""
        return False

    # -- what every runner does ----------------------------------------------------------------

    def new_cache(self) -> Any:
        """An empty cache (what forward writes into)."""
        raise NotImplementedError

    def forward(self, cache: Any, ids: list[int], start: int, n_logits: int) -> torch.Tensor:
        """Feed `ids` at positions start.. after the `start` tokens the cache holds; the logits
        of the last n_logits rows [n_logits, vocab or wider], on the target's device (n_logits
        0: none, [0, vocab or wider], for a prompt's page whose logits nobody reads: a runner
        may skip its LM head there, which changes nothing else). The
        engine calls it outside autograd's inference mode: a runner whose forward would
        otherwise record autograd's graph (a module's parameters) enters the mode itself."""
        raise NotImplementedError

    def forward_tree(self, cache: Any, ids: list[int], parents: list[int],
                     start: int) -> torch.Tensor:
        """Feed a root ids[0] and a draft tree ids[1:] (node i a child of parents[i], -1 the
        root) after `start` cached tokens, each node at the position of its depth; logits
        [len(ids), vocab]. Only where `tree_masks`."""
        raise NotImplementedError

    def crop(self, cache: Any, cached: int, keep: int) -> bool:
        """Forget all but the first `keep` of `cached` tokens; False where the cache cannot
        (the engine then starts a new one)."""
        raise NotImplementedError

    def keep_fed(self, cache: Any, fed: int, start: int, keep: list[int]) -> None:
        """After a forward that fed `fed` tokens at start.., keep only the fed tokens at the
        indices `keep` (increasing), moved to start, start + 1, ...: a tree's accepted path."""
        raise NotImplementedError

    def watch_features(self, layers: tuple[int, ...] | None = None) -> None:
        """From now on, keep each forward's features: the final norm's output (layers None),
        or the hidden states entering decoder layers `layers`, concatenated in that order
        (index L, one past the last layer, is the last layer's output). Layers only where
        `layer_features`."""
        raise NotImplementedError

    def features(self, n: int, rows: list[int] | None = None) -> torch.Tensor:
        """The latest forward's features (the kind `watch_features` asked for): its first n
        rows, or the rows `rows`. [n, width], a tensor no later forward overwrites (a drafter
        may keep it a while before storing it)."""
        raise NotImplementedError
