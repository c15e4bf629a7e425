"""What the inspector shows of a speculative step, built from the step's result: the proposal,
the path kept, the policy's reasons for k, and the test at the decisive position.

The engine calls `explain` once per speculative step; it costs one top-k and one logsumexp over
the decisive row of logits (one native call where the runner has one, `Runner.row_top`: about
0.2 ms a step on the embedded target, cheap beside a forward) and never touches the cache or
the random numbers, so what the page shows cannot change what is generated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specchat.core.drafter import Draft
from specchat.core.events import TOP, Candidate, Evidence, StepRecord
from specchat.core.sampling import SamplingParams, prob_of, top_candidates


@dataclass
class StepResult:
    """One draft-and-verify step, as decided."""
    draft: Draft
    accepted: list[int]  # the draft tokens kept, in order
    path: list[int]  # their indices in the draft (a chain's 0..n-1, a tree's nodes)
    next_token: int  # the target's own token after them
    bonus: bool  # every draft on the path passed
    refused: int | None  # the draft token refused at the decisive position (None: none was)
    p: float | None  # the target's and the draft's probability of `refused`, as the test used
    q: float | None  # them (sampled chains; None otherwise)
    rows: torch.Tensor  # [n + 1, vocab] the logits that emitted the accepted drafts and the
    # next token, after the penalties; the last is the decisive position's
    allowed: int  # the k the policy allowed
    cls: object  # the drafter's class of this proposal (draft_class)
    draft_s: float
    verify_s: float

    @property
    def row(self) -> torch.Tensor:
        return self.rows[-1]


def explain(step: StepResult, record: StepRecord, params: SamplingParams, samplers: list[str],
            drafter_top: list, text: Callable[[int], str],
            vocabulary: frozenset[int] | None = None,
            row_top: Callable | None = None) -> None:
    """Fill `record`'s inspector fields from the step (`vocabulary`: the drafter's, if it
    drafts from a reduced one; `row_top`: the runner's own, for its float32 rows)."""
    draft = step.draft
    ids = draft.tokens.tolist()
    record.proposal, record.proposal_text = ids, [text(t) for t in ids]
    record.k = step.allowed
    record.path = list(step.path)
    if draft.tree is not None:
        record.parents = list(draft.tree.parents)
    if not ids:
        return
    position, refused = len(step.path), step.refused
    # the drafter's rows follow its chain: a tree's path that left it (a fan's leaf) has none
    on_chain = draft.tree is None or step.path == list(range(position))
    top, p_refused = top_candidates(step.row, params, TOP, refused, row_top)
    if refused is None:
        p = q = None
    elif params.greedy:
        p, q = p_refused, None
    elif draft.tree is not None or draft.probs is None:  # one-hot: passes with its p
        p, q = step.p if step.p is not None else prob_of(step.row, params, refused), 1.0
    else:
        p, q = step.p, step.q
    record.evidence = Evidence(
        position, step.next_token, text(step.next_token), refused,
        text(refused) if refused is not None else "", p, q,
        min(1.0, p / q) if q and p is not None else None, params.greedy,
        [Candidate(i, text(i), pr) for i, pr in top],
        [Candidate(i, text(i), pr) for i, pr in drafter_top[position]]
        if position < len(drafter_top) and on_chain else [], samplers,
        None if vocabulary is None else step.next_token in vocabulary)
