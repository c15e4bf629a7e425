"""The OpenAI-compatible API, driven by the official `openai` client against a tiny model served
in-process by uvicorn: streaming and not, token kinds in the chunks, llama.cpp timings, caps,
auth, OpenAI error objects, and turns saved to the stats store."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from tiny import byte_tokenizer, loaded, served_on_loopback, tiny_llama

from specchat.api.server import create_app
from specchat.core.engine import Engine
from specchat.drafters.model import ModelDrafter
from specchat.drafters.ngram import NgramDrafter
from specchat.loader import LoadReport
from specchat.stats.store import StatsStore

KEY = "sk-test-123"
LABEL = "test-org/Tiny Llama 0.1B (random weights)"  # the target's display name
MODEL = "tiny-llama-0.1b"  # its id in the API
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"


@pytest.fixture(scope="module")
def server():
    tok = byte_tokenizer()
    engine = Engine(loaded(tiny_llama(0), tok, name=LABEL),
                    {"ngram": NgramDrafter(), "model": ModelDrafter(tiny_llama(1), len(tok))})
    store = StatsStore(":memory:")
    app = create_app(LoadReport(engine, None, []), store, {KEY: "tests"}, max_tokens_cap=64,
                     max_input_chars=2000)
    with served_on_loopback(app) as url:
        yield f"{url}/v1", app.state.api, store


def client(url, key=KEY):
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0)


def test_models_and_a_plain_chat_completion(server):
    url, api, _ = server
    c = client(url)
    models = c.models.list().data
    assert [m.id for m in models] == [MODEL]  # a stable id, the display name beside it
    assert models[0].model_extra["specchat"]["name"] == LABEL
    assert abs(models[0].created - time.time()) < 3600
    reply = c.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, seed=0,
                                      messages=[{"role": "user", "content": PROMPT}])
    assert reply.model == MODEL and abs(reply.created - time.time()) < 600
    text = reply.choices[0].message.content
    extra = reply.model_extra["specchat"]
    assert "".join(extra["texts"]) == text and len(extra["kinds"]) == 12
    assert set(extra["kinds"]) <= {"accepted", "resampled", "bonus", "target"}
    assert reply.usage.completion_tokens == 12 and reply.choices[0].finish_reason == "length"
    timings = reply.model_extra["timings"]
    assert {"draft_n", "draft_n_accepted", "predicted_per_second", "prompt_ms",
            "predicted_ms"} <= set(timings)
    # The display name, as the id used to be, and no model at all are answered alike.
    for model in (LABEL, None):
        body = {"prompt": "hi", "max_tokens": 2, **({"model": model} if model else {})}
        r = httpx.post(f"{url}/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["model"] == MODEL, r.text


def test_the_race_answers_which_drafter_to_use(server):
    """POST /v1/race: a completion's request decoded plainly, then by each drafter; a row per
    run, each run saved, each drafter's against the race's plain run."""
    url, api, store = server
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{url}/race", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                        "seed": 3}, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    race = r.json()
    assert race["object"] == "race" and race["model"] == MODEL
    runs = {run["mode"]: run for run in race["runs"]}
    assert list(runs) == ["plain", "model", "ngram"]
    assert runs["plain"]["speedup"] is None and runs["plain"]["band"] == [1.0, 1.0]
    for mode in ("model", "ngram"):  # fp32 greedy: every drafter replays plain decoding
        assert runs[mode]["same_as_plain"] is True
        assert runs[mode]["text"] == runs["plain"]["text"] and runs[mode]["new_tokens"] == 16
        assert runs[mode]["speedup"] == pytest.approx(
            runs[mode]["tokens_per_s"] / runs["plain"]["tokens_per_s"])
    assert race["winner"] in (None, *runs)
    api.writer.flush(10)
    rows = [t for c in store.conversations() for t in store.turns(c["id"])
            if t["prompt"] == PROMPT and t["new_tokens"] == 16 and t["seed"] == 3]
    assert len(rows) == 3
    assert [r["baseline_turn_id"] for r in rows[1:]] == [rows[0]["id"]] * 2
    # Checked as a completion is: a bad field is refused by name, nothing runs.
    r = httpx.post(f"{url}/race", json={"prompt": PROMPT, "temperature": "hot"},
                   headers=headers, timeout=60)
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/race", json={"prompt": PROMPT}, timeout=60)
    assert r.status_code == 401


def test_a_keys_requests_join_that_keys_own_drafting_history(server):
    """What a key's owner sent and got back is kept for their later drafts
    (core/history.py), under that owner alone."""
    url, api, _ = server
    history = api.engine.history
    history.forget("api:tests")
    client(url).completions.create(model=MODEL, prompt="abc abc abc", max_tokens=6,
                                   temperature=0)
    assert history.tokens("api:tests") > 6
    assert history.tokens("api") == 0 and history.tokens("") == 0


def test_model_ids_are_slugs_of_the_targets_name():
    from specchat.api.server import model_slug
    assert model_slug("Gemma 3 270M (embedded, Gemma Terms of Use)") == "gemma-3-270m"
    assert model_slug("Qwen/Qwen2.5-7B-Instruct") == "qwen2.5-7b-instruct"
    assert model_slug("./my-model/") == "my-model"
    assert model_slug("/models/Llama 3.1 8B [nf4]") == "llama-3.1-8b"
    assert model_slug("(nothing left)") == "model"


def test_streamed_completion_carries_kinds_and_ends_with_timings(server):
    url, api, store = server
    c = client(url)
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20,
                                       temperature=0, stream=True, extra_body={"drafter": "model"},
                                       stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    chunks, usage = chunks[:-1], chunks[-1].usage
    pieces = [ch for ch in chunks if ch.choices[0].text]
    text = "".join(ch.choices[0].text for ch in pieces)
    kinds = [k for ch in pieces for k in ch.choices[0].model_extra["specchat"]["kinds"]]
    texts = [t for ch in pieces for t in ch.choices[0].model_extra["specchat"]["texts"]]
    assert "".join(texts) == text and len(kinds) == 20
    last = chunks[-1]
    assert last.choices[0].finish_reason == "length"
    assert last.model_extra["timings"]["draft_n"] == last.model_extra["specchat"]["stats"][
        "drafted"]
    assert last.usage is None and usage.prompt_tokens_details.cached_tokens >= 0
    # The same request without streaming and with speculation off gives the same text.
    plain = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20,
                                 temperature=0, extra_body={"speculation": False})
    assert plain.choices[0].text == text
    assert set(plain.model_extra["specchat"]["kinds"]) == {"target"}
    assert api.writer.flush(10)
    owners = {c["owner"] for c in store.conversations()}
    assert owners == {"api:tests"}


def test_stop_and_max_tokens_are_honored_and_capped(server):
    url, api, _ = server
    c = client(url)
    full = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0)
    text = full.choices[0].text
    stop = text[5:7]
    if stop.strip():
        cut = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30,
                                   temperature=0, stop=[stop])
        assert stop not in cut.choices[0].text and text.startswith(cut.choices[0].text)
        assert cut.choices[0].finish_reason == "stop"
    capped = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5000)
    assert capped.usage.completion_tokens <= 64


def test_auth_and_bad_input_get_openai_errors_and_the_server_keeps_serving(server):
    url, api, _ = server
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong").models.list()
    c = client(url)
    # JSON has no NaN, but Python's parser takes one: the check still refuses it.
    raw = httpx.post(f"{url}/completions", content='{"prompt": "hi", "temperature": NaN}',
                     headers={"Authorization": f"Bearer {KEY}",
                              "Content-Type": "application/json"})
    assert raw.status_code == 400
    assert "temperature must be a finite number" in raw.json()["error"]["message"]
    for kwargs, message in ((dict(seed=2**63), "seed must be a whole number"),
                            (dict(top_p=0), "top_p must be a number in (0, 1]")):
        with pytest.raises(openai.BadRequestError) as error:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=4, **kwargs)
        assert message in str(error.value)
    with pytest.raises(openai.BadRequestError, match="messages"):
        c.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.APIStatusError) as error:
        c.completions.create(model=MODEL, prompt="x" * 3000, max_tokens=4)
    assert error.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="Drafter 'nope' is not loaded"):
        c.completions.create(model=MODEL, prompt="hi", extra_body={"drafter": "nope"})
    # A lone surrogate (valid JSON, not valid UTF-8) is replaced, not an error.
    raw = httpx.post(f"{url}/completions",
                     content='{"prompt": "bad \\ud800 text", "max_tokens": 4}',
                     headers={"Authorization": f"Bearer {KEY}",
                              "Content-Type": "application/json"}, timeout=60)
    assert raw.status_code == 200 and raw.json()["usage"]["completion_tokens"] == 4


def test_the_web_app_serves_the_api_on_its_port_behind_its_logins():
    """The page's server with the API added the way app.py adds it: a login's "user:pass" is a
    bearer key, and its API turns belong to that login (its Stats tab shows them)."""
    from specchat.api.server import Api, api_router
    from specchat.ui.access import Access
    from specchat.ui.page import build_ui, launch

    tok = byte_tokenizer()
    engine = Engine(loaded(tiny_llama(0), tok), {"ngram": NgramDrafter()})
    store = StatsStore(":memory:")
    demo = build_ui(engine, store, access=Access(auth=True))
    launch(demo, server_name="127.0.0.1", server_port=None, prevent_thread_lock=True,
           quiet=True, auth=[("alice", "pw")])
    try:
        api = Api(LoadReport(engine, None, []), store, logins=[("alice", "pw")])
        demo.app.include_router(api_router(api))
        url = demo.local_url.rstrip("/") + "/v1"
        reply = client(url, key="alice:pw").completions.create(
            model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8
        with pytest.raises(openai.AuthenticationError):
            client(url, key="alice:wrong").models.list()
        assert api.writer.flush(10)
        assert [c["owner"] for c in store.conversations()] == ["user:alice"]
    finally:
        demo.close()


def test_gradio_client_reaches_the_public_generate_endpoint_and_nothing_else():
    from gradio_client import Client

    from specchat.ui.page import build_ui, launch

    tok = byte_tokenizer()
    engine = Engine(loaded(tiny_llama(0), tok),
                    {"ngram": NgramDrafter(), "model": ModelDrafter(tiny_llama(1), len(tok))})
    demo = build_ui(engine, StatsStore(":memory:"))
    launch(demo, server_name="127.0.0.1", server_port=None, prevent_thread_lock=True,
           quiet=True)
    try:
        remote = Client(demo.local_url, verbose=False)
        endpoints = remote.view_api(print_info=False, return_format="dict")["named_endpoints"]
        assert list(endpoints) == ["/generate"]  # the per-visitor handlers stay private
        tokens = remote.predict(PROMPT, "completion", 0.0, 1.0, 0, 16, 0, True, "model", 4,
                                api_name="/generate")
        assert len(tokens) == 16
        assert {t["kind"] for t in tokens} <= {"accepted", "resampled", "bonus", "target"}
        with pytest.raises(Exception, match="Temperature must be a number >= 0"):
            remote.predict(PROMPT, "completion", -1.0, 1.0, 0, 16, 0, True, "", 4,
                           api_name="/generate")
        with pytest.raises(Exception):
            remote.predict(None, api_name="/on_bot")
    finally:
        demo.close()


def _post(url: str, **body):
    return httpx.post(f"{url}/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"})


def test_concurrent_streams_are_served_in_turn_and_a_full_queue_gets_429(server):
    """Eight clients of one key streaming at once (more than the loop's worker threads, more
    than the per-key cap, which binds only while another key waits) each get their whole reply,
    and the server serves after them; past the queue's capacity a request gets 429 with
    Retry-After, and the queue drains once the engine is free."""
    url, api, store = server
    replies: list = [None] * 8

    def stream(i: int) -> None:
        with httpx.stream("POST", f"{url}/completions", timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"prompt": f"{i} {PROMPT}", "max_tokens": 12,
                                "stream": True}) as r:
            replies[i] = (r.status_code, [line for line in r.iter_lines() if line])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None and r[0] == 200 and r[1][-1] == "data: [DONE]" for r in replies)
    assert _post(url, prompt="hi", max_tokens=3).status_code == 200

    holder = api.queue.join()  # hold the engine: the next requests wait in its queue
    limit, api.max_waiting = api.max_waiting, 2
    try:
        codes: list = []
        waiting = [threading.Thread(target=lambda: codes.append(
            _post(url, prompt="x", max_tokens=3).status_code)) for _ in range(2)]
        for t in waiting:
            t.start()
        deadline = time.time() + 30
        while api.queue.waiting < 2 and time.time() < deadline:
            time.sleep(0.02)
        refused = _post(url, prompt="y", max_tokens=3)
        assert refused.status_code == 429 and refused.headers["Retry-After"].isdigit()
        assert "busy" in refused.json()["error"]["message"]
        assert refused.json()["error"]["type"] == "rate_limit_error"  # as the login limit's
        assert httpx.get(url.removesuffix("/v1") + "/health").json()["waiting"] == 2
        api.max_waiting = limit  # room in the line, but this key has its 2 places already
        other = api.queue.join(owner="another key")  # and another owner waits: the cap binds
        try:
            mine = _post(url, prompt="z", max_tokens=3)
        finally:
            other.leave()
        assert mine.status_code == 429 and mine.headers["Retry-After"].isdigit()
        assert "2 replies waiting already" in mine.json()["error"]["message"]
    finally:
        holder.leave()
        api.max_waiting = limit
    for t in waiting:
        t.join(60)
    assert codes == [200, 200]


def test_the_page_and_the_api_take_turns_in_arrival_order(server):
    """A page reply and API requests wait in one queue: served in the order they asked, the
    page's reply saying meanwhile how many are ahead of it."""
    from specchat.ui.handlers import ChatApp
    from specchat.ui.state import Session, Settings

    url, api, _ = server
    engine = api.engine
    started: list[str] = []
    real = engine.stream

    def stream(ids, cfg, stop_event=None):  # notes which reply the engine begins
        started.append(engine.tokenizer.decode(ids))
        yield from real(ids, cfg, stop_event=stop_event)

    def until(condition) -> None:
        deadline = time.time() + 30
        while not condition() and time.time() < deadline:
            time.sleep(0.02)
        assert condition()

    page = ChatApp(LoadReport(engine, None, []), StatsStore(":memory:"))
    session, settings = Session(), Settings(max_new_tokens=3, temperature=0.0,
                                            mode="completion")
    page.user("from the page", session, settings=settings)
    notices: list[str] = []
    codes: list[int] = []
    engine.stream = stream
    holder = api.queue.join()  # the engine is busy: everyone below waits
    try:
        first = threading.Thread(target=lambda: codes.append(
            _post(url, prompt="api first", max_tokens=3).status_code))
        first.start()
        until(lambda: api.queue.waiting == 1)
        reply = threading.Thread(target=lambda: notices.extend(
            out[2] for out in page.bot(session, settings) if isinstance(out[2], str)))
        reply.start()
        until(lambda: api.queue.waiting == 2)
        second = threading.Thread(target=lambda: codes.append(
            _post(url, prompt="api second", max_tokens=3).status_code))
        second.start()
        until(lambda: api.queue.waiting == 3)
        assert started == []
        holder.leave()
        for t in (first, reply, second):
            t.join(60)
    finally:
        holder.leave()
        del engine.stream
    assert codes == [200, 200] and session.turns[-1].stats.new_tokens == 3
    assert [next(name for name in ("api first", "from the page", "api second") if name in p)
            for p in started] == ["api first", "from the page", "api second"]
    def said(ahead):  # with the expected wait, once a reply has held the engine
        return any(n.startswith(f"Waiting for the model: {ahead} ahead of you") for n in notices)

    assert said(2) and said(1)  # 2: the holder and "api first"
    assert api.queue.waiting == 0


