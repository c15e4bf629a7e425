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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specchat import kernels
from specchat.models.gguf_head import BLOCK as Q8_BLOCK  # values per Q8_0 scale
from specchat.runners import nf4
from specchat.runners.cpu.head_step import HeadStep
from specchat.runners.hf.features import FeatureTap, final_norm


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


def slots_held(cached: torch.Tensor) -> int:
    """How many slots along S `cached` [B, H, S, hd] may take in place: the capacity its
    strides describe when it is the first S slots of a buffer [B, H, cap, hd] (one made by
    `extended`), bounded by what its storage really holds. torch gives a tensor with S = 0 the
    strides of one with S = 1, over an empty storage too: only the storage's size tells the
    room. 0 when `cached` is no such buffer's prefix."""
    B, H, S, hd = cached.shape
    if not (B and H and hd) or cached.storage_offset() != 0:
        return 0
    cap = cached.stride(1) // hd
    if cached.stride() != (H * cap * hd, cap * hd, hd, 1):
        return 0
    held = cached.untyped_storage().nbytes() // cached.element_size()
    last_row = (B - 1) * cached.stride(0) + (H - 1) * cached.stride(1)  # its first element
    return max(0, min(cap, (held - last_row) // hd))


def extended(cached: torch.Tensor, T: int) -> torch.Tensor:
    """cached [B, H, S, hd] as the first S slots of [B, H, S + T, hd] (the last T not yet
    written): in place when `cached` is the first S slots of a buffer with room after them
    (one made here: `slots_held`), else in a new buffer with CACHE_GROW spare slots; cropping a
    cache by slicing keeps the buffer."""
    B, H, S, hd = cached.shape
    if S + T <= slots_held(cached):
        return cached.as_strided((B, H, S + T, hd), cached.stride())
    buffer = cached.new_empty(B, H, S + T + CACHE_GROW, hd)
    buffer[:, :, :S] = cached
    return buffer[:, :, :S + T]


def extended_pair(cache: tuple[torch.Tensor, torch.Tensor], T: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`extended` for a cache's keys and values, over buffers alike (one stride), as the C step
    takes them: a torch forward's first values are a view of its qkv product, not a buffer's
    prefix, and get a buffer of their own; then both are copied to buffers of one size."""
    keys, values = extended(cache[0], T), extended(cache[1], T)
    if keys.stride() != values.stride():  # two contiguous copies [B, H, S + T, hd]: alike
        keys, values = (c.clone(memory_format=torch.contiguous_format) for c in (keys, values))
    return keys, values


def appended(cached: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """cached [B, H, S, hd] followed by new [B, H, T, hd] along S, over `extended`'s buffer:
    a drafting step copies T slots, not the whole cache as `torch.cat` would at every
    forward."""
    if torch.is_grad_enabled() and (cached.requires_grad or new.requires_grad):
        return torch.cat([cached, new], 2)  # training: keep autograd's graph simple
    S = cached.shape[2]
    out = extended(cached, new.shape[2])
    out[:, :, S:] = new
    return out


def attend(q, k, v, cache=None, mask=None):
    """Attention of new queries q [B, H, T, hd] over the cached keys and values (k, v
    [B, Hkv, S, hd], or None) followed by the new k, v [B, Hkv, T, hd]; Hkv may divide H
    (grouped queries). mask [T, S + T] bool (True: attend), default causal.
    Returns (output [B, H, T, hd], the cache with the new keys and values)."""
    T = q.shape[2]
    past = 0
    if cache is not None:
        past = cache[0].shape[2]
        k, v = appended(cache[0], k), appended(cache[1], v)
    gqa = k.shape[1] != q.shape[1]
    if mask is None and past and T > 1:  # queries at past..past+T-1 see keys 0..their own
        mask = (torch.arange(past + T, device=q.device)[None, :]
                <= torch.arange(past, past + T, device=q.device)[:, None])  # [T, S + T]
    if mask is not None:  # a draft tree's rows: each sees the context and its ancestors
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    else:
        att = F.scaled_dot_product_attention(q, k, v, is_causal=past == 0 and T > 1,
                                             enable_gqa=gqa)
    return att, (k, v)


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

    def forward(self, x, pos, cache=None, mask=None, last_only: bool = False):
        """x [B, T, d], pos [T] absolute positions; cache: (keys, values) [B, H, S, hd] of the
        S positions before pos[0], or None; mask [T, S + T] bool (True: attend), default causal.
        Returns (y [B, T, d], new cache); with `last_only` (no mask) y [B, 1, d], the last
        position's: the others need only their keys and values."""
        B, T, d = x.shape
        q, k, v = (self.qkv(self.attn_norm(x)).view(B, T, 3, self.n_heads, d // self.n_heads)
                   .permute(2, 0, 3, 1, 4))  # each [B, H, T, hd]
        if last_only and mask is None and T > 1:  # the last query sees every key: no mask
            q, x, T = q[:, :, -1:], x[:, -1:], 1
            q_pos = pos[-1:]
        else:
            q_pos = pos
        q, k = self.rope(q, q_pos), self.rope(k, pos)
        att, cache = attend(q, k, v, cache, mask)
        x = x + self.o(att.transpose(1, 2).reshape(B, T, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up), cache


def _int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, k] weight -> (int8 [n, k], bf16 scales [n]) for torch._weight_int8pack_mm."""
    scales = (weight.abs().amax(1) / 127).clamp(min=1e-12)
    return torch.round(weight / scales[:, None]).to(torch.int8), scales.to(torch.bfloat16)


def _q8_0(weight: torch.Tensor, rows_at_once: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, k] weight (k a multiple of 32) -> (int8 [n, k], float16 scales [n, k / 32]): one
    scale per 32 values, as `kernels.q8_0_matmul_i8` reads them. A few rows at a time: the float
    temporaries of a whole matrix (five of them) would raise the process's peak memory by
    tens of MB while the head loads."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int8)
    d = torch.empty(n, k // Q8_BLOCK, dtype=torch.float16)
    for r in range(0, n, rows_at_once):
        blocks = weight[r:r + rows_at_once].detach().float().reshape(-1, k // Q8_BLOCK, Q8_BLOCK)
        scales = (blocks.abs().amax(-1) / 127).to(torch.float16)
        scale = scales.float()[..., None]
        values = torch.where(scale > 0, torch.round(blocks / scale.clamp(min=1e-30)), 0.0)
        q[r:r + rows_at_once] = values.clamp(-127, 127).to(torch.int8).reshape(-1, k)
        d[r:r + rows_at_once] = scales
    return q, d


INT8_ROWS = 16  # the most rows a drafting call reads torch's int8 weights for (wider: float)
BLOCK_LINEARS = ("qkv", "o", "gate_up", "down")  # the block's products


def _int8_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., k] -> x @ weight.T [..., n] (float32) from an `_int8` copy."""
    y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), qweight, scales)
    return y.float().view(*x.shape[:-1], -1)


class Int8Drafting(nn.Module):
    """A Linear whose drafting calls read an integer copy of its weight
    (DraftHead.quantize_for_drafting), a quarter of the float bytes:
    - with specchat's kernels (`lib`, a `kernels.load` build): Q8_0 blocks, one scale per 32
      values, through the integer product the target's LM head uses (csrc/q8_0.c), at every
      row count: about half the time of torch's int8 product, and faster than float32 from one
      row to a 48-row catch-up (docs/cpu.md);
    - else torch's int8 product with a scale per output row for calls of up to INT8_ROWS rows
      (a draft token, the catch-up over the tokens a verify accepted, a tree level): for a few
      rows 2-3x faster than float32 (docs/cpu.md).
    Wider calls without Q8_0 blocks (the catch-up over a new prompt, or over the steps the head
    sat out), and Q8_0 ones on CPUs with native bf16 products (`wide_bf16`: 2-3x faster than
    float32 there), read a bf16 copy where `wide_bf16`, else the float weight; training always
    the float weight."""

    def __init__(self, linear: nn.Linear, wide_bf16: bool = False, lib=None,
                 packed: bool = False):
        super().__init__()
        self.linear = linear
        weight = linear.weight.detach()
        self.lib = lib if lib is not None and _q8_0_fits(lib, weight.shape[1]) else None
        self.packed = False  # the Q8_0 copy repacked for `q8_0_rows_matmul_i8` (_q8_0_copy)
        if self.lib is not None:
            self.q8, self.packed = _q8_0_copy(weight, self.lib, packed)
        else:
            self.qweight, self.scales = _int8(weight)
        self.wide = weight.to(torch.bfloat16) if wide_bf16 else None

    def forward(self, x):
        if torch.is_grad_enabled() and x.requires_grad:
            return self.linear(x)
        narrow = x.numel() <= INT8_ROWS * x.shape[-1]
        if self.lib is not None and (narrow or self.wide is None):
            y = _q8_product(self.packed)(self.lib, x, *self.q8)
        elif not narrow:
            if self.wide is None:
                return self.linear(x)
            y = F.linear(x.to(torch.bfloat16), self.wide).float()
        else:
            y = _int8_mm(x, self.qweight, self.scales)
        return y + self.linear.bias if self.linear.bias is not None else y


def _q8_0_fits(lib, in_features: int) -> bool:
    return in_features % Q8_BLOCK == 0 and in_features <= lib.max_in()


def _q8_0_copy(weight: torch.Tensor, lib, packed: bool
               ) -> tuple[tuple[torch.Tensor, torch.Tensor], bool]:
    """A weight's Q8_0 copy for `lib`'s integer products: (values, scales) as
    `q8_0_matmul_i8` reads them, or with `packed` (where the weight's rows come in groups of
    16) repacked in place for `q8_0_rows_matmul_i8`, the LM head's VNNI kernel: half the time
    of the row-major one for a draft's few rows. -> (the copy, whether it is packed)."""
    q, d = _q8_0(weight)
    if packed and q.shape[0] % kernels.I8_ROWS == 0:
        return (q, kernels.q8_0_i8_pack(lib, q, d)), True
    return (q, d), False


def _q8_product(packed: bool):
    """The kernels' wrapper that takes a `_q8_0_copy`."""
    return kernels.q8_0_rows_matmul_i8 if packed else kernels.q8_0_matmul_i8


class DraftHead(nn.Module):
    # The target's features it reads: the final norm's output (`Drafter.feature_layers`).
    feature_layers = None

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

    @property
    def feature_width(self) -> int:
        """Width of one position's target features."""
        return self.cfg.hidden_size

    def embedder(self, target_model) -> nn.Module:
        """What embeds the next token x_{t+1}: the target's own embedding module."""
        return target_model.get_input_embeddings()

    def attach(self, target_model) -> "DraftHead":
        """Copy the target's LM-head rows for vocab_ids (frozen)."""
        weight = lm_head_weight(target_model)
        rows = weight[self.vocab_ids.to(weight.device)].float()
        self.lm_rows = rows.to(self.vocab_ids.device)
        return self

    def forward(self, feats, embeds, pos, cache=None, mask=None, last_only: bool = False):
        """feats, embeds [B, T, d] (f_t and embed(x_{t+1})), pos [T], mask: see Block.
        Returns (predicted f_{t+1} [B, T, d], reduced logits for x_{t+2} [B, T, N], cache); with
        last_only T = 1 in both, the last position's: the others only fill the cache (a
        catch-up over a prompt runs the MLP for one row, not for every token)."""
        step = getattr(self, "_step", None)  # a chain of a few rows, drafting: one C call
        if step is not None and mask is None and not torch.is_grad_enabled() \
                and step.takes(feats, embeds, cache, last_only):
            n = feats.shape[1]
            if cache is None:
                empty = feats.new_empty(1, step.heads, 0, step.head_dim)
                cache = (empty, empty)
            cache = extended_pair(cache, n)
            return (*step(feats, embeds, pos, *cache, last_only), cache)
        pred, cache = self.predict(feats, embeds, pos, cache, mask, last_only)
        return pred, self.logits(pred[:, -1:] if last_only else pred), cache

    def predict(self, feats, embeds, pos, cache=None, mask=None, last_only: bool = False):
        """forward without the logits: (predicted f_{t+1} [B, T, d], cache); with `last_only`
        the last position's [B, 1, d] (the others only fill the cache). Training takes the
        logits only where a position has a loss."""
        x = self.fc(torch.cat([self.emb_norm(embeds), self.feat_norm(feats)], dim=-1))
        h, cache = self.block(x, pos, cache, mask, last_only)
        return rms_normalize(h, self.cfg.rms_eps) * self.norm_scale, cache  # [B, T, d]

    def quantize_for_drafting(self, wide_bf16: bool = False, lib=None,
                              packed: bool | None = None) -> None:
        """Drafting on a CPU: forwards of a few rows (a draft token, a catch-up, a tree level)
        read integer copies of the weights: the reduced LM head and every linear layer, as Q8_0
        blocks through specchat's kernels where `lib` is given and fits, else int8 with a scale
        per output row through torch's product (`Int8Drafting`). Right after the target's
        forward has evicted them from the caches, int8 rows are read faster than fp32 ones (a
        quarter of the bytes), while bf16 is slower than fp32 on CPUs without native bf16.
        `wide_bf16` (CPUs with native bf16): wider forwards through bf16 copies of the layers.
        `packed`: every Q8_0 copy repacked for the VNNI kernel the target's integer LM head runs
        (`kernels.q8_0_rows_matmul_i8`); None: where `lib` runs it with VNNI (elsewhere that
        kernel is its plain C reference, slower than the row-major AVX2 one). Either way every
        layer takes the same product, in torch and in the C step alike. Drafts move a little;
        verification stays exact."""
        if getattr(self, "_int8_rows", None) is not None:
            return
        d = self.lm_rows.shape[1]
        self._q8_lib = lib if lib is not None and _q8_0_fits(lib, d) else None
        linears = [self.fc] + [getattr(self.block, name) for name in BLOCK_LINEARS]
        if packed is None:
            packed = lib is not None and lib.rows_i8_vnni
        # all or none: the C step takes one product for every layer
        shapes = [m.weight.shape for m in linears] + [self.lm_rows.shape]
        packed = packed and self._q8_lib is not None and all(
            out % kernels.I8_ROWS == 0 and _q8_0_fits(lib, cols) for out, cols in shapes)
        self._q8_packed = packed
        if self._q8_lib is not None:
            self._int8_rows, _ = _q8_0_copy(self.lm_rows, self._q8_lib, packed)
        else:
            self._int8_rows = _int8(self.lm_rows)
        self._wide_logits = wide_bf16
        self.fc = Int8Drafting(self.fc, wide_bf16, lib, packed)
        for name in BLOCK_LINEARS:
            setattr(self.block, name,
                    Int8Drafting(getattr(self.block, name), wide_bf16, lib, packed))
        # Every layer on Q8_0 blocks: a chain's step of up to INT8_ROWS rows in one C call
        layers = (self.fc, self.block.qkv, self.block.o, self.block.gate_up, self.block.down)
        if self._q8_lib is not None and all(m.lib is not None for m in layers) \
                and self.fc.linear.bias is not None:
            self._step = HeadStep(self, self._q8_lib, INT8_ROWS)

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Features [..., d] -> the target's logits over the reduced vocabulary [..., N]."""
        int8 = getattr(self, "_int8_rows", None)
        narrow = feats.numel() <= INT8_ROWS * feats.shape[-1]
        if int8 is not None and self._q8_lib is not None and (narrow or not self._wide_logits):
            logits = _q8_product(self._q8_packed)(self._q8_lib, feats, *int8)
        elif int8 is not None and narrow:
            logits = _int8_mm(feats, *int8)
        else:
            logits = feats @ self.lm_rows.T
        cap = self.cfg.logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits


def lm_head_weight(model) -> torch.Tensor:
    """[vocab, d] floating weight of the target's LM head (dequantized if bitsandbytes 4-bit)."""
    weight = model.get_output_embeddings().weight
    if not weight.dtype.is_floating_point:
        import bitsandbytes.functional as bnbf
        weight = bnbf.dequantize_4bit(*nf4.codes_and_state(model.get_output_embeddings()))
    return weight.detach()


@torch.no_grad()
def norm_scale_of(model) -> torch.Tensor:
    """The final norm's effective per-channel weight (Gemma's 1 + w, Llama's w): the norm of a
    vector of ones, whose RMS is 1."""
    norm = final_norm(model)
    p = next(norm.parameters())
    return norm(torch.ones(1, p.shape[-1], dtype=p.dtype, device=p.device)).float()[0].cpu()


@torch.inference_mode()
def target_features(model, ids: list[int], layers: tuple[int, ...] | None = None) -> torch.Tensor:
    """Features of every position of `ids` ([len, width] float32), by one target forward: the
    final norm's output, or the hidden states entering decoder layers `layers` (FeatureTap)."""
    tap = FeatureTap(model, layers)
    try:
        device = next(model.parameters()).device
        model(torch.tensor([ids], device=device), use_cache=False, logits_to_keep=1)
        return tap.features(len(ids)).float()
    finally:
        tap.close()
