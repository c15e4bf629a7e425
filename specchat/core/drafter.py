"""The drafter contract: whatever proposes the next few tokens for the target to verify.

The engine speaks only to this base class, so it never knows whether drafts come from a model,
from n-gram lookup or from a trained head. A drafter overrides `propose`; everything else has a
default that does nothing.

    begin(prompt_ids)                      a new request starts from this context
    use_penalties(shaper)                  the request's penalties (core/penalties.Shaper, or
                                           None), for drafters with logits: drafting from the
                                           distribution the target's draw will use makes a
                                           draft likelier to pass; the test stays exact
    use_history(lookup)                    what the request's owner said before
                                           (core/history.History.lookup bound to the owner,
                                           or None): for drafters that copy text
    stop_early(on)                         whether `propose` may stop short of k where the
                                           drafter judges further drafts unlikely to pass (the
                                           head's confidence bar); off when the request fixes
                                           k (GenerateConfig.adaptive False), before `begin`
    propose(context, k, params, noise) -> (draft_ids [k'], draft_probs [k', vocab] | None)
                                           k' <= k; None probs mean one-hot drafts (the target's
                                           own draw decides). Draft i is for reply position
                                           len(context) + i: a drafter that samples uses
                                           `noise` at that position (sampling.Noise).
    feedback(n_drafted, n_accepted)        called after each verification
    draft_class(context)                   names the kind of proposal coming next (the n-gram
                                           match length) so the engine sizes k per kind
    supports_trees / propose_tree(context, depth, params, nodes, noise) -> DraftTree or a chain
                                           a draft tree verified in one forward (the head);
                                           prefers_trees: greedy replies draft trees by default
    needs_features / observe(start, ids, features)
                                           the target's hidden states of accepted positions,
                                           for drafters that read them (the EAGLE head):
                                           the final norm's output, or with `feature_layers`
                                           those entering these decoder layers (EAGLE-3)
    vocabulary                             the token ids it can draft (a trained head's reduced
                                           vocabulary), None for any; shown by the inspector
    head_label                             the draft head it drafts with, by kind (EAGLE-1
                                           or EAGLE-3), None without one; shown by the
                                           inspector
    last_top                               after `propose`: per draft position, the drafter's
                                           most likely tokens [(id, prob)], where it has a
                                           distribution (a draft model, the head); shown by
                                           the inspector, never used by the test

`context` is the full token list so far (prompt + emitted reply); it only grows within a request.

Inference mode: the engine calls a drafter outside autograd's inference mode, as it calls the
runner. A drafter enters the mode itself in every method that makes or writes the tensors it
keeps (`propose`, `propose_tree`, the head's storing of observed features), so a tensor it made
under the mode is never written outside it, whatever the runner (`tests/test_every_runner.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from specchat.core.sampling import Noise, SamplingParams
from specchat.core.tree import DraftTree

# An empty proposal: the step is a plain target step.
NO_DRAFT = torch.zeros(0, dtype=torch.long)

Chain = tuple[torch.Tensor, "torch.Tensor | None"]


class Drafter:
    name: str = ""
    # The drafter wants `observe` calls with the target's features (a hook on its final norm).
    needs_features: bool = False
    # Which features: None, the final norm's output; (i, j, ...), the hidden states entering
    # those decoder layers, concatenated (an EAGLE-3 head's; `Runner.layer_features`).
    feature_layers: tuple[int, ...] | None = None
    # The drafter implements `propose_tree`.
    supports_trees: bool = False
    # Its greedy replies draft trees unless a request says otherwise (`Engine.greedy_trees`):
    # where its trees were measured faster than its chains.
    prefers_trees: bool = False
    # Set by `propose` where the drafter has a distribution: per draft position, its
    # [(id, prob)] (or an iterable of them computed when read).
    last_top: list[Iterable[tuple[int, float]]] = []

    vocabulary: frozenset[int] | None = None  # the tokens it can draft (None: any)
    head_label: str | None = None  # the draft head it drafts with (None: none)

    def begin(self, prompt_ids: list[int]) -> None:
        """A new request starts from `prompt_ids`."""

    def use_penalties(self, shaper) -> None:
        """The request's penalties (a `Shaper`, or None when off), before `begin`."""

    def use_history(self, lookup) -> None:
        """`lookup(context, k) -> (n, tokens)` over the request's owner's past prompts and
        replies (`History.lookup`), or None, before `begin`."""

    def stop_early(self, on: bool) -> None:
        """Whether `propose` may return fewer than k drafts by its own judgement, before
        `begin`."""

    def propose(self, context: list[int], k: int, params: SamplingParams,
                noise: Noise | None) -> Chain:
        raise NotImplementedError

    def propose_tree(self, context: list[int], depth: int, params: SamplingParams, nodes: int,
                     noise: Noise | None = None):
        """A `tree.DraftTree` of at most `nodes` nodes and `depth` levels, or a chain as
        `propose` returns it (the engine verifies either); `noise` as `propose` takes it."""
        raise NotImplementedError(f"{type(self).__name__} drafts no trees")

    def draft_class(self, context: list[int]) -> object:
        """The kind of the next proposal; the engine keeps acceptance (and so k) per kind."""
        return None

    def observe(self, start: int, token_ids: list[int], features: torch.Tensor) -> None:
        """The target's features [n, d] of accepted context positions start..start+n-1."""

    @property
    def observer(self) -> "Drafter":
        """The drafter whose `observe` does the work: a drafter that passes the features on to
        another (the combined drafter to its head) names that one, so that the engine sends
        each forward's features once, however many drafters share it."""
        return self

    def feedback(self, n_drafted: int, n_accepted: int) -> None:
        """Called after each verification."""


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    # Fast path: the usual case is "b extends a" or "differs only near the end".
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search for the first difference on prefix equality
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Draft:
    """What one step verifies, whatever the drafter returned: a chain of tokens (with the q
    they were sampled from, or None for one-hot drafts) or a draft tree. A chain's token i
    follows token i - 1; a tree's node i follows its parent."""

    def __init__(self, proposal: Chain | DraftTree):
        if isinstance(proposal, DraftTree):
            self.tree, self.tokens, self.probs = proposal, proposal.tokens, None
        else:
            self.tree, (self.tokens, self.probs) = None, proposal
        self.size = len(self.tokens)  # (asked at every step: one tensor call, here)

    @classmethod
    def empty(cls) -> Draft:
        """No draft: plain decoding's step (one instance: a draft is never changed)."""
        return _EMPTY

    def __len__(self) -> int:
        return self.size

    @property
    def levels(self) -> int:
        """Draft positions one verify decides: a tree's depth, a chain's length."""
        return self.tree.depth if self.tree is not None else self.size


