"""N-gram lookup where it has a good match, the trained head elsewhere."""

from __future__ import annotations

from specchat.core.drafter import Drafter
from specchat.drafters.head import HeadDrafter
from specchat.drafters.ngram import NgramDrafter


class CombinedDrafter(Drafter):
    """Prompt lookup when it finds a continuation of a match of at least `min_match` tokens, the
    head otherwise: a shorter match is a weaker guess than the head's. In real use a 2-token
    match's drafts passed less often than the head's (combined 1.02x against the head's 1.09x;
    with 3, 1.03x against 1.03-1.04x), and on looping text 3 lost nothing (2.79x against
    2.46x): docs/performance.md."""

    name = "combined"
    needs_features = True
    supports_trees = True

    def __init__(self, ngram: NgramDrafter, head: HeadDrafter, min_match: int = 3,
                 history_match: int = 3):
        self.ngram, self.head, self.min_match = ngram, head, min_match
        self.history_match = history_match  # the same for a match in the owner's history

    @property
    def head_label(self) -> str:
        return self.head.head_label

    def use_penalties(self, shaper):
        self.head.use_penalties(shaper)

    def stop_early(self, on):
        self.head.stop_early(on)

    def use_history(self, lookup):
        self.ngram.use_history(lookup)

    def begin(self, prompt_ids):
        self.ngram.begin(prompt_ids)
        self.head.begin(prompt_ids)

    def observe(self, start, token_ids, features):
        self.head.observe(start, token_ids, features)

    @property
    def observer(self):
        return self.head

    def draft_class(self, context):
        """The n-gram match length when lookup will draft, else "head". A match in the owner's
        history ("history-<n>", looked up where the conversation has none of 2 tokens) drafts
        from `history_match` tokens on."""
        n = self.ngram.draft_class(context)
        if isinstance(n, str):
            return n if int(n.rsplit("-", 1)[1]) >= self.history_match else "head"
        return n if n >= self.min_match else "head"

    def propose(self, context, k, params, noise):
        if self.draft_class(context) != "head":
            self.last_top = []
            return self.ngram.propose(context, k, params, noise)
        draft = self.head.propose(context, k, params, noise)
        self.last_top = self.head.last_top
        return draft

    @property
    def prefers_trees(self) -> bool:
        """Greedy trees where the head's are fans (`HeadDrafter._fan`): EAGLE-2's trees lost to
        chains here."""
        return self.head.chains_in_c

    def propose_tree(self, context, depth, params, nodes, noise=None):
        if self.draft_class(context) != "head":
            self.last_top = []
            return self.ngram.propose(context, depth, params, noise)
        tree = self.head.propose_tree(context, depth, params, nodes, noise)
        self.last_top = self.head.last_top
        return tree

    def feedback(self, n_drafted, n_accepted):
        self.ngram.feedback(n_drafted, n_accepted)
        self.head.feedback(n_drafted, n_accepted)
