"""The command-line arguments shared by `app.py`, `generate`, `bench` and `train-draft`: which
models to load, how to sample, and the checks on both."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from specchat.core.engine import MAX_PROMPT_TOKENS
from specchat.core.prefix import PREFIX_CACHE_TOKENS
from specchat.core.settings import (
    SETTINGS,
    add_arguments,
    build_config,
    check,
    flag_names,
    values_from_args,
)
from specchat.drafters import NAMES
from specchat.models.presets import PRESETS


BACKEND_KEY_ENV = "SPECCHAT_BACKEND_KEY"


def _token_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens (0 or more)")
    return n


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--preset", choices=sorted(PRESETS),
                   help="a named target + draft pair: " +
                   "; ".join(f"{k}: {v.note}" for k, v in PRESETS.items()))
    g.add_argument("--target", default=None, metavar="MODEL",
                   help="target model: hub id, local directory, or a GGUF file (or a folder "
                        "holding one), converted once into the cache (default: the embedded "
                        "Gemma 3 270M, offline)")
    g.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="draft model (hub id, directory or GGUF file) sharing the target's "
                        "tokenizer; 'embedded' for the embedded Gemma weights (default: none)")
    g.add_argument("--quantization", choices=["nf4", "none"], default="nf4",
                   help="target weights: 4-bit NF4 via bitsandbytes (default) or unquantized")
    g.add_argument("--draft-quantization", choices=["auto", "nf4", "nf4-head", "none"],
                   default="auto",
                   help="draft weights: auto is NF4 on a CPU, where specchat's own forward "
                        "runs the draft on the target's kernels, and unquantized on a GPU; "
                        "nf4-head puts the draft's LM head in NF4 too: fewer bytes a draft "
                        "token, fewer of its tokens accepted (default: auto)")
    g.add_argument("--device", default="auto", metavar="DEVICE", help="auto (CUDA if available), cpu, cuda, cuda:1")
    g.add_argument("--prefix-cache-tokens", type=_token_count, default=PREFIX_CACHE_TOKENS, metavar="N",
                   help="tokens of earlier prompts' whole pages kept for prompts that start the "
                        f"same way (default: {PREFIX_CACHE_TOKENS}; 0: off)")
    g.add_argument("--max-input-tokens", type=_token_count, default=MAX_PROMPT_TOKENS,
                   metavar="N",
                   help="the longest prompt a request may bring, in tokens after the chat "
                        f"format (default: {MAX_PROMPT_TOKENS}; 0: only the model's context "
                        "window)")
    g.add_argument("--head", "--draft-head", dest="head", default=None, metavar="PATH_OR_ID",
                   help="draft head file from `train-draft`, or a public EAGLE-3 head: its "
                        "directory (config.json + weights) or hub id (default: the head "
                        "trained or shipped for this target, if any)")
    b = p.add_argument_group("serving engine as backend (instead of a local model)")
    b.add_argument("--backend", metavar="URL", default=None,
                   help="drive an OpenAI-compatible server: vLLM, SGLang, llama.cpp's "
                        "llama-server or another specchat (python -m specchat serve) "
                        "(default: none, the local model)")
    b.add_argument("--backend-plain", metavar="URL", default=None,
                   help="a second server of the same model without speculation: the 'off' "
                        "run of races and `bench`'s plain mode (default: none)")
    b.add_argument("--backend-key", metavar="KEY", default=None,
                   help=f"API key for the backend(s) (default: ${BACKEND_KEY_ENV}, else none)")
    b.add_argument("--backend-model", metavar="NAME", default=None,
                   help="which served model (default: the first the server lists)")


def trusted_proxy(text: str) -> str:
    """argparse type of --trusted-proxy: an IP address or a CIDR network, as a network."""
    try:
        return str(ipaddress.ip_network(text.strip(), strict=False))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an IP address or network (such as 10.0.0.5 or 10.0.0.0/8)"
        ) from None


def add_trusted_proxy_argument(group) -> None:
    """--trusted-proxy ADDR (repeatable), for whatever serves HTTP; see `trust_proxies`."""
    group.add_argument("--trusted-proxy", metavar="ADDR", action="append", default=[],
                       type=trusted_proxy,
                       help="a reverse proxy (IP or CIDR network, repeatable) whose "
                            "X-Forwarded-For names the client; from any other peer the header "
                            "is ignored and the peer is the client (default: none; with --share, "
                            "the share tunnel on this machine, whose last X-Forwarded-For entry "
                            "is the visitor's address)")


# gradio's share tunnel: frp's client on this machine relays each visitor's request from
# loopback, and frp's HTTP proxies append the visitor's address to X-Forwarded-For. Trusting
# loopback then gives the rightmost entry, the one the tunnel wrote (uvicorn takes the
# rightmost address that is not a trusted proxy); the entries left of it are the visitor's own
# writing and are never read.
SHARE_TUNNEL = ["127.0.0.1/32", "::1/128"]


def proxies_to_trust(trusted: list[str], share: bool) -> list[str]:
    """The --trusted-proxy list, and behind --share the tunnel on this machine."""
    return trusted + [p for p in SHARE_TUNNEL if share and p not in trusted]


def trust_proxies(proxies: list[str]) -> None:
    """Let the HTTP server (uvicorn) read X-Forwarded-For only from `proxies`. Uvicorn takes
    them from $FORWARDED_ALLOW_IPS when the server starts, and trusts loopback when it is
    unset, which would let any local client, a share tunnel's visitors included, choose its
    own address. Call before the server starts."""
    os.environ["FORWARDED_ALLOW_IPS"] = ",".join(proxies)


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--speculation", choices=["on", "off"], default="on",
                   help="draft and verify, or plain decoding")
    g.add_argument("--drafter", choices=NAMES, default=None,
                   help="who proposes drafts: a draft model, ngram prompt lookup, the trained "
                        "draft head, combined (ngram when it finds a continuation, else the "
                        "head), or a --backend server's own (default: the best loaded)")
    g.add_argument("--fixed-draft-len", action="store_true",
                   help="always draft k tokens (default: adapt k to measured acceptance/cost)")
    add_arguments(p)


def model_choice(args) -> tuple[str, str]:
    if getattr(args, "backend", None):
        return args.backend, args.backend_plain or ""
    target, draft = args.target, args.draft_model
    if args.preset:
        preset = PRESETS[args.preset]
        target = target or preset.target
        draft = draft if draft is not None else preset.draft
    return target or "embedded", draft or ""


def head_choice(args) -> str | None:
    """--head, else the preset's public EAGLE-3 head (None: the head trained for the target,
    if any)."""
    head = getattr(args, "head", None)
    if head or getattr(args, "backend", None) or not getattr(args, "preset", None):
        return head
    return PRESETS[args.preset].head or None


def load_from_args(args, progress):
    """Load the models the arguments name (or connect to --backend); `progress(message)`
    hears each step and note. Raises ModelLoadError with a message a user can act on."""
    from specchat.loader import connect_backend, load_engine
    if getattr(args, "backend", None):
        progress(f"Connecting to {args.backend}…")
        report = connect_backend(args.backend, args.backend_plain,
                                 args.backend_key or os.environ.get(BACKEND_KEY_ENV),
                                 args.backend_model)
        for note in report.notes:
            progress(note)
        return report
    target, draft = model_choice(args)
    report = load_engine(target, draft, args.quantization, args.draft_quantization,
                         None if args.device == "auto" else args.device, progress,
                         head=head_choice(args),
                         prefix_tokens=getattr(args, "prefix_cache_tokens", PREFIX_CACHE_TOKENS),
                         max_prompt_tokens=getattr(args, "max_input_tokens", MAX_PROMPT_TOKENS))
    for note in report.notes:
        progress(note)
    return report


def load_for_cli(args):
    """`load_from_args` reporting on stderr: the LoadReport, or None after saying why the
    models could not be loaded."""
    from specchat.models.loaded import ModelLoadError
    try:
        return load_from_args(args, lambda msg: print(
            msg if msg.startswith("specchat: ") else f"specchat: {msg}", file=sys.stderr))
    except ModelLoadError as e:
        print(f"specchat: {e}", file=sys.stderr)
        return None


def config_from_args(args, report):
    """The request the flags describe (`core.settings.build_config`, as the page and the API
    build theirs); raises InputError for a drafter that is not loaded."""
    values = {**values_from_args(args), "speculation": args.speculation == "on",
              "drafter": args.drafter, "adaptive": not args.fixed_draft_len}
    cfg, notes = build_config(values, list(report.engine.drafters), names=flag_names(),
                              greedy_trees=report.engine.greedy_trees)
    for note in notes:
        print(f"specchat: {note}", file=sys.stderr)
    return cfg


def validate_sampling(args) -> str | None:
    """Check the setting flags before any model loads and write the checked values back; the
    message for the first bad one, or None."""
    from specchat.core.inputs import InputError
    values = {name: getattr(args, name) for name in SETTINGS if hasattr(args, name)}
    try:
        checked = check(values, flag_names())
    except InputError as e:
        return str(e)
    for key, value in checked.items():
        if getattr(args, key) is not None:
            setattr(args, key, value)
    return None
