"""What sets one decoder family apart from another, declared once (as gpt-fast's `ModelArgs`):
specchat's CPU forward (`cpu.runner.CpuRunner`, csrc/decoder.c) runs every family below by the
same code, reading from this table which norms a layer has and where transformers keeps them,
how a norm scales, which activation the MLP computes and how RoPE is laid out.

| family   | model types            | norms a layer has                       | MLP  | also                 |
| -------- | ---------------------- | --------------------------------------- | ---- | -------------------- |
| Llama    | llama (SmolLM 2 too)   | before attention, before the MLP        | SiLU | biases where set     |
| Mistral  | mistral                | as Llama's                              | SiLU | a window every layer |
| Qwen 2   | qwen2                  | as Llama's                              | SiLU | q, k, v biases       |
| Qwen 3   | qwen3                  | as Llama's, and each head's q and k     | SiLU |                      |
| Gemma 2  | gemma2                 | before and after attention and the MLP  | gelu (tanh) | 1 + w norms, windows, soft-caps |
| Gemma 3  | gemma3_text            | before and after attention and the MLP, each head's q and k | gelu (tanh) | 1 + w norms, two RoPE tables, windows |
| Phi-3    | phi3                   | as Llama's                              | SiLU | q|k|v and gate|up fused, a window every layer |

Fused layers (Phi-3's `qkv_proj`, `gate_up_proj`) are split at load into the row ranges the
forward's q, k, v, gate and up products read: NF4 keeps a row's codes and block scales apart
from its neighbours' wherever the input width is a whole number of blocks.

A family's models may still differ in what the forward does not run (partial RoPE, Phi-3's
long-context RoPE):
`unsupported` says so, and such a model keeps transformers' forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from specchat.runners.static import attention_unsupported

# the decoder layer's norms in csrc/decoder.c's order (`decoder_layer`)
NORM_SLOTS = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm", "k_norm")
# and its products (`decoder_layer`'s NF4 weights), each where transformers keeps it in a
# decoder layer unless the family fuses it with others (`Family.fused`)
PRODUCTS = ("q", "k", "v", "o", "gate", "up", "down")
LINEARS = dict(zip(PRODUCTS, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                              "mlp.down_proj")))
ACT_GELU_TANH, ACT_SILU = 0, 1  # csrc/specchat.h's `act`

_LLAMA_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_PER_HEAD = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
_GEMMA_NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                "mlp_norm": "pre_feedforward_layernorm",
                "post_mlp_norm": "post_feedforward_layernorm"}


@dataclass(frozen=True)
class Family:
    name: str  # in words, for messages
    activation: str  # transformers' name of the MLP's activation (`hidden_act`)
    norms: dict[str, str]  # a NORM_SLOTS name -> the module under a decoder layer
    norm_plus_one: bool = False  # the norm scales by 1 + weight (Gemma), else by the weight
    rope_kinds: tuple[str | None, ...] = (None,)  # the rotary embedding's layer types, if any
    window_every_layer: bool = False  # `sliding_window` applies to every layer (Mistral)
    # the attention scores and the logits soft-capped, cap tanh(x / cap), where the config has
    # caps (Gemma 2's `attn_logit_softcapping`, `final_logit_softcapping`)
    soft_caps: bool = False
    # fused linear layers: (the module under a decoder layer, the products its rows hold, in
    # order), e.g. Phi-3's ("self_attn.qkv_proj", ("q", "k", "v"))
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def act(self) -> int:
        return ACT_SILU if self.activation == "silu" else ACT_GELU_TANH


FAMILIES = {
    "llama": Family("Llama", "silu", _LLAMA_NORMS),
    "mistral": Family("Mistral", "silu", _LLAMA_NORMS, window_every_layer=True),
    "qwen2": Family("Qwen 2", "silu", _LLAMA_NORMS),
    "qwen3": Family("Qwen 3", "silu", {**_LLAMA_NORMS, **_PER_HEAD}),
    "gemma2": Family("Gemma 2", "gelu_pytorch_tanh", _GEMMA_NORMS, norm_plus_one=True,
                     soft_caps=True),
    "gemma3_text": Family("Gemma 3", "gelu_pytorch_tanh", {**_GEMMA_NORMS, **_PER_HEAD},
                          norm_plus_one=True, rope_kinds=("sliding_attention", "full_attention")),
    "phi3": Family("Phi-3", "silu", _LLAMA_NORMS, window_every_layer=True,
                   fused=(("self_attn.qkv_proj", ("q", "k", "v")),
                          ("mlp.gate_up_proj", ("gate", "up")))),
}


def family_of(config) -> Family | None:
    return FAMILIES.get(getattr(config, "model_type", ""))


def linear_modules(family: Family) -> list[tuple[str, tuple[str, ...]]]:
    """A decoder layer's NF4 modules, each with the products (`PRODUCTS`) its rows hold."""
    fused = [name for _, names in family.fused for name in names]
    return list(family.fused) + [(LINEARS[p], (p,)) for p in PRODUCTS if p not in fused]


def product_rows(config, head_dim: int) -> dict[str, int]:
    """Each product's output rows (a fused module's rows split in `PRODUCTS`' order)."""
    kv = config.num_key_value_heads * head_dim
    return {"q": config.num_attention_heads * head_dim, "k": kv, "v": kv,
            "o": config.hidden_size, "gate": config.intermediate_size,
            "up": config.intermediate_size, "down": config.hidden_size}


def activation(config) -> str | None:
    """The MLP's activation a text config names (Gemma calls it `hidden_activation`)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


def unsupported(config) -> str | None:
    """Why the table's forward cannot run a model of this text config, or None."""
    family = family_of(config)
    if family is None:
        kind = getattr(config, "model_type", "") or type(config).__name__
        return (f"{kind} is not a family it runs (it runs "
                f"{', '.join(f.name for f in FAMILIES.values())})")
    if activation(config) != family.activation:
        return f"its activation is {activation(config)}"
    why = attention_unsupported(config, soft_caps=family.soft_caps)
    if why:
        return why
    rope = getattr(config, "rope_parameters", None) or {}
    partial = getattr(config, "partial_rotary_factor", None) or rope.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        return f"partial RoPE (factor {partial})"
    if rope.get("rope_type") in ("longrope", "dynamic"):  # (Phi-3's long-context models)
        return f"{rope['rope_type']} RoPE (its tables change with the context's length)"
    kinds = set(getattr(config, "layer_types", None) or ())
    if not kinds <= {"sliding_attention", "full_attention"}:
        return f"layer types {sorted(kinds - {'sliding_attention', 'full_attention'})}"
    return None


def soft_caps(config) -> tuple[float, float]:
    """(the attention scores' cap, the logits' cap) the forward applies; 0: none."""
    if not family_of(config).soft_caps:
        return 0.0, 0.0
    return (float(getattr(config, "attn_logit_softcapping", None) or 0.0),
            float(getattr(config, "final_logit_softcapping", None) or 0.0))


def windows(config, n_layers: int) -> list[int]:
    """Each layer's sliding window (0: full attention), as transformers' masks apply them."""
    window = getattr(config, "sliding_window", None) or 0
    if family_of(config).window_every_layer:
        return [window] * n_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * n_layers
    return [window if kind == "sliding_attention" else 0 for kind in types]


def rope_index(config, layer: int) -> int:
    """Which of the family's RoPE tables (`rope_kinds`) layer `layer` takes."""
    kinds = family_of(config).rope_kinds
    if len(kinds) == 1:
        return 0
    return kinds.index(config.layer_types[layer])
