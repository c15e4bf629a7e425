"""The one check every user-given setting and text passes before it reaches the engine.

The page, the CLI and the HTTP API all call `check_settings` and `clean_text`, so a value is
refused (with a sentence naming the setting, the value and what is allowed) in the same way
wherever it was typed: no NaN or infinity reaches the sampler, no seed that SQLite and torch
cannot hold reaches the generator, no lone surrogate reaches the tokenizer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

SEED_MAX = 2**63 - 1  # SQLite INTEGER and torch generators hold up to this
MAX_DRAFT_LEN = 16
MAX_TREE_NODES = 64

LABELS = {"max_new_tokens": "Max new tokens", "temperature": "Temperature", "top_p": "Top-p",
          "top_k": "Top-k", "seed": "Seed", "draft_len": "Draft length k",
          "tree_nodes": "Tree nodes"}

# A Python str holds code points, so a surrogate in one is always unpaired (JSON's "\ud800"
# arrives that way); UTF-8 cannot encode it and the tokenizer refuses the whole text.
_SURROGATE = re.compile("[\ud800-\udfff]")


class InputError(ValueError):
    """A setting or text that cannot be used; str(e) says which, what it was and what is
    allowed."""


def clean_text(text: str | None) -> str:
    """None -> ""; every lone surrogate -> U+FFFD. Nothing else changes."""
    return _SURROGATE.sub("\ufffd", text or "")


def check_settings(*, max_new_tokens, temperature, top_p, top_k, seed, draft_len,
                   tree_nodes=None, names: Mapping[str, str] | None = None) -> dict:
    """Raw values (numbers or numeric strings) -> normalized ones, or InputError.

    seed None or -1 means a fresh random seed (returned as None); tree_nodes None means
    the default. `names` relabels settings in messages (the CLI names its flags)."""
    labels = {**LABELS, **(names or {})}

    def number(key, value) -> float:
        try:
            x = float(value)
        except (TypeError, ValueError):
            raise InputError(f"{labels[key]} must be a number (got {value!r}).") from None
        if isinstance(value, bool) or not math.isfinite(x):
            raise InputError(f"{labels[key]} must be a finite number (got {value!r}).")
        return x

    def integer(key, value, low, high=None, also="") -> int:
        x = number(key, value)
        if x != int(x) or x < low or (high is not None and x > high):
            allowed = f"a whole number between {low} and {high}" if high is not None \
                else f"a whole number >= {low}"
            raise InputError(f"{labels[key]} must be {allowed}{also} (got {value!r}).")
        return int(x)

    out = {"max_new_tokens": integer("max_new_tokens", max_new_tokens, 1),
           "top_k": integer("top_k", top_k, 0),
           "draft_len": integer("draft_len", draft_len, 1, MAX_DRAFT_LEN)}
    out["temperature"] = number("temperature", temperature)
    if out["temperature"] < 0:
        raise InputError(f"{labels['temperature']} must be a finite number >= 0 "
                         f"(got {temperature!r}).")
    out["top_p"] = number("top_p", top_p)
    if not 0 < out["top_p"] <= 1:
        raise InputError(f"{labels['top_p']} must be in (0, 1] (got {top_p!r}).")
    out["seed"] = None
    if seed is not None:
        # Whole numbers stay ints: a float cannot tell SEED_MAX from SEED_MAX + 1.
        x = _exact_int(seed)
        if x is None:
            x = number("seed", seed)
        if x != int(x) or x > SEED_MAX or x < -1:
            raise InputError(f"{labels['seed']} must be a whole number between 0 and "
                             f"{SEED_MAX}, or -1 for a random seed (got {seed!r}).")
        out["seed"] = int(x) if x >= 0 else None
    out["tree_nodes"] = None if tree_nodes is None else \
        integer("tree_nodes", tree_nodes, 0, MAX_TREE_NODES)
    return out


def _exact_int(value) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    return None
