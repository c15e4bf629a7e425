"""specchat's web app: a local chat whose replies stream colored by how each token was produced.

    python app.py                                   # embedded Gemma 3 270M (NF4, CPU), offline
    specchat app                                    # the same, once installed (`pip install .`)
    python app.py --preset qwen2.5-7b               # a named target + draft pair (GPU, hub)
    python app.py --target DIR --draft-model DIR    # any pair sharing a tokenizer
    python app.py --share --auth me:secret          # a public gradio.live link behind a login

This module only parses arguments and launches; the page is `specchat.ui`. The page comes up at
once and the models load in a background thread, with progress shown in the page.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from specchat.api.server import Api, api_router
from specchat.args import (
    add_model_arguments,
    add_trusted_proxy_argument,
    load_from_args,
    model_choice,
    proxies_to_trust,
    trust_proxies,
)
from specchat.engine_queue import EngineLoop
from specchat.help import HelpFormatter
from specchat.stats.cli import add_db_argument
from specchat.stats.store import StatsStore
from specchat.ui.access import Access
from specchat.ui.handlers import warm_up
from specchat.ui.login import guarded_launch_kwargs
from specchat.ui.page import build_ui, launch
from specchat.ui.state import Limits, ModelSlot, hide_paths

AUTH_ENV = "SPECCHAT_AUTH"  # "user:pass" (or "u1:p1,u2:p2"), the same as --auth


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python app.py", formatter_class=HelpFormatter,
        description="specchat: speculative decoding you can see, as a local chat in the browser.")
    add_model_arguments(parser)
    serve = parser.add_argument_group("serving")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (127.0.0.1: this machine only; 0.0.0.0 "
                            "exposes the page to your network)")
    serve.add_argument("--port", type=int, default=None, metavar="N",
                       help="port (default: the first free one from 7860)")
    serve.add_argument("--share", action="store_true",
                       help="also make a public gradio.live link (needs network; when the "
                            "tunnel cannot be made the app says so and keeps serving locally)")
    serve.add_argument("--auth", metavar="USER:PASS", default=None,
                       help=f"require this login (several: u1:p1,u2:p2); or set ${AUTH_ENV} "
                            "(default: no login)")
    serve.add_argument("--api-key", metavar="KEY", action="append", default=[],
                       help="also accept 'Authorization: Bearer KEY' on the OpenAI-compatible "
                            "API at /v1 (repeatable); logins work there as 'USER:PASS' keys")
    serve.add_argument("--admin", metavar="USER", action="append", default=[],
                       help="a login (from --auth) who sees every visitor's conversations in "
                            "the Stats tab (repeatable); others see only their own")
    add_trusted_proxy_argument(serve)
    add_db_argument(serve)
    limits = parser.add_argument_group("limits (enforced server-side, for shared demos)")
    limits.add_argument("--max-input-chars", type=int, default=Limits.max_input_chars,
                        metavar="N", help="longest user message accepted")
    limits.add_argument("--max-new-tokens-cap", type=int, default=Limits.max_new_tokens_cap,
                        metavar="N", help="most new tokens per reply, whatever the page asks")
    return parser


def parse_auth(text: str | None) -> list[tuple[str, str]] | None:
    """"user:pass[,user:pass]" -> [(user, pass)]; None when empty. Raises ValueError."""
    if not text or not text.strip():
        return None
    pairs = []
    for item in text.split(","):
        user, sep, password = item.strip().partition(":")
        if not sep or not user or not password:
            raise ValueError(f"--auth / ${AUTH_ENV} wants USER:PASS, got {item.strip()!r}")
        pairs.append((user, password))
    return pairs


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def exposure_warning(host: str, share: bool, auth) -> str | None:
    """A loud banner when the page is reachable by others without a login."""
    if auth or (is_loopback(host) and not share):
        return None
    where = "a public gradio.live link" if share else f"every machine that can reach {host}"
    line = "!" * 78
    return (f"{line}\n  WARNING: specchat is served to {where} WITHOUT A LOGIN.\n"
            f"  Anyone with the address can chat with your model and use your compute.\n"
            f"  Add --auth USER:PASS (or set ${AUTH_ENV}) to require a login.\n{line}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    auth = _checked(parser, args)
    warning = exposure_warning(args.host, args.share, auth)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    exposed = args.share or not is_loopback(args.host)
    loop = EngineLoop()  # the main thread's, once the page is served: loading, then replies
    slot = _loading_slot(args, exposed, loop)
    store = StatsStore.open_or_disabled(args.db)
    if store.error:
        print(f"specchat: {store.error}", file=sys.stderr)
    # Who owns which conversations: the login when there is one, else the browser on an
    # exposed page; locally without a login the one user sees all (ui/access.py).
    access = Access(auth=bool(auth), exposed=exposed, admins=args.admin)
    demo = build_ui(slot, store, Limits(max_input_chars=args.max_input_chars,
                                        max_new_tokens_cap=args.max_new_tokens_cap), access)
    _serve(args, demo, slot, store, auth)
    try:  # the servers run in threads; the model loads and replies run here
        loop.run()
    except KeyboardInterrupt:
        pass
    finally:
        demo.close()
    return 0


def _checked(parser, args) -> list[tuple[str, str]] | None:
    """The logins (--auth or $SPECCHAT_AUTH), after the checks argparse cannot make."""
    try:
        auth = parse_auth(args.auth if args.auth is not None else os.environ.get(AUTH_ENV))
    except ValueError as e:
        parser.error(str(e))
    if args.max_input_chars < 1 or args.max_new_tokens_cap < 1:
        parser.error("--max-input-chars and --max-new-tokens-cap must be at least 1")
    unknown = sorted(set(args.admin) - {user for user, _ in auth or []})
    if unknown:
        parser.error(f"--admin {', '.join(unknown)}: not a login given by --auth")
    return auth


def _loading_slot(args, exposed: bool, loop: EngineLoop) -> ModelSlot:
    """A slot whose models load on `loop` (the thread that will run the replies) while the
    page is already served."""
    target, draft = model_choice(args)
    what = f"target {target} ({args.quantization})" + (f" and draft {draft}" if draft else "")
    if args.backend:
        what = f"the server at {args.backend}" + (f" (and {draft} for plain replies)"
                                                 if draft else "")
    slot = ModelSlot(description=what)
    if exposed:  # visitors see model names, not where the files live
        slot.redact = hide_paths

    def load(progress):
        progress(f"Loading {what}…")
        report = load_from_args(args, progress)
        if not args.backend:  # a server warms up its own model
            progress("Warming up the target…")
            warm_up(report.engine)
        return report

    slot.load(load, run_on=loop.submit)
    return slot


def _serve(args, demo, slot: ModelSlot, store: StatsStore, auth) -> None:
    """Launch the page, add the API on its port, and say where both are."""
    # The login (if any) is throttled per client address (auth.py); the API's "user:password"
    # keys go through the same guard, so guesses there count the same.
    # Client addresses (which the guard counts failures by) come from X-Forwarded-For only
    # when a --trusted-proxy, or behind --share the tunnel, forwarded the request (its last
    # entry, the one the proxy wrote); otherwise they are the peer's.
    trust_proxies(proxies_to_trust(args.trusted_proxy, args.share))
    login = guarded_launch_kwargs(auth)
    guard = login["auth"].__self__ if login["auth"] else None
    launch(demo, server_name=args.host, server_port=args.port, share=args.share, **login,
           auth_message="specchat: log in with the user and password the host gave you.",
           prevent_thread_lock=True)
    # The OpenAI-compatible API on the same port, behind the same logins (or --api-key). Its
    # requests and the page's replies wait for the engine in one queue (engine_queue.py).
    demo.app.include_router(api_router(Api(
        lambda: slot.report, store, {key: f"key{i + 1}" for i, key in enumerate(args.api_key)},
        logins=auth, max_input_chars=args.max_input_chars,
        max_tokens_cap=args.max_new_tokens_cap, redact=slot.redact, guard=guard)))
    print(f"specchat: OpenAI-compatible API at {demo.local_url.rstrip('/')}/v1",
          file=sys.stderr)
    if not args.share:
        return
    if demo.share_url:
        slot.share_note = "Shared through a public gradio.live link" + \
            (" (login required)." if auth else " WITHOUT a login.")
        print(f"specchat: public link: {demo.share_url}", file=sys.stderr)
    else:
        slot.share_note = ("The public share link could not be created (offline, or the "
                           "tunnel is blocked); the app is served locally only.")
        print(f"specchat: {slot.share_note} Local address: {demo.local_url}",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
