"""A draft head trained for the loaded target (EAGLE-1: Li et al. 2024, arXiv:2401.15077).

The head drafts from the target's own features instead of from tokens alone. At position t its
input is f_t, the target's last hidden state (the output of its final norm, what the LM head
reads), fused with the embedding of the next token x_{t+1}:

    x = fc([norm(embed(x_{t+1})), norm(f_t)])        Linear 2d -> d  (EAGLE-3's input norms)
    h = block(x)                                      one pre-norm transformer block, RoPE
    f^_{t+1} = rmsnorm(h) * target_norm_scale         the target's own final norm, frozen
    logits = f^_{t+1} @ W[vocab_ids].T                the target's LM head, reduced vocabulary

so it predicts the next feature and, through the target's frozen LM head restricted to the N
tokens the target predicts most often, the token after it. Drafting k tokens feeds its own
predicted features forward. Only fc, the two input norms and the block are new weights (a few
MB); the reduced head is tied to the target's rows and never saved.

Verification stays lossless whatever the head proposes: when sampling, the head draws its draft
from its reduced-vocabulary q with the random numbers the target will use at that position
(`sampling.race`), and the step checks it against the target's own draw there, so every
emitted token is plain sampling's (tokens outside the reduced vocabulary simply never get
drafted). Greedy, a draft passes when it is the target's argmax.

Features come for free when the engine passes the hidden states of accepted positions to
`HeadDrafter.observe` (read from a `FeatureTap` on the target's final norm). Without that the
drafter computes missing features with an extra target forward of its own: correct, but slow.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specchat.sampling import SamplingParams, nucleus, race
from specchat.tree import DraftTree

FORMAT = "specchat-head/1"
_EMPTY = torch.zeros(0, dtype=torch.long)


class HeadMismatchError(ValueError):
    """A head file was trained for another target (or is not a head file)."""


@dataclass
class HeadConfig:
    hidden_size: int  # d: the target's hidden size (features, embeddings)
    draft_vocab: int  # N: rows of the reduced LM head
    num_heads: int  # attention heads of the block (head_dim = d / num_heads)
    intermediate_size: int  # MLP width of the block
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    logit_softcap: float = 0.0  # the target's final_logit_softcapping (0 = none)

    @classmethod
    def for_target(cls, model, draft_vocab: int, intermediate_size: int | None = None):
        cfg = model.config.get_text_config()
        d = cfg.hidden_size
        heads = max(1, d // 64) if d % 64 == 0 else max(1, d // 32)
        return cls(hidden_size=d, draft_vocab=draft_vocab, num_heads=heads,
                   intermediate_size=intermediate_size or cfg.intermediate_size,
                   rms_eps=float(getattr(cfg, "rms_norm_eps", 1e-6) or 1e-6),
                   logit_softcap=float(getattr(cfg, "final_logit_softcapping", 0) or 0))


# -- the network -----------------------------------------------------------------------------


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, x.shape[-1:], eps=eps)  # x / sqrt(mean(x^2) + eps), one fused op


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        # The weight in the input's dtype: under bf16 autocast (training) the input is bf16,
        # and mixed dtypes miss the fused kernel.
        return F.rms_norm(x, x.shape[-1:], self.weight.to(x.dtype), self.eps)


class Rope:
    """Rotary position embedding, rotate-half layout, with its cos/sin tables kept and grown
    as positions come (a one-token draft step would otherwise spend more on computing them
    than on applying them)."""

    def __init__(self, head_dim: int, theta: float):
        self.inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32)
                                        / head_dim)
        self.cos = self.sin = torch.zeros(0, head_dim)

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, hd], pos [T] -> x rotated by its positions."""
        need = int(pos.max()) + 1
        if need > self.cos.shape[0] or self.cos.device != x.device:
            size = max(need, 2 * self.cos.shape[0], 256)
            angles = torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            self.cos = angles.cos().repeat(1, 2).to(x.device)
            self.sin = angles.sin().repeat(1, 2).to(x.device)
        cos, sin = self.cos[pos].to(x.dtype), self.sin[pos].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


CACHE_GROW = 256  # head KV cache slots added at a time


