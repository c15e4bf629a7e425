"""A serving engine behind an OpenAI-compatible API, driven as specchat's engine.

    engine = RemoteEngine("http://gpu-box:8000")           # vLLM, SGLang, llama-server, specchat
    prompt, stops = engine.chat_prompt([{"role": "user", "content": "Hi"}])
    for event in engine.stream(prompt, request(max_new_tokens=64)):
        ...  # TokenEvent, StepRecord, GenerationStats: what the local Engine yields

The server formats chats (its own template) and decodes; `stream` turns its SSE chunks into
specchat's events, with token kinds reduced to what the server reports:

- specchat (`python -m specchat serve`): every token's kind and every step record, exact.
- llama.cpp's llama-server: with `timings_per_token` each chunk carries the reply's running
  `draft_n` / `draft_n_accepted` and `predicted_n` (tokens so far). The counters grow just
  before a verify step's tokens are sent, so a jump of (d drafted, a accepted) marks the next a
  tokens accepted and the one after resampled (a < d) or bonus (a = d); tokens with no jump come
  from plain steps. `predicted_n` counts the tokens of chunks that carry no text (held back
  while they may begin a stop string) or several (a character split across tokens): those
  become tokens with "" text, as the local engine emits them. llama-server sends no counters
  until its first draft, so a speculating server's tokens are `served` until then, and `target`
  once a counter shows they were plain steps.
- vLLM (`--per-request-spec-decode-metrics`) and SGLang (`return_spec_tokens_details`) report
  per reply only: their tokens are `served` (the kind for "the server did not say"), and the
  reply's drafted / accepted counts go into the stats.

A reply that was asked to speculate on a server that sent no draft counts at all gets
`RemoteStats.drafts_reported = False`: its tokens stay `served`, its acceptance and target
passes unknown (0), and the page says "this server does not report drafts" rather than showing
a speculative turn with nothing drafted. The timing is what the client sees (request to last
chunk), for every server alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from specchat.core.events import (
    ACCEPTED,
    BONUS,
    RESAMPLED,
    SERVED,
    TARGET,
    GenerationStats,
    StepRecord,
    TokenEvent,
    summarize,
)
from specchat.core.request import GenerateConfig
from specchat.core.settings import request

SERVERS = {"specchat": "specchat", "llamacpp": "llama.cpp", "vllm": "vLLM", "sglang": "SGLang"}

# What each server tells about how a token was produced, in words for the page.
PROVENANCE = {
    "specchat": "Token kinds and step records come from the specchat server, exactly.",
    "llama.cpp": ("Token kinds are rebuilt from llama-server's per-chunk draft counters: "
                  "accepted, resampled and bonus as it verified them; it sends no drafts, so "
                  "the inspector has no refused text or probabilities to show."),
    "vLLM": ("vLLM reports speculation per reply (with --per-request-spec-decode-metrics), "
             "not per token: tokens are shown as 'served', the reply's acceptance is in its "
             "stats."),
    "SGLang": ("SGLang reports speculation per reply (return_spec_tokens_details), not per "
               "token: tokens are shown as 'served', the reply's acceptance is in its stats."),
}
GENERIC = ("This server does not report how tokens were produced: they are shown as "
           "'served'; speed is measured, acceptance is unknown.")


class BackendError(RuntimeError):
    """The server could not be reached or refused the request; the message says which."""


@dataclass
class RemotePrompt:
    """What a remote server continues: chat messages (its template applies), plain text, or
    token ids (the bench sends llama-server the very ids specchat's engine gets)."""
    messages: list[dict] | None = None
    text: str | None = None
    ids: list[int] | None = None


@dataclass
class RemoteTarget:
    name: str  # the server's model id
    url: str
    server: str  # "specchat", "llama.cpp", "vLLM", "SGLang" or "OpenAI-compatible"
    quantization: str = "served"

    @property
    def label(self) -> str:
        # llama-server names its model by the file it loaded: the file name says enough
        name = self.name.rsplit("/", 1)[-1] if self.name.startswith("/") else self.name
        return f"{name} [{self.server} server at {self.url}]"


@dataclass
class RemoteStats(GenerationStats):
    """The stats of a served reply: GenerationStats, and whether the server said how it drafted."""
    # False: the reply was to speculate, and the server sent no draft counts (a llama-server
    # whose drafts never showed in `draft_n`, a vLLM without --per-request-spec-decode-metrics):
    # tokens are 'served', acceptance and target passes unknown.
    drafts_reported: bool = True


@dataclass
class RemoteDevice:
    type: str = "remote"


@dataclass
class _Counters:
    """llama-server's running draft counters, and the verify step they announce."""
    drafted: int = 0
    accepted: int = 0
    group: list[str] = field(default_factory=list)  # kinds still due for the open step


class RemoteEngine:
    """An OpenAI-compatible server with the local Engine's interface (`stream`, `drafters`,
    `target`, `chat_prompt`, `text_prompt`). `plain_url`: a second server without speculation,
    for the plain run of races where the first cannot turn its drafts off per request
    (llama-server, vLLM and SGLang set speculation at launch; specchat's can)."""

    remote = True
    row_exact = False
    tokenizer = None
    chats = True  # the server applies its own chat template
    greedy_trees = ()  # `Engine.greedy_trees`: the server drafts as it was launched to

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 plain_url: str | None = None, timeout: float = 600.0):
        from openai import OpenAI

        self.url = url.rstrip("/").removesuffix("/v1")
        self.client = OpenAI(base_url=f"{self.url}/v1", api_key=api_key or "none",
                             max_retries=0, timeout=timeout)
        self.plain = RemoteEngine(plain_url, api_key, model, timeout=timeout) \
            if plain_url else None
        self.lock = threading.Lock()
        self._fresh = False
        self.last_usage: dict = {}
        self.last_timings: dict = {}  # llama-server's timings of the last reply
        self.last_prompt_ids: list[int] | None = None  # the last prompt sent as token ids
        self.device = RemoteDevice()
        name, owner = self._model(model)
        self.target = RemoteTarget(name, self.url, SERVERS.get(owner, "OpenAI-compatible"))
        self.provenance = PROVENANCE.get(self.target.server, GENERIC)
        self.speculates = self._speculates()
        # One entry, the server's own speculation ("server"), so the page's drafter choice and
        # the speculation switch work as for local drafters.
        self.drafters = {"server": None} if self.speculates is not False else {}

    # -- connecting ------------------------------------------------------------------------

    def _model(self, wanted: str | None) -> tuple[str, str]:
        import openai
        try:
            models = list(self.client.models.list())
        except openai.APIStatusError as e:
            raise BackendError(f"{self.url} refused the model list ({e.status_code}): "
                               f"{_message(e)}") from None
        except openai.APIError as e:
            raise BackendError(f"cannot reach an OpenAI-compatible server at {self.url}: "
                               f"{e}") from None
        if not models:
            raise BackendError(f"{self.url} serves no model")
        chosen = next((m for m in models if m.id == wanted), None) if wanted else models[0]
        if chosen is None:
            raise BackendError(f"{self.url} does not serve {wanted!r}; it serves "
                               f"{', '.join(m.id for m in models)}")
        return chosen.id, str(getattr(chosen, "owned_by", "") or "").lower()

    def _speculates(self) -> bool | None:
        """Whether the server drafts at all: llama-server says so per slot in /slots; specchat
        whenever it has a drafter; the others do not say (None)."""
        if self.target.server == "specchat":
            return True
        if self.target.server != "llama.cpp":
            return None
        import httpx
        try:
            slots = httpx.get(f"{self.url}/slots", timeout=10,
                              headers={"Authorization": f"Bearer {self.client.api_key}"}).json()
        except (httpx.HTTPError, ValueError):
            return None
        if not isinstance(slots, list):
            return None
        return any(isinstance(s, dict) and s.get("speculative") for s in slots)

    # -- prompts -----------------------------------------------------------------------------

    def chat_prompt(self, messages: list[dict]) -> tuple[RemotePrompt, list[str]]:
        return RemotePrompt(messages=[dict(m) for m in messages]), []

    def text_prompt(self, text: str) -> tuple[RemotePrompt, tuple]:
        return RemotePrompt(text=text), ()

    def prime(self, ids: list[int]) -> None:
        """Leave `ids` in the server's prompt cache (llama-server keeps a slot's last prompt):
        one untimed request for a single token. Errors are the caller's to see on the next
        reply."""
        body = self._request(RemotePrompt(ids=list(ids)), request(max_new_tokens=1))
        body["stream"] = False
        body.pop("stream_options", None)
        try:
            self.client.completions.create(**body)
        except Exception:  # noqa: BLE001 (the timed request that follows reports the server)
            return
        self.last_prompt_ids = list(ids)

    def reset_cache(self) -> None:
        """The next request encodes its whole prompt (llama-server: no prompt cache), as a
        first turn does on the local engine after its own reset."""
        self._fresh = True
        if self.plain is not None:
            self.plain.reset_cache()

    def context_window(self) -> int | None:
        return None

    # -- generation ----------------------------------------------------------------------------

    def _request(self, prompt: RemotePrompt, cfg: GenerateConfig) -> dict:
        body: dict = {"model": self.target.name, "max_tokens": cfg.max_new_tokens,
                      "stream": True, "stream_options": {"include_usage": True}}
        if cfg.stop:
            body["stop"] = list(cfg.stop)
        server = self.target.server
        fields, extra = sampling_fields(cfg, server)
        body.update(fields)
        if server == "specchat":
            extra.update(speculation=cfg.speculation, draft_len=cfg.draft_len,
                         adaptive=cfg.adaptive)
        elif server == "llama.cpp":
            extra["timings_per_token"] = True
            if self._fresh:
                extra["cache_prompt"] = False
                self._fresh = False
        elif server == "SGLang":
            extra["return_spec_tokens_details"] = True
        if extra:
            body["extra_body"] = extra
        if prompt.messages is not None:
            body["messages"] = prompt.messages
        else:
            body["prompt"] = prompt.ids if prompt.ids is not None else prompt.text
        return body

    def stream(self, prompt: RemotePrompt, cfg: GenerateConfig,
               stop_event: threading.Event | None = None,
               ) -> Iterator[TokenEvent | StepRecord | GenerationStats]:
        """The reply as the local Engine yields it: TokenEvents, StepRecords, the stats last."""
        if not cfg.speculation and self.speculates is not False and \
                self.target.server != "specchat":
            if self.plain is None:
                raise BackendError(
                    f"the {self.target.server} server at {self.url} speculates on every "
                    "request; start a second one without a draft and pass it as "
                    "--backend-plain URL to compare")
            yield from self.plain.stream(prompt, cfg, stop_event)
            return
        import openai

        body = self._request(prompt, cfg)
        chat = prompt.messages is not None
        create = self.client.chat.completions.create if chat else self.client.completions.create
        speculates = cfg.speculation and bool(self.drafters)
        stats = RemoteStats.for_config(cfg, speculates, "server" if speculates else "none")
        reader = _Reader(self.target.server, bool(self.speculates))
        steps: list[StepRecord] = []
        with self.lock:
            start = time.perf_counter()
            try:
                response = create(**body)
            except openai.APIStatusError as e:
                raise BackendError(f"the server refused the request ({e.status_code}): "
                                   f"{_message(e)}") from None
            except openai.APIError as e:
                raise BackendError(f"the server at {self.url} failed: {e}") from None
            try:
                for chunk in response:
                    data = chunk.model_dump(exclude_unset=True)
                    now = time.perf_counter()
                    for event in reader.read(data, now - start):
                        if isinstance(event, TokenEvent):
                            if stats.new_tokens == 0:
                                stats.ttft_s = now - start
                            stats.new_tokens += 1
                        else:
                            steps.append(event)
                        yield event
                    if stop_event is not None and stop_event.is_set():
                        stats.stop_reason = "stopped"
                        break
            except openai.APIError as e:
                stats.stop_reason, stats.error = "error", f"the server failed mid-reply: {e}"
            finally:
                response.close()
            stats.seconds = time.perf_counter() - start
        for event in reader.flush(stats.seconds):
            steps.append(event)
            yield event
        self.last_usage = dict(reader.usage)  # the server's own token counts
        self.last_timings = dict(reader.timings)
        if prompt.ids is not None:
            self.last_prompt_ids = list(prompt.ids)
        yield reader.finish(summarize(steps, stats))


