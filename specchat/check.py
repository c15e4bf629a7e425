"""`python -m specchat check`: every path of specchat on one device, as a JSON report.

Built for a machine met for the first time (a CUDA GPU above all): no network, no model files,
no gradio. The models are built in code with random weights and saved as checkpoints, so they
load through the same `load_model` as any model (NF4 through bitsandbytes where it imports):

- two small targets, Gemma-3-shaped (sliding-window layers) and Llama-shaped, with a draft
  model sharing their vocabulary (the target's own weights, unquantized) and a random draft
  head: every drafter runs greedy and seeded, and each reply is compared with plain decoding's;
- the load-time proof (does a verify give the one-token steps' logits bit for bit?);
- the headless stream contract (`generate --json`) and the API's `/v1/chat/completions`;
- one target of a real size (Llama 3.2 1B's shape) for speed: tokens/s plain and speculative,
  step time, what a verify costs by tokens fed, peak GPU memory.

Each check is one JSON line: {"check": name, "ok": true|false|null, ...} (null: skipped, with
why). Random weights say nothing about acceptance on real text; they say whether each path
runs, what it costs, and whether speculation keeps plain decoding's text.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

PROMPTS = ("The quick brown fox", "Once upon a time, in a land far away,",
           "def fibonacci(n):", "Q: What is the capital of France?\nA:")
MAX_NEW = 32  # tokens per reply in the drafter checks
SEEDED_T = 0.8


@dataclass
class Context:
    """What the checks share: the device, where checkpoints go, and what loaded."""
    device: str
    small: bool
    workdir: Path
    shape: str = "1b"  # the speed check's target: Llama 3.2 1B's shape or Llama 3.1 8B's
    profile: bool = False  # the speed check also profiles a forward by kernel (`_kernel_table`)
    quantization: str = "none"  # "nf4" where bitsandbytes imports, else "none"
    bnb_problem: str = ""
    targets: dict = field(default_factory=dict)  # name -> (LoadedModel, checkpoint dir)


def _bitsandbytes() -> tuple[bool, str]:
    try:
        import bitsandbytes
    except Exception as e:  # ImportError, or a CUDA library it cannot load
        return False, f"bitsandbytes does not import ({type(e).__name__}: {e})"
    return True, f"bitsandbytes {bitsandbytes.__version__}"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- the checks ---------------------------------------------------------------------------


def check_environment(ctx: Context) -> dict:
    import transformers
    ok, bnb = _bitsandbytes()
    ctx.quantization, ctx.bnb_problem = ("nf4", "") if ok else ("none", bnb)
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "bitsandbytes": bnb,
           "device": ctx.device, "quantization": ctx.quantization}
    if ctx.device.startswith("cuda"):
        if not torch.cuda.is_available():
            return {**out, "ok": False, "error": "torch sees no CUDA GPU"}
        props = torch.cuda.get_device_properties(ctx.device)
        out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                   bf16=torch.cuda.is_bf16_supported())
    else:
        from specchat.models.runtime import cpu_kind
        out["cpu"] = cpu_kind().describe()
    for module in ("gradio", "fastapi", "sqlite_utils"):
        try:
            __import__(module)
            out[module] = True
        except ImportError:
            out[module] = False
    return {**out, "ok": True}


def _load_target(ctx: Context, name: str, model) -> dict:
    from specchat.models.load import load_model
    from specchat.models.synthetic import byte_tokenizer, save
    path = save(model, byte_tokenizer(), ctx.workdir / name)
    loaded = load_model(str(path), ctx.quantization, ctx.device, progress=lambda *_: None)
    ctx.targets[name] = (loaded, path)
    four_bit = sum(type(m).__name__ == "Linear4bit" for m in loaded.model.modules())
    rt = loaded.runtime
    out = {"target": name, "quantization": loaded.quantization, "linear4bit_layers": four_bit,
           "load_s": round(loaded.load_s, 2), "path": rt.path if rt else "",
           "skipped": list(rt.skipped) if rt else [],
           "row_exact": rt.row_exact if rt else None, "proof": rt.proof if rt else ""}
    if ctx.quantization == "nf4" and four_bit == 0 and loaded.device.type == "cuda":
        return {**out, "ok": False, "error": "NF4 asked, but no layer is 4-bit"}
    if ctx.bnb_problem:
        out["note"] = f"{ctx.bnb_problem}: loaded unquantized"
    return {**out, "ok": True}


def check_load_gemma(ctx: Context) -> dict:
    from specchat.models.synthetic import tiny_gemma3
    return _load_target(ctx, "gemma3-small", tiny_gemma3(0, hidden=128, sliding_window=16))


def check_load_llama(ctx: Context) -> dict:
    from specchat.models.synthetic import tiny_llama
    return _load_target(ctx, "llama-small", tiny_llama(1, layers=3, hidden=128))


def _engine(ctx: Context, name: str):
    """An Engine over target `name` with every drafter: ngram, a draft model (the target's
    own checkpoint, unquantized), a random head, and combined."""
    from specchat.core.engine import Engine
    from specchat.drafters.combined import CombinedDrafter
    from specchat.drafters.head import HeadDrafter
    from specchat.drafters.model import ModelDrafter
    from specchat.drafters.ngram import NgramDrafter
    from specchat.models.eagle import DraftHead, HeadConfig
    from specchat.models.load import load_model

    target, path = ctx.targets[name]
    draft = load_model(str(path), "none", ctx.device, progress=lambda *_: None)
    vocab = len(target.tokenizer)
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target.model, 64))
    head.vocab_ids = torch.arange(40, 104)  # printable bytes
    head = head.to(target.device).attach(target.model).eval()
    ngram = NgramDrafter()
    headd = HeadDrafter(head, target.model, vocab, tree_min_score=0.0)  # random: trees anyway
    return Engine(target, {"ngram": ngram, "model": ModelDrafter(draft.model, vocab,
                                                                  runner=draft.runner),
                           "head": headd, "combined": CombinedDrafter(ngram, headd)})


def _reply(engine, prompt: str, **cfg) -> tuple[list[int], list, object]:
    """(token ids, token events, final stats) of one reply to `prompt` continued as text."""
    from specchat.core.events import GenerationStats, TokenEvent
    from specchat.core.settings import request
    ids, _ = engine.text_prompt(prompt)
    events = list(engine.stream(ids, request(list(engine.drafters), max_new_tokens=MAX_NEW,
                                             **cfg)))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    stats = events[-1]
    assert isinstance(stats, GenerationStats), "the stream's last event is its stats"
    if stats.stop_reason == "error":
        raise RuntimeError(stats.error)
    return [t.id for t in tokens], tokens, stats


def _drafters(ctx: Context, name: str) -> dict:
    """Every drafter, greedy and seeded, against plain decoding on the same prompts."""
    engine = _engine(ctx, name)
    target = ctx.targets[name][0]
    modes = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=SEEDED_T, seed=7)}
    rows, equal, total = [], 0, 0
    for mode, sampling in modes.items():
        plain = [_reply(engine, p, speculation=False, **sampling)[0] for p in PROMPTS]
        for drafter in ("ngram", "model", "head", "combined"):
            # The head's greedy trees are checked wherever the target takes tree masks.
            trees = 6 if drafter == "head" and mode == "greedy" and engine.trees_ok else 0
            same, kinds, drafted, accepted = 0, set(), 0, 0
            for prompt, want in zip(PROMPTS, plain):
                got, tokens, stats = _reply(engine, prompt, speculation=True, drafter=drafter,
                                            draft_len=4, adaptive=False, tree_nodes=trees,
                                            **sampling)
                same += got == want
                kinds |= {t.kind for t in tokens}
                drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
            # A draft model's sampled drafts are tested with its own q: the reply follows plain
            # sampling's distribution, not its text for the seed (docs/design.md).
            exact = mode == "greedy" or drafter != "model"
            rows.append({"mode": mode, "drafter": drafter, "trees": bool(trees),
                         "same_as_plain": f"{same}/{len(PROMPTS)}", "text_expected": exact,
                         "kinds": sorted(kinds),
                         "acceptance": round(accepted / drafted, 3) if drafted else None})
            if exact:
                equal, total = equal + same, total + len(PROMPTS)
    out = {"target": name, "quantization": target.quantization,
           "row_exact": target.row_exact, "same_as_plain": f"{equal}/{total}", "runs": rows}
    if target.row_exact and equal != total:
        return {**out, "ok": False,
                "error": "the target proved row-exact, yet speculation changed a reply"}
    if not target.row_exact:
        out["note"] = ("verifies are not row-exact here: a reply may leave plain decoding's "
                       "at a near-tie; the count above says how often it did")
    return {**out, "ok": True}


def check_drafters_gemma(ctx: Context) -> dict:
    return _drafters(ctx, "gemma3-small")


def check_drafters_llama(ctx: Context) -> dict:
    return _drafters(ctx, "llama-small")


def check_generate_json(ctx: Context) -> dict:
    """`python -m specchat generate --json`, run as a user runs it (its own process): token
    lines, then one stats line; the token texts make the reply."""
    from specchat.core.events import KINDS
    path = ctx.targets["llama-small"][1]
    done = subprocess.run([sys.executable, "-m", "specchat", "generate", "--target", str(path),
                           "--device", ctx.device, "--quantization", ctx.quantization,
                           "--drafter", "ngram", "--json", "--raw", "--max-new-tokens", "24",
                           "--prompt", PROMPTS[0]], capture_output=True, text=True)
    code = done.returncode
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    tokens = [x for x in lines if x.get("type") == "token"]
    result = {"exit_code": code, "token_lines": len(tokens),
              "kinds": sorted({t["kind"] for t in tokens})}
    problems = []
    if code != 0:
        problems.append(f"exit code {code}")
    if not lines or lines[-1].get("type") != "stats":
        problems.append("the last line is not the stats line")
    elif lines[-1]["new_tokens"] != len(tokens):
        problems.append("stats.new_tokens differs from the token lines")
    if any(t["kind"] not in KINDS for t in tokens):
        problems.append("a token kind outside the contract")
    if lines and lines[-1].get("type") == "stats":
        stats = lines[-1]
        result.update({k: stats.get(k) for k in ("tokens_per_s", "drafted", "accepted",
                                                  "mean_accepted_len")})
    return {**result, "ok": not problems, **({"error": "; ".join(problems)} if problems else {})}


def check_api(ctx: Context) -> dict:
    """POST /v1/chat/completions, whole and streamed, in-process."""
    try:
        from fastapi.testclient import TestClient
    except ImportError as e:
        return {"ok": None, "skipped": f"fastapi's test client does not import ({e})"}
    from specchat.api.server import create_app
    from specchat.loader import LoadReport
    engine = _engine(ctx, "llama-small")
    client = TestClient(create_app(LoadReport(engine, None, [])))
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
            "temperature": 0, "drafter": "ngram"}
    whole = client.post("/v1/chat/completions", json=body)
    out: dict = {"status": whole.status_code}
    if whole.status_code != 200:
        return {**out, "ok": False, "error": whole.text[:500]}
    reply = whole.json()
    out["usage"] = reply.get("usage")
    chunks = []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        out["stream_status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    streamed = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in chunks if c.get("choices"))
    text = reply["choices"][0]["message"]["content"]
    kinds = sorted({k for c in chunks for choice in c.get("choices", [])
                    for k in (choice.get("specchat") or {}).get("kinds", [])})
    out.update(chunks=len(chunks), kinds=kinds, same_text=streamed == text)
    ok = out["stream_status"] == 200 and streamed == text and bool(kinds)
    return {**out, "ok": ok, **({} if ok else {"error": "streamed reply differs or has no kinds"})}


# -- speed on a target of a real size -------------------------------------------------------


def _median_ms(fn: Callable[[], None], device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


@torch.inference_mode()
def _verify_costs(runner, vocab: int, device: str, widths=(1, 2, 3, 4, 5, 6, 8, 12, 16),
                  context: int = 256, repeats: int = 9) -> dict:
    """Milliseconds of one target forward feeding n tokens after `context` cached ones (a
    verify of n - 1 drafts), the cache rolled back after each."""
    cache = runner.new_cache()
    ids = torch.randint(3, vocab, (context + max(widths),)).tolist()
    runner.forward(cache, ids[:context], 0, 1)

    def feed(n):
        runner.forward(cache, ids[context:context + n], context, n)
        runner.crop(cache, context + n, context)

    feed(1)  # warm-up
    ms = {n: _median_ms(lambda n=n: feed(n), device, repeats) for n in widths}
    return {"context": context, "ms": {n: round(v, 3) for n, v in ms.items()},
            "vs_one_token": {n: round(v / ms[1], 2) for n, v in ms.items()}}


# Kernel names of the CUDA runtime's matmuls (runners/cuda/kernels.py), by the weights they read
MATMUL_KERNELS = {"nf4": ("_nf4_matmul_kernel", "_nf4_sum_kernel"), "bf16": ("_matmul_kernel",)}


@torch.inference_mode()
def _kernel_table(runner, vocab: int, device: str, widths=(1, 16), context: int = 256,
                  forwards: int = 20, top: int = 12) -> dict:
    """Where a forward of n rows after `context` cached ones spends its time, by kernel, under
    torch's profiler: microseconds a forward and launches a forward of each (on CUDA the
    kernels' device time; elsewhere the CPU time of the torch operations it sees, which leaves
    specchat's C forward out: `bench --profile` times that one by part), each one's share, and
    the read rate of the matmul kernels from the bytes of the weights they read
    (`CudaRunner.weight_bytes`)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    cache = runner.new_cache()
    ids = torch.randint(3, vocab, (context + max(widths),)).tolist()
    runner.forward(cache, ids[:context], 0, 1)
    weights = getattr(runner, "weight_bytes", {})  # the CUDA runtime's, by kind
    out = {"context": context, "forwards": forwards,
           "time": "device" if cuda else "cpu (torch operations only)", "widths": {}}
    for n in widths:
        def feed(n=n):
            runner.forward(cache, ids[context:context + n], context, n)
            runner.crop(cache, context + n, context)

        feed()  # warm-up: compiled, captured, allocated
        _sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(forwards):
                feed()
            _sync(device)
        rows = []
        for e in prof.key_averages():
            us = (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
                  if cuda else e.self_cpu_time_total) / forwards
            if us > 0:
                rows.append({"kernel": e.key, "us": round(us, 1),
                             "launches": round(e.count / forwards, 1)})
        total = sum(r["us"] for r in rows)
        rows.sort(key=lambda r: -r["us"])
        for r in rows:
            r["share"] = round(r["us"] / total, 3) if total else 0.0
        rates = {}
        for kind, names in MATMUL_KERNELS.items():
            us = sum(r["us"] for r in rows if any(name in r["kernel"] for name in names))
            if weights.get(kind) and us > 0:
                rates[kind] = {"us": round(us, 1), "weight_mb": round(weights[kind] / 1e6, 1),
                               "gb_s": round(weights[kind] / us / 1e3, 0)}
        out["widths"][n] = {"us": round(total, 1), "kernels": rows[:top], "matmuls": rates}
    return out


