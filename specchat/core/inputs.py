"""The error every bad user input raises, and the one cleaning every user text gets.

Settings are checked by `core.settings` (one table for the page, the CLI and the HTTP API);
texts pass `clean_text`, so no lone surrogate reaches the tokenizer wherever it was typed.
"""

from __future__ import annotations

import re

# A Python str holds code points, so a surrogate in one is always unpaired (JSON's "\ud800"
# arrives that way); UTF-8 cannot encode it and the tokenizer refuses the whole text.
_SURROGATE = re.compile("[\ud800-\udfff]")


class InputError(ValueError):
    """A setting or text that cannot be used; str(e) says which, what it was and what is
    allowed."""


def clean_text(text: str | None) -> str:
    """None -> ""; every lone surrogate -> U+FFFD. Nothing else changes."""
    return _SURROGATE.sub("\ufffd", text or "")