# Samplers beyond temperature, top-p and top-k: their defaults (off), and the name each kind of
# server takes them by in the request (None: it has no such setting). OpenAI's own
# frequency_penalty and presence_penalty are top-level fields everywhere; the rest go in the
# body beside them, by llama.cpp's names where a server is not known to name them otherwise.
_OFF = request()
_VLLM_NAMES = {"min_p": "min_p", "repeat_penalty": "repetition_penalty", "repeat_last_n": None,
               "dry_multiplier": None, "dry_base": None, "dry_allowed_length": None,
               "dry_sequence_breakers": None}
SAMPLER_NAMES = {"vLLM": _VLLM_NAMES, "SGLang": _VLLM_NAMES}


def sampling_fields(cfg: GenerateConfig, server: str) -> tuple[dict, dict]:
    """(the request's OpenAI fields, its extra body fields) that set `cfg`'s sampling: the
    temperature, top-p and seed, top-k where set, and `samplers`."""
    fields = {"temperature": cfg.temperature, "top_p": cfg.top_p}
    if cfg.seed is not None:
        fields["seed"] = cfg.seed
    extra = {"top_k": cfg.top_k} if cfg.top_k else {}
    top, extras = samplers(cfg, server)
    return {**fields, **top}, {**extra, **extras}