_EMPTY = Draft((NO_DRAFT, None))


# -- the registry: every drafter specchat can load (specchat/drafters/, one file each) -----

@dataclass(frozen=True)
class DrafterInfo:
    name: str  # the key in Engine.drafters, GenerateConfig.drafter and `--drafter`
    label: str  # what the page's drafter menu shows
    needs: str  # what must be loaded for it to exist


# Best first, by `python -m specchat bench` on the embedded target: a real draft model, then
# n-gram lookup with the trained head behind it, lookup alone, the head alone.
REGISTRY = (
    DrafterInfo("model", "Draft model", "a draft model sharing the target's vocabulary"),
    DrafterInfo("combined", "N-gram + head", "a draft head trained for the target"),
    DrafterInfo("ngram", "N-gram lookup (prompt)", "nothing"),
    DrafterInfo("head", "Draft head (EAGLE)", "a draft head trained for the target"),
    DrafterInfo("server", "The server's own", "a --backend server that speculates"),
)
NAMES = tuple(info.name for info in REGISTRY)
LABELS = {info.name: info.label for info in REGISTRY}


def preferred(available) -> str:
    """The drafter to use when none is asked for: the best of `available` names."""
    available = list(available)
    return next((name for name in NAMES if name in available), available[0] if available
                else "ngram")
