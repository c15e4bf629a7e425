"""Public EAGLE-3 draft heads (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of
Large Language Models via Training-Time Test", arXiv:2503.01840), in the layout vLLM and SGLang
load, e.g. `yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`.

A head is a directory (or a hub id, fetched into the hub's cache): `config.json`
(`architectures: ["LlamaForCausalLMEagle3"]`, a Llama config of one decoder layer plus
`draft_vocab_size`, optionally `target_hidden_size`) and its weights (`model.safetensors`, or
`pytorch_model.bin`):

    fc.weight                        [d, 3 td]   fuses three target layers' hidden states
    midlayer.input_layernorm.weight  [d]         norms the next token's embedding
    midlayer.hidden_norm.weight      [d]         norms the (fused or own) hidden state
    midlayer.self_attn.{q,k,v}_proj  [., 2 d]    read [embedding, hidden state], 2d wide
    midlayer.self_attn.o_proj        [d, H hd]
    midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj
    norm.weight                      [d]
    lm_head.weight                   [N, d]      the draft vocabulary's logits
    d2t                              [N] int64   draft id i is target id i + d2t[i]
    t2d                              [V] bool    which target ids the draft vocabulary holds
    (embed_tokens.weight             [V, d]      rarely: else the target's embedding is read)

At position t the head reads g_t = fc([a_t, b_t, c_t]), the hidden states entering the target's
decoder layers (2, L // 2, L - 3) (the residual stream: the earlier layer's output), with the
embedding of the next token x_{t+1}:

    residual = g_t
    x = attention([input_layernorm(embed(x_{t+1})), hidden_norm(g_t)])   q, k, v from 2d
    residual = x + residual;  x = mlp(post_attention_layernorm(residual))
    h = x + residual                      fed forward as the next draft's hidden state (d wide,
                                          so fc is skipped: "if hidden_states.shape[-1] !=
                                          embeds.shape[-1]: hidden_states = self.fc(...)")
    logits = lm_head(norm(h))             over the draft vocabulary; target id = id + d2t[id]

Sources read for this layout (not guessed):
- SGLang python/sglang/srt/models/llama_eagle3.py: `LlamaForCausalLMEagle3`, `midlayer`, fc
  (bias only with config `bias`), the residual and the pre-norm state fed forward ("For draft
  decode, we capture the hidden state before norm"), d2t as `hot_token_id = d2t + arange`.
- vLLM vllm/model_executor/models/llama_eagle3.py: the 2d-wide qkv of layer 0,
  `norm_before_residual` (the residual taken after hidden_norm), `target_hidden_size`,
  `compute_logits` (target ids = arange(draft_vocab_size) + draft_id_to_target_id), t2d unused,
  `embed_tokens` shared with the target when the file has none.
- The target layers: EAGLE's own eagle/model/modeling_llama_kv.py (SafeAILab/EAGLE), which
  appends `hidden_states` before layer idx for idx in (2, L // 2, L - 3);
  vLLM's `get_eagle3_aux_hidden_state_layers` (models/llama.py),
  `(2, num_layers // 2, num_layers - 3)`, captured as `hidden_states + residual` before layer i
  runs; SGLang's `set_eagle3_layers_to_capture` (models/llama.py), the same default. A config
  may name its own: vLLM reads a top-level `eagle_aux_hidden_state_layer_ids` as those layer
  indices (`_get_eagle3_aux_layers_from_config`, v1/worker/gpu_model_runner.py); SGLang reads
  `eagle_config.eagle_aux_hidden_state_layer_ids` as layer outputs and adds one ("for the ith
  layer, it takes the output of the (i-1)th layer as aux hidden state").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from specchat.models.eagle import Int8Drafting, attend
from specchat.models.eagle_files import HeadMismatchError

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


# -- the network -------------------------------------------------------------------------------


class Eagle3Attention(nn.Module):
    """Llama attention whose q, k and v read the 2d-wide [embedding, hidden state], with its own
    KV cache as (keys, values) [B, Hkv, S, hd], grown by `eagle.appended`."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        d, self.heads, self.kv_heads = config.hidden_size, config.num_attention_heads, \
            config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(2 * d, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * d, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * d, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=bias)

    def forward(self, x, cos_sin, cache=None, mask=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *cos_sin)  # each [B, H(kv), T, hd]
        att, cache = attend(q, k, v, cache, mask)
        return self.o_proj(att.transpose(1, 2).reshape(B, T, -1)), cache


