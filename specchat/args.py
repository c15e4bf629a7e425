"""The command-line arguments shared by `app.py`, `generate`, `bench` and `train-draft`: which
models to load, how to sample, and the checks on both."""

from __future__ import annotations

import argparse
import os
import sys

from specchat.core.engine import TREE_NODES, default_tree_nodes
from specchat.drafters import NAMES, preferred
from specchat.models.presets import PRESETS


BACKEND_KEY_ENV = "SPECCHAT_BACKEND_KEY"




def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--preset", choices=sorted(PRESETS),
                   help="a named target + draft pair: " +
                   "; ".join(f"{k}: {v.note}" for k, v in PRESETS.items()))
    g.add_argument("--target", default=None,
                   help="target model: hub id or local directory (default: the embedded "
                        "Gemma 3 270M, offline)")
    g.add_argument("--draft-model", default=None,
                   help="draft model (hub id or directory) sharing the target's tokenizer; "
                        "'embedded' for the embedded Gemma weights")
    g.add_argument("--quantization", choices=["nf4", "none"], default="nf4",
                   help="target weights: 4-bit NF4 via bitsandbytes (default) or unquantized")
    g.add_argument("--draft-quantization", choices=["nf4", "none"], default="none",
                   help="draft weights (default: unquantized)")
    g.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:1")
    g.add_argument("--head", default=None,
                   help="draft head file from `train-draft` (default: the head trained or "
                        "shipped for this target, if any)")
    b = p.add_argument_group("serving engine as backend (instead of a local model)")
    b.add_argument("--backend", metavar="URL", default=None,
                   help="drive an OpenAI-compatible server: vLLM, SGLang, llama.cpp's "
                        "llama-server or another specchat (python -m specchat serve)")
    b.add_argument("--backend-plain", metavar="URL", default=None,
                   help="a second server of the same model without speculation: the 'off' "
                        "side of A/B replays and of `bench`'s plain mode")
    b.add_argument("--backend-key", metavar="KEY", default=None,
                   help=f"API key for the backend(s) (or set ${BACKEND_KEY_ENV})")
    b.add_argument("--backend-model", metavar="NAME", default=None,
                   help="which served model (default: the first the server lists)")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--speculation", choices=["on", "off"], default="on",
                   help="draft and verify, or plain decoding")
    g.add_argument("--drafter", choices=NAMES, default=None,
                   help="who proposes drafts: a draft model, ngram prompt lookup, the trained "
                        "draft head, combined (ngram when it finds a continuation, else the "
                        "head), or a --backend server's own. Default: the best loaded")
    g.add_argument("--draft-len", type=int, default=4, help="k: most draft tokens per step")
    g.add_argument("--tree-nodes", type=int, default=None,
                   help="the head (and combined, when it uses the head) drafts a tree of up to "
                        "this many tokens, verified in one forward; 0: a chain, sampled at T > 0 "
                        f"(default: {TREE_NODES} for the head when greedy, else 0)")
    g.add_argument("--fixed-draft-len", action="store_true",
                   help="always draft k tokens (default: adapt k to measured acceptance/cost)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: 1 keeps all")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest: 0 keeps all")
    g.add_argument("--seed", type=int, default=0,
                   help="0..2^63-1 gives the same sampled reply each time; -1 a random one")
    g.add_argument("--max-new-tokens", type=int, default=128, help="longest reply, in tokens")


def model_choice(args) -> tuple[str, str]:
    if getattr(args, "backend", None):
        return args.backend, args.backend_plain or ""
    target, draft = args.target, args.draft_model
    if args.preset:
        preset = PRESETS[args.preset]
        target = target or preset.target
        draft = draft if draft is not None else preset.draft
    return target or "embedded", draft or ""


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
                         head=getattr(args, "head", None))
    for note in report.notes:
        progress(note)
    return report


def load_for_cli(args):
    """`load_from_args` reporting on stderr: the LoadReport, or None after saying why the
    models could not be loaded."""
    from specchat.models.loaded import ModelLoadError
    try:
        return load_from_args(args, lambda msg: print(f"specchat: {msg}", file=sys.stderr))
    except ModelLoadError as e:
        print(f"specchat: {e}", file=sys.stderr)
        return None


def config_from_args(args, report):
    from specchat.core.engine import GenerateConfig
    drafters = report.engine.drafters
    drafter = args.drafter or preferred(report.engine.drafters)
    if drafter not in drafters:
        needs = ("a compatible --draft-model" if drafter == "model" else
                 "a draft head for this target (python -m specchat train-draft)")
        drafter = preferred(report.engine.drafters)
        print(f"specchat: drafter {args.drafter!r} needs {needs}; using {drafter}.",
              file=sys.stderr)
    return GenerateConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          speculation=args.speculation == "on", drafter=drafter,
                          draft_len=args.draft_len, adaptive=not args.fixed_draft_len,
                          tree_nodes=default_tree_nodes(args.temperature, drafter)
                          if args.tree_nodes is None else args.tree_nodes)


FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
         "top_p": "--top-p", "top_k": "--top-k", "seed": "--seed", "draft_len": "--draft-len",
         "tree_nodes": "--tree-nodes"}


def validate_sampling(args) -> str | None:
    """Check the sampling flags (`core.inputs`, the page's check too) and write the normalized
    values back; the message for the first bad one, or None."""
    from specchat.core.inputs import InputError, check_settings
    try:
        values = check_settings(max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, draft_len=args.draft_len,
                                tree_nodes=getattr(args, "tree_nodes", None), names=FLAGS)
    except InputError as e:
        return str(e)
    for key, value in values.items():
        if hasattr(args, key):
            setattr(args, key, value)
    return None
