"""The Models tab (ui/models_panel.py): the catalog's models listed for the local owner, a load
that swaps the page's (and the API's) models in the engine's turn, failed or refused loads that
leave the current models serving, and visitors refused by the handlers themselves."""

from __future__ import annotations

import gc
import threading
import types
import weakref

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from test_catalog import write_checkpoint, write_gguf
from tiny import byte_tokenizer, loaded, tiny_llama

from specchat.api.server import Api, api_router, model_slug
from specchat.core.engine import Engine
from specchat.core.events import TokenEvent
from specchat.core.settings import request as make_request
from specchat.drafters.ngram import NgramDrafter
from specchat.engine_queue import EngineLoop, EngineQueue
from specchat.loader import LoadReport, load_engine
from specchat.stats.store import StatsStore
from specchat.ui import models_panel
from specchat.ui.access import Access
from specchat.ui.handlers import ChatApp
from specchat.ui.models_panel import (
    NOT_THE_OWNER,
    ModelPanel,
    Refused,
    catalog_rows,
    draft_choices,
    loaded_rows,
    outcome_html,
    target_choices,
)
from specchat.ui.state import Session, Settings

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|copy keyword)")]

PROMPT = "the cat sat on the mat. the cat"
NEW_TOKENS = 12
WAIT_S = 120  # a load's proof and warm-up, on a busy 2-core machine


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Tiny checkpoints as a user keeps them: `b` (another target), `other` (one more token in
    its vocabulary: no draft for `b`), and a GGUF file cut short."""
    base = tmp_path_factory.mktemp("panel-models")
    out = {}
    for name, seed, extra in (("b", 1, None), ("other", 2, ["<x>"])):
        tok = byte_tokenizer(extra)
        tiny_llama(seed, vocab=len(tok)).save_pretrained(base / name)
        tok.save_pretrained(base / name)
        out[name] = str(base / name)
    (base / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00cut short")
    out["bad"] = str(base / "bad.gguf")
    out["missing"] = str(base / "not-here")
    return out


def tiny_app(access: Access | None = None) -> ChatApp:
    engine = Engine(loaded(tiny_llama(0), byte_tokenizer()), {"ngram": NgramDrafter()})
    return ChatApp(engine, StatsStore(":memory:"), access=access)


def page_reply(app: ChatApp, text: str = PROMPT) -> str:
    """A greedy plain reply through the page's handlers (`user`, then `bot`)."""
    session = Session()
    settings = Settings(mode="completion", speculation=False, temperature=0.0,
                        max_new_tokens=NEW_TOKENS, seed=0)
    app.user(text, session, None, settings)
    for _ in app.bot(session, settings):
        pass
    assert session.turns[-1].stats.stop_reason in ("length", "eos"), session.turns[-1].stats
    return session.turns[-1].reply


def greedy(engine, text: str = PROMPT) -> str:
    ids, stops = engine.text_prompt(text)
    cfg = make_request(max_new_tokens=NEW_TOKENS, temperature=0.0, stop=stops)
    return "".join(e.text for e in engine.stream(ids, cfg) if isinstance(e, TokenEvent))


def user(name: str | None):
    """A gradio request as the handlers read it: a login's username, or none."""
    return types.SimpleNamespace(username=name, session_hash="tab", headers={}, client=None)


def test_the_owner_lists_the_catalogs_models(tmp_path, monkeypatch):
    roots = {name: tmp_path / name for name in ("specchat", "hub", "lmstudio", "ollama")}
    for root in roots.values():
        root.mkdir()
    monkeypatch.setenv("SPECCHAT_CACHE", str(roots["specchat"]))
    monkeypatch.setenv("HF_HUB_CACHE", str(roots["hub"]))
    monkeypatch.setenv("LMSTUDIO_MODELS", str(roots["lmstudio"]))
    monkeypatch.setenv("OLLAMA_MODELS", str(roots["ollama"]))
    gguf_path = write_gguf(roots["specchat"] / "gguf" / "tiny-Q8_0.gguf")
    write_checkpoint(roots["lmstudio"] / "pub" / "small-llama")
    write_gguf(roots["lmstudio"] / "pub" / "odd" / "odd.gguf", arch="mamba")

    panel = ModelPanel(tiny_app())
    entries = panel.listing()
    by_name = {row[0]: row for row in catalog_rows(entries)}
    assert set(by_name) == {"tiny-Q8_0.gguf", "pub/small-llama", "pub/odd/odd.gguf"}
    assert by_name["tiny-Q8_0.gguf"] == ["tiny-Q8_0.gguf", "llama", "576", "Q8_0",
                                         f"{gguf_path.stat().st_size / 1000:.3g} KB",
                                         "specchat", "yes", str(gguf_path)]
    assert by_name["pub/odd/odd.gguf"][6] == "no: architecture mamba is not one specchat runs"
    # Only what specchat opens can be picked; the embedded default always can be.
    targets = {value: label for label, value in target_choices(entries)}
    assert set(targets) == {"embedded", str(gguf_path), str(roots["lmstudio"] / "pub" /
                                                            "small-llama")}
    assert draft_choices(entries)[0] == ("None (no draft model)", "")
    # What serves now: the target, the draft model, the head, the drafters.
    assert panel.loaded() == [["Target", "tiny [none, cpu]"], ["Draft model", "none"],
                              ["Draft head", "none"], ["Drafters", "N-gram lookup (prompt)"]]


