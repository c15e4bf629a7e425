"""A shared demo under a hostile visitor, on loopback: `python tests/share_load.py` runs the full
test and prints its figures; tests/test_share_load.py runs a small one in the suite.

The API is served as `--share` serves it (a real server trusting the tunnel on this machine),
and every request comes through a fake tunnel: from 127.0.0.1, its X-Forwarded-For ending with
the visitor's address, as the share tunnel appends it. Honest visitors, each with a login of
their own, chat a few turns each, streaming. A hostile visitor floods max-length requests from
several threads and two API keys of its own, and guesses passwords for the honest logins with
forged X-Forwarded-For entries naming honest addresses. The figures: every honest status, the
honest first-token waits (p95) against the longest reply (a fair round is at most one reply of
each owner ahead), what the store kept, the server process's peak memory. Bounded: each
request has a timeout, and the whole run stops after `seconds`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny.py
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # specchat

from tiny import byte_tokenizer, loaded, served_on_loopback, tiny_llama  # noqa: E402

from specchat.api.server import create_app  # noqa: E402
from specchat.args import SHARE_TUNNEL, trust_proxies  # noqa: E402
from specchat.core.engine import Engine  # noqa: E402
from specchat.drafters.ngram import NgramDrafter  # noqa: E402
from specchat.loader import LoadReport  # noqa: E402
from specchat.stats.store import StatsStore  # noqa: E402

HOSTILE = "203.0.113.66"
HOSTILE_KEYS = ("sk-flood-1", "sk-flood-2")


@dataclass
class Figures:
    honest_statuses: dict[int, int] = field(default_factory=dict)
    honest_waits: list[float] = field(default_factory=list)  # seconds to the first chunk
    reply_seconds: list[float] = field(default_factory=list)  # every whole reply, any owner
    flood_statuses: dict[int, int] = field(default_factory=dict)
    guess_statuses: dict[int, int] = field(default_factory=dict)
    honest_saved: int = 0
    honest_finished: int = 0
    peak_rss_mb: float = 0.0  # the process's resident memory at its highest during the run
    start_rss_mb: float = 0.0  # ... and as the run began (in the suite: pytest's own)
    seconds: float = 0.0

    @property
    def p95_wait(self) -> float:
        waits = sorted(self.honest_waits)
        return waits[min(len(waits) - 1, int(0.95 * len(waits)))] if waits else 0.0

    def fair_bound(self, owners: int) -> float:
        """The longest a fair round can make a reply wait: one reply of every other owner."""
        return owners * max(self.reply_seconds, default=0.0)

    def to_json(self, owners: int) -> dict:
        return {"honest_statuses": self.honest_statuses, "flood_statuses": self.flood_statuses,
                "guess_statuses": self.guess_statuses,
                "honest_p95_wait_s": round(self.p95_wait, 3),
                "honest_max_wait_s": round(max(self.honest_waits, default=0.0), 3),
                "longest_reply_s": round(max(self.reply_seconds, default=0.0), 3),
                "fair_round_s": round(self.fair_bound(owners), 3),
                "honest_finished": self.honest_finished, "honest_saved": self.honest_saved,
                "peak_rss_mb": round(self.peak_rss_mb), "start_rss_mb": round(self.start_rss_mb),
                "seconds": round(self.seconds, 1)}


def _rss_mb() -> float:
    """This process's resident memory now (Linux), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _count(counts: dict[int, int], status: int, lock: threading.Lock) -> None:
    with lock:
        counts[status] = counts.get(status, 0) + 1


def run(honest: int = 6, turns: int = 3, flood: int = 50, tabs: int = 4, guesses: int = 100,
        honest_tokens: int = 16, cap: int = 64, seconds: float = 300.0) -> Figures:
    """The whole test; returns its figures."""
    os.environ["FORWARDED_ALLOW_IPS"] = ""
    trust_proxies(SHARE_TUNNEL)  # as app.py does for --share
    users = [(f"visitor{i}", f"password-{i}") for i in range(honest)]
    store = StatsStore(":memory:")
    tok = byte_tokenizer()
    engine = Engine(loaded(tiny_llama(0), tok, name="tiny"), {"ngram": NgramDrafter()})
    app = create_app(LoadReport(engine, None, []), store,
                     {key: f"flood{i}" for i, key in enumerate(HOSTILE_KEYS)}, logins=users,
                     max_tokens_cap=cap)
    url = ""  # the API's, once it is served (below)
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

    def tunnel(address: str, written: str = "") -> dict:
        return {"X-Forwarded-For": f"{written}, {address}" if written else address}

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

    def flooder(n: int) -> None:
        if time.monotonic() < deadline:
            status, _ = chat(HOSTILE_KEYS[n % 2], HOSTILE, cap, written="198.51.100.10")
            _count(figures.flood_statuses, status, lock)

    def guesser(n: int) -> None:
        if time.monotonic() > deadline:
            return
        user = users[n % honest][0]
        r = httpx.get(f"{url}/models", timeout=30, headers={
            "Authorization": f"Bearer {user}:guess-{n}",
            **tunnel(HOSTILE, written=f"198.51.100.{10 + n % honest}")})
        _count(figures.guess_statuses, r.status_code, lock)

    try:
        with served_on_loopback(app) as base, \
                ThreadPoolExecutor(max_workers=honest + tabs + 2) as pool:
            url = base + "/v1"
            jobs = [pool.submit(flooder, n) for n in range(flood)]
            jobs += [pool.submit(guesser, n) for n in range(guesses)]
            time.sleep(0.2)  # the flood is in the line first
            jobs += [pool.submit(visitor, i) for i in range(honest)]
            for job in jobs:
                job.result()
    finally:
        sampling.set()
        sampler.join(5)
    figures.seconds = time.monotonic() - start

    def saved() -> int:
        return sum(len(store.turns(c["id"], owner=f"user:{user}"))
                   for user, _ in users for c in store.conversations(owner=f"user:{user}"))

    settle = time.monotonic() + 10  # turns are written in the background
    while saved() < figures.honest_finished and time.monotonic() < settle:
        time.sleep(0.05)
    figures.honest_saved = saved()
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--honest", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--flood", type=int, default=50)
    p.add_argument("--guesses", type=int, default=100)
    p.add_argument("--seconds", type=float, default=300.0)
    args = p.parse_args()
    figures = run(args.honest, args.turns, args.flood, guesses=args.guesses,
                  seconds=args.seconds)
    owners = args.honest + len(HOSTILE_KEYS)
    print(json.dumps(figures.to_json(owners), indent=1))
    ok = set(figures.honest_statuses) == {200} \
        and figures.p95_wait <= figures.fair_bound(owners) \
        and figures.honest_saved == figures.honest_finished == args.honest * args.turns \
        and figures.peak_rss_mb < 2048
    print("share load test:", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
