"""The adaptive draft length: k per step from measured acceptance and measured costs."""

from __future__ import annotations

import math


class DraftLengthPolicy:
    """Picks k for the next step to maximize expected tokens per second.

    With per-position acceptance alpha, a step with k drafts emits (1 - alpha^(k+1)) / (1 - alpha)
    tokens on average (Leviathan et al.) and costs verify(k + 1) + k * draft_token seconds, both
    measured as we go. k = 0 is plain decoding: chosen when drafting does not pay, with a probe
    every `probe_every`-th step so a change in the text can switch drafting back on. Each probe
    whose draft fails doubles the gap to the next (up to `max_probe_gap`); a draft that passes,
    or a step that drafts on its merits, brings it back to `probe_every`. A probe costs a wider
    verify and, for the head, its catch-up over the steps it skipped: where drafts keep failing
    they would otherwise cost a few percent of every reply. And however its drafts fare, a
    probe comes no more often than keeps its expected loss (its measured cost less the tokens
    it is expected to gain) under PROBE_BUDGET of plain decoding's time: a drafter whose
    tokens cost more than they save (a head that costs a target step a token) probes every
    hundred steps or so, not every eight. A probe's drafting cost is kept apart from the
    drafts' on the steps after it: the head's catch-up prices the probes, not every draft, so
    a probe that passes can turn drafting back on where the drafts pay.

    Alpha, the drafting cost and the probes are kept per draft class when the drafter tells one
    (`Drafter.draft_class`): an n-gram drafter's 3-token matches are far more reliable than its
    1-token matches, so each earns its own k; and where the combined drafter gives a step to the
    head, a draft costs a head forward (on a probe, with its catch-up), not a lookup. The
    lookups' cheap drafts must neither make the head's probes look cheap nor, by drafting,
    put them off for good: a class probes after its own plain steps. The verify cost curve is
    shared.
    """

    PROBE_BUDGET = 0.01  # the share of plain decoding's time that probes may lose, expected
    MAX_COST_GAP = 256  # the most plain steps between probes that PROBE_BUDGET asks for
    # Alpha's memory: each test's weight decays by this a test (about twenty tests). A shorter
    # one (0.9) let a short patch of failures rest a drafter whose drafts pay, and resting
    # wrongly costs more than drafting wrongly: a failed draft costs a verify one row wider and
    # a draft, a tenth or two of a step, where a passed one saves a step (docs/performance.md,
    # "The draft-length policy's memory").
    ALPHA_DECAY = 0.95

    def __init__(self, probe_every: int = 8, margin: float = 0.02, max_probe_gap: int = 32):
        self.probe_every = probe_every
        self.max_probe_gap = max(max_probe_gap, probe_every)
        # Draft only when that is expected to beat plain decoding by this fraction: a draft that
        # merely breaks even costs more than the model sees (the lookup, a wider sampling step).
        # Kept small: resting wrongly costs more than drafting wrongly (see ALPHA_DECAY).
        self.margin = margin
        self._tests: dict[object, list[float]] = {}  # class -> [successes, failures]
        # Verify cost for m > 1 tokens fed: step_s * (1 + fixed + slope * (m - 1)). A wider
        # forward pays a fixed price (a one-token step's LM head is a matrix-vector product;
        # two rows or more take the slower matrix path) and then a little per token. One line fitted from every step's (m, cost),
        # so a single noisy measurement at some m cannot lock k low for good.
        self.step_s = 0.0  # EMA seconds of a 1-token (plain) step
        self.slope_prior = 0.05  # wide forwards are nearly free (LM-head/weight-read bound)
        self._fit = [0.0] * 5  # decayed sums: weight, x, y, x^2, xy for x = m - 1, y = ratio - 1
        # The same y per width m, where measured often enough: costs need not lie on a line
        # (a BLAS may price 2-4 rows like one and jump at 5, which a line misprices).
        self._width: dict[int, list[float]] = {}  # m -> decayed [weight, sum of y]
        self._draft_sums: dict[object, list[float]] = {}  # class -> decayed [seconds, drafts]
        # A probe's drafting seconds are kept apart (class -> decayed [seconds, probes]): the
        # head's probe catches up over every step it sat out, tens of milliseconds, where a
        # draft on the step after a draft costs a few. Priced per token, the catch-up would
        # make drafting look dear for good, even where its drafts pass; it prices the probes.
        self._probe_sums: dict[object, list[float]] = {}
        self._probing = False  # the latest choose() was a probe
        # class -> [plain steps since its last draft, plain steps its next probe waits for]
        self._probes: dict[object, list[int]] = {}

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

    def draft_token_s(self, cls=None) -> float:
        """Seconds of drafting per drafted token in this class, probes aside (0 until it is
        measured; all the seconds where it ran and has not drafted yet)."""
        seconds, tokens = self._draft_sums.get(cls, (0.0, 0.0))
        return seconds / tokens if tokens > 0 else seconds

    def probe_draft_s(self, cls=None) -> float:
        """Seconds of drafting in a probe of this class (before its first probe: a draft
        token's)."""
        seconds, probes = self._probe_sums.get(cls, (0.0, 0.0))
        return seconds / probes if probes > 0 else self.draft_token_s(cls)

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
        return tokens / (self._verify_cost(k + 1) + k * self.draft_token_s(cls))

    def probe_loss(self, cls=None) -> float:
        """A probe's expected loss against a plain step, in plain steps: a one-draft verify and
        a probe's drafting, less the 1 + alpha tokens it is expected to emit."""
        step = self.step_s or 1.0
        return (self._verify_cost(2) + self.probe_draft_s(cls)) / step - (1 + self.alpha(cls))

    def probe_gap(self, cls=None) -> int:
        """The plain steps of this class before its next probe (before PROBE_BUDGET's say)."""
        return self._probes.get(cls, (0, self.probe_every))[1]

    def choose(self, k_max: int, cls=None) -> int:
        best = max(range(k_max + 1), key=lambda k: self.expected_rate(k, cls))
        if best and self.expected_rate(best, cls) < (1 + self.margin) * self.expected_rate(0, cls):
            best = 0
        probe = self._probes.setdefault(cls, [0, self.probe_every])
        self._probing = False
        if best == 0 and k_max > 0:
            probe[0] += 1
            loss = self.probe_loss(cls)
            gap = probe[1] if loss <= 0 else max(
                probe[1], min(math.ceil(loss / self.PROBE_BUDGET), self.MAX_COST_GAP))
            if probe[0] >= gap:
                probe[0], probe[1] = 0, min(2 * probe[1], self.max_probe_gap)
                self._probing = True
                return 1  # probe: keep alpha fresh
        else:
            probe[0] = 0
            if best:  # drafting pays again: probe promptly when it stops paying
                probe[1] = self.probe_every
        return best

    def update(self, fed: int, verify_s: float, drafted: int, accepted: int, draft_s: float,
               cls=None, asked: bool = False):
        """One step's outcome: `fed` tokens verified in `verify_s`, `drafted` of them drafts
        (a tree: its depth) of which `accepted` passed, `draft_s` spent drafting; `asked`: the
        drafter was asked for drafts (k > 0), whether or not it proposed any."""
        decay = 0.9
        probing, self._probing = self._probing, False
        if fed == 1 or not self.step_s:
            self.step_s = verify_s if not self.step_s else decay * self.step_s + (1 - decay) * verify_s
        else:
            x, y = fed - 1, min(max(verify_s / self.step_s - 1, 0.0), 3.0)
            self._fit = [0.95 * a + b for a, b in zip(self._fit, (1.0, x, y, x * x, x * y))]
            seen = self._width.setdefault(fed, [0.0, 0.0])
            seen[0], seen[1] = 0.9 * seen[0] + 1.0, 0.9 * seen[1] + y
        if drafted and accepted == drafted:  # all passed: probe promptly again
            self._probes.setdefault(cls, [0, self.probe_every])[1] = self.probe_every
        if drafted:
            # Per-position tests: `accepted` successes, then one failure unless all passed.
            tests = self._tests.setdefault(cls, [2.0, 1.0])
            tests[0] = self.ALPHA_DECAY * tests[0] + accepted
            tests[1] = self.ALPHA_DECAY * tests[1] + (1 if accepted < drafted else 0)
        if probing and (drafted or draft_s > 0):
            sums = self._probe_sums.setdefault(cls, [0.0, 0.0])
            sums[0], sums[1] = decay * sums[0] + draft_s, decay * sums[1] + 1
            if drafted and draft_s / drafted < self.draft_token_s(cls):
                # A probe costs a draft at least (its catch-up on top): one that came cheaper
                # than the drafts' price shows the price too high (a one-off cost, say, in the
                # first proposal), which nothing else would correct while the class rests.
                sums = self._draft_sums.setdefault(cls, [0.0, 0.0])
                sums[0], sums[1] = decay * sums[0] + draft_s, decay * sums[1] + drafted
        elif drafted or (asked and draft_s > 0):
            # Seconds per drafted token, counting the steps where the drafter was asked and
            # proposed nothing (a head below its confidence bar has run all the same): drafting
            # pays only if the drafts that are made also pay for those.
            sums = self._draft_sums.setdefault(cls, [0.0, 0.0])
            sums[0], sums[1] = decay * sums[0] + draft_s, decay * sums[1] + drafted