def samplers(cfg: GenerateConfig, server: str) -> tuple[dict, dict]:
    """(OpenAI fields, extra body fields) for the samplers `cfg` sets away from their defaults,
    each by the name `server` takes. A window or DRY setting that changes the reply and that the
    server has no counterpart for raises BackendError rather than being dropped unsaid."""
    top = {name: getattr(cfg, name) for name in ("frequency_penalty", "presence_penalty")
           if getattr(cfg, name) != getattr(_OFF, name)}
    penalized = top or cfg.repeat_penalty != _OFF.repeat_penalty
    names = SAMPLER_NAMES.get(server, {})
    extra, missing = {}, []
    for setting in ("min_p", "repeat_penalty", "repeat_last_n", "dry_multiplier", "dry_base",
                    "dry_allowed_length", "dry_sequence_breakers"):
        value = getattr(cfg, setting)
        if value == getattr(_OFF, setting):
            continue
        matters = (setting != "repeat_last_n" or penalized) and \
            (not setting.startswith("dry_") or cfg.dry_multiplier != _OFF.dry_multiplier)
        name = names.get(setting, setting)
        if name is None:
            if matters:
                missing.append(setting)
            continue
        extra[name] = list(value) if isinstance(value, tuple) else value
    if missing:
        raise BackendError(f"the {server} server has no setting for {', '.join(missing)}; "
                           "leave it at its default with this backend")
    return top, extra