def kernel_summary(table: dict) -> str:
    """`_kernel_table` as lines of text."""
    lines = [f"  by kernel ({table['time']} a forward, after {table['context']} cached tokens, "
             f"mean of {table['forwards']}):"]
    for n, w in table["widths"].items():
        lines.append(f"    {n} row{'s' if int(n) > 1 else ''}: {w['us']:.0f} us")
        for r in w["kernels"]:
            lines.append(f"      {r['us']:9.1f} us {r['share']:6.1%} {r['launches']:6.1f}x  "
                         f"{r['kernel'][:70]}")
        for kind, m in w["matmuls"].items():
            lines.append(f"      {kind} matmuls: {m['us']:.0f} us for {m['weight_mb']} MB of "
                         f"weights, {m['gb_s']:.0f} GB/s")
    return "\n".join(lines)


def _steps_by_drafts(steps) -> dict:
    """{drafts tested: [steps, median ms of draft + verify]}: where a reply's time went."""
    by: dict[int, list[float]] = {}
    for s in steps:
        by.setdefault(s.drafted, []).append(s.draft_s + s.verify_s)
    return {k: [len(v), round(statistics.median(v) * 1000, 2)] for k, v in sorted(by.items())}


def _copy_bandwidth(device: str) -> float | None:
    """GB/s of a 1 GiB device-to-device copy, bytes read plus bytes written (median of 10):
    the rate a decode step's weight reads are held to."""
    if not device.startswith("cuda"):
        return None
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device, 10)
    return 2 * 2**30 / (ms / 1000) / 1e9


