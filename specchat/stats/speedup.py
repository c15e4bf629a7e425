"""Speedup: one definition for every view (the chat line under a reply, the A/B verdict, the
Stats tab, the CSV export, `specchat stats` and `stats --json`).

Pure functions over turns given as mappings (the store's rows, `GenerationStats.to_json()`) or
as objects with the same attribute names (`GenerationStats`, `StepRecord`): no model code, no
torch, no gradio.

A speculative turn's speedup is one of two things, and every view says which:

1. **Measured (A/B)**: its tokens/s (new tokens / wall seconds from request to last token,
   prompt encoding included) over the tokens/s of its race's plain run, the same prompt
   and settings with speculation off, when the turn has one and that run finished with tokens.
2. **Estimated ("est.")**: otherwise, from the turn's own steps: the tokens it emitted per
   target pass and the seconds its steps took, against the seconds of a plain one-token step
   timed on the same engine in the same process (the turn's own plain steps when it has
   `MIN_PLAIN_STEPS` of them, else those and the latest ones `PlainStepTimes` kept). It
   covers decoding (prompt encoding is left out) and comes with a band: the 5th and 95th
   percentiles over bootstrap draws of the turn's steps and of the plain steps.
3. No figure (`Speedup.value` None, shown as "—", `Speedup.note` says why): a plain turn, an
   interrupted one (stopped, failed, cancelled), one without tokens, one with too few steps, or
   one with no plain step timed to price its steps against.

A turn is never compared with another prompt's reply: two replies differ in length, in prompt
encoding and in what ran beside them, so their ratio says nothing about speculation. A figure
is computed once, when its turn ends, and kept with the turn (`Speedup.row`): later turns never
change it.

A conversation's figure is the geometric mean of its A/B pairs when it has any, else of its
estimates, and its note says which and how many. Speedups are ratios: the geometric mean is the
mean under which a 2x turn and a 0.5x turn average to 1x, and the mean of the inverse ratios
(off over on) is the inverse of the mean (Fleming & Wallace 1986, "How not to lie with
statistics: the correct way to summarize benchmark results"). Each turn counts once, whatever
its length.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specchat.stats.format import ESTIMATED, fmt_figure, fmt_mean

INTERRUPTED_REASONS = ("stopped", "error", "cancelled")  # cancelled: the page went away
AB, ESTIMATE = "ab", ESTIMATED  # what a figure is: measured against its A/B run, estimated
MIN_STEPS = 3  # decode steps a turn needs before its steps say anything about its speed
MIN_PLAIN_STEPS = 3  # plain step timings needed to price a plain step
RECENT_PLAIN_STEPS = 64  # plain step timings kept per engine for later estimates
BAND = (0.05, 0.95)  # the estimate's band: these percentiles of the bootstrap draws
DRAWS = 200  # bootstrap draws behind a band


@dataclass(frozen=True)
class Speedup:
    value: float | None = None  # the turn's speed over plain decoding's; None: no figure
    baseline: float | None = None  # the plain tokens/s it was compared with
    basis: str = ""  # AB, ESTIMATE, or "" without a figure
    note: str = ""  # what it was compared with, or why there is no figure
    low: float | None = None  # ESTIMATE: the band around the value
    high: float | None = None

    def label(self, sign: str = "x") -> str:
        """"2.47x", "≈2.10x est. (1.80–2.50x)" or "—" (`format.fmt_figure`)."""
        return fmt_figure(self.value, self.basis, self.low, self.high, sign)

    def row(self) -> dict:
        """The store's columns for this figure."""
        return {"speedup": self.value, "speedup_baseline": self.baseline,
                "speedup_basis": self.basis, "speedup_note": self.note,
                "speedup_low": self.low, "speedup_high": self.high}

    @classmethod
    def from_row(cls, row: Mapping) -> Speedup:
        """The figure a stored turn row keeps (the inverse of `row`)."""
        return cls(row.get("speedup"), row.get("speedup_baseline"),
                   row.get("speedup_basis") or "", row.get("speedup_note") or "",
                   row.get("speedup_low"), row.get("speedup_high"))


@dataclass(frozen=True)
class ConversationSpeedup:
    mean: float | None  # geometric mean of the turns' figures; None when no turn has one
    counted: int  # the turns the mean covers
    speculative: int  # all speculative turns
    note: str  # what the mean summarizes, or why there is none
    basis: str = ""  # AB: a mean of A/B pairs; ESTIMATE: of estimates

    def label(self, sign: str = "x") -> str:
        """"2.47x" (A/B pairs), "≈1.80x est." (estimates) or "—"."""
        return fmt_mean(self.mean, self.basis, sign)


def field(turn: Mapping | Any, key: str, default: Any = None) -> Any:
    """A turn's (or a step's) value by name, from a row (mapping) or an object."""
    if isinstance(turn, Mapping):
        return turn.get(key, default)
    return getattr(turn, key, default)


