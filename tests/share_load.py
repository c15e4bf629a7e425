"""A shared demo under a hostile visitor, on loopback: `python tests/share_load.py` runs the full
test and prints its figures; tests/test_share_load.py runs a small one in the suite.

The page and the API are served as `--share --auth` serves them (one real server, as app.py
launches it, trusting the tunnel on this machine), and every request comes through a fake
tunnel: from 127.0.0.1, its X-Forwarded-For ending with the visitor's address, as the share
tunnel appends it. Honest visitors, each with a login of their own, chat a few turns each: some
through the API (streamed chat completions), some through the page's own route (gradio's queue:
log in, join the send event, read the event stream, as the browser does), one tab each. Two
more page visitors leave mid-reply, one pressing Stop, one closing the page. A hostile visitor
floods max-length requests from several threads and two API keys of its own, floods the page
from several tabs of its own login, and guesses passwords for the honest logins, on the API
and on the page's /login, with forged X-Forwarded-For entries naming honest addresses. The
figures: every honest status and outcome, the honest first-token waits (p95, the API's and the
page's) against the longest reply (a fair round is at most one reply of each owner ahead),
what the store kept, the leavers' saved turns, the server process's peak memory. Bounded: each
request has a timeout, and the whole run stops after `seconds`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from contextlib import closing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import torch
from gradio_client.utils import apply_diff

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny.py
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # specchat

from tiny import byte_tokenizer, free_port, loaded, tiny_llama  # noqa: E402

from specchat.api.server import Api, api_router  # noqa: E402
from specchat.args import SHARE_TUNNEL, trust_proxies  # noqa: E402
from specchat.core.engine import Engine  # noqa: E402
from specchat.core.events import TokenEvent  # noqa: E402
from specchat.drafters.ngram import NgramDrafter  # noqa: E402
from specchat.loader import LoadReport  # noqa: E402
from specchat.stats.store import StatsStore  # noqa: E402
from specchat.ui import live  # noqa: E402
from specchat.ui.access import Access  # noqa: E402
from specchat.ui.login import guarded_launch_kwargs  # noqa: E402
from specchat.ui.page import build_ui, launch  # noqa: E402
from specchat.ui.state import Limits  # noqa: E402

HOSTILE = "203.0.113.66"
HOSTILE_KEYS = ("sk-flood-1", "sk-flood-2")
HOSTILE_LOGIN = ("mallory", "mallory-password")  # a login of its own, for the page
LEAVER_DELAY_S = 0.02  # per token of a leaver's reply: long enough to leave in its middle


@dataclass
class Figures:
    honest_statuses: dict[int, int] = field(default_factory=dict)  # the API's visitors
    honest_waits: list[float] = field(default_factory=list)  # seconds to the first chunk
    page_outcomes: dict[str, int] = field(default_factory=dict)  # the page's honest replies
    page_waits: list[float] = field(default_factory=list)  # seconds to the first token shown
    page_told_place: int = 0  # page replies told their place in line while they waited
    reply_seconds: list[float] = field(default_factory=list)  # every whole reply, any owner
    flood_statuses: dict[int, int] = field(default_factory=dict)
    page_flood_outcomes: dict[str, int] = field(default_factory=dict)  # the hostile's tabs
    guess_statuses: dict[int, int] = field(default_factory=dict)  # wrong API keys
    login_guess_statuses: dict[int, int] = field(default_factory=dict)  # wrong page logins
    login_statuses: dict[int, int] = field(default_factory=dict)  # honest page logins
    honest_saved: int = 0
    honest_finished: int = 0
    leavers_saved: dict[str, str] = field(default_factory=dict)  # how -> saved stop reason
    peak_rss_mb: float = 0.0  # the process's resident memory at its highest during the run
    start_rss_mb: float = 0.0  # ... and as the run began (in the suite: pytest's own)
    seconds: float = 0.0

    @staticmethod
    def p95(waits: list[float]) -> float:
        waits = sorted(waits)
        return waits[min(len(waits) - 1, int(0.95 * len(waits)))] if waits else 0.0

    @property
    def p95_wait(self) -> float:
        return self.p95(self.honest_waits + self.page_waits)

    @property
    def max_wait(self) -> float:
        return max(self.honest_waits + self.page_waits, default=0.0)

    def fair_bound(self, owners: int) -> float:
        """The longest a fair round can make a reply wait: one reply of every other owner."""
        return owners * max(self.reply_seconds, default=0.0)

    def to_json(self, owners: int) -> dict:
        return {"honest_statuses": self.honest_statuses, "page_outcomes": self.page_outcomes,
                "login_statuses": self.login_statuses, "flood_statuses": self.flood_statuses,
                "page_flood_outcomes": self.page_flood_outcomes,
                "guess_statuses": self.guess_statuses,
                "login_guess_statuses": self.login_guess_statuses,
                "honest_p95_wait_s": round(self.p95_wait, 3),
                "api_p95_wait_s": round(self.p95(self.honest_waits), 3),
                "page_p95_wait_s": round(self.p95(self.page_waits), 3),
                "honest_max_wait_s": round(self.max_wait, 3),
                "page_told_place": self.page_told_place,
                "longest_reply_s": round(max(self.reply_seconds, default=0.0), 3),
                "fair_round_s": round(self.fair_bound(owners), 3),
                "honest_finished": self.honest_finished, "honest_saved": self.honest_saved,
                "leavers_saved": self.leavers_saved,
                "peak_rss_mb": round(self.peak_rss_mb), "start_rss_mb": round(self.start_rss_mb),
                "seconds": round(self.seconds, 1)}


def _rss_mb() -> float:
    """This process's resident memory now (Linux), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _count(counts: dict, key, lock: threading.Lock) -> None:
    with lock:
        counts[key] = counts.get(key, 0) + 1


