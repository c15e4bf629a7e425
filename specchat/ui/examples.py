"""The page's one-click examples: prompts that read well on the embedded 270M base model, each
with its own settings.

A base model this small falls into loops ("Photosynthesis is a multi-step process." ten times)
unless a sampler stops it, so every example carries the penalties that keep its reply readable
(DRY and a mild repeat penalty: lossless with speculation, core/penalties.py). Each example also
names a few topic words; tests/test_real_model.py generates every example on the embedded model
and checks that no 6-token sequence of its reply occurs more than twice and that the reply
uses at least two of its topic words (it stays on the subject it was given).

The same samplers are the page's defaults for a base model (ui/page.py), with a switch between
them and none at all: `SAMPLER_PRESETS`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from specchat.core.settings import ANTI_LOOP, SETTINGS

# The page's controls that shape the target's distribution against loops (Settings fields).
SAMPLER_FIELDS = ("min_p", "repeat_penalty", "repeat_last_n", "frequency_penalty",
                  "presence_penalty", "dry_multiplier", "dry_base", "dry_allowed_length")
NO_SAMPLERS = {name: SETTINGS[name].default for name in SAMPLER_FIELDS}  # all off
# The page's sampler switch: its choices, each the values it gives the controls above.
SAMPLER_PRESETS = {"examples": {**NO_SAMPLERS, **ANTI_LOOP}, "none": NO_SAMPLERS}
CUSTOM = "custom"  # the controls hold values of the visitor's own
SAMPLER_CHOICES = [
    (f"Against loops, as the examples: DRY {ANTI_LOOP['dry_multiplier']}, repeat penalty "
     f"{ANTI_LOOP['repeat_penalty']}, min-p {ANTI_LOOP['min_p']}", "examples"),
    ("None: the model's own distribution", "none"),
    ("Custom (Penalties below)", CUSTOM),
]


def sampler_preset(values: Mapping) -> str:
    """Which of SAMPLER_PRESETS the controls' `values` (Settings fields) hold, else CUSTOM."""
    for name, preset in SAMPLER_PRESETS.items():
        try:
            if all(math.isclose(float(values[key]), float(value), abs_tol=1e-9)
                   for key, value in preset.items()):
                return name
        except (KeyError, TypeError, ValueError):  # a control left empty
            return CUSTOM
    return CUSTOM


@dataclass(frozen=True)
class Example:
    text: str
    label: str  # shown beside the text: the mode and how it samples
    settings: dict = field(default_factory=dict)  # Settings fields; the rest keep defaults
    topic: tuple[str, ...] = ()  # words an on-topic reply uses (lowercase)


EXAMPLES = [
    Example("Water is a chemical compound made of", "completion · T 0.7",
            dict(mode="completion", temperature=0.7, seed=2, max_new_tokens=96, **ANTI_LOOP),
            ("hydrogen", "oxygen", "water", "molecule", "atom")),
    Example("The Eiffel Tower is a wrought-iron lattice tower in Paris. It was",
            "completion · T 0.7",
            dict(mode="completion", temperature=0.7, seed=2, max_new_tokens=96, **ANTI_LOOP),
            ("tower", "eiffel", "paris", "meters", "built", "french", "france")),
    Example("Photosynthesis is the process by which plants", "completion · greedy",
            dict(mode="completion", temperature=0.0, seed=0, max_new_tokens=128, **ANTI_LOOP),
            ("light", "energy", "plants", "carbon", "oxygen", "sun", "chlorophyll")),
    Example("# A Python function that reverses a string\ndef reverse_string(s):",
            "completion · T 0.7",
            dict(mode="completion", temperature=0.7, seed=2, max_new_tokens=64, **ANTI_LOOP),
            ("return", "string", "s", "reverse", "str")),
    Example("Tell me a fun fact about the octopus.", "chat · greedy",
            dict(mode="chat", temperature=0.0, seed=0, max_new_tokens=64, **ANTI_LOOP),
            ("octopus", "octopuses", "they", "arms", "legs", "sea", "water", "animals")),
]
