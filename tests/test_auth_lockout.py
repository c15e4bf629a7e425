"""A wrong guess costs the guesser, never the account it aims at (specchat/auth.py): failure
budgets per client address and per address and username, the truth when an address is blocked
(the page's /login and the API alike), and X-Forwarded-For read only from a --trusted-proxy.

The page's /login and the API are served in-process here (httpx's ASGI transport), which lets
each request come from the address the test names; the proxy tests start a real server."""

import argparse
import asyncio
import time

import gradio as gr
import httpx
import pytest
from fastapi import FastAPI
from tiny import free_port

from specchat.api.server import Api, api_router
from specchat.app import build_parser
from specchat.args import trust_proxies, trusted_proxy
from specchat.ui.login import REFUSAL_NOTICE_ID, REFUSAL_SCRIPT, guarded_launch_kwargs

PAIRS = [("alice", "wonderland"), ("bob", "builder")]
API_KEY = "sk-test-key"


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def serve(**guard_options):
    """The page (gradio, behind the guarded login) and the API on one app, as app.py serves
    them; no models are loaded, so an API request that passes the login gets 503."""
    kwargs = guarded_launch_kwargs(PAIRS, **guard_options)
    guard = kwargs["auth"].__self__
    app = FastAPI()
    app.include_router(api_router(Api(None, logins=PAIRS, api_keys={API_KEY: "key1"},
                                      guard=guard)))
    with gr.Blocks() as demo:
        gr.Markdown("hello")
    gr.mount_gradio_app(app, demo, "/", app_kwargs=kwargs["app_kwargs"], auth=kwargs["auth"])
    return app, guard


def client(app, address: str) -> httpx.AsyncClient:
    """A client whose requests reach `app` from `address`."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app, client=(address, 40000)),
                             base_url="http://specchat.test", timeout=30)


async def login(app, address, username, password) -> httpx.Response:
    async with client(app, address) as c:
        return await c.post("/login", data={"username": username, "password": password})


async def api_models(app, address, key) -> httpx.Response:
    async with client(app, address) as c:
        return await c.get("/v1/models", headers={"Authorization": f"Bearer {key}"})


def test_parallel_wrong_logins_do_not_hold_a_correct_login_from_another_address():
    """Twenty guesses at bob at once from one address, each held as long as the test likes:
    bob's right password from another address is let in at once, while they still wait."""
    gate, held = asyncio.Event(), []

    async def hold(seconds):  # the guesser's waits end only when the test says so
        held.append(seconds)
        await gate.wait()

    app, guard = serve(sleep=hold, free=1, user_budget=10)

    async def go():
        guesses = [asyncio.create_task(login(app, "10.0.0.1", "bob", f"guess{n}"))
                   for n in range(20)]
        for _ in range(500):  # until the 9 guesses past the free one are held
            if len(held) == 9:
                break
            await asyncio.sleep(0.01)
        start = time.perf_counter()
        right = await asyncio.wait_for(login(app, "10.0.0.2", "bob", "builder"), 10)
        took = time.perf_counter() - start
        still_held = sum(not task.done() for task in guesses)
        gate.set()
        return right, took, still_held, await asyncio.gather(*guesses)

    right, took, still_held, guesses = asyncio.run(go())
    assert right.status_code == 200 and right.json() == {"success": True}
    assert took < 2.0  # no wait at all; the bound only allows for a busy machine
    assert still_held == 9
    # The guesser's own budget (10 for bob from that address) bounded it, however parallel.
    codes = sorted(r.status_code for r in guesses)
    assert codes == [400] * 10 + [429] * 10
    assert guard.failures("bob", "10.0.0.2") == 0


def test_guesses_from_rotating_addresses_do_not_lock_the_user_out():
    """Forty wrong passwords for alice, each from an address of its own, on the page and the
    API: her right password is accepted at once, from a new address or a guessing one."""
    clock = FakeClock()
    app, guard = serve(budget=3, user_budget=2, free=1, clock=clock)

    async def go():
        for n in range(40):
            assert (await login(app, f"10.1.0.{n}", "alice", "guess")).status_code == 400
            response = await api_models(app, f"10.2.0.{n}", "alice:guess")
            assert response.status_code == 401
        return (await login(app, "10.9.0.1", "alice", "wonderland"),
                await login(app, "10.1.0.5", "alice", "wonderland"),
                await api_models(app, "10.2.0.7", "alice:wonderland"))

    fresh, guessing, api = asyncio.run(go())
    assert fresh.status_code == guessing.status_code == 200
    assert fresh.json() == {"success": True}
    assert api.status_code == 503  # past the login: the models are what is missing here
    assert guard.retry_after("alice", "10.9.0.1") == 0


