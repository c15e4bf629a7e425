"""`python -m specchat train-draft`: train an EAGLE draft head (specchat.head) for a target.

Four resumable phases, all under one time budget (--minutes), in one work directory (--out,
by default next to the target's cache, where the app finds the head):

1. generate  the target answers a prompt set the project wrote (specchat/prompts/, never the
             benchmark questions): self-distillation, so the head learns the target's own text.
             Files given with --data add prompts ({"prompt": ...} lines) or plain text.
2. extract   teacher-forced target forwards over every sequence: the features f_t (output of the
             final norm) and the target's top-1 token at every position, in shards.
3. vocab     the N tokens the target predicts most often become the head's reduced vocabulary.
4. train     EAGLE's loss (Li et al. 2024): smooth-L1 between predicted and true next features
             plus cross-entropy against the target's distribution (read off the true features
             through the same frozen reduced LM head), AdamW(0.9, 0.95), gradient clipping,
             noise on input features; checkpoints every few minutes, resumes where it stopped.

Every ~10th prompt is held out: its sequences measure top-1 agreement (teacher forced), and
--evaluate runs the engine on held-out prompts to measure alpha and speed against plain decoding.
"""

from __future__ import annotations

import argparse
import json
import random
import zlib
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import LogitsProcessorList

from specchat.head import (DraftHead, FeatureTap, HeadConfig, default_head_dir, lm_head_weight,
                           norm_scale_of, save_head, smooth_l1, target_identity)

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
HOLDOUT_EVERY = 10  # prompt i is held out when i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1
TEXT_SUFFIXES = (".txt", ".md", ".rst")


@dataclass
class TrainConfig:
    out: Path  # work directory: generated text, feature shards, checkpoint, head.safetensors
    minutes: float = 30.0  # the whole command's time budget (all phases)
    prompt_files: list[Path] = field(default_factory=list)  # JSONL prompt sets (default: ours)
    data: list[Path] = field(default_factory=list)  # extra prompts / plain text, files or dirs
    generate: bool = True  # phase 1 on (off: train on --data text only)
    gen_share: float = 0.5  # at most this share of the budget goes to generating text
    max_new_tokens: int = 256  # per generated reply
    # Stop a reply at the chat format's stop string (a base model's "\nUser:"), as the app
    # does. Off: the embedded target's replies then average 16 tokens, a tenth of the text;
    # past the stop it writes its own follow-up turns, whose "Assistant:" parts are replies too.
    stop_at_turn_end: bool = False
    gen_batch: int = 0  # prompts generated together (left padded); 0: `gen_batch`'s default
    gen_temperature: float = 0.7  # odd prompts are sampled at this temperature, even ones greedy
    samples: int = 3  # replies per prompt: the first as above, the others sampled (more text)
    seq_len: int = 512  # tokens per training sequence (longer ones are cut in windows)
    extract_batch_tokens: int = 4096  # tokens per teacher-forced target forward
    top1_tokens: int = 5000  # training positions that get the target's full-vocabulary top-1
    # (for choosing the reduced vocabulary; held-out ones always do). The full LM head costs as
    # much as the rest of the forward, so not every position pays for it.
    draft_vocab: int = 8192  # N: rows of the reduced LM head
    intermediate_size: int = 0  # MLP width of the head's block (0: the target's)
    batch_tokens: int = 4096  # tokens per optimizer step
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ce_weight: float = 1.0
    feature_weight: float = 0.1  # the issue measured: CE-dominant beats feature-dominant here
    noise: float = 0.1  # uniform noise on input features, in units of the feature std
    unroll: int = 1  # >1: also train on the head's own predicted features (training-time test)
    bf16: bool = True  # train under bf16 autocast where the device computes bf16 fast
    checkpoint_minutes: float = 3.0
    max_steps: int = 0  # stop training after this many optimizer steps (0: only the clock)
    seed: int = 0


# -- data ---------------------------------------------------------------------------------------


def load_prompts(files: list[Path]) -> list[dict]:
    """Prompt records {"key", "prompt", "category", "heldout"} from JSONL prompt sets."""
    files = files or sorted(PROMPTS_DIR.glob("*.jsonl"))
    out = []
    for path in files:
        for i, line in enumerate(Path(path).read_text().splitlines()):
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = row.get("prompt") or (row.get("turns") or [""])[0]
            if prompt:
                out.append({"key": f"{Path(path).stem}:{i}", "prompt": prompt,
                            "category": row.get("category", ""),
                            "heldout": i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1})
    return out


