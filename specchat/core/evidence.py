"""What the inspector shows of a speculative step, built from the step's result: the proposal,
the path kept, the policy's reasons for k, and the test at the decisive position.

The engine calls `explain` once per speculative step; it costs one top-k and one logsumexp over
the decisive row of logits (one native call where the runner has one, `Runner.row_evidence`,
which also gives a refused token's probability under min-p: about 0.15 ms a step on the
embedded target, cheap beside a forward) and never touches the cache or
the random numbers, so what the page shows cannot change what is generated.
"""

from __future__ import annotations

import math
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
            row_evidence: Callable | None = None) -> None:
    """Fill `record`'s inspector fields from the step (`vocabulary`: the drafter's, if it
    drafts from a reduced one; `row_evidence`: the runner's own, for its float32 rows)."""
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
    top, p_refused, p_sampled = _decisive(step.row, params, refused, row_evidence)
    if refused is None:
        p = q = None
    elif params.greedy:
        p, q = p_refused, None
    elif draft.tree is not None or draft.probs is None:  # one-hot: passes with its p
        if step.p is not None:
            p = step.p
        else:
            p = p_sampled if p_sampled is not None else prob_of(step.row, params, refused)
        q = 1.0
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


def _decisive(row: torch.Tensor, params: SamplingParams, refused: int | None,
              native: Callable | None) -> tuple[list[tuple[int, float]], float | None,
                                                 float | None]:
    """The decisive row's TOP likeliest tokens and their probabilities at the sampling
    temperature (1 when greedy), the refused token's probability there, and its probability
    under the request's sampling where one native call gives it (min-p or no truncation: the
    runner's `row_evidence`), else None."""
    if native is None or row.dtype is not torch.float32 or row.device.type != "cpu" \
            or row.dim() != 1 or not row.is_contiguous():
        top, p_refused = top_candidates(row, params, TOP, refused)
        return top, p_refused, None
    t = params.temperature if params.temperature > 0 else 1.0
    min_p = params.min_p if params.min_p > 0 and not params.greedy else 0.0
    ids, values, lse, p_refused, p_kept = native(row, TOP, t, min_p, refused)
    untruncated = params.top_p >= 1.0 and not 0 < params.top_k < row.shape[-1]
    return ([(i, math.exp(v - lse)) for i, v in zip(ids, values)], p_refused,
            p_kept if untruncated else None)
