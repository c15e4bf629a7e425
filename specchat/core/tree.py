"""Draft trees: several candidate continuations verified in one target forward (SpecInfer,
Miao et al. 2023; EAGLE-2, Li et al. 2024).

A chain of drafts is lost from its first wrong token on. A tree keeps a few alternatives where the
drafter is unsure: the target reads every node in one forward, each node attending to the context
and its own ancestors only (a tree attention mask), and the step keeps the longest path the target
agrees with. A wider forward costs more where the
hardware makes it so; the draft-length policy measures that price (policy.py) and the bench
reports it (docs/performance.md).

Verification draws the target's token at each node exactly as plain decoding would (argmax, or
`sample_row` with the keyed random numbers of the node's reply position) and walks down while
that token is one of the node's children.
Every emitted token is therefore plain decoding's own draw, whatever the tree: lossless at any
temperature, and a seeded reply is plain decoding's reply. (It is the one-hot coupling of
`sampling.verify` applied per node; the children's probabilities under the drafter only shape
the tree, never the test.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specchat.core.sampling import Noise, SamplingParams, sample_row
from specchat.core.sampling import argmax as greedy_ids


@dataclass
class DraftTree:
    """Node i is token tokens[i], a child of node parents[i] (-1: of the context's newest token,
    the root). Parents come before their children."""

    tokens: torch.Tensor  # [N] long
    parents: list[int]

    def __len__(self) -> int:
        return len(self.parents)

    def depths(self) -> list[int]:
        """Depth of each node (children of the root: 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    @property
    def depth(self) -> int:
        return max(self.depths(), default=0)

    def without(self, tokens: frozenset[int] | set[int]) -> DraftTree:
        """The tree without the nodes whose token is in `tokens`, nor their descendants."""
        index: dict[int, int] = {-1: -1}  # old node -> new node, for the nodes kept
        kept, parents = [], []
        for i, (token, p) in enumerate(zip(self.tokens.tolist(), self.parents)):
            if token not in tokens and p in index:
                index[i] = len(kept)
                kept.append(i)
                parents.append(index[p])
        if len(kept) == len(self.parents):
            return self
        return DraftTree(self.tokens[kept], parents)

    def paths(self) -> list[list[int]]:
        """The tokens from the root down to each row of a tree forward: [] for the root, then
        node i's ancestors and node i (what a node's row continues after the context)."""
        out: list[list[int]] = [[]]
        for token, p in zip(self.tokens.tolist(), self.parents):
            out.append(out[p + 1] + [token])
        return out


def visibility(parents: list[int]) -> torch.Tensor:
    """[N + 1, N + 1] bool: row i sees column j iff j is i or an ancestor of i, over the root
    (index 0) followed by the nodes (index 1 + node)."""
    n = len(parents) + 1
    vis = torch.zeros(n, n, dtype=torch.bool)
    vis[0, 0] = True
    for i, p in enumerate(parents, start=1):
        vis[i] = vis[p + 1]
        vis[i, i] = True
    return vis


@dataclass
class TreeVerdict:
    path: list[int]  # accepted nodes, root to leaf
    next_token: int  # the target's token after the path
    bonus: bool  # the path ends at a leaf: every draft on it passed
    refused: list[int] = field(default_factory=list)  # the decisive node's children (nodes)


def verify_tree(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
                noise: Noise | None, position: int = 0) -> TreeVerdict:
    """target_logits [N + 1, vocab]: row 0 at the root, row 1 + i at node i. The root's row
    predicts the token at reply position `position`, a node's at position + its depth."""
    children: dict[int, dict[int, int]] = {}
    for i, (token, p) in enumerate(zip(tree.tokens.tolist(), tree.parents)):
        children.setdefault(p, {})[token] = i
    argmax = greedy_ids(target_logits).tolist() if params.greedy else None
    node, path = -1, []
    while True:
        row = node + 1
        y = argmax[row] if argmax is not None else sample_row(target_logits[row], params,
                                                               noise, position + len(path))
        kids = children.get(node)
        if not kids or y not in kids:
            return TreeVerdict(path, y, bonus=not kids, refused=list((kids or {}).values()))
        node = kids[y]
        path.append(node)
