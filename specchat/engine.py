"""The streaming speculative-decoding engine.

    engine = Engine(target, drafters={"ngram": NgramDrafter()})
    for event in engine.stream(prompt_ids, GenerateConfig(speculation=True, drafter="ngram")):
        ...  # TokenEvent as tokens are decided, StepRecord per step, GenerationStats last

One step = one target forward over [last token] + k drafts, then `sampling.verify`. With
speculation off (or when the drafter has nothing to propose) k = 0 and the very same code path
is plain decoding. A drafter may propose a tree instead (`tree.DraftTree`, the head does): the
forward then reads every node under a tree attention mask, `tree.verify_tree` walks the path the
target agrees with, and the cache keeps that path (`kvcache.keep_fed`).

The target's KV cache lives across steps and across requests: after each
verification it is cropped to the accepted context, and a new request re-encodes only what its
prompt does not share with the cached tokens (a chat's history is encoded once).

Invariant between steps: the cache holds every context token but the newest one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specchat.attention import is_row_exact
from specchat.drafters import Drafter, _common_prefix_len
from specchat.events import (ACCEPTED, BONUS, RESAMPLED, TARGET, GenerationStats, StepRecord,
                             TokenEvent, summarize)
from specchat.kvcache import (crop_to, keep_fed, new_cache, tree_attention_mask,
                              tree_masks_supported)
from specchat.sampling import Noise, SamplingParams, verify
from specchat.text import ReplyText, tokens_until_stop
from specchat.tree import DraftTree, verify_tree, visibility


_NO_DRAFTS = torch.zeros(0, dtype=torch.long)
# Draft-tree size for the head in the app and the CLI (`GenerateConfig.tree_nodes`).
TREE_NODES = 10


def default_tree_nodes(temperature: float, drafter: str = "head") -> int:
    """Trees for the head alone when greedy, chains otherwise. By `bench` on 65 Spec-Bench
    questions (README): greedy, the head's trees tie or beat its chains (1.08x vs 1.09x, 1.16x
    vs 1.09x in an earlier run), but `combined` is faster with chains (1.61x vs 1.57x, 1.68x vs
    1.59x); at T = 0.7 `combined` chains and trees tie (1.30x vs 1.31x), so chains, the
    simpler."""
    return TREE_NODES if temperature <= 0 and drafter == "head" else 0


# Best first, by `python -m specchat bench` on the embedded target (README): a real draft model,
# then n-gram lookup with the trained head behind it, lookup alone, the head alone.
DRAFTER_PREFERENCE = ("model", "combined", "ngram", "head")


@dataclass
class GenerateConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = 0  # None: a fresh random seed per request
    speculation: bool = True  # False: plain decoding, same code path with k = 0
    drafter: str = "ngram"  # key into Engine.drafters
    draft_len: int = 4  # k: the most draft tokens per step
    adaptive: bool = True  # let k follow measured acceptance and cost (never above draft_len)
    # Drafters that can (the head) draft a tree of up to this many tokens, k levels deep,
    # verified in one forward (tree.py). 0: chains.
    tree_nodes: int = 0
    stop: tuple[str, ...] = ()  # stop strings (not included in the reply)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)


class DraftLengthPolicy:
    """Picks k for the next step to maximize expected tokens per second.

    With per-position acceptance alpha, a step with k drafts emits (1 - alpha^(k+1)) / (1 - alpha)
    tokens on average (Leviathan et al.) and costs verify(k + 1) + k * draft_token seconds, both
    measured as we go. k = 0 is plain decoding: chosen when drafting does not pay, with a probe
    every `probe_every` steps so a change in the text can switch drafting back on.

    Alpha is kept per draft class when the drafter tells one (`Drafter.draft_class`): an n-gram
    drafter's 3-token matches are far more reliable than its 1-token matches, so each earns its
    own k. The cost curve is shared.
    """

    def __init__(self, probe_every: int = 8, margin: float = 0.05):
        self.probe_every = probe_every
        # Draft only when that is expected to beat plain decoding by this fraction: estimates are
        # noisy, and a draft that merely breaks even costs more than the model sees (the lookup,
        # a wider sampling step), so a marginal gain is not worth the risk of a loss.
        self.margin = margin
        self._tests: dict[object, list[float]] = {}  # class -> [successes, failures]
        # Verify cost for m > 1 tokens fed: step_s * (1 + fixed + slope * (m - 1)). A wider
        # forward pays a fixed price (on this CPU a one-token step's LM head is a matrix-vector
        # product; two rows or more take the slower matrix path: 2 tokens cost 1.2 steps) and
        # then a little per token (11 tokens: 1.9). One line fitted from every step's (m, cost),
        # so a single noisy measurement at some m cannot lock k low for good.
        self.step_s = 0.0  # EMA seconds of a 1-token (plain) step
        self.slope_prior = 0.05  # wide forwards are nearly free (LM-head/weight-read bound)
        self._fit = [0.0] * 5  # decayed sums: weight, x, y, x^2, xy for x = m - 1, y = ratio - 1
        # The same y per width m, where measured often enough: costs need not lie on a line.
        # With MKL's float32 products on an AVX2 CPU, 2-4 tokens cost what one did (1.00-1.08
        # steps) and 5 tokens 1.6-1.9: the line mispriced both.
        self._width: dict[int, list[float]] = {}  # m -> decayed [weight, sum of y]
        self.draft_token_s = 0.0
        self.plain_streak = 0

    @property
    def verify_line(self) -> tuple[float, float]:
        """(fixed, slope) of the verify cost line, from the fit (or the prior)."""
        w, sx, sy, sxx, sxy = self._fit
        if w < 1e-9:
            return 0.0, self.slope_prior
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        # One width only (or nearly): the data fixes the level there, the prior the slope.
        slope = (sxy / w - mx * my) / var if var > 0.25 else self.slope_prior
        slope = min(max(slope, 0.0), 1.0)
        return max(0.0, my - slope * mx), slope

    def alpha(self, cls=None) -> float:
        successes, failures = self._tests.get(cls, (2.0, 1.0))  # prior 2/3, weight of 3 tests
        return successes / (successes + failures)

    WIDTH_WEIGHT = 3.0  # decayed measurements of a width before its own mean replaces the line

    def _verify_cost(self, m: int) -> float:
        seen = self._width.get(m)
        if m > 1 and seen and seen[0] >= self.WIDTH_WEIGHT:
            return (self.step_s or 1.0) * (1 + seen[1] / seen[0])
        fixed, slope = self.verify_line if m > 1 else (0.0, 0.0)
        return (self.step_s or 1.0) * (1 + fixed + slope * (m - 1))

    def expected_rate(self, k: int, cls=None) -> float:
        a = min(self.alpha(cls), 0.999)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        return tokens / (self._verify_cost(k + 1) + k * self.draft_token_s)

    def choose(self, k_max: int, cls=None) -> int:
        best = max(range(k_max + 1), key=lambda k: self.expected_rate(k, cls))
        if best and self.expected_rate(best, cls) < (1 + self.margin) * self.expected_rate(0, cls):
            best = 0
        if best == 0 and k_max > 0:
            self.plain_streak += 1
            if self.plain_streak % self.probe_every == 0:
                return 1  # probe: keep alpha fresh
        else:
            self.plain_streak = 0
        return best

    def update(self, fed: int, verify_s: float, drafted: int, accepted: int, draft_s: float,
               cls=None):
        decay = 0.9
        if fed == 1 or not self.step_s:
            self.step_s = verify_s if not self.step_s else decay * self.step_s + (1 - decay) * verify_s
        else:
            x, y = fed - 1, min(max(verify_s / self.step_s - 1, 0.0), 3.0)
            self._fit = [0.95 * a + b for a, b in zip(self._fit, (1.0, x, y, x * x, x * y))]
            seen = self._width.setdefault(fed, [0.0, 0.0])
            seen[0], seen[1] = 0.9 * seen[0] + 1.0, 0.9 * seen[1] + y
        if drafted:
            # Per-position tests: `accepted` successes, then one failure unless all passed.
            tests = self._tests.setdefault(cls, [2.0, 1.0])
            tests[0] = decay * tests[0] + accepted
            tests[1] = decay * tests[1] + (1 if accepted < drafted else 0)
            per_token = draft_s / drafted
            self.draft_token_s = (per_token if not self.draft_token_s
                                  else decay * self.draft_token_s + (1 - decay) * per_token)


class Engine:
    def __init__(self, target, drafters: dict[str, Drafter] | None = None):
        self.target = target  # models.LoadedModel (model, tokenizer, device, ...)
        self.model = target.model
        self.tokenizer = target.tokenizer
        self.device = target.device
        self.drafters: dict[str, Drafter] = dict(drafters or {})
        self.vocab_size = len(self.tokenizer)
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self.lock = threading.Lock()  # one generation at a time on one model
        self._policies: dict[tuple[str, bool], DraftLengthPolicy] = {}
        self._cache = None
        self._cache_ids: list[int] = []  # tokens whose keys/values are in self._cache
        self._tap = None  # head.FeatureTap on the target's final norm, once a drafter wants it
        self.row_exact = is_row_exact(self.model)  # verify logits = one-token logits, bit for bit
        self.trees_ok = tree_masks_supported(self.model)  # flash attention takes no tree mask

    # -- target forward -------------------------------------------------------------------

    @torch.inference_mode()
    def _forward(self, ids: list[int], n_logits: int) -> torch.Tensor:
        """Feed `ids` after the cached tokens; return the last n_logits rows [n, vocab]
        (on the model's device and dtype: sampling moves them to CPU only when it needs them)."""
        out = self.model(torch.tensor([ids], device=self.device), past_key_values=self._cache,
                         use_cache=True, logits_to_keep=n_logits)
        self._cache_ids.extend(ids)
        return out.logits[0, :, :self.vocab_size]

    @torch.inference_mode()
    def _forward_tree(self, ids: list[int], parents: list[int]) -> torch.Tensor:
        """Feed the root ids[0] and a draft tree ids[1:] (node i a child of parents[i], -1 the
        root) after the cached tokens, with a tree attention mask. Returns logits [len(ids),
        vocab]."""
        cached = len(self._cache_ids)
        visible = visibility(parents)
        positions = cached + visible.sum(-1).to(self.device) - 1  # depth = ancestors seen
        mask = tree_attention_mask(self.model, self._cache, cached, visible, positions)
        out = self.model(torch.tensor([ids], device=self.device), past_key_values=self._cache,
                         attention_mask=mask, position_ids=positions[None], use_cache=True,
                         logits_to_keep=len(ids))
        self._cache_ids.extend(ids)
        return out.logits[0, :, :self.vocab_size]

    def _prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, int]:
        """Encode the prompt, reusing the cached prefix it shares with the last request.
        Returns the logits of the last prompt position [1, vocab] and the tokens encoded."""
        keep = min(_common_prefix_len(self._cache_ids, prompt_ids), len(prompt_ids) - 1)
        if self._cache is None or not crop_to(self._cache, len(self._cache_ids), keep):
            self._cache, keep = new_cache(self.model), 0
        self._cache_ids = self._cache_ids[:keep]
        return self._forward(prompt_ids[keep:], 1), len(prompt_ids) - keep

    def _feature_drafters(self) -> list:
        """Drafters that draft from the target's features (the EAGLE head). They get them for
        free: a hook on the target's final norm keeps the hidden states of each forward."""
        wants = [d for d in self.drafters.values() if getattr(d, "needs_features", False)]
        if wants and self._tap is None:
            from specchat.head import FeatureTap
            self._tap = FeatureTap(self.model)
        return wants

    def _observe(self, wants: list, start: int, ids: list[int],
                 rows: list[int] | None = None) -> None:
        """Positions `rows` of the latest forward (default: its first len(ids)) were accepted,
        tokens `ids` at context positions start.. . Sent whichever drafter is active, so
        switching drafters costs nothing."""
        if wants:
            features = self._tap.features(len(ids), rows)  # [len(ids), d]
            for d in wants:
                d.observe(start, ids, features)

    def _tree_step(self, context: list[int], tree: DraftTree, params: SamplingParams,
                   noise: Noise, wants: list):
        """Verify a draft tree in one forward and keep the accepted path in the cache.
        Returns (accepted tokens, verdict, tree depth)."""
        ids = [context[-1], *tree.tokens.tolist()]
        logits = self._forward_tree(ids, tree.parents)
        verdict = verify_tree(tree, logits, params, noise, len(context))
        keep = [0] + [1 + i for i in verdict.path]  # the root and the accepted path
        keep_fed(self._cache, len(ids), keep)
        self._cache_ids = self._cache_ids[:-len(ids)] + [ids[j] for j in keep]
        accepted = [ids[j] for j in keep[1:]]
        self._observe(wants, len(context) - 1, [context[-1], *accepted], keep)
        return accepted, verdict, tree.depth

    @property
    def context_window(self) -> int | None:
        """The most tokens (prompt + reply) the target reads: its position embeddings."""
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    def default_drafter(self) -> str:
        """The drafter to use when none is asked for: the best that is loaded."""
        return next((d for d in DRAFTER_PREFERENCE if d in self.drafters),
                    next(iter(self.drafters), "ngram"))

    def reset_cache(self) -> None:
        self._cache, self._cache_ids = None, []

    def policy(self, drafter: str, greedy: bool) -> DraftLengthPolicy:
        return self._policies.setdefault((drafter, greedy), DraftLengthPolicy())

    # -- the decode loop ------------------------------------------------------------------

    def stream(self, prompt_ids: list[int], cfg: GenerateConfig,
               stop_event: threading.Event | None = None,
               ) -> Iterator[TokenEvent | StepRecord | GenerationStats]:
        if not prompt_ids:
            raise ValueError("empty prompt")
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
        noise = Noise(seed)  # the draw at reply position t depends on (seed, t) alone
        stats = GenerationStats(speculation=drafter is not None,
                                drafter=drafter.name if drafter else "none",
                                draft_len=cfg.draft_len if drafter else 0,
                                temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                seed=seed, prompt_tokens=len(prompt_ids))
        trees = bool(drafter and cfg.tree_nodes and self.trees_ok
                     and hasattr(drafter, "propose_tree"))
        stats.tree_nodes = cfg.tree_nodes if trees else 0
        policy = self.policy(stats.drafter + "+tree" * trees, params.greedy) if drafter else None
        steps: list[StepRecord] = []
        reply = ReplyText(self.tokenizer, prompt_ids, cfg.stop)
        context = list(prompt_ids)

        with self.lock:
            start = time.perf_counter()
            wants = self._feature_drafters()
            try:
                logits, stats.prefill_tokens = self._prefill(prompt_ids)
                stats.target_calls = 1
                first = verify(_NO_DRAFTS, None, logits, params, noise,
                               len(prompt_ids)).next_token
                step_tokens: list[tuple[int, str]] = [(first, TARGET)]
                record = StepRecord(0, 0, 0, 1, 0.0, time.perf_counter() - start)
                if drafter:
                    drafter.begin(prompt_ids)
                fed = stats.prefill_tokens
                self._observe(wants, len(prompt_ids) - fed, prompt_ids[len(prompt_ids) - fed:])
                step = generated = 0
                while True:
                    # Emit what the last step decided, token by token, watching for stops.
                    for token, kind in step_tokens:
                        context.append(token)
                        if token in self.eos_ids:
                            stats.stop_reason = "eos"
                            break
                        generated += 1
                        event = TokenEvent(token, "", kind, step, record.drafted, record.accepted)
                        released, hit = reply.push(event)
                        for ev in released:
                            stats.ttft_s = stats.ttft_s or time.perf_counter() - start
                            stats.new_tokens += 1  # tokens shown: a stop string's are not
                            yield ev
                        if hit:
                            stats.stop_reason = "stop_string"
                            break
                        if generated >= max_new:
                            stats.stop_reason = "length"
                            break
                    if step:
                        steps.append(record)
                        yield record
                    if stats.stop_reason:
                        break
                    if stop_event is not None and stop_event.is_set():
                        stats.stop_reason = "stopped"
                        break

                    step += 1
                    t0 = time.perf_counter()
                    k, cls = 0, None
                    if drafter:  # never draft past max_new_tokens (the +1 is the target's)
                        cls = drafter.draft_class(context) if hasattr(drafter, "draft_class") \
                            else None
                        k = policy.choose(cfg.draft_len, cls) if cfg.adaptive else cfg.draft_len
                        k = min(k, max_new - generated - 1)
                    if k == 0:
                        draft = (_NO_DRAFTS, None)
                    elif trees:
                        draft = drafter.propose_tree(context, k, params, cfg.tree_nodes)
                    else:
                        draft = drafter.propose(context, k, params, noise)
                        draft = _until_stop(self.tokenizer, context, draft, cfg.stop)
                    t1 = time.perf_counter()
                    tree = self._tree_step(context, draft, params, noise, wants) \
                        if isinstance(draft, DraftTree) else None
                    if tree is not None:
                        accepted, verdict, levels = tree
                        k, n = len(draft), len(accepted)
                    else:
                        draft_ids, draft_probs = draft
                        k = levels = len(draft_ids)
                        target_logits = self._forward([context[-1], *draft_ids.tolist()], k + 1)
                        verdict = verify(draft_ids, draft_probs, target_logits, params,
                                         noise, len(context))
                        n = verdict.n_accepted
                        accepted = draft_ids[:n].tolist()
                        # Every token but the newest is in the cache: drop the rejected drafts.
                        crop_to(self._cache, len(self._cache_ids),
                                len(self._cache_ids) - (k - n))
                        self._cache_ids = self._cache_ids[:len(self._cache_ids) - (k - n)]
                        self._observe(wants, len(context) - 1, [context[-1], *accepted])
                    t2 = time.perf_counter()
                    stats.target_calls += 1
                    if drafter:
                        drafter.feedback(k, n)
                    if policy:  # a tree counts as its depth: one draft forward and test a level
                        policy.update(k + 1, t2 - t1, levels, n, t1 - t0, cls)
                    last_kind = TARGET if k == 0 else (BONUS if verdict.bonus else RESAMPLED)
                    step_tokens = [(int(t), ACCEPTED) for t in accepted]
                    step_tokens.append((verdict.next_token, last_kind))
                    record = StepRecord(step, k, n, len(step_tokens), t1 - t0, t2 - t1,
                                        levels if tree is not None else 0)
                if stats.stop_reason != "stop_string":
                    for ev in reply.finish():
                        stats.new_tokens += 1
                        yield ev
            except torch.OutOfMemoryError as e:
                self.reset_cache()
                stats.stop_reason, stats.error = "error", f"out of memory: {e}"
            except Exception:  # (not GeneratorExit: at a yield the cache is consistent)
                self.reset_cache()  # a half-done step leaves the cache unknown: start clean
                raise
            stats.seconds = time.perf_counter() - start
        yield summarize(steps, stats)