def tunnel(address: str, written: str = "") -> dict:
    """The headers the tunnel passes on: what the visitor wrote, then its address."""
    return {"X-Forwarded-For": f"{written}, {address}" if written else address}


@dataclass
class Reply:
    """What one page reply showed: the seconds to its first token (None: none came), whether
    it finished with a reply (its stats line, no error), the notices it showed."""
    first: float | None = None
    seconds: float = 0.0  # from its first token to its end
    finished: bool = False
    refused: bool = False
    notices: list[str] = field(default_factory=list)
    last: str = ""  # the reply's HTML as last shown


class PageRoute:
    """The page's send event as the browser drives it, found in the served page's config."""

    def __init__(self, demo):
        config = demo.config
        self.components = {c["id"]: c for c in config["components"]}
        deps = config["dependencies"]

        def name(dep) -> str:
            return getattr(demo.fns[dep["id"]].fn, "__name__", "")

        def elem(elem_id: str) -> int:
            return next(i for i, c in self.components.items()
                        if c["props"].get("elem_id") == elem_id)

        send = elem("sc-send")
        self.user = next(d for d in deps if name(d) == "on_user" and
                         (send, "click") in [tuple(t) for t in d["targets"]])
        self.bot = next(d for d in deps if name(d) == "on_bot" and
                        d.get("trigger_after") == self.user["id"])
        self.stop = next(d for d in deps if name(d) == "on_stop")
        self.send_id, self.stop_id = send, elem("sc-stop")
        self.box, self.max_new = elem("sc-input"), elem("sc-max-new")
        self.chat, self.notice = elem("sc-chat"), elem("sc-notice")
        self.live = elem("sc-live")  # a streaming reply's feed (ui/live.py)

    def data(self, dep: dict, text: str, tokens: int) -> list:
        """The event's inputs, as the page sends them: the controls at their defaults, greedy,
        seed 0, `tokens` new tokens at most."""
        out = []
        for i in dep["inputs"]:
            c = self.components[i]
            label = c["props"].get("label") or ""
            value = None if c["type"] in ("state", "browserstate") else c["props"].get("value")
            if i == self.box:
                value = text
            elif i == self.max_new:
                value = tokens
            elif label.startswith("Temperature"):
                value = 0.0
            elif label.startswith("Seed"):
                value = 0
            out.append(value)
        return out