def appended(cached: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """cached [B, H, S, hd] followed by new [B, H, T, hd] along S. Written in place when
    `cached` is the first S slots of a buffer with room after them (one made here: its stride
    tells its capacity), else into a new buffer with CACHE_GROW spare slots; cropping a cache
    by slicing keeps the buffer. A drafting step thus copies T slots, not the whole cache
    (`torch.cat` cost 0.05-0.3 ms per forward at 100-1000 cached positions)."""
    B, H, S, hd = cached.shape
    T = new.shape[2]
    if torch.is_grad_enabled() and (cached.requires_grad or new.requires_grad):
        return torch.cat([cached, new], 2)  # training: keep autograd's graph simple
    cap = cached.stride(1) // hd if hd else 0
    if cached.stride() == (H * cap * hd, cap * hd, hd, 1) and cached.storage_offset() == 0 \
            and S + T <= cap and new.dtype == cached.dtype:
        out = cached.as_strided((B, H, S + T, hd), cached.stride())
    else:
        cap = S + T + CACHE_GROW
        buffer = cached.new_empty(B, H, cap, hd)
        buffer[:, :, :S] = cached
        out = buffer[:, :, :S + T]
    out[:, :, S:] = new
    return out


class Block(nn.Module):
    """Pre-norm transformer block (attention + gated MLP) with its own tiny KV cache."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        d, self.n_heads, self.theta = cfg.hidden_size, cfg.num_heads, cfg.rope_theta
        self.rope = Rope(d // self.n_heads, self.theta)
        self.attn_norm = RMSNorm(d, cfg.rms_eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d, cfg.rms_eps)
        self.gate_up = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)

    def forward(self, x, pos, cache=None, mask=None):
        """x [B, T, d], pos [T] absolute positions; cache: (keys, values) [B, H, S, hd] of the
        S positions before pos[0], or None; mask [T, S + T] bool (True: attend), default causal.
        Returns (y [B, T, d], new cache)."""
        B, T, d = x.shape
        q, k, v = (self.qkv(self.attn_norm(x)).view(B, T, 3, self.n_heads, d // self.n_heads)
                   .permute(2, 0, 3, 1, 4))  # each [B, H, T, hd]
        q, k = self.rope(q, pos), self.rope(k, pos)
        past = 0
        if cache is not None:
            past = cache[0].shape[2]
            k, v = appended(cache[0], k), appended(cache[1], v)
        if mask is not None:  # a draft tree's rows: each sees the context and its ancestors
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif past == 0:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        elif T == 1:
            att = F.scaled_dot_product_attention(q, k, v)
        else:  # queries at past..past+T-1 see keys 0..their own position
            mask = (torch.arange(past + T, device=x.device)[None, :]
                    <= torch.arange(past, past + T, device=x.device)[:, None])  # [T, S + T]
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o(att.transpose(1, 2).reshape(B, T, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up), (k, v)


def _int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, k] weight -> (int8 [n, k], bf16 scales [n]) for torch._weight_int8pack_mm."""
    scales = (weight.abs().amax(1) / 127).clamp(min=1e-12)
    return torch.round(weight / scales[:, None]).to(torch.int8), scales.to(torch.bfloat16)


def _one_row_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., k] holding one row -> x @ weight.T [..., n] (float32) from an `_int8` copy."""
    y = torch._weight_int8pack_mm(x.reshape(1, -1).to(torch.bfloat16), qweight, scales)
    return y.float().view(*x.shape[:-1], -1)


class OneRowInt8(nn.Module):
    """A Linear whose one-row calls read an int8 copy of its weight (DraftHead.
    quantize_for_drafting); wider calls (training, the catch-up over accepted tokens, tree
    levels) use the float weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear
        self.qweight, self.scales = _int8(linear.weight.detach())

    def forward(self, x):
        if x.numel() != x.shape[-1]:
            return self.linear(x)
        y = _one_row_int8(x, self.qweight, self.scales)
        return y + self.linear.bias if self.linear.bias is not None else y


