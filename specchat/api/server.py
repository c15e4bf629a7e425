"""An OpenAI-compatible HTTP API over the engine, with per-token provenance.

    app = create_app(report, store)            # a FastAPI app; `python -m specchat serve` runs it
    gradio_app.include_router(api_router(Api(lambda: slot.report, store, logins=...)))  # app.py
    GET  /v1/models
    GET  /v1/models/{id}
    POST /v1/chat/completions                  # messages, in the model's chat format
    POST /v1/completions                       # a prompt the model continues
    POST /v1/race                              # either request, plainly and by every drafter

Requests take OpenAI's fields (max_tokens, temperature, top_p, seed, stop, stream, the
penalties), llama.cpp's (top_k, min_p, repeat_penalty, dry_*) and specchat's own (speculation,
drafter, draft_len). What no other server gives: each streamed chunk carries its tokens' kinds
(`"specchat": {"kinds": [...], "steps": [...]}`), and the last one llama.cpp-compatible
`timings` (draft_n, draft_n_accepted, cache_n, ...) and specchat's own stats, so clients written
for llama-server read it unchanged. The model's id is a slug of the target's name
(`model_slug`: "gemma-3-270m"); its display name is in the model object's `specchat` field.

Settings pass the same check as the page and the CLI (`core.settings.build_config`), and the
same caps. One reply is generated at a time, the page's included, in fair turns: requests wait
in the engine's queue (`engine_queue.py`, round-robin over owners) as coroutines, holding no
thread. A request whose owner has `MAX_PER_OWNER` waiting already, or one waiting while
`MAX_WAITING` wait in all, gets 429 saying which limit it met, with `Retry-After`; an owner
with nothing waiting always gets a place. Each reply runs in a thread of its
own; a client that goes away stops it at the next step, frees the engine, and its turn is
recorded as interrupted. Errors are OpenAI error objects with the HTTP status that says whose
fault it was. Turns are saved to the stats database in the background, owned by the API key's
name, or by the login whose "user:password" is the bearer token (the same owner as that login's
page: the Stats tab shows API turns too), or "api" where no key is needed.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import replace

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from specchat.auth import LoginGuard, TooManyAttempts
from specchat.core.events import GenerationStats, StepRecord, TokenEvent
from specchat.core.inputs import InputError, clean_text
from specchat.core.race import PLAIN
from specchat.core.race import lanes as race_lanes
from specchat.core.request import GenerateConfig
from specchat.core.settings import SETTINGS, build_config, values_from_body
from specchat.engine_queue import (
    MAX_PER_OWNER,
    MAX_WAITING,
    EngineQueue,
    Finished,
    LoopPost,
    QueueFull,
    run_reply,
)
from specchat.stats.race import standings
from specchat.stats.race import Entry as RaceEntry
from specchat.stats.race import winner as race_winner
from specchat.stats.store import StatsStore
from specchat.stats.writer import StatsWriter

# The line's limits (engine_queue.MAX_WAITING, MAX_PER_OWNER) are the page's too: past 8
# waiting, a request whose key or login has one waiting already gets 429; while another key or
# login waits too, one with 2 waiting gets 429 (one owner cannot crowd the others out). A lone
# client's batch waits its turn, as llama-server and vLLM queue one.
RETRY_AFTER_S = 5
# How often a request that is not streaming checks whether its client is still there, while it
# waits for the engine and while its reply is made: a client that left frees its place.
GONE_POLL_S = 0.25
MISSING_KEY = "A valid API key is required: send 'Authorization: Bearer KEY'."
MAX_INPUT_CHARS = 16000
MAX_TOKENS_CAP = 1024
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings a request may give, and their length
# OpenAI fields specchat cannot honour: refused by name rather than ignored. A value equal to
# the default (n: 1, logprobs: false, response_format: text, ...) is accepted.
# llama.cpp's own fields for what specchat does not do (grammars, other samplers, token
# probabilities) are refused the same way.
UNSUPPORTED = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
               "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
               "functions": (None, []), "function_call": (None, "none"),
               "n_probs": (None, 0), "grammar": (None, ""), "json_schema": (None, {}),
               "typical_p": (None, 1), "mirostat": (None, 0), "xtc_probability": (None, 0),
               "ignore_eos": (None, False)}

log = logging.getLogger("specchat.api")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.headers = headers

    def response_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.response_body(), self.status, headers=self.headers)


class Api:
    """The engine behind the routes: request parsing, one generation at a time, recording."""

    def __init__(self, report, store: StatsStore | None = None,
                 api_keys: dict[str, str] | None = None,
                 logins: list[tuple[str, str]] | None = None,
                 max_input_chars: int = MAX_INPUT_CHARS, max_tokens_cap: int = MAX_TOKENS_CAP,
                 writer: StatsWriter | None = None, redact=str, guard: LoginGuard | None = None):
        # `report`: a LoadReport, or a function returning one (None while the models load).
        self._report = report if callable(report) else (lambda: report)
        self.store = store or StatsStore.open_or_disabled("off")
        self.writer = writer or StatsWriter(self.store)
        self.api_keys = api_keys or {}  # key -> owner name
        # The page's logins: "user:password" is accepted as a bearer token, checked (and its
        # failures throttled and logged) by the page's guard when it shares one, else by ours.
        self.logins = bool(logins)
        self.guard = guard or LoginGuard(logins or [])
        self.max_input_chars, self.max_tokens_cap = max_input_chars, max_tokens_cap
        self.max_waiting = MAX_WAITING  # past this many waiting, 429 for an owner with one
        self.max_per_owner = MAX_PER_OWNER  # ... or this many of its owner's
        self.started = int(time.time())
        self.redact = redact  # model names as visitors may see them (paths cut on exposed pages)

    @property
    def report(self):
        report = self._report()
        if report is None:
            raise ApiError(503, "The models are still loading; retry in a moment.",
                           "server_error")
        return report

    @property
    def engine(self):
        return self.report.engine

    def pinned(self) -> Api:
        """This Api on the models loaded now, for one request from its prompt to its record: a
        swap of the models meanwhile (the page's Models tab, which waits its turn in the
        engine's line) leaves the request on the models its prompt was made for."""
        report = self.report
        pinned = copy.copy(self)
        pinned._report = lambda: report
        return pinned

    @property
    def queue(self) -> EngineQueue:
        """The engine's one queue, which the page's replies join too."""
        return EngineQueue.of(self.engine)

    @property
    def model_id(self) -> str:
        """The served model's id in /v1/models and every response: a stable slug."""
        return model_slug(self.engine.target.name)

    @property
    def model_label(self) -> str:
        """The target's display name, as visitors may see it."""
        return self.redact(self.engine.target.name)

    def model_object(self) -> dict:
        """The one entry of /v1/models; the display name and the drafters ride in `specchat`."""
        return {"id": self.model_id, "object": "model", "created": self.started,
                "owned_by": "specchat",
                "specchat": {"name": self.model_label, "drafters": list(self.engine.drafters),
                             "quantization": self.engine.target.quantization}}

    # -- requests ---------------------------------------------------------------------------

    async def owner(self, request: Request) -> str:
        """The key's owner; 401 without a valid key when keys or logins are set. A key that is
        no API key goes through the login guard as "user:password": a wrong one counts as a
        failed attempt from this address (logged, answered later and later). An address that
        spent its failure budget gets 429 with the seconds left, whatever the key."""
        if not self.api_keys and not self.logins:
            return "api"
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if not given:  # no key at all is no guess: nothing to check or count
            raise ApiError(401, MISSING_KEY, "authentication_error")
        user, colon, password = given.partition(":")
        user, password = (user, password) if colon else ("", given)
        address = request.client.host if request.client else None
        try:
            # Refused before any key is compared, so a blocked address learns nothing more.
            self.guard.refuse_if_blocked(user, address)
            found = None
            for key, name in self.api_keys.items():  # every key compared: no early exit
                if given and hmac.compare_digest(given.encode(), key.encode()):
                    found = f"api:{name}"
            if found:
                return found
            if await self.guard.check(user, password, address):
                return f"user:{user}"
        except TooManyAttempts as refused:
            raise ApiError(429, str(refused), "rate_limit_error",
                           headers={"Retry-After": str(refused.seconds)}) from None
        raise ApiError(401, MISSING_KEY, "authentication_error")

    def prompt(self, body: dict, chat: bool) -> tuple[list[int], tuple[str, ...], str]:
        """-> (the prompt as the engine takes it: token ids for the local engine, the messages
        or text for a serving backend; stop strings of the chat format; the text to record as
        the prompt). Formatted by the engine itself, as the page does."""
        if chat:
            clean = self._messages(body.get("messages"))
            text = "\n".join(m["content"] for m in clean)
            self._check_length(text)
            ids, stops = self.engine.chat_prompt(clean)
            return ids, tuple(stops), clean[-1]["content"]
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return self._token_prompt(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return self._token_prompt(prompt)
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids.",
                           param="prompt")
        prompt = clean_text(prompt)
        self._check_length(prompt)
        return self.engine.text_prompt(prompt)[0], (), prompt

    @staticmethod
    def _messages(messages) -> list[dict]:
        """Chat messages as the chat format takes them: roles system (or OpenAI's developer),
        user, assistant; content as text or text parts, nothing else."""
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list.", param="messages")
        clean = []
        for m in messages:
            role = m.get("role") if isinstance(m, dict) else None
            role = "system" if role == "developer" else role
            if role not in ("system", "user", "assistant"):
                raise ApiError(400, "Each message needs a role of system, user or assistant.",
                               param="messages")
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}]
                if not all(isinstance(p, dict) and p.get("type") == "text" and
                           isinstance(p.get("text"), str) for p in content):
                    raise ApiError(400, "Message content parts must be text: images, audio "
                                        "and files are not supported.", param="messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ApiError(400, "Message content must be text.", param="messages")
            clean.append({"role": role, "content": clean_text(content)})
        return clean

    def _token_prompt(self, ids: list[int]) -> tuple[list[int], tuple, str]:
        """A prompt given as token ids (OpenAI's token-array form), used as they are."""
        if self.engine.tokenizer is None:
            raise ApiError(400, "A prompt of token ids needs specchat's own model; with a "
                                "serving backend, send text.", param="prompt")
        vocab = len(self.engine.tokenizer)
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"Token ids must lie in 0..{vocab - 1}.", param="prompt")
        if len(ids) > self.max_input_chars:
            raise ApiError(413, f"The prompt is {len(ids):,} tokens; the limit here is "
                                f"{self.max_input_chars:,}.")
        return list(ids), (), self.engine.tokenizer.decode(ids)

    async def read_json(self, request: Request) -> dict:
        """The request's JSON body, read no further than a size that its longest allowed
        input explains (413 beyond it), and parsed to no deeper than Python's recursion
        allows (400 beyond it)."""
        limit = 8 * self.max_input_chars + 65536  # 4 UTF-8 bytes a character, escapes, fields
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"The request body is {int(declared):,} bytes; the limit here "
                                f"is {limit:,}.")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise ApiError(413, f"The request body is over {limit:,} bytes, the limit "
                                    "here.")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise ApiError(400, "The request body must be JSON (and nested no deeper than a "
                                "few hundred levels).") from None
        return body

    def _check_length(self, text: str) -> None:
        if len(text) > self.max_input_chars:
            raise ApiError(413, f"The input is {len(text):,} characters; the limit here is "
                                f"{self.max_input_chars:,}.")

    def logprobs(self, body: dict, chat: bool) -> int | None:
        """How many alternatives each token's logprob comes with (None: no logprobs). Chat:
        `logprobs` true and `top_logprobs` 0..20; completions: `logprobs` 0..5."""
        asked, top = body.get("logprobs"), body.get("top_logprobs")
        if chat:
            if asked not in (None, True, False):
                raise ApiError(400, "'logprobs' must be true or false.", param="logprobs")
            if top is not None and (not isinstance(top, int) or isinstance(top, bool)
                                    or not 0 <= top <= MAX_TOP_LOGPROBS or not asked):
                raise ApiError(400, f"'top_logprobs' must be a whole number in 0..."
                                    f"{MAX_TOP_LOGPROBS}, with 'logprobs': true.",
                               param="top_logprobs")
            return self._gives_logprobs((top or 0) if asked else None)
        if top is not None:
            raise ApiError(400, "'top_logprobs' belongs to chat completions; completions take "
                                "'logprobs': N.", param="top_logprobs")
        if asked is None or asked is False:
            return None
        if not isinstance(asked, int) or isinstance(asked, bool) or not 0 <= asked <= 5:
            raise ApiError(400, "'logprobs' must be a whole number in 0..5.", param="logprobs")
        return self._gives_logprobs(asked)

    def _gives_logprobs(self, n: int | None) -> int | None:
        if n is not None and not getattr(self.engine, "gives_logprobs", False):
            raise ApiError(400, "This engine does not give logprobs (a serving backend's are "
                                "not passed through).", param="logprobs")
        return n

    def config(self, body: dict) -> GenerateConfig:
        for name, defaults in UNSUPPORTED.items():
            if body.get(name) not in defaults:
                raise ApiError(400, f"'{name}' is not supported by specchat: leave it out "
                                    f"(or send {json.dumps(defaults[1])}).", param=name)
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise ApiError(400, "'response_format' other than text (JSON mode, schemas) is not "
                                "supported by specchat.", param="response_format")

        check_types(body)
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, "'stop' must be a string or a list of strings.", param="stop")
        if len(stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise ApiError(400, f"'stop' takes at most {MAX_STOPS} strings of at most "
                                f"{MAX_STOP_CHARS} characters each.", param="stop")
        values, names = values_from_body(body)  # nulls mean "not given": the defaults
        values.update(stop=stop, drafter=body.get("drafter"),
                      speculation=body.get("speculation"), adaptive=body.get("adaptive"),
                      dry_sequence_breakers=body.get("dry_sequence_breakers"))
        try:
            cfg, _ = build_config(values, list(self.engine.drafters),
                                  max_new_cap=self.max_tokens_cap, names=names,
                                  greedy_trees=self.engine.greedy_trees)
        except InputError as e:
            raise ApiError(400, str(e)) from None
        return cfg

    # -- generation -------------------------------------------------------------------------

    async def start(self, ids: list[int], cfg: GenerateConfig, steps,
                    request: Request | None = None, owner: str | None = None
                    ) -> tuple[asyncio.Queue, threading.Event]:
        """Wait for the engine in its queue (429 when full), then run one reply in a thread of
        its own: `steps` turns the engine's events into what the route sends, each put on the
        returned queue as it comes (`LoopPost`: several steps' items at once, while they come
        faster than its interval), then `Finished`. Setting the returned event stops the
        reply at its next step. With `request`, a client that disconnects while waiting leaves
        the queue at once (a stream's client that leaves cancels this coroutine itself).
        `owner`: whose turn it is in the line, where it is not `cfg.owner` (a race's runs
        draft without history, so their requests name no owner)."""
        try:
            ticket = self.queue.join(self.max_waiting, owner=owner or cfg.owner,
                                     per_owner=self.max_per_owner)
        except QueueFull as full:
            expected = self.queue.expected_wait(1)
            retry = max(RETRY_AFTER_S, math.ceil(expected)) if expected else RETRY_AFTER_S
            reason = (f"You have {full.waiting} replies waiting already, the most one key or "
                      "login may have; retry when one is done." if full.mine else
                      f"The server is busy: {full.waiting} replies are waiting already, one "
                      "of them yours. Retry when it is done.")
            raise ApiError(429, reason, "rate_limit_error",
                           headers={"Retry-After": str(retry)}) from None
        try:
            # waits as a coroutine: no thread is held meanwhile
            granted = asyncio.ensure_future(ticket.granted())
            while not (await asyncio.wait({granted}, timeout=GONE_POLL_S))[0]:
                if request is not None and await request.is_disconnected():
                    granted.cancel()
                    raise ApiError(499, "The client closed the request.")
            granted.result()
        except BaseException:  # the client left while waiting (or got the engine as it left)
            ticket.leave()
            raise
        loop, queue, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
        run_reply(ticket, lambda: steps(self.engine.stream(ids, cfg, stop_event=stop), stop),
                  LoopPost(loop, queue).put, "specchat-api-reply")
        return queue, stop

    # -- routes ---------------------------------------------------------------------------

    async def models(self, request: Request) -> dict:
        await self.owner(request)
        return {"object": "list", "data": [self.model_object()]}

    async def model(self, request: Request) -> dict:
        """GET /v1/models/{id}: the `openai` client's `models.retrieve`."""
        await self.owner(request)
        wanted = request.path_params["model_id"]
        if wanted != self.model_id:
            raise ApiError(404, f"The model {wanted!r} does not exist here; this server serves "
                                f"{self.model_id!r}.", "not_found_error", param="model")
        return self.model_object()

    async def health(self):
        """llama-server's health check: 200 once the models are loaded, 503 before."""
        try:
            self.report
        except ApiError as error:
            return JSONResponse({"status": "loading model", **error.response_body()}, 503)
        return {"status": "ok", "waiting": self.queue.waiting}

    async def chat_completions(self, request: Request):
        return await self.complete(request, chat=True)

    async def completions(self, request: Request):
        return await self.complete(request, chat=False)

    async def complete(self, request: Request, chat: bool) -> dict | StreamingResponse:
        """One completion: checked, queued for the engine, then streamed or answered whole."""
        owner = await self.owner(request)
        body = await self.read_json(request)
        return await self.pinned()._complete(request, chat, owner, body)

    async def _complete(self, request: Request, chat: bool, owner: str, body
                        ) -> dict | StreamingResponse:
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        if not isinstance(body.get("model", ""), (str, type(None))):
            raise ApiError(400, "'model' must be a string.", param="model")
        ids, stops, prompt = self.prompt(body, chat)
        cfg = self.config(body)
        cfg = replace(cfg, owner=owner,  # drafts may copy this owner's requests, no one else's
                      stop=tuple(dict.fromkeys((*stops, *cfg.stop))),
                      logprobs=self.logprobs(body, chat))
        tokenizer = self.engine.tokenizer  # None for a serving backend: no alternatives
        reply = Reply(chat, self.model_id,
                      (lambda i: tokenizer.decode([i])) if tokenizer is not None else None)
        queue, stop = await self.start(ids, cfg, lambda events, stop: self.steps(
            events, stop, owner, prompt), request)
        first = await queue.get()
        if isinstance(first, ValueError):  # the engine checks the request before any work
            raise ApiError(400, str(first))
        if isinstance(first, Exception):
            raise _failed(first) from first
        items = reply_items(first, queue, stop)
        if body.get("stream"):
            options = body.get("stream_options") or {}
            with_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return StreamingResponse(reply.events(items, with_usage),
                                     headers={"Cache-Control": "no-cache"},
                                     media_type="text/event-stream")
        watch = asyncio.ensure_future(_stop_when_gone(request, stop))
        try:
            return await reply.whole(items)
        finally:
            watch.cancel()

    async def race(self, request: Request) -> dict:
        """POST /v1/race: the request of /v1/completions (`prompt`) or /v1/chat/completions
        (`messages`) decoded plainly, then with each drafter the model has, one after the
        other in the engine's line (core/race.py); answered whole with a row per run and the
        winner, where its band clears every other run's (stats/race.py), else null. Each run
        is recorded, each drafter's against the plain run."""
        owner = await self.owner(request)
        body = await self.read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        return await self.pinned()._race(request, owner, body)

    async def _race(self, request: Request, owner: str, body: dict) -> dict:
        chat = "messages" in body
        ids, stops, prompt = self.prompt(body, chat)
        cfg = self.config(body)
        if not self.engine.drafters:
            raise ApiError(400, "No drafter is loaded, so there is nothing to race.")
        cfg = replace(cfg, stop=tuple(dict.fromkeys((*stops, *cfg.stop))), logprobs=None)
        lanes = race_lanes(self.engine, cfg)
        entries, texts, plain, conversation = [], [], None, uuid.uuid4().hex
        for lane in lanes:
            queue, stop = await self.start(ids, lane.cfg, collected, request, owner=owner)
            watch = asyncio.ensure_future(_stop_when_gone(request, stop))
            try:
                tokens, records, stats = None, None, None
                async for item in reply_items(await queue.get(), queue, stop):
                    tokens, records, stats = item
            finally:
                watch.cancel()
            if isinstance(stats, Exception):
                raise ApiError(400, str(stats)) if isinstance(stats, ValueError) \
                    else _failed(stats)
            saved = self.record(owner, prompt, tokens, records, stats, conversation,
                                None if lane.mode == PLAIN else plain)
            plain = saved if lane.mode == PLAIN else plain
            entries.append(RaceEntry(lane.mode, stats, records, [(t.id, t.text) for t in tokens]))
            texts.append("".join(t.text for t in tokens))
            if stats.stop_reason not in ("length", "eos", "stop_string"):
                break
        rows = standings(entries)
        best = race_winner(rows) if len(entries) == len(lanes) else None
        labels = {lane.mode: lane.label for lane in lanes}
        return {"object": "race", "model": self.model_id, "created": int(time.time()),
                "winner": best, "runs": [
                    {"mode": row.mode, "label": labels[row.mode],
                     "tokens_per_s": row.tokens_per_s, "speedup": row.speedup,
                     "band": list(row.band) if row.band else None,
                     "acceptance": row.acceptance, "tokens_per_step": row.tokens_per_step,
                     "ttft_s": row.ttft_s, "new_tokens": row.new_tokens,
                     "same_as_plain": row.same_as_plain, "stop_reason": row.stop_reason,
                     "text": text} for row, text in zip(rows, texts)]}

    def steps(self, events: Iterator, stop: threading.Event, owner: str, prompt: str
              ) -> Iterator:
        """(new tokens, the step records that decided them) per step, then the stats; the
        turn is recorded at the end, as interrupted when the client went away. Runs in the
        reply's thread."""
        pending, records, tokens, done = [], [], [], []
        stats = None
        for event in events:
            if isinstance(event, TokenEvent):
                pending.append(event)
                tokens.append(event)
            elif isinstance(event, StepRecord):
                done.append(event)
                records.append(event)
                if pending:  # a step whose tokens are held back (a possible stop
                    yield pending, records  # string) rides with the next ones
                    pending, records = [], []
            elif isinstance(event, GenerationStats):
                stats = event
        if stop.is_set() and stats.stop_reason == "stopped":
            stats.stop_reason = "cancelled"  # only a client that left sets it
        if pending or records:
            yield pending, records
        self.record(owner, prompt, tokens, done, stats)
        yield stats

    def record(self, owner: str, prompt: str, tokens: list[TokenEvent],
               steps: list[StepRecord], stats: GenerationStats,
               conversation_id: str | None = None, baseline: Future | None = None) -> Future:
        """Save a turn in the background (a conversation of its own unless `conversation_id`
        is given; `baseline`: the saved plain run it is timed against); -> its row id's
        future."""
        engine, draft = self.engine, self.report.draft
        return self.writer.submit(
            conversation_id or uuid.uuid4().hex, prompt, "".join(t.text for t in tokens),
            stats.to_json(),
            dict(title=prompt[:60], owner=owner, target=self.redact(engine.target.name),
                 draft=self.redact(draft.name) if draft is not None else "",
                 quantization=engine.target.quantization, device=engine.device.type),
            baseline, [t.to_json() for t in tokens], [r.to_json() for r in steps])


# Fields of JSON type boolean, and those of type object; null means "not given" for each.
BOOLEAN_FIELDS = ("stream", "speculation", "adaptive", "echo")
OBJECT_FIELDS = ("stream_options",)


def check_types(body: dict) -> None:
    """Each field by its JSON type, as OpenAI checks them: a number where a number belongs (not
    "12", not true), a boolean where a boolean belongs (not "false", which would read as true),
    an object where an object belongs. Ranges are the settings' own checks."""
    def refuse(field: str, kind: str):
        raise ApiError(400, f"'{field}' must be {kind} (got {json.dumps(body[field])[:40]}).",
                       param=field)
    for row in SETTINGS.values():
        for field in row.api or (row.name,):
            value = body.get(field)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float))):
                refuse(field, "an integer" if row.integer else "a number")
    for field in BOOLEAN_FIELDS:
        if body.get(field) is not None and not isinstance(body[field], bool):
            refuse(field, "true or false")
    for field in OBJECT_FIELDS:
        if body.get(field) is not None and not isinstance(body[field], dict):
            refuse(field, "an object")
    options = body.get("stream_options") or {}
    if options.get("include_usage") is not None and not isinstance(options["include_usage"],
                                                                    bool):
        raise ApiError(400, "'stream_options.include_usage' must be true or false.",
                       param="stream_options")


