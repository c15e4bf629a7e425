"""Seeded random interleavings of requests against the real server (the page and the API on one
engine line, as `app.py --share --auth` serves them), on loopback: `python tests/soak.py
--sequences N [--embedded]` runs them and prints each seed; tests/test_soak.py runs a few in the
suite (tiny models) and many under `-m slow` (the embedded model).

A sequence, from its seed alone, is a handful of requests sent together from several logins and
addresses (through a fake share tunnel): streamed and unstreamed completions and chat
completions, a client that drops mid-stream, page replies (one left with Stop, one with its tab
closed), stop strings, an empty and a huge prompt, each drafter and speculation off, greedy and
seeded sampling. Requests past an owner's place in the line are refused. After each sequence:
no 5xx; every finished reply is plain decoding's text for its request (the same request with
speculation off, sent alone); each 429 says why; a fresh request is answered within its usual
time. After the run: resident memory within 10% of its level after the first round.

Replay one sequence with `python tests/soak.py --seed S --sequences 1`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from contextlib import closing
from dataclasses import dataclass, field

import httpx
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # specchat

from share_load import PageRoute, Tab, _rss_mb, serve, tunnel  # noqa: E402
from tiny import byte_tokenizer, loaded, tiny_gemma3  # noqa: E402

from specchat import kernels  # noqa: E402
from specchat.core.engine import Engine  # noqa: E402
from specchat.drafters.combined import CombinedDrafter  # noqa: E402
from specchat.drafters.head import HeadDrafter  # noqa: E402
from specchat.drafters.ngram import NgramDrafter  # noqa: E402
from specchat.models.eagle import DraftHead, HeadConfig  # noqa: E402
from specchat.runners.memory import limit_malloc_arenas  # noqa: E402
from specchat.stats.store import StatsStore  # noqa: E402
from specchat.ui import live  # noqa: E402
from specchat.ui.page import PAGE_SESSIONS  # noqa: E402

LOGINS = [(f"soak{i}", f"soak-password-{i}") for i in range(4)]
ADDRESSES = [f"198.51.100.{n}" for n in (11, 12, 13)]
DRAFTERS = ["head", "combined", "ngram", None]  # None: speculation off
PROMPTS = ["Hi", "Once upon a time", "the cat sat on the mat. the cat sat on the",
           "Write a list:\n1.", "def add(a, b):\n"]
STOPS = [None, ["\n"], [".", "the"]]
SESSIONS = 12  # page sessions the soak's server keeps
PREFIX_TOKENS = 256  # tokens of whole prompt pages its engine keeps
HUGE = "word " * 40_000  # past the API's longest prompt: refused with a message


def tiny_engine() -> Engine:
    """A tiny Gemma 3 target with a random draft head on this CPU's C step (the reference
    kernels where none runs), lookup, and both together."""
    limit_malloc_arenas()  # as load_engine does for the app
    target = tiny_gemma3(0)
    tok = byte_tokenizer()
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, 64))
    head.vocab_ids = torch.arange(40, 104)
    head = head.attach(target).eval()
    lib = kernels.load() or kernels.load("ref")
    drafter = HeadDrafter(head, target, len(tok), 0.0, lib=lib)
    ngram = NgramDrafter()
    return Engine(loaded(target, tok, name="tiny"),
                  {"ngram": ngram, "head": drafter, "combined": CombinedDrafter(ngram, drafter)})


def embedded_engine() -> Engine:
    from specchat.loader import load_engine
    return load_engine("embedded", quantization="nf4", progress=lambda *a, **k: None).engine


@dataclass
class Request:
    kind: str  # "api", "api-stream", "api-drop", "chat", "page", "page-stop", "page-close"
    login: int
    address: str
    prompt: str
    drafter: str | None
    temperature: float
    seed: int
    stop: list[str] | None
    tokens: int
    delay: float  # seconds after the sequence starts

    def body(self, speculation: bool | None = None) -> dict:
        """The API request's body; `speculation` False: the same request, plain."""
        spec = self.drafter is not None if speculation is None else speculation
        body = {"max_tokens": self.tokens, "temperature": self.temperature, "seed": self.seed,
                "speculation": spec, "stream": self.kind in ("api-stream", "api-drop")}
        if spec:
            body["drafter"] = self.drafter
        if self.stop is not None:
            body["stop"] = self.stop
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return body

    def key(self) -> str:
        """What plain decoding's text depends on."""
        return json.dumps([self.kind in ("chat",), self.kind.startswith("page"), self.prompt,
                           self.temperature, self.seed, self.stop, self.tokens])


