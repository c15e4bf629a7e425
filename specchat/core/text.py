"""Text around the token stream: incremental detokenization, stop strings, chat prompts."""

from __future__ import annotations

import functools
from dataclasses import replace

from specchat.core.events import TokenEvent


class Detokenizer:
    """Turns token ids into text deltas that never split a multi-byte character.

    vLLM's scheme: decode a small window of recent tokens twice (with and without the new one)
    and emit the difference, holding it back while it ends in U+FFFD (an incomplete UTF-8
    sequence). Seeding the window with the prompt's last tokens keeps tokenizers that drop a
    leading space at the start of a decode from eating the reply's first space.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], seed_tokens: int = 4):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-seed_tokens:])
        self.prefix = 0  # window start
        self.read = len(self.ids)  # tokens before this are already emitted as text

    def _decode(self, ids: list[int]) -> str:
        return _decoded(self.tokenizer, tuple(ids))

    @property
    def incomplete(self) -> bool:
        """Tokens added whose text is still held back (an unfinished character)."""
        return self.read < len(self.ids)

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # wait for the rest of the character
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever is held back at the end of the reply (e.g. an invalid byte sequence)."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


@functools.lru_cache(maxsize=1 << 16)
def _decoded(tokenizer, ids: tuple[int, ...]) -> str:
    """The text of a short window of ids. The detokenizer's windows are mostly a token or two
    that came before (a reply's common tokens and pairs): remembered, a decode costs a lookup,
    not a tokenizer call of tens of microseconds at every step."""
    return tokenizer.decode(list(ids), skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)


def tokens_until_stop(tokenizer, context: list[int], draft: list[int],
                      stops: tuple[str, ...] | list[str]) -> int:
    """How many of `draft`'s tokens can matter after `context`: up to and including the one
    that completes a stop string, all of them when none does. The reply ends at a stop
    string, so verifying drafts past it only widens the target's forward. (N-gram lookup meets
    this at the end of nearly every reply: after a newline it copies the prompt's next
    "User: ..." line.)"""
    stops = [s for s in stops if s]
    if not stops or not draft:
        return len(draft)
    tail = context[-max(len(s) for s in stops):]  # a stop spans at most len(stop) tokens

    def ends_in_draft(ids: list[int]) -> bool:
        text = tokenizer.decode(tail + ids, skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
        return any(text.find(s, max(0, base - len(s) + 1)) >= 0 for s in stops)

    base = len(tokenizer.decode(tail, skip_special_tokens=False,
                                clean_up_tokenization_spaces=False))
    if not ends_in_draft(draft):  # the usual case: one decode
        return len(draft)
    return next(i for i in range(1, len(draft) + 1) if ends_in_draft(draft[:i]))


def stop_check(tokenizer, stops: tuple[str, ...] | list[str]):
    """ends(ids) -> True when the last of `ids` completes one of the stop strings (None when
    there are none). A stop string spans at most len(stop) tokens, so only the tail is decoded:
    cheap enough to call for every row of a batched decoding step."""
    stops = [s for s in stops if s]
    if not stops:
        return None
    n = max(map(len, stops)) + 1

    def ends(ids: list[int]) -> bool:
        text = tokenizer.decode(ids[-n:], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
        return any(s in text for s in stops)

    return ends


class ReplyText:
    """Decides which token events can be shown, and with what text.

    push(event, text) -> (events safe to show now, stop string found). An event is held back
    while its token ends an unfinished character, or while the text could be the start of a
    stop string. On a hit, the events before the stop string are released (the one containing
    its start is cut) and the rest dropped, so the concatenated texts are exactly the reply.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stops: tuple[str, ...] | list[str]):
        self.detok = Detokenizer(tokenizer, prompt_ids)
        self.stops = [s for s in stops if s]
        self.starts = "".join(sorted({s[0] for s in self.stops}))  # a stop string starts so
        self.pending: list[TokenEvent] = []

    def push(self, event: TokenEvent) -> tuple[list[TokenEvent], bool]:
        text = event.text = self.detok.add(event.id)
        if not self.pending and not self.detok.incomplete:
            for c in self.starts:
                if c in text:
                    break
            else:  # nothing held, and no stop string can start in this text: shown as it is
                return [event], False
        self.pending.append(event)
        if self.detok.incomplete:
            return [], False
        text = "".join(e.text for e in self.pending)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            return self._take(min(hits), cut=True), True
        hold = max((n for s in self.stops for n in range(1, len(s))
                    if text.endswith(s[:n])), default=0)
        return self._take(len(text) - hold, cut=False), False

    def _take(self, upto: int, cut: bool) -> list[TokenEvent]:
        """Release whole events within the first `upto` chars (with cut: the partial one too)."""
        out, used = [], 0
        while self.pending and used + len(self.pending[0].text) <= upto:
            used += len(self.pending[0].text)
            out.append(self.pending.pop(0))
        if cut and self.pending and used < upto:
            out.append(replace(self.pending[0], text=self.pending[0].text[:upto - used]))
        if cut:
            self.pending = []
        return out

    def finish(self, at_limit: bool = False) -> list[TokenEvent]:
        """The reply ended (not on a stop string): release what was held back. `at_limit`: it
        was cut by its token limit, and text that was held back as the start of a stop string
        is dropped: the model was beginning the format's next turn ("\nUser" of "\nUser:"),
        never the reply."""
        tail = self.detok.flush()
        if tail and self.pending:
            self.pending[-1].text += tail
        if at_limit and self.pending:
            text = "".join(e.text for e in self.pending)
            hold = max((n for s in self.stops for n in range(1, len(s))
                        if text.endswith(s[:n])), default=0)
            return self._take(len(text) - hold, cut=True)
        out, self.pending = self.pending, []
        return out


