"""Attention whose every query row computes exactly what a one-token decoding step computes.

Speculative decoding is lossless in distribution whatever the arithmetic, but a user toggling
speculation expects the same greedy reply, and on a bf16 / NF4 target the stock attention does
not give it: a verify forward (k + 1 query rows, a mask) and a decoding step (one row, no mask,
GQA packed) take different kernel paths, their outputs differ in the last bits, and a near-tie
between two tokens flips the reply after a few dozen tokens.

On CPU, `torch.nn.functional.scaled_dot_product_attention` is exact per row once every call
takes the same path: query heads packed onto their key/value head, a boolean mask, and keys
padded with masked slots to a multiple of 64. Rows then give bit-identical outputs whatever the
number of rows and however many masked slots follow (measured; tests/test_attention.py). On the
embedded target the rest of the model is row-exact already (norms, MLPs, bitsandbytes' fused
NF4 kernel, the bf16 LM head), so with this attention a verify forward's logits equal plain
decoding's, bit for bit, and so does the reply (tests/test_real_model.py).

Where the model runtime's path has specchat's kernels (`models.runtime`), narrow forwards run
their `attend` instead: each query row alone, slot by slot, reading keys and values where the
cache holds them. It is row-exact by construction, and for a few rows far cheaper than sdpa's
CPU kernel with its packed mask and padded keys (docs/cpu.md). Without kernels the packed sdpa
path below runs. Each kernels build registers its own attention name (`register`), so the name
a model's config holds says which attention it runs.

Conditions:
- Keys sit at the same slot in every call: the cache holds every token from slot 0, sliding-
  window layers included (the mask applies their window), in `kvcache.PagedLayer`s, whose
  spare slots give the padding without a copy. A decoding step costs what it did with sdpa.
- Chunks of `WIDE` rows or more (prompts) take the stock path, with its faster causal kernel:
  they are computed the same way with speculation on or off, so nothing needs to match them.
  (So do verifies that wide, as are the NF4 layers' inputs: `models.WIDE_ROWS`.) In sliding-
  window layers they attend to the keys of their window only (`attended_keys`).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specchat import kernels
from specchat.runners.hf.kvcache import has_spare_slots

NAME = "specchat_sdpa"  # without kernels; with them f"{NAME}_{variant}" (`register`)
PAGE = 64  # keys are padded to a multiple of this many slots
WIDE = 64  # query rows from which the stock sdpa runs instead (prompt encoding)


def row_exact_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                   is_causal=None, lib=None, **kwargs):
    """transformers' attention-function signature: query [B, H, Q, D], key/value [B, KV, S, D],
    attention_mask bool [B, 1, Q, >=S] or None (causal). Returns ([B, Q, H, D], None).
    `lib`: the runtime's kernels (`kernels.load`), or None for the packed sdpa path."""
    batch, heads, rows, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    if rows >= WIDE or kwargs.get("softcap") is not None or heads % kv_heads:
        key, value, attention_mask = attended_keys(key, value, attention_mask)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if lib is not None and not module.training and dim % 8 == 0 \
            and key.dtype == value.dtype and key.dtype in (torch.float32, torch.bfloat16) \
            and key.stride(3) == 1 and value.stride(3) == 1 \
            and (attention_mask is None or attention_mask.shape[-1] >= slots):
        return _kernel_attention(lib, query, key, value, attention_mask, scaling), None
    groups = heads // kv_heads
    # [B, H, Q, D] -> [B, KV, G*Q, D]: each key/value head with its query heads' rows.
    packed = query.reshape(batch, kv_heads, groups * rows, dim)
    mask = _packed_mask(attention_mask, batch, rows, slots, groups, query.device)
    if mask.shape[-1] > slots:
        key, value = padded(key, mask.shape[-1]), padded(value, mask.shape[-1])
    out = F.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, scale=scaling,
        dropout_p=dropout if module.training else 0.0)
    return out.reshape(batch, heads, rows, dim).transpose(1, 2).contiguous(), None


def attended_keys(key: torch.Tensor, value: torch.Tensor, attention_mask):
    """key, value [B, KV, S, D] and a boolean mask [B, 1, Q, >= S] without the leading key
    slots no query row attends to, in whole pages of PAGE slots: a sliding-window layer's
    keys older than its window, which the cache keeps (every layer holds every token) and its
    mask hides. Without them a prompt's page attends to at most window + PAGE keys in those
    layers, not to the whole context. The cut depends only on the mask (the rows' positions),
    so a page is computed the same way whenever it is encoded. Other masks pass unchanged."""
    if attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.ndim != 4:
        return key, value, attention_mask
    slots = key.shape[2]
    if slots < 2 * PAGE:
        return key, value, attention_mask
    seen = attention_mask[:, :, :, :slots].any(dim=2).any(dim=0)[0]  # [S]: attended by a row
    first = int(seen.to(torch.uint8).argmax()) if bool(seen.any()) else 0
    first = first // PAGE * PAGE
    if first == 0:
        return key, value, attention_mask
    return key[:, :, first:], value[:, :, first:], attention_mask[:, :, :, first:]


