"""Where specchat keeps what it makes: converted checkpoints, compiled kernels, trained heads."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("SPECCHAT_CACHE")
    if root:
        return Path(root)
    from platformdirs import user_cache_dir
    return Path(user_cache_dir("specchat"))