class Tab:
    """One browser tab of a logged-in visitor, reaching the page through the tunnel."""

    def __init__(self, base: str, route: PageRoute, client: httpx.Client, address: str,
                 written: str = ""):
        self.base, self.route, self.client = base, route, client
        self.headers = tunnel(address, written)
        self.session = uuid.uuid4().hex[:11]

    def _join(self, dep: dict, data: list, trigger: int | None) -> str:
        r = self.client.post(f"{self.base}/gradio_api/queue/join", headers=self.headers, json={
            "data": data, "fn_index": dep["id"], "trigger_id": trigger,
            "session_hash": self.session, "event_data": None})
        r.raise_for_status()
        return r.json()["event_id"]

    def _events(self):
        """The session's event stream: each message as a dict."""
        with self.client.stream("GET", f"{self.base}/gradio_api/queue/data",
                                params={"session_hash": self.session},
                                headers=self.headers) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data:"):
                    yield json.loads(line[5:])

    def _follow(self, feed: str, sent: float, reply: Reply, leave: str) -> bool:
        """Read the reply's feed as the page's script does, to its end; True when the tab
        left at the first token ("close": the feed is closed there)."""
        with self.client.stream("GET", f"{self.base}/specchat/live/{feed}",
                                headers=self.headers) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data:") or '"tokens"' not in line:
                    continue
                if reply.first is None:
                    reply.first = time.monotonic() - sent
                    if leave == "close":
                        return True
                    if leave == "stop":
                        self.client.post(f"{self.base}/gradio_api/run/predict",
                                         headers=self.headers, json={
                                             "data": [], "fn_index": self.route.stop["id"],
                                             "trigger_id": self.route.stop_id,
                                             "session_hash": self.session, "event_data": None})
        return False

    def send(self, text: str, tokens: int, leave: str = "") -> Reply:
        """Send `text` as the page's Send button does (the echo, then the reply) and follow the
        reply to its end. `leave`: "stop" presses Stop at the first token, "close" closes the
        page there."""
        route, reply = self.route, Reply()
        self._join(route.user, route.data(route.user, text, tokens), route.send_id)
        for msg in self._events():
            if msg.get("msg") == "process_completed":
                break
        sent = time.monotonic()
        event = self._join(route.bot, route.data(route.bot, text, tokens), None)
        outputs = None
        chat_at = [i for i, c in enumerate(route.bot["outputs"]) if c == route.chat][0]
        notice_at = [i for i, c in enumerate(route.bot["outputs"]) if c == route.notice][0]
        live_at = [i for i, c in enumerate(route.bot["outputs"]) if c == route.live][0]
        events = self._events()
        try:
            for msg in events:
                if msg.get("event_id") != event:
                    continue
                if msg["msg"] == "process_generating":
                    data = msg["output"]["data"]
                    outputs = list(data) if outputs is None else \
                        [apply_diff(old, new) for old, new in zip(outputs, data)]
                elif msg["msg"] == "process_completed":
                    if msg.get("success") and msg["output"].get("data") is not None:
                        outputs = msg["output"]["data"]
                    break
                else:
                    continue
                # (an output the handler skipped comes as an update without a value)
                notice, chat = outputs[notice_at], outputs[chat_at]
                if isinstance(notice, str) and notice and notice not in reply.notices:
                    reply.notices.append(notice)
                if isinstance(chat, list) and chat:
                    content = chat[-1]["content"]
                    reply.last = content if isinstance(content, str) else \
                        "".join(part.get("text", "") for part in content)
                live = outputs[live_at]  # the name of the reply's feed (ui/live.py)
                if reply.first is None and isinstance(live, str) and '"feed"' in live:
                    if self._follow(json.loads(live)["feed"], sent, reply, leave):
                        return reply
                if reply.first is None and 'class="tk tk-' in reply.last:
                    reply.first = time.monotonic() - sent
        finally:
            events.close()  # leaving: the server sees the page go
        if reply.first is not None:
            reply.seconds = time.monotonic() - sent - reply.first
        reply.refused = "Not sent:" in reply.last
        reply.finished = 'class="sc-stats"' in reply.last and "sc-error" not in reply.last
        return reply


