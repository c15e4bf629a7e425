"""Training the head: its reduced vocabulary, batches, the loss, the held-out check."""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from specchat.models.eagle import DraftHead, HeadConfig, norm_scale_of
from specchat.train import eagle3
from specchat.train.config import TrainConfig, _bar


def smooth_l1(pred: torch.Tensor, target: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.smooth_l1_loss(pred / scale, target / scale, reduction="none").mean(-1)


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


def _coverage(records: list[dict], vocab_ids: torch.Tensor) -> float:
    """The share of the computed top-1s that `vocab_ids` covers."""
    top1 = torch.cat([r["top1"].long() for r in records])
    top1 = top1[top1 >= 0]
    return float(torch.isin(top1, vocab_ids.cpu()).float().mean()) if len(top1) else 0.0


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
    aux = torch.zeros(len(rows), width, rows[0]["aux"].shape[-1]) if "aux" in rows[0] else None
    mask = torch.zeros(len(rows), width, dtype=torch.bool)  # real tokens
    trained = torch.zeros(len(rows), width, dtype=torch.bool)  # head positions with a loss
    for i, r in enumerate(rows):
        n = len(r["ids"])
        ids[i, :n], top1[i, :n], feats[i, :n] = r["ids"], r["top1"], r["feats"].float()
        if aux is not None:
            aux[i, :n] = r["aux"].float()
        mask[i, :n] = True
        trained[i, r.get("start", 0):n - 1] = True
    batch = {"ids": ids, "top1": top1, "feats": feats, "mask": mask, "trained": trained}
    if aux is not None:
        batch["aux"] = aux
    return {k: v.to(device) for k, v in batch.items()}


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


def loss_for(cfg: TrainConfig):
    """The style's loss: `head_loss` (EAGLE-1's) or `eagle3.head_loss`."""
    return eagle3.head_loss if cfg.style == "eagle3" else head_loss


def autocast(device, cfg: TrainConfig):
    """bf16 autocast for the head's forward: weights and optimizer stay float32. It pays only where the
    device computes bf16 natively (AMX or AVX512-BF16 CPUs, bf16 GPUs); elsewhere bf16 is
    emulated and slower, so there it stays off."""
    from specchat.models.runtime import cpu_kind
    device = torch.device(device)
    # (oneDNN reports bf16 support on any AVX-512 CPU, where it emulates it: not the test)
    fast = cpu_kind().native_bf16 if device.type == "cpu" \
        else device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16 and fast)


def evaluate_holdout(head: DraftHead, embed, records: list[dict], device, cfg: TrainConfig
                     ) -> dict:
    """Teacher-forced top-1 agreement with the target on held-out sequences: @1 with true
    features, @2 (and on, to an EAGLE-3 head's unroll) from the head's own predictions of the
    steps before."""
    if not records:
        return {}
    was = head.training
    head.eval()
    sums: dict[str, list[int]] = {}
    eval_cfg = TrainConfig(**{**asdict(cfg), "unroll": max(2, cfg.unroll), "noise": 0.0})
    loss = loss_for(cfg)
    with torch.no_grad():
        for i in range(0, len(records), 8):
            _, m = loss(head, embed, collate(records[i:i + 8], device), eval_cfg, False)
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
    train_recs, held = _split_records(records)
    ckpt_path = cfg.out / "train.pt"
    state = _load_checkpoint(ckpt_path, identity, cfg.style)
    head, coverage = _head_to_train(target, train_recs, cfg, state)
    if cfg.style == "eagle3":
        head = eagle3.attach_target(head.to(device), target.model).train()
        embed = head.embedder(target.model)  # the stored rows, as vLLM and SGLang read them
    else:
        head = head.to(device).attach(target.model).train()
        embed = target.model.get_input_embeddings()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr,
                            betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    progress = _Progress()
    if state is not None:
        opt.load_state_dict(state["opt"])
        progress = _Progress(state["step"], state["seen"], state["trained_s"])
    batches = Batches(train_recs, cfg.batch_tokens, cfg.seq_len, cfg.seed + progress.step)
    torch.manual_seed(cfg.seed + progress.step)
    ema = _train_until(head, embed, opt, batches, cfg, device, deadline, progress, lambda: (
        _save_checkpoint(ckpt_path, head, opt, progress, coverage, identity, cfg.style)))
    result = {"steps": progress.step, "tokens_seen": progress.seen,
              "train_seconds": round(progress.trained_s),
              "train_positions": sum(len(r["ids"]) - 1 - r.get("start", 0)
                                     for r in train_recs),
              "vocab_coverage": round(coverage, 4), "final_loss_ema": round(ema.get("loss", 0), 4),
              **{f"holdout_{k}": v for k, v in
                 evaluate_holdout(head, embed, held, device, cfg).items()}}
    return head.eval(), result