def sequence(seed: int, tokens: int) -> list[Request]:
    rng = random.Random(seed)
    kinds = ["api", "api-stream", "api-drop", "chat", "page", "page-stop", "page-close"]
    out = []
    for _ in range(rng.randint(3, 7)):
        kind = rng.choice(kinds)
        prompt = rng.choice(PROMPTS)
        roll = rng.random()
        if roll < 0.08 and not kind.startswith("page"):
            prompt = HUGE
        elif roll < 0.16:
            prompt = ""
        greedy = rng.random() < 0.5
        out.append(Request(kind, rng.randrange(len(LOGINS)), rng.choice(ADDRESSES), prompt,
                           rng.choice(DRAFTERS), 0.0 if greedy else 0.8,
                           0 if greedy else rng.randrange(1000),
                           None if kind.startswith("page") else rng.choice(STOPS),
                           rng.randint(1, tokens), rng.random() * 0.3))
    pages = set()  # (login, prompt) of page replies: one each, so the store tells them apart
    for r in out:
        if r.kind.startswith("page"):
            for _ in range(len(LOGINS)):
                if (r.login, r.prompt) not in pages:
                    break
                r.login = (r.login + 1) % len(LOGINS)
            else:
                r.kind = "page-close"  # every login has this prompt already: left unchecked
            pages.add((r.login, r.prompt))
    if rng.random() < 0.4:  # a burst: one login's requests at once, past its place in line
        login, address = rng.randrange(len(LOGINS)), rng.choice(ADDRESSES)
        out += [Request("api", login, address, rng.choice(PROMPTS), rng.choice(DRAFTERS), 0.0,
                        0, None, tokens, 0.0) for _ in range(rng.randint(3, 5))]
    return out


@dataclass
class Outcome:
    request: Request
    status: int = 0  # the HTTP status; page replies: 200 finished, 429 refused, 0 otherwise
    text: str | None = None  # a finished reply's text
    message: str = ""  # a refusal's or an error's message
    problem: str = ""  # what went wrong, for the report


@dataclass
class Report:
    sequences: int = 0
    replies: int = 0
    refused: int = 0
    kinds: dict = field(default_factory=dict)  # finished replies by kind
    problems: list[str] = field(default_factory=list)
    probe_seconds: list[float] = field(default_factory=list)
    first_round_rss_mb: float = 0.0
    end_rss_mb: float = 0.0
    seconds: float = 0.0
    seeds: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"sequences": self.sequences, "replies": self.replies, "refused": self.refused,
                "finished_by_kind": self.kinds,
                "problems": self.problems, "seeds": [self.seeds[0], self.seeds[-1]]
                if self.seeds else [], "first_round_rss_mb": round(self.first_round_rss_mb),
                "end_rss_mb": round(self.end_rss_mb), "seconds": round(self.seconds, 1),
                "probe_median_s": round(statistics.median(self.probe_seconds), 3)
                if self.probe_seconds else None}