class _Reader:
    """Turns one server's chunks into TokenEvents and StepRecords, and its final chunk's
    counters into the reply's stats."""

    def __init__(self, server: str, speculates: bool):
        self.server, self.speculates = server, speculates
        self.step = 0
        self.counters = _Counters()
        self.open: StepRecord | None = None  # llama.cpp: the verify step being received
        self.step_started = 0.0
        self.usage: dict = {}
        self.timings: dict = {}  # the last chunk's llama-server timings
        self.finish_reason = ""
        self.counts: dict | None = None  # per-reply counters (vLLM, SGLang, llama.cpp)
        self.server_stats: dict | None = None  # specchat's stats object
        self.decoded = 0  # llama.cpp: tokens its chunks have counted so far (`predicted_n`)
        self.counted = False  # llama.cpp: a chunk carried draft counters
        self.unsaid: list[TokenEvent] = []  # llama.cpp: tokens sent before any counter

    def read(self, data: dict, elapsed: float) -> Iterator[TokenEvent | StepRecord]:
        if data.get("usage"):
            self.usage = data["usage"]
        timings = data.get("timings") or {}
        if timings:
            self.timings = timings
        if self.server == "vLLM":
            spec = (data.get("metrics") or {}).get("speculative_decoding")
            if spec:
                self.counts = {"drafted": spec.get("num_draft_tokens", 0),
                               "accepted": spec.get("num_accepted_draft_tokens", 0),
                               "steps": spec.get("num_spec_steps", 0)}
        elif self.server == "SGLang":
            spec = (data.get("sglext") or {}).get("spec_tokens_details")
            if isinstance(spec, dict) and spec.get("spec_verify_ct"):
                self.counts = {"steps": int(spec["spec_verify_ct"])}
        for choice in data.get("choices") or []:
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            extension = choice.get("specchat") or {}
            if extension.get("stats"):
                self.server_stats = extension["stats"]
            text = (choice.get("delta") or {}).get("content") if "delta" in choice \
                else choice.get("text")
            if self.server == "specchat" and "kinds" in extension:
                yield from self._specchat(extension)
            elif self.server == "llama.cpp":
                yield from self._llama(text or "", timings, elapsed)
            elif text:  # no per-token word from the server
                self.step += 1
                yield TokenEvent(-1, text, SERVED, self.step, 0, 0)
        ext = data.get("specchat") or {}
        if ext.get("stats"):
            self.server_stats = ext["stats"]
        if self.server == "llama.cpp" and "draft_n" in timings and self.server_stats is None:
            self.counts = {"drafted": timings["draft_n"],
                           "accepted": timings.get("draft_n_accepted", 0)}

    def _specchat(self, ext: dict) -> Iterator[TokenEvent | StepRecord]:
        ids = ext.get("ids") or [-1] * len(ext["kinds"])
        records = {r["step"]: StepRecord.from_json(r) for r in ext.get("records") or []}
        for token, text, kind, step in zip(ids, ext["texts"], ext["kinds"], ext["steps"]):
            record = records.get(step)
            yield TokenEvent(token, text, kind, step, record.drafted if record else 0,
                             record.accepted if record else 0)
        yield from records.values()

    def _llama(self, text: str, timings: dict, elapsed: float
               ) -> Iterator[TokenEvent | StepRecord]:
        """One llama-server chunk: as many tokens as `predicted_n` grew by (one per chunk with
        text where it is absent), the chunk's text on the last of them."""
        if "draft_n" in timings and not self.counted:
            self.counted = True
            for event in self.unsaid:  # no counter so far meant no draft so far: plain steps
                event.kind = TARGET
            self.unsaid.clear()
        decoded = timings.get("predicted_n")
        if isinstance(decoded, int) and decoded > self.decoded:
            count, self.decoded = decoded - self.decoded, decoded
        else:
            count = 1 if text else 0
        for i in range(count):
            yield from self._token(text if i == count - 1 else "", timings if i == 0 else {},
                                   elapsed)

    def _token(self, text: str, timings: dict, elapsed: float
               ) -> Iterator[TokenEvent | StepRecord]:
        """One llama-server token, its kind read from the counters' jump (if any)."""
        drafted = timings.get("draft_n", self.counters.drafted)
        accepted = timings.get("draft_n_accepted", self.counters.accepted)
        new_drafts, new_accepted = drafted - self.counters.drafted, \
            accepted - self.counters.accepted
        self.counters.drafted, self.counters.accepted = drafted, accepted
        if new_drafts > 0 or not self.counters.group:
            yield from self._close(elapsed)
            self.step += 1
            if new_drafts > 0:  # a verify step: its accepted drafts, then the target's token
                last = BONUS if new_accepted >= new_drafts else RESAMPLED
                self.counters.group = [ACCEPTED] * new_accepted + [last]
                self.open = StepRecord(self.step, new_drafts, new_accepted, 0, 0.0, 0.0,
                                       k=new_drafts)
            else:  # a speculating server that has not said so far: "served" until it does
                self.counters.group = [SERVED if self.speculates and not self.counted
                                       else TARGET]
                self.open = StepRecord(self.step, 0, 0, 0, 0.0, 0.0)
        kind = self.counters.group.pop(0)
        self.open.emitted += 1
        event = TokenEvent(-1, text, kind, self.step, self.open.drafted, self.open.accepted)
        if kind == SERVED:
            self.unsaid.append(event)
        yield event
        if not self.counters.group:
            yield from self._close(elapsed)

    def _close(self, elapsed: float) -> Iterator[StepRecord]:
        if self.open is not None:
            self.open.verify_s = max(elapsed - self.step_started, 0.0)
            self.step_started = elapsed
            yield self.open
            self.open = None

    def flush(self, elapsed: float) -> Iterator[StepRecord]:
        yield from self._close(elapsed)

    def finish(self, stats: GenerationStats) -> GenerationStats:
        """The reply's stats, summarized from its step records, completed with what only the
        server knows."""
        if self.server_stats:  # specchat: what its engine counted beyond the steps
            for key in ("prefill_tokens", "prompt_tokens", "target_calls", "drafter",
                        "tree_nodes"):
                if key in self.server_stats:
                    setattr(stats, key, self.server_stats[key])
        elif self.counts and not stats.drafted:  # per-reply counters only
            stats.drafted = self.counts.get("drafted", stats.drafted)
            stats.accepted = self.counts.get("accepted", stats.accepted)
            if "steps" in self.counts and not self.counts.get("drafted"):
                # SGLang: each verify emits its accepted drafts plus one token
                stats.accepted = max(stats.new_tokens - self.counts["steps"], 0)
            stats.acceptance_rate = stats.accepted / stats.drafted if stats.drafted else 0.0
        if self.server == "llama.cpp":
            stats.target_calls = served_target_calls(stats.new_tokens, stats.accepted,
                                                     self.step)
        elif self.counts and self.counts.get("steps"):
            stats.target_calls = self.counts["steps"] + 1
        told = self.server_stats or self.counts or self.counted
        if stats.speculation and not told and isinstance(stats, RemoteStats):
            stats.drafts_reported = False
            stats.target_calls = 0  # unknown: how many tokens each pass gave is not said
        if self.usage:
            stats.prompt_tokens = self.usage.get("prompt_tokens") or stats.prompt_tokens
        if not stats.stop_reason:
            stats.stop_reason = {"length": "length"}.get(self.finish_reason, "eos")
        stats.tokens_per_s = stats.new_tokens / stats.seconds if stats.seconds > 0 else 0.0
        return stats


def served_target_calls(tokens: int, accepted: int, steps: int = 0) -> int:
    """Target forward passes behind a served reply of `tokens` tokens, `accepted` of them
    accepted drafts: each pass, the prompt's included, gives one token of its own after the
    drafts it accepted, so tokens - accepted; never fewer than the `steps` seen."""
    return max(tokens - accepted, steps, 1 if tokens else 0)


def _message(error) -> str:
    body = getattr(error, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return str(getattr(error, "message", error))
