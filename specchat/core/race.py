"""A race: the same prompt, seed and settings decoded plainly, then with each drafter the
engine has, so a user sees which drafter pays on their prompt and their model.

    for lane in lanes(engine, cfg):       # "plain", "ngram", "head", "head-chain", ...
        events = engine.stream(ids, lane.cfg)

Every lane drafts from the prompt alone: no run reads or adds to its owner's drafting history
(core/history.py). The reply a race replays is in that history already, as is each earlier
lane's text, and copying it would measure the replay rather than the drafter; `bench` runs
without history for the same reason, so a race and a bench of one prompt agree.

Trees run where they apply: a drafter that drafts trees gets a lane with its default (a tree
when greedy, see `default_tree_nodes`) and one with the other shape, so the two are compared on
the prompt too. The results are read by stats/race.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from specchat.core.request import TREE_NODES, GenerateConfig

PLAIN = "plain"
# Lanes in this order, the drafters best first; others (a serving backend's) after them.
ORDER = ("model", "combined", "head", "ngram")


@dataclass(frozen=True)
class Lane:
    mode: str  # "plain", a drafter's name, or "<drafter>-tree" / "<drafter>-chain"
    label: str  # what the page calls it
    cfg: GenerateConfig


LABELS = {PLAIN: "speculation off", "model": "draft model", "ngram": "n-gram lookup",
          "head": "draft head", "combined": "n-gram + head"}


def label(mode: str) -> str:
    base, _, shape = mode.partition("-")
    return LABELS.get(base, base) + (f" ({shape})" if shape else "")


def lanes(engine, cfg: GenerateConfig) -> list[Lane]:
    """The race's runs for request `cfg` on `engine`: plain decoding first, then each loaded
    drafter (with its other draft shape where it drafts trees), all without history."""
    base = replace(cfg, owner=None, remember=False)
    out = [Lane(PLAIN, label(PLAIN), replace(base, speculation=False, tree_nodes=0))]
    drafters = getattr(engine, "drafters", {})
    names = sorted(drafters, key=lambda d: (ORDER.index(d) if d in ORDER else len(ORDER), d))
    greedy_trees = set(getattr(engine, "greedy_trees", ()))
    trees = bool(getattr(engine, "trees_ok", False))
    for name in names:
        default = TREE_NODES if cfg.temperature <= 0 and name in greedy_trees else 0
        out.append(Lane(name, label(name),
                        replace(base, speculation=True, drafter=name, tree_nodes=default)))
        if trees and getattr(drafters[name], "supports_trees", False) and cfg.temperature <= 0:
            other = f"{name}-chain" if default else f"{name}-tree"
            out.append(Lane(other, label(other), replace(
                base, speculation=True, drafter=name, tree_nodes=0 if default else TREE_NODES)))
    return out
