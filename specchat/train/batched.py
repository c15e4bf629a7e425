"""Batched sampling that keeps the target's features: the text `train-draft` trains a head on.

Self-distillation needs the target's replies to many prompts and, at every position of them,
the target's feature f_t (the output of its final norm), which is what the head reads. Both come
out of the same forwards: a batch of prompts is encoded once, then every decoding step feeds
one token per row and hands back that token's feature with the next token's logits. There is
no second, teacher-forced pass over the replies.

transformers' `generate` spends most of a batched CPU step outside the model: it builds the
padding masks from scratch every step, concatenates the KV cache, and its logits processors
copy the whole 262k-token vocabulary per row. Here the masks grow by one column, the cache is
written in place (`kvcache.PagedLayer`), and a row draws from the target's top-k logits with
the Gumbel-max trick. The caller runs it on stock sdpa (`attention.stock_attention`) and
dense weights (`runners.hf.cpu.dense_nf4`). On a CPU this decodes several times as
many tokens per second as `generate` on the same dense weights and attention
(docs/training.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from specchat.runners.hf.attention import tree_masks_supported
from specchat.runners.hf.features import FeatureTap
from specchat.runners.hf.kvcache import PagedLayer


@dataclass
class Sampled:
    ids: list[int]  # prompt + reply (no end-of-turn token)
    prompt_len: int
    feats: torch.Tensor  # [len(ids), d] bf16: the target's feature at every position
    top1: torch.Tensor  # [len(ids)] int32: the target's top-1 next token; -1 where not computed
    # [len(ids), len(layers) * d] bf16: the hidden states entering the decoder layers `layers`
    # at every position (an EAGLE-3 head's input); None when no layers were asked for
    aux: torch.Tensor | None = None


def supported(model) -> bool:
    """Masks of our own need sdpa or eager attention and known layer kinds."""
    return tree_masks_supported(model)


class _Masks:
    """Attention masks for a left-padded batch whose rows grow by one token a step: a key is
    visible to a query when it is a real token at an earlier or equal position (and, in
    sliding-window layers, less than the window behind)."""

    def __init__(self, model, real: torch.Tensor):
        config = model.config.get_text_config()
        self.impl = getattr(config, "_attn_implementation", None) or "eager"
        self.dtype = next(model.parameters()).dtype
        self.types = list(dict.fromkeys(getattr(config, "layer_types", None) or []))
        self.window = getattr(config, "sliding_window", None)
        self.real = real  # [B, S] bool: slot holds a token (not left padding)
        self.pos = (real.long().cumsum(-1) - 1).clamp(min=0)  # [B, S] each slot's position

    def grow(self, alive: torch.Tensor | None = None) -> None:
        """One more slot per row (the token a step feeds); `alive` keeps those rows only."""
        if alive is not None:
            self.real, self.pos = self.real[alive], self.pos[alive]
        self.real = torch.cat([self.real, torch.ones_like(self.real[:, :1])], 1)
        self.pos = torch.cat([self.pos, self.pos[:, -1:] + 1], 1)

    def positions(self, q: int) -> torch.Tensor:
        return self.pos[:, -q:]

    def __call__(self, q: int):
        """The forward's `attention_mask` for its last q slots as queries."""
        qpos = self.pos[:, -q:, None]  # [B, Q, 1]
        kpos = self.pos[:, None, :]  # [B, 1, S]
        # Left-padding slots have position 0, so their queries see the row's first token:
        # no query sees nothing (which would give NaN).
        causal = self.real[:, None, :] & (kpos <= qpos)

        def typed(mask):
            mask = mask[:, None]  # [B, 1, Q, S]
            if self.impl == "eager":
                return torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill(
                    ~mask, torch.finfo(self.dtype).min)
            return mask

        if not self.types:
            return typed(causal)
        out = {}
        for kind in self.types:
            if kind == "sliding_attention" and self.window:
                out[kind] = typed(causal & (qpos - kpos < self.window))
            else:
                out[kind] = typed(causal)
        return out