def test_a_blocked_address_is_told_so_with_the_seconds_left():
    clock = FakeClock()
    app, guard = serve(budget=4, user_budget=3, refill=60.0, free=100, clock=clock)
    truth = "Too many attempts from your address; retry in {} s."

    async def go():
        for n in range(3):
            wrong = await login(app, "10.0.0.1", "alice", f"guess{n}")
            assert wrong.status_code == 400
        # alice's budget from 10.0.0.1 is spent: her right password is refused, unchecked.
        page = await login(app, "10.0.0.1", "alice", "wonderland")
        assert page.status_code == 429 and page.headers["Retry-After"] == "60"
        assert page.json() == {"detail": truth.format(60)}
        clock.now += 20  # the seconds said are the seconds left
        page = await login(app, "10.0.0.1", "alice", "wonderland")
        api = await api_models(app, "10.0.0.1", "alice:wonderland")
        for response in (page, api):
            assert response.status_code == 429 and response.headers["Retry-After"] == "40"
            assert "Incorrect" not in response.text
        assert page.json() == {"detail": truth.format(40)}
        assert api.json()["error"]["message"] == truth.format(40)
        assert api.json()["error"]["type"] == "rate_limit_error"
        # From elsewhere, and from there once the budget refilled, she is let in.
        assert (await login(app, "10.0.0.2", "alice", "wonderland")).status_code == 200
        clock.now += 40
        assert (await login(app, "10.0.0.1", "alice", "wonderland")).status_code == 200
        # Its 3 failures are 2 after a minute; two more spend the address's own budget (4):
        # then every credential from it is refused, an API key too, right or wrong alike.
        for n in range(2):
            assert (await login(app, "10.0.0.1", "bob", f"guess{n}")).status_code == 400
        return (await login(app, "10.0.0.1", "bob", "builder"),
                await api_models(app, "10.0.0.1", API_KEY),
                await api_models(app, "10.0.0.3", API_KEY))

    page, api, elsewhere = asyncio.run(go())
    assert page.status_code == api.status_code == 429
    assert page.json()["detail"] == api.json()["error"]["message"] == truth.format(60)
    assert elsewhere.status_code == 503  # the key itself is fine


def test_the_login_page_carries_the_script_that_shows_a_refusal():
    """gradio's login form reports only a 400; the page's script shows a 429's reason."""
    app, _ = serve()

    async def go():
        async with client(app, "10.0.0.1") as c:
            return await c.get("/")

    page = asyncio.run(go())
    assert page.status_code == 200 and page.text.count(REFUSAL_SCRIPT) == 1
    assert int(page.headers["content-length"]) == len(page.content)
    assert f'"{REFUSAL_NOTICE_ID}"' in REFUSAL_SCRIPT
    assert "textContent = reason" in REFUSAL_SCRIPT and "innerHTML" not in REFUSAL_SCRIPT


# -- --trusted-proxy ---------------------------------------------------------------------------

