"""Where specchat keeps what it makes: converted checkpoints, compiled kernels, trained heads."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("SPECCHAT_CACHE")
    if root:
        return Path(root)
    try:
        from platformdirs import user_cache_dir
    except ImportError:  # a bare machine (a lent GPU's image): the XDG default
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specchat"
    return Path(user_cache_dir("specchat"))


def assets_dir() -> Path:
    """The page's assets and the shipped draft heads: `assets/` beside the package in a
    checkout, `specchat/assets/` once installed (`pip install .` maps one onto the other)."""
    package = Path(__file__).resolve().parent
    installed = package / "assets"
    return installed if installed.is_dir() else package.parent / "assets"
