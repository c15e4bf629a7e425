"""`python -m specchat bench`: Spec-Bench style benchmark of the engine against transformers.

    python -m specchat bench --limit-per-category 5 --max-new-tokens 128 \
        --modes plain,ngram,hf-plain,hf-pld --json out/bench.json

Every mode runs on the same loaded target, interleaved per question (in an order drawn anew for
each question and repeat) so machine drift hits all modes alike:
  plain        our engine, speculation off (the very same decode loop with k = 0)
  ngram/model  our engine, speculation on with that drafter
  hf-plain     transformers `generate`, no assistance
  hf-pld       transformers `generate(prompt_lookup_num_tokens=...)` (prompt lookup decoding)
  hf-assisted  transformers `generate(assistant_model=...)`, when a draft model is loaded
  llama.cpp    a llama.cpp server (`--llama-server URL`, or `--llama-server-bin` starts one on
               the embedded model's GGUF with the same threads), sent the very prompt ids; with
               `--llama-spec-type T` also `llama.cpp-T`, a server running its own speculation T.
               Its speedup is over `llama.cpp` (its own plain decoding), its drafts are read
               from the per-chunk counters (specchat/backends/remote.py), and it has no forward
               timings (overhead "-").
All modes get the same prompt ids and the same stop condition (max new tokens, EOS, and the chat
format's stop string unless --ignore-stop-strings), and their tokens are counted alike: the tokens
shown to the user (the engine's `new_tokens`; transformers' output goes through the engine's own
ReplyText, so EOS and a stop string's tokens do not count). Every first turn starts from an empty
KV cache, so prefill is paid by every mode; with `--turns all` a follow-up turn reuses the
engine's cached history (what the chat does) and its time to first token is reported separately.

Numbers (the pure functions below, tested on synthetic step records in tests/test_bench.py):
- tokens/s of a category = sum of new tokens / sum of seconds over its (question, turn) items,
  each item's tokens and seconds being medians over `--repeats`; speedup = that over `plain`'s on
  the same items. Counts (drafted, accepted, target calls) pool every repeat.
- alpha = accepted / (accepted + rejections): the per-position acceptance estimate of Leviathan et
  al. 2022 (docs/design.md); c = draft seconds per drafted token / seconds of a plain
  target step; verify ratio = seconds of a speculative step's target forward (k + 1 tokens fed)
  / the plain step's. A draft tree (tree.py) counts as a chain as long as its depth: k is the
  depth, alpha the chance the accepted path goes one level further, c the draft seconds per
  level; its verify ratio is measured at its real width.
  Leviathan et al. 2022, expected walltime improvement:
  (1 - alpha^(k+1)) / ((1 - alpha)(c k + verify_ratio)), where this engine's verify cost for
  k + 1 tokens is measured instead of assumed equal to one step's. The formula covers decoding
  only; "+prefill" adds the prompt's encoding, unchanged by speculation (Amdahl's law with the
  share of plain's time spent in the first forward), to predict the end-to-end speedup measured.
- Time inside the target's forward is measured with forward hooks for every mode, so "overhead per
  token" (wall time outside the model's forward) compares the two decode loops directly.
"""

from __future__ import annotations

import platform
import random
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

from specchat.bench.config import (
    ALL_MODES,
    ENGINE_MODES,
    HEAD_MODES,
    NEEDS_DRAFT,
    BenchSettings,
    Run,
)
from specchat.bench.metrics import summarize_bench
from specchat.core.events import TARGET, StepRecord, TokenEvent, collect

# ---------------------------------------------------------------------------------------------
# Running the modes


