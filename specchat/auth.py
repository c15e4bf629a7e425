"""Password checks that slow down guessing, shared by every route that takes a password.

`LoginGuard` checks the `(user, password)` pairs from `--auth` in constant time, logs every
failure, and delays its answer by a time that doubles with the recent failures for that username
and for that client address (the larger of the two applies). Attempts for one username are
checked one after the other, so guesses sent in parallel wait in line and each pays the delay its
predecessors earned. The delay is awaited, so other visitors are served meanwhile.

Each username and each address also has a failure budget (a token bucket: `budget` failures,
refilled one per `refill` seconds). Once either is spent, attempts are refused without looking
at the password until the bucket refills, so however many clients guess in parallel, no more
than `budget` guesses plus one per `refill` seconds are ever checked for a username.

One guard serves the page's `/login` (wired by `ui/login.py`) and the HTTP API's
"user:password" bearer keys (`api/server.py`), so a guess counts the same on either route.
Callers that know the client's address pass it; Gradio's `auth(username, password)` callback
gets no request, so the page's middleware records the address in `client_address`, which the
guard reads when it is given none.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# The address of the client whose /login request is being handled (None outside one).
client_address: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "specchat_login_client", default=None)


def _digest(text: str) -> bytes:
    # Comparing fixed-length digests keeps the comparison's time independent of the lengths.
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


@dataclass
class _Failures:
    count: int
    last: float  # clock time of the latest failure


class LoginGuard:
    """Checks logins against `pairs` and throttles repeated failures.

    Pass `auth=guard.check` to gradio, not the guard itself: gradio awaits `auth` only when
    `inspect.iscoroutinefunction(auth)` is true, which holds for a bound `async def` method but
    not for an instance with an async `__call__` (its coroutine would be taken as a truthy
    answer). The guard is deliberately not callable, so `auth=guard` fails at launch.

    The first `free` failures cost nothing; after that each failure is answered `base` seconds
    late, doubling per failure up to `cap`. A username's or address's failures are forgotten
    `window` seconds after its latest failure, and at once after a successful login. At most
    `max_keys` usernames and addresses are tracked; the oldest are dropped first.
    """

    def __init__(self, pairs: Iterable[tuple[str, str]], *, free: int = 2, base: float = 0.25,
                 cap: float = 10.0, window: float = 15 * 60, max_keys: int = 10_000,
                 budget: int = 30, refill: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep):
        self._accounts = [(_digest(user), _digest(password)) for user, password in pairs]
        self.free, self.base, self.cap = free, base, cap
        self.window, self.max_keys = window, max_keys
        self.clock, self.sleep = clock, sleep
        # ("user", name) or ("addr", host) -> failures, oldest latest-failure first.
        self._failures: OrderedDict[tuple[str, str], _Failures] = OrderedDict()
        self._lines: dict[str, list] = {}  # username -> [lock, attempts holding or awaiting it]
        self.budget, self.refill = budget, refill
        # key -> [failures left, clock time they were counted at]; full buckets are dropped.
        self._buckets: OrderedDict[tuple[str, str], list[float]] = OrderedDict()

    def delay_for(self, failures: int) -> float:
        """Seconds to hold an answer after `failures` recent failures."""
        if failures <= self.free:
            return 0.0
        return min(self.cap, self.base * 2.0 ** (failures - self.free - 1))

    def failures(self, username: str, address: str | None = None) -> int:
        """Recent failures: the larger of the username's and the address's count."""
        self._expire()
        return max((self._failures[key].count for key in self._keys(username, address)
                    if key in self._failures), default=0)

    def delay(self, username: str, address: str | None = None) -> float:
        """Seconds an attempt for `username` from `address` now waits before it is checked."""
        return self.delay_for(self.failures(username, address))

    async def check(self, username: str, password: str, address: str | None = None) -> bool:
        """Gradio's `auth` callback: True when the pair is one of ours (after any delay).
        `address`: the client's, where the caller knows it (else the /login middleware's)."""
        address = address or client_address.get()
        name = username[:128]
        line = self._lines.setdefault(name, [asyncio.Lock(), 0])
        line[1] += 1
        try:
            async with line[0]:  # one attempt at a time per username: parallel guesses queue
                return await self._check(username, password, address)
        finally:
            line[1] -= 1
            if not line[1]:
                del self._lines[name]

    def retry_after(self, username: str, address: str | None = None) -> float:
        """Seconds until an attempt for `username` from `address` is checked again (0: now):
        the failure budget of the username or of the address is spent."""
        now, wait = self.clock(), 0.0
        for key in self._keys(username, address):
            left = self._left(key, now)
            if left < 1:
                wait = max(wait, (1 - left) * self.refill)
        return wait

    def _left(self, key: tuple[str, str], now: float) -> float:
        bucket = self._buckets.get(key)
        if bucket is None:
            return float(self.budget)
        left = min(self.budget, bucket[0] + (now - bucket[1]) / self.refill)
        bucket[0], bucket[1] = left, now
        if left >= self.budget:
            del self._buckets[key]
        return left

    def _spend(self, username: str, address: str | None) -> None:
        now = self.clock()
        for key in self._keys(username, address):
            left = self._left(key, now)
            self._buckets[key] = [left - 1, now]
            self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)

    async def _check(self, username: str, password: str, address: str | None) -> bool:
        refused = self.retry_after(username, address)
        if refused:
            logger.warning("login refused for user %s from %s: failure budget spent, refills in "
                           "%.0fs", repr(username[:64]), address or "an unknown address",
                           refused)
            return False
        # Already over the threshold: wait before checking, so guesses in line are held too,
        # not only the answers to failed ones.
        waited = self.delay(username, address)
        if waited:
            await self.sleep(waited)
        if self._matches(username, password):
            for key in self._keys(username, address):
                self._failures.pop(key, None)
                self._buckets.pop(key, None)
            return True
        self._spend(username, address)
        failures = self._record_failure(username, address)
        delay = self.delay_for(failures)
        logger.warning("login failed for user %s from %s: %d recent failures, answered after "
                       "%.2fs", repr(username[:64]), address or "an unknown address", failures,
                       delay)
        if delay > waited:
            await self.sleep(delay - waited)
        return False

    def _matches(self, username: str, password: str) -> bool:
        # Compare with every account, without stopping early, so the time taken says nothing
        # about which usernames exist.
        user, secret = _digest(username), _digest(password)
        found = False
        for known_user, known_secret in self._accounts:
            found |= hmac.compare_digest(user, known_user) & hmac.compare_digest(secret,
                                                                                 known_secret)
        return found

    @staticmethod
    def _keys(username: str, address: str | None) -> list[tuple[str, str]]:
        # Long usernames are cut: they only name a counter, and memory stays bounded.
        keys = [("user", username[:128])]
        if address:
            keys.append(("addr", address))
        return keys

    def _record_failure(self, username: str, address: str | None) -> int:
        """Counts a failure for the username and the address; returns the larger count."""
        self._expire()
        now, counts = self.clock(), []
        for key in self._keys(username, address):
            entry = self._failures.pop(key, None) or _Failures(0, now)
            entry.count, entry.last = entry.count + 1, now
            self._failures[key] = entry  # re-inserted last: the order stays by latest failure
            counts.append(entry.count)
        while len(self._failures) > self.max_keys:
            self._failures.popitem(last=False)
        return max(counts)

    def _expire(self):
        """Drops the counters whose latest failure is older than `window`."""
        horizon = self.clock() - self.window
        while self._failures:
            key, entry = next(iter(self._failures.items()))
            if entry.last > horizon:
                break
            del self._failures[key]
