"""KV-cache rollback on top of transformers' DynamicCache.

Speculation feeds k+1 tokens to the target and keeps only the accepted ones, so the cache must
shrink after a rejection. transformers 5.x: `cache.crop(-n)` removes the last n tokens (a positive
value raises). Sliding-window layers (Gemma 3, Mistral) drop keys older than the window as they
go, so they can only roll back if `activate_past_recording()` was called: then each forward keeps
its full states until the next `crop`, which trims back to the window. We therefore crop after
every forward (crop(0) when nothing was rejected) and can roll back at most the tokens of the last
forward on a layer that is past its window. `crop_to` checks that and reports when it cannot.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def new_cache(model, paged: bool = False) -> DynamicCache:
    """A cache for `model`'s forwards: every token from slot 0 in every layer, sliding ones
    too, whose mask applies the window (a sliding layer that drops old keys rolls back only
    within its last forward, and its masks disagree with its keys in some transformers
    versions). `paged`: in `PagedLayer`s, what the row-exact attention of `runners.hf.attention`
    needs (each key at the same slot in every call). The model runtime says which a model
    takes (`LoadedModel.paged_cache`)."""
    cache = DynamicCache()
    if paged:
        cache.layer_class_to_replicate = PagedLayer
    return cache


class PagedLayer(DynamicLayer):
    """A full-attention cache layer whose keys/values live in a zero-initialized buffer grown
    `GROW` slots at a time. New states are written in place, where DynamicLayer concatenates
    (a copy of the whole layer per forward). `keys` / `values` stay views of the cached tokens,
    so everything that reads, crops or rewrites them works unchanged; the buffer's spare slots
    let the row-exact attention (`runners.hf.attention`) pad the keys to a page without copying
    them: `has_spare_slots` tells it which key tensors are such views."""

    GROW = 256  # slots; a multiple of attention.PAGE

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._buffers = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cached = self.get_seq_length()
        total = cached + key_states.shape[-2]
        buffers = self._buffers
        if buffers is None or total > buffers[0].shape[-2] \
                or (cached and self.keys.data_ptr() != buffers[0].data_ptr()):
            # first use, full, or `keys` replaced by another tensor: a new buffer
            shape = (*key_states.shape[:2], -(-total // self.GROW) * self.GROW + self.GROW,
                     key_states.shape[-1])
            buffers = tuple(torch.zeros(shape, dtype=s.dtype, device=s.device)
                            for s in (key_states, value_states))
            if cached:
                buffers[0][:, :, :cached] = self.keys
                buffers[1][:, :, :cached] = self.values
            self._buffers = buffers
        buffers[0][:, :, cached:total] = key_states
        buffers[1][:, :, cached:total] = value_states
        self.keys, self.values = buffers[0][:, :, :total], buffers[1][:, :, :total]
        for view in (self.keys, self.values):
            view._paged = True  # see `has_spare_slots`
        return self.keys, self.values

    def reset(self) -> None:
        self._buffers = None
        super().reset()


def has_spare_slots(states: torch.Tensor) -> bool:
    """Whether `states` is a `PagedLayer`'s keys or values: a view at the start of a buffer
    whose slots past the view hold zeros or older states (finite values a masked read may
    touch)."""
    return getattr(states, "_paged", False)


def can_crop(cache: DynamicCache, remove: int) -> bool:
    """Can `remove` trailing tokens be dropped from every layer without losing needed states?"""
    for layer in cache.layers:
        window = getattr(layer, "sliding_window", None)
        keys = getattr(layer, "keys", None)
        if window is None or keys is None or not getattr(layer, "is_initialized", False):
            continue
        total = layer.cumulative_length
        needed = min(window - 1, total - remove)  # states the next forward must still see
        if keys.shape[-2] < remove + needed:
            return False
    return True


def crop_to(cache: DynamicCache, cached_len: int, keep: int) -> bool:
    """Shrink a cache holding `cached_len` tokens to its first `keep`. False if impossible
    (the caller must then start a fresh cache and re-encode)."""
    remove = cached_len - keep
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cached_len} tokens to {keep}")
    if cached_len == 0:
        return True  # nothing cached yet (layers are initialized lazily by the first forward)
    if remove and not can_crop(cache, remove):
        return False
    cache.crop(-remove)  # -0 == 0: trims sliding layers back to their window
    return True


# -- draft trees (specchat/tree.py) ------------------------------------------------------------




def tree_attention_mask(model, cache: DynamicCache, cached_len: int, visible: torch.Tensor,
                        positions: torch.Tensor):
    """The `attention_mask` for a forward that feeds Q new tokens arranged as a tree after
    `cached_len` cached ones: new token i sees every cached token (within the sliding window,
    measured in positions: a node's position is its depth, not its slot) and the new tokens
    visible[i] marks (itself and its ancestors). positions [Q]: each new token's position.

    Returns what the model's forward takes: a dict {layer type: [1, 1, Q, KV] mask} for models
    with `layer_types` (Gemma 3, Qwen2, ...), else one mask; bool for sdpa, additive float for
    eager. Only for models where `tree_masks_supported`."""
    config = model.config.get_text_config()
    impl = getattr(config, "_attn_implementation", None) or "eager"
    dtype = next(model.parameters()).dtype
    q = visible.shape[0]
    device = positions.device

    def one(layer_idx: int, window: int | None) -> torch.Tensor:
        layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
        if layer is not None and getattr(layer, "is_initialized", False):
            kv_length, kv_offset = layer.get_mask_sizes(q)
        else:
            kv_length, kv_offset = q + cached_len, 0
        slots = torch.arange(kv_offset, kv_offset + kv_length, device=device)
        past = slots < cached_len
        allowed = torch.zeros(q, kv_length, dtype=torch.bool, device=device)
        see_past = past[None, :].expand(q, -1)
        if window is not None:  # the sliding-window rule in positions: q - kv < window
            see_past = see_past & (positions[:, None] - slots[None, :] < window)
        allowed[:, past] = see_past[:, past]
        allowed[:, ~past] = visible.to(device)
        mask = allowed[None, None]
        if impl == "eager":
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
                ~mask, torch.finfo(dtype).min)
        return mask

    types = getattr(config, "layer_types", None)
    if not types:
        return one(0, None)
    masks = {}
    for kind in dict.fromkeys(types):
        window = getattr(config, "sliding_window", None) if kind == "sliding_attention" else None
        masks[kind] = one(types.index(kind), window)
    return masks


@torch.inference_mode()
def keep_fed(cache: DynamicCache, fed: int, keep: list[int]) -> None:
    """After a forward that fed `fed` tokens, keep only those at indices `keep` (increasing) of
    the fed ones, in that order: the root and the accepted path of a draft tree. Then trim
    sliding layers back to their window, as `crop_to` does."""
    index = None
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False) or layer.keys is None:
            continue
        if index is None or index.device != layer.keys.device:
            index = torch.tensor(keep, dtype=torch.long, device=layer.keys.device)
        for name in ("keys", "values"):  # in place: the cache owns these tensors
            states = getattr(layer, name)
            start = states.shape[2] - fed
            states[:, :, start:start + len(keep)] = states[:, :, start:].index_select(2, index)
            setattr(layer, name, states[:, :, :start + len(keep)])
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length -= fed - len(keep)
    cache.crop(0)
