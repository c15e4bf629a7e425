"""The streaming speculative-decoding engine.

    engine = Engine(target, drafters={"ngram": NgramDrafter()})
    for event in engine.stream(prompt_ids, settings.request(["ngram"], draft_len=4)):
        ...  # TokenEvent as tokens are decided, StepRecord per step, GenerationStats last

One step = one target forward over [last token] + k drafts, then `sampling.verify`. With
speculation off (or when the drafter has nothing to propose) k = 0 and the very same code path
is plain decoding. A drafter may propose a tree instead (`tree.DraftTree`, the head does): the
forward then reads every node under a tree attention mask, `tree.verify_tree` walks the path the
target agrees with, and the cache keeps that path. The target's forwards, cache and features
go through its runner (core/runner.py): transformers' own, or the CUDA runtime's.

The target's KV cache lives across steps and across requests: after each
verification it is cropped to the accepted context, and a new request re-encodes only what its
prompt does not share with the cached tokens (a chat's history is encoded once).

Invariant between steps: the cache holds every context token but the newest one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from specchat.core.drafter import NO_DRAFT, Draft, Drafter, common_prefix_len
from specchat.core.events import (
    ACCEPTED,
    BONUS,
    RESAMPLED,
    TARGET,
    GenerationStats,
    StepRecord,
    TokenEvent,
    summarize,
)
from specchat.core.evidence import StepResult, explain
from specchat.core.history import History
from specchat.core.penalties import Shaper
from specchat.core.policy import DraftLengthPolicy
from specchat.core.prefix import PREFIX_CACHE_TOKENS, PrefixStore
from specchat.core.request import GenerateConfig
from specchat.core.sampling import DRAW, Noise, SamplingParams, blocked, verify
from specchat.core.text import (
    ReplyText,
    chat_prompt,
    has_chat_template,
    non_text_ids,
    raw_prompt,
    tokens_until_stop,
)
from specchat.core.tree import DraftTree, TreeVerdict, verify_tree

# The longest prompt a request may bring by default, in tokens: what a 2-core CPU encodes in
# about 10 s on the embedded target, so one request cannot hold the engine for minutes.
MAX_PROMPT_TOKENS = 4096
TEXTS_KEPT = 65536  # tokens' texts the inspector's evidence keeps (`Engine._token_text`)


class Verified(NamedTuple):
    """What one verify forward decided (`Engine._verify_chain`, `_verify_tree`)."""
    path: list[int]  # the accepted drafts' indices (a chain's 0..n-1, a tree's nodes)
    next_token: int  # the target's own token after them
    bonus: bool  # every draft on the path passed
    refused: int | None  # the draft token refused at the decisive position
    p: float | None  # the target's and the draft's probability of `refused` (sampled chains)
    q: float | None
    rows: torch.Tensor  # the logits of the rows that emitted tokens, after the penalties


@dataclass
class _Request:
    """What the steps of one reply share."""
    cfg: GenerateConfig
    drafter: Drafter | None  # None: speculation off
    params: SamplingParams
    shaper: Shaper | None  # the penalties, None when off
    noise: Noise
    stats: GenerationStats
    policy: DraftLengthPolicy | None
    trees: bool  # the drafter drafts trees for this reply
    max_new: int
    reply: ReplyText
    context: list[int]  # prompt + reply so far
    wants: list = field(default_factory=list)  # drafters that read the target's features
    generated: int = 0  # reply tokens decided so far (EOS aside)
    start: float = 0.0  # perf_counter at the request's start
    # `context` as int64 (`context_ids`): the penalties read it every step; past its end, room
    # for a step's drafts (`sequence`). Torch tensors (a native call takes their data_ptr), with
    # numpy views for slices and memoryviews for the element writes (a numpy element write
    # costs several times more right after a forward, with the CPU's caches cold).
    _ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    _ids_np: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    _ids_mv: memoryview = field(default_factory=lambda: memoryview(b""))
    _converted: int = 0  # tokens of `context` already in _ids
    # whether each token of _ids holds a DRY breaker (`sequence`); _flagged of them are known
    _breaks: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.uint8))
    _breaks_mv: memoryview = field(default_factory=lambda: memoryview(b""))
    _flagged: int = 0

    def context_ids(self) -> np.ndarray:
        """`context` as an int64 array. The context only grows (`Engine._emit` appends), so
        only the tokens added since the last call are converted, not the whole context at
        every step."""
        self._convert()
        return self._ids_np[:len(self.context)]

    def _convert(self) -> None:
        n, done = len(self.context), self._converted
        if n > done:
            self._room(n)
            context = self.context
            if n - done > 8:  # a prompt: one conversion of the slice
                self._ids_np[done:n] = context[done:n]
            else:  # a step's few tokens: element writes (no list-to-array conversion)
                ids = self._ids_mv
                for i in range(done, n):
                    ids[i] = context[i]
            self._converted = n

    def sequence(self, drafted: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The context and then `drafted`, as int64 tokens and uint8 flags (1: the token's text
        holds one of DRY's sequence breakers; all 0 without DRY), at the start of the request's
        own buffers (which run on past them), valid until the next call."""
        n, k = len(self.context), len(drafted)
        self._convert()
        if k:
            self._room(n + k)
            ids = self._ids_mv
            for i, token in enumerate(drafted):
                ids[n + i] = token
        shaper = self.shaper
        if shaper is not None and shaper.dry:
            breaker, flags, context = shaper.is_breaker, self._breaks_mv, self.context
            for i in range(self._flagged, n):
                flags[i] = breaker(context[i])
            self._flagged = n
            for i, token in enumerate(drafted):
                flags[n + i] = breaker(token)
        return self._ids, self._breaks

    def _room(self, size: int) -> None:
        if size <= len(self._ids_np):
            return
        grown = max(2 * len(self._ids_np), size, 256)
        ids, breaks = torch.zeros(grown, dtype=torch.int64), torch.zeros(grown, dtype=torch.uint8)
        ids[:self._converted] = self._ids[:self._converted]
        breaks[:self._flagged] = self._breaks[:self._flagged]
        self._ids, self._breaks, self._ids_np = ids, breaks, ids.numpy()
        self._ids_mv, self._breaks_mv = memoryview(self._ids_np), memoryview(breaks.numpy())


