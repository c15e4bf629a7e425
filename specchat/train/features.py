"""The target's features of each training sequence, written in shards and read back."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from specchat.models.eagle import lm_head_weight
from specchat.runners.hf.features import FeatureTap
from specchat.train.config import TrainConfig, _bar


@torch.inference_mode()
def extract_features(target, seqs: list[dict], cfg: TrainConfig, deadline: float) -> None:
    """Phase 2: teacher-forced target forwards; shards of {"key", "ids", "feats", "top1",
    "heldout"} (and "aux", the hidden states entering `cfg.feature_layers`, for an EAGLE-3
    head) under features/. The target's top-1 is over its full vocabulary."""
    shard_dir = cfg.out / "features"
    shard_dir.mkdir(parents=True, exist_ok=True)
    index = _load_index(shard_dir, cfg)
    done = {k for s in index["shards"] for k in s["keys"]}
    todo = sorted((s for s in seqs if s["key"] not in done), key=lambda s: len(s["ids"]))
    if not todo:
        return
    model, device = target.model, target.device
    weight = lm_head_weight(model)
    if weight.device.type == "cpu":
        weight = weight.float()  # CPU bf16 matmuls are slow; 4 bytes x vocab x d of memory
    pad = target.tokenizer.pad_token_id or 0
    # Batches of similar lengths (little padding), visited in a shuffled order so that the
    # positions given a top-1 are spread over the data.
    batches, i = [], 0
    while i < len(todo):
        n = max(1, cfg.extract_batch_tokens // max(len(todo[i]["ids"]), 1))
        batches.append(todo[i:i + n])
        i += n
    random.Random(cfg.seed).shuffle(batches)
    tap = FeatureTap(model)
    aux_tap = FeatureTap(model, cfg.feature_layers) if cfg.feature_layers else None
    bar = _bar(total=len(seqs), initial=len(seqs) - len(todo), desc="extract", unit="seq")
    try:
        pending: list[dict] = []
        for b, batch in enumerate(batches):
            if time.time() > deadline:
                bar.write("extract: time share used up; training on what there is")
                break
            width = max(len(s["ids"]) for s in batch)
            input_ids = torch.tensor([s["ids"] + [pad] * (width - len(s["ids"])) for s in batch])
            mask = torch.tensor([[1] * len(s["ids"]) + [0] * (width - len(s["ids"]))
                                 for s in batch])
            model(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                  use_cache=False, logits_to_keep=1)
            feats = tap.last  # [B, width, d]
            aux = aux_tap.batch() if aux_tap is not None else None  # [B, width, 3d]
            for row, s in enumerate(batch):
                f = feats[row, :len(s["ids"])]
                if s["heldout"] or index.get("top1_tokens", 0) < cfg.top1_tokens:
                    top1 = torch.cat([(c.to(weight.dtype) @ weight.T).argmax(-1)
                                      for c in f.split(256)]).int().cpu()
                    if not s["heldout"]:
                        index["top1_tokens"] = index.get("top1_tokens", 0) + len(top1)
                else:
                    top1 = torch.full((len(s["ids"]),), -1, dtype=torch.int32)  # not computed
                pending.append({"key": s["key"], "ids": torch.tensor(s["ids"], dtype=torch.int32),
                                "feats": f.to(torch.bfloat16).cpu(), "top1": top1,
                                "start": s.get("start", 0), "heldout": bool(s["heldout"]),
                                **({"aux": aux[row, :len(s["ids"])].to(torch.bfloat16).cpu()}
                                   if aux is not None else {})})
            bar.update(len(batch))
            if sum(len(p["ids"]) for p in pending) >= 32768 or b == len(batches) - 1:
                _write_shard(shard_dir, index, pending)
                pending = []
        if pending:
            _write_shard(shard_dir, index, pending)
    finally:
        tap.close()
        if aux_tap is not None:
            aux_tap.close()
        bar.close()


def _load_index(shard_dir: Path, cfg: TrainConfig | None = None) -> dict:
    """features/index.json: the shards written so far, and the target layers whose hidden
    states they keep ("layers": an EAGLE-3 head's; none for an EAGLE-1 head)."""
    path = shard_dir / "index.json"
    if path.exists():
        return json.loads(path.read_text())
    return {"shards": [], **({"layers": list(cfg.feature_layers)}
                             if cfg is not None and cfg.feature_layers else {})}


def _write_shard(shard_dir: Path, index: dict, records: list[dict]) -> None:
    name = f"shard-{len(index['shards']):05d}.pt"
    tmp = shard_dir / (name + ".tmp")
    torch.save(records, tmp)
    tmp.replace(shard_dir / name)
    index["shards"].append({"file": name, "keys": [r["key"] for r in records]})
    tmp_index = shard_dir / "index.json.tmp"
    tmp_index.write_text(json.dumps(index))
    tmp_index.replace(shard_dir / "index.json")  # the shard counts only once indexed


def load_features(out: Path, seqs: list[dict] | None = None) -> list[dict]:
    """Every extracted record, once per key (the latest: a run killed between writing a shard
    and listing its replies generates them again); "start" taken from `seqs` (the current
    sequence list)."""
    start = {s["key"]: s.get("start", 0) for s in seqs or []}
    records: dict[str, dict] = {}
    for s in _load_index(out / "features")["shards"]:
        for r in torch.load(out / "features" / s["file"], weights_only=True):
            records[r["key"]] = r
    for r in records.values():
        r["start"] = start.get(r["key"], r.get("start", 0))
    return list(records.values())
