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

On specchat's own CPU forward (`models.cpu_runner`), the decoder stack is one C call that
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

    from specchat.models.cpu_runner import CLOCK_ROWS

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


def profile_lines(profile: dict | None, llama_ms: float | None = None) -> list[str]:
    """The profile as a table, beside llama.cpp's decode time per token when it raced."""
    if not profile or not profile.get("tokens"):
        return []
    rows, total = profile["ms_per_token"], profile["step_ms"]
    lines = [f"where a plain decoding token goes (--profile: {profile['tokens']} tokens, "
             "hooks on; ms per token)"]
    for title, names in (("target forward", FORWARD_ROWS), ("host", HOST_ROWS)):
        part = sum(rows[r] for r in names)
        lines.append(f"  {title:<24} {part:>7.2f}  {part / total:>5.0%}" if total else "")
        lines += [f"    {r:<22} {rows[r]:>7.2f}  {rows[r] / total:>5.0%}" for r in names
                  if total]
    lines.append(f"  {'a plain token':<24} {total:>7.2f}")
    if llama_ms:
        lines.append(f"  {'llama.cpp, a plain token':<24} {llama_ms:>7.2f}  (its decode-only "
                     "time per token in the race above)")
    return lines + [""]
