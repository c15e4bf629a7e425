"""`bench --profile`: where a plain decoding token's time goes, in real use.

After the timed runs, plain decoding runs once more on the same prompts with timers on: forward
hooks on the target's modules, and wrappers around the engine's own steps. Every millisecond
of a step lands in one row:

  target forward          the runner's forward, split by module kind:
    NF4 layers              the quantized projections (q, k, v, o, gate, up, down)
    other linear layers     projections kept in float or bf16, if any
    LM head                 the vocabulary projection (the GGUF's Q8_0 on the embedded target)
    attention               each attention block less its projections: rotary, q/k norms,
                            the cache update, the attention product, reshapes
    norms                   the RMSNorms outside attention
    MLP activation          each MLP less its projections: the activation and the product
    embedding               the token embedding
    rest of the forward     what no module above accounts for: masks, residual adds, the loop
  host, per step          the engine between forwards:
    masks and penalties     non-text mask, repetition penalty, DRY, ...
                            (`Engine._chain_distribution`); with the runner's native sampler
                            (specchat's CPU forward) the draw too, made in the same call
    sampling                min-p, top-p, temperature, the draw where Python makes it
                            (`core.sampling.verify`)
    drafting                the drafter's proposal (speculative modes only; 0 here)
    streaming and stats     everything else: stop strings, text, events, step records

On specchat's own CPU forward (`runners.cpu.runner`), the decoder stack is one C call that
times its own parts (`CpuRunner.clock`): its products are the NF4 layers' row, its attention
(RoPE, cache writes and masks included), norms and activation their rows, the rest (residual
adds, buffers, the Python around the call) the rest of the forward's.

The hooks and timers cost a few microseconds each, inside the rows they time: the profile's
total is a little above the timed runs' step time, which the report prints beside it. Only the
decode steps count (not the prompt's forwards, not the first token).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from specchat.bench.config import BenchSettings

FORWARD_ROWS = ("NF4 layers", "other linear layers", "LM head", "attention", "norms",
                "MLP activation", "embedding", "rest of the forward")
HOST_ROWS = ("masks and penalties", "sampling", "drafting", "streaming and stats")


class _Clock:
    """Seconds per row name, summed while `on`."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False

    @contextmanager
    def time(self, row: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.on:
                self.seconds[row] += time.perf_counter() - start


def _kind(name: str, module) -> str | None:
    """The profile row of a module whose time is its own (children's excluded), or None."""
    cls = type(module).__name__
    if cls == "Linear4bit":
        return "NF4 layers"
    if name.endswith("lm_head"):
        return "LM head"
    if "Linear" in cls:
        return "other linear layers"
    if cls.endswith("Attention"):
        return "attention"
    if cls.endswith("RMSNorm") or cls.endswith("LayerNorm"):
        return "norms"
    if cls.endswith("MLP"):
        return "MLP activation"
    if "Embedding" in cls and "Rotary" not in cls:
        return "embedding"
    return None


class _ModuleTimer:
    """Forward hooks on every module with a row: each one's time less its timed children's."""

    def __init__(self, model, clock: _Clock):
        self.clock, self.stack, self.hooks = clock, [], []
        for name, module in model.named_modules():
            row = _kind(name, module)
            if row is None or (row == "norms" and ".self_attn." in f".{name}."):
                continue  # q/k norms count in their attention block
            self.hooks += [module.register_forward_pre_hook(self._pre),
                           module.register_forward_hook(self._post(row))]

    def _pre(self, module, args):
        self.stack.append([time.perf_counter(), 0.0])  # [start, children's time]

    def _post(self, row: str):
        def post(module, args, output):
            start, children = self.stack.pop()
            spent = time.perf_counter() - start
            if self.stack:
                self.stack[-1][1] += spent
            if self.clock.on:
                self.clock.seconds[row] += spent - children
        return post

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


@contextmanager
def _wrapped(obj, name: str, clock: _Clock, row: str):
    """obj.name timed into `row` while the context lasts."""
    original, own = getattr(obj, name), name in vars(obj)

    def timed(*args, **kwargs):
        with clock.time(row):
            return original(*args, **kwargs)

    setattr(obj, name, timed)
    try:
        yield
    finally:
        if own:
            setattr(obj, name, original)
        else:  # a method of the class: the instance's timer goes, the method shows again
            delattr(obj, name)


# `CpuRunner.clock`'s parts (cpu_runner.CLOCK_ROWS) -> the profile's rows
_C_ROWS = {"products": "NF4 layers", "attention": "attention", "norms": "norms",
           "activation": "MLP activation"}


@contextmanager
def _c_clock(runner, clock: _Clock):
    """While active, the C forward's own timings of its parts land in their rows (while `clock`
    is on); a no-op for runners without one."""
    if not hasattr(runner, "clock"):
        yield
        return
    import ctypes

    from specchat.runners.cpu.runner import CLOCK_ROWS

    runner.clock = (ctypes.c_double * len(CLOCK_ROWS))()
    forward = runner._run

    def timed(*args, **kwargs):
        before, head = list(runner.clock), runner.head_seconds
        try:
            return forward(*args, **kwargs)
        finally:
            if clock.on:
                for name, a, b in zip(CLOCK_ROWS, before, runner.clock):
                    if name in _C_ROWS:
                        clock.seconds[_C_ROWS[name]] += b - a
                clock.seconds["LM head"] += runner.head_seconds - head

    runner._run = timed
    try:
        yield
    finally:
        del runner._run
        runner.clock = None


def profile_plain(engine, prompts: list[tuple[list[int], tuple]], s: BenchSettings) -> dict:
    """Plain decoding of `prompts` ((ids, stops) each) with the profile's timers: milliseconds
    per decoded token by row, their total, and the tokens measured (a step's each)."""
    from specchat.core import engine as engine_module
    from specchat.core.events import StepRecord

    clock = _Clock()
    timer = _ModuleTimer(engine.model, clock)
    step_s, steps = 0.0, 0
    try:
        with _wrapped(engine.runner, "forward", clock, "forward"), \
                _c_clock(engine.runner, clock), \
                _wrapped(engine, "_chain_distribution", clock, "masks and penalties"), \
                _wrapped(engine_module, "verify", clock, "sampling"), \
                _wrapped(engine, "_draft", clock, "drafting"):
            for ids, stops in prompts:
                engine.reset_cache()
                cfg = s.generate_config("plain", stops, list(engine.drafters))
                last = None
                for event in engine.stream(ids, cfg):
                    now = time.perf_counter()
                    if isinstance(event, StepRecord):  # after its step's tokens
                        if last is not None:  # a step: from one record to the next
                            step_s += now - last
                            steps += 1
                        last = now
                        clock.on = True  # from the second decode step on
                clock.on = False
    finally:
        timer.remove()
    seconds = dict(clock.seconds)
    forward_s = seconds.pop("forward", 0.0)
    inside = sum(seconds.get(r, 0.0) for r in FORWARD_ROWS[:-1])
    seconds["rest of the forward"] = max(0.0, forward_s - inside)
    host = sum(seconds.get(r, 0.0) for r in HOST_ROWS[:-1])
    seconds["streaming and stats"] = max(0.0, step_s - forward_s - host)
    per = 1000 / steps if steps else 0.0  # plain decoding: one token a step
    rows = {r: seconds.get(r, 0.0) * per for r in FORWARD_ROWS + HOST_ROWS}
    return {"ms_per_token": rows, "forward_ms": forward_s * per, "step_ms": step_s * per,
            "host_ms": (step_s - forward_s) * per, "tokens": steps}


VERIFY_ROWS = (1, 2, 4, 8, 16)  # rows of the forwards `profile_rows` times


def profile_rows(engine, prompt: list[int], rows: tuple[int, ...] = VERIFY_ROWS,
                 repeats: int = 10) -> dict:
    """What a forward of n rows costs after `prompt` (a verify of n - 1 drafts, the step's
    forward alone), by part where the runner times its parts (specchat's CPU forward): the
    median of `repeats` forwards of each row count, each at the same position, so every one
    attends to the same context. -> {"rows": {n: {"ms": total, part: ms, ...}}, "context"}."""
    import statistics

    runner = engine.runner
    clock = _Clock()
    cache = runner.new_cache()
    runner.forward(cache, prompt, 0, 1)
    start = len(prompt)
    fed = [prompt[-1]] * max(rows)  # any tokens: the cost does not depend on which
    out = {}
    with _c_clock(runner, clock):
        for n in rows:
            totals, parts = [], defaultdict(list)
            for _ in range(repeats + 1):  # the first warms this width up
                clock.seconds.clear()
                clock.on = True
                began = time.perf_counter()
                runner.forward(cache, fed[:n], start, n)
                totals.append(time.perf_counter() - began)
                clock.on = False
                if not runner.crop(cache, start + n, start):  # back to the prompt alone
                    cache = runner.new_cache()
                    runner.forward(cache, prompt, 0, 1)
                for part, seconds in clock.seconds.items():
                    parts[part].append(seconds)
            out[n] = {"ms": statistics.median(totals[1:]) * 1000,
                      **{part: statistics.median(v[1:]) * 1000 for part, v in parts.items()}}
    return {"rows": out, "context": start, "repeats": repeats}


def rows_lines(found: dict | None) -> list[str]:
    """`profile_rows` as a table: ms by part, and each row count's forward in one row's."""
    if not found or not found.get("rows"):
        return []
    by = found["rows"]
    one = by[min(by)]["ms"]
    parts = [p for p in FORWARD_ROWS if any(p in r for r in by.values())]
    head = f"  {'rows':>4} {'forward':>9} {'x 1 row':>8}" + "".join(f" {p:>11.11}" for p in parts)
    lines = [f"a forward of n rows after a {found['context']}-token prompt (--profile; what a "
             f"verify of n - 1 drafts costs; ms, median of {found.get('repeats', 10)})", head]
    for n, r in by.items():
        lines.append(f"  {n:>4} {r['ms']:>9.2f} {r['ms'] / one:>7.2f}x"
                     + "".join(f" {r.get(p, 0.0):>11.2f}" for p in parts))
    return lines + [""]


def profile_lines(profile: dict | None, llama_ms: float | None = None) -> list[str]:
    """The profile as a table; beside it llama.cpp's, where `bench --profile` raced it with
    its profile program (`profile["llama"]`), else its decode-only time per token in the race
    (`llama_ms`)."""
    if not profile or not profile.get("tokens"):
        return []
    rows, total = profile["ms_per_token"], profile["step_ms"]
    llama = profile.get("llama") or {}
    theirs = llama.get("ms_per_token")
    lines = [f"where a plain decoding token goes (--profile: {profile['tokens']} tokens, "
             "hooks on; ms per token)" + (f"{'specchat':>17}{'llama.cpp':>19}" if theirs
                                          else "")]

    def line(label: str, name_rows: tuple[str, ...], indent: str) -> str:
        ours = sum(rows[r] for r in name_rows)
        text = f"{indent}{label:<{26 - len(indent)}} {ours:>7.2f}  {ours / total:>5.0%}"
        if theirs:
            value = sum(theirs[r] for r in name_rows)
            text += f"{'':>9}{value:>7.2f}  {value / llama['step_ms']:>5.0%}"
        return text

    if total:
        for title, names in (("target forward", FORWARD_ROWS), ("host", HOST_ROWS)):
            lines.append(line(title, names, "  "))
            lines += [line(r, (r,), "    ") for r in names]
    lines.append(f"  {'a plain token':<24} {total:>7.2f}"
                 + (f"{'':>16}{llama['step_ms']:>7.2f}" if theirs else ""))
    if theirs:
        lines += [
            "  llama.cpp's side: its own code on the race's prompts, samplers and stop strings "
            f"({llama['tokens']} tokens; backends/llama_profile.py): its forward and sampler "
            "chain timed each step, the forward split by each node's share timed alone "
            f"(split, a forward took {llama['split_ms']:.2f} ms); NF4 layers: its Q4_K, Q5_0 "
            "and Q6_K products; sampling: its whole sampler chain (penalties and DRY "
            "included); streaming and stats: the rest of its decode-only time per token in "
            "the race, the server's loop and HTTP streaming"]
    elif llama.get("missing"):
        lines.append(f"  llama.cpp's side: {llama['missing']}")
    if llama_ms and not theirs:
        lines.append(f"  {'llama.cpp, a plain token':<24} {llama_ms:>7.2f}  (its decode-only "
                     "time per token in the race above)")
    return lines + [""]


# llama.cpp's side (`backends.llama_profile`): each node of its forward, by its op and name and
# the name of its first source (a weight's, for the products), into the rows above
_LLAMA_NORM_OPS = ("RMS_NORM", "NORM")
_LLAMA_ATTENTION_OPS = ("FLASH_ATTN_EXT", "SOFT_MAX", "ROPE", "SET_ROWS", "CPY")
_LLAMA_ACTIVATION_OPS = ("GEGLU", "GELU", "SWIGLU", "GLU", "UNARY")


def llama_row(op: str, name: str, weight: str) -> str:
    """The profile row of one node of llama.cpp's forward graph."""
    if op == "MUL_MAT" and weight in ("token_embd.weight", "output.weight"):
        return "LM head"
    if op == "MUL_MAT" and weight.startswith("blk."):
        return "NF4 layers"  # (the layers' products: Q4_K, Q5_0, Q6_K on the embedded GGUF)
    if op in ("GET_ROWS", "DUP") or name.startswith("inp_"):
        return "embedding"
    if op in _LLAMA_NORM_OPS or (op == "MUL" and name.endswith(("norm", "_normed"))):
        return "norms"
    if op in _LLAMA_ATTENTION_OPS or op == "MUL_MAT":  # (kq, kqv: products with the cache)
        return "attention"
    if op in _LLAMA_ACTIVATION_OPS or (op == "MUL" and name.startswith("ffn")):
        return "MLP activation"
    return "rest of the forward"


def llama_rows(found: dict, race_ms: float | None) -> dict:
    """`backends.llama_profile.run`'s findings -> milliseconds per decoded token by row, as
    `profile_plain` gives specchat's: the forward's rows its measured time per token split by
    the nodes' shares, the sampler chain's time, and the rest of the race's decode-only time
    per token (`race_ms`) as the server's own loop, streaming included."""
    tokens = found["tokens"]
    forward_ms, sample_ms = 1000 * found["forward_s"] / tokens, 1000 * found["sample_s"] / tokens
    seconds: dict[str, float] = defaultdict(float)
    for node in found["nodes"]:
        seconds[llama_row(node["op"], node["name"], node["weight"])] += node["seconds"]
    total = sum(seconds.values()) or 1.0
    rows = {r: forward_ms * seconds.get(r, 0.0) / total for r in FORWARD_ROWS}
    rows.update({"masks and penalties": 0.0, "sampling": sample_ms, "drafting": 0.0})
    step_ms = race_ms if race_ms else forward_ms + sample_ms
    rows["streaming and stats"] = max(0.0, step_ms - forward_ms - sample_ms)
    return {"ms_per_token": rows, "forward_ms": forward_ms, "step_ms": step_ms,
            "host_ms": step_ms - forward_ms, "tokens": tokens,
            "split_ms": 1000 * found["split_forward_s"] / found["split_tokens"],
            "race_ms": race_ms}


def profile_llama(server: str | Path, prompts: list[tuple[list[int], tuple]],
                  s: BenchSettings, drafters: list[str], threads: int,
                  race_ms: float | None) -> dict:
    """llama.cpp's plain decoding of `prompts` with the race's samplers and stop strings, by
    the profile program built beside the llama-server at `server`: `llama_rows`, or
    {"missing": why} where it cannot run."""
    from specchat.backends import llama_cpp, llama_profile
    from specchat.backends.remote import sampling_fields

    tool = llama_profile.beside(Path(server))
    if tool is None:
        return {"missing": f"no {llama_profile.TOOL} beside {server}: build llama.cpp again "
                           "(python -m specchat.backends.llama_cpp build) for its side"}
    stops = prompts[0][1] if prompts else ()
    fields, extra = sampling_fields(s.generate_config("plain", stops, drafters), "llama.cpp")
    try:
        found = llama_profile.run(tool, llama_cpp.embedded_gguf(), [ids for ids, _ in prompts],
                                  threads, s.max_new_tokens, {**fields, **extra}, stops)
    except llama_profile.ProfileError as e:
        return {"missing": str(e)}
    return llama_rows(found, race_ms)
