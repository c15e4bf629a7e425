"""Training an EAGLE-3-style head (`train-draft --style eagle3`; Li et al. 2025,
arXiv:2503.01840), saved in the public layout that vLLM, SGLang and specchat load
(models/eagle3.py): `config.json` and `model.safetensors` in the work directory.

What differs from the EAGLE-1-style head (train/fit.py):
- the head reads g_t = fc([a_t, b_t, c_t]), the hidden states entering the target's layers
  (2, L // 2, L - 3), not the final norm's output;
- it has its own norm and LM head over a draft vocabulary (d2t maps draft ids to the
  target's), started from the target's final norm and LM-head rows;
- there is no feature loss: only cross-entropy against the target's distribution, restricted
  to the draft vocabulary;
- training-time test: step s of the unroll drafts from step s - 1's own hidden state, with the
  embedding of the true next token, as drafting does. At step s, array position t stands for
  the draft chain that started at true position t and now sits at position t + s: its query
  attends to the true keys of positions 0..t (step 0's) and to its own chain's keys of steps
  1..s (one each, at position t), which is what the head's cache holds when it drafts.

Step s at position t predicts the token after t + s + 1, whose target distribution is
softmax(f_{t+s+1} @ W[draft vocabulary].T), f the final norm's output. Its loss counts where
position t + s is one the head learns from (a reply's, with a next token), weighted 0.8^s, and
not where the target's top-1 there lies outside the draft vocabulary (EAGLE-3's position mask:
no draft could match it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specchat.models.eagle import lm_head_weight, norm_scale_of
from specchat.models.eagle3 import ARCHITECTURE, Eagle3Head, aux_layers

STEP_WEIGHT = 0.8  # step s's loss is weighted STEP_WEIGHT ** s (EAGLE-3's training code)
DEFAULT_STEPS = 4  # training-time-test steps when --unroll is not given


def layers(model) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head fuses: the public default for its depth."""
    return aux_layers({}, model.config.get_text_config().num_hidden_layers)


def head_config(model, draft_vocab: int, intermediate_size: int = 0) -> dict:
    """config.json of a new head for `model`: a Llama config of one decoder layer as wide as
    the target, with the target's attention shape, in the public layout's keys."""
    tc = model.config.get_text_config()
    d, heads = tc.hidden_size, tc.num_attention_heads
    return {"architectures": [ARCHITECTURE], "model_type": "llama",
            "hidden_size": d, "target_hidden_size": d,
            "intermediate_size": intermediate_size or tc.intermediate_size,
            "num_hidden_layers": 1, "num_attention_heads": heads,
            "num_key_value_heads": getattr(tc, "num_key_value_heads", None) or heads,
            "head_dim": getattr(tc, "head_dim", None) or d // heads,
            "hidden_act": "silu", "rms_norm_eps": float(getattr(tc, "rms_norm_eps", 1e-6)),
            "rope_theta": 10000.0, "max_position_embeddings": tc.max_position_embeddings,
            "vocab_size": tc.vocab_size, "draft_vocab_size": draft_vocab,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def build(config: dict, target_hidden: int) -> Eagle3Head:
    """The network a config.json describes (as models.eagle3.load_eagle3 builds it)."""
    llama = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    llama.draft_vocab_size = config["draft_vocab_size"]
    return Eagle3Head(llama, aux_layers(config, 0), config["vocab_size"], target_hidden)


def new_head(model, vocab_ids: torch.Tensor, intermediate_size: int = 0) -> tuple[Eagle3Head,
                                                                                  dict]:
    """(head, its config.json) over the draft vocabulary `vocab_ids` (sorted target ids): d2t
    and t2d from it, lm_head and norm started as the target's own (its rows of the LM head, its
    final norm's scale), fc, o_proj and down_proj as below, the rest as transformers
    initializes a Llama layer. The config names
    the layers read the way vLLM reads them (`eagle_aux_hidden_state_layer_ids`, the layers
    whose input is taken); they are the public default, so an engine that ignores the key
    reads the same ones."""
    config = head_config(model, len(vocab_ids), intermediate_size)
    config["eagle_aux_hidden_state_layer_ids"] = list(layers(model))
    head = build(config, model.config.get_text_config().hidden_size)
    weight = lm_head_weight(model)
    with torch.no_grad():
        head.d2t.copy_(vocab_ids - torch.arange(len(vocab_ids)))
        head.t2d.zero_()
        head.t2d[vocab_ids] = True
        head.lm_head.weight.copy_(weight[vocab_ids.to(weight.device)].float().cpu())
        head.norm.weight.copy_(norm_scale_of(model))
        # h starts as the last fused layer's hidden state, read through the target's own
        # final norm and LM head (a logit lens): outputs at the target's scale from the first
        # step. fc passes that layer through, and the attention's and MLP's outputs start at 0.
        d = head.fc.weight.shape[0]
        head.fc.weight.zero_()
        head.fc.weight[:, -d:] = torch.eye(d)
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
    return head.tie_vocabulary(), config


def save(directory: Path, head: Eagle3Head, config: dict, meta: dict | None = None) -> Path:
    """config.json and model.safetensors (bf16 weights, d2t int64, t2d bool) in `directory`,
    each written aside and moved into place. `meta` (the training summary) goes in the
    safetensors header, which loaders ignore."""
    from safetensors.torch import save_file
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).detach().cpu()
               .contiguous() for k, v in head.state_dict().items()
               if not k.startswith("rotary.") and k != "vocab_ids"}
    tmp = directory / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"specchat": json.dumps(meta or {})})
    tmp.replace(directory / "model.safetensors")
    tmp = directory / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=1))
    tmp.replace(directory / "config.json")
    return directory