def test_a_client_that_leaves_frees_the_engine_and_its_turn_is_kept(server):
    """Closing a stream mid-reply stops the reply at its next step: the engine serves the next
    request at once, and the turn is recorded as interrupted, with the tokens sent."""
    url, api, store = server
    slow = api.engine.model.register_forward_hook(lambda *a: time.sleep(0.05))
    try:
        with httpx.stream("POST", f"{url}/completions", timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"prompt": "leaving " + PROMPT, "max_tokens": 60,
                                "stream": True, "speculation": False}) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: {"))
        assert '"text"' in first
        started = time.time()
        assert _post(url, prompt="next", max_tokens=2).status_code == 200
        assert time.time() - started < 2.5  # not after the 60-token reply's 3 s
    finally:
        slow.remove()
    assert api.writer.flush(10)
    turns = [t for c in store.conversations() for t in store.turns(c["id"])
             if t["prompt"].startswith("leaving")]
    assert len(turns) == 1 and turns[0]["interrupted"]
    assert turns[0]["stop_reason"] == "cancelled" and 0 < turns[0]["new_tokens"] < 60


def test_a_client_that_leaves_a_reply_it_did_not_stream_or_its_wait_frees_its_place(server):
    """A client that does not stream and goes away (here: its own timeout) stops its reply at
    the next step, recorded as cancelled; clients that leave while waiting leave the queue."""
    url, api, store = server
    slow = api.engine.model.register_forward_hook(lambda *a: time.sleep(0.05))
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/completions", timeout=1.0,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"prompt": "impatient " + PROMPT, "max_tokens": 60,
                             "speculation": False})
        started = time.time()
        assert _post(url, prompt="next", max_tokens=2).status_code == 200
        assert time.time() - started < 2.5  # not after the 60-token reply's 3 s
        holder = api.queue.join()  # the engine is busy: the next clients wait
        try:
            leavers = [threading.Thread(target=lambda: pytest.raises(
                httpx.TimeoutException, httpx.post, f"{url}/completions", timeout=0.5,
                headers={"Authorization": f"Bearer {KEY}"},
                json={"prompt": "waiting", "max_tokens": 3})) for _ in range(2)]  # a key's 2
            for t in leavers:
                t.start()
            for t in leavers:
                t.join()
            deadline = time.time() + 5
            while api.queue.waiting and time.time() < deadline:
                time.sleep(0.05)
            assert api.queue.waiting == 0
        finally:
            holder.leave()
    finally:
        slow.remove()
    assert api.writer.flush(10)
    turns = [t for c in store.conversations() for t in store.turns(c["id"])
             if t["prompt"].startswith(("impatient", "waiting"))]
    assert len(turns) == 1 and turns[0]["stop_reason"] == "cancelled"
    assert 0 < turns[0]["new_tokens"] < 60