def load_data(paths: list[Path]) -> tuple[list[dict], list[dict]]:
    """--data: (extra prompts, plain texts {"key", "text"}). JSONL lines with "prompt" or
    "turns" are prompts, with "text" are text; .txt/.md/.rst files (or directories of them) are
    text."""
    prompts, texts = [], []
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES + (".jsonl",)) \
            if p.is_dir() else [p]
    for f in files:
        if f.suffix == ".jsonl":
            for i, line in enumerate(f.read_text(errors="replace").splitlines()):
                if not line.strip():
                    continue
                row = json.loads(line)
                key = f"{f}:{i}"
                if row.get("text"):
                    texts.append({"key": key, "text": row["text"]})
                elif row.get("prompt") or row.get("turns"):
                    prompts.append({"key": key, "prompt": row.get("prompt") or row["turns"][0],
                                    "category": row.get("category", ""),
                                    "heldout": i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1})
        else:
            texts.append({"key": str(f), "text": f.read_text(errors="replace")})
    return prompts, texts


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a kill: generated again
    return rows


def _bar(**kw):
    from tqdm.auto import tqdm
    return tqdm(dynamic_ncols=True, file=sys.stderr, **kw)


@torch.inference_mode()
def generate_replies(target, prompts: list[dict], cfg: TrainConfig, deadline: float) -> int:
    """Phase 1: the target answers each prompt; appends {"key", "ids", "prompt_len",
    "heldout"} lines to generated.jsonl (prompt + reply token ids). Where the model's attention
    takes masks of our own (sdpa, eager), the features come with the replies
    (`batched.sample_with_features`) and go straight into the feature shards: phase 2 then has
    nothing left to do for them. Returns replies generated now."""
    from specchat.batched import supported
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
    from specchat.attention import stock_attention
    from specchat.batched import sample_with_features
    from specchat.models import dense_nf4
    from specchat.text import stop_check
    tok, model = target.tokenizer, target.model
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    stop = set(_eos(model, tok))
    prompt_ids, stops = _prompts(tok, todo)
    ends = stop_check(tok, stops) if cfg.stop_at_turn_end else None
    # Round by round (a budget that runs out still covers every prompt), and within a round
    # prompts of similar lengths together: little left padding to encode.
    todo = sorted(todo, key=lambda p: (p.get("sample", 0), len(prompt_ids[p["key"]])))
    shard_dir = cfg.out / "features"
    shard_dir.mkdir(parents=True, exist_ok=True)
    index = _load_index(shard_dir)
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
                ends)
            records = []
            for p, r in zip(part, results):
                n, first = min(len(r.ids), cfg.seq_len), r.prompt_len - 1  # as `sequences`
                if first < n - 2:
                    records.append({"key": p["key"], "ids": torch.tensor(r.ids[:n],
                                                                          dtype=torch.int32),
                                    "feats": r.feats[:n], "top1": r.top1[:n], "start": first,
                                    "heldout": p["heldout"]})
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
    from specchat.text import tokens_until_stop
    tok, model = target.tokenizer, target.model
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    formatted, stops = _prompts(tok, todo)
    size = gen_batch(cfg, target.device)
    made = 0
    with path.open("a") as f:
        for start in range(0, len(todo), size):
            if time.time() > deadline:
                bar.write("generate: time share used up; training on what there is")
                break
            batch = todo[start:start + size]
            for sampled in (False, True):
                part = [p for p in batch if _is_sampled(p) == sampled]
                if not part:
                    continue
                ids = [formatted[p["key"]] for p in part]
                width = max(map(len, ids))
                input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
                mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
                kwargs = dict(do_sample=False)
                if stops and cfg.stop_at_turn_end:
                    kwargs.update(stop_strings=list(stops), tokenizer=tok)
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
                        reply = reply[:tokens_until_stop(tok, prompt_ids, reply, stops)]
                    f.write(json.dumps({"key": p["key"], "ids": prompt_ids + reply,
                                        "prompt_len": len(prompt_ids),
                                        "heldout": p["heldout"]}) + "\n")
                    made += 1
                f.flush()
                bar.update(len(part))
    return made