def test_a_load_swaps_the_models_for_the_page_and_the_api(dirs, monkeypatch):
    """On the engine's loop and in its turn: the slot then serves the new target, the page's
    next reply and the API's come from it, and the old models are freed."""
    reference = greedy(load_engine(dirs["b"], quantization="none", device="cpu",
                                   progress=lambda m: None).engine)
    app = tiny_app()
    api = Api(lambda: app.slot.report, StatsStore(":memory:"))
    server = FastAPI()
    server.include_router(api_router(api))
    client = TestClient(server)
    old = app.slot.engine
    before = page_reply(app)
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"

    ran_on = []
    real = models_panel.load_engine

    def spy(*args, **kwargs):
        ran_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(models_panel, "load_engine", spy)
    loop, stop = EngineLoop(), threading.Event()
    runner = threading.Thread(target=loop.run, args=(stop,), name="engine-loop", daemon=True)
    runner.start()
    try:
        # A reply holds the engine: the load waits its turn, then runs on the loop.
        holder = EngineQueue.of(old).join(owner="someone")
        load = ModelPanel(app).start(dirs["b"], "", "none")
        assert not load.wait(0.5) and load.state == "waiting" and app.slot.engine is old
        assert len(load.lines) == 1 and \
            load.lines[0].startswith("Waiting for the 1 reply ahead to end"), load.lines
        holder.leave()
        assert load.wait(WAIT_S), load.lines
        assert load.state == "done", load.lines
        assert ran_on == ["engine-loop"]
        assert any("Warming up" in line for line in load.lines)
        assert load.lines[-1].startswith("Ready in")
        assert "Loaded target" in outcome_html(load)

        engine = app.slot.engine
        assert engine is not old and engine.target.name == dirs["b"]
        assert loaded_rows(app.slot)[0] == ["Target", engine.target.label]
        after = page_reply(app)
        assert after == reference != before
        listed = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in listed] == [model_slug(dirs["b"])]
        answer = client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
            "speculation": False}).json()
        assert answer["choices"][0]["text"] == reference
    finally:
        stop.set()
        runner.join(10)
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None  # nothing holds the models swapped out


def test_a_failed_load_leaves_the_current_models_serving(dirs):
    app = tiny_app()
    panel, engine = ModelPanel(app), app.slot.engine
    before = page_reply(app)
    for target, why in ((dirs["bad"], "truncated"), (dirs["missing"], "no such directory")):
        load = panel.start(target, "", "none")
        assert load.wait(WAIT_S) and load.state == "failed", load.lines
        assert why in load.error and why in load.lines[-2]
        assert load.lines[-1] == "The current models go on serving."
        shown = outcome_html(load)
        assert "Could not load" in shown and why in shown
        assert app.slot.engine is engine and app.slot.state == "ready"
    assert page_reply(app) == before


def test_a_draft_of_another_vocabulary_is_refused_with_what_differs(dirs):
    app = tiny_app()
    engine = app.slot.engine
    load = ModelPanel(app).start(dirs["b"], dirs["other"], "none")
    assert load.wait(WAIT_S) and load.state == "failed", load.lines
    assert "vocabulary does not match the target's" in load.error
    assert "tokenizer size 259 vs 260" in load.error
    assert app.slot.engine is engine


def test_visitors_and_other_logins_are_refused_by_the_handlers(dirs):
    # A visitor of an exposed page without a login: no tab, and the handlers refuse.
    exposed = Access(exposed=True)
    assert not exposed.models_offered
    app = tiny_app(exposed)
    panel, engine = ModelPanel(app), app.slot.engine
    for call in (lambda: panel.listing(user(None)), lambda: panel.loaded(user(None)),
                 lambda: panel.start(dirs["b"], "", "none", user(None))):
        with pytest.raises(Refused, match="Only this machine's owner"):
            call()
    assert panel.load is None and app.slot.engine is engine
    # Behind logins: only a login named by --admin.
    logins = Access(auth=True, exposed=True, admins={"root"})
    assert logins.models_offered
    app = tiny_app(logins)
    panel = ModelPanel(app)
    for who in (user("alice"), user(None), None):
        with pytest.raises(Refused) as refused:
            panel.start(dirs["b"], "", "none", who)
        assert str(refused.value) == NOT_THE_OWNER
    assert panel.load is None
    assert panel.loaded(user("root"))[0][0] == "Target"
    assert not Access(auth=True).models_offered  # logins and no admin: nobody
    with pytest.raises(Refused, match="Pick a target"):
        panel.start("", "", "none", user("root"))