def _kernel_attention(lib, query, key, value, attention_mask, scaling) -> torch.Tensor:
    """specchat's attention kernel (`kernels.attend`): each query row alone, slot by slot,
    reading the cache's keys and values where they lie. Returns [B, Q, H, D]."""
    rows, slots, dim = query.shape[2], key.shape[2], query.shape[3]
    if attention_mask is None:
        mask = _causal_mask(rows, slots)
    else:
        if attention_mask.dtype != torch.bool:
            raise ValueError(f"{NAME} takes boolean masks, got {attention_mask.dtype}")
        mask = attention_mask[:, :, :, :slots]
        if mask.stride(3) != 1:
            mask = mask.contiguous()
    scale = scaling if scaling is not None else dim ** -0.5
    out = kernels.attend(lib, query, key, value, mask, scale)
    return out.transpose(1, 2).to(query.dtype).contiguous()


def _causal_mask(rows: int, slots: int) -> torch.Tensor:
    """[1, 1, rows, slots] bool: the new rows are the last `rows` slots."""
    hit = _causal.get((rows, slots))
    if hit is None:
        row = torch.arange(rows)[:, None]
        hit = (torch.arange(slots)[None, :] <= slots - rows + row)[None, None]
        if len(_causal) >= 8:
            _causal.clear()
        _causal[rows, slots] = hit
    return hit


_causal: dict = {}


_masks: dict = {}  # the last forward's masks: every layer of a kind gets the same one


def _packed_mask(attention_mask, batch: int, rows: int, slots: int, groups: int, device):
    """[B, 1, G*Q, S padded to PAGE] bool: `attention_mask` (None: causal, the new rows being
    the last `rows` slots) for the packed rows, the padding slots masked."""
    key = (id(attention_mask), batch, rows, slots, groups, device)
    hit = _masks.get(key)
    if hit is not None and hit[0] is attention_mask:
        return hit[1]
    if attention_mask is None:
        row = torch.arange(rows, device=device)[:, None]
        slot = torch.arange(slots, device=device)[None, :]
        mask = (slot <= slots - rows + row)[None, None]
    else:
        if attention_mask.dtype != torch.bool:
            raise ValueError(f"{NAME} takes boolean masks, got {attention_mask.dtype}")
        mask = attention_mask[:, :, :, :slots]
    mask = F.pad(mask, (0, -slots % PAGE), value=False)
    mask = mask.expand(batch, 1, rows, mask.shape[-1]).repeat(1, 1, groups, 1)
    if len(_masks) >= 8:
        _masks.clear()
    _masks[key] = (attention_mask, mask)  # holding the input keeps its id from being reused
    return mask


def padded(states: torch.Tensor, slots: int) -> torch.Tensor:
    """`states` [B, H, S, D] extended to `slots` along S: a longer view of the same buffer when
    it is a kvcache.PagedLayer's with room, else a zero-padded copy. The extra slots are
    masked; what they hold only has to be finite (the layer's are zeros or older states)."""
    size = (*states.shape[:2], slots, states.shape[3])
    last = states.storage_offset() + sum((n - 1) * st for n, st in zip(size, states.stride()))
    if states.stride(2) == states.shape[3] and states.stride(3) == 1 \
            and last < states.untyped_storage().nbytes() // states.element_size() \
            and has_spare_slots(states):
        return states.as_strided(size, states.stride())
    return F.pad(states, (0, 0, 0, slots - states.shape[2]))


def register(lib=None) -> str:
    """Register the row-exact attention with `lib`'s kernels (None: the packed sdpa path) under
    its own name with transformers; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = NAME if lib is None else f"{NAME}_{lib.variant}"
    if name not in _registered:
        AttentionInterface.register(name, functools.partial(row_exact_sdpa, lib=lib))
        AttentionMaskInterface.register(name, sdpa_mask)
        _registered.add(name)
    return name


_registered: set[str] = set()


def use_row_exact_attention(model, lib=None) -> bool:
    """Switch a CPU model from sdpa to the row-exact attention, with `lib`'s kernels (None: the
    packed sdpa path). Returns whether it was switched.

    Only on CPU (the exactness was measured there; CUDA's NF4 kernels differ by row count
    anyway) and only from sdpa or another row-exact attention, which take the same masks."""
    config = model.config.get_text_config()
    impl = getattr(config, "_attn_implementation", None)
    if (impl != "sdpa" and not is_row_exact(model)) or model.device.type != "cpu":
        return False
    model.set_attn_implementation(register(lib))
    return True


def is_row_exact(model) -> bool:
    """Whether the model attends through `row_exact_sdpa` (with or without kernels)."""
    impl = getattr(model.config.get_text_config(), "_attn_implementation", None) or ""
    return impl == NAME or impl.startswith(f"{NAME}_")


def tree_masks_supported(model) -> bool:
    """Can this model's attention take an arbitrary mask (sdpa, eager, row-exact; not flash),
    and does it have only causal and sliding-window layers, named in `layer_types` when there
    is a window?"""
    config = model.config.get_text_config()
    impl = getattr(config, "_attn_implementation", None) or "eager"
    kinds = set(getattr(config, "layer_types", None) or ())
    if not kinds and getattr(config, "sliding_window", None):
        return False  # which layers slide is not said: keep to chains
    return (impl in ("sdpa", "eager") or is_row_exact(model)) \
        and kinds <= {"full_attention", "sliding_attention"}


@contextlib.contextmanager
def stock_attention(model):
    """transformers' sdpa while active, on a model switched to `row_exact_sdpa`: for batched
    decoding (`batched.sample_with_features`), where no reply has to match another's bit for
    bit, and the packed path's mask for 64 rows costs more than the step's matmuls."""
    exact = getattr(model.config.get_text_config(), "_attn_implementation", None) \
        if is_row_exact(model) else None
    if exact:
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        if exact:
            model.set_attn_implementation(exact)
