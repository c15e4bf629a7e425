"""The page's one-click examples: prompts that read well on the embedded 270M base model, each
with its own settings.

A base model this small falls into loops ("Photosynthesis is a multi-step process." ten times)
unless a sampler stops it, so every example carries the penalties that keep its reply readable
(DRY and a mild repeat penalty: lossless with speculation, core/penalties.py). Each example also
names a few topic words; tests/test_real_model.py generates every example on the embedded model
and checks that no 6-token sequence of its reply occurs more than twice and that the reply
uses at least two of its topic words (it stays on the subject it was given).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specchat.core.settings import ANTI_LOOP

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
    Example("Tell me a fun fact about octopuses.", "chat · greedy",
            dict(mode="chat", temperature=0.0, seed=0, max_new_tokens=64, **ANTI_LOOP),
            ("octopus", "octopuses", "they", "arms", "legs", "sea", "water", "animals")),
]