def test_a_request_keeps_the_models_its_prompt_was_made_for():
    """The API pins the slot's models for a whole request: a swap meanwhile changes the next
    request's, never this one's."""
    app = tiny_app()
    api = Api(lambda: app.slot.report)
    pinned = api.pinned()
    new = LoadReport(Engine(loaded(tiny_llama(1), byte_tokenizer(), name="tiny-b")), None, [])
    old = app.slot.swap(new)
    assert pinned.engine is old.engine and pinned.model_id == "tiny"
    assert api.engine is new.engine and api.model_id == "tiny-b"


def test_the_page_has_the_tab_only_where_the_owner_may_use_it():
    from specchat.ui.page import build_ui

    def tab(access):
        config = build_ui(tiny_app(access).slot, access=access).config
        found = [c for c in config["components"]
                 if c.get("props", {}).get("elem_id") == "sc-models-tab"]
        return found[0]["props"].get("visible", True) if found else None

    assert tab(Access()) is True
    assert tab(Access(exposed=True)) is None
    assert tab(Access(auth=True)) is None
    assert tab(Access(auth=True, admins={"root"})) is False  # shown to the admins on load


def test_the_owners_page_has_the_tab_and_visitors_pages_do_not(dirs, tmp_path, monkeypatch):
    """Chromium: the local page lists the models (names as text, axe finds nothing serious),
    loads one that fails and one that loads, following each load's lines, and its header
    follows the new target; an exposed page has no Models tab; behind logins only the admin's
    page shows it."""
    from test_a11y import _axe, _axe_script
    from test_browser import CHROMIUM, CHROMIUM_ARGS, WAIT_MS, _login, _sync_playwright

    from specchat.ui.page import build_ui, launch

    sync_playwright = _sync_playwright()
    axe = _axe_script()
    # (specchat's own cache stays: the load below uses the C kernels compiled there)
    for name in ("HF_HUB_CACHE", "LMSTUDIO_MODELS", "OLLAMA_MODELS"):
        (tmp_path / name).mkdir()
        monkeypatch.setenv(name, str(tmp_path / name))
    write_gguf(tmp_path / "LMSTUDIO_MODELS" / "pub" / "<img src=x onerror=alert(1)>.gguf")
    write_checkpoint(tmp_path / "LMSTUDIO_MODELS" / "pub" / "small-llama")
    demos = {}
    try:
        for kind, access, auth in (
                ("local", Access(), None), ("exposed", Access(exposed=True), None),
                ("logins", Access(auth=True, admins={"root"}),
                 [("root", "root-pw"), ("alice", "alice-pw")])):
            demo = build_ui(tiny_app(access).slot, access=access)
            launch(demo, server_name="127.0.0.1", server_port=None, prevent_thread_lock=True,
                   quiet=True, auth=auth)
            demos[kind] = demo
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.set_default_timeout(WAIT_MS)
                page.goto(demos["local"].local_url)
                page.wait_for_selector("#sc-status .sc-status-ready")
                page.get_by_role("tab", name="Models").click()
                listing = page.locator("#sc-models-list")
                listing.get_by_text("pub/small-llama").first.wait_for()
                # A file's name is shown as text, never as markup.
                assert "pub/<img src=x onerror=alert(1)>.gguf" in listing.inner_text()
                assert page.locator("#sc-models-list img").count() == 0
                page.locator("#sc-models-loaded").get_by_text("tiny [none, cpu]").wait_for()
                page.screenshot(path=str(tmp_path / "models-tab.png"), full_page=True)
                assert _axe(page, axe, "Models") == []

                target = page.locator("#sc-models-target input")
                for path in (dirs["missing"], dirs["b"]):
                    target.fill(path)
                    target.press("Enter")
                    page.click("#sc-models-load")
                    if path == dirs["missing"]:
                        page.wait_for_selector("#sc-models-outcome .sc-error:has-text("
                                               "'no such directory')")
                page.wait_for_selector("#sc-models-outcome :text('Loaded target')")
                assert "Ready in" in page.locator("#sc-models-lines textarea").input_value()
                # The page follows the new models: its header names the new target.
                page.wait_for_selector(f"#sc-header summary:has-text('{dirs['b']}')")
                assert dirs["b"] in page.locator("#sc-models-loaded").inner_text()

                page.goto(demos["exposed"].local_url)
                page.wait_for_selector("#sc-status .sc-status-ready")
                assert page.get_by_role("tab", name="Stats").count() == 1
                assert page.get_by_role("tab", name="Models").count() == 0
                assert page.locator("#sc-models-tab, #sc-models-list").count() == 0

                for name, shown in (("root", 1), ("alice", 0)):
                    page = _login(browser, demos["logins"].local_url, name, f"{name}-pw")
                    page.get_by_role("tab", name="Stats").wait_for()
                    if shown:
                        page.get_by_role("tab", name="Models").wait_for()
                    assert page.get_by_role("tab", name="Models").count() == shown, name
                    page.context.close()
            finally:
                browser.close()
    finally:
        for demo in demos.values():
            demo.close()