class DraftHead(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.emb_norm = RMSNorm(d, cfg.rms_eps)
        self.feat_norm = RMSNorm(d, cfg.rms_eps)
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.block = Block(cfg)
        # Saved with the head: which target tokens the reduced LM head covers, the target's final
        # norm scale (its effective weight), and the feature scale the feature loss divides by.
        self.register_buffer("vocab_ids", torch.zeros(cfg.draft_vocab, dtype=torch.long))
        self.register_buffer("norm_scale", torch.ones(d))
        self.register_buffer("feat_std", torch.ones(()))
        # Tied to the target, never saved: its LM head rows for vocab_ids.
        self.register_buffer("lm_rows", torch.zeros(cfg.draft_vocab, d), persistent=False)

    def attach(self, target_model) -> "DraftHead":
        """Copy the target's LM-head rows for vocab_ids (frozen)."""
        weight = lm_head_weight(target_model)
        rows = weight[self.vocab_ids.to(weight.device)].float()
        self.lm_rows = rows.to(self.vocab_ids.device)
        return self

    def forward(self, feats, embeds, pos, cache=None, mask=None, last_only: bool = False):
        """feats, embeds [B, T, d] (f_t and embed(x_{t+1})), pos [T], mask: see Block.
        Returns (predicted f_{t+1} [B, T, d], reduced logits for x_{t+2} [B, T, N] (T = 1:
        the last position's only, with last_only), cache)."""
        pred, cache = self.predict(feats, embeds, pos, cache, mask)
        return pred, self.logits(pred[:, -1:] if last_only else pred), cache

    def predict(self, feats, embeds, pos, cache=None, mask=None):
        """forward without the logits: (predicted f_{t+1} [B, T, d], cache). Training takes
        the logits only where a position has a loss."""
        x = self.fc(torch.cat([self.emb_norm(embeds), self.feat_norm(feats)], dim=-1))
        h, cache = self.block(x, pos, cache, mask)
        return rms_normalize(h, self.cfg.rms_eps) * self.norm_scale, cache  # [B, T, d]

    def quantize_for_drafting(self) -> None:
        """Drafting on a CPU: one-row forwards (the common case, one draft token) read int8
        copies of the weights, with a scale per output row: the reduced LM head and every
        linear layer. Right after the target's forward has evicted them from the caches,
        int8 rows are read about 1.4x faster than fp32 ones, 1.7x for the LM head (0.54 ms
        against 0.94 for its 8192 rows; interleaved microbenchmark), and bf16 is slower than
        fp32 here. Drafts move a little; verification stays exact."""
        if getattr(self, "_int8_rows", None) is not None:
            return
        self._int8_rows = _int8(self.lm_rows)
        self.fc = OneRowInt8(self.fc)
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(self.block, name, OneRowInt8(getattr(self.block, name)))

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Features [..., d] -> the target's logits over the reduced vocabulary [..., N]."""
        int8 = getattr(self, "_int8_rows", None)
        if int8 is not None and feats.numel() == feats.shape[-1]:  # one row
            logits = _one_row_int8(feats, *int8)
        else:
            logits = feats @ self.lm_rows.T
        cap = self.cfg.logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits


# -- reading the target ------------------------------------------------------------------------


def final_norm(model) -> nn.Module:
    """The target's final norm: its output is what the LM head reads (our features)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model")
    norm = getattr(base, "norm", None)
    if norm is None:
        raise ValueError(f"{type(model).__name__}: cannot find the final norm (model.norm)")
    return norm


def lm_head_weight(model) -> torch.Tensor:
    """[vocab, d] floating weight of the target's LM head (dequantized if bitsandbytes 4-bit)."""
    weight = model.get_output_embeddings().weight
    if not weight.dtype.is_floating_point:
        import bitsandbytes.functional as bnbf
        weight = bnbf.dequantize_4bit(weight.data, weight.quant_state)
    return weight.detach()


@torch.no_grad()
def norm_scale_of(model) -> torch.Tensor:
    """The final norm's effective per-channel weight (Gemma's 1 + w, Llama's w): the norm of a
    vector of ones, whose RMS is 1."""
    norm = final_norm(model)
    p = next(norm.parameters())
    return norm(torch.ones(1, p.shape[-1], dtype=p.dtype, device=p.device)).float()[0].cpu()


class FeatureTap:
    """Keeps the output of the target's final norm from its latest forward."""

    def __init__(self, model):
        self.last: torch.Tensor | None = None  # [batch, fed tokens, d]
        self._handle = final_norm(model).register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.last = output[0] if isinstance(output, tuple) else output

    def features(self, n: int, rows: list[int] | None = None) -> torch.Tensor:
        """Features of the latest forward, batch row 0: its first n positions, or the
        positions `rows` (a draft tree's accepted path): [n, d]."""
        if rows is None:
            return self.last[0, :n]
        return self.last[0, torch.tensor(rows, device=self.last.device)]

    def close(self) -> None:
        self._handle.remove()


@torch.inference_mode()
def target_features(model, ids: list[int]) -> torch.Tensor:
    """Features of every position of `ids` ([len, d] float32), by one target forward."""
    tap = FeatureTap(model)
    try:
        device = next(model.parameters()).device
        model(torch.tensor([ids], device=device), use_cache=False, logits_to_keep=1)
        return tap.features(len(ids)).float()
    finally:
        tap.close()


# -- the drafter -------------------------------------------------------------------------------


class HeadDrafter:
    """Drafts with a DraftHead. Keeps the target's features of the conversation (from
    `observe`, or computed itself when missing) and the head's own KV cache, both synced with
    the context by common prefix, like ModelDrafter's cache.

    Head position t reads (f_t, x_{t+1}); with context x_0..x_{L-1} the target has computed
    f_0..f_{L-2} (its cache holds every token but the newest), so the head's last true position
    is L-2 and predicts f_{L-1} and the first draft x_L.
    """

    name = "head"
    needs_features = True

    def __init__(self, head: DraftHead, target_model, vocab_size: int, min_gain: float = 0.0,
                 tree_width: int = 4, tree_beam: int = 4,
                 tree_min_score: float = 0.2):
        self.head = head.eval()
        if head.vocab_ids.device.type == "cpu":
            head.quantize_for_drafting()
        # The shape of draft trees (`propose_tree`): children per node, nodes expanded a level,
        # the least score (the head's chance of acceptance) a node needs.
        self.tree_width, self.tree_beam = tree_width, tree_beam
        self.tree_min_score = tree_min_score
        self.target = target_model
        self.embed = target_model.get_input_embeddings()
        self.vocab_size = vocab_size  # width of the engine's target logits (and our q rows)
        # Stop drafting once the head's own estimate that this draft and every one before it
        # pass (the product of their probabilities under the head) falls below min_gain: a draft
        # that will almost surely be rejected still costs a head step and a wider verify. The
        # head's probabilities track acceptance (EAGLE-2): measured over 26 Spec-Bench replies,
        # drafts it gave 0.1-0.2 passed 9% of the time, 0.5-0.6 48%, 0.9-1 90%.
        self.min_gain = min_gain
        # And do not even run the head for the next draft once the product is under twice
        # min_gain: that draft would need a probability of at least 1/2 to be kept, and the
        # forward is usually spent for nothing. Replayed on 569 drafting steps of 39 Spec-Bench
        # replies: 17% fewer head forwards, 3% fewer accepted drafts, tokens per unit of cost
        # +1.2%.
        self.lookahead = 2.0
        self.device = head.vocab_ids.device
        self.tokens: list[int] = []  # context tokens whose features are in self.feats[:len]
        self.feats = torch.zeros(0, head.cfg.hidden_size, device=self.device)  # [capacity, d]
        self.cache = None  # head KV cache over positions 0..len(head_tokens)-2
        self.head_tokens: list[int] = []  # the tokens that cache was built from
        self.computed = 0  # features the drafter had to compute itself (no observe)
        self.coupled = True  # sampled drafts verified one-hot (see _sample); False: with q

    def begin(self, prompt_ids):
        pass  # features and cache survive across requests: a chat's history is reused

    def observe(self, start: int, token_ids: list[int], features: torch.Tensor) -> None:
        """The target computed `features` [n, d] for context positions start..start+n-1
        (tokens `token_ids`), all of them accepted."""
        if start > len(self.tokens):
            return  # a gap (features we never saw): propose() recomputes what it needs
        del self.tokens[start:]
        self.tokens.extend(token_ids)
        self._store(start, features)

    def _store(self, start: int, features: torch.Tensor) -> None:
        end = start + features.shape[0]
        if end > self.feats.shape[0]:
            grown = torch.zeros(max(end, 2 * self.feats.shape[0], 256), self.feats.shape[1],
                                device=self.device)
            grown[:start] = self.feats[:start]
            self.feats = grown
        self.feats[start:end] = features.to(self.device, torch.float32)

    def _ensure_features(self, prefix: list[int]) -> None:
        """Make self.feats[:len(prefix)] the target's features of `prefix`."""
        known = _common_prefix_len(self.tokens, prefix)
        if known < len(prefix):
            self.computed += len(prefix)
            self.tokens = list(prefix)
            self._store(0, target_features(self.target, prefix))

    def _embed(self, ids: list[int]) -> torch.Tensor:
        emb_device = self.embed.weight.device
        return self.embed(torch.tensor([ids], device=emb_device)).to(self.device, torch.float32)

    def _sync_cache(self, context: list[int]) -> int:
        """Crop the head cache to the positions still valid for `context`; return their count."""
        keep = max(0, min(len(self.head_tokens), _common_prefix_len(self.head_tokens, context))
                   - 1)
        if self.cache is not None:
            self.cache = (self.cache[0][:, :, :keep], self.cache[1][:, :, :keep])
        self.head_tokens = self.head_tokens[:keep + 1] if keep else []
        return keep

    def _catch_up(self, context):
        """Run the head over the true positions it has not seen. Returns its predicted
        feature f_{L-1} and logits for x_L at the last one ([1, 1, d], [1, 1, N])."""
        L = len(context)
        self._ensure_features(context[:-1])  # f_0 .. f_{L-2}
        h = self._sync_cache(context[:-1])  # at most L-2: always re-feed one true position
        # Catch up on true positions h..L-2: inputs (f_t, x_{t+1}).
        pos = torch.arange(h, L - 1, device=self.device)
        pred, logits, self.cache = self.head(self.feats[h:L - 1][None],
                                             self._embed(context[h + 1:L]), pos, self.cache,
                                             last_only=True)
        self.head_tokens = list(context)
        return pred[:, -1:], logits[:, -1:]

    @torch.inference_mode()
    def propose(self, context, k, params, noise):
        L = len(context)
        if k <= 0 or L < 2:
            return _EMPTY, None
        pred, logits = self._catch_up(context)
        ids, rows = [], []
        p_all = 1.0  # the head's probability that every draft so far passes
        for i in range(k):
            reduced_logits = logits[0, -1:]  # [1, N]
            token, q, p_token = self._sample(reduced_logits, params, noise, L + i)
            p_all *= p_token
            if p_all < self.min_gain:
                break
            ids.append(token)
            if q is not None:
                rows.append(q)
            if i == k - 1 or p_all < self.lookahead * self.min_gain:
                break
            pos = torch.tensor([L - 1 + i], device=self.device)
            pred, logits, self.cache = self.head(pred[:, -1:], self._embed([token]), pos,
                                                 self.cache)
        # Drafted positions carry predicted features: drop them, the target will supply true ones.
        self._sync_cache(context)
        draft_ids = torch.tensor(ids, dtype=torch.long)
        return draft_ids, (torch.stack(rows) if rows else None)

    @torch.inference_mode()
    def propose_tree(self, context, depth: int, params: SamplingParams, nodes: int):
        """A draft tree of at most `nodes` nodes and `depth` levels (EAGLE-2's dynamic
        tree). A node's score is the product of the head's probabilities along its path, the
        head's estimate that the target accepts it; nodes under `tree_min_score` are not worth
        their share of the wider verify. Each level, the `tree_beam` best new nodes are expanded
        with one head forward (their rows see the context and their own ancestors) and each
        gets its `tree_width` likeliest tokens as children. The tree is the `nodes` best
        nodes found (ancestor-closed: a node never scores above its parent). Drafts are one-hot
        (tree.py verifies with the target's own draws): the probabilities only rank."""
        L = len(context)
        if depth <= 0 or nodes <= 0 or L < 2:
            return _EMPTY, None
        feat, logits = self._catch_up(context)
        temperature = 1.0 if params.greedy else params.temperature
        base = self.cache[0].shape[2]  # head cache slots of the true positions
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        sees: dict[int, list[int]] = {-1: []}  # expanded node -> head cache slots it attends to
        # The frontier: expanded nodes (the root first), their predicted features [R, d] (the
        # feature input of their children), logits [R, N] and scores.
        front, front_feat, front_logits, front_score = [-1], feat[0], logits[0], [1.0]
        for level in range(1, depth + 1):
            p, index = torch.softmax(front_logits.float() / temperature, -1).topk(self.tree_width)
            grown, rows = [], []
            for r, (pr, ir) in enumerate(zip(p.tolist(), index.tolist())):
                for pj, ij in zip(pr, ir):
                    score = front_score[r] * pj
                    if score < self.tree_min_score:
                        break
                    tokens.append(ij)  # a reduced-vocabulary index until the end
                    parents.append(front[r])
                    scores.append(score)
                    grown.append(len(tokens) - 1)
                    rows.append(r)
            if level == depth or not grown:
                break
            # Deeper nodes score at most their parents: stop once none can make the tree.
            if len(scores) >= nodes:
                last_place = sorted(scores, reverse=True)[nodes - 1]
                if max(scores[i] for i in grown) <= last_place:
                    break
            expand = sorted(range(len(grown)), key=lambda j: -scores[grown[j]])[:self.tree_beam]
            expand.sort()
            seen = self.cache[0].shape[2]
            mask = torch.zeros(len(expand), seen + len(expand), dtype=torch.bool,
                               device=self.device)
            mask[:, :base] = True
            for r, j in enumerate(expand):
                node = grown[j]
                sees[node] = sees[parents[node]] + [seen + r]
                mask[r, sees[node]] = True
            feats = front_feat[torch.tensor([rows[j] for j in expand], device=self.device)]
            ids = self.head.vocab_ids[torch.tensor([tokens[grown[j]] for j in expand])].tolist()
            pos = torch.full((len(expand),), L - 2 + level, device=self.device)
            pred, out, self.cache = self.head(feats[None], self._embed(ids), pos, self.cache,
                                              mask)
            front = [grown[j] for j in expand]
            front_feat, front_logits = pred[0], out[0]
            front_score = [scores[i] for i in front]
        self._sync_cache(context)  # drop the tree's rows: the target supplies true features
        if not tokens:
            return _EMPTY, None
        best = sorted(range(len(tokens)), key=lambda i: -scores[i])[:nodes]
        best.sort()  # creation order: parents first
        new_index = {old: new for new, old in enumerate(best)}
        ids = self.head.vocab_ids[torch.tensor([tokens[i] for i in best])].cpu()
        return DraftTree(ids, [new_index[parents[i]] if parents[i] >= 0 else -1 for i in best])

    def _sample(self, reduced_logits, params: SamplingParams, noise, position: int):
        """-> (full-vocab token id, its q row [vocab] or None for a one-hot draft, the token's
        probability under the head: at temperature 1 when greedy, else under q).

        Sampled with the target's own keyed random numbers for this position (`sampling.race`):
        the target's draw there is the same race over p, so the draft is the target's token
        whenever the two races agree (Gumbel coupling), and the step verifies it as a one-hot
        draft: the emitted tokens are plain sampling's, whatever the head proposed."""
        if params.greedy:
            p_top, index = torch.softmax(reduced_logits[0].float(), -1).max(-1)
            return int(self.head.vocab_ids[int(index)]), None, float(p_top)
        ids, probs = nucleus(reduced_logits[0], params)  # over the reduced vocabulary
        vocab_ids = self.head.vocab_ids.cpu()
        kept = vocab_ids if ids is None else vocab_ids[ids]
        i = race(kept, probs, noise, position)
        if self.coupled:
            return int(kept[i]), None, float(probs[i])
        q = torch.zeros(self.vocab_size)  # tokens outside the reduced vocabulary: q = 0
        q[kept] = probs.float()
        return int(kept[i]), q, float(probs[i])

    def feedback(self, n_drafted, n_accepted):
        pass


class CombinedDrafter:
    """Prompt lookup when it finds a continuation of a match of at least `min_match` tokens, the
    head otherwise: a 1-token match is a weak guess that the head usually beats."""

    name = "combined"
    needs_features = True

    def __init__(self, ngram, head: HeadDrafter, min_match: int = 2):
        self.ngram, self.head, self.min_match = ngram, head, min_match

    def begin(self, prompt_ids):
        self.ngram.begin(prompt_ids)
        self.head.begin(prompt_ids)

    def observe(self, start, token_ids, features):
        self.head.observe(start, token_ids, features)

    def draft_class(self, context):
        """The n-gram match length when lookup will draft, else "head"."""
        n = self.ngram.draft_class(context)
        return n if n >= self.min_match else "head"

    def propose(self, context, k, params, noise):
        if self.draft_class(context) != "head":
            return self.ngram.propose(context, k, params, noise)
        return self.head.propose(context, k, params, noise)

    def propose_tree(self, context, depth, params, nodes):
        if self.draft_class(context) != "head":
            return self.ngram.propose(context, depth, params, None)
        return self.head.propose_tree(context, depth, params, nodes)

    def feedback(self, n_drafted, n_accepted):
        self.ngram.feedback(n_drafted, n_accepted)
        self.head.feedback(n_drafted, n_accepted)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    from specchat.drafters import _common_prefix_len as common
    return common(a, b)


# -- target identity, saving and loading -------------------------------------------------------

_CONFIG_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim",
                "rms_norm_eps", "tie_word_embeddings")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@torch.no_grad()