def model_slug(name: str) -> str:
    """A model's name as an id clients can keep in their configuration: remarks in brackets
    dropped, only the last part of a path or hub id, lowercase, and each run of characters
    other than a-z, 0-9, '.' and '-' made one '-' ("Gemma 3 270M (embedded, ...)" ->
    "gemma-3-270m", "Qwen/Qwen2.5-7B-Instruct" -> "qwen2.5-7b-instruct")."""
    name = re.sub(r"\s*[(\[][^)\]]*[)\]]", "", name).strip().rstrip("/\\")
    name = re.split(r"[/\\]", name)[-1].lower()
    return re.sub(r"[^a-z0-9.-]+", "-", name).strip("-.") or "model"


def timings(stats: GenerationStats) -> dict:
    """llama-server's `timings` object, from specchat's stats (`cache_n`: prompt tokens whose
    keys and values came from the cache)."""
    predicted_s = max(stats.seconds - stats.ttft_s, 0.0)
    prompt_ms, predicted_ms = 1000 * stats.ttft_s, 1000 * predicted_s
    return {"cache_n": stats.prompt_tokens - stats.prefill_tokens,
            "prompt_n": stats.prefill_tokens, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / stats.prefill_tokens
            if stats.prefill_tokens else 0.0,
            "prompt_per_second": 1000 * stats.prefill_tokens / prompt_ms if prompt_ms else 0.0,
            "predicted_n": stats.new_tokens, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / stats.new_tokens if stats.new_tokens
            else 0.0,
            "predicted_per_second": stats.new_tokens / predicted_s if predicted_s else 0.0,
            "draft_n": stats.drafted, "draft_n_accepted": stats.accepted}