# Base models have no chat template: plain turns, and the next "User:" ends the reply.
PLAIN_ROLES = {"system": "", "user": "User: ", "assistant": "Assistant: "}
PLAIN_STOPS = ("\nUser:",)
# A base model continues text; the preamble tells it what kind of text this is: a short
# conversation in which the assistant answers each question directly. With a greeting alone a
# 270M base model answered every question with the same invented persona; with a single factual
# exchange it copied that answer to every greeting. A greeting and two factual exchanges on
# different subjects give on-topic answers (tests/test_real_model.py asks five questions).
PLAIN_PREAMBLE = (
    "A conversation between a user and a helpful, knowledgeable assistant. The assistant "
    "answers each question directly, correctly and in one or two full sentences.\n\n"
    "User: Hello!\n"
    "Assistant: Hello! What would you like to know?\n"
    "User: What is the largest planet in the solar system?\n"
    "Assistant: Jupiter is the largest planet in the solar system. It is a gas giant more than "
    "eleven times as wide as Earth.\n"
    "User: Why do we have seasons?\n"
    "Assistant: Earth's axis is tilted, so each hemisphere gets more direct sunlight for part "
    "of the year (summer) and less for the rest (winter).\n"
)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt(tokenizer, messages: list[dict]) -> tuple[list[int], tuple[str, ...]]:
    """Messages ({"role", "content"}) -> (prompt token ids, stop strings) for the next reply."""
    if has_chat_template(tokenizer):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids), ()
    parts = [] if any(m["role"] == "system" for m in messages) else [PLAIN_PREAMBLE]
    for m in messages:
        content = m["content"].strip()
        if m["role"] == "system":
            parts.append(content + "\n\n")
        else:
            parts.append(f"{PLAIN_ROLES[m['role']]}{content}\n")
    text = "".join(parts) + "Assistant:"
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    return list(ids), PLAIN_STOPS


def raw_prompt(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


# Markers of images, audio and video in multimodal vocabularies. Some conversions keep them as
# ordinary vocabulary entries (Gemma 3's <start_of_image> is not flagged special in its GGUF's
# tokenizer), so they are looked up by name as well as by the special flag.
MEDIA_MARKERS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_audio>",
                 "<end_of_audio>", "<audio_soft_token>", "[multimodal]", "<|image|>",
                 "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                 "<|video_pad|>", "<|audio|>")


def non_text_ids(tokenizer, keep: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """The ids of tokens that are not text: the tokenizer's special tokens (padding, BOS,
    unused slots, turn markers) and media markers, except `keep` (the end-of-text tokens, which
    end a reply). A reply never contains them: plain decoding and speculation both mask them
    (`Engine`), so a reply stays text and speculation stays lossless."""
    ids = {int(i) for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items()
           if getattr(added, "special", False)}
    ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
    unknown = getattr(tokenizer, "unk_token_id", None)
    for name in MEDIA_MARKERS:
        i = tokenizer.convert_tokens_to_ids(name)
        if isinstance(i, int) and i != unknown:
            ids.add(i)
    return sorted(ids - set(keep))
