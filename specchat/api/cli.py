"""`python -m specchat serve`: the OpenAI-compatible API on its own port."""

from __future__ import annotations

import argparse
import os
import sys

from specchat.args import (
    add_model_arguments,
    add_trusted_proxy_argument,
    load_for_cli,
    trust_proxies,
)
from specchat.help import HelpFormatter
from specchat.stats.cli import add_db_argument

API_KEY_ENV = "SPECCHAT_API_KEY"  # one key, the same as --api-key


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve", formatter_class=HelpFormatter, help="serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions)",
        description="Serve the engine over an OpenAI-compatible HTTP API. Streamed chunks "
                    "carry each token's kind; the last one carries usage, llama.cpp-style "
                    "timings and specchat's stats.")
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, metavar="N", help="port to listen on")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' (repeatable; or ${API_KEY_ENV})")
    parser.add_argument("--max-new-tokens-cap", "--max-tokens-cap", dest="max_tokens_cap",
                        type=int, default=1024, metavar="N",
                        help="most new tokens per reply, whatever a request asks")
    add_trusted_proxy_argument(parser)
    add_db_argument(parser)
    parser.set_defaults(func=run_serve)
    return parser


def run_serve(args) -> int:
    import threading

    import uvicorn

    from specchat.api.server import create_app
    from specchat.engine_queue import EngineLoop
    from specchat.stats.store import StatsStore

    keys = args.api_key or ([os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) else [])
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        print("specchat: WARNING: serving the API beyond this machine without --api-key: "
              "anyone who can reach it can use your model.", file=sys.stderr)
    report = load_for_cli(args)
    if report is None:
        return 1
    store = StatsStore.open_or_disabled(args.db)
    if store.error:
        print(f"specchat: {store.error}", file=sys.stderr)
    app = create_app(report, store, {key: f"key{i + 1}" for i, key in enumerate(keys)},
                     max_tokens_cap=args.max_tokens_cap)
    trust_proxies(args.trusted_proxy)  # X-Forwarded-For from the named proxies only
    # The server in a thread; replies run on this one (engine_queue.EngineLoop)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, name="specchat-api-server", daemon=True)
    thread.start()
    loop = EngineLoop()
    watch = threading.Thread(target=lambda: (thread.join(), loop.stop()), daemon=True)
    watch.start()  # a server that stops (its port taken, say) ends the loop too
    try:
        loop.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        thread.join(10)
    return 0 if server.started else 1