def test_the_fields_clients_send_are_taken_or_refused_by_name(server):
    """Nulls mean "unset"; fields specchat cannot honour are refused by name, not ignored; a
    stream starts with the role and sends usage only when asked; errors everywhere under /v1
    are OpenAI's; /health answers."""
    url, api, _ = server
    ok = _post(url, prompt="hi", max_tokens=3, temperature=None, top_p=None, top_k=None,
               seed=None, n=1, logprobs=None, response_format={"type": "text"})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    timings = ok.json()["timings"]
    assert {"cache_n", "prompt_per_second", "prompt_per_token_ms",
            "predicted_per_token_ms"} <= set(timings)
    for body, name in ((dict(n=2), "'n'"), (dict(logprobs=True), "'logprobs'"),
                       (dict(response_format={"type": "json_object"}), "'response_format'"),
                       (dict(tools=[{"type": "function"}]), "'tools'"),
                       (dict(max_tokens=0), "max_tokens"), (dict(seed=-5), "seed"),
                       (dict(stop=["y" * 1000]), "'stop'"), (dict(stop=["a"] * 40), "'stop'"),
                       (dict(logit_bias={"1": -100}), "'logit_bias'"),
                       (dict(grammar='root ::= "a"'), "'grammar'"), (dict(n_probs=2), "'n_probs'"),
                       (dict(typical_p=0.5), "'typical_p'"), (dict(ignore_eos=True), "'ignore_eos'")):
        r = _post(url, prompt="hi", **body)
        assert r.status_code == 400 and name in r.json()["error"]["message"], (body, r.text)
    huge = httpx.post(f"{url}/completions", content=b'{"prompt": "' + b"x" * 300000 + b'"}',
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert huge.status_code == 413 and "limit" in huge.json()["error"]["message"]
    nested = httpx.post(f"{url}/completions", content="[" * 100000 + "]" * 100000,
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert nested.status_code in (400, 413) and "error" in nested.json()
    deep = httpx.post(f"{url}/completions", content="[" * 5000 + "]" * 5000,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert deep.status_code == 400 and "JSON" in deep.json()["error"]["message"]

    with httpx.stream("POST", f"{url}/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                            "stream": True}) as r:
        import json
        data = [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: {")]
    assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    for messages, status in (([{"role": "user", "content": [image]}], 400),
                             ([{"role": "developer", "content": "Be brief."},
                               {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                              200)):
        r = httpx.post(f"{url}/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"messages": messages, "max_tokens": 2, "typical_p": 1.0})
        assert r.status_code == status, r.text
    assert all(d["choices"] for d in data) and "usage" not in data[-1]  # not asked for

    root = url.removesuffix("/v1")
    assert httpx.get(f"{root}/health").json()["status"] == "ok"
    missing = httpx.get(f"{url}/nope", headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = httpx.get(f"{url}/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert wrong.status_code == 405 and wrong.headers["Allow"] == "POST"
    assert "use POST" in wrong.json()["error"]["message"]


def test_wrong_keys_count_as_failed_logins(server, caplog):
    """A bearer key that is no API key is a login attempt ("user:password"): each failure is
    logged and counted for that user and this address, so guessing through the API is
    throttled like the page's login (the app shares one guard between the two)."""
    import logging
    url, api, _ = server
    with caplog.at_level(logging.WARNING, logger="specchat.auth"):
        for n in range(3):
            r = httpx.get(f"{url}/models", headers={"Authorization": f"Bearer bob:guess{n}"})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    try:
        assert api.guard.failures("bob", "127.0.0.1") >= 3
        assert sum("login failed for user 'bob'" in r.getMessage() for r in caplog.records) == 3
        assert api.guard.delay("bob") > 0  # the next guess for bob waits
    finally:
        api.guard._failures.clear()
    assert httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"}).status_code \
        == 200


def _load(url: str, seconds: float, clients: int = 16) -> tuple[list[str], list[str]]:
    """`clients` threads, half streaming, sending short requests until `seconds` pass; a 429
    waits its Retry-After (at most 1 s here) and tries again. -> (prompts answered in full,
    failures)."""
    done, failures, deadline = [], [], time.time() + seconds

    def run(i: int) -> None:
        n = 0
        while time.time() < deadline:
            prompt, stream = f"load {i}-{n} {PROMPT}", i % 2 == 0
            body = {"prompt": prompt, "max_tokens": 6, "stream": stream}
            try:
                if stream:
                    with httpx.stream("POST", f"{url}/completions", json=body, timeout=60,
                                      headers={"Authorization": f"Bearer {KEY}"}) as r:
                        lines = [line for line in r.iter_lines() if line]
                        ok, code = r.status_code == 200 and lines[-1] == "data: [DONE]", \
                            r.status_code
                else:
                    r = _post(url, **body)
                    ok, code = r.status_code == 200 and r.json()["choices"], r.status_code
            except httpx.HTTPError as e:  # a hang shows up here as a timeout
                failures.append(f"{prompt}: {type(e).__name__}")
                return
            if code == 429:
                time.sleep(min(1.0, float(r.headers.get("Retry-After", 1))))
                continue
            (done if ok else failures).append(prompt if ok else f"{prompt}: {code}")
            n += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    assert not any(t.is_alive() for t in threads), "a client hung"
    return done, failures


@pytest.mark.parametrize("seconds", [pytest.param(10, id="10s"),
                                     pytest.param(60, id="60s", marks=pytest.mark.slow)])
def test_sixteen_clients_mixed_streamed_and_whole_lose_nothing(server, seconds):
    """A load test: 16 clients for a while, streamed and whole requests mixed. None hangs,
    none gets an error but 429 (answered by waiting), and the stats database holds every
    finished turn; the server answers at once afterwards."""
    url, api, store = server
    done, failures = _load(url, seconds)
    assert not failures, failures[:5]
    assert len(done) >= 16
    assert api.writer.flush(30)
    saved = {t["prompt"] for c in store.conversations() for t in store.turns(c["id"])
             if t["prompt"].startswith("load ")}
    assert set(done) <= saved
    assert _post(url, prompt="after", max_tokens=2).status_code == 200


def test_logprobs_come_from_the_target_in_openais_shapes(server):
    url, api, _ = server
    c = client(url)
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                     max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in content)
    assert all(e.top_logprobs[0].logprob == e.logprob for e in content)  # greedy: the argmax
    plain = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                 logprobs=2, extra_body={"speculation": False})
    spec = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                logprobs=2, extra_body={"drafter": "ngram"})
    for reply in (plain, spec):
        lp = reply.choices[0].logprobs
        assert "".join(lp.tokens) == reply.choices[0].text and len(lp.top_logprobs[0]) <= 2
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(
        spec.choices[0].logprobs.token_logprobs, abs=1e-5)
    streamed = [ch for ch in c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
        temperature=0, logprobs=True, stream=True) if ch.choices and ch.choices[0].logprobs]
    assert sum(len(ch.choices[0].logprobs.content) for ch in streamed) >= 1
    for body, param in (({"logprobs": 9}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs")):
        r = _post(url, prompt="hi", max_tokens=2, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_every_field_is_checked_by_its_json_type(server):
    """A number where a number belongs, a boolean where a boolean belongs, an object where an
    object belongs: "false" would read as true, "12" as a number, 0 as no stop; each is a 400
    that names the field. An oversized top-k is refused by its range, not a 500."""
    url, _, _ = server
    for body, name in ((dict(speculation="false"), "'speculation'"),
                       (dict(stream="false"), "'stream'"), (dict(adaptive=1), "'adaptive'"),
                       (dict(max_tokens="12"), "'max_tokens'"), (dict(top_k=True), "'top_k'"),
                       (dict(temperature="0.5"), "'temperature'"), (dict(stop=0), "'stop'"),
                       (dict(stream_options="yes"), "'stream_options'"),
                       (dict(stream=True, stream_options={"include_usage": "yes"}),
                        "'stream_options.include_usage'"),
                       (dict(top_k=10**30), "top_k")):
        r = _post(url, prompt="hi", max_tokens=body.pop("max_tokens", 3), **body)
        assert r.status_code == 400, (body, r.text)
        assert name in r.json()["error"]["message"], (body, r.text)
    plain = _post(url, prompt="hi", max_tokens=4, speculation=False, temperature=0)
    assert plain.status_code == 200, plain.text
    assert plain.json()["specchat"]["stats"]["speculation"] is False


def test_a_model_is_retrieved_by_id_and_streams_are_not_cached(server):
    """The `openai` client's models.retrieve works for the served id and gets OpenAI's 404 for
    another; event streams say Cache-Control: no-cache, so no proxy holds them back."""
    url, _, _ = server
    api = client(url)
    served = api.models.list().data[0].id
    assert api.models.retrieve(served).id == served
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        api.models.retrieve("gpt-4o")
    with httpx.stream("POST", f"{url}/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "hi", "max_tokens": 2, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["cache-control"] == "no-cache"
        r.read()


def test_the_prompt_is_limited_in_tokens_after_the_chat_format(server):
    """A request of many empty messages is short in characters but long in tokens once the chat
    format wraps each: the engine counts the tokens (--max-input-tokens) and refuses it before
    any encoding, with a 400 that says the limit; a request under it is served."""
    url, api, _ = server
    api.engine.max_prompt_tokens = 200
    try:
        messages = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}] * 20
        r = httpx.post(f"{url}/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"messages": messages + [{"role": "user", "content": "hi"}],
                             "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert "at most 200 (--max-input-tokens)" in r.json()["error"]["message"]
        assert _post(url, prompt="hi", max_tokens=2).status_code == 200
    finally:
        api.engine.max_prompt_tokens = None


def test_options_and_head_under_v1_get_openai_errors(server):
    url, auth = server[0], {"Authorization": f"Bearer {KEY}"}
    for method in ("OPTIONS", "HEAD"):
        r = httpx.request(method, url + "/chat/completions", headers=auth)
        assert r.status_code == 405 and r.headers["Allow"] == "POST", method
        if method == "OPTIONS":  # HEAD answers carry no body
            assert r.json()["error"]["type"] == "invalid_request_error"
        r = httpx.request(method, url + "/no-such-route", headers=auth)
        assert r.status_code == 404, method