FINISH = {"eos": "stop", "stop_string": "stop", "length": "length", "stopped": "stop",
          "error": "stop"}
ROUTES = {"/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/completions": "POST",
          "/v1/race": "POST"}


def usage(stats: GenerationStats) -> dict:
    """OpenAI's `usage` object (`cached_tokens`: prompt tokens taken from the cache)."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "prompt_tokens_details": {
                "cached_tokens": stats.prompt_tokens - stats.prefill_tokens}}


class Reply:
    """One response in OpenAI's shapes: its id, object type and time, the chunks of a stream
    or the whole object, each token carrying its kind, text, step and id."""

    def __init__(self, chat: bool, model: str, decode=None):
        self.chat, self.model = chat, model
        self.decode = decode  # token id -> its text, for the alternatives of logprobs
        self.ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.kind = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())

    def piece(self, tokens: list[TokenEvent], records: list[StepRecord]) -> dict:
        """A streamed choice: a step's new text, with specchat's provenance of each token."""
        text = "".join(t.text for t in tokens)
        extra = {"specchat": {"kinds": [t.kind for t in tokens],
                              "texts": [t.text for t in tokens],
                              "steps": [t.step for t in tokens],
                              "ids": [t.id for t in tokens],
                              "records": [r.to_json() for r in records]}}
        logprobs = self.logprobs(tokens)
        if logprobs is not None:
            extra["logprobs"] = logprobs
        if self.chat:
            return {"index": 0, "delta": {"content": text}, "finish_reason": None, **extra}
        return {"index": 0, "text": text, "finish_reason": None, **extra}

    def logprobs(self, tokens: list[TokenEvent], offset: int = 0) -> dict | None:
        """OpenAI's logprobs of `tokens`: chat's `content` list, or the completions' parallel
        lists. None when the request did not ask for them."""
        if not tokens or tokens[0].logprob is None:
            return None
        decode = self.decode or (lambda i: "")

        def entry(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        if self.chat:
            return {"content": [{**entry(t.text, t.logprob), "top_logprobs": [
                entry(decode(i), lp) for i, lp in t.top_logprobs]} for t in tokens]}
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t.text)
        return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{decode(i): lp for i, lp in t.top_logprobs} for t in tokens],
                "text_offset": offsets}

    def chunk(self, choice: dict | None, **more) -> str:
        """One server-sent event; no choice: a chunk with empty `choices` (the usage one)."""
        return "data: " + json.dumps(
            {"id": self.ident, "object": self.kind + (".chunk" if self.chat else ""),
             "created": self.created, "model": self.model,
             "choices": [choice] if choice else [], **more}, ensure_ascii=False) + "\n\n"

    @staticmethod
    def extra(stats: GenerationStats) -> dict:
        """What the last chunk (or the whole object) adds: llama.cpp's timings, our stats."""
        return {"timings": timings(stats), "specchat": {"stats": stats.to_json()}}

    async def events(self, items, with_usage: bool):
        """The stream: the role (chat), a chunk per step, the finish with timings and stats,
        the usage when asked for, [DONE]; a reply that fails on the way sends its OpenAI
        error object as the last data before [DONE]."""
        if self.chat:  # OpenAI's first chunk: the role, no content yet
            yield self.chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                              "finish_reason": None})
        try:
            async for item in items:
                if not isinstance(item, GenerationStats):
                    yield self.chunk(self.piece(*item))
                    continue
                end = {"index": 0, "finish_reason": FINISH.get(item.stop_reason, "stop")}
                end.update({"delta": {}} if self.chat else {"text": ""})
                yield self.chunk(end, **self.extra(item))
                if with_usage:  # its own chunk, with no choices, as OpenAI sends it
                    yield self.chunk(None, usage=usage(item))
        except ApiError as error:  # the headers are sent: the error rides the stream (as
            yield f"data: {json.dumps(error.response_body())}\n\n"  # vLLM sends it)
        yield "data: [DONE]\n\n"

    async def whole(self, items) -> dict:
        """The response of a request that did not ask to stream."""
        tokens, stats = [], None
        async for item in items:
            if isinstance(item, GenerationStats):
                stats = item
            else:
                tokens += item[0]
        text = "".join(t.text for t in tokens)
        extra = self.extra(stats)
        extra["specchat"].update(kinds=[t.kind for t in tokens], texts=[t.text for t in tokens])
        choice = {"index": 0, "finish_reason": FINISH.get(stats.stop_reason, "stop")}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat
                      else {"text": text})
        logprobs = self.logprobs(tokens)
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return {"id": self.ident, "object": self.kind, "created": self.created,
                "model": self.model, "choices": [choice], "usage": usage(stats), **extra}