class Eagle3Layer(nn.Module):
    """The head's one decoder layer (`midlayer`), names as in the public files."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.input_layernorm = LlamaRMSNorm(d, eps)
        self.hidden_norm = LlamaRMSNorm(d, eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embeds, hidden, cos_sin, cache=None, mask=None):
        """embeds, hidden [B, T, d] -> (h, the residual stream after the layer [B, T, d],
        cache)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2d]
        x, cache = self.self_attn(x, cos_sin, cache, mask)
        residual = x + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual, cache


class Eagle3Head(nn.Module):
    """A public EAGLE-3 head, drafting with `drafters.head.HeadDrafter` as specchat's own head
    does: forward(feats, embeds, pos, cache, mask, last_only) -> (next hidden states, draft
    vocabulary logits, cache), `vocab_ids` the target id of each draft id."""

    def __init__(self, config: LlamaConfig, layers: tuple[int, ...], vocab_size: int,
                 target_hidden: int, own_embedding: bool = False):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.feature_layers = layers  # target layers whose input hidden states it fuses
        self.feature_width = len(layers) * target_hidden
        self.fc = nn.Linear(self.feature_width, d, bias=bool(getattr(config, "bias", False)))
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(d, config.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(vocab_size, d) if own_embedding else None
        self.rotary = LlamaRotaryEmbedding(config)
        # target id of each draft id (filled by `tie_vocabulary` once d2t is loaded)
        self.register_buffer("vocab_ids", torch.zeros(config.draft_vocab_size,
                                                      dtype=torch.long), persistent=False)

    def tie_vocabulary(self) -> Eagle3Head:
        self.vocab_ids = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t
        return self

    def embedder(self, target_model) -> nn.Module:
        """What embeds the next token: the file's `embed_tokens`, else the target's embedding
        rows as they are stored (vLLM and SGLang share the weight, so a model that scales its
        embeddings, as Gemma does, is read unscaled)."""
        if self.embed_tokens is not None:
            return self.embed_tokens
        return nn.Embedding.from_pretrained(target_model.get_input_embeddings().weight,
                                            freeze=True)

    def forward(self, feats, embeds, pos, cache=None, mask=None, last_only: bool = False):
        """feats [B, T, 3 td] (the target's, fused by fc) or [B, T, d] (the head's own h of the
        draft before), embeds [B, T, d] (of x_{t+1}), pos [T]; mask: see `eagle.attend`.
        Returns (h [B, T, d], logits [B, T or 1, N], cache)."""
        if feats.shape[-1] == self.feature_width:
            feats = self.fc(feats)
        cos_sin = self.rotary(embeds, pos[None])  # each [1, T, hd]
        h, cache = self.midlayer(embeds, feats, cos_sin, cache, mask)
        return h, self.logits(h[:, -1:] if last_only else h), cache

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def quantize_for_drafting(self, wide_bf16: bool = False, lib=None,
                              packed: bool | None = None) -> None:
        """As `DraftHead.quantize_for_drafting`: on a CPU, every linear layer read through an
        integer copy of its weight (`Int8Drafting`), repacked for the VNNI kernel where
        `packed` (None: where `lib` runs it with VNNI) and the layer's rows allow. Drafts move
        a little; verification stays exact."""
        if isinstance(self.fc, Int8Drafting):
            return
        if packed is None:
            packed = lib is not None and lib.rows_i8_vnni
        self.fc = Int8Drafting(self.fc, wide_bf16, lib, packed)
        self.lm_head = Int8Drafting(self.lm_head, wide_bf16, lib, packed)
        att, mlp = self.midlayer.self_attn, self.midlayer.mlp
        for owner, names in ((att, ("q_proj", "k_proj", "v_proj", "o_proj")),
                             (mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                setattr(owner, name, Int8Drafting(getattr(owner, name), wide_bf16, lib, packed))


# -- the files ---------------------------------------------------------------------------------


def read_config(path: str | Path) -> dict | None:
    """A directory's config.json when it declares an EAGLE-3 head, else None (not one: today's
    specchat head file, or a directory of something else)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    return config if ARCHITECTURE in (config.get("architectures") or []) else None


def is_eagle3(path: str | Path) -> bool:
    return read_config(path) is not None


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(path: str | Path) -> bool:
    """`owner/name` naming no local file or directory (and no specchat head file)."""
    text = str(path)
    return bool(_HUB_ID.fullmatch(text)) and not Path(text).exists() \
        and not text.endswith(".safetensors")


def fetch(repo_id: str) -> Path:
    """A hub head's config.json and weights, into the hub's cache (as the hub's client keeps
    them; offline with HF_HUB_OFFLINE=1 where cached) -> its local directory."""
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["config.json", *WEIGHT_FILES]))
    except Exception as e:  # offline, no such repository, gated: say which
        raise HeadMismatchError(f"could not fetch the head {repo_id} from the hub "
                                f"({type(e).__name__}: {str(e).splitlines()[0]})") from e


def aux_layers(config: dict, target_layers: int) -> tuple[int, ...]:
    """The target layers whose input hidden states the head fuses (see the module's sources),
    in layer order: vLLM, SGLang and EAGLE's own code append them as their layer loop meets
    them (`if idx in layers`), so fc reads them lowest first, each once."""
    if config.get("eagle_aux_hidden_state_layer_ids"):  # vLLM: layer indices as they are
        layers = [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
    elif (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
        # SGLang: layer outputs, one added
        layers = [int(i) + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    else:
        layers = [2, target_layers // 2, target_layers - 3]
    return tuple(sorted(set(layers)))


def _load_tensors(directory: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = directory / name
        if not path.is_file():
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(str(path))
        return torch.load(str(path), map_location="cpu", weights_only=True)
    raise HeadMismatchError(f"{directory}: an EAGLE-3 config.json without its weights (looked "
                            f"for {', '.join(WEIGHT_FILES)})")


def expected_shapes(config: LlamaConfig, width: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the public layout and its shape; `width` the fused features' width."""
    d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv, n = config.num_attention_heads * hd, config.num_key_value_heads * hd, \
        config.draft_vocab_size
    shapes = {"fc.weight": (d, width), "norm.weight": (d,), "lm_head.weight": (n, d),
              "d2t": (n,), "t2d": (vocab,)}
    if getattr(config, "bias", False):
        shapes["fc.bias"] = (d,)
    layer = {"input_layernorm.weight": (d,), "hidden_norm.weight": (d,),
             "post_attention_layernorm.weight": (d,),
             "self_attn.q_proj.weight": (q, 2 * d), "self_attn.k_proj.weight": (kv, 2 * d),
             "self_attn.v_proj.weight": (kv, 2 * d), "self_attn.o_proj.weight": (d, q),
             "mlp.gate_proj.weight": (inter, d), "mlp.up_proj.weight": (inter, d),
             "mlp.down_proj.weight": (d, inter)}
    if getattr(config, "attention_bias", False):
        layer.update({f"self_attn.{p}_proj.bias": (s[0],) for p, s in
                      zip("qkvo", (layer["self_attn.q_proj.weight"],
                                   layer["self_attn.k_proj.weight"],
                                   layer["self_attn.v_proj.weight"], (d,)))})
    if getattr(config, "mlp_bias", False):
        layer.update({"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,),
                      "mlp.down_proj.bias": (d,)})
    shapes.update({f"midlayer.{k}": v for k, v in layer.items()})
    return shapes


def shape_problems(raw: dict, target_config) -> list[str]:
    """What differs between a head's config and the target it is loaded for."""
    problems = []
    target_hidden = raw.get("target_hidden_size") or raw.get("hidden_size")
    if target_hidden != target_config.hidden_size:
        problems.append(f"it reads hidden states {target_hidden} wide, the target's are "
                        f"{target_config.hidden_size}")
    if raw.get("vocab_size") != target_config.vocab_size:
        problems.append(f"its vocabulary is {raw.get('vocab_size')} tokens, the target's "
                        f"{target_config.vocab_size}")
    layers = aux_layers(raw, target_config.num_hidden_layers)
    if not all(0 <= i <= target_config.num_hidden_layers for i in layers):
        problems.append(f"it reads the target's layers {list(layers)}, the target has "
                        f"{target_config.num_hidden_layers}")
    if raw.get("num_hidden_layers", 1) != 1:
        problems.append(f"it has {raw.get('num_hidden_layers')} decoder layers (specchat "
                        "reads heads of one, `midlayer`)")
    if raw.get("tie_word_embeddings"):
        problems.append("its lm_head is tied to an embedding (tie_word_embeddings)")
    return problems


def load_eagle3(path: str | Path, model) -> Eagle3Head:
    """The EAGLE-3 head in directory `path` for the target `model` (a transformers model),
    float32 on the target's device; refuses, saying what differs, a head built for another
    target's shape or files not in the public layout."""
    directory = Path(path)
    raw = read_config(directory)
    if raw is None:
        raise HeadMismatchError(f"{directory}: not an EAGLE-3 head (its config.json does not "
                                f"name {ARCHITECTURE})")
    target_config = model.config.get_text_config()
    problems = shape_problems(raw, target_config)
    if problems:
        raise HeadMismatchError(f"The EAGLE-3 head {directory} was built for another target: "
                                + "; ".join(problems) + ".")
    config = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    config.draft_vocab_size = raw.get("draft_vocab_size") or raw["vocab_size"]
    layers = aux_layers(raw, target_config.num_hidden_layers)
    width = len(layers) * target_config.hidden_size
    if width == config.hidden_size:  # the forward tells fused features from its own by width
        raise HeadMismatchError(f"{directory}: fc's input ({width}) is as wide as the head's "
                                "hidden size; specchat cannot tell the two apart")
    tensors = {k: v for k, v in _load_tensors(directory).items()
               if not k.endswith("rotary_emb.inv_freq")}
    own_embedding = "embed_tokens.weight" in tensors
    if not own_embedding and config.hidden_size != target_config.hidden_size:
        raise HeadMismatchError(f"The EAGLE-3 head {directory} is {config.hidden_size} wide and "
                                f"has no embed_tokens; the target's embeddings are "
                                f"{target_config.hidden_size} wide.")
    expected = expected_shapes(config, width, target_config.vocab_size)
    if own_embedding:
        expected["embed_tokens.weight"] = (target_config.vocab_size, config.hidden_size)
    # Both engines skip t2d, and read no d2t as draft id = target id (vLLM's load_weights)
    optional = {"t2d"} | ({"d2t"} if config.draft_vocab_size == target_config.vocab_size
                          else set())
    layout = [f"{k} missing" for k in expected if k not in tensors and k not in optional]
    layout += [f"{k} is not in the EAGLE-3 layout" for k in tensors if k not in expected]
    layout += [f"{k} is {list(tensors[k].shape)}, expected {list(shape)}"
               for k, shape in expected.items()
               if k in tensors and tuple(tensors[k].shape) != shape]
    if layout:
        raise HeadMismatchError(f"The EAGLE-3 head {directory} does not have the public layout "
                                f"(q, k and v read 2 x {config.hidden_size}, fc "
                                f"{len(layers)} x {target_config.hidden_size}): "
                                + "; ".join(layout[:6]) + ".")
    tensors.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
    ids = torch.arange(config.draft_vocab_size) + tensors["d2t"].long()
    if int(ids.min()) < 0 or int(ids.max()) >= target_config.vocab_size:
        raise HeadMismatchError(f"The EAGLE-3 head {directory}: d2t maps draft ids outside the "
                                f"target's {target_config.vocab_size} tokens.")
    if "t2d" not in tensors:
        tensors["t2d"] = torch.zeros(target_config.vocab_size, dtype=torch.bool)
        tensors["t2d"][ids] = True
    head = Eagle3Head(config, layers, target_config.vocab_size, target_config.hidden_size,
                      own_embedding)
    head.load_state_dict({k: v.float() if v.is_floating_point() else v
                          for k, v in tensors.items()}, strict=True)
    device = next(model.parameters()).device
    return head.to(device).tie_vocabulary().eval()
