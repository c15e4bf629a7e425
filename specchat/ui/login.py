"""The page's login: gradio's `/login` checked by a `LoginGuard` (specchat/auth.py).

Gradio's `/login` route answers a wrong password at once and logs nothing. Here its `auth`
callback is the guard's check, which throttles and logs failures per username and per client
address. Gradio calls `auth(username, password)` without the request, so `ClientAddress`, a small
ASGI middleware, records the address of each `/login` request in the context variable the guard
reads (`auth.client_address`). Gradio builds its FastAPI app inside `launch()`, which passes
`app_kwargs` on to `FastAPI(...)`: a `middleware=[...]` entry there installs ours before the
server starts. `guarded_launch_kwargs` returns both pieces, for the launcher to use in place of
`auth=pairs`:

    from specchat.ui.login import guarded_launch_kwargs
    launch(demo, ..., **guarded_launch_kwargs(pairs))

Behind `--share`, requests reach the app through gradio's local tunnel client; uvicorn takes the
visitor's address from the tunnel's `X-Forwarded-For` header (it trusts the header from
127.0.0.1). Where no address is known the guard throttles by username only.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.middleware import Middleware

from specchat.auth import LoginGuard, client_address


class ClientAddress:
    """ASGI middleware: sets `client_address` for HTTP requests to `.../login`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith(("/login", "/login/")):
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        token = client_address.set(client[0] if client else None)
        try:
            await self.app(scope, receive, send)
        finally:
            client_address.reset(token)


def guarded_launch_kwargs(pairs: Iterable[tuple[str, str]] | None, **guard_options) -> dict:
    """`demo.launch` keyword arguments for a login checked by a `LoginGuard`: `auth` and the
    `app_kwargs` that install `ClientAddress`. No pairs: `{"auth": None}` (no login)."""
    pairs = list(pairs or [])
    if not pairs:
        return {"auth": None}
    guard = LoginGuard(pairs, **guard_options)
    # A fresh dict per call: gradio adds its own entries (lifespan, response class) to it.
    return {"auth": guard.check, "app_kwargs": {"middleware": [Middleware(ClientAddress)]}}
