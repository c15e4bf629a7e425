"""Every drafter specchat can load, one file each, and their registry.

A new drafter is a subclass of `core.drafter.Drafter` in a file here plus one `DrafterInfo` line
below; `loader.load_engine` decides which of them can run for a given target.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterInfo:
    name: str  # the key in Engine.drafters, GenerateConfig.drafter and `--drafter`
    label: str  # what the page's drafter menu shows
    needs: str  # what must be loaded for it to exist


# Best first, by `python -m specchat bench` on the embedded target: a real draft model, then
# n-gram lookup with the trained head behind it, lookup alone, the head alone.
REGISTRY = (
    DrafterInfo("model", "Draft model", "a draft model sharing the target's vocabulary"),
    DrafterInfo("combined", "N-gram + head", "a draft head trained for the target"),
    DrafterInfo("ngram", "N-gram lookup (prompt)", "nothing"),
    DrafterInfo("head", "Draft head (EAGLE)", "a draft head trained for the target"),
    DrafterInfo("server", "The server's own", "a --backend server that speculates"),
)
NAMES = tuple(info.name for info in REGISTRY)
LABELS = {info.name: info.label for info in REGISTRY}


def preferred(available) -> str:
    """The drafter to use when none is asked for: the best of `available` names."""
    available = list(available)
    return next((name for name in NAMES if name in available), available[0] if available
                else "ngram")