# -- training-time test ------------------------------------------------------------------------


def _attention(head: Eagle3Head, x: torch.Tensor, pos: torch.Tensor, past: list) -> torch.Tensor:
    """The midlayer's attention for unroll step s = len(past) (past: the (keys, values) of
    steps 0..s-1, each [B, Hkv, T_j, hd]). x [B, n, 2d] at array positions 0..n-1, sequence
    positions pos [n]. Appends this step's keys and values to `past`."""
    att = head.midlayer.self_attn
    B, n, _ = x.shape
    q = att.q_proj(x).view(B, n, att.heads, att.head_dim).transpose(1, 2)
    k = att.k_proj(x).view(B, n, att.kv_heads, att.head_dim).transpose(1, 2)
    v = att.v_proj(x).view(B, n, att.kv_heads, att.head_dim).transpose(1, 2)
    cos, sin = head.rotary(x, pos[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    past.append((k, v))
    group = att.heads // att.kv_heads
    keys = [kj[:, :, :n].repeat_interleave(group, 1) for kj, _ in past]
    values = [vj[:, :, :n].repeat_interleave(group, 1) for _, vj in past]
    scale = att.head_dim ** -0.5
    # Step 0's keys, causally: the true positions 0..t.
    causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
    # Steps 1..s: the chain's own key at the same array position (its diagonal).
    scores += [(q * kj).sum(-1, keepdim=True) * scale for kj in keys[1:]]
    weights = torch.softmax(torch.cat(scores, -1), -1)  # [B, H, n, n + s]
    out = weights[..., :n] @ values[0]
    for j, vj in enumerate(values[1:]):
        out = out + weights[..., n + j:n + j + 1] * vj
    return att.o_proj(out.transpose(1, 2).reshape(B, n, -1))


def unrolled(head: Eagle3Head, aux: torch.Tensor, embeds: torch.Tensor, steps: int
             ) -> list[torch.Tensor]:
    """Hidden states of `steps` training-time-test steps: aux [B, T, 3d] (positions 0..T-1),
    embeds [B, T + steps - 1, d] (embed(x_{t+1}) at index t). Step s: [B, T - s, d], array
    position t at sequence position t + s."""
    layer = head.midlayer
    hidden = head.fc(aux)
    T = aux.shape[1]
    past: list = []
    out = []
    for s in range(steps):
        n = T - s
        if n <= 0:
            break
        hidden = hidden[:, :n]
        normed = layer.hidden_norm(hidden)
        residual = normed if layer.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds[:, s:s + n]), normed], -1)
        pos = torch.arange(s, s + n, device=aux.device)
        residual = _attention(head, x, pos, past) + residual
        hidden = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        out.append(hidden)
    return out


