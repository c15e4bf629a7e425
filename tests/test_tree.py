"""Draft trees: the visibility mask and the walk that verifies a tree (specchat/tree.py). The
engine's end-to-end checks (greedy and seeded sampling equal to plain decoding, past the sliding
window) are in test_engine.py and test_head.py."""

import collections

import pytest
import torch
from tiny import dense_probs

from specchat.core.sampling import Noise, SamplingParams, sample_row
from specchat.core.tree import DraftTree, verify_tree, visibility

#        root
#       /    \
#     0:a    1:b
#     /  \      \
#   2:c  3:d    4:e
#   |
#   5:f
TREE = DraftTree(torch.tensor([10, 11, 12, 13, 14, 15]), [-1, -1, 0, 0, 1, 2])


def test_visibility_is_self_and_ancestors():
    vis = visibility(TREE.parents)
    want = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5],
            6: [0, 1, 3, 6]}
    for row, cols in want.items():
        assert vis[row].nonzero().flatten().tolist() == cols
    assert TREE.depths() == [1, 1, 2, 2, 2, 3] and TREE.depth == 3


def logits_row(best: int, vocab: int = 32) -> torch.Tensor:
    row = torch.zeros(vocab)
    row[best] = 5.0
    return row


def rows(best_by_row: dict[int, int]) -> torch.Tensor:
    """Logits for the root (row 0) and each node (row 1 + i); unlisted rows prefer token 0."""
    return torch.stack([logits_row(best_by_row.get(r, 0)) for r in range(len(TREE) + 1)])


@pytest.mark.parametrize("best, path, token, bonus", [
    ({0: 10, 1: 13, 4: 7}, [0, 3], 7, True),  # root -> a -> d, a leaf: bonus
    ({0: 10, 1: 12, 3: 15, 6: 9}, [0, 2, 5], 9, True),  # down to the deepest leaf
    ({0: 11, 2: 20}, [1], 20, False),  # b, whose only child e is not the target's token
    ({0: 21}, [], 21, False),  # neither a nor b
])
def test_greedy_walk_follows_the_targets_argmax(best, path, token, bonus):
    v = verify_tree(TREE, rows(best), SamplingParams(0.0), None)
    assert (v.path, v.next_token, v.bonus) == (path, token, bonus)


def test_sampled_walk_emits_the_targets_own_draws():
    """Each emitted token is a draw from the target's distribution at its position, whatever the
    tree: the first one is distributed as p at the root, and a seeded walk reproduces plain
    sampling's first draw."""
    torch.manual_seed(0)
    logits = torch.randn(len(TREE) + 1, 32) * 2
    logits[0, 10] += 2.0  # make node a likely, so walks often go down
    params = SamplingParams(temperature=1.0)
    want = dense_probs(logits[0:1], params)[0]
    first = collections.Counter()
    noise = Noise(1)
    draws = 20000
    for t in range(draws):
        v = verify_tree(TREE, logits, params, noise, position=t)
        first[TREE.tokens[v.path[0]].item() if v.path else v.next_token] += 1
    got = torch.tensor([first[t] / draws for t in range(32)])
    assert 0.5 * (got - want).abs().sum() < 0.02
    for seed in range(5):
        v = verify_tree(TREE, logits, params, Noise(seed), position=9)
        plain = sample_row(logits[0], params, Noise(seed), 9)
        assert (TREE.tokens[v.path[0]].item() if v.path else v.next_token) == plain
