"""The page and the API stream at the engine's own speed (slow: the embedded model, real
Chromium, about 4 minutes on 2 cores).

For the same request (the embedded model, Completion mode, the examples' samplers, 256 tokens),
speculation off and on: the tok/s the page shows for a reply, and a reply streamed through the
API by the `openai` client (in a process of its own, as a user runs one), each against the
engine's own `generate` run beside it in the server's process. Ratios measured in one run, so
they hold on a noisy machine; the margins are below the targets (page 0.9, API 0.95), which
docs/performance.md records with this test's output:

    python -m pytest -q -s -m slow tests/test_page_speed.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
from test_browser import CHROMIUM_ARGS, COUNT_FRAMES, _free_port, _sync_playwright
from tiny import served_on_loopback

from specchat.api.server import create_app
from specchat.core.events import GenerationStats
from specchat.engine_queue import EngineLoop
from specchat.loader import load_engine
from specchat.stats.store import StatsStore
from specchat.ui.examples import SAMPLER_PRESETS
from specchat.ui.handlers import ChatApp, warm_up
from specchat.ui.page import launch, page
from specchat.ui.state import Settings

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|copy keyword)")]

PROMPT = "The three most useful things to know about the history of the printing press are"
TOKENS = 256
# the samplers the page sends, by the API's names (the examples' set: DRY, repeat penalty, min-p)
SAMPLERS = ("min_p", "repeat_penalty", "repeat_last_n", "frequency_penalty", "presence_penalty",
            "dry_multiplier", "dry_base", "dry_allowed_length", "temperature", "top_p", "top_k")
PAGE_MARGIN = 0.75  # target 0.9, medians 0.85-0.97 (docs/performance.md)
API_MARGIN = 0.8  # target 0.95, medians 0.85-0.95
ROUNDS = 5  # replies measured a configuration, the median kept


@pytest.fixture(scope="module")
def report():
    report = load_engine("embedded", progress=lambda *a: None)
    warm_up(report.engine)
    return report


def _settings(speculation: bool) -> Settings:
    return replace(Settings(), **SAMPLER_PRESETS["examples"], mode="completion", seed=7,
                   max_new_tokens=TOKENS, speculation=speculation)


def _generate(app: ChatApp, settings: Settings) -> GenerationStats:
    """What `generate` does: the engine's own stream, the same request the page makes."""
    engine = app.slot.engine
    cfg, _ = app.config(settings)
    ids, stops = engine.text_prompt(PROMPT)
    return [e for e in engine.stream(ids, replace(cfg, stop=stops))][-1]


def _page_reply(url: str, store: StatsStore, browser) -> dict:
    """A reply in a new tab of a running browser, as a visitor opens the page."""
    tab = browser.new_page(viewport={"width": 1280, "height": 800})
    try:
        tab.set_default_timeout(120_000)
        tab.add_init_script(COUNT_FRAMES)
        tab.goto(url)
        tab.wait_for_selector("#sc-status .sc-status-ready")
        # as a visitor types: the page's own start (scripts, fonts, layouts, gradio's entrance
        # transitions, a few seconds of animation frames) is over before the message goes,
        # not racing the reply
        for _ in range(20):
            tab.evaluate("window.__frames = 0")
            time.sleep(0.5)
            if tab.evaluate("window.__frames") == 0:
                break
        tab.locator("#sc-input textarea").fill(PROMPT)
        before = len(store.conversations())
        tab.click("#sc-send")
        tab.wait_for_selector("#sc-chat .sc-stats")
        deadline = time.monotonic() + 30
        while len(store.conversations()) <= before and time.monotonic() < deadline:
            time.sleep(0.1)
        conversation = store.conversations()[0]
        return store.turns(conversation["id"])[-1]
    finally:
        tab.close()