def tokens_per_s(turn: Mapping | Any) -> float:
    """New tokens over wall seconds (the engine's own formula, recomputed so every reader
    divides the same two numbers)."""
    new_tokens, seconds = field(turn, "new_tokens") or 0, field(turn, "seconds") or 0.0
    return new_tokens / seconds if seconds > 0 else float(field(turn, "tokens_per_s") or 0.0)


def interrupted(turn: Mapping | Any) -> bool:
    return bool(field(turn, "interrupted")) or field(turn, "stop_reason") in INTERRUPTED_REASONS


def comparable(turn: Mapping | Any) -> bool:
    """A finished turn with tokens: the only kind that gets a figure or serves as a baseline."""
    return not interrupted(turn) and tokens_per_s(turn) > 0


def turn_speedup(turn: Mapping | Any, ab_baseline: Mapping | Any | None = None,
                 steps: Sequence[Mapping | Any] = (), plain_costs: Sequence[float] = (),
                 seed: int = 0) -> Speedup:
    """The one definition: over `ab_baseline` (the turn's A/B plain run) when it is usable,
    else estimated from the turn's `steps` (its StepRecords) against plain step seconds
    (`estimate`), or no figure with the reason."""
    if not field(turn, "speculation"):
        return Speedup(note="plain turn (a baseline)")
    if field(turn, "drafts_reported", True) is False:
        return Speedup(note="the server does not report its drafts")
    if interrupted(turn):
        return Speedup(note=f"{field(turn, 'stop_reason') or 'interrupted'}: a partial "
                            "reply is not compared")
    rate = tokens_per_s(turn)
    if rate <= 0:
        return Speedup(note="no tokens to time")
    if ab_baseline is not None and comparable(ab_baseline):
        baseline = tokens_per_s(ab_baseline)
        return Speedup(rate / baseline, baseline, AB, "vs its A/B plain run of the same prompt "
                                                      f"and settings: {baseline:.1f} tok/s")
    return estimate(steps, plain_costs, seed=seed)


def estimate(steps: Sequence[Mapping | Any], plain_costs: Sequence[float] = (),
             draws: int = DRAWS, seed: int = 0) -> Speedup:
    """A speculative turn's speedup from its own steps: its tokens per second of decode steps
    (tokens emitted over draft plus verify seconds) times the seconds of a plain one-token step,
    the median of the turn's own plain steps (those that drafted nothing) when it has
    `MIN_PLAIN_STEPS`, else of those and `plain_costs` (seconds of plain steps timed earlier on
    the same engine). The band: the `BAND` percentiles over `draws` bootstrap draws of both
    sets of steps. Deterministic for a seed."""
    timed = [(int(field(s, "emitted") or 0),
              float(field(s, "draft_s") or 0.0) + float(field(s, "verify_s") or 0.0))
             for s in steps]
    if len(timed) < MIN_STEPS:
        return Speedup(note=f"too few steps to estimate from ({len(timed)})")
    tokens, seconds = sum(n for n, _ in timed), sum(s for _, s in timed)
    if tokens <= 0 or seconds <= 0:
        return Speedup(note="its steps were not timed")
    own = [float(field(s, "verify_s") or 0.0) for s in steps if not field(s, "drafted")]
    own = [s for s in own if s > 0]
    if len(own) >= MIN_PLAIN_STEPS:
        costs, where = own, f"{len(own)} plain steps of this reply"
    else:
        costs = own + [s for s in plain_costs if s > 0]
        where = f"{len(costs)} plain steps timed in this process"
    if len(costs) < MIN_PLAIN_STEPS:
        return Speedup(note="no plain step timed in this process yet to price its steps: "
                            "a race of drafters measures the speedup")
    plain_step = statistics.median(costs)
    value = tokens / seconds * plain_step
    low, high = _band(timed, costs, draws, seed)
    note = (f"est. from its own steps: {tokens / len(timed):.2f} tokens per target pass at "
            f"{1000 * seconds / len(timed):.1f} ms a step, against a plain step of "
            f"{1000 * plain_step:.1f} ms (median of {where}); prompt encoding left out; "
            f"band: {int(100 * BAND[0])}th to {int(100 * BAND[1])}th percentile of "
            f"{draws} bootstrap draws")
    # The band always holds the value itself (a skewed draw can leave it just outside).
    return Speedup(value, 1 / plain_step, ESTIMATE, note, min(low, value), max(high, value))


def _band(timed: list[tuple[int, float]], costs: list[float], draws: int, seed: int
          ) -> tuple[float, float]:
    """The BAND percentiles of the estimate over bootstrap draws of the turn's steps (tokens,
    seconds) and of the plain step seconds."""
    rng = random.Random(seed)
    values = []
    for _ in range(draws):
        picked = rng.choices(timed, k=len(timed))
        seconds = sum(s for _, s in picked)
        plain = statistics.median(rng.choices(costs, k=len(costs)))
        values.append(sum(n for n, _ in picked) / seconds * plain if seconds > 0 else math.inf)
    values.sort()
    return values[int(BAND[0] * draws)], values[int(BAND[1] * draws) - 1]


