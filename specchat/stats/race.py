"""A race's results: one prompt, the same seed and settings, speculation off and then each
drafter on; which one was fastest, and whether that is more than noise.

    rows = standings(runs)            # runs: [Entry(mode, stats, steps, tokens)], the plain first
    winner(rows)                      # the mode whose band clears every other's, or None

Each speculative run's speedup is its tok/s over the plain run's (the A/B definition of
stats/speedup.py), and its band how far that ratio could move by chance: a bootstrap over
both runs' steps (`noise_band`). The plain run's band is 1x exactly. A winner is named only
where its band's low end is above every other run's high end, so a race within noise says so
instead of crowning whichever run the machine happened to favour.

Pure numbers over the runs' stats and step records (attributes or mapping keys): no model
code, so the page, the API and the tests read the same figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specchat.stats.speedup import noise_band


@dataclass
class Entry:
    """One run of a race as it ended: its mode ("plain", a drafter, "head-tree", ...), the
    engine's GenerationStats, its StepRecords and its emitted tokens as (id, text) pairs."""
    mode: str
    stats: Any
    steps: Sequence[Any] = ()
    tokens: Sequence[tuple[int, str]] = ()


@dataclass
class Standing:
    mode: str
    tokens_per_s: float
    speedup: float | None  # over the plain run (None: the plain run itself, or no baseline)
    band: tuple[float, float] | None  # the speedup's bootstrap band; (1, 1) for the plain run
    acceptance: float | None  # accepted / drafted (None: nothing drafted)
    tokens_per_step: float | None  # tokens emitted per speculative step
    ttft_s: float
    new_tokens: int
    same_as_plain: bool | None  # its text is the plain run's (None: not comparable)
    stop_reason: str = ""
    notes: list[str] = field(default_factory=list)


def _get(obj, name: str, default=None):
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def _rates(steps: Sequence[Any]) -> list[tuple[int, float]]:
    """(tokens emitted, seconds) per decode step, as `noise_band` takes them."""
    return [(_get(s, "accepted", 0) + 1, _get(s, "draft_s", 0.0) + _get(s, "verify_s", 0.0))
            for s in steps]


def complete(stats) -> bool:
    """A run that ran to its end (the token limit, a stop string, the end of text)."""
    return stats is not None and _get(stats, "stop_reason") in ("length", "eos", "stop_string")


def standings(runs: Sequence[Entry]) -> list[Standing]:
    """One row per run, in the race's order; runs[0] is the plain run, the baseline."""
    plain = runs[0] if runs and complete(runs[0].stats) else None
    rows = []
    for i, run in enumerate(runs):
        stats = run.stats
        rate = _get(stats, "tokens_per_s", 0.0) or 0.0
        speedup = band = same = None
        if i == 0:
            band = (1.0, 1.0)
        elif plain is not None and complete(stats):
            base = _get(plain.stats, "tokens_per_s", 0.0)
            speedup = rate / base if base > 0 else None
            band = noise_band(_rates(plain.steps), _rates(run.steps))
        if plain is not None and run is not plain and complete(stats):
            same = list(run.tokens) == list(plain.tokens)
        drafted = _get(stats, "drafted", 0) or 0
        rows.append(Standing(
            mode=run.mode, tokens_per_s=rate, speedup=speedup, band=band,
            acceptance=_get(stats, "accepted", 0) / drafted if drafted else None,
            tokens_per_step=(_get(stats, "mean_accepted_len") or None) if drafted else None,
            ttft_s=_get(stats, "ttft_s", 0.0) or 0.0, new_tokens=_get(stats, "new_tokens", 0),
            same_as_plain=same, stop_reason=_get(stats, "stop_reason", "") or ""))
    return rows


def winner(rows: Sequence[Standing]) -> str | None:
    """The fastest run's mode where its band clears every other run's band (the plain run's,
    rows[0], is 1x), else None: no run is measurably ahead of the rest. Every run needs a
    band."""
    if len(rows) < 2 or any(r.band is None for r in rows):
        return None
    best = max(rows, key=lambda r: 1.0 if r is rows[0] else (r.speedup or 0.0))
    if any(r is not best and r.band[1] >= best.band[0] for r in rows):
        return None
    return best.mode