@dataclass
class _Progress:
    """Where training stands: saved in each checkpoint, restored on resuming."""
    step: int = 0  # optimizer steps taken
    seen: int = 0  # tokens trained on
    trained_s: float = 0.0  # seconds spent training, over every run


def _split_records(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(training records, held-out records); there must be something to train on."""
    train_recs = [r for r in records if not r["heldout"]]
    held = [r for r in records if r["heldout"]]
    if not train_recs:
        raise SystemExit("train-draft: no training data (generation or extraction got nothing "
                         "done in the time given); run again with more --minutes")
    return train_recs, held


def _load_checkpoint(path, identity: dict, style: str) -> dict | None:
    """train.pt's state if there is one, refused when it was trained for another target."""
    state = torch.load(path, weights_only=True) if path.exists() else None
    if state is not None and state["identity_key"] != identity["key"]:
        raise SystemExit(f"train-draft: {path} belongs to another target; use another --out")
    if state is not None and state.get("style", "eagle1") != style:
        raise SystemExit(f"train-draft: {path} trains a head of style "
                         f"{state.get('style', 'eagle1')}, not {style}; use another --out")
    return state


def _head_to_train(target, train_recs: list[dict], cfg: TrainConfig, state: dict | None
                   ) -> tuple[DraftHead, float]:
    """(head, vocabulary coverage): the checkpoint's, or a new head over the reduced vocabulary
    chosen from the training records."""
    if cfg.style == "eagle3":
        return _eagle3_to_train(target, train_recs, cfg, state)
    if state is not None:
        head = DraftHead(HeadConfig(**json.loads(state["config"])))
        head.load_state_dict(state["head"])
        return head, state["coverage"]
    if cfg.init is not None:  # fine-tuning: the head's own vocabulary, measured on this data
        from specchat.models.eagle_files import HeadMismatchError, load_head
        try:
            head = load_head(cfg.init, target.model, target.tokenizer).cpu()
        except HeadMismatchError as e:
            raise SystemExit(f"train-draft: --init takes a head file of this style: {e}") from e
        for p in head.parameters():
            p.requires_grad_(True)
        return head, _coverage(train_recs, head.vocab_ids)
    vocab, coverage = choose_vocab(train_recs, cfg.draft_vocab, target.tokenizer)
    head = DraftHead(HeadConfig.for_target(target.model, len(vocab),
                                           cfg.intermediate_size or None))
    head.vocab_ids = vocab
    head.norm_scale = norm_scale_of(target.model)
    sample = torch.cat([r["feats"].float() for r in train_recs[:64]])
    head.feat_std = sample.std().reshape(())
    return head, coverage


def _eagle3_to_train(target, train_recs: list[dict], cfg: TrainConfig, state: dict | None
                     ) -> tuple[torch.nn.Module, float]:
    """As `_head_to_train`, for an EAGLE-3-style head (train/eagle3.py)."""
    if not all("aux" in r for r in train_recs):
        raise SystemExit(f"train-draft: {cfg.out} holds features without the target layers' "
                         "hidden states an EAGLE-3 head reads (made for --style eagle1); use "
                         "another --out")
    if state is not None:
        config = json.loads(state["config"])
        head = eagle3.build(config, target.model.config.get_text_config().hidden_size)
        head.load_state_dict(state["head"])
        head.aux_std, head.config_json = state["aux_std"], config
        return head.tie_vocabulary(), state["coverage"]
    if cfg.init is not None:  # fine-tuning an EAGLE-3 head (ours or a public one)
        from specchat.models.eagle3 import load_eagle3, read_config
        from specchat.models.eagle_files import HeadMismatchError
        try:
            head = load_eagle3(cfg.init, target.model).cpu().train()
        except HeadMismatchError as e:
            raise SystemExit(f"train-draft: --init with --style eagle3 takes an EAGLE-3 head "
                             f"directory: {e}") from e
        if tuple(head.feature_layers) != tuple(cfg.feature_layers or ()):
            raise SystemExit(f"train-draft: {cfg.init} reads the target's layers "
                             f"{list(head.feature_layers)}; train-draft keeps "
                             f"{list(cfg.feature_layers or ())}")
        for p in head.parameters():
            p.requires_grad_(True)
        head.config_json = read_config(cfg.init)
        head.aux_std = eagle3.feature_std(train_recs, len(head.feature_layers))
        return head, _coverage(train_recs, head.vocab_ids)
    vocab, coverage = choose_vocab(train_recs, cfg.draft_vocab, target.tokenizer)
    head, config = eagle3.new_head(target.model, vocab, cfg.intermediate_size)
    head.config_json = config
    head.aux_std = eagle3.feature_std(train_recs, len(head.feature_layers))
    return head, coverage


def _save_checkpoint(path, head, opt, progress: _Progress, coverage: float,
                     identity: dict, style: str = "eagle1") -> None:
    """Written aside, then moved into place: an interrupted save leaves the last one whole."""
    tmp = path.with_suffix(".tmp")
    config = head.config_json if style == "eagle3" else asdict(head.cfg)
    extra = {"aux_std": head.aux_std.cpu()} if style == "eagle3" else {}
    torch.save({"head": head.state_dict(), "config": json.dumps(config), "style": style,
                "opt": opt.state_dict(), "step": progress.step, "seen": progress.seen,
                "trained_s": progress.trained_s, "coverage": coverage,
                "identity_key": identity["key"], **extra}, tmp)
    tmp.replace(path)


def _train_until(head: DraftHead, embed, opt, batches: Batches, cfg: TrainConfig, device,
                 deadline: float, progress: _Progress, checkpoint) -> dict[str, float]:
    """Optimizer steps until the deadline or cfg.max_steps, calling `checkpoint` every
    cfg.checkpoint_minutes and at the end. The learning rate warms up, then decays linearly
    with the share of the budget spent (time or steps, whichever is further), to 10%.
    Returns the moving averages of the loss, the cross-entropy and top-1 agreement."""
    start = time.time()
    budget = max(0.0, deadline - start)
    last_ckpt = start
    bar = _bar(total=round(budget), desc="train", unit="s",
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s [{elapsed}<{remaining}{postfix}]")
    ema: dict[str, float] = {}
    while time.time() < deadline and not (cfg.max_steps and progress.step >= cfg.max_steps):
        frac = max((time.time() - start) / max(budget, 1e-9),
                   progress.step / cfg.max_steps if cfg.max_steps else 0.0)
        lr = cfg.lr * min(1.0, (progress.step + 1) / cfg.warmup_steps) * max(0.1, 1.0 - frac)
        loss, m, tokens = _train_step(head, embed, opt, next(batches), cfg, device, lr)
        progress.step += 1
        progress.seen += tokens
        _update_ema(ema, loss, m)
        now = time.time()
        bar.n = min(round(now - start), bar.total)
        bar.set_postfix(step=progress.step, loss=f"{ema['loss']:.3f}",
                        top1=f"{ema.get('top1', 0):.3f}", refresh=False)
        bar.refresh()
        if now - last_ckpt > cfg.checkpoint_minutes * 60:
            progress.trained_s += now - last_ckpt
            last_ckpt = now
            checkpoint()
    bar.close()
    progress.trained_s += time.time() - last_ckpt
    checkpoint()
    return ema


def _train_step(head: DraftHead, embed, opt, rows: list[dict], cfg: TrainConfig, device,
                lr: float) -> tuple[float, dict, int]:
    """One optimizer step on one batch at learning rate `lr`: (loss, head_loss's metrics,
    tokens in the batch)."""
    for g in opt.param_groups:
        g["lr"] = lr
    batch = collate(rows, device)
    with autocast(device, cfg):
        loss, m = loss_for(cfg)(head, embed, batch, cfg)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
    opt.step()
    return loss.item(), m, int(batch["mask"].sum())


def _update_ema(ema: dict[str, float], loss: float, m: dict) -> None:
    """Moving averages (0.9) of the loss, the cross-entropy and, where the batch had known
    top-1s, top-1 agreement: the progress bar's figures and the summary's final loss."""
    a, b = m["top1@1"]
    for k, v in (("loss", loss), ("ce", m["ce"])) + ((("top1", a / b),) if b else ()):
        ema[k] = v if k not in ema else 0.9 * ema[k] + 0.1 * v