def _bytes_per_token(model) -> int:
    """Bytes a decode step reads: every weight once (4-bit codes and their absmax, norms, the
    LM head), the embedding table aside (one row of it)."""
    table = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(t.numel() * t.element_size() for t in model.parameters())
    total += sum(t.numel() * t.element_size() for t in model.buffers())
    return total - (table.numel() * table.element_size() if table is not head else 0)


@torch.inference_mode()
def _hf_generate(loaded, prompt: list[int], max_new: int, device: str) -> dict:
    """transformers' `generate` on the same loaded model (its own forward, DynamicCache),
    greedy, `max_new` tokens: the baseline that any stack gives."""
    model = loaded.model
    ids = torch.tensor([prompt], device=device)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, **kwargs)
    _sync(device)
    seconds = time.perf_counter() - t0
    new = out.shape[1] - len(prompt)
    return {"tokens": new, "tokens_per_s": round(new / seconds, 1)}


@torch.inference_mode()
def _draft_step_ms(path: Path, device: str) -> dict:
    """One token through a draft model of this shape, unquantized (bf16), on the runtime a
    draft model gets on this device: median milliseconds of a step."""
    from specchat.models.load import load_model
    draft = load_model(str(path), "none", device, progress=lambda *_: None)
    runner, vocab = draft.runner, len(draft.tokenizer)
    cache = runner.new_cache()
    ids = torch.randint(3, vocab, (300,)).tolist()
    runner.forward(cache, ids[:256], 0, 1)
    at = [256]

    def step():
        runner.forward(cache, ids[at[0]:at[0] + 1], at[0], 1)
        at[0] += 1

    step()
    ms = _median_ms(step, device, 31)
    return {"runtime": draft.runtime.path if draft.runtime else "", "ms": round(ms, 3)}


