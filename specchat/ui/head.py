"""Scripts the page's HTML carries in its own <head>, so that they run before gradio's modules.

gradio adds a `head=` of its own to the page only once its app has mounted, too late for a
script that must wrap a browser function before gradio's modules take their copies of it.
`HeadScript` puts a script into each HTML page as it is served instead:

- `FRAMES_SCRIPT` (assets/frames.js), on every page: gradio's status trackers tick an
  elapsed-time display by `requestAnimationFrame`, and an idle gradio page keeps one of them
  ticking, 60 frames a second of the browser's work on cores the engine decodes on;
- the login page's notice of a refused login (`login.REFUSAL_SCRIPT`).
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders

from specchat.paths import assets_dir

FRAMES_SCRIPT = f"<script>{(assets_dir() / 'frames.js').read_text(encoding='utf-8')}</script>"


class HeadScript:
    """ASGI middleware: adds `script` (a whole <script> element) to the head of each HTML page
    served whole (status 200, not compressed), just before its </head>."""

    def __init__(self, app, script: str):
        self.app, self.script = app, script.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        start, parts = None, []

        async def send_with_script(message):
            nonlocal start
            if message["type"] == "http.response.start":
                headers = MutableHeaders(raw=message["headers"])
                if (message["status"] == 200 and "content-encoding" not in headers
                        and headers.get("content-type", "").startswith("text/html")):
                    start = message  # held until the whole page is here
                    return
            elif start is not None and message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                page = b"".join(parts).replace(b"</head>", self.script + b"</head>", 1)
                MutableHeaders(raw=start["headers"])["content-length"] = str(len(page))
                await send(start)
                message = {"type": "http.response.body", "body": page}
            await send(message)

        await self.app(scope, receive, send_with_script)