class Soak:
    def __init__(self, engine: Engine, cap: int = 64):
        # on disk: the turns it keeps are data, not the server's resident memory
        self.folder = tempfile.TemporaryDirectory()
        self.store = StatsStore(os.path.join(self.folder.name, "soak.db"), quiet=True)
        self.grace, live.GRACE_S = live.GRACE_S, min(live.GRACE_S, 0.3)
        self.demo, self.base = serve(self.store, engine, LOGINS, cap)
        assert self.demo.state_holder.capacity == PAGE_SESSIONS  # the page's bound on them
        # A smaller bound, reached within the first round: from then on resident memory is
        # flat, as a demo's is past its PAGE_SESSIONS visitors.
        self.demo.state_holder.capacity = SESSIONS
        # Likewise the prefix store, which fills by design up to its bound (300 MB at the
        # embedded model's default): a few pages, full within the first round.
        self.engine, self.prefix_tokens = engine, engine.prefixes.max_tokens
        engine.prefixes.max_tokens = PREFIX_TOKENS
        self.route = PageRoute(self.demo)
        self.plain: dict[str, str | None] = {}  # Request.key -> plain decoding's text
        self.pages: dict[int, httpx.Client] = {}

    def close(self) -> None:
        for client in self.pages.values():
            client.close()
        self.demo.close()
        self.engine.prefixes.max_tokens = self.prefix_tokens
        self.store.close()
        self.folder.cleanup()
        live.GRACE_S = self.grace

    def auth(self, login: int) -> dict:
        user, password = LOGINS[login]
        return {"Authorization": f"Bearer {user}:{password}"}

    # -- the API ----------------------------------------------------------------------------

    def api(self, r: Request, body: dict, address: str) -> Outcome:
        out = Outcome(r)
        route = "chat/completions" if "messages" in body else "completions"
        headers = {**self.auth(r.login), **tunnel(address)}
        url = f"{self.base}/v1/{route}"
        if not body["stream"]:
            resp = httpx.post(url, json=body, headers=headers, timeout=300)
            out.status = resp.status_code
            data = resp.json()
            if resp.status_code == 200:
                choice = data["choices"][0]
                out.text = choice["message"]["content"] if "messages" in body else choice["text"]
            else:
                out.message = data.get("error", {}).get("message", "")
            return out
        with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                resp.read()
                out.message = resp.json().get("error", {}).get("message", "")
                return out
            pieces = []
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                pieces.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
                if r.kind == "api-drop" and len(pieces) >= 2:
                    return out  # the client leaves mid-stream: no text to check
            out.text = "".join(pieces)
        return out

    # -- the page ---------------------------------------------------------------------------

    def page(self, r: Request, speculation: bool | None = None) -> Outcome:
        out = Outcome(r)
        user, password = LOGINS[r.login]
        client = httpx.Client(timeout=300)
        with closing(client):
            login = client.post(f"{self.base}/login", data={"username": user,
                                                             "password": password},
                                headers=tunnel(r.address))
            if login.status_code != 200:
                out.status, out.message = login.status_code, login.text[:200]
                return out
            spec = r.drafter is not None if speculation is None else speculation
            route = SettingsRoute(self.route, {"Speculative decoding": spec,
                                               "Drafter": r.drafter or "ngram",
                                               "Temperature": r.temperature, "Seed": r.seed})
            tab = Tab(self.base, route, client, r.address)
            before = self.turn_ids(user)
            leave = {"page-stop": "stop", "page-close": "close"}.get(r.kind, "")
            reply = tab.send(r.prompt or " ", r.tokens, leave=leave if speculation is None
                             else "")
            if reply.refused:
                out.status, out.message = 429, reply.last
            elif "sc-error" in reply.last:
                out.status, out.message = 500, reply.last[-400:]
            elif reply.finished and not leave:
                out.status = 200
                out.text = self.saved_reply(user, r.prompt or " ", before)
        return out

    def turn_ids(self, user: str) -> set[int]:
        owner = f"user:{user}"
        return {t["id"] for c in self.store.conversations(owner=owner)
                for t in self.store.turns(c["id"], owner=owner)}

    def saved_reply(self, user: str, prompt: str, before: set[int]) -> str | None:
        """The reply the store kept for `user`'s finished turn with `prompt`, one not among
        `before` (turns are written in the background: waited for). A sequence gives one login
        at most one finished page reply a prompt (`sequence`), so it is that reply's."""
        owner = f"user:{user}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            turns = [t for c in self.store.conversations(owner=owner)
                     for t in self.store.turns(c["id"], owner=owner)
                     if t["prompt"] == prompt and t["id"] not in before
                     and not t["interrupted"]]
            if turns:
                return max(turns, key=lambda t: t["id"])["reply"]
            time.sleep(0.05)
        return None

    # -- a sequence -------------------------------------------------------------------------

    def send(self, r: Request) -> Outcome:
        time.sleep(r.delay)
        try:
            if r.kind.startswith("page"):
                return self.page(r)
            return self.api(r, r.body(), r.address)
        except httpx.HTTPError as e:
            out = Outcome(r)
            out.problem = f"{r.kind}: {type(e).__name__}: {e}"
            return out

    def plain_text(self, r: Request) -> str | None:
        """Plain decoding's text for `r`: the same request with speculation off, alone."""
        key = r.key()
        if key not in self.plain:
            if r.kind.startswith("page"):
                plain = Request(**{**r.__dict__, "kind": "page", "delay": 0.0})
                out = self.page(plain, speculation=False)
            else:
                plain = Request(**{**r.__dict__, "kind": "chat" if r.kind == "chat" else "api",
                                   "delay": 0.0})
                out = self.api(plain, plain.body(speculation=False), "198.51.100.99")
            self.plain[key] = out.text
        return self.plain[key]

    def probe(self) -> float:
        """The seconds a fresh request takes."""
        r = Request("api", 0, "198.51.100.98", "the cat sat", "head", 0.0, 0, None, 8, 0.0)
        sent = time.monotonic()
        out = self.api(r, r.body(), r.address)
        if out.status != 200:
            raise AssertionError(f"a fresh request got {out.status}: {out.message}")
        return time.monotonic() - sent

    def run_sequence(self, seed: int, tokens: int, report: Report) -> None:
        requests = sequence(seed, tokens)
        outcomes: list[Outcome] = [None] * len(requests)  # type: ignore[list-item]

        def go(i: int) -> None:
            outcomes[i] = self.send(requests[i])

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        for out in outcomes:
            r = out.request
            what = f"seed {seed}: {r.kind} drafter={r.drafter} T={r.temperature} " \
                   f"seed={r.seed} stop={r.stop} prompt={r.prompt[:20]!r}"
            if out.problem:
                report.problems.append(f"{what}: {out.problem}")
            elif out.status >= 500:
                report.problems.append(f"{what}: {out.status} {out.message[:300]}")
            elif out.status == 429:
                report.refused += 1
                if not out.message.strip():
                    report.problems.append(f"{what}: a 429 without a message")
            elif out.status == 200 and out.text is not None:
                report.replies += 1
                report.kinds[r.kind] = report.kinds.get(r.kind, 0) + 1
                want = self.plain_text(r)
                if out.text != want:
                    report.problems.append(f"{what}: {out.text!r} is not plain decoding's "
                                           f"{want!r}")
        report.probe_seconds.append(self.probe())
        report.sequences += 1
        report.seeds.append(seed)