def collected(events: Iterator, stop: threading.Event) -> Iterator:
    """A race run's one item, once it has ended: (its tokens, its step records, its stats);
    an engine's refusal of the request (ValueError) in place of the stats. Timed as `bench`
    times a reply: nothing is sent while it runs."""
    tokens, records, stats = [], [], None
    try:
        for event in events:
            if isinstance(event, TokenEvent):
                tokens.append(event)
            elif isinstance(event, StepRecord):
                records.append(event)
            elif isinstance(event, GenerationStats):
                stats = event
    except ValueError as e:
        stats = e
    yield tokens, records, stats


async def _stop_when_gone(request: Request, stop: threading.Event) -> None:
    """Stop a reply that is not streamed at its next step once its client disconnected: nobody
    will read it (a stream's client that leaves stops its reply through `reply_items`)."""
    while not stop.is_set():
        if await request.is_disconnected():
            stop.set()
            return
        await asyncio.sleep(GONE_POLL_S)


async def reply_items(first, queue: asyncio.Queue, stop: threading.Event):
    """A reply's items as its thread makes them, from `first`; the reply stops at its next step
    when the one reading goes away."""
    item = first
    try:
        while not isinstance(item, Finished):
            if isinstance(item, ApiError):
                raise item
            if isinstance(item, Exception):
                raise _failed(item) from item
            yield item
            item = await queue.get()
    finally:
        stop.set()  # a no-op once the reply ended; else the client went away


