"""Who is asking: the identity that owns a visitor's conversations, and who may see them all.

- With a login (`--auth`), a visitor is their username, whatever address the page is served on:
  two users behind one reverse proxy or tunnel never see each other's conversations, and a user
  finds their history again after a reload or on another browser.
- Without a login, on a page only this machine can reach, the one user is the app's owner.
- Without a login on an exposed page (`--share`, a network address), a visitor is their browser:
  a random id kept in the browser's storage (`gr.BrowserState`), stored only as a hash.
- The owner, and users named by `--admin`, see every conversation (`Viewer.sees_all`), and
  they alone may change the loaded models (`Access.manages_models`, the page's Models tab).

Every Stats handler and every saved turn goes through `Access.viewer`, on the server side.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

LOCAL = "local"  # the owner's conversations (and the CLI's)
NOBODY = ""  # matches no conversation: a request we cannot place sees nothing
_BROWSER_ID = re.compile(r"[A-Za-z0-9_-]{32,64}")


@dataclass(frozen=True)
class Viewer:
    owner: str  # stored with the conversations this visitor starts
    sees_all: bool = False

    @property
    def filter(self) -> str | None:
        """`owner=` for StatsStore reads and deletes: None (everything) or this owner."""
        return None if self.sees_all else self.owner


def new_browser_id() -> str:
    return secrets.token_urlsafe(32)


class Access:
    def __init__(self, auth: bool = False, exposed: bool = False, admins: Iterable[str] = ()):
        self.auth, self.exposed = auth, exposed
        self.admins = frozenset(admins)

    @staticmethod
    def valid_browser_id(browser_id) -> bool:
        return isinstance(browser_id, str) and bool(_BROWSER_ID.fullmatch(browser_id))

    def viewer(self, request, browser_id: str | None = None) -> Viewer:
        """The visitor behind a gradio request (None: a local caller such as a test)."""
        username = getattr(request, "username", None) if request is not None else None
        if username:
            return Viewer(f"user:{username}", sees_all=username in self.admins)
        if self.auth:  # a login is required, yet the request has none: see nothing
            return Viewer(NOBODY)
        if not self.exposed:
            return Viewer(LOCAL, sees_all=True)
        if self.valid_browser_id(browser_id):
            digest = hashlib.sha256(browser_id.encode()).hexdigest()[:32]
            return Viewer(f"browser:{digest}")
        return Viewer(NOBODY)

    @property
    def models_offered(self) -> bool:
        """Whether anyone may change the models here: the one user of a page only this
        machine reaches, without a login, or the `--admin` logins."""
        return (not self.auth and not self.exposed) or (self.auth and bool(self.admins))

    def manages_models(self, request) -> bool:
        """Whether the visitor behind a gradio request (None: a local caller such as a test)
        may load other models: the local owner, or a login named by `--admin`. A visitor of an
        exposed page without a login, or any other login, may not."""
        username = getattr(request, "username", None) if request is not None else None
        if username:
            return username in self.admins
        return self.viewer(request).owner == LOCAL