def _prompts(tok, todo: list[dict]) -> tuple[dict[str, list[int]], tuple[str, ...]]:
    """Each prompt's chat-formatted ids by key, and the format's stop strings (where a base
    model's plain "User:/Assistant:" turn ends: it has no end-of-turn token)."""
    from specchat.text import chat_prompt
    formatted = {p["key"]: chat_prompt(tok, [{"role": "user", "content": p["prompt"]}])
                 for p in todo}
    stops = next(iter(formatted.values()), ([], ()))[1]
    return {k: ids for k, (ids, _) in formatted.items()}, tuple(stops)


GEN_TOP_K = 40  # sampled replies draw from the target's 40 most likely tokens


def gen_batch(cfg: TrainConfig, device) -> int:
    """Prompts answered together: --gen-batch, or 64 on a CPU (on the embedded target a
    64-row step of `batched` took 0.07 s, a 1-row decoding step 0.05 s) and 16 on a GPU (the
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


def with_samples(prompts: list[dict], samples: int) -> list[dict]:
    """Each prompt `samples` times: the first reply keeps its key, the others (always sampled)
    get "#j". Ordered round by round, so a budget that runs out still covers every prompt."""
    return [p if j == 0 else {**p, "key": f"{p['key']}#{j}", "sample": j}
            for j in range(max(1, samples)) for p in prompts]


def _sampled(key: str) -> bool:
    """Half the prompts are answered greedily, half sampled (varied text, greedy habits)."""
    return zlib.crc32(key.encode()) % 2 == 1


def _eos(model, tok) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    return ids + ([tok.eos_token_id] if tok.eos_token_id is not None else [])


def sequences(cfg: TrainConfig, texts: list[dict], tokenizer, prompts: list[dict]
              ) -> list[dict]:
    """Everything to extract: generated sequences and --data texts, cut to seq_len windows.
    "start" is the first head position that is trained and measured: the head drafts replies,
    so on generated sequences it starts where the reply does (head position t predicts token
    t + 2; the target itself emits the reply's first token)."""
    from specchat.text import chat_prompt
    by_key = {p["key"]: p for p in prompts}
    out = []
    for row in read_jsonl(cfg.out / "generated.jsonl"):
        prompt_len = row.get("prompt_len")
        if prompt_len is None and row["key"] in by_key:  # rows written before prompt_len
            prompt_len = len(chat_prompt(tokenizer, [{"role": "user",
                                                      "content": by_key[row["key"]]["prompt"]}])[0])
        start = max(0, (prompt_len or 1) - 1)
        if start < min(len(row["ids"]), cfg.seq_len) - 2:  # else no reply within seq_len
            out.append({"key": row["key"], "ids": row["ids"][:cfg.seq_len], "start": start,
                        "heldout": row["heldout"]})
    for i, t in enumerate(texts):
        ids = tokenizer(t["text"], add_special_tokens=True)["input_ids"]
        for j in range(0, len(ids), cfg.seq_len):
            window = ids[j:j + cfg.seq_len]
            if len(window) >= 16:
                out.append({"key": f"{t['key']}@{j}", "ids": window, "start": 0,
                            "heldout": i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1})
    return out


@torch.inference_mode()
def extract_features(target, seqs: list[dict], cfg: TrainConfig, deadline: float) -> None:
    """Phase 2: teacher-forced target forwards; shards of {"key", "ids", "feats", "top1",
    "heldout"} under features/. The target's top-1 is over its full vocabulary."""
    shard_dir = cfg.out / "features"
    shard_dir.mkdir(parents=True, exist_ok=True)
    index = _load_index(shard_dir)
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
                                "start": s.get("start", 0), "heldout": bool(s["heldout"])})
            bar.update(len(batch))
            if sum(len(p["ids"]) for p in pending) >= 32768 or b == len(batches) - 1:
                _write_shard(shard_dir, index, pending)
                pending = []
        if pending:
            _write_shard(shard_dir, index, pending)
    finally:
        tap.close()
        bar.close()


def _load_index(shard_dir: Path) -> dict:
    path = shard_dir / "index.json"
    return json.loads(path.read_text()) if path.exists() else {"shards": []}


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