def target_identity(model, tokenizer, name: str = "") -> dict:
    """What a head is bound to: the target's architecture, vocabulary and (a sample of) weights.
    Independent of quantization and dtype, so an NF4 and an fp32 load of one model match."""
    cfg = model.config.get_text_config().to_dict()
    config_hash = _sha(json.dumps({k: cfg.get(k) for k in _CONFIG_KEYS}, sort_keys=True))[:16]
    vocab_hash = _sha(json.dumps(sorted(tokenizer.get_vocab().items())))[:16]
    emb = model.get_input_embeddings().weight
    rows = torch.linspace(1, emb.shape[0] - 1, 16).long().to(emb.device)
    fingerprint = torch.cat([norm_scale_of(model)[:64],
                             emb[rows, :16].float().flatten().cpu()])
    return {"name": name, "config": config_hash, "vocab": vocab_hash,
            "key": _sha(config_hash + vocab_hash)[:12],
            "fingerprint": [round(float(x), 5) for x in fingerprint]}


def identity_problem(recorded: dict, actual: dict) -> str | None:
    """None when a head recorded for `recorded` may draft for `actual`; else why not."""
    if recorded.get("config") != actual["config"]:
        return "its architecture differs"
    if recorded.get("vocab") != actual["vocab"]:
        return "its vocabulary differs"
    a, b = torch.tensor(recorded.get("fingerprint", [])), torch.tensor(actual["fingerprint"])
    if a.shape != b.shape or not torch.allclose(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max())):
        return "its weights differ (a fine-tune or another checkpoint of the same architecture)"
    return None


