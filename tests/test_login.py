"""LoginGuard (specchat/auth.py): constant-time checks, throttling per username and address; the
page's /login route wired to it (ui/login.py)."""

import asyncio
import inspect
import logging
import socket
import time

import gradio as gr
import pytest
import httpx

from specchat.auth import LoginGuard, client_address
from specchat.ui.login import ClientAddress, guarded_launch_kwargs

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
    assert kwargs["app_kwargs"]["middleware"][0].cls is ClientAddress
    assert guarded_launch_kwargs(None) == {"auth": None}


def test_delay_grows_with_failures_up_to_cap():
    guard, fake = make_guard(free=2, base=0.25, cap=10.0)
    assert [guard.delay_for(n) for n in range(1, 6)] == [0, 0, 0.25, 0.5, 1.0]
    assert guard.delay_for(50) == 10.0
    first = None
    for n in range(1, 21):
        fake.slept.clear()
        assert not attempt(guard, "alice", "guess", "10.0.0.1")
        if n == 1:
            first = sum(fake.slept)
    assert first == 0
    # The 20th failure is answered after the capped delay, split into a wait before the check
    # (the count was already over the threshold) and the rest after the failure.
    assert sum(fake.slept) == guard.delay_for(20) == 10.0 > first
    assert guard.failures("alice") == 20
    assert guard.delay("alice") == 10.0


def test_address_with_many_failures_slows_other_users():
    guard, fake = make_guard()
    for n in range(10):
        attempt(guard, f"user{n}", "guess", "10.0.0.1")
    assert guard.delay("bob", "10.0.0.1") == guard.delay_for(10) > 0
    assert guard.delay("bob", "10.0.0.2") == 0
    fake.slept.clear()
    assert attempt(guard, "bob", "builder", "10.0.0.1")  # slowed, but still let in
    assert sum(fake.slept) == guard.delay_for(10)
    fake.slept.clear()
    assert attempt(guard, "bob", "builder", "10.0.0.2")
    assert fake.slept == []


def test_success_resets_user_and_address():
    guard, _ = make_guard()
    for _ in range(5):
        attempt(guard, "alice", "guess", "10.0.0.1")
    assert guard.failures("alice", "10.0.0.1") == 5
    assert attempt(guard, "alice", "wonderland", "10.0.0.1")
    assert guard.failures("alice") == 0
    assert guard.failures("nobody", "10.0.0.1") == 0


def test_failures_expire_and_keys_are_bounded():
    guard, fake = make_guard(window=60.0, max_keys=4, free=10)  # free: no sleeps move the clock
    for _ in range(5):
        attempt(guard, "alice", "guess", "10.0.0.1")
    fake.now += 59
    assert guard.failures("alice") == 5
    fake.now += 1  # a minute after the latest failure
    assert guard.failures("alice") == 0
    assert guard.failures("x", "10.0.0.1") == 0
    assert len(guard._failures) == 0
    for n in range(10):
        attempt(guard, f"user{n}", "guess", f"10.0.0.{n}")
    assert len(guard._failures) == 4  # the newest two usernames and addresses
    assert guard.failures("user9", "10.0.0.9") == 1
    assert guard.failures("user0", "10.0.0.0") == 0


def test_failures_logged_without_password(caplog):
    guard, _ = make_guard()
    with caplog.at_level(logging.WARNING, logger="specchat.auth"):
        attempt(guard, "alice", "hunter2-secret", "10.0.0.1")
        attempt(guard, "x" * 1000, "hunter2-secret")
        attempt(guard, "alice", "wonderland", "10.0.0.1")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2  # failures only
    assert "'alice'" in messages[0] and "10.0.0.1" in messages[0]
    assert "unknown address" in messages[1] and len(messages[1]) < 200
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_login_route_is_throttled(caplog):
    kwargs = guarded_launch_kwargs(PAIRS, base=0.05, cap=0.2)
    guard = kwargs["auth"].__self__
    with gr.Blocks() as demo:
        gr.Markdown("hello")
    port = _free_port()
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
            answers = [post("alice", f"guess{n}") for n in range(20)]
            assert [r.status_code for r, _ in answers] == [400] * 20
            first, twentieth = answers[0][1], answers[19][1]
            assert twentieth >= guard.delay_for(20) > first
            # 127.0.0.1 is throttled now: bob's right password waits, but gets in.
            response, took = post("bob", "builder")
            assert response.status_code == 200 and response.json() == {"success": True}
            assert took >= guard.delay_for(20)
            # alice's own counter is still high; her right password also gets in.
            response, took = post("alice", "wonderland")
            assert response.status_code == 200
            assert took >= guard.delay_for(20)
            assert guard.failures("alice", "127.0.0.1") == 0
    finally:
        demo.close()
    failures = [r.getMessage() for r in caplog.records if r.name == "specchat.auth"]
    assert len(failures) == 20
    assert all("'alice' from 127.0.0.1" in m for m in failures)
    assert not any("guess" in m for m in failures)


def test_parallel_guesses_for_one_user_wait_in_line():
    """Guesses sent at once for one username are checked one after another, each after the
    delay its predecessors earned: together they take the sum of the delays, not the longest
    one, so parallelism buys an attacker nothing."""
    guard = LoginGuard(PAIRS, free=2, base=0.02, cap=10.0)

    async def go():
        return await asyncio.gather(*(guard.check("alice", f"guess{n}", "10.0.0.9")
                                      for n in range(8)))

    start = time.perf_counter()
    assert asyncio.run(go()) == [False] * 8
    took = time.perf_counter() - start
    assert guard.failures("alice") == 8
    assert took >= sum(guard.delay_for(n) for n in range(1, 9))  # 1.26 s; at once: 0.64 s
    assert not guard._lines  # no lock kept once the line is empty


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


def test_a_spent_failure_budget_refuses_even_the_right_password_until_it_refills(caplog):
    """However many guesses arrive in parallel, at most `budget` are checked for a username
    before it refuses outright; one more is checked per `refill` seconds after that."""
    guard, fake = make_guard(budget=5, refill=60.0, free=100)  # no delays: the budget alone

    async def burst():
        return await asyncio.gather(*(guard.check("bob", f"guess{n}", f"10.0.0.{n}")
                                      for n in range(40)))

    with caplog.at_level(logging.WARNING, logger="specchat.auth"):
        assert asyncio.run(burst()) == [False] * 40
    checked = [r for r in caplog.records if "login failed" in r.getMessage()]
    refused = [r for r in caplog.records if "login refused" in r.getMessage()]
    assert len(checked) == 5 and len(refused) == 35  # each attempt logged once
    assert attempt(guard, "bob", "builder") is False  # refused: not even checked
    assert guard.retry_after("bob") == pytest.approx(60.0)
    fake.now += 61  # one failure refilled
    assert guard.retry_after("bob") == 0
    assert attempt(guard, "bob", "builder") is True  # and a success refills the whole budget
    assert guard.retry_after("bob") == 0 and ("user", "bob") not in guard._buckets


def test_an_address_that_spends_its_budget_is_refused_for_every_username():
    guard, fake = make_guard(budget=3, refill=60.0, free=100)
    for name in ("u1", "u2", "u3"):
        assert attempt(guard, name, "x", "10.9.9.9") is False
    assert guard.retry_after("alice", "10.9.9.9") > 0
    assert attempt(guard, "alice", "wonderland", "10.9.9.9") is False
    assert attempt(guard, "alice", "wonderland", "10.1.1.1") is True
