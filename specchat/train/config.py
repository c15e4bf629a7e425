"""train-draft's settings."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

STYLES = ("eagle1", "eagle3")


@dataclass
class TrainConfig:
    out: Path  # work directory: generated text, feature shards, checkpoint, the head's files
    # "eagle1": specchat's head over the final norm's output (head.safetensors); "eagle3": a
    # head in the public EAGLE-3 layout (config.json, model.safetensors) fusing the hidden
    # states entering three of the target's layers, trained with training-time test
    style: str = "eagle1"
    # eagle3: the target layers whose input hidden states the head fuses (train.eagle3.layers)
    feature_layers: tuple[int, ...] | None = None
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
    # The app's prompt formats the target answers in (`data.FORMATS`), each prompt in one,
    # chosen by its key: the chat format, the chat format under a system prompt, and plain text
    # to continue (the page's Completion mode).
    formats: tuple[str, ...] = ("chat", "system", "completion")
    gen_batch: int = 0  # prompts generated together (left padded); 0: `gen_batch`'s default
    gen_temperature: float = 0.7  # odd prompts are sampled at this temperature, even ones greedy
    samples: int = 3  # replies per prompt: the first as above, the others sampled (more text)
    # prompts the target writes itself before answering them (`invent.py`: self-instruct),
    # beside the prompt set's; 0: none
    invent: int = 0
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
    feature_weight: float = 0.1  # CE-dominant trains a better head than feature-dominant (docs/training.md)
    noise: float = 0.1  # uniform noise on input features, in units of the feature std
    # >1: also train on the head's own predicted features; eagle3: the training-time-test
    # steps, each drafting from the step before's own hidden state
    unroll: int = 1
    bf16: bool = True  # train under bf16 autocast where the device computes bf16 fast
    checkpoint_minutes: float = 3.0
    max_steps: int = 0  # stop training after this many optimizer steps (0: only the clock)
    seed: int = 0
    # Start from this head (its vocabulary and weights; a fresh optimizer) instead of a new one:
    # fine-tuning a trained head on text of another kind. Used when the work directory has no
    # checkpoint yet.
    init: Path | None = None


def _bar(**kw):
    from tqdm.auto import tqdm
    return tqdm(dynamic_ncols=True, file=sys.stderr, **kw)
