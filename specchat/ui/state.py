"""Per-visitor state (settings, turns, session) and the model slot that loads in the background."""

from __future__ import annotations

import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from specchat.core.engine import Engine
from specchat.core.events import GenerationStats, StepRecord, TokenEvent
from specchat.core.settings import SETTINGS
from specchat.loader import LoadReport
from specchat.models.loaded import ModelLoadError
from specchat.stats.speedup import Speedup

# A filesystem path of two or more parts (POSIX, ~, or Windows), not inside a URL.
_PATH = re.compile(r"(?<![\w:/.~])(?:~|[A-Za-z]:)?(?:[/\\][\w.@+-]+){2,}[/\\]?")


def hide_paths(text: str) -> str:
    """Each filesystem path in `text` cut to its last part ("/home/me/models/qwen-7b" ->
    "qwen-7b"): what visitors of an exposed page see instead of where files live."""
    return _PATH.sub(lambda m: re.split(r"[/\\]", m.group(0).rstrip("/\\"))[-1], text)


# ---------------------------------------------------------------------------------------------
# Settings and per-browser state

@dataclass
class Limits:
    """Server-side caps: a visitor of a shared link cannot go past these from the page or API."""
    max_input_chars: int = 4000  # one user message
    max_new_tokens_cap: int = 1024  # per reply
    max_history_chars: int = 24000  # older turns beyond this are left out of the prompt


@dataclass
class Settings:
    """What the page's controls say for one request (raw values: `ChatApp.config` checks them)."""
    system: str = ""  # system prompt
    speculation: bool = True
    drafter: str = ""  # "model" | "combined" | "ngram" | "head"; "" = the engine's default
    draft_len: int = SETTINGS["draft_len"].default  # k
    adaptive: bool = True  # let k follow measured acceptance
    temperature: float = SETTINGS["temperature"].default
    top_p: float = SETTINGS["top_p"].default
    top_k: int = SETTINGS["top_k"].default
    max_new_tokens: int = SETTINGS["max_new_tokens"].default
    seed: int = SETTINGS["seed"].default  # -1: a fresh random seed per reply (in its stats)
    mode: str = "chat"  # "chat" | "completion" (the model continues the message as text)
    # Samplers against repetition (core/penalties.py), off here: the settings table's defaults,
    # the one set every front end uses. The page starts a base model at the examples' samplers
    # instead (ui/page.py, `page_defaults`).
    min_p: float = SETTINGS["min_p"].default
    repeat_penalty: float = SETTINGS["repeat_penalty"].default
    repeat_last_n: int = SETTINGS["repeat_last_n"].default
    frequency_penalty: float = SETTINGS["frequency_penalty"].default
    presence_penalty: float = SETTINGS["presence_penalty"].default
    dry_multiplier: float = SETTINGS["dry_multiplier"].default
    dry_base: float = SETTINGS["dry_base"].default
    dry_allowed_length: int = SETTINGS["dry_allowed_length"].default


@dataclass
class Turn:
    user: str
    tokens: list[TokenEvent] = field(default_factory=list)  # as the engine emitted them
    steps: list[StepRecord] = field(default_factory=list)  # the inspector's records
    key: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # names it in the page
    stats: GenerationStats | None = None  # None while streaming
    # The speedup shown under the reply (stats/speedup.py), fixed when the reply ends and
    # stored with the turn: later turns never change it.
    speedup: Speedup | None = None
    notes: list[str] = field(default_factory=list)  # caps applied, fallbacks
    body_html: str = field(default="", repr=False)  # rendered tokens, cached once finished
    feed: str = field(default="", repr=False)  # its live feed's name while it streams (ui/live.py)
    saved: Future | None = field(default=None, repr=False)  # its row id in the stats store

    @property
    def reply(self) -> str:
        return "".join(t.text for t in self.tokens)


@dataclass
class Session:
    """One browser's conversation (a gr.State: visitors never see each other's)."""
    turns: list[Turn] = field(default_factory=list)
    pending: str | None = None  # a user message echoed in the chat, waiting for its reply
    # its request (GenerateConfig, notes), built once when it was sent (`ChatApp.user`)
    pending_request: tuple | None = None
    conversation_id: str | None = None  # in the stats store, created with the first turn
    conversation: dict | None = None  # its row's fields, sent with every turn


# ---------------------------------------------------------------------------------------------
# Models: loaded in the background while the page is already up

class ModelSlot:
    """The models the page serves: loading (with progress lines), ready, or failed."""

    def __init__(self, report: LoadReport | None = None, description: str = ""):
        self.report = report
        self.description = description  # what is being loaded, shown while loading
        self.error = ""
        self.lines: list[str] = []
        self.started = time.monotonic()
        self.share_note = ""  # set by the launcher when a share link could not be made
        # What every text about models, files and errors goes through before a visitor sees
        # it: `hide_paths` on an exposed page.
        self.redact: Callable[[str], str] = str

    @classmethod
    def of(cls, source: Engine | LoadReport | ModelSlot) -> ModelSlot:
        if isinstance(source, ModelSlot):
            return source
        if isinstance(source, Engine):
            source = LoadReport(source, None, [])
        return cls(source)

    @property
    def state(self) -> str:
        return "ready" if self.report else "failed" if self.error else "loading"

    @property
    def engine(self) -> Engine | None:
        return self.report.engine if self.report else None

    def swap(self, report: LoadReport, description: str = "") -> LoadReport | None:
        """Serve `report` from now on: models loaded and warmed up whole beforehand (the page's
        Models tab), so a request sees the old models or the new, never a mix. The page's
        handlers and the API read the slot at each request. -> the report it replaces."""
        old, self.report = self.report, report
        self.error = ""
        self.description = description or self.description
        return old

    def progress(self, message: str) -> None:
        message = str(message).strip()
        if message:
            self.lines.append(message)
            print(f"specchat: {message}", file=sys.stderr, flush=True)

    def load(self, loader: Callable[[Callable[[str], None]], LoadReport],
             run_on: Callable[[Callable[[], None]], None] | None = None
             ) -> threading.Thread | None:
        """Run loader(progress) in a daemon thread, or through `run_on` (a job runner: the
        server's `EngineLoop.submit`, so the model loads, proves and warms up on the thread
        that runs its replies); the page polls `state`."""
        def run():
            try:
                self.report = loader(self.progress)
                self.progress(f"Ready in {time.monotonic() - self.started:.0f} s.")
            except ModelLoadError as e:  # says why, in words a user can act on
                self.error = str(e)
            except Exception as e:  # anything else: say what it was
                self.error = f"{type(e).__name__}: {e}"
            if self.error:
                print(f"specchat: model loading failed: {self.error}", file=sys.stderr)

        self.started = time.monotonic()
        if run_on is not None:
            run_on(run)
            return None
        thread = threading.Thread(target=run, name="specchat-load", daemon=True)
        thread.start()
        return thread