def slug(name: str) -> str:
    base = Path(name.rstrip("/")).name if name else "target"
    base = base.split(" (")[0]  # "Gemma 3 270M (embedded, ...)" -> "Gemma 3 270M"
    return re.sub(r"[^a-z0-9.]+", "-", base.lower()).strip("-") or "target"


def default_head_dir(identity: dict) -> Path:
    from specchat.models import cache_dir
    return cache_dir() / "heads" / f"{slug(identity['name'])}-{identity['key']}"


SHIPPED_DIR = Path(__file__).resolve().parent.parent / "assets" / "heads"


def save_head(path: str | Path, head: DraftHead, identity: dict, meta: dict | None = None,
              dtype: torch.dtype = torch.bfloat16):
    """Weights in `dtype` (bf16 halves the file; drafting runs in fp32 either way)."""
    from safetensors.torch import save_file
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    params = {name for name, _ in head.named_parameters()}
    tensors = {k: (v.to(dtype) if k in params else v).detach().cpu().contiguous()
               for k, v in head.state_dict().items()}
    header = {"format": FORMAT, "config": asdict(head.cfg), "target": identity,
              "meta": meta or {}}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"specchat": json.dumps(header)})
    tmp.replace(path)  # atomic: a killed save never leaves half a head


def read_header(path: str | Path) -> dict:
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {}).get("specchat", "{}"))
    except Exception as e:  # noqa: BLE001  (a truncated or foreign file: say so)
        raise HeadMismatchError(f"{path}: not a readable draft head ({e})") from e
    if header.get("format") != FORMAT:
        raise HeadMismatchError(f"{path}: not a specchat draft head (format "
                                f"{header.get('format')!r}, expected {FORMAT!r})")
    return header


