"""The page's login: gradio's `/login` checked by a `LoginGuard` (specchat/auth.py).

Gradio's `/login` route answers a wrong password at once and logs nothing. Here its `auth`
callback is the guard's check, which throttles and logs failures per client address (and per
address and username). Three small pieces connect the two, all installed through the
`app_kwargs` that gradio's `launch()` passes on to `FastAPI(...)`:

- `ClientAddress`, an ASGI middleware, records the address of each `/login` request in the
  context variable the guard reads (`auth.client_address`): gradio calls
  `auth(username, password)` without the request.
- An exception handler turns the guard's `TooManyAttempts` into HTTP 429 with the reason
  ("Too many attempts from your address; retry in N s.") and `Retry-After`.
- `REFUSAL_SCRIPT`, added to the HTML pages by a `head.HeadScript` middleware: gradio's login
  form reports only a 400 (as "Incorrect Credentials"), so the script shows a 429's reason.

`guarded_launch_kwargs` returns these, for the launcher to use in place of `auth=pairs`:

    from specchat.ui.login import guarded_launch_kwargs
    launch(demo, ..., **guarded_launch_kwargs(pairs))

The address is the one uvicorn reports: the peer's, or the `X-Forwarded-For` client when the
peer is a proxy named by `--trusted-proxy` (`args.trust_proxies`). Behind `--share`, visitors
reach the app through gradio's tunnel client on this machine, which is then trusted
(`args.SHARE_TUNNEL`): each visitor counts under the address the tunnel appended, never under
one a visitor wrote, and never under the tunnel's 127.0.0.1 that every visitor shares.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi.responses import JSONResponse
from starlette.middleware import Middleware

from specchat.auth import LoginGuard, TooManyAttempts, client_address
from specchat.ui.head import HeadScript

REFUSAL_NOTICE_ID = "specchat-login-refused"

# Runs before gradio's scripts: wraps `fetch` so that a 429 from `/login` puts the server's
# reason on the page (as text, never as markup) and hides gradio's "Incorrect Credentials" left
# from an earlier 400 (`p.creds`), which would be false now. The next answer from `/login`
# takes the notice away and gives gradio its message back.
REFUSAL_SCRIPT = f"""<script>
(() => {{
  const fetchBefore = window.fetch;
  window.fetch = async (...args) => {{
    const response = await fetchBefore(...args);
    const target = args[0] instanceof Request ? args[0].url : String(args[0]);
    if (!/\\/login\\/?$/.test(new URL(target, location.href).pathname)) return response;
    const refused = response.status === 429;
    document.querySelectorAll("p.creds").forEach(p => {{ p.hidden = refused; }});
    document.getElementById("{REFUSAL_NOTICE_ID}")?.remove();
    if (refused) {{
      let reason = "Too many attempts from your address; retry later.";
      try {{ reason = (await response.clone().json()).detail || reason; }} catch (e) {{}}
      const note = document.createElement("p");
      note.id = "{REFUSAL_NOTICE_ID}";
      note.setAttribute("role", "alert");
      note.style.cssText = "position:fixed;top:1rem;left:50%;transform:translateX(-50%);" +
        "z-index:1000;margin:0;padding:.6rem 1rem;border-radius:.4rem;" +
        "background:#fef2f2;color:#991b1b;border:1px solid #fca5a5;font:14px sans-serif";
      note.textContent = reason;
      document.body.prepend(note);
    }}
    return response;
  }};
}})();
</script>"""


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


async def too_many_attempts(request, refused: TooManyAttempts) -> JSONResponse:
    """HTTP 429 for a login refused unchecked, in the shape of gradio's own login errors."""
    return JSONResponse({"detail": str(refused)}, status_code=429,
                        headers={"Retry-After": str(refused.seconds)})


def guarded_launch_kwargs(pairs: Iterable[tuple[str, str]] | None, **guard_options) -> dict:
    """`demo.launch` keyword arguments for a login checked by a `LoginGuard`: `auth` and the
    `app_kwargs` that install the pieces above. No pairs: `{"auth": None}` (no login)."""
    pairs = list(pairs or [])
    if not pairs:
        return {"auth": None}
    guard = LoginGuard(pairs, **guard_options)
    # A fresh dict per call: gradio adds its own entries (lifespan, response class) to it.
    return {"auth": guard.check,
            "app_kwargs": {"middleware": [Middleware(HeadScript, script=REFUSAL_SCRIPT),
                                          Middleware(ClientAddress)],
                           "exception_handlers": {TooManyAttempts: too_many_attempts}}}
