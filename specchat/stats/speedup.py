"""Speedup: one definition for every view (the chat line under a reply, the A/B verdict, the
Stats tab, the CSV export, `specchat stats` and `stats --json`).

Pure functions over turns given as mappings (the store's rows, `GenerationStats.to_json()`) or
as objects with the same attribute names (`GenerationStats`): no model code, no torch, no gradio.

A speculative turn's speedup is its tokens/s (new tokens / wall seconds from request to last
token, prompt encoding included) over a plain tokens/s measured in the same conversation (so
with the same target and drafter, on the same machine):

1. its A/B replay's plain run (the same prompt and settings, speculation off), when the turn
   has one and that run finished with tokens; else
2. the median tokens/s of the conversation's finished plain turns at the same temperature
   (the median, so one reply that paid a one-time cost does not move the baseline); else
3. no figure: `Speedup.value` is None, shown as "—", and `Speedup.note` says why.

Interrupted turns (stopped, failed, cancelled) are neither given a speedup nor used as a
baseline: a partial reply's tokens/s holds a larger share of prompt encoding than a whole one's.

A conversation's speedup is the geometric mean of its turns' speedups. Speedups are ratios: the
geometric mean is the mean under which a 2x turn and a 0.5x turn average to 1x, and the mean of
the inverse ratios (off over on) is the inverse of the mean (Fleming & Wallace 1986, "How not
to lie with statistics: the correct way to summarize benchmark results"). Each turn counts
once, whatever its length; turns without a figure are left out, and the note says how many
counted.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

INTERRUPTED_REASONS = ("stopped", "error", "cancelled")  # cancelled: the page went away
AB, PLAIN = "ab", "plain"  # what a figure was compared with: the A/B run, the plain median


@dataclass(frozen=True)
class Speedup:
    value: float | None = None  # the turn's tokens/s over the baseline's; None: no figure
    baseline: float | None = None  # the plain tokens/s it was compared with
    basis: str = ""  # AB, PLAIN, or "" without a figure
    note: str = ""  # what it was compared with, or why there is no figure


@dataclass(frozen=True)
class ConversationSpeedup:
    mean: float | None  # geometric mean of the turns' speedups; None when no turn has one
    counted: int  # speculative turns with a figure
    speculative: int  # all speculative turns
    note: str  # how the mean was formed, or why there is none


def field(turn: Mapping | Any, key: str, default: Any = None) -> Any:
    """A turn's value by name, from a row (mapping) or a stats object."""
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
    """A finished turn with tokens: the only kind that gets a speedup or serves as a baseline."""
    return not interrupted(turn) and tokens_per_s(turn) > 0


def _temperature(turn_or_value: Mapping | Any) -> float | None:
    value = turn_or_value if isinstance(turn_or_value, (int, float)) or turn_or_value is None \
        else field(turn_or_value, "temperature")
    return None if value is None else round(float(value), 4)


def plain_baseline(turns: Iterable[Mapping | Any], temperature: float | None
                   ) -> tuple[float | None, int]:
    """(median tokens/s, count) of the finished plain turns at this temperature; (None, 0)
    when there is none."""
    wanted = _temperature(temperature)
    rates = [tokens_per_s(t) for t in turns
             if not field(t, "speculation") and comparable(t) and _temperature(t) == wanted]
    return (statistics.median(rates) if rates else None), len(rates)


def speedup_over(turn: Mapping | Any, baseline: float | None, basis: str = PLAIN,
                 count: int = 1) -> Speedup:
    """`turn`'s speedup over a plain tokens/s already chosen (`basis`: AB for its A/B run,
    PLAIN for the median of `count` plain turns), or why it has none."""
    if not field(turn, "speculation"):
        return Speedup(note="plain turn (a baseline)")
    if interrupted(turn):
        return Speedup(note=f"{field(turn, 'stop_reason') or 'interrupted'}: a partial "
                            "reply is not compared")
    rate = tokens_per_s(turn)
    if rate <= 0:
        return Speedup(note="no tokens to time")
    if not baseline or baseline <= 0:
        temperature = _temperature(turn)
        at = f" at temperature {temperature:g}" if temperature is not None else ""
        return Speedup(note=f"no plain turn{at} to compare with yet")
    if basis == AB:
        note = f"vs its A/B plain run: {baseline:.1f} tok/s"
    else:
        plain = "the plain turn" if count == 1 else f"the median of {count} plain turns"
        note = f"vs {plain}: {baseline:.1f} tok/s"
    return Speedup(rate / baseline, baseline, basis, note)


def turn_speedup(turn: Mapping | Any, plain_turns: Iterable[Mapping | Any] = (),
                 ab_baseline: Mapping | Any | None = None) -> Speedup:
    """The one definition: over `ab_baseline` (the turn's A/B plain run) when it is usable,
    else over the median of `plain_turns` (the conversation's turns; speculative and
    interrupted ones are skipped) at the turn's temperature."""
    if ab_baseline is not None and comparable(ab_baseline):
        return speedup_over(turn, tokens_per_s(ab_baseline), AB)
    baseline, count = plain_baseline(plain_turns, field(turn, "temperature"))
    return speedup_over(turn, baseline, PLAIN, count)


def conversation_speedups(turns: Sequence[Mapping | Any],
                          others: Iterable[Mapping | Any] = ()) -> list[Speedup]:
    """Every turn's `Speedup`, in order. A turn's A/B run is found by `baseline_turn_id`
    among `turns` (and `others`: baseline rows kept outside the conversation)."""
    by_id = {field(t, "id"): t for t in [*others, *turns] if field(t, "id") is not None}
    return [turn_speedup(t, turns, by_id.get(field(t, "baseline_turn_id"))) for t in turns]


def geometric_mean(values: Iterable[float | None]) -> float | None:
    logs = [math.log(v) for v in values if v is not None and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def conversation_speedup(turns: Sequence[Mapping | Any]) -> ConversationSpeedup:
    """The conversation's mean over turns that carry their `speedup` (and `speedup_note`), as
    the store keeps them: the geometric mean of the speculative turns' figures."""
    spec = [t for t in turns if field(t, "speculation")]
    values = [field(t, "speedup") for t in spec if field(t, "speedup") is not None]
    mean = geometric_mean(values)
    if not spec:
        note = "no speculative turn"
    elif mean is None:
        note = field(spec[-1], "speedup_note") or "no speculative turn has a baseline"
    else:
        note = f"geometric mean over {len(values)} of {len(spec)} speculative turns"
    return ConversationSpeedup(mean, len(values), len(spec), note)


def noise_band(off_steps: Sequence[tuple[int, float]], on_steps: Sequence[tuple[int, float]],
               draws: int = 400, seed: int = 0) -> tuple[float, float] | None:
    """How far one A/B ratio could move by chance: the 5th and 95th percentiles of the
    decode-speed ratio (on over off) over `draws` bootstrap resamples of each run's steps,
    given as (tokens emitted, seconds) per step. A band holding 1.0 means the two runs'
    own step-to-step variation explains the difference: no measurable speedup. None when a
    run has fewer than 4 steps to resample. Deterministic for a seed."""
    if len(off_steps) < 4 or len(on_steps) < 4:
        return None
    rng = random.Random(seed)

    def rate(steps) -> float:
        picked = [steps[rng.randrange(len(steps))] for _ in steps]
        seconds = sum(s for _, s in picked)
        return sum(n for n, _ in picked) / seconds if seconds > 0 else math.inf

    ratios = sorted(rate(on_steps) / rate(off_steps) for _ in range(draws))
    return ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]
