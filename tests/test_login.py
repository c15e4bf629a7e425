"""LoginGuard (specchat/auth.py): constant-time checks, throttling per client address and per
address and username; the page's /login route wired to it (ui/login.py). The lockout cases (a
guesser never locks the user out, the truth when blocked, trusted proxies) are in
test_auth_lockout.py."""

import asyncio
import inspect
import logging
import time

import gradio as gr
import httpx
import pytest
from tiny import free_port

from specchat.auth import LoginGuard, TooManyAttempts, client_address
from specchat.ui.head import HeadScript
from specchat.ui.login import REFUSAL_SCRIPT, ClientAddress, guarded_launch_kwargs

PAIRS = [("alice", "wonderland"), ("bob", "builder")]


class FakeTime:
    """An injected clock and sleep: sleeping advances the clock and is recorded."""

    def __init__(self):
        self.now = 1000.0
        self.slept = []

    def clock(self):
        return self.now

    async def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def make_guard(**options):
    fake = FakeTime()
    return LoginGuard(PAIRS, clock=fake.clock, sleep=fake.sleep, **options), fake


def attempt(guard, username, password, address=None):
    """One check, with `address` given the way the page's middleware gives it."""
    async def go():
        token = client_address.set(address)
        try:
            return await guard.check(username, password)
        finally:
            client_address.reset(token)
    return asyncio.run(go())


def test_accepts_right_password_only():
    guard, _ = make_guard()
    assert attempt(guard, "alice", "wonderland")
    assert attempt(guard, "bob", "builder")
    assert not attempt(guard, "alice", "builder")
    assert not attempt(guard, "alice", "")
    assert not attempt(guard, "carol", "wonderland")
    assert not attempt(LoginGuard([]), "", "")  # no accounts: it only throttles and logs


def test_gradio_awaits_check():
    # gradio awaits auth only when inspect.iscoroutinefunction(auth) says so.
    guard, _ = make_guard()
    assert inspect.iscoroutinefunction(guard.check)
    assert not callable(guard)  # auth=guard would fail at launch instead of letting anyone in
    kwargs = guarded_launch_kwargs(PAIRS)
    assert kwargs["auth"].__self__.delay_for(3) > 0
    app_kwargs = kwargs["app_kwargs"]
    assert [m.cls for m in app_kwargs["middleware"]] == [HeadScript, ClientAddress]
    assert app_kwargs["middleware"][0].kwargs == {"script": REFUSAL_SCRIPT}
    assert TooManyAttempts in app_kwargs["exception_handlers"]
    assert guarded_launch_kwargs(None) == {"auth": None}


def test_delay_grows_with_failures_up_to_cap():
    # Budgets out of the way and no refill while the fake clock moves: the delays alone.
    guard, fake = make_guard(free=2, base=0.25, cap=10.0, budget=100, user_budget=100,
                             refill=1e9)
    assert [guard.delay_for(n) for n in range(1, 6)] == [0, 0, 0.25, 0.5, 1.0]
    assert guard.delay_for(50) == 10.0
    for n in range(1, 21):
        fake.slept.clear()
        assert not attempt(guard, "alice", "guess", "10.0.0.1")
        # The n-th attempt waits delay_for(n) before it is checked (nothing at first).
        assert sum(fake.slept) == guard.delay_for(n)
    assert guard.delay_for(20) == 10.0
    assert guard.failures("alice", "10.0.0.1") == 20
    assert guard.failures("alice") == 20  # the address with the most failures against alice
    assert guard.delay("alice", "10.0.0.1") == 10.0
    assert guard.delay("alice", "10.0.0.2") == 0  # elsewhere, nothing to wait for


def test_a_right_password_waits_as_long_as_a_wrong_one_from_the_same_address():
    """The wait comes before the check: its length says nothing about the password."""
    guard, fake = make_guard(budget=100, user_budget=100, refill=1e9)
    for _ in range(5):
        attempt(guard, "alice", "guess", "10.0.0.1")
    fake.slept.clear()
    assert attempt(guard, "alice", "wonderland", "10.0.0.1")
    right = list(fake.slept)
    fake.slept.clear()
    assert not attempt(guard, "bob", "guess", "10.0.0.1")  # the address's 6th failure
    assert right == fake.slept == [guard.delay_for(6)]


def test_an_address_with_many_failures_slows_other_users_there_only():
    guard, fake = make_guard(refill=1e9)
    for n in range(10):
        attempt(guard, f"user{n}", "guess", "10.0.0.1")
    assert guard.delay("bob", "10.0.0.1") == guard.delay_for(11) > 0
    assert guard.delay("bob", "10.0.0.2") == 0
    fake.slept.clear()
    assert attempt(guard, "bob", "builder", "10.0.0.1")  # slowed, but still let in
    assert fake.slept == [guard.delay_for(11)]
    fake.slept.clear()
    assert attempt(guard, "bob", "builder", "10.0.0.2")
    assert fake.slept == []


def test_success_forgives_the_attempt_and_the_pair_but_not_the_address():
    """A right password clears that address-and-username counter; the address keeps its other
    failures, so knowing one password buys no more guesses at other accounts."""
    guard, _ = make_guard(free=100, budget=100, user_budget=6, refill=1e9)
    for _ in range(5):
        attempt(guard, "alice", "guess", "10.0.0.1")
    assert guard.failures("alice", "10.0.0.1") == 5
    assert attempt(guard, "alice", "wonderland", "10.0.0.1")
    assert guard.failures("bob", "10.0.0.1") == 5  # the address's count: unchanged
    for _ in range(5):  # alice's counter from there starts afresh: checked, not refused
        assert attempt(guard, "alice", "guess", "10.0.0.1") is False
    assert guard.failures("nobody", "10.0.0.1") == 10