@torch.inference_mode()
def sample_with_features(model, prompts: list[list[int]], sampled: list[bool],
                         max_new_tokens: int, temperature: float, top_k: int, stop: set[int],
                         pad: int, generator: torch.Generator | None = None,
                         ends: list[Callable[[list[int]], bool] | None] | None = None,
                         layers: tuple[int, ...] | None = None) -> list[Sampled]:
    """Each prompt's reply (greedy where `sampled` is False, else softmax(top-k / T)), with
    the target's features and top-1 tokens along prompt and reply. Rows leave the batch when
    they write a stop token, or when their `ends[i](reply)` says the token just written
    completes a stop string (`text.stop_check`; None: none): the end of the turn in a plain
    chat format, where a base model would go on to write the user's next message itself.
    `layers`: also keep the hidden states entering those decoder layers (`Sampled.aux`)."""
    device = model.device
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    masks = _Masks(model, torch.tensor([[False] * (width - len(p)) + [True] * len(p)
                                        for p in prompts], device=device))
    cache = DynamicCache()
    cache.layer_class_to_replicate = PagedLayer  # every token in every layer, written in place
    tap = FeatureTap(model)
    aux_tap = FeatureTap(model, layers) if layers else None
    rows = list(range(len(prompts)))  # batch row -> prompt index, for the rows still writing
    feats: list[list[torch.Tensor]] = [[] for _ in prompts]
    aux: list[list[torch.Tensor]] = [[] for _ in prompts]
    top1: list[list[torch.Tensor]] = [[] for _ in prompts]
    replies: list[list[int]] = [[] for _ in prompts]
    do_sample = torch.tensor(sampled, device=device)
    try:
        out = model(input_ids=input_ids, attention_mask=masks(width),
                    position_ids=masks.positions(width), past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        for i, p in enumerate(prompts):
            feats[i].append(tap.last[i, width - len(p):].to(torch.bfloat16))
            if aux_tap is not None:
                aux[i].append(aux_tap.batch()[i, width - len(p):].to(torch.bfloat16))
            top1[i].append(torch.full((len(p) - 1,), -1, dtype=torch.int32))
        for step in range(max_new_tokens):
            tokens, best = _draw(out.logits[:, -1], do_sample, temperature, top_k, generator,
                                 device)
            keep = _write(rows, tokens, best, top1, replies, stop, ends,
                          last=step + 1 >= max_new_tokens)
            if not keep:
                break
            if len(keep) < len(rows):
                alive = torch.tensor(keep, device=device)
                cache.batch_select_indices(alive)
                do_sample = do_sample[alive]
                rows = [rows[r] for r in keep]
                tokens = [tokens[r] for r in keep]
                masks.grow(alive)
            else:
                masks.grow()
            out = model(input_ids=torch.tensor(tokens, device=device)[:, None],
                        attention_mask=masks(1), position_ids=masks.positions(1),
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
            step_feats = tap.last[:, 0].to(torch.bfloat16)
            step_aux = aux_tap.batch()[:, 0].to(torch.bfloat16) if aux_tap is not None else None
            for r, i in enumerate(rows):
                feats[i].append(step_feats[r:r + 1])
                if step_aux is not None:
                    aux[i].append(step_aux[r:r + 1])
    finally:
        tap.close()
        if aux_tap is not None:
            aux_tap.close()
    return _results(prompts, replies, feats, top1, aux if layers else None)


def _draw(logits: torch.Tensor, do_sample: torch.Tensor, temperature: float, top_k: int,
          generator: torch.Generator | None, device) -> tuple[list[int], torch.Tensor]:
    """Each row's next token from its logits [R, vocab]: the top-1 in greedy rows, a Gumbel-max
    draw from the tempered top-k in sampled ones. Returns (tokens, top-1s [R] int32 on the CPU)."""
    values, indices = logits.topk(top_k, dim=-1)  # [R, k], sorted
    choice = torch.zeros(len(logits), dtype=torch.long, device=device)
    if bool(do_sample.any()):
        u = torch.rand(values.shape, generator=generator, device=device)
        gumbel = -torch.log(-torch.log(u.clamp_(1e-20, 1.0)))
        raced = (values.float() / temperature + gumbel).argmax(-1)
        choice = torch.where(do_sample, raced, choice)
    tokens = indices.gather(1, choice[:, None])[:, 0].tolist()
    return tokens, indices[:, 0].int().cpu()


def _write(rows: list[int], tokens: list[int], best: torch.Tensor, top1: list[list[torch.Tensor]],
           replies: list[list[int]], stop: set[int], ends, last: bool) -> list[int]:
    """Records each row's top-1 and appends its token to its reply (a stop token is not part
    of it). Returns the batch rows that go on writing."""
    keep = []
    for r, (i, t) in enumerate(zip(rows, tokens)):
        top1[i].append(best[r:r + 1])
        if t in stop:
            continue
        replies[i].append(t)
        end = ends[i] if ends is not None else None
        if not last and not (end is not None and end(replies[i])):
            keep.append(r)
    return keep


def _results(prompts: list[list[int]], replies: list[list[int]],
             feats: list[list[torch.Tensor]], top1: list[list[torch.Tensor]],
             aux: list[list[torch.Tensor]] | None = None) -> list[Sampled]:
    results = []
    for i, p in enumerate(prompts):
        f = torch.cat(feats[i]).cpu()
        # The last token of a reply cut at the cap or at a stop string was not fed.
        ids = (p + replies[i])[:len(f)]
        t = torch.cat(top1[i])[:len(ids)]
        a = torch.cat(aux[i]).cpu()[:len(ids)] if aux is not None else None
        results.append(Sampled(ids=ids, prompt_len=len(p), feats=f[:len(ids)], top1=t, aux=a))
    return results