SHAPES = ("1b", "8b")


def check_speed(ctx: Context) -> dict:
    """A target of a real size (Llama 3.2 1B's or Llama 3.1 8B's shape, random weights):
    tokens/s plain and speculative, transformers' `generate` on the same loaded model, the
    first token, the step time, verify cost by tokens fed, the copy bandwidth and the decode
    rate it allows, peak GPU memory."""
    from specchat.core.engine import Engine
    from specchat.core.events import GenerationStats, StepRecord, TokenEvent
    from specchat.core.settings import request
    from specchat.drafters.ngram import NgramDrafter
    from specchat.models.load import load_model
    from specchat.models.loaded import LoadedModel
    from specchat.models.synthetic import (
        byte_tokenizer,
        llama_1b_config,
        llama_8b_config,
        random_model,
        save,
    )

    cuda = ctx.device.startswith("cuda")
    config = llama_8b_config() if ctx.shape == "8b" else llama_1b_config(small=ctx.small)
    build_device = ctx.device if cuda else "cpu"
    model = random_model(config, seed=3, device=build_device)
    params = sum(p.numel() for p in model.parameters())  # before 4-bit packing halves them
    tokenizer = byte_tokenizer()
    path = save(model, tokenizer, ctx.workdir / f"llama-{ctx.shape}-shape")
    # The same weights unquantized on transformers' forward, for what 4 bits change in a
    # verify's cost (the 1B shape: 16 GB of bf16 at 8B say nothing new).
    dense = _verify_costs(LoadedModel(model, tokenizer, "llama-shape", "none",
                                      torch.device(build_device), 0.0).runner,
                          config.vocab_size, ctx.device, repeats=5 if ctx.small else 9) \
        if cuda and ctx.shape == "1b" else None
    del model
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    loaded = load_model(str(path), ctx.quantization, ctx.device, progress=lambda *_: None)
    engine = Engine(loaded, {"ngram": NgramDrafter()})
    engine.eos_ids = set()  # random weights: time full-length replies
    prompt, _ = engine.text_prompt("The history of the printing press begins " * 8)
    max_new = 32 if ctx.small else 128
    runs = {}
    for name, cfg in (("plain", dict(speculation=False)),
                      ("ngram", dict(speculation=True, drafter="ngram", draft_len=4))):
        best = None
        for _ in range(2):  # the first run warms up kernels and allocations
            engine.reset_cache()
            engine.prefixes.clear()  # a cold prompt: the first token's time is the prompt's
            events = list(engine.stream(prompt, request(list(engine.drafters),
                                                        max_new_tokens=max_new, **cfg)))
            stats = events[-1]
            assert isinstance(stats, GenerationStats)
            steps = [e for e in events if isinstance(e, StepRecord)]
            decode_s = sum(s.draft_s + s.verify_s for s in steps)  # after the first token
            run = {"tokens": stats.new_tokens, "tokens_per_s": round(stats.tokens_per_s, 1),
                   "decode_tokens_per_s": round((stats.new_tokens - 1) / decode_s, 1)
                   if decode_s > 0 else None,
                   "first_token_ms": round(stats.ttft_s * 1000, 1) if stats.ttft_s else None,
                   "prefill_ms": round((stats.seconds - decode_s) * 1000, 1),
                   "step_ms": round(statistics.median(s.draft_s + s.verify_s for s in steps)
                                    * 1000, 2) if steps else None,
                   "acceptance": round(stats.acceptance_rate, 3),
                   "mean_accepted_len": round(stats.mean_accepted_len, 2),
                   "steps": _steps_by_drafts(steps),
                   "draft_ms": round(stats.draft_s * 1000, 1),
                   "verify_ms": round(stats.verify_s * 1000, 1),
                   "ids": [e.id for e in events if isinstance(e, TokenEvent)]}
            if best is None or run["tokens_per_s"] > best["tokens_per_s"]:
                best = run
        runs[name] = best
    ids = {name: run.pop("ids") for name, run in runs.items()}
    verify = _verify_costs(loaded.runner, config.vocab_size, ctx.device,
                           repeats=5 if ctx.small else 9)
    kernels = _kernel_table(loaded.runner, config.vocab_size, ctx.device,
                            forwards=5 if ctx.small else 20) if ctx.profile else None
    out = {"shape": f"llama-{ctx.shape}" + (" (small)" if ctx.small else ""),
           "parameters_m": round(params / 1e6, 1), "quantization": loaded.quantization,
           "runtime": loaded.runtime.path if loaded.runtime else "",
           "runtime_skipped": list(loaded.runtime.skipped) if loaded.runtime else [],
           "row_exact": loaded.row_exact, "proof": loaded.runtime.proof if loaded.runtime else "",
           "prompt_tokens": len(prompt), "runs": runs,
           "greedy_same_as_plain": ids["ngram"] == ids["plain"],
           "ngram_vs_plain": round(runs["ngram"]["tokens_per_s"] / runs["plain"]["tokens_per_s"],
                                   2),
           "verify": verify,
           **({"verify_unquantized_transformers": dense} if dense else {}),
           **({"kernels": kernels} if kernels else {}),
           "note": "random weights: acceptance says nothing about real text (their greedy text "
                   "loops); the step time and verify costs are the model's"}
    if cuda:
        out["gpu"] = torch.cuda.get_device_name(ctx.device)
        out["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["hf_generate"] = _hf_generate(loaded, prompt, max_new, ctx.device)
        out["plain_vs_hf_generate"] = round(runs["plain"]["tokens_per_s"]
                                            / out["hf_generate"]["tokens_per_s"], 2)
        bandwidth = _copy_bandwidth(ctx.device)
        read = getattr(loaded.runner, "bytes_per_token", None) or _bytes_per_token(loaded.model)
        out["copy_gb_s"] = round(bandwidth, 0)
        out["bytes_per_token_gb"] = round(read / 1e9, 3)
        out["memory_limit_tokens_per_s"] = round(bandwidth * 1e9 / read, 0)
        del engine, loaded
        torch.cuda.empty_cache()
        if ctx.shape == "1b":
            out["draft_model_step"] = _draft_step_ms(path, ctx.device)
    if not out["greedy_same_as_plain"]:  # speculation must never change a greedy reply
        spec, plain = ids["ngram"], ids["plain"]
        first = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a != b),
                     min(len(spec), len(plain)))
        return {**out, "ok": False,
                "error": f"greedy speculative text differs from plain's from token {first} "
                         f"(row-exact proved: {out['row_exact']})"}
    return {**out, "ok": True}