class _Probe:
    """Times the target's forward (hooks) and, as a transformers streamer, when tokens come out."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.calls: list[tuple[int, float]] = []  # (tokens fed, seconds in forward)
        self.puts: list[tuple[int, float]] = []  # (tokens streamed, perf_counter)
        self._prompt_seen = False
        self._t = 0.0
        self._fed = 0

    def attach(self, model) -> list:
        return [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                model.register_forward_hook(self._post, with_kwargs=True)]

    def attach_runner(self, runner) -> list:
        """Time the forwards of `runner` (the engine's seam, core/runner.py) instead: what the
        engine's modes feed, whether or not transformers' modules run them. Returns handles
        whose `remove` undoes it, as the hooks' do."""
        handles = []
        for name in ("forward", "forward_tree"):
            original = getattr(runner, name)

            def timed(cache, ids, *args, _original=original, **kwargs):
                self._fed, self._t = len(ids), time.perf_counter()
                try:
                    return _original(cache, ids, *args, **kwargs)
                finally:
                    self.calls.append((self._fed, time.perf_counter() - self._t))

            setattr(runner, name, timed)
            handles.append(_Unwrap(runner, name))
        return handles

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._fed = int(ids.shape[-1]) if ids is not None else 0
        self._t = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        self.calls.append((self._fed, time.perf_counter() - self._t))

    # transformers' BaseStreamer protocol: the prompt first, then each step's new tokens
    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.puts.append((int(value.numel()), time.perf_counter()))

    def end(self) -> None:
        pass


class _Unwrap:
    """Takes an instance's wrapper of a method off again (`_Probe.attach_runner`)."""

    def __init__(self, obj, name: str):
        self.obj, self.name = obj, name

    def remove(self) -> None:
        vars(self.obj).pop(self.name, None)


def hf_steps(calls: list[tuple[int, float]], puts: list[tuple[int, float]],
             prompt_len: int) -> list[StepRecord]:
    """Step records of a transformers `generate` call, from its target forwards (tokens fed) and
    what it streamed after each (accepted + 1 tokens). The first call (prefill, which in assisted
    generation may also verify drafts) is left out, like the engine's prefill."""
    if len(calls) != len(puts):
        return []  # not one stream per forward: no per-step view
    steps = []
    for i in range(1, len(calls)):
        fed, forward_s = calls[i]
        drafted = fed - 1
        emitted = puts[i][0]
        steps.append(StepRecord(i, drafted, max(0, min(drafted, emitted - 1)), emitted, 0.0,
                                forward_s))
    return steps


class _StopText:
    """transformers stopping criterion: the reply so far contains a stop string."""

    def __init__(self, tokenizer, stops, prompt_len: int):
        self.tokenizer, self.prompt_len = tokenizer, prompt_len
        self.stops = [s for s in stops if s]

    def __call__(self, input_ids, scores, **kwargs):
        import torch
        text = self.tokenizer.decode(input_ids[0, self.prompt_len:].tolist(),
                                     skip_special_tokens=False)
        hit = any(s in text for s in self.stops)
        return torch.full((input_ids.shape[0],), hit, dtype=torch.bool, device=input_ids.device)


def run_engine_mode(engine, probe: _Probe, ids: list[int], stops, mode: str, s: BenchSettings,
                    fresh: bool, max_new_tokens: int | None = None) -> dict:
    if fresh:
        engine.reset_cache()  # a first turn starts from no KV, as generate() does ...
        if s.prompt_cache == "cold":  # ... and, cold, with no stored prompt pages either
            engine.prefixes.clear()
    cfg = s.generate_config(mode, stops, list(engine.drafters), max_new_tokens)
    probe.reset()
    reply = collect(engine.stream(ids, cfg))
    stats = reply.stats
    prefill_s, fed = 0.0, 0
    for rows, seconds in probe.calls:  # the prompt's forwards: its pages, then the rest
        if fed >= stats.prefill_tokens:
            break
        prefill_s, fed = prefill_s + seconds, fed + rows
    return dict(new_tokens=stats.new_tokens, seconds=stats.seconds, ttft_s=stats.ttft_s,
                prompt_tokens=stats.prompt_tokens, prefill_tokens=stats.prefill_tokens,
                target_calls=stats.target_calls, forward_s=sum(t for _, t in probe.calls),
                prefill_s=prefill_s, steps=reply.steps, text=reply.text, stop_reason=stats.stop_reason,
                error=stats.error)


def run_hf_mode(engine, probe: _Probe, ids: list[int], stops, mode: str, s: BenchSettings,
                assistant=None, max_new_tokens: int | None = None) -> dict:
    """transformers `generate` on the engine's target with the same prompt and stop condition."""
    import torch

    from specchat.core.text import ReplyText

    model, tok = engine.model, engine.tokenizer
    input_ids = torch.tensor([ids], device=engine.device)
    eos = sorted(engine.eos_ids)
    kwargs: dict = dict(max_new_tokens=max_new_tokens or s.max_new_tokens,
                        do_sample=s.temperature > 0, eos_token_id=eos,
                        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos[0],
                        attention_mask=torch.ones_like(input_ids), streamer=probe,
                        suppress_tokens=engine.non_text.tolist())  # as the engine masks them
    if s.temperature > 0:
        kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    if stops:
        # Not generate(stop_strings=...): assisted generation hands those to the assistant's own
        # generate(), which then refuses to run without a tokenizer of its own.
        from transformers import StoppingCriteriaList
        kwargs["stopping_criteria"] = StoppingCriteriaList([_StopText(tok, stops, len(ids))])
    if mode == "hf-pld":
        kwargs["prompt_lookup_num_tokens"] = s.hf_pld_tokens or s.draft_len
    elif mode == "hf-assisted":
        kwargs["assistant_model"] = assistant
    probe.reset()
    start = time.perf_counter()
    with torch.inference_mode():
        if s.temperature > 0:
            torch.manual_seed(s.seed)
        out = model.generate(input_ids, **kwargs)
    seconds = time.perf_counter() - start
    # Count and cut exactly as the engine does: tokens shown to the user (not EOS, not a stop
    # string's), text through the engine's own ReplyText.
    reply, shown, hit, stop_reason = ReplyText(tok, ids, stops), [], False, "length"
    for t in out[0, len(ids):].tolist():
        if t in engine.eos_ids:
            stop_reason = "eos"
            break
        released, hit = reply.push(TokenEvent(t, "", TARGET, 0, 0, 0))
        shown.extend(released)
        if hit:
            stop_reason = "stop_string"
            break
    if not hit:
        shown.extend(reply.finish())
    ttft = probe.puts[0][1] - start if probe.puts else seconds
    return dict(new_tokens=len(shown), seconds=seconds, ttft_s=ttft, prompt_tokens=len(ids),
                prefill_tokens=len(ids), target_calls=len(probe.calls),
                forward_s=sum(t for _, t in probe.calls),
                prefill_s=probe.calls[0][1] if probe.calls else 0.0,
                steps=hf_steps(probe.calls, probe.puts, len(ids)),
                text="".join(e.text for e in shown),
                stop_reason=stop_reason, error="")


def run_remote_mode(remote, ids: list[int], stops, s: BenchSettings, fresh: bool,
                    max_new_tokens: int | None = None, found: list[int] | None = None) -> dict:
    """A server (`RemoteEngine`) on the same prompt ids, with the same stop condition and
    sampling settings; timed as its client sees it (request to last chunk). `found`: the prompt
    the server last served when the question came (its prompt cache's content then)."""
    from specchat.backends.remote import RemotePrompt, served_target_calls
    if fresh and s.prompt_cache == "cold":
        remote.reset_cache()  # no prompt cache: the first turn encodes its whole prompt
    elif fresh and found is not None and remote.last_prompt_ids != found:
        # a repeat: give the server's cache back the prompt it held when the question came,
        # as specchat's prefix store is given back its snapshot (untimed)
        remote.prime(found)
    # speculation on: the server's own setting decides
    cfg = s.generate_config("ngram", stops, ["ngram"], max_new_tokens)
    reply = collect(remote.stream(RemotePrompt(ids=list(ids)), cfg))
    stats, steps, text = reply.stats, reply.steps, reply.text
    # Tokens as the server counts them (a stop string's too, which its text leaves out)
    tokens = max(stats.new_tokens, remote.last_usage.get("completion_tokens") or 0)
    # Target passes: as the server counted them (specchat), else one per token that was not an
    # accepted draft, never fewer than the steps seen (served_target_calls).
    calls = max(stats.target_calls, served_target_calls(tokens, stats.accepted, len(steps)))
    # the tokens it encoded (llama-server's `prompt_n`; the rest came from its prompt cache)
    encoded = remote.last_timings.get("prompt_n")
    return dict(new_tokens=tokens, seconds=stats.seconds, ttft_s=stats.ttft_s,
                prompt_tokens=stats.prompt_tokens or len(ids),
                prefill_tokens=encoded if isinstance(encoded, int) else len(ids),
                target_calls=calls, forward_s=None, prefill_s=stats.ttft_s,
                steps=steps, text=text, stop_reason=stats.stop_reason,
                error=stats.error)


def available_modes(engine, assistant) -> list[str]:
    return [m for m in ALL_MODES
            if m not in NEEDS_DRAFT or ("model" in engine.drafters and assistant is not None)] \
        + [m for m in HEAD_MODES if m.removesuffix("-tree") in engine.drafters]


def bench(engine, questions: list[dict], s: BenchSettings, assistant=None,
          progress: bool = True, log: Callable[[str], None] | None = None,
          extra_config: dict | None = None, remotes: dict | None = None) -> dict:
    """Run every mode on every question (interleaved), return summarize_bench's report.
    `remotes`: extra modes served by other engines, {mode name: RemoteEngine} (llama.cpp).
    Ctrl-C stops early and returns what was measured: whole questions only, so every mode is
    compared on the same ones."""
    from tqdm import tqdm

    log = log or (lambda msg: print(msg, file=sys.stderr))
    remotes = remotes or {}
    _check_modes(engine, s.modes, assistant, remotes)
    run_mode = _ModeRunner(engine, s, assistant, remotes)
    runs: list[Run] = []
    bar = None
    done = 0
    interrupted = False
    started = time.time()
    try:
        _warm_up(run_mode, engine, questions, s)
        bar = tqdm(questions, desc="bench", unit="question", file=sys.stderr, disable=not progress,
                   dynamic_ncols=True)
        for qi, q in enumerate(bar):
            runs.extend(_run_question(run_mode, engine, q, qi, s, bar, log))
            done += 1
        bar.close()
    except KeyboardInterrupt:
        interrupted = True
        if bar is not None:
            bar.close()
        log("bench: interrupted; reporting the questions measured so far")
    finally:
        run_mode.detach()
    config = {**asdict(s), "modes": list(s.modes),
              "questions_planned": len(questions), "questions_done": done,
              "interrupted": interrupted, "wall_s": time.time() - started,
              "peak_rss_mb": peak_rss_mb(), **(extra_config or {})}
    return summarize_bench(runs, s.modes, config, remote_modes=tuple(remotes)) | \
        {"runs": [_run_json(r) for r in runs]}


def _check_modes(engine, modes, assistant, remotes: dict) -> None:
    """ValueError for a mode that is unknown or that the loaded models cannot run."""
    for m in modes:
        if m in remotes:
            continue
        if m not in ALL_MODES + HEAD_MODES:
            raise ValueError(f"unknown mode {m!r}; modes: {', '.join(ALL_MODES + HEAD_MODES)}")
        if m in HEAD_MODES and m.removesuffix("-tree") not in engine.drafters:
            raise ValueError(f"mode {m!r} needs a draft head for this target: "
                             f"python -m specchat train-draft")
        if m in ENGINE_MODES[1:] and m not in engine.drafters:
            raise ValueError(f"mode {m!r} needs the {m!r} drafter (load a --draft-model)")
        if m == "hf-assisted" and assistant is None:
            raise ValueError("mode 'hf-assisted' needs a draft model (--draft-model)")


SETTLE_S = 0.25  # seconds between two runs when servers race beside the engine


class _ModeRunner:
    """Runs one mode on one prompt with the right runner; holds the forward hooks that time the
    target (and the assistant of hf-assisted) until `detach`."""

    def __init__(self, engine, s: BenchSettings, assistant, remotes: dict):
        self.engine, self.s, self.assistant, self.remotes = engine, s, assistant, remotes
        # the engine's modes timed at its runner, transformers' `generate` at the model's hooks
        self.probe, self.draft_probe, self.runner_probe = _Probe(), _Probe(), _Probe()
        self.hooks = self.probe.attach(engine.model) + (
            self.draft_probe.attach(assistant) if assistant is not None else []) \
            + self.runner_probe.attach_runner(engine.runner)
        self.found: dict[str, list[int] | None] = {}  # each server's last prompt, by mode

    def question_starts(self) -> None:
        """Note what each server's prompt cache holds as a question comes (its last prompt)."""
        self.found = {mode: r.last_prompt_ids for mode, r in self.remotes.items()}

    def __call__(self, mode: str, ids: list[int], stops, fresh: bool,
                 max_new: int | None = None) -> dict:
        engine, s = self.engine, self.s
        if self.remotes:
            # Each run starts with the CPU quiet: a server's thread pool (and torch's OpenMP
            # threads) may spin-wait a while after a request.
            time.sleep(SETTLE_S)
        if mode in self.remotes:
            return run_remote_mode(self.remotes[mode], ids, stops, s, fresh, max_new,
                                   self.found.get(mode))
        if mode in ENGINE_MODES + HEAD_MODES:
            return run_engine_mode(engine, self.runner_probe, ids, stops, mode, s, fresh,
                                   max_new)
        self.draft_probe.reset()
        r = run_hf_mode(engine, self.probe, ids, stops, mode, s, self.assistant, max_new)
        if mode == "hf-assisted":  # spread the assistant's forward time over the drafts
            drafted = sum(st.drafted for st in r["steps"])
            per_token = sum(t for _, t in self.draft_probe.calls) / drafted if drafted else 0.0
            for st in r["steps"]:
                st.draft_s = st.drafted * per_token
        return r

    def detach(self) -> None:
        for h in self.hooks:
            h.remove()


def prompt_of(tokenizer, messages: list[dict], s: BenchSettings) -> tuple[list[int], tuple]:
    """The prompt ids and stop strings of the last user turn in `messages`, as the page sends
    it in the bench's format: Chat, the conversation in the chat format (its stop strings
    unless --ignore-stop-strings); Completion, that turn's text alone, with no stop strings."""
    from specchat.core.text import chat_prompt, raw_prompt
    if s.prompt_format == "completion":
        return raw_prompt(tokenizer, messages[-1]["content"]), ()
    ids, stops = chat_prompt(tokenizer, messages)
    return ids, tuple(stops) if s.stop_strings else ()


def _warm_up(run_mode: _ModeRunner, engine, questions: list[dict], s: BenchSettings) -> None:
    """One short unrecorded run per mode on the first question."""
    if s.warmup_tokens and questions:
        ids, stops = prompt_of(engine.tokenizer,
                               [{"role": "user", "content": questions[0]["turns"][0]}], s)
        for mode in s.modes:
            run_mode(mode, ids, stops, True, s.warmup_tokens)


def mode_order(modes: tuple[str, ...], question: int, repeat: int) -> list[str]:
    """The modes in the order drawn for one question's repeat."""
    order = list(modes)
    random.Random(question * 1009 + repeat).shuffle(order)
    return order


def _run_question(run_mode: _ModeRunner, engine, q: dict, qi: int, s: BenchSettings, bar,
                  log: Callable[[str], None]) -> list[Run]:
    """Every repeat of every mode on one question, in an order drawn for the question and the
    repeat (seeded: the same every run), so that drift over time hits every mode alike and no
    mode always runs right after the same other one (whatever one run leaves behind, a warm
    or a cold cache, a server still busy, falls on every mode alike)."""
    q_runs: list[Run] = []
    # Every mode meets the prefix store as the question found it: pages an earlier mode encoded
    # for this very prompt would make the later modes' first turns cheaper than the first's.
    prefixes = getattr(engine, "prefixes", None)
    before = prefixes.snapshot() if prefixes is not None else None
    run_mode.question_starts()  # and every server's prompt cache as the question found it
    for rep in range(s.repeats):
        for mode in mode_order(s.modes, qi, rep):
            bar.set_postfix_str(f"{q['category']} {mode}", refresh=False)
            if prefixes is not None:
                prefixes.restore_snapshot(before)
            q_runs.extend(_run_turns(run_mode, engine, q, mode, rep, s, log))
    if s.history:  # the question's plain run joins the history once every run is done
        history_add(engine, q, [r for r in q_runs if r.mode == "plain" and r.repeat == 0]
                    or q_runs[:1], s)
    return q_runs


def history_add(engine, q: dict, runs: list[Run], s: BenchSettings) -> None:
    """Add a question's turns and the replies of one of its runs to the --history owner's
    history, as the engine adds a finished reply and its prompt."""
    from specchat.bench.config import HISTORY_OWNER

    messages: list[dict] = []
    for user, run in zip(q["turns"], sorted(runs, key=lambda r: r.turn)):
        messages += [{"role": "user", "content": user}, {"role": "assistant",
                                                         "content": run.text}]
    if messages and hasattr(engine, "history"):
        ids, _ = prompt_of(engine.tokenizer, messages[:-1], s)
        reply = engine.tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        engine.history.add(HISTORY_OWNER, ids + reply)


def _run_turns(run_mode: _ModeRunner, engine, q: dict, mode: str, rep: int, s: BenchSettings,
               log: Callable[[str], None]) -> list[Run]:
    """One mode on a question's turns (the first, or all), each follow-up after the mode's own
    reply to the one before."""
    turns = q["turns"] if s.turns == "all" else q["turns"][:1]
    runs: list[Run] = []
    messages: list[dict] = []
    for ti, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        ids, stops = prompt_of(engine.tokenizer, messages, s)
        r = run_mode(mode, ids, stops, fresh=ti == 0)
        if r["error"]:
            log(f"bench: {mode} on question {q['question_id']}: {r['error']}")
        runs.append(Run(q["question_id"], q["category"], ti + 1, mode, rep, **r))
        messages.append({"role": "assistant", "content": r["text"]})
    return runs


def _run_json(r: Run) -> dict:
    d = asdict(r)
    # compact: [drafted, accepted, draft_s, verify_s(, tree depth)] per step
    d["steps"] = [[st["drafted"], st["accepted"], round(st["draft_s"], 6),
                   round(st["verify_s"], 6)] + ([st["tree_depth"]] if st["tree_depth"] else [])
                  for st in d["steps"]]
    return d


def peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024  # bytes vs KiB


def current_rss_mb() -> float | None:
    """Resident memory now (Linux), to tell a loading spike from what decoding holds."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def machine_config() -> dict:
    import os

    import torch
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