def choose_vocab(records: list[dict], n: int, tokenizer=None) -> tuple[torch.Tensor, float]:
    """The n tokens the target predicts most often, then the most frequent input tokens, then
    (a small data set predicts only a few thousand distinct tokens) the tokenizer's lowest
    ids, which BPE and SentencePiece vocabularies order roughly by frequency. Predictions: the
    computed top-1s and the tokens the target wrote itself (replies).
    Returns (vocab_ids [<= n], share of computed top-1s they cover)."""
    top1 = torch.cat([r["top1"].long() for r in records])
    top1 = top1[top1 >= 0]  # positions whose top-1 was computed
    written = torch.cat([r["ids"][r["start"] + 1:].long() for r in records
                         if r.get("start", 0) > 0] + [torch.zeros(0, dtype=torch.long)])
    predicted = torch.cat([top1, written])
    inputs = torch.cat([r["ids"].long() for r in records])
    counts = torch.bincount(predicted).float()
    in_counts = torch.bincount(inputs, minlength=len(counts)).float()
    counts = torch.cat([counts, torch.zeros(max(0, len(in_counts) - len(counts)))])
    score = counts * (len(inputs) + 1) + in_counts  # predicted tokens first, by count
    order = torch.argsort(score, descending=True)
    order = order[score[order] > 0][:n]
    if tokenizer is not None and len(order) < n:
        order = torch.cat([order, fill_ids(tokenizer, n - len(order), exclude=order)])
    coverage = float(torch.isin(top1, order).float().mean())
    return order.sort().values, coverage


def fill_ids(tokenizer, n: int, exclude: torch.Tensor) -> torch.Tensor:
    """The n lowest token ids that are not special (added) tokens and not in `exclude`."""
    special = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    taken = set(exclude.tolist()) | special
    out = [i for i in range(len(tokenizer)) if i not in taken][:n]
    return torch.tensor(out, dtype=torch.long)


# -- training -----------------------------------------------------------------------------------


class Batches:
    """Random batches of feature sequences, padded right; each row a window of <= seq_len."""

    def __init__(self, records: list[dict], batch_tokens: int, seq_len: int, seed: int):
        self.records = [r for r in records if len(r["ids"]) - r.get("start", 0) >= 3]
        self.batch_tokens, self.seq_len = batch_tokens, seq_len
        self.rng = random.Random(seed)

    def __next__(self) -> list[dict]:
        rows, used = [], 0
        while used < self.batch_tokens:
            r = self.rng.choice(self.records)
            n = len(r["ids"])
            first = min(r.get("start", 0), n - self.seq_len) if n > self.seq_len else 0
            start = self.rng.randrange(0, first + 1)  # windows keep trained positions
            row = {k: (v[start:start + self.seq_len] if torch.is_tensor(v) else v)
                   for k, v in r.items()}
            row["start"] = max(0, r.get("start", 0) - start)
            rows.append(row)
            used += min(n, self.seq_len)
        return rows


def collate(rows: list[dict], device) -> dict:
    width = max(len(r["ids"]) for r in rows)
    d = rows[0]["feats"].shape[-1]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    top1 = torch.zeros(len(rows), width, dtype=torch.long)
    feats = torch.zeros(len(rows), width, d)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)  # real tokens
    trained = torch.zeros(len(rows), width, dtype=torch.bool)  # head positions with a loss
    for i, r in enumerate(rows):
        n = len(r["ids"])
        ids[i, :n], top1[i, :n], feats[i, :n] = r["ids"], r["top1"], r["feats"].float()
        mask[i, :n] = True
        trained[i, r.get("start", 0):n - 1] = True
    return {k: v.to(device) for k, v in
            {"ids": ids, "top1": top1, "feats": feats, "mask": mask,
             "trained": trained}.items()}