def speed_summary(r: dict) -> str:
    """The speed check's figures side by side, in words."""
    plain, ngram, verify = r["runs"]["plain"], r["runs"]["ngram"], r["verify"]["vs_one_token"]
    where = r.get("gpu", "this CPU")
    lines = [f"{r['shape']} ({r['parameters_m']:,.0f} M parameters, {r['quantization']}) on "
             f"{where}, runtime {r['runtime']}, row-exact: {r['row_exact']}"]
    line = f"  plain {plain['tokens_per_s']} tok/s"
    if "hf_generate" in r:
        line += (f"; transformers generate on the same model {r['hf_generate']['tokens_per_s']}"
                 f" tok/s (plain is {r['plain_vs_hf_generate']}x); memory limit "
                 f"{r['memory_limit_tokens_per_s']:.0f} tok/s ({r['bytes_per_token_gb']} GB a "
                 f"token at {r['copy_gb_s']:.0f} GB/s)")
    lines.append(line)
    lines.append(f"  ngram k=4 {ngram['tokens_per_s']} tok/s ({r['ngram_vs_plain']}x plain, "
                 f"{ngram['mean_accepted_len']} tokens a step; random weights loop)")
    widest = max(verify, key=int)
    lines.append(f"  a verify of {widest} tokens costs {verify[widest]}x a plain step "
                 f"({r['verify']['ms'][1]} ms); first token after {r['prompt_tokens']} "
                 f"prompt tokens {plain['first_token_ms']} ms")
    if "peak_gpu_memory_gib" in r:
        lines.append(f"  peak GPU memory {r['peak_gpu_memory_gib']} GiB")
    if "draft_model_step" in r:
        d = r["draft_model_step"]
        lines.append(f"  a draft-model step (this shape, bf16, {d['runtime']}) {d['ms']} ms")
    lines.append(f"  greedy speculative text = plain: {r['greedy_same_as_plain']}")
    if "kernels" in r:
        lines.append(kernel_summary(r["kernels"]))
    return "\n".join(lines)