def load_head(path: str | Path, model, tokenizer, identity: dict | None = None,
              name: str = "") -> DraftHead:
    """Load a head for `model`, refusing one trained for another target."""
    from safetensors.torch import load_file
    header = read_header(path)
    actual = identity or target_identity(model, tokenizer, name)
    problem = identity_problem(header["target"], actual)
    if problem:
        trained_for = header["target"].get("name") or "another target"
        raise HeadMismatchError(
            f"The draft head {path} was trained for {trained_for}"
            f" (config {header['target'].get('config')}, vocab {header['target'].get('vocab')}); "
            f"the loaded target {actual['name'] or ''} (config {actual['config']}, vocab "
            f"{actual['vocab']}) is different: {problem}. Train a head for this target with "
            f"`python -m specchat train-draft --target ...`.")
    head = DraftHead(HeadConfig(**header["config"]))
    head.load_state_dict(load_file(str(path)), strict=False)
    device = next(model.parameters()).device
    return head.to(device).attach(model).eval()


def any_heads() -> bool:
    """Is there any head file at all (so that hashing the target's vocabulary can be skipped)?"""
    from specchat.models import cache_dir
    return any((cache_dir() / "heads").glob("*/head.safetensors")) or \
        any(SHIPPED_DIR.glob("*.safetensors"))