def _failed(error: Exception) -> ApiError:
    """A reply that failed in the engine -> the 500 its client is answered with (the server
    goes on serving: the engine starts the next request from a clean cache)."""
    log.error("a reply failed", exc_info=error)
    return ApiError(500, f"The reply failed: {type(error).__name__}: {error}", "server_error")


def answered(route):
    """ApiError -> its OpenAI error object, and any other exception -> a 500 in the same shape
    (handled here, not by an app-wide handler, so the routes can join an app that is already
    serving)."""
    async def handler(request: Request):
        try:
            return await route(request)
        except ApiError as error:
            return error.response()
        except Exception as error:  # noqa: BLE001 - a client always gets an OpenAI error object
            return _failed(error).response()
    handler.__name__ = route.__name__
    return handler


async def not_here(request: Request, rest: str) -> JSONResponse:
    """Under /v1, OpenAI's error objects for unknown routes and wrong methods."""
    path = f"/v1/{rest}"
    if path in ROUTES:
        return ApiError(405, f"{request.method} is not allowed on {path}; use {ROUTES[path]}.",
                        headers={"Allow": ROUTES[path]}).response()
    return ApiError(404, f"No route {path} here: {', '.join(ROUTES)}.",
                    "not_found_error").response()


def create_app(report, store: StatsStore | None = None, api_keys: dict[str, str] | None = None,
               **options) -> FastAPI:
    """A standalone app serving the API (`python -m specchat serve`)."""
    api = Api(report, store, api_keys, **options)
    app = FastAPI(title="specchat API")
    app.state.api = api
    app.include_router(api_router(api))
    return app


def api_router(api: Api) -> APIRouter:
    """The /v1 routes over `api` (and /health); the web app adds them to gradio's server."""
    router = APIRouter()
    router.add_api_route("/v1/models", answered(api.models), methods=["GET"])
    router.add_api_route("/v1/models/{model_id:path}", answered(api.model), methods=["GET"])
    router.add_api_route("/health", api.health, methods=["GET"])
    router.add_api_route("/v1/chat/completions", answered(api.chat_completions),
                         methods=["POST"])
    router.add_api_route("/v1/completions", answered(api.completions), methods=["POST"])
    router.add_api_route("/v1/race", answered(api.race), methods=["POST"])
    router.add_api_route("/v1/{rest:path}", not_here, include_in_schema=False,
                         methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    return router