CHECKS: dict[str, Callable[[Context], dict]] = {
    "environment": check_environment,
    "load_gemma3": check_load_gemma,
    "load_llama": check_load_llama,
    "drafters_gemma3": check_drafters_gemma,
    "drafters_llama": check_drafters_llama,
    "generate_json": check_generate_json,
    "api_chat_completions": check_api,
    "speed_real_size": check_speed,
}
NEEDS = {"drafters_gemma3": "load_gemma3", "drafters_llama": "load_llama",
         "generate_json": "load_llama", "api_chat_completions": "load_llama"}


def run_checks(device: str = "cuda", small: bool | None = None,
               only: list[str] | None = None, shape: str = "1b",
               profile: bool = False) -> Iterator[dict]:
    """Run the checks in order, yielding one result each; a failing check is reported and the
    rest still run (those that need what it loaded are skipped)."""
    small = not device.startswith("cuda") if small is None else small
    with tempfile.TemporaryDirectory(prefix="specchat-check-") as tmp:
        ctx = Context(device, small, Path(tmp), shape=shape, profile=profile)
        failed: set[str] = set()
        wanted = {"environment", *only, *(NEEDS[n] for n in only if n in NEEDS)} if only \
            else set(CHECKS)
        for name, check in CHECKS.items():
            if name not in wanted:
                continue
            need = NEEDS.get(name, "environment" if name != "environment" else None)
            if need in failed or "environment" in failed:
                yield {"check": name, "ok": None,
                       "skipped": f"{'environment' if 'environment' in failed else need} failed"}
                continue
            t0 = time.perf_counter()
            try:
                result = check(ctx)
            except Exception as e:
                result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc(limit=-6)}
            if result.get("ok") is False:
                failed.add(name)
            yield {"check": name, **result, "seconds": round(time.perf_counter() - t0, 1)}