class Engine:
    def __init__(self, target, drafters: dict[str, Drafter] | None = None,
                 prefix_tokens: int = PREFIX_CACHE_TOKENS,
                 max_prompt_tokens: int | None = None):
        self.target = target  # models.LoadedModel (model, tokenizer, device, ...)
        self.model = target.model
        self.tokenizer = target.tokenizer
        self._texts: dict[int, str] = {}  # token -> its text alone (`_token_text`)
        self.device = target.device
        self.drafters: dict[str, Drafter] = dict(drafters or {})
        self.vocab_size = len(self.tokenizer)
        self.eos_ids = target.eos_ids
        # Tokens a reply never holds (control and media tokens, and logits rows past the
        # tokenizer's vocabulary): masked in every target distribution, plain and speculative
        # alike, so the mask changes what is sampled but never whether speculation is lossless.
        self.non_text = torch.tensor(non_text_ids(self.tokenizer, self.eos_ids), dtype=torch.long)
        self._non_text_set = frozenset(self.non_text.tolist())
        self._mask_key, self._mask_ids, self._mask_runs = None, self.non_text, []
        self.lock = threading.Lock()  # one generation at a time on one model
        self._breakers: dict = {}  # DRY's breakers -> {token: whether its text holds one}
        self._policies: dict[tuple[str, bool], DraftLengthPolicy] = {}
        self._cache = None
        self._cache_ids: list[int] = []  # tokens whose keys/values are in self._cache
        # Prompts are encoded in whole pages of `page` tokens, then in narrower forwards
        # (`_prefill`); the cache's first _wide_end tokens were encoded as whole pages.
        self.page = target.narrow_rows + 1
        self._wide_end = 0
        # Whole pages of earlier prompts, for prompts that start the same way (core/prefix.py).
        self.prefixes = PrefixStore(prefix_tokens, self.page)
        # Each owner's earlier prompts and replies, for the drafters that copy text.
        self.history = History()
        # The longest prompt a request may bring, counted in tokens after the chat format (the
        # page, the API and the CLI alike); None: the model's context window alone.
        self.max_prompt_tokens = max_prompt_tokens
        # What runs the target's forwards (core/runner.py): its cache, rollback, trees and
        # features. The model runtime proved at load whether verify logits equal one-token
        # logits bit for bit (models.LoadedModel.row_exact).
        self.runner = target.runner
        self.row_exact = target.row_exact
        self.gives_logprobs = True  # GenerateConfig.logprobs is honoured
        self.trees_ok = self.runner.tree_masks
        # The runner's native sampler (`shape_pick`), for the new float32 CPU logits it hands
        # over each forward (`owned_logits`); None: the Python sampler.
        self._native_sampler = self.runner.shape_pick if self.runner.owned_logits else None
        self._row_evidence = self.runner.row_evidence if self.runner.owned_logits else None

    @property
    def greedy_trees(self) -> tuple[str, ...]:
        """The drafters whose greedy replies draft trees unless a request gives tree_nodes
        (`core.settings.build_config`): those that prefer trees where they run, if the target
        takes tree masks at all."""
        if not self.trees_ok:
            return ()
        return tuple(name for name, d in self.drafters.items()
                     if d.supports_trees and d.prefers_trees)

    # -- prompts ------------------------------------------------------------------------------
    # What `stream` continues, built the same way for a remote engine (backends/remote.py).

    @property
    def chats(self) -> bool:
        """The target has a chat format (a base model has none: it continues text)."""
        return has_chat_template(self.tokenizer)

    def chat_prompt(self, messages: list[dict]) -> tuple[list[int], tuple[str, ...]]:
        """Messages -> (prompt ids in the target's chat format, its stop strings)."""
        return chat_prompt(self.tokenizer, messages)

    def text_prompt(self, text: str) -> tuple[list[int], tuple[str, ...]]:
        """Plain text for the target to continue (no chat format, no stop strings)."""
        return raw_prompt(self.tokenizer, text), ()

    # -- target forward -------------------------------------------------------------------

    def _forward(self, ids: list[int], n_logits: int) -> torch.Tensor:
        """Feed `ids` after the cached tokens; return the last n_logits rows [n, vocab]
        (on the model's device and dtype: sampling moves them to CPU only when it needs them).
        The runner enters autograd's inference mode where it needs it: a decorator here would
        cost a step tens of microseconds, with the CPU's caches cold after a forward."""
        logits = self.runner.forward(self._cache, ids, len(self._cache_ids), n_logits)
        self._cache_ids.extend(ids)
        # (no slice where there is nothing to cut: each torch call counts, with cold caches)
        return logits if logits.shape[-1] == self.vocab_size else logits[:, :self.vocab_size]

    def _forward_tree(self, ids: list[int], parents: list[int]) -> torch.Tensor:
        """Feed the root ids[0] and a draft tree ids[1:] (node i a child of parents[i], -1 the
        root) after the cached tokens, with a tree attention mask. Returns logits [len(ids),
        vocab]."""
        logits = self.runner.forward_tree(self._cache, ids, parents, len(self._cache_ids))
        self._cache_ids.extend(ids)
        return logits if logits.shape[-1] == self.vocab_size else logits[:, :self.vocab_size]

    def _prefill(self, prompt_ids: list[int], wants: list,
                 stop_event: threading.Event | None = None) -> tuple[torch.Tensor | None, int]:
        """Encode the prompt, reusing what the cache holds of it. Returns the logits of the last
        prompt position [1, vocab] (None when `stop_event` was set between two forwards: the
        cache keeps what was encoded) and the tokens encoded.

        Every request encodes its prompt the same way, whatever ran before, so its logits and
        reply are the same: whole pages of `page` tokens (from position 0) in one forward
        each, wide products; the rest, and every token decoding adds, in forwards of fewer rows,
        which compute each row exactly as a one-token step does. A cached token is reused only
        where this prompt would have computed it the same way (`_reusable`)."""
        wide_end = len(prompt_ids) // self.page * self.page
        keep = self._reusable(prompt_ids, wide_end)
        if self._cache is None or not self.runner.crop(self._cache, len(self._cache_ids), keep):
            self._cache, keep = self.runner.new_cache(), 0
        self._cache_ids = self._cache_ids[:keep]
        self._wide_end = min(self._wide_end, keep)
        stored, n = self.prefixes.longest(prompt_ids, min(wide_end, len(prompt_ids) - 1))
        if n > keep:  # more whole pages in the prefix store than in the cache
            self._cache = self.runner.new_cache()
            features = self.prefixes.restore(stored, n, self._cache)
            self._cache_ids, self._wide_end, keep = list(prompt_ids[:n]), n, n
            if features is not None:  # the drafters' features as a fresh encoding gives them
                for d in wants:
                    d.observe(0, prompt_ids[:n], features)
        logits, at = None, keep
        pages = {}  # page start -> the features of a whole page encoded here
        while at < len(prompt_ids):
            if stop_event is not None and stop_event.is_set():
                logits = None
                break
            end = at + self.page if at < wide_end else min(len(prompt_ids), at + self.page - 1)
            # the last forward's logits only: a page's LM head row before it is read by none
            # (one row of the embedded target's head costs about half a plain step)
            logits = self._forward(prompt_ids[at:end], 1 if end == len(prompt_ids) else 0)
            features = self._observe(wants, at, prompt_ids[at:end])
            if features is not None and end - at == self.page:
                pages[at] = features
            at = end
            self._wide_end = min(at, wide_end)
        self.prefixes.add(prompt_ids, self._cache, self._wide_end, pages)
        return logits, at - keep

    def _reusable(self, prompt_ids: list[int], wide_end: int) -> int:
        """How many cached tokens `prompt_ids` can keep: the common prefix (the last prompt
        token is always fed, for its logits), cut where this prompt's encoding would differ
        from the cache's: within whole pages only at a page boundary, and never past a page
        that one of the two computed whole and the other row by row."""
        common = min(common_prefix_len(self._cache_ids, prompt_ids), len(prompt_ids) - 1)
        both_wide = min(self._wide_end, wide_end)
        if common <= both_wide:
            return common // self.page * self.page
        return common if self._wide_end == wide_end else both_wide

    def _feature_drafters(self) -> list:
        """Drafters that draft from the target's features (the EAGLE heads). They get them for
        free: the runner keeps each forward's final-norm output, or the hidden states entering
        the decoder layers an EAGLE-3 head reads (`Runner.layer_features`)."""
        wants = list({id(d.observer): d.observer for d in self.drafters.values()
                      if d.needs_features}.values())
        kinds = {d.feature_layers for d in wants}
        if len(kinds) > 1:  # one forward's features are of one kind (the prefix store's too)
            raise ValueError(f"drafters read different features of the target: {kinds}")
        if wants:
            layers = kinds.pop()
            if layers is not None and not self.runner.layer_features:
                raise ValueError(f"{type(self.runner).__name__} gives no decoder layer's "
                                 f"hidden states (a head reads layers {layers})")
            self.runner.watch_features(layers)
        return wants

    def _observe(self, wants: list, start: int, ids: list[int],
                 rows: list[int] | None = None) -> torch.Tensor | None:
        """Positions `rows` of the latest forward (default: its first len(ids)) were accepted,
        tokens `ids` at context positions start.. . Sent whichever drafter is active, so
        switching drafters costs nothing. -> their features, None where no drafter reads them."""
        if not wants:
            return None
        features = self.runner.features(len(ids), rows)  # [len(ids), d]
        for d in wants:
            d.observe(start, ids, features)
        return features

    @property
    def context_window(self) -> int | None:
        """The most tokens (prompt + reply) the target reads: its position embeddings."""
        window, held = self.target.positions, self.runner.context  # (a static cache's slots)
        return min(w for w in (window, held) if w) if window or held else None

    def reset_cache(self) -> None:
        self._cache, self._cache_ids, self._wide_end = None, [], 0

    def policy(self, drafter: str, greedy: bool) -> DraftLengthPolicy:
        return self._policies.setdefault((drafter, greedy), DraftLengthPolicy())

    # -- one step ---------------------------------------------------------------------------

    def _verify_chain(self, run: _Request, draft: Draft) -> Verified:
        """Verify a chain of drafts in one forward; crop the rejected ones from the cache."""
        context, k = run.context, len(draft)
        drafted = draft.tokens.tolist() if k else []
        logits = self._forward([context[-1], *drafted], k + 1)
        # row i continues the context and drafts 0..i-1
        logits, picks = self._chain_distribution(run, logits, drafted, draft.probs is None)
        # a refused one-hot draft's p is the inspector's alone: `explain` computes it with the
        # row's top candidates, in one native call where the runner has one
        v = verify(draft.tokens, draft.probs, logits, run.params, run.noise, len(context), picks,
                   refused_p=False)
        n = v.n_accepted
        # Every token but the newest is in the cache: drop the rejected drafts.
        if n < k:
            self.runner.crop(self._cache, len(self._cache_ids), len(self._cache_ids) - (k - n))
            del self._cache_ids[len(self._cache_ids) - (k - n):]
        self._observe(run.wants, len(context) - 1, [context[-1], *drafted[:n]])
        refused = drafted[n] if n < k else None
        rows = logits if n == k else logits[:n + 1]
        return Verified(list(range(n)), v.next_token, v.bonus, refused, v.p, v.q, rows)

    def _verify_tree(self, run: _Request, draft: Draft) -> Verified:
        """Verify a draft tree in one forward and keep the accepted path in the cache."""
        context, tree = run.context, draft.tree
        ids = [context[-1], *tree.tokens.tolist()]
        logits = self._forward_tree(ids, tree.parents)
        spine = _spine(tree.parents)
        if spine and self._native_sampler is not None and logits.dtype == torch.float32 \
                and logits.is_contiguous() and self._native_mode(run, logits) is not None:
            v = self._verify_spine(run, logits, tree, spine)
        else:
            # a node's row continues the context and the node's path
            logits = self._distribution(run, logits, context, tree.paths())
            v = verify_tree(tree, logits, run.params, run.noise, len(context))
        keep = [0] + [1 + i for i in v.path]  # the root and the accepted path
        self.runner.keep_fed(self._cache, len(ids), len(self._cache_ids) - len(ids), keep)
        self._cache_ids = self._cache_ids[:-len(ids)] + [ids[j] for j in keep]
        self._observe(run.wants, len(context) - 1, [ids[j] for j in keep], keep)
        refused = int(tree.tokens[v.refused[0]]) if v.refused else None
        # the kept rows: a view where they lead the forward's rows (a path down the chain), a
        # copy of a few 262k-wide rows (a tenth of a millisecond and more) only past a leaf
        rows = logits[:len(keep)] if keep[-1] == len(keep) - 1 else logits[keep]
        return Verified(list(v.path), v.next_token, v.bonus, refused, None, None, rows)

    def _verify_spine(self, run: _Request, logits: torch.Tensor, tree: DraftTree,
                      spine: int) -> TreeVerdict:
        """`verify_tree` for a chain of nodes 0..spine-1 with leaves beside it (the head's
        `_fan`), on the native sampler: the chain's rows shaped and drawn in one call, a leaf's
        row only where the walk reaches it. The draws `verify_tree` makes on `_distribution`'s
        rows, and those rows, where the walk goes."""
        tokens = tree.tokens.tolist()
        chain = tokens[:spine]
        _, picks = self._chain_distribution(run, logits[:spine + 1], chain, True)
        children: dict[int, dict[int, int]] = {}
        for i, (token, parent) in enumerate(zip(tokens, tree.parents)):
            children.setdefault(parent, {})[token] = i
        node, path = -1, []
        while True:
            if node < spine:  # the root or the chain: row node + 1 is drawn already
                y = picks[node + 1]
            else:  # a leaf beside chain node len(path) - 2: its row continues its own path
                leaf = logits[node + 1:node + 2]
                y = self._chain_distribution(run, leaf, chain[:len(path) - 1] + [tokens[node]],
                                             True, first=len(path))[1][0]
            kids = children.get(node)
            if not kids or y not in kids:
                return TreeVerdict(path, y, bonus=not kids, refused=list((kids or {}).values()))
            node = kids[y]
            path.append(node)

    def _distribution(self, run: _Request, logits: torch.Tensor, context: list[int],
                      extras: list[list[int]]) -> torch.Tensor:
        """The target's logits [n, width] -> the logits its tokens are drawn from: non-text
        tokens masked, then the request's penalties, row r for the prefix context + extras[r].
        Every token of a reply, plain or speculative, is drawn from these."""
        # The engine's own copy of the rows (on the CPU where penalties apply), then every change
        # in place: a pass over 262k logits costs as much as the penalties themselves, and more
        # right after a forward, with cold caches. A runner that hands over new float32 CPU
        # logits each call (`owned_logits`) needs no copy at all.
        if self.runner.owned_logits:
            out = logits
        else:
            out = logits.to(device="cpu" if run.shaper else logits.device, dtype=torch.float32,
                            copy=True)
        self._mask_(out)
        if run.shaper:
            run.shaper.shape_(out, run.context_ids() if context is run.context else context,
                              extras)
        return out

    def _chain_distribution(self, run: _Request, logits: torch.Tensor, drafted: list[int],
                            pick: bool, first: int = 0) -> tuple[torch.Tensor, list[int] | None]:
        """`_distribution` for a chain's rows (row i continues the context and drafts
        0..first+i-1; plain decoding's one row), and with `pick` each row's draw where the
        runner's native sampler makes it: (logits, the draws or None). The native sampler does
        the mask, the penalties and the draw in one call, to the bits of the Python
        definitions."""
        sampler = self._native_sampler
        if sampler is None or logits.dtype != torch.float32 or not logits.is_contiguous():
            extras = [drafted[:i] for i in range(first, len(drafted) + 1)]
            return self._distribution(run, logits, run.context, extras), None
        mode, params = self._native_mode(run, logits) if pick else None, run.params
        n, rows = len(run.context), len(drafted) + 1 - first
        seq, breaks = run.sequence(drafted)
        at = [n + first + i for i in range(rows)]  # each row's prefix length: its position
        keys = [run.noise.keys(i, DRAW) for i in at] if mode == "min_p" else None
        picks = sampler(logits, self._mask_runs_for(logits), seq, breaks, at,
                        run.shaper.penalties if run.shaper else None, mode, params.temperature,
                        params.min_p, keys)
        return logits, picks

    @staticmethod
    def _native_mode(run: _Request, logits: torch.Tensor) -> str | None:
        """The draw the native sampler makes for this request: "greedy", "min_p" (min-p alone
        over rows it takes in blocks), or None (it shapes the rows, Python draws)."""
        params = run.params
        if params.greedy:
            return "greedy"
        if params.top_p >= 1.0 and not 0 < params.top_k < logits.shape[-1] \
                and params.min_p > 0 and blocked(logits):
            return "min_p"
        return None

    def _mask_(self, logits: torch.Tensor) -> None:
        """Mask, in place, what no reply holds: the non-text tokens, and the rows past the
        tokenizer's vocabulary (no tokens at all). They lie in a few runs of consecutive ids
        (Gemma 3's 6,250 in three): on the CPU each run is one slice of a numpy view, cheaper
        than a gather of every id, above all right after a forward, with cold caches."""
        runs = self._mask_runs_for(logits)
        if logits.device.type == "cpu" and len(runs) <= _FEW_RUNS:
            values = logits.numpy()
            for start, end in runs:
                values[..., start:end] = -np.inf
        else:
            logits.index_fill_(-1, self._mask_ids, -torch.inf)

    def _mask_runs_for(self, logits: torch.Tensor) -> list[tuple[int, int]]:
        """The [start, end) runs of ids to mask in these logits. Learned on the first logits
        of a width: then a run that ends the row (Gemma 3's image ids) may be left to the
        runner, which from the next forward on hands those logits over as -inf without
        computing them (`skip_logits_from`); these first logits still need it."""
        key = (logits.shape[-1], logits.is_cpu)  # (one runner, one device besides the CPU)
        if self._mask_key == key:
            return self._mask_runs
        past = torch.arange(self.vocab_size, logits.shape[-1], dtype=torch.long)
        ids = torch.cat([self.non_text, past])
        self._mask_ids, self._mask_runs = ids.to(logits.device), _runs(ids.tolist())
        runs = self._mask_runs  # all of them in these logits
        tail = self._mask_runs[-1] if self._mask_runs else None
        if tail and tail[1] == logits.shape[-1] and self.runner.skip_logits_from(tail[0]):
            self._mask_runs = self._mask_runs[:-1]
        self._mask_key = key
        return runs

    def _draft(self, run: _Request) -> tuple[Draft, object, int]:
        """Ask the drafter for this step's proposal. -> (draft, its class, the k allowed)."""
        drafter, cfg = run.drafter, run.cfg
        if drafter is None:
            return Draft.empty(), None, 0
        drafter.last_top = []
        cls = drafter.draft_class(run.context)
        k = run.policy.choose(cfg.draft_len, cls) if cfg.adaptive else cfg.draft_len
        k = min(k, run.max_new - run.generated - 1)  # never past max_new_tokens (+1: the target's)
        k = min(k, self.page - 2)  # a verify feeds k + 1 rows, fewer than a page: row-exact
        if k <= 0:
            return Draft.empty(), cls, 0
        if run.trees:
            nodes = min(cfg.tree_nodes, self.page - 2)
            tree = drafter.propose_tree(run.context, k, run.params, nodes, run.noise)
            if isinstance(tree, DraftTree):
                tree = tree.without(self._non_text_set)
                tree = tree if len(tree) else (NO_DRAFT, None)
            else:
                tree = _text_only(tree, self._non_text_set)
            return Draft(tree), cls, k
        proposal = _text_only(drafter.propose(run.context, k, run.params, run.noise),
                              self._non_text_set)
        return Draft(_until_stop(self.tokenizer, run.context, proposal, cfg.stop)), cls, k

    def _step(self, run: _Request) -> StepResult:
        """Draft, then verify in one target forward (the cache keeps what was accepted)."""
        t0 = time.perf_counter()
        draft, cls, allowed = self._draft(run)
        t1 = time.perf_counter()
        verify_ = self._verify_tree if draft.tree is not None else self._verify_chain
        v = verify_(run, draft)
        return StepResult(draft=draft, accepted=[int(draft.tokens[i]) for i in v.path],
                          path=v.path, next_token=v.next_token, bonus=v.bonus,
                          refused=v.refused, p=v.p, q=v.q, rows=v.rows, allowed=allowed,
                          cls=cls, draft_s=t1 - t0, verify_s=time.perf_counter() - t1)

    def _record(self, run: _Request, step: StepResult, number: int
                ) -> tuple[list[tuple], StepRecord]:
        """The step's tokens (token, kind, logprob, top alternatives) and its record; the
        drafter and the k policy hear how it went."""
        k, n = len(step.draft), len(step.accepted)
        levels = step.draft.levels
        run.stats.target_calls += 1
        record = StepRecord(number, k, n, n + 1, step.draft_s, step.verify_s,
                            levels if step.draft.tree is not None else 0)
        if run.drafter:
            explain(step, record, run.params, run.stats.samplers, run.drafter.last_top,
                    self._token_text, run.drafter.vocabulary, self._row_evidence)
            if run.cfg.adaptive:
                record.alpha = run.policy.alpha(step.cls)
                plain = run.policy.expected_rate(0, step.cls)
                record.expected_gain = (run.policy.expected_rate(step.allowed, step.cls) / plain
                                        if plain else None)
            run.drafter.feedback(k, n)
            # A tree counts as its depth: one draft forward and one test per level.
            run.policy.update(k + 1, step.verify_s, levels, n, step.draft_s, step.cls,
                              asked=step.allowed > 0)
        last_kind = TARGET if k == 0 else (BONUS if step.bonus else RESAMPLED)
        tokens = [(t, ACCEPTED) for t in step.accepted] + [(step.next_token, last_kind)]
        return self._with_logprobs(run, step.rows, tokens), record

    @staticmethod
    def _with_logprobs(run: _Request, rows: torch.Tensor, tokens: list[tuple[int, str]]
                       ) -> list[tuple]:
        """(token, kind) -> (token, kind, logprob, top) when the request asks for them."""
        if run.cfg.logprobs is None:
            return [(t, kind, None, None) for t, kind in tokens]
        found = token_logprobs(rows, [t for t, _ in tokens], run.cfg.logprobs)
        return [(t, kind, lp, top) for (t, kind), (lp, top) in zip(tokens, found)]

    def _token_text(self, token: int) -> str:
        """A token's text alone, as the inspector shows it (about 9 a speculative step, each
        a tokenizer call: kept once made, up to TEXTS_KEPT of them)."""
        text = self._texts.get(token)
        if text is None:
            if len(self._texts) >= TEXTS_KEPT:
                self._texts.clear()
            text = self._texts[token] = self.tokenizer.decode([token])
        return text

    # -- the decode loop ------------------------------------------------------------------

    def _request(self, prompt_ids: list[int], cfg: GenerateConfig) -> _Request:
        """Check a request and set up what its steps share."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if self.max_prompt_tokens and len(prompt_ids) > self.max_prompt_tokens:
            raise ValueError(f"the prompt is {len(prompt_ids):,} tokens in the model's format; "
                             f"specchat takes at most {self.max_prompt_tokens:,} "
                             "(--max-input-tokens): shorten it")
        window = self.context_window
        if window and len(prompt_ids) >= window:
            raise ValueError(f"the prompt is {len(prompt_ids):,} tokens; {self.target.name} reads "
                             f"at most {window:,} (prompt and reply together): shorten it")
        max_new = min(cfg.max_new_tokens, window - len(prompt_ids)) if window \
            else cfg.max_new_tokens
        drafter = self.drafters.get(cfg.drafter) if cfg.speculation else None
        if cfg.speculation and drafter is None:
            raise ValueError(f"unknown drafter {cfg.drafter!r}; available: "
                             f"{', '.join(self.drafters) or 'none'}")
        params = cfg.sampling
        seed = cfg.seed if cfg.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        stats = GenerationStats.for_config(cfg, drafter is not None,
                                           drafter.name if drafter else "none",
                                           prompt_tokens=len(prompt_ids))
        stats.seed = seed
        trees = bool(drafter and cfg.tree_nodes and self.trees_ok and drafter.supports_trees)
        stats.tree_nodes = cfg.tree_nodes if trees else 0
        policy = self.policy(stats.drafter + "+tree" * trees, params.greedy) if drafter else None
        # Noise: the draw at reply position t depends on (seed, t) alone.
        shaper = Shaper.build(cfg.penalties, self.tokenizer, self._breakers)
        return _Request(cfg, drafter, params, shaper,
                        Noise(seed), stats, policy, trees, max_new,
                        ReplyText(self.tokenizer, prompt_ids, cfg.stop), list(prompt_ids))

    def _emit(self, run: _Request, tokens: list[tuple], record: StepRecord
              ) -> Iterator[TokenEvent]:
        """Emit a step's tokens one by one, watching for the end: EOS, a stop string, the token
        limit. Sets `run.stats.stop_reason` when the reply ends."""
        stats = run.stats
        for token, kind, logprob, top in tokens:
            run.context.append(token)
            if token in self.eos_ids:
                stats.stop_reason = "eos"
                return
            run.generated += 1
            event = TokenEvent(token, "", kind, record.step, record.drafted, record.accepted,
                               logprob, top)
            released, hit = run.reply.push(event)
            for ev in released:
                stats.ttft_s = stats.ttft_s or time.perf_counter() - run.start
                stats.new_tokens += 1  # tokens shown: a stop string's are not
                yield ev
            if hit:
                stats.stop_reason = "stop_string"
                return
            if run.generated >= run.max_new:
                stats.stop_reason = "length"
                return

    def _first(self, run: _Request, prompt_ids: list[int],
               stop_event: threading.Event | None) -> tuple[list[tuple], StepRecord] | None:
        """Encode the prompt (what the cache does not hold) and draw the first token; None
        when `stop_event` was set while the prompt was being encoded."""
        stats = run.stats
        logits, stats.prefill_tokens = self._prefill(prompt_ids, run.wants, stop_event)
        if logits is None:
            return None
        logits, picks = self._chain_distribution(run, logits, [], True)  # the prompt, so far
        stats.target_calls = 1
        first = verify(NO_DRAFT, None, logits, run.params, run.noise, len(prompt_ids), picks)
        record = StepRecord(0, 0, 0, 1, 0.0, time.perf_counter() - run.start)
        if run.drafter:
            run.drafter.use_penalties(run.shaper)
            run.drafter.stop_early(run.cfg.adaptive)
            owner = run.cfg.owner
            run.drafter.use_history(
                (lambda context, k: self.history.lookup(owner, context, k)) if owner else None)
            run.drafter.begin(prompt_ids)
        return self._with_logprobs(run, logits, [(first.next_token, TARGET)]), record

    def stream(self, prompt_ids: list[int], cfg: GenerateConfig,
               stop_event: threading.Event | None = None,
               ) -> Iterator[TokenEvent | StepRecord | GenerationStats]:
        """Generate a reply: TokenEvents as tokens are decided, a StepRecord after each step's
        tokens, the GenerationStats last."""
        run = self._request(prompt_ids, cfg)
        stats, steps = run.stats, []
        with self.lock:
            run.start = time.perf_counter()
            run.wants = self._feature_drafters()
            try:
                first = self._first(run, prompt_ids, stop_event)
                if first is None:
                    stats.stop_reason = "stopped"
                tokens, record = first or ([], None)
                while first is not None:
                    yield from self._emit(run, tokens, record)
                    if record.step:
                        steps.append(record)
                        yield record
                    if stats.stop_reason:
                        break
                    if stop_event is not None and stop_event.is_set():
                        stats.stop_reason = "stopped"
                        break
                    tokens, record = self._record(run, self._step(run), record.step + 1)
                if stats.stop_reason != "stop_string":
                    for ev in run.reply.finish(at_limit=stats.stop_reason == "length"):
                        stats.ttft_s = stats.ttft_s or time.perf_counter() - run.start
                        stats.new_tokens += 1
                        yield ev
            except torch.OutOfMemoryError as e:
                self.reset_cache()
                self.prefixes.clear()  # memory for the next request
                stats.stop_reason, stats.error = "error", f"out of memory: {e}"
            except Exception:  # (not GeneratorExit: at a yield the cache is consistent)
                self.reset_cache()  # a half-done step leaves the cache unknown: start clean
                raise
            stats.seconds = time.perf_counter() - run.start
            if cfg.owner and cfg.remember and stats.stop_reason != "error":
                said = run.context[:-1] if stats.stop_reason == "eos" else run.context
                self.history.add(cfg.owner, said)
        vocabulary = run.drafter.vocabulary if run.drafter else None
        stats.draft_head = run.drafter.head_label if run.drafter else None
        reply = run.context[len(prompt_ids):]
        if vocabulary is not None and reply:
            stats.draft_vocab = len(vocabulary)
            stats.draft_vocab_coverage = sum(t in vocabulary for t in reply) / len(reply)
        yield summarize(steps, stats)


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int
                   ) -> list[tuple[float, list[tuple[int, float]]]]:
    """For rows [n, vocab] of the target's logits after the penalties (before temperature and
    truncation: the model's own view, as OpenAI's logprobs are) and the token each row emitted:
    (its log-probability, the `top` likeliest [(id, logprob)]) per token."""
    logp = torch.log_softmax(rows.float(), -1)
    out = []
    for r, token in enumerate(tokens):
        values, ids = torch.topk(logp[r], top) if top else (torch.zeros(0), torch.zeros(0))
        out.append((float(logp[r, token]), list(zip(ids.tolist(), values.tolist()))))
    return out


def _until_stop(tokenizer, context, draft, stops):
    """A chain draft without the tokens after a stop string (they could never be shown)."""
    draft_ids, draft_probs = draft
    if not stops or len(draft_ids) < 2:
        return draft
    keep = tokens_until_stop(tokenizer, context, draft_ids.tolist(), stops)
    if keep == len(draft_ids):
        return draft
    return draft_ids[:keep], (draft_probs[:keep] if draft_probs is not None else None)


def _spine(parents: list[int]) -> int:
    """m where a tree's nodes 0..m-1 are a chain from the root (each the child of the one
    before) and every other node is a leaf beside it; 0 for any other tree."""
    m = 0
    while m < len(parents) and parents[m] == m - 1:
        m += 1
    return m if all(p < m for p in parents) else 0


def _text_only(draft, non_text: frozenset[int]):
    """A chain draft up to its first non-text token (the target would never accept it)."""
    draft_ids, draft_probs = draft
    for i, token in enumerate(draft_ids.tolist()):
        if token in non_text:
            return draft_ids[:i], (draft_probs[:i] if draft_probs is not None else None)
    return draft


_FEW_RUNS = 16  # runs of masked ids `Engine._mask_` fills as slices (more: one gather)


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """ids -> the [start, end) runs of consecutive ones, in order."""
    runs: list[tuple[int, int]] = []
    for i in sorted(set(ids)):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