def test_trusted_proxy_takes_addresses_and_networks_only():
    args = build_parser().parse_args(["--trusted-proxy", "10.0.0.5", "--trusted-proxy",
                                      "10.0.0.0/8", "--trusted-proxy", "::1"])
    assert args.trusted_proxy == ["10.0.0.5/32", "10.0.0.0/8", "::1/128"]
    assert build_parser().parse_args([]).trusted_proxy == []  # none by default
    for bad in ("proxy.example", "10.0.0.300", "10.0.0.0/40", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            trusted_proxy(bad)


def test_serve_takes_trusted_proxies_too():
    from specchat.cli import build_parser as cli_parser

    args = cli_parser().parse_args(["serve", "--trusted-proxy", "192.168.1.0/24"])
    assert args.trusted_proxy == ["192.168.1.0/24"]
    assert cli_parser().parse_args(["serve"]).trusted_proxy == []


@pytest.mark.parametrize("proxies, trusted", [
    ([], False),  # the default: no proxy, loopback (a share tunnel) included
    (["10.0.0.0/8"], False),  # a proxy elsewhere: this peer is not it
    (["127.0.0.1"], True),
    (["127.0.0.0/8"], True),
])
def test_x_forwarded_for_is_read_only_from_a_trusted_proxy(monkeypatch, proxies, trusted):
    """A real server, started the way app.py starts it: a wrong login and a wrong API key
    claiming to come from elsewhere count against the claimed address only when the peer
    (127.0.0.1 here) is a trusted proxy; otherwise against the peer."""
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "restored after the test")
    trust_proxies([trusted_proxy(p) for p in proxies])
    kwargs = guarded_launch_kwargs(PAIRS)
    guard = kwargs["auth"].__self__
    with gr.Blocks() as demo:
        gr.Markdown("hello")
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                **kwargs)
    try:
        demo.app.include_router(api_router(Api(None, logins=PAIRS, guard=guard)))
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=30) as c:
            page = c.post(f"{url}/login", data={"username": "alice", "password": "guess"},
                          headers={"X-Forwarded-For": "203.0.113.7"})
            api = c.get(f"{url}/v1/models", headers={"Authorization": "Bearer bob:guess",
                                                     "X-Forwarded-For": "203.0.113.8"})
    finally:
        demo.close()
    assert page.status_code == 400 and api.status_code == 401
    if trusted:
        assert guard.failures("alice", "203.0.113.7") == guard.failures("bob", "203.0.113.8") == 1
        assert guard.failures("alice", "127.0.0.1") == 0
    else:
        assert guard.failures("alice", "203.0.113.7") == guard.failures("bob", "203.0.113.8") == 0
        assert guard.failures("carol", "127.0.0.1") == 2  # the address: both failures


def test_behind_the_share_tunnel_each_visitor_counts_under_the_address_the_tunnel_wrote(
        monkeypatch):
    """A real server trusting the share tunnel as app.py does for --share, reached through a
    fake tunnel: requests from 127.0.0.1 whose X-Forwarded-For ends with the visitor's
    address, as frp's HTTP proxy appends it. A hostile visitor guesses passwords and keys with
    forged entries naming an honest visitor's address: only the hostile address is blocked,
    and the honest visitor's right password and key go through at once."""
    from specchat.args import SHARE_TUNNEL, proxies_to_trust

    assert proxies_to_trust([], share=False) == []
    assert proxies_to_trust(["10.0.0.0/8"], share=True) == ["10.0.0.0/8", *SHARE_TUNNEL]
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "restored after the test")
    trust_proxies(proxies_to_trust([], share=True))
    kwargs = guarded_launch_kwargs(PAIRS, budget=5, user_budget=3, free=1000)
    guard = kwargs["auth"].__self__
    with gr.Blocks() as demo:
        gr.Markdown("hello")
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                **kwargs)
    hostile, honest = "203.0.113.66", "198.51.100.20"

    def tunnel(visitor: str, written: str = "") -> dict:
        """The headers the tunnel passes on: what the visitor wrote, then its address."""
        return {"X-Forwarded-For": f"{written}, {visitor}" if written else visitor}

    try:
        demo.app.include_router(api_router(Api(None, logins=PAIRS, api_keys={API_KEY: "key1"},
                                               guard=guard)))
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=30) as c:
            guesses = [c.post(f"{url}/login", data={"username": "alice", "password": f"g{n}"},
                              headers=tunnel(hostile, written=honest)).status_code
                       for n in range(8)]
            guesses += [c.get(f"{url}/v1/models", headers={
                "Authorization": f"Bearer bob:g{n}", **tunnel(hostile, f"{honest}, 127.0.0.1")}
            ).status_code for n in range(4)]
            right = c.post(f"{url}/login", data={"username": "alice", "password": "wonderland"},
                           headers=tunnel(honest))
            key = c.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}",
                                                     **tunnel(honest)})
            login_key = c.get(f"{url}/v1/models", headers={"Authorization": "Bearer bob:builder",
                                                           **tunnel(honest)})
    finally:
        demo.close()
    # alice's budget from the hostile address (3), then the address's own (5) with bob's
    assert guesses == [400] * 3 + [429] * 5 + [401] * 2 + [429] * 2
    assert right.status_code == 200
    assert key.status_code == login_key.status_code == 503  # past the login: no models here
    assert guard.failures("alice", honest) == 0 and guard.failures("alice", "127.0.0.1") == 0
    assert guard.retry_after("alice", hostile) > 0