def head_loss(head: Eagle3Head, embed, batch: dict, cfg, train: bool = True
              ) -> tuple[torch.Tensor, dict]:
    """EAGLE-3's loss over a batch (the module's docstring). Returns (loss, metrics):
    metrics["top1@s"] counts agreement of step s's argmax with the target's full-vocabulary
    top-1 (what greedy verification accepts), "ce" step 1's cross-entropy."""
    ids, feats, aux = batch["ids"], batch["feats"], batch["aux"]
    T = ids.shape[1] - 1  # head positions t read (g_t, x_{t+1})
    steps = max(1, cfg.unroll)
    weight = head.target_rows  # `attach_target`
    with torch.no_grad():
        emb = embed(ids[:, 1:]).float()  # [B, T, d]: embed(x_{t+1})
        emb = F.pad(emb, (0, 0, 0, steps - 1))
    inputs = aux[:, :T].float()
    if train and cfg.noise:
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * 2 * cfg.noise * head.aux_std
    hidden = unrolled(head, inputs, emb, steps)
    # Positions p that learn (a reply's, with a next token) and whose target top-1 (the token
    # after p + 1) the draft vocabulary holds, or is not known; every step reads the same
    # target distributions there (step s from array position t = p - s).
    rows, p = batch["trained"][:, :T].nonzero(as_tuple=True)
    top1 = batch["top1"][rows, p + 1]
    known = top1 >= 0
    keep = head.t2d[top1.clamp(min=0)] | ~known
    rows, p, top1, known = rows[keep], p[keep], top1[keep], known[keep]
    with torch.no_grad():
        target_probs = torch.softmax(feats[rows, p + 1].float() @ weight.T, -1)  # [V, N]
    total, metrics = 0.0, {}
    for s, h in enumerate(hidden):
        use = p >= s
        if not bool(use.any()):
            break
        logits = head.logits(h[rows[use], p[use] - s])
        ce = -(target_probs[use] * torch.log_softmax(logits.float(), -1)).sum(-1)
        total = total + ce.mean() * STEP_WEIGHT ** s
        agree = (head.vocab_ids[logits.argmax(-1)] == top1[use]) & known[use]
        metrics[f"top1@{s + 1}"] = (int(agree.sum()), int(known[use].sum()))
        if s == 0:
            metrics["ce"] = float(ce.mean().detach())
    if not metrics:
        metrics = {"top1@1": (0, 0), "ce": 0.0}
        total = sum(q.sum() * 0.0 for q in head.parameters())
    return total, metrics


def attach_target(head: Eagle3Head, model) -> Eagle3Head:
    """Keep the target's LM-head rows of the head's draft vocabulary (float32, not saved)."""
    weight = lm_head_weight(model)
    head.target_rows = weight[head.vocab_ids.to(weight.device)].float().to(
        head.vocab_ids.device)
    return head


def feature_std(records: list[dict], parts: int) -> torch.Tensor:
    """The std of each fused layer's hidden states, spread over its columns [parts * td]:
    noise on the inputs is in these units, as the layers' scales differ by orders."""
    sample = torch.cat([r["aux"].float() for r in records[:64]])  # [n, parts * td]
    each = sample.shape[1] // parts
    std = torch.stack([sample[:, i * each:(i + 1) * each].std() for i in range(parts)])
    return std.repeat_interleave(each)
