"""`HFRunner`: the runner seam (`core.runner`) over transformers' own forward.

The CPU paths for models `cpu_runner.CpuRunner` does not take (`runners.hf.cpu`, `runners.hf.attention`
swap in specchat's kernels and row-exact attention under the same modules) and any model the
CUDA runtime does not take run here:
a `DynamicCache` (paged where the row-exact attention reads keys in place), rolled back by
cropping, draft trees under a tree attention mask, features from hooks on the final norm or on
decoder layers (`features.FeatureTap`).
"""

from __future__ import annotations

import torch

from specchat.core.runner import Runner
from specchat.core.tree import visibility
from specchat.runners.hf.attention import tree_masks_supported
from specchat.runners.hf.features import FeatureTap
from specchat.runners.hf.kvcache import (
    crop_to,
    keep_fed,
    new_cache,
    tree_attention_mask,
)


class HFRunner(Runner):
    layer_features = True

    def __init__(self, model, paged: bool = False):
        self.model = model
        self.paged = paged
        self.device = next(model.parameters()).device
        self.tree_masks = tree_masks_supported(model)
        self.owned_logits = False  # transformers' output, in the model's dtype and device
        self._tap: FeatureTap | None = None

    def new_cache(self):
        return new_cache(self.model, self.paged)

    @torch.inference_mode()
    def forward(self, cache, ids: list[int], start: int, n_logits: int) -> torch.Tensor:
        # (transformers reads logits_to_keep 0 as every row)
        out = self.model(torch.tensor([ids], device=self.device), past_key_values=cache,
                         use_cache=True, logits_to_keep=max(n_logits, 1))
        return out.logits[0, out.logits.shape[1] - n_logits:]

    @torch.inference_mode()
    def forward_tree(self, cache, ids: list[int], parents: list[int],
                     start: int) -> torch.Tensor:
        visible = visibility(parents)
        positions = start + visible.sum(-1).to(self.device) - 1  # depth = ancestors seen
        mask = tree_attention_mask(self.model, cache, start, visible, positions)
        out = self.model(torch.tensor([ids], device=self.device), past_key_values=cache,
                         attention_mask=mask, position_ids=positions[None], use_cache=True,
                         logits_to_keep=len(ids))
        return out.logits[0]

    def crop(self, cache, cached: int, keep: int) -> bool:
        return crop_to(cache, cached, keep)

    def keep_fed(self, cache, fed: int, start: int, keep: list[int]) -> None:
        keep_fed(cache, fed, keep)

    def watch_features(self, layers: tuple[int, ...] | None = None) -> None:
        if self._tap is not None and self._tap.layers != layers:
            self._tap.close()
            self._tap = None
        if self._tap is None:
            self._tap = FeatureTap(self.model, layers)

    def features(self, n: int, rows: list[int] | None = None) -> torch.Tensor:
        return self._tap.features(n, rows)
