"""`python -m specchat train-draft`: train a draft head for a target, in one of two styles:
EAGLE-1 (specchat's own head, models/eagle.py, a head.safetensors the app finds by itself) or
EAGLE-3 (`--style eagle3`: the public layout, models/eagle3.py, loaded with --head DIR and by
vLLM and SGLang).

Four resumable phases, all under one time budget (--minutes), in one work directory (--out,
by default next to the target's cache, where the app finds the head):

1. generate  the target answers a prompt set the project wrote (train/prompts/, never the
             benchmark questions): self-distillation, so the head learns the target's own text.
             Files given with --data add prompts ({"prompt": ...} lines) or plain text;
             --invent N has the target write N more prompts first (train/invent.py).
2. extract   teacher-forced target forwards over every sequence: the features f_t (output of the
             final norm; for EAGLE-3 also the hidden states entering three decoder layers) and
             the target's top-1 token at every position, in shards.
3. vocab     the N tokens the target predicts most often become the head's reduced vocabulary.
4. train     EAGLE-1 (train/fit.py): smooth-L1 between predicted and true next features plus
             cross-entropy against the target's distribution (read off the true features
             through the same frozen reduced LM head). EAGLE-3 (train/eagle3.py): cross-entropy
             alone, over training-time-test steps that draft from the head's own outputs.
             AdamW(0.9, 0.95), gradient clipping, noise on input features; checkpoints every
             few minutes, resumes where it stopped.

Every ~10th prompt is held out: its sequences measure top-1 agreement (teacher forced), and
--evaluate runs the engine on held-out prompts to measure alpha and speed against plain decoding.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from specchat.help import HelpFormatter
from specchat.models.eagle_files import default_head_dir, save_head, target_identity
from specchat.train import eagle3
from specchat.train.config import STYLES, TrainConfig
from specchat.train.data import (
    BENCH_QUESTIONS,
    FORMATS,
    load_data,
    load_prompts,
    question_overlap,
    read_jsonl,
    sequences,
    with_samples,
)
from specchat.train.features import extract_features, load_features
from specchat.train.fit import train_head
from specchat.train.invent import invent_prompts
from specchat.train.replies import generate_replies

# -- the command --------------------------------------------------------------------------------


def run(target, cfg: TrainConfig, progress=print) -> tuple[Path, dict]:
    """All phases for a loaded target (models.LoadedModel). Returns (head path, summary)."""
    t0 = time.time()
    deadline = t0 + cfg.minutes * 60
    if cfg.style == "eagle3" and cfg.feature_layers is None:
        cfg.feature_layers = eagle3.layers(target.model)
    check_features(cfg)
    cfg.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    identity = target_identity(target.model, target.tokenizer, target.name)
    (cfg.out / "target.json").write_text(json.dumps(identity, indent=1))
    extra_prompts, texts = load_data(cfg.data)
    prompts = (load_prompts(cfg.prompt_files) if cfg.generate else []) + extra_prompts
    prompts = apart_from_bench(prompts, "prompt", progress)
    if cfg.invent and cfg.generate:  # within the generation's share of the budget
        invented = invent_prompts(target, prompts, cfg.invent, cfg,
                                  t0 + cfg.gen_share * cfg.minutes * 60)
        prompts += apart_from_bench(invented, "prompt", progress)
    texts = apart_from_bench(texts, "text", progress)
    if prompts and cfg.generate:
        generate_replies(target, with_samples(prompts, cfg.samples), cfg,
                         t0 + cfg.gen_share * cfg.minutes * 60)
    seqs = sequences(cfg, texts, target.tokenizer, prompts)
    # Extraction may use the budget up to where 30% of it is left for training.
    extract_features(target, seqs, cfg, deadline - 0.3 * cfg.minutes * 60)
    records = load_features(cfg.out, seqs)
    head, summary = train_head(target, records, cfg, deadline, identity)
    config = {k: (str(v) if isinstance(v, Path) else v)
              for k, v in asdict(cfg).items() if k not in ("prompt_files", "data")}
    summary.update(minutes_total=round((time.time() - t0) / 60, 2), config=config)
    # A head file travels (it may be shipped or shared): it names the directories and the head
    # it came from, not where they lay on the machine that trained it.
    names = {k: Path(config[k]).name for k in ("out", "init") if config.get(k)}
    meta = {**summary, "config": {**config, **names}}
    if cfg.style == "eagle3":  # the public layout: the work directory is the head's
        path = eagle3.save(cfg.out, head, head.config_json, meta={**meta, "target": identity})
    else:
        path = cfg.out / "head.safetensors"
        save_head(path, head, identity, meta=meta)
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return path, summary


def check_features(cfg: TrainConfig) -> None:
    """Refuse a work directory whose features were made for the other style: an EAGLE-3 head
    reads hidden states of layers an EAGLE-1 run never kept."""
    index = cfg.out / "features" / "index.json"
    if not index.exists():
        return
    kept = json.loads(index.read_text()).get("layers") or None
    wanted = list(cfg.feature_layers) if cfg.feature_layers else None
    if kept != wanted and json.loads(index.read_text()).get("shards"):
        raise SystemExit(f"train-draft: {cfg.out} holds features for --style "
                         f"{'eagle3' if kept else 'eagle1'}, not --style {cfg.style}; use "
                         "another --out")


def _formats_arg(value: str) -> tuple[str, ...]:
    formats = tuple(dict.fromkeys(f.strip() for f in value.split(",") if f.strip()))
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise argparse.ArgumentTypeError(f"unknown format(s) {', '.join(bad) or '(none)'}; "
                                         f"choose from {', '.join(FORMATS)}")
    return formats


def apart_from_bench(rows: list[dict], field: str, progress=print) -> list[dict]:
    """`rows` without those whose `field` shares text with the bench's own questions
    (`data.question_overlap`): the bench measures the head on questions it never saw."""
    questions = [t for q in read_jsonl(BENCH_QUESTIONS) for t in q.get("turns", [])]
    tied = question_overlap([r[field] for r in rows], questions)
    if not tied:
        return rows
    progress(f"left out {len(tied)} {field}(s) sharing text with the bench's questions, "
             f"such as {rows[tied[0][0]]['key']} (\"{tied[0][1]}\")")
    drop = {i for i, _ in tied}
    return [r for i, r in enumerate(rows) if i not in drop]


def evaluate_engine(target, head_path: Path, prompts: list[dict], max_new_tokens: int,
                    draft_len: int = 4, modes: tuple[str, ...] = ("plain", "head", "combined")
                    ) -> dict:
    """Greedy decoding of held-out prompts, plain vs the head's drafters (fixed k): alpha,
    acceptance, tokens per target call, tokens/s, and c = seconds per drafted token over
    seconds per plain target step (as the engine measures them)."""
    from specchat.core.engine import Engine
    from specchat.core.events import collect
    from specchat.core.settings import build_config
    from specchat.core.text import chat_prompt
    from specchat.drafters.ngram import NgramDrafter
    from specchat.loader import head_drafters
    drafters, notes = head_drafters(target, NgramDrafter(), head_path)
    if not drafters:
        raise SystemExit("train-draft: " + ("; ".join(notes) or f"no head at {head_path}"))
    engine = Engine(target, {"ngram": NgramDrafter(), **drafters})
    keys = ("new_tokens", "seconds", "drafted", "accepted", "rejections", "target_calls")
    totals = {m: dict.fromkeys(keys + ("draft_s", "step_s", "steps"), 0.0) for m in modes}
    for p in prompts:
        ids, stops = chat_prompt(target.tokenizer, [{"role": "user", "content": p["prompt"]}])
        for mode in modes:
            cfg, _ = build_config(dict(max_new_tokens=max_new_tokens, seed=0,
                                       speculation=mode != "plain",
                                       drafter=mode if mode != "plain" else None,
                                       draft_len=draft_len, tree_nodes=0, adaptive=False,
                                       stop=stops), list(engine.drafters))
            engine.reset_cache()
            t = totals[mode]
            reply = collect(engine.stream(ids, cfg))
            t["draft_s"] += sum(step.draft_s for step in reply.steps)
            t["step_s"] += sum(step.verify_s for step in reply.steps)
            t["steps"] += len(reply.steps)
            for k in keys:
                t[k] += getattr(reply.stats, k)
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
    from specchat.models.load import load_model
    from specchat.models.loaded import ModelLoadError
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
                      formats=args.formats,
                      gen_batch=args.gen_batch, samples=args.samples, invent=args.invent,
                      seq_len=args.seq_len,
                      draft_vocab=args.draft_vocab, intermediate_size=args.intermediate_size,
                      batch_tokens=args.batch_tokens, lr=args.lr,
                      ce_weight=args.ce_weight, feature_weight=args.feature_weight,
                      noise=args.noise, max_steps=args.max_steps, style=args.style,
                      unroll=args.unroll or (eagle3.DEFAULT_STEPS if args.style == "eagle3"
                                             else 1),
                      bf16=not args.fp32, seed=args.seed,
                      init=Path(args.init) if args.init else None)
    summary: dict = {}
    path = out if args.style == "eagle3" else out / "head.safetensors"
    if args.minutes > 0:
        log(f"train-draft: target {target.label}, work directory {out}, "
            f"budget {args.minutes:g} min")
        path, summary = run(target, cfg, log)
        log(f"train-draft: head saved to {path}")
        if args.out:
            log("train-draft: the app looks for heads next to the target's cache "
                f"({default_head_dir(identity)}); pass this one with --head {path}"
                if args.style == "eagle1" else
                f"train-draft: pass this EAGLE-3 head with --head {path}")
    if args.evaluate:
        held = [p for p in load_prompts(cfg.prompt_files) if p["heldout"]][:args.evaluate]
        summary["engine_eval"] = evaluate_engine(target, path, held, args.eval_tokens)
    print(json.dumps(summary, indent=None if args.json else 1))
    return 0


def add_cli(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train-draft", formatter_class=HelpFormatter,
        help="train a draft head (EAGLE) for a target, on text the target writes",
        description="Self-distillation: the target answers a prompt set, then an EAGLE-style "
                    "draft head is trained on the target's features. Resumable (run the same "
                    "command again to continue), bounded by --minutes, CPU or CUDA. The head is "
                    "saved with the target's identity; the app loads it as drafter 'head'.")
    p.add_argument("--target", default="embedded", metavar="MODEL",
                   help="target model: hub id or local directory (default: the embedded "
                        "Gemma 3 270M, offline)")
    p.add_argument("--quantization", choices=["nf4", "none"], default="nf4",
                   help="target weights: 4-bit NF4 via bitsandbytes or unquantized; load the "
                        "target as the app will (the features depend on it)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:1")
    p.add_argument("--data", nargs="*", default=[], metavar="PATH",
                   help="extra JSONL ({'prompt'}/{'turns'} = prompts, {'text'} = text) or "
                        ".txt/.md/.rst files or directories (default: none)")
    p.add_argument("--prompts", nargs="*", default=[], metavar="PATH",
                   help="prompt set JSONL files (default: specchat/train/prompts/*.jsonl)")
    p.add_argument("--no-generate", action="store_true",
                   help="skip self-distillation: train on --data text only")
    p.add_argument("--minutes", type=float, default=30.0, metavar="X",
                   help="time budget for the whole command; 0 with --evaluate evaluates an "
                        "existing head")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="work directory and head location (default: next to the target's "
                        "cache, where the app finds it)")
    _add_generation_arguments(p)
    _add_training_arguments(p)
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--evaluate", type=int, default=0, metavar="N",
                   help="afterwards, decode N held-out prompts with the head vs plain and "
                        "report alpha and speed (0 = no evaluation)")
    p.add_argument("--eval-tokens", type=int, default=96, metavar="N",
                   help="with --evaluate: new tokens per held-out prompt")
    p.add_argument("--json", action="store_true",
                   help="summary as one JSON line (default: indented JSON)")
    p.set_defaults(func=cmd_train_draft)
    return p


def _add_generation_arguments(p: argparse.ArgumentParser) -> None:
    """Phase 1: how the target writes the text the head learns from."""
    p.add_argument("--gen-share", type=float, default=0.5, metavar="X",
                   help="most of the budget spent generating text, as a share of it")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                   help="longest generated reply, in tokens")
    p.add_argument("--stop-at-turn-end", action="store_true",
                   help="end each generated reply at the chat format's stop string, as the "
                        "app does (default: go on to the cap; the model's own follow-up turns "
                        "are more text of the kind it writes)")
    p.add_argument("--formats", type=_formats_arg, default=FORMATS, metavar="LIST",
                   help="the app's prompt formats the target answers in, comma separated, each "
                        "prompt in one: chat (the chat format), system (the chat format under a "
                        "system prompt), completion (the prompt as plain text to continue, the "
                        f"page's Completion mode) (default: {','.join(FORMATS)})")
    p.add_argument("--gen-batch", type=int, default=0, metavar="N",
                   help="prompts generated together (0 = 64 on a CPU, 16 on a GPU)")
    p.add_argument("--samples", type=int, default=3, metavar="N",
                   help="replies per prompt (the extra ones sampled): more text from the same "
                        "prompts")
    p.add_argument("--invent", type=int, default=0, metavar="N",
                   help="first have the target write N more prompts, each after a few of the "
                        "prompt set's training prompts (self-instruct), and answer them too: "
                        "varied text, where a few hundred prompts' replies are learnt by heart "
                        "(default: 0, none)")


def _add_training_arguments(p: argparse.ArgumentParser) -> None:
    """Phase 4: the head's size, the loss and the optimizer."""
    p.add_argument("--seq-len", type=int, default=512, metavar="N",
                   help="tokens per training sequence")
    p.add_argument("--draft-vocab", type=int, default=8192, metavar="N",
                   help="reduced vocabulary size N")
    p.add_argument("--intermediate-size", type=int, default=0, metavar="N",
                   help="MLP width of the head's block (0 = the target's); narrower drafts "
                        "faster and makes a smaller file")
    p.add_argument("--batch-tokens", type=int, default=4096, metavar="N",
                   help="tokens per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3, metavar="X", help="AdamW's learning rate")
    p.add_argument("--ce-weight", type=float, default=1.0, metavar="X",
                   help="weight of the token loss (cross-entropy against the target's)")
    p.add_argument("--feature-weight", type=float, default=0.1, metavar="X",
                   help="weight of the feature loss (predicted vs the target's features)")
    p.add_argument("--noise", type=float, default=0.1, metavar="X",
                   help="uniform noise on input features, in feature std units")
    p.add_argument("--style", choices=STYLES, default="eagle1",
                   help="eagle1: specchat's head over the final norm's output (a "
                        "head.safetensors the app finds by itself); eagle3: a head in the public "
                        "EAGLE-3 layout (config.json, model.safetensors, loaded with --head DIR, "
                        "and by vLLM and SGLang), fusing three target layers' hidden states, "
                        "trained with training-time test and no feature loss")
    p.add_argument("--unroll", type=int, default=0, metavar="N",
                   help="eagle1: >1 also trains on the head's own predicted features; eagle3: "
                        "the training-time-test steps (0 = 1 for eagle1, "
                        f"{eagle3.DEFAULT_STEPS} for eagle3)")
    p.add_argument("--fp32", action="store_true",
                   help="train in float32 throughout (default: bf16 autocast where fast)")
    p.add_argument("--max-steps", type=int, default=0, metavar="N",
                   help="stop training after this many optimizer steps in total (0 = only the "
                        "clock stops it); makes a run reproducible on machines of any speed")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="data order and initialization")
    p.add_argument("--init", default=None, metavar="HEAD",
                   help="start from this head (its vocabulary and weights, a fresh optimizer): "
                        "a head file, or with --style eagle3 an EAGLE-3 head's directory; "
                        "fine-tune it on the text generated here; used while the work "
                        "directory has no checkpoint (default: a new head)")


__all__ = ["TrainConfig", "add_cli", "run", "evaluate_engine"]