class PlainStepTimes:
    """The latest plain one-token steps' seconds on one engine (steps that drafted nothing:
    plain replies, A/B plain runs, speculative replies' steps without a draft, the warm-up).
    They price the steps of a turn that has too few plain steps of its own. Thread-safe."""

    def __init__(self, keep: int = RECENT_PLAIN_STEPS):
        self._seconds: deque[float] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def add(self, steps: Iterable[Mapping | Any]) -> None:
        plain = [float(field(s, "verify_s") or 0.0) for s in steps if not field(s, "drafted")]
        with self._lock:
            self._seconds.extend(s for s in plain if s > 0)

    def recent(self) -> list[float]:
        with self._lock:
            return list(self._seconds)


_TIMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TIMES_LOCK = threading.Lock()


def plain_step_times(engine: object | None) -> PlainStepTimes:
    """The plain step timings kept for `engine` in this process (a fresh, unkept record for
    None: no engine yet)."""
    if engine is None:
        return PlainStepTimes()
    with _TIMES_LOCK:
        try:
            return _TIMES.setdefault(engine, PlainStepTimes())
        except TypeError:  # an object without weak references: timings are not kept
            return PlainStepTimes()


def conversation_speedups(turns: Sequence[Mapping | Any], others: Iterable[Mapping | Any] = (),
                          steps: Mapping[Any, Sequence[Mapping | Any]] | None = None
                          ) -> list[Speedup]:
    """Every turn's `Speedup` from what is kept with it, in order. A turn's A/B run is found by
    `baseline_turn_id` among `turns` (and `others`: baseline rows kept outside the
    conversation); `steps` maps a turn's id to its step records."""
    by_id = {field(t, "id"): t for t in [*others, *turns] if field(t, "id") is not None}
    steps = steps or {}
    return [turn_speedup(t, by_id.get(field(t, "baseline_turn_id")),
                         steps.get(field(t, "id"), ())) for t in turns]


def geometric_mean(values: Iterable[float | None]) -> float | None:
    logs = [math.log(v) for v in values if v is not None and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def conversation_speedup(turns: Sequence[Mapping | Any]) -> ConversationSpeedup:
    """The conversation's figure over turns that carry their `speedup`, `speedup_basis` (and
    `speedup_note`), as the store keeps them: the geometric mean of its A/B pairs when it has
    any, else of its estimates; the note says which and how many."""
    spec = [t for t in turns if field(t, "speculation")]

    def figures(basis: str) -> list[float]:
        return [field(t, "speedup") for t in spec
                if field(t, "speedup_basis") == basis and field(t, "speedup") is not None]

    measured, estimated = figures(AB), figures(ESTIMATE)
    if measured:
        note = f"geometric mean of {_plural(len(measured), 'A/B pair')}"
        if estimated:
            note += f" ({_plural(len(estimated), 'other turn')} only estimated, left out)"
        return ConversationSpeedup(geometric_mean(measured), len(measured), len(spec), note, AB)
    if estimated:
        note = (f"est.: geometric mean of {_plural(len(estimated), 'turn')}' estimates from "
                "their own steps (no A/B pair yet)")
        return ConversationSpeedup(geometric_mean(estimated), len(estimated), len(spec), note,
                                   ESTIMATE)
    if not spec:
        return ConversationSpeedup(None, 0, 0, "no speculative turn")
    note = field(spec[-1], "speedup_note") or "no speculative turn has a figure"
    return ConversationSpeedup(None, 0, len(spec), note)


def noise_band(off_steps: Sequence[tuple[int, float]], on_steps: Sequence[tuple[int, float]],
               draws: int = 400, seed: int = 0) -> tuple[float, float] | None:
    """How far one A/B ratio could move by chance: the 5th and 95th percentiles of the
    decode-speed ratio (on over off) over `draws` bootstrap draws of each run's steps, given
    as (tokens emitted, seconds) per step. A band holding 1.0 means the two runs' own
    step-to-step variation explains the difference: no measurable speedup. None when a run has
    fewer than 4 steps to draw from. Deterministic for a seed."""
    if len(off_steps) < 4 or len(on_steps) < 4:
        return None
    rng = random.Random(seed)

    def rate(steps) -> float:
        picked = [steps[rng.randrange(len(steps))] for _ in steps]
        seconds = sum(s for _, s in picked)
        return sum(n for n, _ in picked) / seconds if seconds > 0 else math.inf

    ratios = sorted(rate(on_steps) / rate(off_steps) for _ in range(draws))
    return ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]
