"""The target's own replies to the training prompts, the head's training text."""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path

import torch
from transformers import LogitsProcessorList

from specchat.train.config import TrainConfig, _bar
from specchat.train.data import _prompts, _sampled, read_jsonl
from specchat.train.features import _load_index, _write_shard


@torch.inference_mode()
def generate_replies(target, prompts: list[dict], cfg: TrainConfig, deadline: float) -> int:
    """Phase 1: the target answers each prompt; appends {"key", "ids", "prompt_len",
    "heldout"} lines to generated.jsonl (prompt + reply token ids). Where the model's attention
    takes masks of our own (sdpa, eager), the features come with the replies
    (`batched.sample_with_features`) and go straight into the feature shards: phase 2 then has
    nothing left to do for them. Returns replies generated now."""
    from specchat.train.batched import supported
    path = cfg.out / "generated.jsonl"
    done = {r["key"] for r in read_jsonl(path)}
    todo = [p for p in prompts if p["key"] not in done]
    bar = _bar(total=len(prompts), initial=len(prompts) - len(todo), desc="generate", unit="reply")
    try:
        if supported(target.model):
            return _generate_with_features(target, todo, cfg, deadline, path, bar)
        return _generate_text(target, todo, cfg, deadline, path, bar)
    finally:
        bar.close()


def _is_sampled(p: dict) -> bool:
    return p.get("sample", 0) > 0 or _sampled(p["key"])


def _generate_with_features(target, todo: list[dict], cfg: TrainConfig, deadline: float,
                            path: Path, bar) -> int:
    from specchat.core.text import stop_check
    from specchat.runners.hf.attention import stock_attention
    from specchat.runners.hf.cpu import dense_nf4
    from specchat.train.batched import sample_with_features
    tok, model = target.tokenizer, target.model
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    stop = set(_eos(model, tok))
    prompt_ids, stops = _prompts(tok, todo, cfg.formats)
    checks = {s: stop_check(tok, s) for s in set(stops.values())} if cfg.stop_at_turn_end \
        else {}
    # Round by round (a budget that runs out still covers every prompt), and within a round
    # prompts of similar lengths together: little left padding to encode.
    todo = sorted(todo, key=lambda p: (p.get("sample", 0), len(prompt_ids[p["key"]])))
    shard_dir = cfg.out / "features"
    shard_dir.mkdir(parents=True, exist_ok=True)
    index = _load_index(shard_dir, cfg)
    size = gen_batch(cfg, target.device)
    made = 0
    with dense_nf4(model), stock_attention(model), path.open("a") as f:
        for start in range(0, len(todo), size):
            if time.time() > deadline:
                bar.write("generate: time share used up; training on what there is")
                break
            part = todo[start:start + size]
            generator = torch.Generator(target.device).manual_seed(
                cfg.seed * 1_000_003 + zlib.crc32(part[0]["key"].encode()))
            results = sample_with_features(
                model, [prompt_ids[p["key"]] for p in part], [_is_sampled(p) for p in part],
                cfg.max_new_tokens, cfg.gen_temperature, GEN_TOP_K, stop, pad, generator,
                [checks.get(stops[p["key"]]) for p in part] if checks else None,
                layers=cfg.feature_layers)
            records = []
            for p, r in zip(part, results):
                n, first = min(len(r.ids), cfg.seq_len), r.prompt_len - 1  # as `sequences`
                if first < n - 2:
                    records.append({"key": p["key"], "ids": torch.tensor(r.ids[:n],
                                                                          dtype=torch.int32),
                                    "feats": r.feats[:n], "top1": r.top1[:n], "start": first,
                                    "heldout": p["heldout"],
                                    **({"aux": r.aux[:n]} if r.aux is not None else {})})
            if records:
                _write_shard(shard_dir, index, records)
            for p, r in zip(part, results):  # after the shard: a key listed has its features
                f.write(json.dumps({"key": p["key"], "ids": r.ids, "prompt_len": r.prompt_len,
                                    "heldout": p["heldout"]}) + "\n")
            f.flush()
            made += len(part)
            bar.update(len(part))
    return made


def _generate_text(target, todo: list[dict], cfg: TrainConfig, deadline: float, path: Path,
                   bar) -> int:
    """transformers' `generate`, for attention implementations that take no masks of ours
    (flash attention): text only, phase 2 extracts its features."""
    from specchat.core.text import tokens_until_stop
    tok, model = target.tokenizer, target.model
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    formatted, stops = _prompts(tok, todo, cfg.formats)
    size = gen_batch(cfg, target.device)
    made = 0
    with path.open("a") as f:
        for start in range(0, len(todo), size):
            if time.time() > deadline:
                bar.write("generate: time share used up; training on what there is")
                break
            batch = todo[start:start + size]
            for sampled, stop_set in sorted({(_is_sampled(p), stops[p["key"]]) for p in batch}):
                part = [p for p in batch
                        if _is_sampled(p) == sampled and stops[p["key"]] == stop_set]
                ids = [formatted[p["key"]] for p in part]
                width = max(map(len, ids))
                input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
                mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
                kwargs = dict(do_sample=False)
                if stop_set and cfg.stop_at_turn_end:
                    kwargs.update(stop_strings=list(stop_set), tokenizer=tok)
                if sampled:
                    kwargs["logits_processor"] = LogitsProcessorList(
                        [GumbelTopK(GEN_TOP_K, cfg.gen_temperature)])
                out = model.generate(input_ids=input_ids.to(target.device),
                                     attention_mask=mask.to(target.device),
                                     max_new_tokens=cfg.max_new_tokens, pad_token_id=pad,
                                     **kwargs).cpu()
                eos = set(_eos(model, tok))
                for p, prompt_ids, row in zip(part, ids, out[:, width:].tolist()):
                    reply = []
                    for t in row:
                        if t in eos:
                            break
                        reply.append(t)
                    if cfg.stop_at_turn_end:
                        reply = reply[:tokens_until_stop(tok, prompt_ids, reply, stop_set)]
                    f.write(json.dumps({"key": p["key"], "ids": prompt_ids + reply,
                                        "prompt_len": len(prompt_ids),
                                        "heldout": p["heldout"]}) + "\n")
                    made += 1
                f.flush()
                bar.update(len(part))
    return made


GEN_TOP_K = 40  # sampled replies draw from the target's 40 most likely tokens


def gen_batch(cfg: TrainConfig, device) -> int:
    """Prompts answered together: --gen-batch, or 64 on a CPU (where a 64-row step of `batched`
    costs little more than a 1-row decoding step) and 16 on a GPU (the
    KV cache of 64 long rows of a 7B model would not fit beside it on a consumer card)."""
    return cfg.gen_batch or (64 if torch.device(device).type == "cpu" else 16)


class GumbelTopK:
    """Sampling from softmax(top-k logits / T) as an argmax (the Gumbel-max trick), for greedy
    `generate`: top-k, not top-p, because sorting a 262k vocabulary every step costs more than
    the step itself on a CPU; and generate's own sampling (softmax and multinomial over the full
    vocabulary for every row) doubles a batched CPU step, this costs one top-k."""

    def __init__(self, top_k: int, temperature: float):
        self.top_k, self.temperature = top_k, temperature

    def __call__(self, input_ids, scores):
        values, indices = scores.float().topk(self.top_k, dim=-1)
        gumbel = -torch.log(-torch.log(torch.rand_like(values).clamp_(1e-20, 1.0)))
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, indices, (values / self.temperature + gumbel).to(scores.dtype))


def _eos(model, tok) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    return ids + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
