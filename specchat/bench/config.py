"""Bench settings, modes and the record of one run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from specchat.core.events import StepRecord
from specchat.core.request import TREE_NODES, GenerateConfig

ENGINE_MODES = ("plain", "ngram", "model")  # "plain" = speculation off; others name a drafter
HF_MODES = ("hf-plain", "hf-pld", "hf-assisted")
ALL_MODES = (*ENGINE_MODES, *HF_MODES)
HEAD_MODES = ("head", "combined",  # engine drafters that exist once `train-draft` made a head
              "head-tree", "combined-tree")  # ... drafting trees of --tree-nodes (tree.py)
NEEDS_DRAFT = ("model", "hf-assisted")
REMOTE_PLAIN = "llama.cpp"  # a llama.cpp server decoding plainly; "llama.cpp-T" drafts with T


HISTORY_OWNER = "bench"  # the one user of --history


@dataclass
class BenchSettings:
    modes: tuple[str, ...] = ("plain", "ngram", "hf-plain", "hf-pld")
    turns: str = "first"  # first | all
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0  # the same seed for every run: repeats decode the same text
    draft_len: int = GenerateConfig.draft_len  # k for our engine (the most draft tokens a step)
    adaptive: bool = True  # let the engine adapt k (never above draft_len)
    hf_pld_tokens: int = 0  # prompt_lookup_num_tokens for hf-pld (0: the same as draft_len)
    tree_nodes: int = TREE_NODES  # draft-tree size of the "-tree" modes
    repeats: int = 1  # runs per (question, mode); timings are medians over them
    warmup_tokens: int = 16  # one short unrecorded run per mode before the first question
    stop_strings: bool = True  # stop at the chat format's stop strings (False: EOS and length)
    # "chat": each turn in the target's chat format, as the page's Chat mode sends it;
    # "completion": each turn as plain text to continue, as its Completion mode sends it (no
    # chat format, no history, no stop strings).
    prompt_format: str = "chat"
    # One owner's history across the questions (core/history.py), as one user asking them in
    # turn: every engine mode may draft from the prompts and replies of the questions before,
    # never from the question's own runs (its reply joins the history after its last run).
    history: bool = False
    # What each engine keeps of the prompts before a question's first turn. "warm": what its
    # users get, specchat's prefix store and llama-server's prompt cache (`cache_prompt`, its
    # default) as the questions before left them; "cold": both emptied before every first turn,
    # so every prompt is encoded whole.
    prompt_cache: str = "warm"
    # min-p and the penalties (GenerateConfig fields, core/settings.py) for every engine and
    # server mode; transformers' modes cannot apply them the same way and are left out.
    samplers: dict = field(default_factory=dict)

    def generate_config(self, mode: str, stops: Sequence[str], drafters: Sequence[str],
                        max_new_tokens: int | None = None) -> GenerateConfig:
        """The request of `mode` ("plain", a drafter, a drafter's "-tree" variant), built and
        checked as the page's and the API's are (`core.settings.build_config`); `drafters`:
        the loaded ones. Raises ValueError for a setting out of its range."""
        from specchat.core.settings import build_config

        plain = mode == "plain"
        values = dict(self.samplers, max_new_tokens=max_new_tokens or self.max_new_tokens,
                      temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                      seed=self.seed, draft_len=self.draft_len,
                      tree_nodes=self.tree_nodes if mode.endswith("-tree") else 0,
                      speculation=not plain, drafter=None if plain else mode.removesuffix("-tree"),
                      adaptive=self.adaptive, stop=tuple(stops))
        cfg, notes = build_config(values, drafters)
        if notes:  # a capped or changed setting: the bench measures what it was asked
            raise ValueError(" ".join(notes))
        return replace(cfg, owner=HISTORY_OWNER, remember=False) if self.history else cfg


@dataclass
class Run:
    """One mode on one turn of one question, one repeat."""
    question_id: int | str
    category: str
    turn: int  # from 1
    mode: str
    repeat: int
    new_tokens: int
    seconds: float  # request to last token, prefill included
    ttft_s: float  # request to first token
    prompt_tokens: int
    prefill_tokens: int  # prompt tokens actually encoded (the rest came from the prefix cache)
    target_calls: int  # target forwards, prefill included
    forward_s: float | None  # seconds inside the target's forward (hooks; None: a server)
    steps: list[StepRecord] = field(default_factory=list)  # decode steps, prefill excluded
    text: str = ""
    stop_reason: str = ""
    error: str = ""
    prefill_s: float = 0.0  # seconds of the prompt's encoding (its target forwards)