ROUND = 10  # sequences: resident memory is compared with its level after the first round


def run(engine: Engine, sequences: int, seed: int = 0, seconds: float = 60.0,
        tokens: int = 24) -> Report:
    """Up to `sequences` sequences from seeds seed, seed + 1, ...; stops after `seconds`."""
    report, start = Report(), time.monotonic()
    soak = Soak(engine)
    try:
        for n in range(sequences):
            if n >= ROUND and time.monotonic() - start > seconds:
                break
            soak.run_sequence(seed + n, tokens, report)
            if n == min(ROUND, sequences) - 1:
                report.first_round_rss_mb = _rss_mb()
            if report.problems:
                break  # the seed of the first failing sequence is the last in report.seeds
    finally:
        report.end_rss_mb = _rss_mb()
        report.seconds = time.monotonic() - start
        soak.close()
    return report


class SettingsRoute(PageRoute):
    """The page's route with some controls set: {label prefix: value}."""

    def __init__(self, route: PageRoute, settings: dict):
        self.__dict__.update(route.__dict__)
        self.settings = settings

    def data(self, dep: dict, text: str, tokens: int) -> list:
        out = super().data(dep, text, tokens)
        for n, i in enumerate(dep["inputs"]):
            label = self.components[i]["props"].get("label") or ""
            for prefix, value in self.settings.items():
                if label.startswith(prefix):
                    out[n] = value
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=3600.0)
    p.add_argument("--embedded", action="store_true", help="the embedded model (else tiny)")
    args = p.parse_args()
    if not args.embedded:
        torch.set_num_threads(1)  # tiny tensors: one thread, as in the suite
    engine = embedded_engine() if args.embedded else tiny_engine()
    report = run(engine, args.sequences, args.seed, args.seconds)
    print(json.dumps(report.to_json(), indent=1))
    ok = not report.problems and report.end_rss_mb <= 1.1 * report.first_round_rss_mb
    print("soak:", "passed" if ok else f"FAILED at seed {report.seeds[-1]}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