def _until_stop(tokenizer, context, draft, stops):
    """A chain draft without the tokens after a stop string (they could never be shown)."""
    draft_ids, draft_probs = draft
    if not stops or len(draft_ids) < 2:
        return draft
    keep = tokens_until_stop(tokenizer, context, draft_ids.tolist(), stops)
    if keep == len(draft_ids):
        return draft
    return draft_ids[:keep], (draft_probs[:keep] if draft_probs is not None else None)


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@dataclass
class LoadReport:
    engine: Engine
    draft: object | None  # models.LoadedModel of the draft, when one loaded and fits
    notes: list[str]  # things the user should know (fallbacks, refused drafts)


def load_engine(target: str = "embedded", draft_model: str = "", quantization: str = "nf4",
                draft_quantization: str = "none", device: str | None = None,
                progress=print, head: str | None = None) -> LoadReport:
    """Load a target (and optionally a draft model) and build an Engine with every drafter that
    can work: n-gram lookup always, the draft model when its vocabulary matches the target's,
    `head` and `combined` when a draft head trained for this target exists (`head`: a file
    from `train-draft`; default: the one trained or shipped for this target, if any)."""
    from specchat.drafters import ModelDrafter, NgramDrafter
    from specchat.head import head_drafters
    from specchat.models import load_model, vocab_mismatch

    tgt = load_model(target, quantization, device, progress)
    engine = Engine(tgt, {"ngram": NgramDrafter()})
    notes: list[str] = []
    found, head_notes = head_drafters(tgt, NgramDrafter(), head or None)
    engine.drafters.update(found)  # "head", "combined"
    notes += head_notes
    draft = None
    if draft_model:
        draft = load_model(draft_model, draft_quantization, device, progress)
        problem = vocab_mismatch(tgt.tokenizer, draft.tokenizer, _logits_width(tgt.model),
                                 _logits_width(draft.model))
        if problem:
            notes.append(f"Draft model {draft.name} refused, n-gram drafter used instead: "
                         f"its vocabulary does not match the target's ({problem}).")
            draft = None
        else:
            engine.drafters["model"] = ModelDrafter(draft.model, engine.vocab_size)
    return LoadReport(engine, draft, notes)


def _logits_width(model) -> int:
    return model.config.get_text_config().vocab_size