def main(args) -> int:
    out = open(args.out, "w") if args.out else None
    failed = 0
    try:
        for result in run_checks(args.device, True if args.small else None, args.only or None,
                                 args.shape, args.profile):
            line = json.dumps(result)
            print(line, flush=True)
            if out:
                out.write(line + "\n")
                out.flush()
            if result["check"] == "speed_real_size" and result.get("ok"):
                print(speed_summary(result), file=sys.stderr)
            mark = {True: "ok", False: "FAILED", None: "skipped"}[result.get("ok")]
            print(f"specchat check: {result['check']}: {mark} ({result.get('seconds', 0)} s)"
                  + (f": {result['error']}" if result.get("error") else ""), file=sys.stderr)
            failed += result.get("ok") is False
    finally:
        if out:
            out.close()
    return 1 if failed else 0


def add_cli(sub) -> None:
    from specchat.help import HelpFormatter
    p = sub.add_parser("check", help="check every path on a device (CUDA above all) with models "
                                     "built in code; one JSON line per check",
                       formatter_class=HelpFormatter,
                       description="Every path of specchat on one device (CUDA above all), "
                                   "with models built in code and no network: one JSON line "
                                   "per check on stdout, a summary on stderr (docs/gpu.md).")
    p.add_argument("--device", default="cuda", metavar="DEVICE",
                   help="cuda, cuda:1 or cpu (default: cuda)")
    p.add_argument("--small", action="store_true",
                   help="time a small target instead of the 1B-shaped one (default: small on "
                        "a CPU only)")
    p.add_argument("--shape", choices=SHAPES, default="1b",
                   help="the speed check's target: Llama 3.2 1B's shape or Llama 3.1 8B's "
                        "(default: 1b)")
    p.add_argument("--only", action="append", choices=sorted(CHECKS), metavar="CHECK",
                   help=f"run only this check (repeatable; its prerequisites too): "
                        f"{', '.join(CHECKS)} (default: all)")
    p.add_argument("--profile", action="store_true",
                   help="the speed check also profiles a forward of 1 and 16 rows by kernel: "
                        "microseconds, launches, share, and the matmuls' read rate")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="also write the JSON lines to this file (default: stdout only)")
    p.set_defaults(func=main)
