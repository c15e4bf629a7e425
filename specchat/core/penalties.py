"""Samplers that reshape the target's logits from the text so far: repetition, frequency and
presence penalties, and DRY ("don't repeat yourself").

    shaper = Shaper.build(penalties, tokenizer)   # None when every penalty is off
    rows = shaper.shape(logits, context, [[], [d0], [d0, d1]])  # row r continues context + extras[r]

Each penalty is a function of one row's prefix (the prompt and the reply up to that position)
and nothing else, so it reshapes a row the same way whether the row came from plain decoding,
from a chain's verify forward (row i continues the context plus drafts 0..i-1) or from a node of
a draft tree (the context plus the node's ancestors). Applied before the sampling test, it keeps
speculation lossless: greedy replies and seeded sampled replies are plain decoding's, token for
token, with every penalty on (tests/test_penalties.py).

The definitions follow llama.cpp's, with OpenAI's names where OpenAI has the setting:
- repeat_penalty r over the last `repeat_last_n` tokens: a logit l of a token in that window
  becomes l / r when l > 0, l * r otherwise (Keskar et al. 2019, CTRL);
- frequency_penalty f and presence_penalty p over the same window: l -= f * count + p * [count > 0]
  (OpenAI's definition);
- DRY (p-e-w, 2024): where the text ends with a sequence that occurred earlier followed by token t,
  t's logit drops by multiplier * base ** (n - allowed_length), n the length of the repeated
  sequence, once n >= allowed_length. A sequence breaker (a token whose text holds one of the
  breaker strings: newlines, colons, quotes, asterisks) ends a match, so the formats of lists and
  dialogues can repeat.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

DRY_BREAKERS = ("\n", ":", '"', "*")
# Longest repeat DRY measures: base ** 60 already pushes any logit out of reach.
_DRY_MAX_MATCH = 64


@dataclass(frozen=True)
class Penalties:
    repeat_penalty: float = 1.0  # 1 = off
    repeat_last_n: int = 64  # the window of the three penalties above, in tokens (0 = off)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    dry_multiplier: float = 0.0  # 0 = DRY off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[str, ...] = DRY_BREAKERS

    @property
    def windowed(self) -> bool:
        return self.repeat_last_n > 0 and (self.repeat_penalty != 1.0 or self.frequency_penalty != 0
                                           or self.presence_penalty != 0)

    @property
    def dry(self) -> bool:
        return self.dry_multiplier > 0

    @property
    def active(self) -> bool:
        return self.windowed or self.dry

    def names(self) -> list[str]:
        """The penalties that are on, as the step card and the stats name them."""
        out = []
        if self.windowed:
            for label, value, off in (("repeat penalty", self.repeat_penalty, 1.0),
                                      ("frequency penalty", self.frequency_penalty, 0.0),
                                      ("presence penalty", self.presence_penalty, 0.0)):
                if value != off:
                    out.append(f"{label} {value:g} (last {self.repeat_last_n} tokens)")
        if self.dry:
            out.append(f"DRY {self.dry_multiplier:g} (base {self.dry_base:g}, allowed length "
                       f"{self.dry_allowed_length})")
        return out


@dataclass
class Shaper:
    """Penalties bound to a tokenizer (which tokens break DRY's sequences)."""
    penalties: Penalties
    tokenizer: object
    _breaks: dict[int, bool] = field(default_factory=dict)
    dry: bool = field(init=False)  # DRY is on (`Penalties.dry`, read at every step)

    def __post_init__(self):
        self.dry = self.penalties.dry

    @classmethod
    def build(cls, penalties: Penalties, tokenizer, memo: dict | None = None) -> Shaper | None:
        """None when every penalty is off. `memo` (a dict the caller keeps): which tokens break
        sequences, remembered across requests with the same breakers."""
        if not penalties.active:
            return None
        breaks = {} if memo is None else memo.setdefault(penalties.dry_sequence_breakers, {})
        return cls(penalties, tokenizer, breaks)

    def shape(self, logits: torch.Tensor, context: list[int],
              extras: list[list[int]]) -> torch.Tensor:
        """logits [n, vocab] -> new float32 CPU logits, row r reshaped for the prefix
        context + extras[r]."""
        return self.shape_(logits.float().cpu().clone(), context, extras)

    def shape_(self, logits: torch.Tensor, context: list[int] | np.ndarray,
               extras: list[list[int]]) -> torch.Tensor:
        """`shape` in place, on float32 CPU logits the caller owns; returns them. `context`
        may come as an int64 array already (the engine keeps one)."""
        base = np.asarray(context, dtype=np.int64)
        rows = logits.numpy()  # shares the logits' memory
        for r, extra in enumerate(extras):
            prefix = np.concatenate([base, np.asarray(extra, dtype=np.int64)]) if extra else base
            self._shape_values(rows[r], prefix, None)
        return logits

    def shape_row(self, row: torch.Tensor, prefix: np.ndarray,
                  index: torch.Tensor | None = None) -> None:
        """Reshape one float32 row in place for the tokens `prefix` before it. The row covers
        the whole vocabulary, or with `index` (a drafter's reduced vocabulary) token t is
        row[index[t]], and tokens with index -1 are not in the row.

        Only the window's tokens and DRY's continuations change, a few dozen of the row's
        entries: they are read and written through a numpy view of the row, in float32
        scalars. The arithmetic is torch's to the bit (IEEE float32, each Python number
        rounded to float32 first, as torch rounds a scalar operand: tests/test_penalties.py
        checks it against a torch reference), at a fraction of the cost: right after a
        forward, when the caches hold none of the code, each array call costs tens of
        microseconds."""
        self._shape_values(row.numpy(), prefix, None if index is None else index.numpy())

    def _shape_values(self, values: np.ndarray, prefix: np.ndarray,
                      places: np.ndarray | None) -> None:
        """`shape_row` on the row's float32 values (token t at values[places[t]])."""
        pen = self.penalties
        if pen.windowed:
            self._windowed(values, prefix, places)
        if pen.dry:
            for token, length in self.dry_matches(prefix).items():
                at = token if places is None else places[token]
                if length >= pen.dry_allowed_length and at >= 0:
                    values[at] -= np.float32(pen.dry_multiplier * pen.dry_base ** (
                        length - pen.dry_allowed_length))

    def _windowed(self, values: np.ndarray, prefix: np.ndarray,
                  places: np.ndarray | None) -> None:
        """The repeat, frequency and presence penalties over the window, on a row's values:
        a loop over the window's few distinct tokens, in float32 scalars (half the cost of
        the same arithmetic in array calls, right after a forward)."""
        pen = self.penalties
        window = prefix[-pen.repeat_last_n:].tolist()
        counts = Counter(window) if pen.frequency_penalty != 0 else dict.fromkeys(window, 0)
        r, f, p = (np.float32(x) for x in (pen.repeat_penalty, pen.frequency_penalty,
                                           pen.presence_penalty))
        for token, count in counts.items():
            at = token if places is None else places[token]
            if at < 0:  # not in the reduced vocabulary
                continue
            value = values[at]
            if r != 1:
                value = value / r if value > 0 else value * r
            if f != 0:
                value = value - np.float32(count) * f
            if p != 0:
                value = value - p
            values[at] = value

    def dry_matches(self, prefix: np.ndarray) -> dict[int, int]:
        """token t -> the length of the longest sequence that ends the prefix and that also
        occurred earlier followed by t (breakers end sequences). Vectorized over the earlier
        occurrences of the last token: the tokens before each one are compared with the
        prefix's own tail in one [occurrences, reach] pass, `reach` the tail's run of tokens
        without a breaker (no match reaches past it)."""
        n = len(prefix)
        if n < 2 or self.is_breaker(int(prefix[-1])):
            return {}
        starts = np.flatnonzero(prefix[:-1] == prefix[-1])  # earlier places of the last token
        following = prefix[starts + 1].tolist()
        ok = [not self.is_breaker(t) for t in following]
        if not all(ok):
            starts = starts[ok]
            following = [t for t, keep in zip(following, ok) if keep]
        if not following:
            return {}
        limit = min(_DRY_MAX_MATCH, n - 1) - 1  # the most tokens a match adds before the last
        tail = prefix[n - 1 - limit:n - 1][::-1]  # prefix[n - 2], prefix[n - 3], ...
        reach = 0
        for token in tail.tolist():
            if self.is_breaker(token):
                break
            reach += 1
        lengths = np.ones(len(starts), dtype=np.int64)
        if reach:
            back = starts[:, None] - np.arange(1, reach + 1)  # [occurrences, reach]
            same = (back >= 0) & (prefix[np.maximum(back, 0)] == tail[:reach])
            lengths += np.cumprod(same, axis=1).sum(axis=1)  # each row's leading run
        best: dict[int, int] = {}
        for t, length in zip(following, lengths.tolist()):
            best[t] = max(best.get(t, 0), length)
        return best

    def is_breaker(self, token: int) -> bool:
        """Whether the token's text holds one of DRY's sequence breakers (remembered)."""
        hit = self._breaks.get(token)
        if hit is None:
            text = self.tokenizer.decode([token])
            hit = self._breaks[token] = any(b in text for b in self.penalties.dry_sequence_breakers)
        return hit
