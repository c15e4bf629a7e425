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

from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache


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
