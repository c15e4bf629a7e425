"""Password checks that slow down guessing, shared by every route that takes a password.

A wrong guess costs the guesser, never the account it aims at. `LoginGuard` counts failures
under two keys, both tied to the client's address:

- the address itself (every username tried from it), with a budget of `budget` failures;
- the address and the username together, with a smaller budget, `user_budget`, so that one
  person's typos or guesses at one account do not block others who share the address (a NAT).

Nothing is counted per username alone: a right password from an address that has not been
guessing is let in at once, whatever other addresses did. Each count drops by one every
`refill` seconds. Once a count reaches its budget, attempts under that key are refused without
looking at the password (`TooManyAttempts`, which says how many seconds are left), the right
password too: the answer does not tell whether it was right.

Below the budget, an attempt from an address that failed recently waits before it is checked,
a time that doubles with each recent failure (the larger count of the two keys applies). The
wait comes before the check, so a right password waits as long as a wrong one and the answer's
timing says nothing. Waits are awaited with no lock held, and each attempt is counted before it
waits, so attempts sent in parallel see each other: no more than the budget of them get through.

One guard serves the page's `/login` (wired by `ui/login.py`) and the HTTP API's
"user:password" bearer keys (`api/server.py`), so a guess counts the same on either route.
Callers that know the client's address pass it; Gradio's `auth(username, password)` callback
gets no request, so the page's middleware records the address in `client_address`, which the
guard reads when it is given none. The address is the one the HTTP server reports: the peer,
or what a proxy named by `--trusted-proxy` forwarded (`args.trust_proxies`).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# The address of the client whose /login request is being handled (None outside one).
client_address: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "specchat_login_client", default=None)

# Where no address is known, every such attempt shares this one (it is never a real address).
UNKNOWN_ADDRESS = "unknown address"


class TooManyAttempts(Exception):
    """An attempt refused unchecked: its address (or address and username) spent its failure
    budget. `seconds`: whole seconds until an attempt is checked again (for `Retry-After`)."""

    def __init__(self, retry_after: float):
        self.seconds = max(1, _whole(retry_after))
        super().__init__(f"Too many attempts from your address; retry in {self.seconds} s.")


def _digest(text: str) -> bytes:
    # Comparing fixed-length digests keeps the comparison's time independent of the lengths.
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


@dataclass
class _Failures:
    count: float  # failures not yet refilled, as of `at`
    at: float  # clock time of the latest change


class LoginGuard:
    """Checks logins against `pairs` and throttles repeated failures per address.

    Pass `auth=guard.check` to gradio, not the guard itself: gradio awaits `auth` only when
    `inspect.iscoroutinefunction(auth)` is true, which holds for a bound `async def` method but
    not for an instance with an async `__call__` (its coroutine would be taken as a truthy
    answer). The guard is deliberately not callable, so `auth=guard` fails at launch.

    Failures per address: `budget`; per address and username: `user_budget`; each count drops by
    one every `refill` seconds. With n recent failures, counting the attempt at hand, an attempt
    waits `delay_for(n)`: nothing for the first `free`, then `base` seconds, doubling up to
    `cap`. At most `max_keys` counters are kept; those changed longest ago are dropped first.
    """

    def __init__(self, pairs: Iterable[tuple[str, str]], *, free: int = 2, base: float = 0.25,
                 cap: float = 10.0, budget: int = 30, user_budget: int = 10,
                 refill: float = 30.0, max_keys: int = 10_000,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep):
        self._accounts = [(_digest(user), _digest(password)) for user, password in pairs]
        self.free, self.base, self.cap = free, base, cap
        self.budget, self.user_budget, self.refill = budget, user_budget, refill
        self.max_keys = max_keys
        self.clock, self.sleep = clock, sleep
        # ("address", address) or ("pair", address, username) -> its failures, the counter
        # changed longest ago first. Counters that refilled completely are dropped.
        self._failures: OrderedDict[tuple[str, ...], _Failures] = OrderedDict()

    # -- what a caller may ask -----------------------------------------------------------------

    def delay_for(self, failures: int) -> float:
        """Seconds an attempt waits when its address has `failures` recent failures, the
        attempt itself counted."""
        if failures <= self.free:
            return 0.0
        return min(self.cap, self.base * 2.0 ** (failures - self.free - 1))

    def failures(self, username: str, address: str | None = None) -> int:
        """Recent failures of `username` from `address`: the larger of the address's count and
        the address-and-username count. Without an address: the most that any one address has
        against `username` (for reports; `check` files unknown addresses under one name)."""
        now = self.clock()
        if address is None:
            name = username[:128]
            counts = [self._count(key, now) for key in list(self._failures)
                      if key[0] == "pair" and key[2] == name]
        else:
            counts = [self._count(key, now) for key, _ in self._keys(username, address)]
        return _whole(max(counts, default=0.0))

    def delay(self, username: str, address: str | None = None) -> float:
        """Seconds the next attempt for `username` from `address` waits before it is checked
        (without an address: from the address with the most failures against it)."""
        return self.delay_for(self.failures(username, address) + 1)

    def retry_after(self, username: str, address: str | None = None) -> float:
        """Seconds until an attempt for `username` from `address` is checked again (0: now)."""
        now, wait = self.clock(), 0.0
        for key, limit in self._keys(username, address or UNKNOWN_ADDRESS):
            over = self._count(key, now) - (limit - 1)  # a whole failure must refill first
            if over > 1e-9:  # not a floating-point remainder of a failure that refilled
                wait = max(wait, over * self.refill)
        return wait

    def refuse_if_blocked(self, username: str, address: str | None = None) -> None:
        """Raises `TooManyAttempts` when the address, or the address and username, spent its
        failure budget; the refusal is logged. Checks nothing, counts nothing."""
        address = address or client_address.get() or UNKNOWN_ADDRESS
        wait = self.retry_after(username, address)
        if wait > 0:
            refused = TooManyAttempts(wait)
            logger.warning("login refused for user %r from %r: too many failures, retry in "
                           "%d s", username[:64], address[:64], refused.seconds)
            raise refused

    async def check(self, username: str, password: str, address: str | None = None) -> bool:
        """Gradio's `auth` callback: True when the pair is one of ours (after any wait).
        `address`: the client's, where the caller knows it (else the /login middleware's).
        Raises `TooManyAttempts`, before looking at the password, when the address (or the
        address and username) spent its failure budget."""
        address = address or client_address.get() or UNKNOWN_ADDRESS
        self.refuse_if_blocked(username, address)
        # Counted as a failure before waiting: attempts in parallel see each other, and one
        # that is abandoned while it waits still counts. A right password takes it back.
        failures = self._count_failure(username, address)
        wait = self.delay_for(failures)
        if wait:
            await self.sleep(wait)
        if self._matches(username, password):
            self._forgive(username, address)
            return True
        logger.warning("login failed for user %r from %r: %d recent failures from there, "
                       "answered after %.2f s", username[:64], address[:64], failures, wait)
        return False

    # -- bookkeeping ---------------------------------------------------------------------------

    def _matches(self, username: str, password: str) -> bool:
        # Compare with every account, without stopping early, so the time taken says nothing
        # about which usernames exist.
        user, secret = _digest(username), _digest(password)
        found = False
        for known_user, known_secret in self._accounts:
            found |= hmac.compare_digest(user, known_user) & hmac.compare_digest(secret,
                                                                                 known_secret)
        return found

    def _keys(self, username: str, address: str) -> list[tuple[tuple[str, ...], int]]:
        """The two counters an attempt is filed under, each with its budget. Long usernames
        and addresses are cut: they only name a counter, and memory stays bounded."""
        address, username = address[:64], username[:128]
        return [(("address", address), self.budget),
                (("pair", address, username), self.user_budget)]

    def _count(self, key: tuple[str, ...], now: float) -> float:
        """The key's failures not yet refilled (one refills every `refill` seconds)."""
        entry = self._failures.get(key)
        if entry is None:
            return 0.0
        count = entry.count - (now - entry.at) / self.refill
        if count <= 0:
            del self._failures[key]
            return 0.0
        return count

    def _set(self, key: tuple[str, ...], count: float, now: float) -> None:
        self._failures.pop(key, None)
        if count > 0:
            self._failures[key] = _Failures(count, now)  # last: the order stays by change time
        while len(self._failures) > self.max_keys:
            self._failures.popitem(last=False)

    def _count_failure(self, username: str, address: str) -> int:
        """Counts one failure under both keys; returns the larger count, in whole failures."""
        now, counts = self.clock(), []
        for key, _ in self._keys(username, address):
            count = self._count(key, now) + 1
            self._set(key, count, now)
            counts.append(count)
        return _whole(max(counts))

    def _forgive(self, username: str, address: str) -> None:
        """After a right password: the attempt is no failure, and the address-and-username
        counter starts afresh. The address keeps its other failures, so knowing one password
        does not buy more guesses at other accounts."""
        now = self.clock()
        (address_key, _), (pair_key, _) = self._keys(username, address)
        self._set(address_key, self._count(address_key, now) - 1, now)
        self._set(pair_key, 0, now)


def _whole(count: float) -> int:
    """Rounded up, as failures not yet fully refilled (2.4 -> 3) or seconds to wait, with
    room for floating-point error (39.999999999 -> 40, not 41; 4.0000000001 -> 4)."""
    return math.ceil(count - 1e-9)
