"""What the front ends (page, API, CLI, bench) use of an engine: the local `Engine` and a
serving-engine backend (`backends.remote.RemoteEngine`) both provide it, and
`tests/test_engine.py` checks that they do. A new backend implements this and nothing else."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from specchat.core.events import GenerationStats, StepRecord, TokenEvent
from specchat.core.request import GenerateConfig


@runtime_checkable
class StreamingEngine(Protocol):
    target: Any  # what runs the replies: .name, .label, .quantization (models.LoadedModel)
    device: Any  # .type: "cpu", "cuda", or the backend's own
    tokenizer: Any  # the target's tokenizer, or None where the server tokenizes
    drafters: dict  # name -> drafter; its keys are what `GenerateConfig.drafter` may name
    lock: threading.Lock  # held for a whole reply: one generation at a time
    row_exact: bool  # greedy and seeded replies with speculation are plain decoding's, bit for bit
    # the drafters whose greedy replies draft trees unless a request gives tree_nodes
    # (`core.settings.build_config`); () where none does
    greedy_trees: tuple[str, ...]

    @property
    def chats(self) -> bool:
        """The target has a chat format (a base model continues text instead)."""

    def chat_prompt(self, messages: list[dict]) -> tuple[Any, tuple[str, ...] | list[str]]:
        """Messages -> (the prompt `stream` takes, the chat format's stop strings)."""

    def text_prompt(self, text: str) -> tuple[Any, tuple[str, ...]]:
        """Plain text to continue -> (the prompt `stream` takes, no stop strings)."""

    def context_window(self) -> int | None:
        """The most tokens a prompt and its reply may take together, where known."""

    def reset_cache(self) -> None:
        """Forget any cached prompt (the next reply encodes its prompt afresh)."""

    def stream(self, prompt: Any, cfg: GenerateConfig,
               stop_event: threading.Event | None = None,
               ) -> Iterator[TokenEvent | StepRecord | GenerationStats]:
        """A reply: TokenEvents as tokens are decided, a StepRecord per step, the stats last.
        Setting `stop_event` ends it at the next step (stop_reason "stopped")."""
