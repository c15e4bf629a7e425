"""The `bench` subcommand."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from specchat.bench.config import ALL_MODES, HEAD_MODES, HF_MODES, BenchSettings
from specchat.bench.questions import default_questions_path, load_questions
from specchat.bench.report import format_report
from specchat.bench.run import available_modes, bench, current_rss_mb, machine_config, peak_rss_mb
from specchat.core.settings import ANTI_LOOP, PENALTIES, add_arguments
from specchat.help import HelpFormatter

SAMPLER_FLAGS = ["min_p", *PENALTIES]  # engine samplers the bench passes to every mode
SETTING_FLAGS = ["max_new_tokens", "temperature", "top_p", "top_k", "seed", "draft_len",
                 "tree_nodes"]
_B = BenchSettings()
BENCH_DEFAULTS = {name: getattr(_B, name) for name in SETTING_FLAGS}

# ---------------------------------------------------------------------------------------------
# CLI


def _modes_arg(value: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(m.strip() for m in value.split(",") if m.strip()))
    bad = [m for m in modes if m not in ALL_MODES + HEAD_MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(bad) or '(none)'}; choose from "
            f"{', '.join(ALL_MODES + HEAD_MODES)}")
    return modes


def add_cli(subparsers) -> argparse.ArgumentParser:
    from specchat.args import add_model_arguments
    p = subparsers.add_parser(
        "bench", formatter_class=HelpFormatter, help="benchmark decoding modes on a question set",
        description="Run a JSONL question set (specchat's own by default, Spec-Bench's with "
                    "--questions) in several decoding modes side by side on one loaded target, "
                    "interleaved per question, and report tokens/s, speedup over plain "
                    "decoding, acceptance, target calls per token and time to first token, per "
                    "category and overall.")
    p.add_argument("--questions", default=None, metavar="PATH",
                   help="JSONL file, one question a line with `turns` and `category`, such as "
                        "Spec-Bench's question.jsonl (default: specchat's own set, 3 questions "
                        "in each of Spec-Bench's 13 categories)")
    p.add_argument("--categories", nargs="+", default=None, metavar="NAME",
                   help="only these categories, space or comma separated (default: all)")
    p.add_argument("--limit-per-category", type=int, default=None, metavar="N",
                   help="the first N questions of each category (default: all)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed runs, decode every question once more in plain mode "
                        "with timers on, and report where a token's time goes: the forward's "
                        "parts (NF4 layers, LM head, attention, norms, ...) and the host's "
                        "(penalties, sampling, streaming and stats)")
    p.add_argument("--prompt-cache", choices=["warm", "cold"], default="warm",
                   help="warm: each engine keeps its prompt cache across questions, as its "
                        "users run it (specchat's prefix store, llama-server's cache_prompt, "
                        "with --swa-full so that it can keep a prefix on Gemma 3); cold: both "
                        "caches emptied before every question's first turn (default: warm)")
    p.add_argument("--turns", choices=["first", "all"], default="first",
                   help="first turns only, or every turn (follow-ups reuse the cached history)")
    p.add_argument("--modes", type=_modes_arg, default=None,
                   help=f"comma separated, from {','.join(ALL_MODES + HEAD_MODES)} (default: "
                        "every mode the loaded models allow)")
    p.add_argument("--samplers", choices=["examples", "none"], default="examples",
                   help="samplers of every mode: the page's examples' (" +
                        ", ".join(f"{k.replace('_', '-')} {v}" for k, v in ANTI_LOOP.items()) +
                        "), or none; the flags below change single ones (default: examples)")
    # The request's settings, as `generate` and the page name them; the bench's own defaults
    # where they differ (a fixed seed: repeats decode the same text).
    add_arguments(p, names=[*SETTING_FLAGS, *SAMPLER_FLAGS, "dry_sequence_breakers"],
                  defaults=BENCH_DEFAULTS, helps={
                      "seed": "the same seed for every run, so repeats decode the same text",
                      "tree_nodes": "draft-tree size of the head-tree and combined-tree modes"})
    p.add_argument("--fixed-draft-len", action="store_true",
                   help="always draft k tokens where the drafter has them: k does not adapt, and "
                        "the head drafts past its confidence bar (default: the engine adapts "
                        "k)")
    p.add_argument("--hf-pld-tokens", type=int, default=0, metavar="N",
                   help="prompt_lookup_num_tokens for hf-pld (default: --draft-len)")
    p.add_argument("--repeats", type=int, default=1, metavar="N", help="runs per question and mode; "
                                                          "timings are medians")
    p.add_argument("--ignore-stop-strings", action="store_true",
                   help="a stress mode, not real use: stop at EOS and --max-new-tokens only, "
                        "not at the chat format's stop strings. A small base model then loops "
                        "(User: ... Assistant: ...) and any n-gram drafter predicts the loop; "
                        "the report labels its figures as looping text")
    p.add_argument("--format", choices=("chat", "completion"), default="chat",
                   dest="prompt_format",
                   help="how each question is sent, as the page's two modes send a message: "
                        "chat (the chat format, its stop strings) or completion (plain text "
                        "to continue, no stop strings, each turn on its own)")
    p.add_argument("--history", action="store_true",
                   help="one user asking the questions in turn: the engine's modes may draft "
                        "from the prompts and replies of the questions before (never from the "
                        "question's own runs); the report says so")
    p.add_argument("--warmup-tokens", type=int, default=16, metavar="N",
                   help="tokens of one unrecorded warm-up run per mode (0: none)")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch CPU threads (default: torch's choice). On a machine shared with "
                        "other busy processes, 1 avoids threads waiting on each other")
    _add_llama_arguments(p)
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write the full report here (default: the text report only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p


def _add_llama_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "llama.cpp in the same table",
        "Race a llama.cpp server on the same questions, prompt ids and stop condition: mode "
        "`llama.cpp` (plain decoding) and `llama.cpp-T` for each --llama-spec-type T. Build "
        "llama-server once: python -m specchat.backends.llama_cpp build (docs/performance.md).")
    g.add_argument("--llama-server", metavar="URL", default=None,
                   help="a running llama-server (launched on the same weights) (default: "
                        "none)")
    g.add_argument("--llama-server-bin", metavar="PATH", default=None,
                   help="start llama-server from PATH ('auto': the one built into specchat's "
                        "cache) on the embedded model's GGUF, with --threads threads (default: "
                        "none)")
    g.add_argument("--llama-spec-type", metavar="T", action="append", default=[],
                   help="with --llama-server-bin: also a server with llama.cpp's own "
                        "speculation T (ngram-simple, ngram-cache, ...); repeatable (default: "
                        "none)")


def cmd_bench(args) -> int:
    from specchat.args import load_for_cli

    # Options first: a wrong one is said at once, whatever the question file.
    problem = _option_problem(args)
    if problem:
        return _fail(problem, 2)
    path = args.questions or default_questions_path()
    categories = [c for arg in (args.categories or []) for c in arg.split(",") if c]
    questions = _read_questions(args, path, categories)
    if questions is None:
        return 2
    if args.threads > 0:
        import torch
        torch.set_num_threads(args.threads)
    if getattr(args, "backend", None):
        return _fail("bench measures specchat's own engine on this machine; race a server "
                     "beside it with --llama-server URL", 2)
    report = load_for_cli(args)
    if report is None:
        return 1
    loaded_peak_mb, loaded_rss_mb = peak_rss_mb(), current_rss_mb()
    engine = report.engine
    assistant = report.draft.model if report.draft else None
    modes = args.modes or tuple(m for m in available_modes(engine, assistant)
                                if not (_samplers(args) and m in HF_MODES))
    _quiet_transformers()
    settings = _settings(args, modes)
    extra = {"questions_file": str(path), "categories": categories or None,
             "limit_per_category": args.limit_per_category,
             "target": engine.target.label, "draft": report.draft.label if report.draft else None,
             "runtime": engine.target.runtime.to_json()
             if getattr(engine.target, "runtime", None) else None,
             "command": "python -m specchat " + " ".join(sys.argv[1:]),
             "peak_rss_after_load_mb": loaded_peak_mb, "rss_after_load_mb": loaded_rss_mb,
             **machine_config()}
    result = _bench_beside_servers(args, engine, questions, settings, assistant, extra)
    if isinstance(result, int):
        return result
    if args.profile and not result["config"]["interrupted"]:
        from specchat.bench.profile import profile_plain, profile_rows
        from specchat.bench.run import prompt_of

        prompts = [prompt_of(engine.tokenizer, [{"role": "user", "content": q["turns"][0]}],
                             settings) for q in questions]
        result["profile"] = profile_plain(engine, prompts, settings)
        result["profile"]["by_rows"] = profile_rows(engine, prompts[0][0])
        if args.llama_server_bin:  # llama.cpp's side, by its profile program
            result["profile"]["llama"] = _profile_llama(args, engine, prompts, settings, result)
    print(format_report(result))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"report written to {out}", file=sys.stderr)
    return 130 if result["config"]["interrupted"] else 0


def _profile_llama(args, engine, prompts, settings: BenchSettings, result: dict) -> dict:
    import torch

    from specchat.bench.profile import profile_llama
    from specchat.bench.report import llama_decode_ms

    return profile_llama(_llama_binary(args), prompts, settings, list(engine.drafters),
                         args.threads or torch.get_num_threads(), llama_decode_ms(result))


def _fail(message: str, code: int) -> int:
    print(f"specchat: {message}", file=sys.stderr)
    return code


def _option_problem(args) -> str | None:
    from specchat.args import validate_sampling
    hf = [m for m in args.modes or () if m in HF_MODES]
    problem = ("--repeats must be at least 1" if args.repeats < 1 else
               "--seed must be >= 0: the bench compares replies per seed" if args.seed < 0 else
               validate_sampling(args))
    if not problem and hf and _samplers(args):
        problem = (f"{', '.join(hf)} run transformers' generate, which has no DRY and other "
                   "penalties with the same definitions: drop those modes, or pass "
                   "--samplers none without penalty and min-p flags")
    return problem or _llama_problem(args)


def _read_questions(args, path, categories: list[str]) -> list[dict] | None:
    """The questions asked for, or None once the problem with them is said."""
    if not Path(path).is_file():
        _fail(f"no question file at {path}; pass --questions FILE (Spec-Bench's is "
              "data/spec_bench/question.jsonl in its repository)" if args.questions else
              f"the default question file {path} is missing from this install; pass "
              "--questions FILE.", 2)
        return None
    try:
        questions = load_questions(path, categories, args.limit_per_category)
    except (OSError, ValueError) as e:
        _fail(str(e), 2)
        return None
    if not questions:
        _fail(f"no questions in {path}", 2)
        return None
    return questions


def _quiet_transformers() -> None:
    try:
        import transformers
        transformers.logging.set_verbosity_error()  # generate()'s per-call advice, not results
    except Exception:  # noqa: BLE001
        pass


def _samplers(args) -> dict:
    """The samplers of every mode, as GenerateConfig fields: the examples' (--samplers) with
    the sampler flags given (min-p, the penalties) over them."""
    out = dict(ANTI_LOOP) if getattr(args, "samplers", "none") == "examples" else {}
    out.update({name: getattr(args, name) for name in SAMPLER_FLAGS
                if getattr(args, name) is not None})
    if args.dry_sequence_breakers:
        out["dry_sequence_breakers"] = tuple(args.dry_sequence_breakers)
    return out


def _settings(args, modes: tuple[str, ...]) -> BenchSettings:
    return BenchSettings(samplers=_samplers(args), modes=modes, turns=args.turns,
                         prompt_cache=args.prompt_cache,
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                         draft_len=args.draft_len,
                         adaptive=not args.fixed_draft_len, hf_pld_tokens=args.hf_pld_tokens,
                         tree_nodes=args.tree_nodes,
                         repeats=args.repeats, warmup_tokens=args.warmup_tokens,
                         stop_strings=not args.ignore_stop_strings, history=args.history,
                         prompt_format=args.prompt_format)


def _bench_beside_servers(args, engine, questions: list[dict], settings: BenchSettings,
                          assistant, extra: dict) -> dict | int:
    """The bench's result, with the llama.cpp servers asked for running beside the engine (and
    stopped after); or the exit code once a problem is said."""
    from specchat.backends.llama_cpp import LlamaCppError
    from specchat.backends.remote import BackendError
    with contextlib.ExitStack() as servers:
        started: dict = {}  # {mode: LlamaServer} started here
        try:
            remotes = _llama_servers(args, servers, started)
        except (LlamaCppError, BackendError) as e:
            return _fail(str(e), 1)
        settings.modes = tuple(m for m in settings.modes if m not in remotes) + tuple(remotes)
        extra["llama_cpp"] = {mode: r.url for mode, r in remotes.items()} or None
        if started:
            from specchat.backends.llama_cpp import build_info
            extra["llama_cpp_build"] = build_info(_llama_binary(args))
        try:
            return bench(engine, questions, settings, assistant,
                         progress=not args.no_progress, extra_config=extra, remotes=remotes)
        except (ValueError, BackendError) as e:
            dead = [(mode, server) for mode, server in started.items() if server.dead()]
            if dead:  # say how it died, not only that a request failed
                return _fail("\n".join(server.death(f"the bench ran its mode {mode} ({e})")
                                        for mode, server in dead), 1)
            return _fail(str(e), 2)


def _llama_problem(args) -> str | None:
    if args.llama_server and args.llama_server_bin:
        return "give --llama-server URL (a running server) or --llama-server-bin PATH, not both"
    if args.llama_spec_type and not args.llama_server_bin:
        return ("--llama-spec-type needs --llama-server-bin: llama-server sets its speculation "
                "at launch, so the bench starts one server per type")
    if args.llama_server_bin and args.target not in (None, "", "embedded"):
        return ("--llama-server-bin serves the embedded model's GGUF; for another target start "
                "llama-server on its GGUF and pass --llama-server URL")
    if args.llama_server_bin not in (None, "auto") and not Path(args.llama_server_bin).is_file():
        return f"--llama-server-bin {args.llama_server_bin}: no such file"
    return None


def _llama_servers(args, stack: contextlib.ExitStack, started: dict) -> dict:
    """{mode: RemoteEngine} for the llama.cpp modes asked for; servers started here go into
    `started` ({mode: LlamaServer}) and stop when `stack` closes."""
    from specchat.backends.remote import RemoteEngine
    if args.llama_server:
        remote = RemoteEngine(args.llama_server)
        if remote.target.server != "llama.cpp":
            from specchat.backends.remote import BackendError
            raise BackendError(f"{args.llama_server} is a {remote.target.server} server, not "
                               "llama.cpp's llama-server")
        return {"llama.cpp" if remote.speculates is False else "llama.cpp-server": remote}
    if not args.llama_server_bin:
        return {}
    import torch

    from specchat.backends import llama_cpp
    binary = _llama_binary(args)
    if binary is None:
        raise llama_cpp.LlamaCppError("no llama-server in specchat's cache; build it once with "
                                      "python -m specchat.backends.llama_cpp build")
    gguf = llama_cpp.embedded_gguf()
    threads = args.threads or torch.get_num_threads()
    # Warm, its prompt cache must be able to keep a prefix: on a model with sliding-window
    # layers (Gemma 3) llama-server keeps only the window's KV unless told --swa-full, and
    # then encodes every prompt whole whatever it cached.
    extra = llama_cpp.WARM_ARGS if args.prompt_cache == "warm" else []
    remotes = {}
    for spec in [None, *dict.fromkeys(args.llama_spec_type)]:
        mode = f"llama.cpp-{spec}" if spec else "llama.cpp"
        server = llama_cpp.LlamaServer(binary, gguf, _free_port(), threads, spec, extra=extra)
        url = stack.enter_context(server)
        started[mode] = server
        remotes[mode] = RemoteEngine(url)
    return remotes


def _llama_binary(args) -> Path | None:
    """The llama-server --llama-server-bin names ('auto': the one in specchat's cache, None
    where none was built)."""
    from specchat.backends import llama_cpp
    return llama_cpp.cached_server() if args.llama_server_bin == "auto" \
        else Path(args.llama_server_bin)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