def head_loss(head: DraftHead, embed, batch: dict, cfg: TrainConfig, train: bool = True
              ) -> tuple[torch.Tensor, dict]:
    """EAGLE loss over a batch. Head position t reads (f_t, x_{t+1}) and predicts f_{t+1} and
    the target's distribution of x_{t+2}, which softmax(LM(f_{t+1})) is (restricted to the
    reduced vocabulary). Returns (loss, metrics); metrics["top1"] counts agreement with the
    target's full-vocabulary top-1 (what greedy verification accepts)."""
    feats = batch["feats"]
    T = feats.shape[1] - 1
    # Head positions with a loss (a reply's, next token real), packed: (row, t). Only they pay
    # for the 8192-wide logits; prompt and padding positions are context for attention only.
    rows, t = batch["trained"][:, :-1].nonzero(as_tuple=True)
    with torch.no_grad():
        emb = embed(batch["ids"][:, 1:]).float()  # [B, T, d]  embed(x_{t+1})
        target_feats = feats[:, 1:][rows, t].float()  # [V, d]  f_{t+1}
        target_probs = torch.softmax(head.logits(target_feats), -1)  # [V, N]
        top1 = batch["top1"][:, 1:][rows, t]  # [V]  the target's full-vocabulary x_{t+2}
    inputs = feats[:, :-1]
    if train and cfg.noise:
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * 2 * cfg.noise * head.feat_std
    pos = torch.arange(T, device=feats.device)
    total, metrics = 0.0, {}
    for step in range(max(1, cfg.unroll)):
        # Unrolled step s: array position t - s predicts f_{t+1} and x_{t+2}, as at s = 0.
        use = t >= step
        if not bool(use.any()):
            break
        pred, _ = head.predict(inputs, emb, pos)  # [B, T - step, d]
        at = pred[rows[use], t[use] - step]  # [V_s, d]
        logits = head.logits(at)
        ce = -(target_probs[use] * torch.log_softmax(logits, -1)).sum(-1)  # [V_s]
        fl = smooth_l1(at, target_feats[use], head.feat_std)
        loss = (cfg.ce_weight * ce + cfg.feature_weight * fl).mean()
        total = total + loss * (1.0 if step == 0 else 0.5 ** step)
        known = top1[use] >= 0
        agree = (head.vocab_ids[logits.argmax(-1)] == top1[use]) & known
        metrics[f"top1@{step + 1}"] = (int(agree.sum()), int(known.sum()))
        if step == 0:
            n = max(len(ce), 1)
            metrics.update(ce=float(ce.sum().detach()) / n, feat=float(fl.sum().detach()) / n)
        # Next unroll step: position t reads the head's own prediction of f_t (made at t - 1).
        inputs, emb, pos = pred[:, :-1], emb[:, 1:], pos[1:]
    return total, metrics


def autocast(device, cfg: TrainConfig):
    """bf16 autocast for the head's forward: weights and optimizer stay float32. On this CPU
    (AMX) a training step of 4096 tokens unrolled twice took 3.4 s instead of 5.9; on CPUs
    without native bf16 it would be slower, so there it stays off, as on GPUs without bf16."""
    device = torch.device(device)
    fast = torch.ops.mkldnn._is_mkldnn_bf16_supported() if device.type == "cpu" \
        else device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16 and fast)


def evaluate_holdout(head: DraftHead, embed, records: list[dict], device, cfg: TrainConfig
                     ) -> dict:
    """Teacher-forced top-1 agreement with the target on held-out sequences: @1 with true
    features, @2 with the head's own predicted feature one step back (unrolled)."""
    if not records:
        return {}
    was = head.training
    head.eval()
    sums: dict[str, list[int]] = {}
    eval_cfg = TrainConfig(**{**asdict(cfg), "unroll": 2, "noise": 0.0})
    with torch.no_grad():
        for i in range(0, len(records), 8):
            _, m = head_loss(head, embed, collate(records[i:i + 8], device), eval_cfg, False)
            for k, v in m.items():
                if isinstance(v, tuple):
                    s = sums.setdefault(k, [0, 0])
                    s[0] += v[0]
                    s[1] += v[1]
    head.train(was)
    return {k: round(a / max(b, 1), 4) for k, (a, b) in sums.items()}


