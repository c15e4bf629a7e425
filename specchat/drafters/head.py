"""The EAGLE head as a drafter: chains and trees drafted from the target's own features, with
specchat's EAGLE-1-style head (`models.eagle.DraftHead`) or a public EAGLE-3 head
(`models.eagle3.Eagle3Head`): both take (features, embeddings, positions, cache) and return
their next features and reduced-vocabulary logits."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from specchat import kernels
from specchat.core.drafter import NO_DRAFT, Drafter, common_prefix_len
from specchat.core.events import TOP
from specchat.core.sampling import (
    DRAW,
    SamplingParams,
    min_p_place,
    nucleus,
    race,
    top_candidates,
)
from specchat.core.tree import DraftTree
from specchat.models.eagle import DraftHead, extended_pair, target_features
from specchat.models.runtime import cpu_kind
from specchat.runners.cpu.embedding import c_embedding

# Observed features kept before they are stored (`HeadDrafter.observe`)
PENDING_FEATURES = 32


class _TopLater:
    """A draft position's most likely tokens [(id, prob)] (`Drafter.last_top`), computed when
    first read: the inspector reads one position a step (the first refused), while a top-k
    over the head's row at every draft, right after the target's forward, cost about 0.3 ms.
    `rows`, `r`: the head's reduced-vocabulary logits there, row r of a tensor nothing writes
    to later (taken from it only when read); `vocab`: a place -> its token id (a list); `lib`:
    the kernels the head runs on, or None."""

    def __init__(self, rows: torch.Tensor, r: int, params: SamplingParams, vocab: list[int],
                 lib=None):
        self._args, self._top = (rows, r, params, vocab, lib), None

    def __iter__(self):
        if self._top is None:
            rows, r, params, vocab, lib = self._args
            # the kernels' own top and log-sum-exp where the head runs on them: a tenth of
            # torch's topk and logsumexp, which cost about 0.4 ms right after a forward
            native = (lambda x, n: kernels.row_top(lib, x, n)) if lib is not None else None
            top, _ = top_candidates(rows[r], params, TOP, native=native)
            self._top, self._args = [(vocab[j], q) for j, q in top], None
        return iter(self._top)


# -- the drafter -------------------------------------------------------------------------------


class HeadDrafter(Drafter):
    """Drafts with a DraftHead or an Eagle3Head. Keeps the target's features of the
    conversation (from `observe`, or computed itself when missing) and the head's own KV
    cache, both synced with the context by common prefix, like ModelDrafter's cache.

    Head position t reads (f_t, x_{t+1}); with context x_0..x_{L-1} the target has computed
    f_0..f_{L-2} (its cache holds every token but the newest), so the head's last true position
    is L-2 and predicts f_{L-1} and the first draft x_L. (An EAGLE-3 head's f_t is three layers'
    hidden states, and what it feeds forward at a draft is its own hidden state, not a
    prediction of the target's.)
    """

    name = "head"
    needs_features = True
    supports_trees = True

    def __init__(self, head: DraftHead, target_model, vocab_size: int, min_gain: float = 0.0,
                 tree_width: int = 4, tree_beam: int = 4,
                 tree_min_score: float = 0.2, wide_bf16: bool | None = None, lib=None,
                 fan_width: int = 3, fan_min_score: float = 0.1):
        self.head = head.eval()
        self.feature_layers = head.feature_layers  # the target features it reads
        self.vocabulary = frozenset(head.vocab_ids.tolist())  # it drafts only these tokens
        self._vocab_list = head.vocab_ids.tolist()  # a place in it -> the token id
        self._vocab_ids = head.vocab_ids.to("cpu", torch.int64).contiguous()
        self._lib = None  # the kernels its drafts' penalties run on (CPU), or None: Python's
        if head.vocab_ids.device.type == "cpu":
            # Wide drafting forwards through bf16 copies (`Int8Drafting`): by the CPU's own
            # flags unless forced (tests run both on any CPU). `lib`: the kernels the target's
            # runtime runs on (`Runtime.kernels`); a target on torch's own products leaves the
            # head the default build.
            wide = cpu_kind().native_bf16 if wide_bf16 is None else wide_bf16
            self._lib = lib or kernels.load()
            head.quantize_for_drafting(wide_bf16=wide, lib=self._lib)
        # The shape of draft trees (`propose_tree`): children per node, nodes expanded a level,
        # the least score (the head's chance of acceptance) a node needs.
        self.tree_width, self.tree_beam = tree_width, tree_beam
        self.tree_min_score = tree_min_score
        # Where the chain runs in C, a tree is that chain with leaves beside its drafts
        # (`_fan`): at each draft, up to `fan_width` of the head's next likeliest tokens whose
        # chance of passing (the head's probability of the path to them) is at least
        # `fan_min_score`.
        self.fan_width, self.fan_min_score = fan_width, fan_min_score
        self.target = target_model
        self.embed = head.embedder(target_model)
        # its lookup in one C call where that gives the module's bits (Gemma 3's table)
        self._c_embed = c_embedding(self._lib, self.embed, head.feature_width) \
            if self._lib is not None and head.vocab_ids.device.type == "cpu" else None
        self._c_embed_at = self._c_embed.table.data_ptr() if self._c_embed is not None else 0
        # the C chain's inputs (`_chain_inputs`): its tokens, their embeddings, positions 0..
        self._chain_ids = np.zeros(0, dtype=np.int64)
        self._chain_ids_view, self._chain_ids_at = memoryview(self._chain_ids), 0
        self._chain_embeds = torch.empty(0, head.feature_width)
        self._positions = torch.arange(0)
        self.vocab_size = vocab_size  # width of the engine's target logits (and our q rows)
        # Stop drafting once the head's own estimate that this draft and every one before it
        # pass (the product of their probabilities under the head) falls below min_gain: a draft
        # that will almost surely be rejected still costs a head step and a wider verify. The
        # head's probabilities track acceptance (EAGLE-2; measured in docs/performance.md, "The
        # head's stopping rules").
        self.min_gain = min_gain
        self.early = True  # stop_early: False drafts all k (a fixed-k request)
        # And do not even run the head for the next draft once the product is under twice
        # min_gain: that draft would need a probability of at least 1/2 to be kept, and the
        # forward is usually spent for nothing (docs/performance.md, "The head's stopping
        # rules").
        self.lookahead = 2.0
        self.device = head.vocab_ids.device
        self.tokens: list[int] = []  # context tokens whose features are in self.feats[:len]
        self.feats = torch.zeros(0, head.feature_width, device=self.device)  # [capacity, width]
        self._pending: list[tuple[int, torch.Tensor]] = []  # observed, not yet in self.feats
        self.cache = None  # head KV cache over positions 0..len(head_tokens)-2
        self.head_tokens: list[int] = []  # the tokens that cache was built from
        self.computed = 0  # features the drafter had to compute itself (no observe)
        self.coupled = True  # sampled drafts verified one-hot (see _sample); False: with q
        # The request's penalties (repetition, DRY, ...), applied to the head's logits at each
        # draft position from that draft's own prefix, as the target's draw will apply them:
        # a penalty that moves the target's choice moves the draft's too.
        self.shaper = None
        self._index: torch.Tensor | None = None  # token id -> its place in the reduced vocabulary
        # The context's tokens and DRY breaker flags as the native penalties read them, kept
        # across proposals (a context grows by a few tokens a step): the tokens they hold
        # (a list, to compare), and the buffers, with room for a draft's own tokens after them
        self._pen_tokens: list[int] = []
        self._pen_seq = torch.zeros(0, dtype=torch.int64)
        self._pen_flags = torch.zeros(0, dtype=torch.uint8)
        self._breaks_by: dict[tuple[str, ...], torch.Tensor] = {}  # `_vocab_breaks`
        # a greedy chain in one C call (`_propose_chain`) where the head's step runs in C and
        # the target's embedding is looked up there too
        self.native_chain = True

    @property
    def chains_in_c(self) -> bool:
        """Greedy (and min-p drawn) chains run in one C call (`_propose_chain`): the head's step
        runs in C and the target's embedding is looked up there too."""
        return self.native_chain and self._c_embed is not None \
            and getattr(self.head, "_step", None) is not None and self.device.type == "cpu"

    # Greedy trees by default: where each draft is a torch forward, EAGLE-2's trees; where the
    # chain runs in one C call, that chain with leaves (`_fan`), a chain's cost and a few
    # verify rows more (docs/performance.md, "Leaves beside the chain").
    prefers_trees = True

    @property
    def label(self) -> str:
        """What the page calls this head: its kind, and where an EAGLE-3 head came from."""
        if self.feature_layers is None:
            return "draft head (EAGLE, trained for this target)"
        source = getattr(self, "source", None)
        return f"draft head (EAGLE-3{': ' + source if source else ''})"

    @property
    def head_label(self) -> str:
        """The head's kind alone (its source stays on the page's header, where a shared demo
        redacts it)."""
        return "EAGLE-1 draft head" if self.feature_layers is None else "EAGLE-3 draft head"

    def use_penalties(self, shaper):
        self.shaper = shaper
        self._pen_tokens = []  # the breakers are the request's: flags written anew
        if shaper is not None and shaper.penalties.dry and self._lib is not None:
            # made now, with the request (tens of milliseconds the first time for a set of
            # breakers): inside a proposal the draft-length policy would price drafts by them
            self._vocab_breaks()

    def stop_early(self, on):
        self.early = on

    def _penalized(self, rows: torch.Tensor, context: list[int],
                   extras: list[list[int]]) -> torch.Tensor:
        """Reduced-vocabulary logits [R, N] -> the same with the request's penalties, row r
        for the prefix context + extras[r]."""
        self._places()
        out = rows.clone() if rows.dtype is torch.float32 and rows.is_cpu else rows.float().cpu()
        if self._lib is not None:  # one native call a row: 0.07 ms a draft against 0.13-0.16
            n = self._sync_prefix(context, max(len(extra) for extra in extras))
            for r, extra in enumerate(extras):
                m = n + len(extra)  # the draft's own tokens after the context's
                self._pen_seq[n:m] = torch.tensor(extra, dtype=torch.int64)
                self._pen_flags[n:m] = torch.tensor(list(self._breaks_of(extra)),
                                                    dtype=torch.uint8)
                kernels.shape_reduced(self._lib, out[r], self._index, self._pen_seq[:m],
                                      self._pen_flags[:m], self.shaper.penalties)
            return out.to(rows.device)
        base = np.asarray(context, dtype=np.int64)
        for r, extra in enumerate(extras):
            prefix = np.concatenate([base, np.asarray(extra, dtype=np.int64)]) if extra else base
            self.shaper.shape_row(out[r], prefix, self._index)
        return out.to(rows.device)

    def _places(self) -> torch.Tensor:
        """token id -> its place in the reduced vocabulary (-1: none), made once."""
        if self._index is None:
            ids = self.head.vocab_ids.cpu()
            self._index = torch.full((max(self.vocab_size, int(ids.max()) + 1),), -1,
                                     dtype=torch.long)
            self._index[ids] = torch.arange(len(ids))
        return self._index

    def _vocab_breaks(self) -> torch.Tensor:
        """Whether each place's token holds one of the request's DRY breakers (uint8), kept per
        set of breakers: a chain's drafts flag their own tokens in C."""
        key = self.shaper.penalties.dry_sequence_breakers
        flags = self._breaks_by.get(key)
        if flags is None:
            flags = self._breaks_by[key] = torch.tensor(
                list(self._breaks_of(self._vocab_list)), dtype=torch.uint8)
        return flags

    def _sync_prefix(self, context: list[int], room: int) -> int:
        """Make the first len(context) places of self._pen_seq and self._pen_flags the
        context's tokens and DRY breaker flags, with `room` places after them; only what
        changed since the last call is written. Returns len(context)."""
        keep = common_prefix_len(self._pen_tokens, context)
        added = context[keep:]
        del self._pen_tokens[keep:]
        self._pen_tokens.extend(added)
        need = len(context) + room
        if need > self._pen_seq.shape[0]:  # grown: every place written anew
            size = max(need, 2 * self._pen_seq.shape[0], 256)
            self._pen_seq = torch.zeros(size, dtype=torch.int64)
            self._pen_flags = torch.zeros(size, dtype=torch.uint8)
            keep, added = 0, context
        if added:  # through numpy: a torch call per write costs tens of microseconds here
            self._pen_seq.numpy()[keep:len(context)] = added
            self._pen_flags.numpy()[keep:len(context)] = np.frombuffer(self._breaks_of(added),
                                                                       dtype=np.uint8)
        return len(context)

    def _breaks_of(self, tokens: list[int]) -> bytes:
        """Whether each token's text holds a DRY breaker (all 0 with DRY off: no detokenizing)."""
        if not self.shaper.penalties.dry:
            return bytes(len(tokens))
        return bytes(self.shaper.is_breaker(t) for t in tokens)

    @torch.inference_mode()
    def begin(self, prompt_ids):
        """Catch up over the prompt now, right after its prefill: a cost of the request, like the
        prefill, not of its first draft, which would otherwise price every draft of the reply
        by the prompt's length (the draft-length policy measures drafts per token). Features
        and cache survive across requests, so a chat's history is not run again."""
        if len(prompt_ids) >= 2:
            self._catch_up(list(prompt_ids))

    def observe(self, start: int, token_ids: list[int], features: torch.Tensor) -> None:
        """The target computed `features` [n, d] for context positions start..start+n-1
        (tokens `token_ids`), all of them accepted."""
        if start > len(self.tokens):
            return  # a gap (features we never saw): propose() recomputes what it needs
        del self.tokens[start:]
        self.tokens.extend(token_ids)
        # Stored when next read, or a few dozen at a time: one copy at every step, right after
        # a forward with cold caches, costs several times the same copies made in a row. (A
        # runner's features are a tensor no later forward overwrites.)
        self._pending.append((start, features))
        if len(self._pending) >= PENDING_FEATURES:
            self._flush()

    @torch.inference_mode()
    def _flush(self) -> None:
        """Store the features observed since the last flush, in the order they came. Under
        inference mode, as `propose` is: `self.feats` is made there (an inference tensor) and
        written here, and an inference tensor takes in-place writes only under the mode."""
        pending, self._pending = self._pending, []
        for start, features in pending:
            self._store(start, features)

    def _store(self, start: int, features: torch.Tensor) -> None:
        end = start + features.shape[0]
        if end > self.feats.shape[0]:
            grown = torch.zeros(max(end, 2 * self.feats.shape[0], 256), self.feats.shape[1],
                                device=self.device)
            grown[:start] = self.feats[:start]
            self.feats = grown
        if self.feats.device.type == "cpu" and features.device.type == "cpu" \
                and features.dtype == torch.float32 and features.is_contiguous():
            # one memmove: at every step, right after a forward, a torch indexing call costs
            # several times the copy of one row
            ctypes.memmove(self.feats.data_ptr() + 4 * start * self.feats.shape[1],
                           features.data_ptr(), 4 * features.numel())
        else:
            self.feats[start:end] = features.to(self.device, torch.float32)

    def _ensure_features(self, prefix: list[int]) -> None:
        """Make self.feats[:len(prefix)] the target's features of `prefix`."""
        self._flush()
        known = common_prefix_len(self.tokens, prefix)
        if known < len(prefix):
            self.computed += len(prefix)
            self.tokens = list(prefix)
            self._store(0, target_features(self.target, prefix, self.feature_layers))

    def _embed(self, ids: list[int]) -> torch.Tensor:
        """The target's embedding rows of `ids`, float32 [1, len(ids), d]."""
        if self._c_embed is not None and min(ids) >= 0 and max(ids) < self._c_embed.rows:
            out = torch.empty(1, len(ids), self._c_embed.table.shape[1])
            self._c_embed.lookup(self._lib, torch.from_numpy(np.array(ids, dtype=np.int64)), out)
            return out
        emb_device = self.embed.weight.device
        return self.embed(torch.tensor([ids], device=emb_device)).to(self.device, torch.float32)

    def _sync_cache(self, context: list[int]) -> int:
        """Crop the head cache to the positions still valid for `context`; return their count."""
        keep = max(0, min(len(self.head_tokens), common_prefix_len(self.head_tokens, context))
                   - 1)
        if self.cache is not None:
            self.cache = (self.cache[0][:, :, :keep], self.cache[1][:, :, :keep])
        self.head_tokens = self.head_tokens[:keep + 1] if keep else []
        return keep

    def _catch_up_inputs(self, context):
        """The true positions the head has not seen, h..L-2, as its inputs (f_t, x_{t+1}):
        (features [1, n, d], embeddings [1, n, d], positions [n]), the cache cropped to h."""
        L = len(context)
        self._ensure_features(context[:-1])  # f_0 .. f_{L-2}
        h = self._sync_cache(context[:-1])  # at most L-2: always re-feed one true position
        # (numpy's arange: right after a forward, torch's costs some 40 microseconds)
        pos = torch.from_numpy(np.arange(h, L - 1, dtype=np.int64))
        pos = pos if self.device.type == "cpu" else pos.to(self.device)
        return self.feats[h:L - 1][None], self._embed(context[h + 1:L]), pos

    def _chain_inputs(self, context: list[int]) -> tuple[int, int, int, int]:
        """`_catch_up_inputs` for the C chain, as (the features' address, the embeddings'
        address, their rows n, the positions' address): rows of the drafter's own buffers,
        the embeddings looked up by one `embed_rows` call, with no torch call (each costs tens
        of microseconds right after the target's forward, with cold caches)."""
        L = len(context)
        self._ensure_features(context[:-1])  # f_0 .. f_{L-2}
        h = self._sync_cache(context[:-1])  # at most L-2: always re-feed one true position
        n, d = L - 1 - h, self.feats.shape[1]
        ids = context[h + 1:L]
        if n > len(self._chain_ids):
            self._chain_ids = np.zeros(max(n, 2 * len(self._chain_ids), 64), dtype=np.int64)
            self._chain_ids_view = memoryview(self._chain_ids)
            self._chain_ids_at = self._chain_ids.ctypes.data
            self._chain_embeds = torch.empty(len(self._chain_ids), d)
        if L - 1 > len(self._positions):
            self._positions = torch.arange(max(L - 1, 2 * len(self._positions), 256))
        if min(ids) < 0 or max(ids) >= self._c_embed.rows:
            raise IndexError(f"token ids must lie in [0, {self._c_embed.rows}): {ids}")
        view = self._chain_ids_view  # element writes: a step's one or two ids
        for i, t in enumerate(ids):
            view[i] = t
        _, kind, scale = self._c_embed
        embeds = self._chain_embeds.data_ptr()
        self._lib.embed_rows(self._c_embed_at, kind, d, self._chain_ids_at, n, scale, embeds)
        return (self.feats.data_ptr() + 4 * h * d, embeds, n,
                self._positions.data_ptr() + 8 * h)

    def _catch_up(self, context):
        """Run the head over the true positions it has not seen. Returns its predicted
        feature f_{L-1} and logits for x_L at the last one ([1, 1, d], [1, 1, N])."""
        feats, embeds, pos = self._catch_up_inputs(context)
        pred, logits, self.cache = self.head(feats, embeds, pos, self.cache, last_only=True)
        self.head_tokens = list(context)
        return pred[:, -1:], logits[:, -1:]

    @torch.inference_mode()
    def propose(self, context, k, params, noise):
        L = len(context)
        if k <= 0 or L < 2:
            return NO_DRAFT, None
        if (params.greedy or self._min_p_drawn(params)) and self.chains_in_c:
            return self._propose_chain(context, k, params, noise)
        pred, logits = self._catch_up(context)
        ids, rows = [], []
        min_gain = self.min_gain if self.early else 0.0
        p_all = 1.0  # the head's probability that every draft so far passes
        self.last_top = []
        for i in range(k):
            reduced_logits = logits[0, -1:]  # [1, N]
            if self.shaper:
                reduced_logits = self._penalized(reduced_logits, context, [ids])
            self.last_top.append(
                _TopLater(reduced_logits, 0, params, self._vocab_list, self._lib))
            drawn = self._sample(reduced_logits, params, noise, L + i)
            if drawn is None:  # no finite logit: nothing to draft
                break
            token, q, p_token = drawn
            p_all *= p_token
            # The first draft is always proposed: the head has run already, and one draft
            # costs only a verify one row wider (a tenth of a step on a CPU), which even the
            # drafts the head gives under min_gain repay (docs/performance.md, "The head's
            # stopping rules"); nor would the draft-length policy, which prices drafting per
            # drafted token, see a head run with nothing to show for it.
            if p_all < min_gain and i:
                break
            ids.append(token)
            if q is not None:
                rows.append(q)
            if i == k - 1 or p_all < self.lookahead * min_gain:
                break
            pos = torch.tensor([L - 1 + i], device=self.device)
            pred, logits, self.cache = self.head(pred[:, -1:], self._embed([token]), pos,
                                                 self.cache)
        # Drafted positions carry predicted features: drop them, the target will supply true ones.
        self._sync_cache(context)
        draft_ids = torch.tensor(ids, dtype=torch.long)
        return draft_ids, (torch.stack(rows) if rows else None)

    def _propose_chain(self, context: list[int], k: int, params: SamplingParams, noise):
        """`propose`'s chain in one C call (`_chain`), as `propose` returns it."""
        return self._chain(context, k, params, noise)[0], None

    def _chain(self, context: list[int], k: int, params: SamplingParams, noise
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`propose`'s chain in one C call (`HeadStep.chain`), greedy or drawn by min-p
        (`_min_p_drawn`): the catch-up, then each draft's penalties, its pick and the head's
        next step, with the same functions on the same values as the loop above, so the same
        drafts, rows and cache; none of the loop's dozens of torch calls a draft, each slow
        right after the target's forward."""
        step = self.head._step
        feats, embeds, n, pos = self._chain_inputs(context)  # n: the catch-up's rows
        cache = self.cache
        if cache is None:
            empty = torch.empty(1, step.heads, 0, step.head_dim)
            cache = (empty, empty)
        keys, values = extended_pair(cache, n + k - 1)  # then up to k - 1 drafts' slots
        pen = self.shaper.penalties if self.shaper else None
        places = seq = breaks = vocab_breaks = None
        n_seq = 0
        if pen is not None:
            places, n_seq = self._places(), self._sync_prefix(context, k)
            seq, breaks = self._pen_seq, self._pen_flags
            vocab_breaks = self._vocab_breaks() if pen.dry else None
        min_gain = self.min_gain if self.early else 0.0
        sampled = None
        if not params.greedy:  # each draft position's keys, as the target's draw reads them
            L = len(context)
            sampled = (params.temperature, params.min_p,
                       torch.tensor([noise.keys(L + i, DRAW) for i in range(k)],
                                    dtype=torch.int64))
        tokens, rows = step.chain(feats, embeds, n, pos, keys, values, k, self._c_embed,
                                  self._vocab_ids, min_gain, self.lookahead, pen, places, seq,
                                  breaks, n_seq, vocab_breaks, sampled)
        self.cache, self.head_tokens = (keys, values), list(context)
        self._sync_cache(context)  # the true positions only: the target supplies their features
        self.last_top = [_TopLater(rows, r, params, self._vocab_list, self._lib)
                         for r in range(len(rows))]
        return tokens, rows  # the drafts, and the head's rows there after their penalties

    def _fan(self, context: list[int], depth: int, params: SamplingParams, nodes: int, noise
             ) -> DraftTree | tuple:
        """A tree at the cost of a chain: the C chain of up to `depth` drafts, and beside each
        draft, as leaves of the same parent, the head's next likeliest tokens there (up to
        `fan_width`, each scored by the head's probability of the chain before it and of the
        token, at temperature 1; at least `fan_min_score`, the best `nodes` in all). A leaf
        takes no head step, only a verify row: it passes where the target's token is the head's
        second or third choice, about a sixth of the greedy steps on the embedded target
        (docs/performance.md, "Leaves beside the chain"). Nodes: the chain's first, each the
        child of the one before, then the leaves, level by level."""
        chain, rows = self._chain(context, depth, params, noise)
        ids = chain.tolist()
        if not ids:
            return NO_DRAFT, None
        places = self._places()
        leaves: list[tuple[float, int, int]] = []  # (score, level, token)
        reach = 1.0  # the head's probability that the chain passes up to this level
        for level, token in enumerate(ids):
            row = rows[level]
            top, values, lse = kernels.row_top(self._lib, row, self.fan_width + 1)
            kept = 0
            for place, value in zip(top, values):
                alt = self._vocab_list[place]
                score = reach * math.exp(value - lse)
                if alt == token:
                    continue
                if score < self.fan_min_score or kept == self.fan_width:
                    break
                leaves.append((score, level, alt))
                kept += 1
            reach *= math.exp(float(row[places[token]]) - lse)
        leaves = sorted(leaves, reverse=True)[:max(0, nodes - len(ids))]
        leaves.sort(key=lambda leaf: (leaf[1], -leaf[0]))
        return DraftTree(torch.tensor(ids + [t for _, _, t in leaves], dtype=torch.long),
                         list(range(-1, len(ids) - 1)) + [level - 1 for _, level, _ in leaves])

    @torch.inference_mode()
    def propose_tree(self, context, depth: int, params: SamplingParams, nodes: int,
                     noise=None):
        """A draft tree of at most `nodes` nodes and `depth` levels. Where the chain runs in C
        (greedy, or min-p's draw with the request's `noise`): that chain with leaves (`_fan`).
        Elsewhere EAGLE-2's dynamic tree: a node's score is the product of the head's
        probabilities along its path, the head's estimate that the target accepts it; nodes under `tree_min_score` are not worth
        their share of the wider verify. Each level, the `tree_beam` best new nodes are expanded
        with one head forward (their rows see the context and their own ancestors) and each
        gets its `tree_width` likeliest tokens as children. The tree is the `nodes` best
        nodes found (ancestor-closed: a node never scores above its parent). Drafts are one-hot
        (tree.py verifies with the target's own draws): the probabilities only rank."""
        L = len(context)
        if depth <= 0 or nodes <= 0 or L < 2:
            return NO_DRAFT, None
        if self.chains_in_c and (params.greedy or noise is not None
                                 and self._min_p_drawn(params)):
            return self._fan(context, depth, params, nodes, noise)
        feat, logits = self._catch_up(context)
        temperature = 1.0 if params.greedy else params.temperature
        base = self.cache[0].shape[2]  # head cache slots of the true positions
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        sees: dict[int, list[int]] = {-1: []}  # expanded node -> head cache slots it attends to
        # The frontier: expanded nodes (the root first), their predicted features [R, d] (the
        # feature input of their children), logits [R, N] and scores.
        front, front_feat, front_logits, front_score = [-1], feat[0], logits[0], [1.0]
        paths: dict[int, list[int]] = {-1: []}  # expanded node -> its tokens from the root
        for level in range(1, depth + 1):
            if self.shaper:
                front_logits = self._penalized(front_logits, context, [paths[n] for n in front])
            p, index = torch.softmax(front_logits.float() / temperature, -1).topk(self.tree_width)
            grown, rows = [], []
            for r, (pr, ir) in enumerate(zip(p.tolist(), index.tolist())):
                for pj, ij in zip(pr, ir):
                    score = front_score[r] * pj
                    if score < self.tree_min_score:
                        break
                    tokens.append(ij)  # a reduced-vocabulary index until the end
                    parents.append(front[r])
                    scores.append(score)
                    grown.append(len(tokens) - 1)
                    rows.append(r)
            if level == depth or not grown:
                break
            # Deeper nodes score at most their parents: stop once none can make the tree.
            if len(scores) >= nodes:
                last_place = sorted(scores, reverse=True)[nodes - 1]
                if max(scores[i] for i in grown) <= last_place:
                    break
            expand = sorted(range(len(grown)), key=lambda j: -scores[grown[j]])[:self.tree_beam]
            expand.sort()
            seen = self.cache[0].shape[2]
            mask = torch.zeros(len(expand), seen + len(expand), dtype=torch.bool,
                               device=self.device)
            mask[:, :base] = True
            for r, j in enumerate(expand):
                node = grown[j]
                sees[node] = sees[parents[node]] + [seen + r]
                paths[node] = paths[parents[node]] + [int(self.head.vocab_ids[tokens[node]])]
                mask[r, sees[node]] = True
            feats = front_feat[torch.tensor([rows[j] for j in expand], device=self.device)]
            ids = self.head.vocab_ids[torch.tensor([tokens[grown[j]] for j in expand])].tolist()
            pos = torch.full((len(expand),), L - 2 + level, device=self.device)
            pred, out, self.cache = self.head(feats[None], self._embed(ids), pos, self.cache,
                                              mask)
            front = [grown[j] for j in expand]
            front_feat, front_logits = pred[0], out[0]
            front_score = [scores[i] for i in front]
        self._sync_cache(context)  # drop the tree's rows: the target supplies true features
        if not tokens:
            return NO_DRAFT, None
        best = sorted(range(len(tokens)), key=lambda i: -scores[i])[:nodes]
        best.sort()  # creation order: parents first
        new_index = {old: new for new, old in enumerate(best)}
        ids = self.head.vocab_ids[torch.tensor([tokens[i] for i in best])].cpu()
        return DraftTree(ids, [new_index[parents[i]] if parents[i] >= 0 else -1 for i in best])

    def _min_p_drawn(self, params: SamplingParams) -> bool:
        """Whether a sampled draft is min-p's draw over the reduced vocabulary
        (`sampling.min_p_place`, in C where the kernels are): min-p without top-p or top-k,
        the examples' samplers, drafts verified one-hot."""
        return not params.greedy and self.coupled and params.min_p > 0 \
            and params.top_p >= 1.0 and not 0 < params.top_k < len(self._vocab_list)

    def _sample(self, reduced_logits, params: SamplingParams, noise, position: int):
        """-> (full-vocab token id, its q row [vocab] or None for a one-hot draft, the token's
        probability under the head: at temperature 1 when greedy, else under q), or None where
        the row holds no finite logit.

        Sampled with the target's own keyed random numbers for this position (`sampling.race`,
        or with min-p alone `min_p_place`, the target's min-p draw keyed the same way): the
        target's draw there is the same race over p, so the draft is the target's token
        whenever the two races agree (Gumbel coupling), and the step verifies it as a one-hot
        draft: the emitted tokens are plain sampling's, whatever the head proposed."""
        if self._min_p_drawn(params):
            row = reduced_logits[0].float().cpu().contiguous()
            drawn = kernels.min_p_place(self._lib, row, self._vocab_ids, params.temperature,
                                        params.min_p, noise.keys(position, DRAW)) \
                if self._lib is not None else \
                min_p_place(row, params, noise, position, self._vocab_list)
            return None if drawn is None else (self._vocab_list[drawn[0]], None, drawn[1])
        if params.greedy:
            row = reduced_logits[0].float()
            if self._lib is not None and row.is_contiguous() and row.device.type == "cpu":
                ids, values, lse = kernels.row_top(self._lib, row, 1)  # one call: a tenth
                if ids:
                    return self._vocab_list[ids[0]], None, math.exp(values[0] - lse)
            p_top, index = torch.softmax(row, -1).max(-1)
            return self._vocab_list[int(index)], None, float(p_top)
        ids, probs = nucleus(reduced_logits[0], params)  # over the reduced vocabulary
        vocab_ids = self.head.vocab_ids.cpu()
        kept = vocab_ids if ids is None else vocab_ids[ids]
        i = race(kept, probs, noise, position)
        if self.coupled:
            return int(kept[i]), None, float(probs[i])
        q = torch.zeros(self.vocab_size)  # tokens outside the reduced vocabulary: q = 0
        q[kept] = probs.float()
        return int(kept[i]), q, float(probs[i])