def find_head(identity: dict) -> Path | None:
    """The head for this target: trained here (cache) first, then one shipped in assets/."""
    candidates = [default_head_dir(identity) / "head.safetensors",
                  *sorted(SHIPPED_DIR.glob(f"*-{identity['key']}.safetensors"))]
    for path in candidates:
        if path.exists():
            return path
    return None


# A draft token costs a head step (c ~ 0.07 target steps here) and widens the verify (~0.05);
# below this estimated chance of passing it does not pay for itself.
MIN_GAIN = 0.15


def head_drafters(target, ngram, path: str | Path | None = None,
                  min_gain: float = MIN_GAIN) -> tuple[dict, list[str]]:
    """Drafters `head` and `combined` for a models.LoadedModel target, when a head for it exists
    (or `path` names one). Returns (drafters, notes for the user)."""
    if path is None and not any_heads():
        return {}, []
    identity = target_identity(target.model, target.tokenizer, target.name)
    path = path or find_head(identity)
    if path is None:
        return {}, []
    try:
        head = load_head(path, target.model, target.tokenizer, identity)
    except HeadMismatchError as e:
        return {}, [f"Draft head refused: {e}"]
    drafter = HeadDrafter(head, target.model, len(target.tokenizer), min_gain)
    return {"head": drafter, "combined": CombinedDrafter(ngram, drafter)}, []


def count_parameters(head: DraftHead) -> int:
    return sum(p.numel() for p in head.parameters())


def smooth_l1(pred: torch.Tensor, target: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.smooth_l1_loss(pred / scale, target / scale, reduction="none").mean(-1)


__all__ = ["CombinedDrafter", "DraftHead", "FeatureTap", "HeadConfig", "HeadDrafter",
           "HeadMismatchError", "find_head", "head_drafters", "load_head", "save_head",
           "target_identity"]
