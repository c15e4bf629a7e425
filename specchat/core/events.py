"""What the engine emits while it decodes: tokens, per-step records, and one final summary.

These are plain dataclasses with no torch or gradio in them, so the UI, the CLI, the bench
and the stats store can all consume them without touching model code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# How a token was produced (docs/design.md, "Token kinds").
ACCEPTED = "accepted"  # proposed by the draft, accepted by verification
RESAMPLED = "resampled"  # target's token after it rejected a draft, drawn from (p - q)+
BONUS = "bonus"  # target's token after every draft of the step passed, drawn from p_{k+1}
TARGET = "target"  # target's token in a step with no draft
KINDS = (ACCEPTED, RESAMPLED, BONUS, TARGET)
# A token from a remote serving engine that reports speculation per reply, not per token
# (backends/remote.py): the one kind specchat's own engine never emits.
SERVED = "served"


@dataclass
class TokenEvent:
    id: int  # token id in the target's vocabulary
    text: str  # text this token adds to the reply ("" while a multi-byte char is incomplete)
    kind: str  # one of KINDS (SERVED from some remote servers)
    step: int  # verification step (target forward) that decided it, from 1
    step_drafted: int  # draft tokens proposed in that step
    step_accepted: int  # draft tokens accepted in that step
    # With GenerateConfig.logprobs: the token's log-probability under the target and the
    # likeliest alternatives [(id, logprob)] (engine.token_logprobs says which distribution).
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None

    def to_json(self) -> dict:
        out = {"type": "token", "id": self.id, "text": self.text, "kind": self.kind,
               "step": self.step, "step_drafted": self.step_drafted,
               "step_accepted": self.step_accepted}
        if self.logprob is not None:
            out.update(logprob=self.logprob, top_logprobs=self.top_logprobs)
        return out


TOP = 5  # candidates shown per distribution in a step's evidence


@dataclass
class Candidate:
    id: int
    text: str
    prob: float


@dataclass
class Evidence:
    """The test that ended a speculative step, at its decisive draft position.

    `p` and `q` are the probabilities the verification used: the target's and the draft's for
    the refused token (q = 1 for one-hot drafts: n-gram lookup, the head, trees, which pass
    with probability p). Greedy decoding tests "draft == the target's argmax" instead; there
    `p` is the target's probability at temperature 1, for information, and `accept_prob` None.
    """
    position: int  # draft position decided, from 0 (== the drafts tested when all passed)
    token: int  # what the target emitted there
    token_text: str
    rejected: int | None = None  # the draft token refused there (None: every draft passed)
    rejected_text: str = ""
    p: float | None = None
    q: float | None = None
    accept_prob: float | None = None  # min(1, p / q)
    greedy: bool = True
    target_top: list[Candidate] = field(default_factory=list)  # at the decisive position
    draft_top: list[Candidate] = field(default_factory=list)  # where the drafter has a q
    samplers: list[str] = field(default_factory=list)  # what shaped target_top, in order
    # The target's token is one the drafter can draft (its vocabulary); None: it drafts any.
    in_draft_vocab: bool | None = None


@dataclass
class StepRecord:
    step: int  # from 1
    drafted: int  # draft tokens proposed (0: plain target step)
    accepted: int  # of those, accepted
    emitted: int  # tokens this step added to the reply (accepted + 1, fewer at a stop)
    draft_s: float  # seconds spent proposing
    verify_s: float  # seconds in the target forward + acceptance test
    tree_depth: int = 0  # a draft tree's levels (0: the drafts were a chain)
    proposal: list[int] = field(default_factory=list)  # drafted ids: the chain, or tree nodes
    proposal_text: list[str] = field(default_factory=list)
    parents: list[int] | None = None  # a tree's node parents (-1: the root); None: a chain
    path: list[int] = field(default_factory=list)  # proposal indices accepted, in order
    k: int = 0  # the most drafts the policy allowed this step (adaptive k)
    alpha: float | None = None  # the policy's acceptance estimate behind that choice
    expected_gain: float | None = None  # its expected tokens/s at k over plain decoding's
    evidence: Evidence | None = None  # None: a plain step, or a step cut short by a stop

    def to_json(self) -> dict:
        return {"type": "step", **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> StepRecord:
        """The inverse of `to_json` (a stored step, reopened by the Stats tab)."""
        data = {k: v for k, v in data.items() if k != "type" and k in cls.__dataclass_fields__}
        evidence = data.get("evidence")
        if evidence:
            evidence = dict(evidence)
            for key in ("target_top", "draft_top"):
                evidence[key] = [Candidate(**c) for c in evidence.get(key) or []]
            data["evidence"] = Evidence(**evidence)
        return cls(**data)

    @property
    def levels(self) -> int:
        """Draft positions tested in a row: a chain's length, a tree's depth (a tree of n
        nodes and depth d tests at most d drafts along its path, and costs d draft forwards)."""
        return self.tree_depth or self.drafted


@dataclass
class GenerationStats:
    new_tokens: int = 0
    seconds: float = 0.0  # wall time from request to last token
    ttft_s: float = 0.0  # time to first token (includes prefill)
    prefill_tokens: int = 0  # prompt tokens actually encoded (the rest came from the prefix cache)
    prompt_tokens: int = 0
    tokens_per_s: float = 0.0  # new_tokens / seconds
    target_calls: int = 0  # target forward passes, prefill included
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # steps that ended with a rejected draft
    acceptance_rate: float = 0.0  # accepted / drafted
    alpha: float = 0.0  # accepted / (accepted + rejections): per-position acceptance estimate
    mean_accepted_len: float = 0.0  # tokens emitted per speculative step (accepted + 1)
    speculation: bool = False
    drafter: str = "none"
    draft_len: int = 0  # the k asked for (the adaptive k may run lower)
    tree_nodes: int = 0  # the most tokens of a draft tree (0: drafts were chains)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    samplers: list[str] = field(default_factory=list)  # what shaped the distribution, in order
    seed: int | None = None
    draft_s: float = 0.0
    verify_s: float = 0.0
    accepted_by_position: list[int] = field(default_factory=list)  # [k] accepted at draft pos i
    drafted_by_position: list[int] = field(default_factory=list)  # [k] proposed at draft pos i
    stop_reason: str = ""  # eos | stop_string | length | stopped | error
    error: str = ""
    # A drafter with a reduced vocabulary (a trained head): its size, and the share of the
    # reply's tokens within it (the rest no draft could have matched). None otherwise.
    draft_vocab: int | None = None
    draft_vocab_coverage: float | None = None
    # The draft head behind the drafter, by kind ("EAGLE-3 draft head"); None for drafters
    # without one.
    draft_head: str | None = None

    @classmethod
    def for_config(cls, cfg, speculation: bool | None = None, drafter: str | None = None,
                   **fields) -> GenerationStats:
        """The stats of a reply to `cfg` (an engine.GenerateConfig), before any token: the
        settings it records. `speculation`/`drafter` override what the config asked for with
        what runs it (None: as asked)."""
        speculation = cfg.speculation if speculation is None else speculation
        drafter = drafter if drafter is not None else (cfg.drafter if speculation else "none")
        return cls(speculation=speculation, drafter=drafter,
                   draft_len=cfg.draft_len if speculation else 0, temperature=cfg.temperature,
                   top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p, samplers=cfg.samplers(),
                   seed=cfg.seed, **fields)

    def to_json(self) -> dict:
        return {"type": "stats", **asdict(self)}


def summarize(steps: list[StepRecord], stats: GenerationStats) -> GenerationStats:
    """Fill the derived numbers of `stats` from the step records (pure arithmetic)."""
    spec_steps = [s for s in steps if s.drafted > 0]
    stats.drafted = sum(s.drafted for s in spec_steps)
    stats.accepted = sum(s.accepted for s in spec_steps)
    stats.rejections = sum(1 for s in spec_steps if s.accepted < s.levels)
    stats.acceptance_rate = stats.accepted / stats.drafted if stats.drafted else 0.0
    tested = stats.accepted + stats.rejections
    stats.alpha = stats.accepted / tested if tested else 0.0
    stats.mean_accepted_len = (
        sum(s.accepted + 1 for s in spec_steps) / len(spec_steps) if spec_steps else 0.0)
    stats.draft_s = sum(s.draft_s for s in steps)
    stats.verify_s = sum(s.verify_s for s in steps)
    width = max((s.levels for s in spec_steps), default=0)
    stats.drafted_by_position = [sum(1 for s in spec_steps if s.levels > i) for i in range(width)]
    stats.accepted_by_position = [sum(1 for s in spec_steps if s.accepted > i) for i in range(width)]
    stats.tokens_per_s = stats.new_tokens / stats.seconds if stats.seconds > 0 else 0.0
    return stats


@dataclass
class Reply:
    """A whole reply's events, collected (`collect`): for callers that need them at the end
    rather than as they stream."""
    tokens: list[TokenEvent] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    stats: GenerationStats | None = None

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    @property
    def ids(self) -> list[int]:
        return [t.id for t in self.tokens]


def collect(events) -> Reply:
    """Sort a stream's events (an engine's `stream`) into one Reply."""
    reply = Reply()
    for event in events:
        if isinstance(event, TokenEvent):
            reply.tokens.append(event)
        elif isinstance(event, StepRecord):
            reply.steps.append(event)
        elif isinstance(event, GenerationStats):
            reply.stats = event
    return reply