def test_the_page_and_the_api_stream_at_the_engines_speed(report, capsys):
    """As `python app.py` and `serve` run: the servers in threads, every reply (and here each
    `generate` run beside them) on the main thread's `EngineLoop`."""
    sync_playwright = _sync_playwright()
    loop, figures, failed = EngineLoop(), [], []

    def measure() -> None:
        try:
            figures.extend(_measure(report, loop, sync_playwright))
        except BaseException as e:  # noqa: BLE001 - raised on the main thread
            failed.append(e)
        finally:
            loop.stop()

    thread = threading.Thread(target=measure, name="measure")
    thread.start()
    loop.run()
    thread.join()
    if failed:
        raise failed[0]
    with capsys.disabled():
        print()
        for where, speculation, tok_s, generate, ratios in figures:
            print(f"{where:<5} speculation {'on ' if speculation else 'off'}: {tok_s:6.1f} tok/s, "
                  f"generate {generate:6.1f} tok/s, ratio {tok_s / generate:.2f} (rounds: "
                  + ", ".join(f"{r:.2f}" for r in ratios) + ")")
    for where, speculation, tok_s, generate, _ in figures:
        margin = PAGE_MARGIN if where == "page" else API_MARGIN
        assert tok_s >= margin * generate, (where, speculation, tok_s, generate)


def _measure(report, loop: EngineLoop, sync_playwright) -> list[tuple]:
    """(where, speculation, tok/s, generate's tok/s, every round's ratio) of the median of ROUNDS
    rounds, each a reply between two `generate` runs: one reply's ratio moves by 0.1 and more
    with the machine's drift on a shared 2-core CPU."""
    figures = []
    for speculation in (False, True):
        store = StatsStore(":memory:")
        settings = _settings(speculation)
        app = ChatApp(report, store)
        demo = page(app, settings)
        port = _free_port()
        launch(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
               quiet=True)
        rounds = []
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium",
                                            args=CHROMIUM_ARGS)
                for _ in range(ROUNDS):
                    base = loop.call(_generate, app, settings)
                    report.engine.history.clear()  # no earlier reply to copy drafts from
                    turn = _page_reply(f"http://127.0.0.1:{port}/", store, browser)
                    after = loop.call(_generate, app, settings)
                    assert turn["new_tokens"] == base.new_tokens  # the same request and reply
                    rounds.append((turn["tokens_per_s"],
                                   (base.tokens_per_s + after.tokens_per_s) / 2))
                browser.close()
        finally:
            demo.close()
        figures.append(("page", speculation, *_median_round(rounds),
                        [tok_s / gen for tok_s, gen in rounds]))

        api = create_app(report, StatsStore(":memory:"), {"sk-speed": "speed"},
                         max_tokens_cap=TOKENS)
        rounds = []
        with served_on_loopback(api) as url:
            body = dict(model=api.state.api.model_id, prompt=PROMPT, max_tokens=TOKENS,
                        seed=settings.seed,
                        extra_body={name: getattr(settings, name) for name in SAMPLERS}
                        | {"speculation": speculation})
            for _ in range(ROUNDS):
                base = loop.call(_generate, app, settings)
                report.engine.history.clear()
                tokens, seconds = _api_reply(f"{url}/v1", body)
                after = loop.call(_generate, app, settings)
                assert tokens == base.new_tokens
                rounds.append((tokens / seconds, (base.tokens_per_s + after.tokens_per_s) / 2))
        figures.append(("api", speculation, *_median_round(rounds),
                        [tok_s / gen for tok_s, gen in rounds]))
    return figures


# A client program of its own, as the API's users run one: a client in the server's process
# would take the server's interpreter lock for every chunk it parses.
CLIENT = """
import json, sys, time
import openai
url, body = sys.argv[1], json.loads(sys.argv[2])
client = openai.OpenAI(base_url=url, api_key="sk-speed", max_retries=0)
started, tokens = time.perf_counter(), 0
for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                       **body):
    if getattr(chunk, "usage", None):
        tokens = chunk.usage.completion_tokens
print(json.dumps([tokens, time.perf_counter() - started]))
"""


def _api_reply(url: str, body: dict) -> tuple[int, float]:
    """A reply streamed by the `openai` client in a process of its own: (tokens, seconds) end
    to end, the first token's wait and the HTTP stream included."""
    done = subprocess.run([sys.executable, "-c", CLIENT, url, json.dumps(body)],
                          capture_output=True, text=True, timeout=300, check=True)
    tokens, seconds = json.loads(done.stdout.strip().splitlines()[-1])
    return tokens, seconds


def _median_round(rounds: list[tuple[float, float]]) -> tuple[float, float]:
    """The round whose ratio is the median."""
    ordered = sorted(rounds, key=lambda r: r[0] / r[1])
    return ordered[len(ordered) // 2]
