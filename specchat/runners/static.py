"""What specchat's own forwards (`cpu.runner.CpuRunner`, `cuda.runner.CudaRunner`) share: the
architecture check both make before taking a model, and what they keep beside the weights (a KV
cache with a slot per position, the model's RoPE tables)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


# The activation each model family's MLP computes on specchat's forwards, by model type.
ACTIVATIONS = {"gemma3_text": "gelu_pytorch_tanh", "llama": "silu", "qwen2": "silu",
               "mistral": "silu"}


def unsupported_config(config, kinds: tuple[str, ...], only: str = "") -> str | None:
    """Why a forward that runs the model types `kinds` cannot run a model of this text config
    (what both forwards refuse alike), or None. `only`: how a forward of one family names it
    ("Gemma 3"), for a message that says so."""
    kind = getattr(config, "model_type", "")
    if kind not in kinds:
        name = kind or type(config).__name__
        return f"it runs {only} only, not {name}" if only else \
            f"{name} is not a model it runs ({', '.join(kinds)})"
    act = getattr(config, "hidden_activation", None) if kind == "gemma3_text" \
        else getattr(config, "hidden_act", "silu")
    if act != ACTIVATIONS[kind]:
        return f"its activation is {act}"
    return attention_unsupported(config)


def attention_unsupported(config, soft_caps: bool = False) -> str | None:
    """What a forward of specchat's does not compute in a model's attention or logits (the
    soft-caps, unless `soft_caps`: the CPU forward's Gemma 2; bidirectional attention), or
    None."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, name, None) and not soft_caps:
            return f"{name} {getattr(config, name)}"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    return None


class StaticCache:
    """Every layer's keys and values at fixed slots: the token at position p sits at slot p, a
    rollback is the engine forgetting tokens (the next forward overwrites their slots).
    `layers[i].keys` and `.values` are [1, kv heads, slots, head dim] views and `update` writes
    a prefix: what the prefix store (core/prefix.py) reads and restores."""

    def __init__(self, layers: int, kv_heads: int, slots: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (layers, kv_heads, slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def slots(self) -> int:
        return self.k.shape[2]

    @property
    def layers(self) -> list:
        return [_LayerView(self.k[i][None], self.v[i][None]) for i in range(self.k.shape[0])]

    def grow(self, slots: int) -> None:
        """At least `slots` slots, the ones held kept (new buffers: pointers taken before are
        stale)."""
        if slots <= self.slots:
            return
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:2], slots, old.shape[3]))
            new[:, :, :old.shape[2]] = old
            setattr(self, name, new)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> None:
        n = keys.shape[-2]
        self.grow(n)
        self.k[layer, :, :n] = keys[0]
        self.v[layer, :, :n] = values[0]

    def keep(self, start: int, rows: list[int]) -> None:
        """Move the fed tokens at start + rows (increasing) to start, start + 1, ...: a draft
        tree's accepted path, kept as a chain."""
        if rows[-1] == len(rows) - 1:  # already in place (a path down a fan's chain)
            return
        src = torch.tensor([start + r for r in rows], device=self.k.device)
        dst = torch.arange(start, start + len(rows), device=self.k.device)
        for t in (self.k, self.v):
            t[:, :, dst] = t[:, :, src]


@dataclass
class _LayerView:
    keys: torch.Tensor
    values: torch.Tensor


def rope_tables(base, slots: int, head_dim: int, device,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [slots, head dim] in float32, from the model's own rotary embedding (its
    scaling included; Gemma's has one per layer type). Each position's values are computed
    alone, so a longer table starts with a shorter one's values."""
    positions = torch.arange(slots, device=device)[None]
    probe = torch.zeros(1, 1, head_dim, dtype=torch.float32, device=device)
    with torch.no_grad():
        if layer_type is None:
            cos, sin = base.rotary_emb(probe, positions)
        else:
            cos, sin = base.rotary_emb(probe, positions, layer_type)
    return cos[0].float().contiguous(), sin[0].float().contiguous()
