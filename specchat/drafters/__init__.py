"""Every drafter specchat can load, one file each, and their registry.

A new drafter is a subclass of `core.drafter.Drafter` in a file here plus one `DrafterInfo` line
in `core.drafter.REGISTRY`; `loader.load_engine` decides which of them can run for a given target.
"""

from __future__ import annotations

# The registry is plain data and lives beside the drafter contract (`core.drafter`), where the
# engine's settings read it too; here it stays under the names the front ends import.
from specchat.core.drafter import LABELS, NAMES, REGISTRY, DrafterInfo, preferred

__all__ = ["LABELS", "NAMES", "REGISTRY", "DrafterInfo", "preferred"]