def train_head(target, records: list[dict], cfg: TrainConfig, deadline: float,
               identity: dict) -> tuple[DraftHead, dict]:
    """Phase 3-4: vocabulary, then training until the deadline. Resumes from train.pt."""
    device = target.device
    train_recs = [r for r in records if not r["heldout"]]
    held = [r for r in records if r["heldout"]]
    if not train_recs:
        raise SystemExit("train-draft: no training data (generation or extraction got nothing "
                         "done in the time given); run again with more --minutes")
    ckpt_path = cfg.out / "train.pt"
    state = torch.load(ckpt_path, weights_only=True) if ckpt_path.exists() else None
    if state is not None and state["identity_key"] != identity["key"]:
        raise SystemExit(f"train-draft: {ckpt_path} belongs to another target; use another --out")
    if state is not None:
        head = DraftHead(HeadConfig(**json.loads(state["config"])))
        head.load_state_dict(state["head"])
        coverage = state["coverage"]
    else:
        vocab, coverage = choose_vocab(train_recs, cfg.draft_vocab, target.tokenizer)
        head = DraftHead(HeadConfig.for_target(target.model, len(vocab),
                                               cfg.intermediate_size or None))
        head.vocab_ids = vocab
        head.norm_scale = norm_scale_of(target.model)
        sample = torch.cat([r["feats"].float() for r in train_recs[:64]])
        head.feat_std = sample.std().reshape(())
    head = head.to(device).attach(target.model).train()
    embed = target.model.get_input_embeddings()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr,
                            betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, seen, trained_s = 0, 0, 0.0
    if state is not None:
        opt.load_state_dict(state["opt"])
        step, seen, trained_s = state["step"], state["seen"], state["trained_s"]
    batches = Batches(train_recs, cfg.batch_tokens, cfg.seq_len, cfg.seed + step)
    torch.manual_seed(cfg.seed + step)

    def checkpoint():
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "config": json.dumps(asdict(head.cfg)),
                    "opt": opt.state_dict(), "step": step, "seen": seen,
                    "trained_s": trained_s, "coverage": coverage,
                    "identity_key": identity["key"]}, tmp)
        tmp.replace(ckpt_path)

    start = time.time()
    budget = max(0.0, deadline - start)
    last_ckpt = start
    bar = _bar(total=round(budget), desc="train", unit="s",
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s [{elapsed}<{remaining}{postfix}]")
    ema: dict[str, float] = {}
    while time.time() < deadline and not (cfg.max_steps and step >= cfg.max_steps):
        frac = max((time.time() - start) / max(budget, 1e-9),
                   step / cfg.max_steps if cfg.max_steps else 0.0)
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * max(0.1, 1.0 - frac)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = collate(next(batches), device)
        with autocast(device, cfg):
            loss, m = head_loss(head, embed, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        seen += int(batch["mask"].sum())
        a, b = m["top1@1"]
        for k, v in (("loss", loss.item()), ("ce", m["ce"])) + ((("top1", a / b),) if b else ()):
            ema[k] = v if k not in ema else 0.9 * ema[k] + 0.1 * v
        now = time.time()
        bar.n = min(round(now - start), bar.total)
        bar.set_postfix(step=step, loss=f"{ema['loss']:.3f}", top1=f"{ema.get('top1', 0):.3f}",
                        refresh=False)
        bar.refresh()
        if now - last_ckpt > cfg.checkpoint_minutes * 60:
            trained_s += now - last_ckpt
            last_ckpt = now
            checkpoint()
    bar.close()
    trained_s += time.time() - last_ckpt
    checkpoint()
    result = {"steps": step, "tokens_seen": seen, "train_seconds": round(trained_s),
              "train_positions": sum(len(r["ids"]) - 1 - r.get("start", 0)
                                     for r in train_recs),
              "vocab_coverage": round(coverage, 4), "final_loss_ema": round(ema.get("loss", 0), 4),
              **{f"holdout_{k}": v for k, v in
                 evaluate_holdout(head, embed, held, device, cfg).items()}}
    return head.eval(), result


# -- the command --------------------------------------------------------------------------------


def run(target, cfg: TrainConfig, progress=print) -> tuple[Path, dict]:
    """All phases for a loaded target (models.LoadedModel). Returns (head path, summary)."""
    t0 = time.time()
    deadline = t0 + cfg.minutes * 60
    cfg.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    identity = target_identity(target.model, target.tokenizer, target.name)
    (cfg.out / "target.json").write_text(json.dumps(identity, indent=1))
    extra_prompts, texts = load_data(cfg.data)
    prompts = (load_prompts(cfg.prompt_files) if cfg.generate else []) + extra_prompts
    if prompts and cfg.generate:
        generate_replies(target, with_samples(prompts, cfg.samples), cfg,
                         t0 + cfg.gen_share * cfg.minutes * 60)
    seqs = sequences(cfg, texts, target.tokenizer, prompts)
    # Extraction may use the budget up to where 30% of it is left for training.
    extract_features(target, seqs, cfg, deadline - 0.3 * cfg.minutes * 60)
    records = load_features(cfg.out, seqs)
    head, summary = train_head(target, records, cfg, deadline, identity)
    path = cfg.out / "head.safetensors"
    summary.update(minutes_total=round((time.time() - t0) / 60, 2),
                   config={k: (str(v) if isinstance(v, Path) else v)
                           for k, v in asdict(cfg).items() if k not in ("prompt_files", "data")})
    save_head(path, head, identity, meta=summary)
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return path, summary


def evaluate_engine(target, head_path: Path, prompts: list[dict], max_new_tokens: int,
                    draft_len: int = 4, modes: tuple[str, ...] = ("plain", "head", "combined")
                    ) -> dict:
    """Greedy decoding of held-out prompts, plain vs the head's drafters (fixed k): alpha,
    acceptance, tokens per target call, tokens/s, and c = seconds per drafted token over
    seconds per plain target step (as the engine measures them)."""
    from specchat.drafters import NgramDrafter
    from specchat.engine import Engine, GenerateConfig
    from specchat.events import GenerationStats, StepRecord
    from specchat.head import head_drafters
    from specchat.text import chat_prompt
    drafters, notes = head_drafters(target, NgramDrafter(), head_path)
    if not drafters:
        raise SystemExit("train-draft: " + ("; ".join(notes) or f"no head at {head_path}"))
    engine = Engine(target, {"ngram": NgramDrafter(), **drafters})
    keys = ("new_tokens", "seconds", "drafted", "accepted", "rejections", "target_calls")
    totals = {m: dict.fromkeys(keys + ("draft_s", "step_s", "steps"), 0.0) for m in modes}
    for p in prompts:
        ids, stops = chat_prompt(target.tokenizer, [{"role": "user", "content": p["prompt"]}])
        for mode in modes:
            cfg = GenerateConfig(max_new_tokens=max_new_tokens, speculation=mode != "plain",
                                 drafter=mode if mode != "plain" else "ngram",
                                 draft_len=draft_len, adaptive=False, stop=stops)
            engine.reset_cache()
            t = totals[mode]
            for e in engine.stream(ids, cfg):
                if isinstance(e, StepRecord):
                    t["draft_s"] += e.draft_s
                    t["step_s"] += e.verify_s
                    t["steps"] += 1
                elif isinstance(e, GenerationStats):
                    for k in keys:
                        t[k] += getattr(e, k)
    plain_step = totals["plain"]["step_s"] / max(totals["plain"]["steps"], 1) \
        if "plain" in totals else 0.0
    out = {}
    for mode, t in totals.items():
        rate = t["new_tokens"] / max(t["seconds"], 1e-9)
        out[mode] = {
            "tokens_per_s": round(rate, 2),
            "alpha": round(t["accepted"] / max(t["accepted"] + t["rejections"], 1), 4),
            "acceptance_rate": round(t["accepted"] / max(t["drafted"], 1), 4),
            "tokens_per_target_call": round(t["new_tokens"] / max(t["target_calls"], 1), 3),
            "c": round(t["draft_s"] / max(t["drafted"], 1) / max(plain_step, 1e-9), 4),
            **{k: round(t[k], 3) for k in keys}}
    if "plain" in out:
        for mode in out:
            out[mode]["speedup"] = round(out[mode]["tokens_per_s"]
                                         / max(out["plain"]["tokens_per_s"], 1e-9), 3)
    return out


def cmd_train_draft(args) -> int:
    from specchat.models import ModelLoadError, load_model
    if args.json:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    log = (lambda m: print(m, file=sys.stderr))
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        target = load_model(args.target, args.quantization,
                            None if args.device == "auto" else args.device, log)
    except ModelLoadError as e:
        print(f"specchat: {e}", file=sys.stderr)
        return 1
    identity = target_identity(target.model, target.tokenizer, target.name)
    out = Path(args.out) if args.out else default_head_dir(identity)
    cfg = TrainConfig(out=out, minutes=args.minutes, prompt_files=[Path(p) for p in args.prompts],
                      data=[Path(p) for p in args.data], generate=not args.no_generate,
                      gen_share=args.gen_share, max_new_tokens=args.max_new_tokens,
                      stop_at_turn_end=args.stop_at_turn_end,
                      gen_batch=args.gen_batch, samples=args.samples, seq_len=args.seq_len,
                      draft_vocab=args.draft_vocab, intermediate_size=args.intermediate_size,
                      batch_tokens=args.batch_tokens, lr=args.lr,
                      ce_weight=args.ce_weight, feature_weight=args.feature_weight,
                      noise=args.noise, unroll=args.unroll, max_steps=args.max_steps,
                      bf16=not args.fp32, seed=args.seed)
    summary: dict = {}
    path = out / "head.safetensors"
    if args.minutes > 0:
        log(f"train-draft: target {target.label}, work directory {out}, "
            f"budget {args.minutes:g} min")
        path, summary = run(target, cfg, log)
        log(f"train-draft: head saved to {path}")
        if args.out:
            log("train-draft: the app looks for heads next to the target's cache "
                f"({default_head_dir(identity)}); pass this one with --head {path}")
    if args.evaluate:
        held = [p for p in load_prompts(cfg.prompt_files) if p["heldout"]][:args.evaluate]
        summary["engine_eval"] = evaluate_engine(target, path, held, args.eval_tokens)
    print(json.dumps(summary, indent=None if args.json else 1))
    return 0


def add_cli(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train-draft", help="train a draft head (EAGLE) for a target, on text the target writes",
        description="Self-distillation: the target answers a prompt set, then an EAGLE-style "
                    "draft head is trained on the target's features. Resumable (run the same "
                    "command again to continue), bounded by --minutes, CPU or CUDA. The head is "
                    "saved with the target's identity; the app loads it as drafter 'head'.")
    p.add_argument("--target", default="embedded",
                   help="hub id or local directory (default: the embedded Gemma 3 270M)")
    p.add_argument("--quantization", choices=["nf4", "none"], default="nf4",
                   help="load the target as the app will (features depend on it)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda")
    p.add_argument("--data", nargs="*", default=[],
                   help="extra JSONL ({'prompt'}/{'turns'} = prompts, {'text'} = text) or "
                        ".txt/.md/.rst files or directories")
    p.add_argument("--prompts", nargs="*", default=[],
                   help="prompt set JSONL files (default: specchat/prompts/*.jsonl)")
    p.add_argument("--no-generate", action="store_true",
                   help="skip self-distillation: train on --data text only")
    p.add_argument("--minutes", type=float, default=30.0,
                   help="time budget for the whole command (default 30); 0 with --evaluate "
                        "evaluates an existing head")
    p.add_argument("--out", default=None,
                   help="work directory and head location (default: next to the target's "
                        "cache, where the app finds it)")
    p.add_argument("--gen-share", type=float, default=0.5,
                   help="most of the budget spent generating text (default 0.5)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per generated reply")
    p.add_argument("--stop-at-turn-end", action="store_true",
                   help="end each generated reply at the chat format's stop string, as the "
                        "app does (default: go on to the cap; the model's own follow-up turns "
                        "are more text of the kind it writes)")
    p.add_argument("--gen-batch", type=int, default=0,
                   help="prompts generated together (default 0: 64 on a CPU, 16 on a GPU)")
    p.add_argument("--samples", type=int, default=3,
                   help="replies per prompt (the extra ones sampled): more text from the same "
                        "prompts (default 3)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--draft-vocab", type=int, default=8192, help="reduced vocabulary size N")
    p.add_argument("--intermediate-size", type=int, default=0,
                   help="MLP width of the head's block (default 0: the target's); narrower "
                        "drafts faster and makes a smaller file")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ce-weight", type=float, default=1.0)
    p.add_argument("--feature-weight", type=float, default=0.1)
    p.add_argument("--noise", type=float, default=0.1,
                   help="uniform noise on input features, in feature std units")
    p.add_argument("--unroll", type=int, default=1,
                   help=">1: also train on the head's own predicted features")
    p.add_argument("--fp32", action="store_true",
                   help="train in float32 throughout (default: bf16 autocast where fast)")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop training after this many optimizer steps in total (0: only the "
                        "clock); makes a run reproducible on machines of any speed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--evaluate", type=int, default=0, metavar="N",
                   help="afterwards, decode N held-out prompts with the head vs plain and "
                        "report alpha and speed")
    p.add_argument("--eval-tokens", type=int, default=96)
    p.add_argument("--json", action="store_true", help="summary as one JSON line")
    p.set_defaults(func=cmd_train_draft)
    return p


__all__ = ["TrainConfig", "add_cli", "run", "evaluate_engine"]
