"""The request: what one reply is asked to be, frozen once built.

A `GenerateConfig` is built and checked in one place, `core.settings.build_config` (the page,
the API, the CLI and the bench) or `core.settings.request` (requests made in code: the checks,
the page's warm-up, a server probe); a front end that adds to one (the owner, `remember`) makes
a copy with `dataclasses.replace`.
"""

from __future__ import annotations

from dataclasses import dataclass

from specchat.core.penalties import DRY_BREAKERS, Penalties
from specchat.core.sampling import SamplingParams

# Draft-tree size for the head in the app and the CLI (`GenerateConfig.tree_nodes`).
TREE_NODES = 10


def default_tree_nodes(temperature: float, drafter: str = "head",
                       greedy_trees: tuple[str, ...] = ("head",)) -> int:
    """Trees for a drafter of `greedy_trees` when greedy, chains otherwise. The engine names
    the drafters whose trees pay where they run (`Engine.greedy_trees`): in the bench
    (docs/performance.md) the head's greedy trees beat its chains where each of its drafts is a
    torch forward; where its chain is one C call, that chain with leaves beside it
    (`HeadDrafter._fan`) beats the chain, greedy, for `head` and `combined`; sampled replies
    gained nothing from either kind of tree."""
    return TREE_NODES if temperature <= 0 and drafter in greedy_trees else 0


@dataclass(frozen=True)
class GenerateConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # Penalties on what the text so far repeats (core/penalties.py); the defaults are off.
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[str, ...] = DRY_BREAKERS
    seed: int | None = 0  # None: a fresh random seed per request
    speculation: bool = True  # False: plain decoding, same code path with k = 0
    drafter: str = "ngram"  # key into Engine.drafters
    # k: the most draft tokens per step. The policy picks each step's k up to it; 8 lets
    # lookup's drafts run on where text repeats (docs/performance.md, "The longest draft").
    draft_len: int = 8
    adaptive: bool = True  # let k follow measured acceptance and cost (never above draft_len)
    # Drafters that can (the head) draft a tree of up to this many tokens, k levels deep,
    # verified in one forward (tree.py). 0: chains.
    tree_nodes: int = 0
    stop: tuple[str, ...] = ()  # stop strings (not included in the reply)
    # Each token's log-probability and this many alternatives (`token_logprobs`); None: off.
    logprobs: int | None = None
    # Whose request this is (the page's visitor, the API key's owner; "" for nobody): drafters
    # that copy text may draft from this owner's earlier prompts and replies (core/history.py),
    # never from another's. `remember`: keep this prompt and reply there.
    owner: str = ""
    remember: bool = True

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.min_p)

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.repeat_penalty, self.repeat_last_n, self.frequency_penalty,
                         self.presence_penalty, self.dry_multiplier, self.dry_base,
                         self.dry_allowed_length, tuple(self.dry_sequence_breakers))

    def samplers(self) -> list[str]:
        """The samplers that shape this request's distribution, in the order they apply."""
        p = self.sampling
        out = self.penalties.names()
        if p.greedy:
            return out
        out.append(f"temperature {p.temperature:g}")
        if p.top_k > 0:
            out.append(f"top-k {p.top_k}")
        if p.top_p < 1:
            out.append(f"top-p {p.top_p:g}")
        if p.min_p > 0:
            out.append(f"min-p {p.min_p:g}")
        return out