def test_failures_refill_and_counters_are_bounded():
    guard, fake = make_guard(refill=60.0, max_keys=4, free=100)  # free: no sleeps move the clock
    for _ in range(5):
        attempt(guard, "alice", "guess", "10.0.0.1")
    fake.now += 59
    assert guard.failures("alice", "10.0.0.1") == 5  # 4.02 left: not a whole one refilled
    fake.now += 1  # a minute after the latest failure: one refilled
    assert guard.failures("alice", "10.0.0.1") == 4
    fake.now += 4 * 60
    assert guard.failures("alice", "10.0.0.1") == 0
    assert len(guard._failures) == 0  # refilled counters are dropped
    for n in range(10):
        attempt(guard, f"user{n}", "guess", f"10.0.0.{n}")
    assert len(guard._failures) == 4  # the two newest attempts' address and pair counters
    assert guard.failures("user9", "10.0.0.9") == 1
    assert guard.failures("user8", "10.0.0.8") == 1
    assert guard.failures("user0", "10.0.0.0") == 0


def test_failures_and_refusals_logged_without_password(caplog):
    guard, _ = make_guard(user_budget=2)
    with caplog.at_level(logging.WARNING, logger="specchat.auth"):
        attempt(guard, "alice", "hunter2-secret", "10.0.0.1")
        attempt(guard, "x" * 1000, "hunter2-secret")
        attempt(guard, "alice", "wonderland", "10.0.0.1")  # a success: not logged
        attempt(guard, "alice", "hunter2-secret", "10.0.0.1")
        attempt(guard, "alice", "hunter2-secret", "10.0.0.1")
        with pytest.raises(TooManyAttempts):
            attempt(guard, "alice", "hunter2-secret", "10.0.0.1")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 5  # each failure and refusal once
    assert "'alice' from '10.0.0.1'" in messages[0]
    assert "unknown address" in messages[1] and len(messages[1]) < 250
    assert "refused" in messages[4] and "retry in" in messages[4]
    assert not any("hunter2" in m for m in messages)


def test_middleware_sets_address_for_login_only():
    seen = []

    async def app(scope, receive, send):
        seen.append(client_address.get())

    async def go():
        middleware = ClientAddress(app)
        for path in ("/login", "/gradio/login/", "/config"):
            await middleware({"type": "http", "path": path, "client": ("1.2.3.4", 5)}, None, None)
        await middleware({"type": "http", "path": "/login", "client": None}, None, None)
        await middleware({"type": "lifespan"}, None, None)
        return client_address.get()

    assert asyncio.run(go()) is None  # reset after each request
    assert seen == ["1.2.3.4", "1.2.3.4", None, None, None]


def test_login_route_is_throttled_then_refused_with_the_seconds_left(caplog):
    kwargs = guarded_launch_kwargs(PAIRS, base=0.05, cap=0.2, user_budget=12)
    guard = kwargs["auth"].__self__
    with gr.Blocks() as demo:
        gr.Markdown("hello")
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                **kwargs)
    url = f"http://127.0.0.1:{port}/login"

    def post(username, password):
        start = time.perf_counter()
        response = client.post(url, data={"username": username, "password": password})
        return response, time.perf_counter() - start

    try:
        with caplog.at_level(logging.WARNING, logger="specchat.auth"), \
                httpx.Client(timeout=30) as client:
            assert post("bob", "builder")[0].status_code == 200  # warms the server up
            answers = [post("alice", f"guess{n}") for n in range(12)]
            assert [r.status_code for r, _ in answers] == [400] * 12
            assert answers[11][1] >= guard.delay_for(12) > answers[0][1]
            # alice's counter from this address is spent: her right password is refused,
            # with the truth and the seconds left, and is not checked.
            refused, _ = post("alice", "wonderland")
            wait = refused.headers["Retry-After"]
            assert refused.status_code == 429 and 0 < int(wait) <= 30
            assert refused.json() == {
                "detail": f"Too many attempts from your address; retry in {wait} s."}
            # The address as a whole is under its budget: bob waits, but gets in.
            response, took = post("bob", "builder")
            assert response.status_code == 200 and response.json() == {"success": True}
            assert took >= guard.delay_for(13)
    finally:
        demo.close()
    messages = [r.getMessage() for r in caplog.records if r.name == "specchat.auth"]
    assert len(messages) == 13
    assert all("'alice' from '127.0.0.1'" in m for m in messages)
    assert "refused" in messages[-1]
    assert not any("guess" in m for m in messages)


def test_the_api_shares_the_guard_without_importing_the_page():
    """The guard is neutral ground: the HTTP API checks its "user:password" keys through it
    and loads none of the page's modules (an api -> ui import would tie the two together)."""
    import subprocess
    import sys
    code = ("import sys, specchat.api.server; "
            "print(sorted(m for m in sys.modules if m.startswith('specchat.ui')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_an_address_that_spends_its_budget_is_refused_for_every_username():
    guard, fake = make_guard(budget=3, refill=60.0, free=100)
    for name in ("u1", "u2", "u3"):
        assert attempt(guard, name, "x", "10.9.9.9") is False
    assert guard.retry_after("alice", "10.9.9.9") == pytest.approx(60.0)
    with pytest.raises(TooManyAttempts) as refused:  # the right password is not even checked
        attempt(guard, "alice", "wonderland", "10.9.9.9")
    assert refused.value.seconds == 60
    assert attempt(guard, "alice", "wonderland", "10.1.1.1") is True
    fake.now += 60  # one failure refilled: the address is checked again
    assert guard.retry_after("alice", "10.9.9.9") == 0
    assert attempt(guard, "alice", "wonderland", "10.9.9.9") is True