def serve(store: StatsStore, engine: Engine, logins: list[tuple[str, str]], cap: int):
    """The page and the API on one loopback port, as app.py serves them with --share --auth:
    the login guard shared, the tunnel on this machine trusted. -> (demo, base URL)."""
    os.environ["FORWARDED_ALLOW_IPS"] = ""
    trust_proxies(SHARE_TUNNEL)  # as app.py does for --share
    report = LoadReport(engine, None, [])
    demo = build_ui(report, store, Limits(max_new_tokens_cap=cap),
                    Access(auth=True, exposed=True))
    login = guarded_launch_kwargs(logins)
    port = free_port()
    launch(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
           quiet=True, **login)
    demo.app.include_router(api_router(Api(
        report, store, {key: f"flood{i}" for i, key in enumerate(HOSTILE_KEYS)},
        logins=logins, max_tokens_cap=cap, guard=login["auth"].__self__)))
    return demo, f"http://127.0.0.1:{port}"


def run(honest: int = 6, turns: int = 3, flood: int = 50, tabs: int = 4, guesses: int = 100,
        honest_tokens: int = 16, cap: int = 64, seconds: float = 300.0, page: int = 3,
        page_tabs: int = 6, page_flood: int = 30) -> Figures:
    """The whole test; returns its figures. `honest` API visitors and `page` page visitors
    chat `turns` turns each; two page visitors leave mid-reply; the hostile visitor sends
    `flood` API requests from `tabs` threads, `page_flood` page messages from `page_tabs` tabs,
    and `guesses` wrong passwords."""
    users = [(f"visitor{i}", f"password-{i}") for i in range(honest)]
    page_users = [(f"page{i}", f"page-password-{i}") for i in range(page)]
    leavers = {"stop": ("leaver0", "leaver-password-0"), "close": ("leaver1", "leaver-password-1")}
    logins = users + page_users + list(leavers.values()) + [HOSTILE_LOGIN]
    store = StatsStore(":memory:")
    engine = Engine(loaded(tiny_llama(0), byte_tokenizer(), name="tiny"),
                    {"ngram": NgramDrafter()})
    slow = {f"user:{user}" for user, _ in leavers.values()}
    real_stream = engine.stream

    def stream(ids, cfg, stop_event=None):  # a leaver's reply lasts long enough to leave it
        events = real_stream(ids, cfg, stop_event=stop_event)
        try:
            for event in events:
                if cfg.owner in slow and isinstance(event, TokenEvent):
                    time.sleep(LEAVER_DELAY_S)
                yield event
        finally:
            events.close()

    engine.stream = stream
    # a leaver's page is gone for good: its feed's grace for a reconnect (live.GRACE_S, a few
    # seconds) would outlast a leaver's whole reply here, so the run takes a short one
    grace, live.GRACE_S = live.GRACE_S, min(live.GRACE_S, 0.3)
    demo, base = serve(store, engine, logins, cap)
    url = base + "/v1"
    route = PageRoute(demo)
    figures, lock = Figures(), threading.Lock()
    deadline = time.monotonic() + seconds
    start = time.monotonic()
    figures.start_rss_mb = figures.peak_rss_mb = _rss_mb()
    sampling = threading.Event()

    def sample() -> None:  # the server's memory through the whole run
        while not sampling.wait(0.05):
            figures.peak_rss_mb = max(figures.peak_rss_mb, _rss_mb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    def chat(key: str, address: str, tokens: int, written: str = "") -> tuple[int, float | None]:
        """One streamed chat completion: (status, seconds to its first chunk)."""
        body = {"messages": [{"role": "user", "content": "Tell me about the sea."}],
                "max_tokens": tokens, "temperature": 0, "stream": True}
        sent = time.monotonic()
        timeout = max(1.0, deadline - sent)
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=timeout,
                          headers={"Authorization": f"Bearer {key}",
                                   **tunnel(address, written)}) as r:
            first = None
            for line in r.iter_lines():
                if first is None and line.startswith("data: "):
                    first = time.monotonic() - sent
            if r.status_code == 200:
                with lock:
                    figures.reply_seconds.append(time.monotonic() - sent - (first or 0.0))
            return r.status_code, first

    def visitor(i: int) -> None:
        user, password = users[i]
        for _ in range(turns):
            if time.monotonic() > deadline:
                return
            status, first = chat(f"{user}:{password}", f"198.51.100.{i + 10}", honest_tokens)
            _count(figures.honest_statuses, status, lock)
            if status == 200 and first is not None:
                with lock:
                    figures.honest_waits.append(first)
                    figures.honest_finished += 1

    def logged_in(user: str, password: str, address: str, written: str = "") -> httpx.Client:
        client = httpx.Client(timeout=max(1.0, deadline - time.monotonic()))
        r = client.post(f"{base}/login", data={"username": user, "password": password},
                        headers=tunnel(address, written))
        if user != HOSTILE_LOGIN[0]:
            _count(figures.login_statuses, r.status_code, lock)
        return client

    def page_visitor(i: int) -> None:
        user, password = page_users[i]
        address = f"198.51.100.{i + 50}"
        with closing(logged_in(user, password, address)) as client:
            tab = Tab(base, route, client, address)
            for turn in range(turns):
                if time.monotonic() > deadline:
                    return
                reply = tab.send(f"Tell me about the sea, part {turn + 1}.", honest_tokens)
                outcome = "finished" if reply.finished else \
                    "refused" if reply.refused else "unfinished"
                _count(figures.page_outcomes, outcome, lock)
                with lock:
                    figures.page_told_place += any(n.startswith("Waiting for the model:")
                                                   for n in reply.notices)
                    if reply.finished and reply.first is not None:
                        figures.page_waits.append(reply.first)
                        figures.reply_seconds.append(reply.seconds)
                        figures.honest_finished += 1

    def leaver(how: str) -> None:
        user, password = leavers[how]
        address = f"198.51.100.{90 + len(how)}"
        with closing(logged_in(user, password, address)) as client:
            Tab(base, route, client, address).send("Tell me a long story.", cap, leave=how)

    def hostile_tab(client: httpx.Client, sends: int) -> None:
        with closing(client):
            tab = Tab(base, route, client, HOSTILE, written="198.51.100.50")
            for _ in range(sends):
                if time.monotonic() > deadline:
                    return
                reply = tab.send("Write as much as you can.", cap)
                outcome = "finished" if reply.finished else \
                    "refused" if reply.refused else "unfinished"
                _count(figures.page_flood_outcomes, outcome, lock)

    def flooder(n: int) -> None:
        if time.monotonic() < deadline:
            status, _ = chat(HOSTILE_KEYS[n % 2], HOSTILE, cap, written="198.51.100.10")
            _count(figures.flood_statuses, status, lock)

    def guesser(n: int) -> None:
        if time.monotonic() > deadline:
            return
        forged = tunnel(HOSTILE, written=f"198.51.100.{10 + n % honest}")
        if n % 2:  # the page's login form
            user = page_users[n % page][0]
            r = httpx.post(f"{base}/login", data={"username": user, "password": f"guess-{n}"},
                           timeout=30, headers=forged)
            _count(figures.login_guess_statuses, r.status_code, lock)
            return
        user = users[n % honest][0]
        r = httpx.get(f"{url}/models", timeout=30, headers={
            "Authorization": f"Bearer {user}:guess-{n}", **forged})
        _count(figures.guess_statuses, r.status_code, lock)

    per_tab = -(-page_flood // page_tabs)
    # the hostile's tabs log in before its guesses spend its address's budget
    hostile_clients = [logged_in(*HOSTILE_LOGIN, HOSTILE, written="198.51.100.50")
                       for n in range(page_tabs) if page_flood > n * per_tab]
    try:
        with ThreadPoolExecutor(max_workers=tabs + 2) as hostile, \
                ThreadPoolExecutor(max_workers=honest + page + page_tabs + 2) as pool:
            jobs = [hostile.submit(flooder, n) for n in range(flood)]
            jobs += [hostile.submit(guesser, n) for n in range(guesses)]
            jobs += [pool.submit(hostile_tab, client, min(per_tab, page_flood - n * per_tab))
                     for n, client in enumerate(hostile_clients)]
            time.sleep(0.2)  # the flood is in the line first
            jobs += [pool.submit(visitor, i) for i in range(honest)]
            jobs += [pool.submit(page_visitor, i) for i in range(page)]
            jobs += [pool.submit(leaver, how) for how in leavers]
            for job in jobs:
                job.result()
    finally:
        sampling.set()
        sampler.join(5)
        figures.seconds = time.monotonic() - start

        def saved(names) -> list[dict]:
            return [t for name in names for c in store.conversations(owner=f"user:{name}")
                    for t in store.turns(c["id"], owner=f"user:{name}")]

        honest_names = [user for user, _ in users + page_users]
        settle = time.monotonic() + 10  # turns are written in the background
        while (len(saved(honest_names)) < figures.honest_finished or
               len(saved(user for user, _ in leavers.values())) < len(leavers)) and \
                time.monotonic() < settle:
            time.sleep(0.05)
        figures.honest_saved = len(saved(honest_names))
        for how, (user, _) in leavers.items():
            turns_saved = saved([user])
            figures.leavers_saved[how] = ", ".join(
                t["stop_reason"] + (" (interrupted)" if t["interrupted"] else "")
                for t in turns_saved) or "nothing"
        demo.close()
        del engine.stream
        live.GRACE_S = grace
    return figures


def owners(honest: int, page: int) -> int:
    """Every owner with replies in the line: the honest ones, the two leavers, the hostile's
    two keys and its login."""
    return honest + page + 2 + len(HOSTILE_KEYS) + 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--honest", type=int, default=6)
    p.add_argument("--page", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--flood", type=int, default=50)
    p.add_argument("--page-flood", type=int, default=30)
    p.add_argument("--guesses", type=int, default=100)
    p.add_argument("--seconds", type=float, default=300.0)
    args = p.parse_args()
    torch.set_num_threads(1)  # tiny tensors: one thread, as in the suite (tests/conftest.py)
    figures = run(args.honest, args.turns, args.flood, guesses=args.guesses,
                  seconds=args.seconds, page=args.page, page_flood=args.page_flood)
    n = owners(args.honest, args.page)
    print(json.dumps(figures.to_json(n), indent=1))
    ok = set(figures.honest_statuses) == {200} and set(figures.login_statuses) == {200} \
        and figures.page_outcomes == {"finished": args.page * args.turns} \
        and figures.p95_wait <= figures.fair_bound(n) \
        and figures.honest_saved == figures.honest_finished == \
        (args.honest + args.page) * args.turns \
        and all("(interrupted)" in v for v in figures.leavers_saved.values()) \
        and figures.peak_rss_mb < 2048
    print("share load test:", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
