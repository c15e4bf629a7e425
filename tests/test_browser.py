"""The page in real headless Chromium (Debian's /usr/bin/chromium driven by Playwright): a tiny
random model pair serves the app in-process; we chat, see colored token spans of several kinds,
switch speculation off, race the drafters, and take a screenshot.

Skipped only when Chromium (or Playwright) is genuinely absent and $CI is unset; in CI a missing
browser is a failure, so the check can never silently disappear there.
"""

from __future__ import annotations

import http.server
import os
import re
import socket
import threading
import time
from pathlib import Path

import pytest
from tiny import byte_tokenizer, loaded, tiny_llama

from specchat.core.engine import Engine
from specchat.drafters.model import ModelDrafter
from specchat.drafters.ngram import NgramDrafter
from specchat.stats.store import StatsStore
from specchat.ui.access import Access
from specchat.ui.handlers import warm_up
from specchat.ui.page import build_ui, launch
from specchat.ui.state import Limits, Settings

# gradio's queue monitoring trips pandas 3 deprecations; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|copy keyword)")

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
WAIT_MS = 60_000  # generous: CI machines are small and shared
REPETITIVE = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"


def _sync_playwright():
    missing = []
    if not Path(CHROMIUM).exists():
        missing.append(f"{CHROMIUM} (apt-get install chromium chromium-driver)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
        missing.append("the playwright package (pip install -r requirements.txt)")
    if missing:
        reason = "browser test needs " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must run it, not skip it")
        pytest.skip(reason)
    return sync_playwright


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    """The app on a tiny pair whose draft has the target's weights (greedy drafts pass)."""
    tok = byte_tokenizer()
    engine = Engine(loaded(tiny_llama(0), tok),
                    {"ngram": NgramDrafter(), "model": ModelDrafter(tiny_llama(0), len(tok))})
    warm_up(engine)  # as the launcher does: its plain steps price the first reply's estimate
    store = StatsStore(":memory:")
    # k fixed: on this pair a draft token costs a target step, so the adaptive policy may rightly
    # decode plainly, and what this page checks is the colors, the toggle and the replay.
    demo = build_ui(engine, store, min_interval=0.02,
                    defaults=Settings(max_new_tokens=48, seed=0, adaptive=False))
    port = _free_port()
    launch(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/", store
    finally:
        demo.close()
        store.close()


# The open step card's text and gradio's "scroll down" button, on the chat scrolled so that the
# card fills the lower part of its view (where the button floats): "clear", "overlaps" or
# "no button" (the chat was not scrolled up, so the button never showed).
SCROLL_BUTTON_OVER_CARD = """async () => {
  const log = document.querySelector('#sc-chat [role=log]');
  const card = document.querySelector('#sc-chat .sc-card:not([hidden])');
  log.scrollTop += card.getBoundingClientRect().top - log.getBoundingClientRect().top
                   - log.clientHeight * 0.4;
  await new Promise((done) => setTimeout(done, 500));
  const button = document.querySelector('#sc-chat .scroll-down-button-container button');
  if (!button) return 'no button';
  const b = button.getBoundingClientRect(), c = card.getBoundingClientRect();
  const view = log.getBoundingClientRect();
  const top = Math.max(c.top, view.top), bottom = Math.min(c.bottom, view.bottom);
  const overlaps = b.left < c.right && b.right > c.left && b.top < bottom && b.bottom > top;
  return overlaps ? 'overlaps' : 'clear';
}"""


def _saved_turns(store, n: int, timeout: float = 30.0) -> list[dict]:
    """The first conversation's turns once `n` are saved (the app saves in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        conversations = store.conversations()
        turns = store.turns(conversations[0]["id"]) if conversations else []
        if len(turns) >= n or time.monotonic() > deadline:
            return turns
        time.sleep(0.1)


def _kinds(page, selector: str) -> list[str]:
    classes = page.eval_on_selector_all(selector, "els => els.map(e => e.className)")
    return [m.group(1) for c in classes for m in [re.search(r"\btk-(\w+)", c)] if m]


def test_chat_colors_toggle_and_the_race_in_chromium(served, tmp_path):
    sync_playwright = _sync_playwright()
    url, store = served
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})  # a laptop
            page.set_default_timeout(WAIT_MS)
            page.goto(url)
            page.wait_for_selector("#sc-status .sc-status-ready")
            box = page.locator("#sc-input textarea")
            # Every id the page sets is set once.
            assert page.evaluate(
                "(() => { const ids = [...document.querySelectorAll('[id^=\"sc-\"]')]"
                ".map(e => e.id); return ids.length - new Set(ids).size; })()") == 0

            # An empty message is refused with a visible notice.
            page.click("#sc-send")
            page.wait_for_selector("#sc-notice:has-text('Type a message first')")

            # 1. Speculation on: the reply streams as colored spans of at least two kinds.
            box.fill("Hello <b>specchat</b>")
            box.press("Enter")
            page.wait_for_selector("#sc-chat .sc-stats")
            assert "Hello <b>specchat</b>" in page.inner_text("#sc-chat")  # escaped, shown as text
            kinds = _kinds(page, "#sc-chat .sc-reply span.tk")
            assert len(set(kinds)) >= 2 and set(kinds) <= {"accepted", "bonus", "resampled",
                                                           "target"}, kinds
            first = page.locator("#sc-chat .sc-reply span.tk-accepted").first
            assert re.fullmatch(r"accepted · step \d+ · accepted \d+/\d+",
                                first.get_attribute("title"))
            # The CSS is live: color plus a second cue (underline style) per kind.
            style = first.evaluate("e => [getComputedStyle(e).textDecorationStyle, "
                                   "getComputedStyle(e).backgroundColor]")
            assert style[0] == "solid" and style[1] not in ("rgba(0, 0, 0, 0)", "transparent")
            if "bonus" in kinds:
                bonus = page.locator("#sc-chat .sc-reply span.tk-bonus").first
                assert bonus.evaluate("e => getComputedStyle(e).textDecorationStyle") == "double"
            stats_line = page.inner_text("#sc-chat .sc-stats")
            assert "tok/s" in stats_line and "accepted" in stats_line
            # Its speedup is an estimate from its own steps, labelled so, with its band: no
            # other reply to divide by exists, and none would be used.
            assert re.search(r"≈\d+\.\d\d× est\. \(\d+\.\d\d–\d+\.\d\d×\)", stats_line), \
                stats_line
            assert page.locator("#sc-chat .sc-speedup").count() == 0

            # 2. Speculation off: the next reply is all plain target tokens.
            page.click("#sc-speculation input")
            box.fill("Again, plainly")
            box.press("Enter")
            page.wait_for_function(
                "document.querySelectorAll('#sc-chat .sc-stats').length >= 2")
            replies = page.locator("#sc-chat .sc-reply")
            assert replies.count() == 2
            second = set(_kinds(page, "#sc-chat .message-row:last-child .sc-reply span.tk"))
            assert second == {"target"}, second
            assert "speculation off" in page.locator("#sc-chat .sc-stats").nth(1).inner_text()

            # The first reply's step card opens in a chat tall enough to hold it with the reply
            # (the card alone is about 260 px), and the chat's floating "scroll down" button,
            # shown once the chat is scrolled up, stays off the card's text.
            # (a finished reply shows formatted first: its tokens are one click away)
            page.locator("#sc-chat .sc-view-tk").first.click()
            page.locator("#sc-chat .tk.sc-step").first.click()
            page.wait_for_selector("#sc-chat .sc-card:not([hidden])")
            chat = page.locator("#sc-chat").bounding_box()
            assert chat["height"] >= 440, f"chat too short for a reply and its card: {chat}"
            page.wait_for_timeout(1500)  # gradio keeps the chat at its end a moment after a reply
            assert page.evaluate(SCROLL_BUTTON_OVER_CARD) == "clear"

            # 3. The race: plain, then each drafter, each run with its own reply and step
            # cards; a row of figures per run, identical texts (fp32 greedy).
            page.click("#sc-race")
            page.wait_for_selector("#sc-race-verdict .sc-race-grid")
            verdict = page.inner_text("#sc-race-verdict")
            assert "tok/s" in verdict and "speedup (band)" in verdict
            assert verdict.count("✓ identical") == 2, verdict  # the draft model, n-gram lookup
            assert set(_kinds(page, "#sc-race-runs .sc-race-plain span.tk")) == {"target"}
            assert len(set(_kinds(page, "#sc-race-runs .sc-race-model span.tk"))) >= 2
            # A run's step card opens inside its own panel.
            page.locator("#sc-race-runs .sc-race-model .tk.sc-step").first.click()
            page.wait_for_selector("#sc-race-runs .sc-race-model .sc-card:not([hidden])")
            assert page.locator("#sc-race-runs .sc-race-ngram .sc-card:not([hidden])").count() == 0
            # The results are on screen without scrolling: the page brings them into view.
            page.wait_for_function(
                "(() => { const r = document.getElementById('sc-race-verdict')"
                ".getBoundingClientRect(); return r.top >= 0 && r.bottom <= innerHeight; })()",
                timeout=5_000)

            shot = tmp_path / "specchat.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 20_000
        finally:
            browser.close()
    # Two chat turns and the race's three runs were recorded, each drafter's against the plain.
    turns = _saved_turns(store, 5)
    assert [t["speculation"] for t in turns] == [True, False, False, True, True]
    assert turns[3]["baseline_turn_id"] == turns[4]["baseline_turn_id"] == turns[2]["id"]


# ---------------------------------------------------------------------------------------------
# The shared link: two logins on a loopback page, hostile text, a tab closed mid-reply.

@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The app behind two logins on 127.0.0.1 (as behind a reverse proxy or tunnel), and a
    server counting requests: a payload's image would be fetched from it."""
    tok = byte_tokenizer()
    # A draft model with other weights than the target's: many drafts are refused.
    engine = Engine(loaded(tiny_llama(0), tok),
                    {"ngram": NgramDrafter(), "model": ModelDrafter(tiny_llama(1), len(tok))})
    store = StatsStore(tmp_path_factory.mktemp("db") / "stats.db")
    # replies up to 20,000 tokens: one a tab closes mid-reply outlasts the close, however fast
    # the tiny model decodes on this machine
    demo = build_ui(engine, store, limits=Limits(max_new_tokens_cap=20000),
                    access=Access(auth=True), min_interval=0.02,
                    defaults=Settings(max_new_tokens=24, seed=0))
    port = _free_port()
    launch(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
           auth=[("alice", "alice-pw"), ("bob", "bob-pw")])
    hits = []

    class Counter(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            hits.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    trap = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Counter)
    threading.Thread(target=trap.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{port}/", store, trap.server_address[1], hits
    finally:
        trap.shutdown()
        demo.close()
        store.close()


def _login(browser, url: str, user: str, password: str):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    answer = context.request.post(url + "login", form={"username": user, "password": password})
    assert answer.ok, answer.status
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(url)
    page.wait_for_selector("#sc-status .sc-status-ready")
    _settled(page)
    return page


def _settled(page) -> None:
    """Wait until no event is pending on the page: a pending event's progress overlay takes the
    clicks meant for the components under it (seen on a busy machine)."""
    page.wait_for_function("() => ![...document.querySelectorAll('[data-testid=status-tracker]')]"
                           ".some(e => !e.className.includes('hide'))")


def _choose(radio) -> None:
    """Check a radio button that the page's load event may still set: the event picks the mode
    once the model's kind is known, and an answer arriving just after a click undoes it (seen
    on a busy machine). A few tries; the last failure is raised."""
    from playwright.sync_api import Error

    for attempt in range(3):
        try:
            radio.check()
            return
        except Error as e:
            if "did not change its state" not in str(e) or attempt == 2:
                raise
            radio.page.wait_for_timeout(1000)


def _no_markup(page, trap_port: int) -> None:
    """The payload arrived as text: no element of it exists anywhere on the page (chat, A/B
    panels, Stats table, picker, read-only replay)."""
    for selector in (f"img[src*='{trap_port}']", f"a[href*='{trap_port}']",
                     "form[action='/x']", "input[name='pw']"):
        assert page.locator(selector).count() == 0, selector


def _open_stats(page) -> None:
    page.get_by_role("tab", name="Stats").click()
    page.get_by_role("button", name="Refresh").click()


def test_hostile_text_is_shown_as_text_in_every_view_and_logins_are_isolated(shared):
    sync_playwright = _sync_playwright()
    url, store, trap_port, hits = shared
    payload = (f'Hi <img src="http://127.0.0.1:{trap_port}/x.png?who=alice"> '
               f'<a href="http://127.0.0.1:{trap_port}/login">Session expired - log in again</a> '
               '<form action="/x"><input name="pw"></form>'
               '<div style="position:fixed;inset:0">overlay</div>')
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            alice = _login(browser, url, "alice", "alice-pw")
            box = alice.locator("#sc-input textarea")
            box.fill(payload)
            box.press("Enter")
            alice.wait_for_selector("#sc-chat .sc-stats")
            alice.click("#sc-race")
            alice.wait_for_selector("#sc-race-verdict .sc-race-grid")
            assert "Session expired - log in again" in alice.inner_text("#sc-chat")
            _no_markup(alice, trap_port)
            _saved_turns(store, 3)

            alice.reload()  # a logged-in user's history survives a reload
            alice.wait_for_selector("#sc-status .sc-status-ready")
            _open_stats(alice)
            alice.wait_for_selector("#sc-stats-history .sc-user")
            assert "Session expired - log in again" in alice.inner_text("#sc-stats-history")
            # The read-only view offers no Clear or share button (they would not act on it).
            assert not alice.locator("#sc-stats-history button[aria-label='Clear']").is_visible()
            assert alice.locator("#sc-stats-history .icon-button-wrapper button:visible").count() \
                == 0
            assert "Hi <img src=" in alice.inner_text("#sc-stats-conversations")  # as text
            _no_markup(alice, trap_port)
            assert hits == []  # the browser fetched nothing the payload named

            # Bob, another login on the same loopback page, sees none of alice's conversation:
            # not in the list, not by id, not in an export.
            bob = _login(browser, url, "bob", "bob-pw")
            _open_stats(bob)
            bob.wait_for_timeout(1500)
            assert "Session expired" not in bob.inner_text("body")
            conversation = store.conversations()[0]["id"]
            assert conversation not in bob.content()
            bob.get_by_role("button", name="Export CSV").click()
            bob.wait_for_timeout(1500)
            assert "Session expired" not in bob.inner_text("body")
        finally:
            browser.close()
    assert store.conversations()[0]["owner"] == "user:alice"


def test_a_tab_closed_mid_reply_records_an_interrupted_turn(shared, monkeypatch):
    from specchat.ui import live

    # the tiny model would finish its reply within the grace a dropped feed gets to come back
    monkeypatch.setattr(live, "GRACE_S", 0.2)
    sync_playwright = _sync_playwright()
    url, store, _, _ = shared
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = _login(browser, url, "bob", "bob-pw")
            # A long reply: the tab closes while it streams.
            longest = page.locator("#sc-max-new input[type=number]")
            longest.fill("20000")
            longest.press("Tab")
            box = page.locator("#sc-input textarea")
            box.fill("a long story, please")
            box.press("Enter")
            # tokens drawn from the reply's feed: a cursor after them is there only mid-reply
            page.wait_for_selector("#sc-chat .sc-reply span.tk ~ .sc-cursor")
            page.context.close()
        finally:
            browser.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = [t for c in store.conversations() if c["owner"] == "user:bob"
                for t in store.turns(c["id"])]
        if rows:
            break
        time.sleep(0.2)
    assert rows and rows[-1]["interrupted"] and rows[-1]["stop_reason"] == "cancelled"
    assert rows[-1]["prompt"] == "a long story, please"


def test_inspector_ghost_text_step_cards_and_modes(shared):
    sync_playwright = _sync_playwright()
    url, _, _, _ = shared
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = _login(browser, url, "alice", "alice-pw")
            _choose(page.locator("#sc-mode").get_by_label("Chat", exact=True))
            page.get_by_label("Adapt k to measured acceptance and cost").uncheck()  # k = 8
            box = page.locator("#sc-input textarea")
            box.fill(REPETITIVE)
            box.press("Enter")
            page.wait_for_selector("#sc-chat .sc-stats")
            page.locator("#sc-chat .sc-view-tk").first.click()  # the reply's tokens view
            # Refused drafts follow the token that replaced them, as ghost text.
            ghost = page.locator("#sc-chat .sc-ghost").first
            ghost.wait_for()
            assert page.evaluate("[...document.querySelectorAll('#sc-chat .sc-ghost')].some("
                                 "g => g.previousElementSibling?.classList.contains("
                                 "'tk-resampled'))")
            assert page.locator("#sc-chat .sc-charts").count() == 1
            page.click("#sc-ghosts input")  # the switch hides them
            assert not ghost.is_visible()
            page.click("#sc-ghosts input")
            assert ghost.is_visible()

            # A click opens the token's step card; Escape closes it; Enter on a focused token
            # opens it again.
            token = page.locator("#sc-chat .tk-resampled.sc-step").first
            step = next(c for c in token.get_attribute("class").split()
                        if c.startswith("sc-step-"))[len("sc-step-"):]
            card = page.locator(f"#sc-chat .sc-card-{step}")
            token.click()
            card.wait_for(state="visible")
            text = card.inner_text()
            assert f"Step {step}:" in text and "target at draft position" in text
            page.keyboard.press("Escape")
            card.wait_for(state="hidden")
            token.focus()
            page.keyboard.press("Enter")
            card.wait_for(state="visible")
            # One tab stop a reply; the arrows walk its steps.
            assert page.evaluate("[...document.querySelectorAll('#sc-chat .sc-reply')].every("
                                 "r => r.querySelectorAll('[tabindex=\"0\"]').length <= 1)")
            focused_step = ("[...document.activeElement.classList]"
                            ".find(c => c.startsWith('sc-step-'))")
            page.keyboard.press("ArrowRight")
            after = page.evaluate(focused_step)
            page.keyboard.press("ArrowLeft")
            assert after and after != f"sc-step-{step}"
            assert page.evaluate(focused_step) == f"sc-step-{step}"

            # Completion mode: the text itself is continued, no chat format.
            _choose(page.locator("#sc-mode").get_by_label("Completion", exact=True))
            box.fill("Once upon a time")
            box.press("Enter")
            page.wait_for_function(
                "document.querySelectorAll('#sc-chat .sc-stats').length >= 2")

            # An example starts a conversation of its own: only its turn is in the chat.
            page.locator("#sc-examples .gallery-item").nth(1).click()
            page.wait_for_function(
                "document.querySelectorAll('#sc-chat .sc-stats').length === 1")
            assert "Eiffel Tower" in page.locator("#sc-chat").inner_text()
        finally:
            browser.close()


LONG_TITLE = ("Why does the draft model's acceptance fall with each draft position, and which "
              "draft length k should I pick for a 270M target on a laptop CPU?")

# The example chips whose text is cut off without an ellipsis.
CHIPS_CUT_SILENTLY = """[...document.querySelectorAll('#sc-examples .gallery-item .gallery')]
  .filter((e) => e.scrollWidth > e.clientWidth && getComputedStyle(e).textOverflow !== 'ellipsis')
  .map((e) => e.textContent)"""

# The conversations table's layout: its width against its container's, the nearest box around
# it that scrolls sideways, the headers whose text takes more than one line, the long title's
# cell, and whether the picker's text stops before its dropdown arrow.
STATS_LAYOUT = """(title) => {
  const container = document.getElementById('sc-stats-conversations');
  const table = container.querySelector('table');
  let scroller = table.parentElement;
  while (scroller !== container && !['auto', 'scroll'].includes(
      getComputedStyle(scroller).overflowX)) scroller = scroller.parentElement;
  const lines = (el) => {  // how many lines its text takes
    const tops = new Set();
    const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    while (walker.nextNode()) {
      const range = document.createRange();
      range.selectNodeContents(walker.currentNode);
      for (const r of range.getClientRects()) if (r.width > 0) tops.add(Math.round(r.top));
    }
    return tops.size;
  };
  const cell = [...container.querySelectorAll(':is(td, [role=gridcell]) .cell-wrap')]
    .find((c) => c.textContent.trim() === title && c.getClientRects().length > 0);
  const text = cell.querySelector(':scope > span') || cell;  // the box that holds the text
  const input = document.querySelector('#sc-stats-picker input');
  const arrow = document.querySelector('#sc-stats-picker .icon-wrap');
  const textEnd = input.getBoundingClientRect().right
                  - parseFloat(getComputedStyle(input).paddingRight);
  return {
    table: table.scrollWidth, container: container.clientWidth,
    scroller: scroller === container ? null : scroller.clientWidth,
    wrapped: [...table.querySelectorAll('thead th .header-content')]
      .filter((h) => lines(h) > 1).map((h) => h.textContent.trim()),
    cut: text.scrollWidth > text.clientWidth,
    ellipsis: getComputedStyle(text).textOverflow === 'ellipsis',
    pickerClear: textEnd <= arrow.getBoundingClientRect().left
                 && getComputedStyle(input).textOverflow === 'ellipsis',
  };
}"""


# The centre of a cell showing the long title, where the element there is that cell: false until
# one is. (Gradio's table draws its rows in more than one table, some under others: the cell a
# pointer reaches is the one on top.)
CELL_UNDER_ITS_CENTRE = """(title) => {
  for (const cell of document.querySelectorAll(
      '#sc-stats-conversations :is(td, [role=gridcell]) .cell-wrap')) {
    if (cell.textContent.trim() !== title || !cell.getClientRects().length) continue;
    const box = cell.getBoundingClientRect();
    const at = [box.left + box.width / 2, box.top + box.height / 2];
    const there = document.elementFromPoint(...at);
    if (there && there.closest('.cell-wrap') === cell) return at;
  }
  return false;
}"""


def _check_stats_layout(page, store, width: int) -> None:
    """The Stats tab at this width: the conversations table fits (or scrolls sideways inside
    its box on a phone), no header breaks, a long title ends with an ellipsis and shows whole
    as a tooltip, and the picker's arrow covers none of its text."""
    if not any(c["title"] == LONG_TITLE for c in store.conversations()):
        store.new_conversation(LONG_TITLE, "local", "tiny", "tiny")
    _open_stats(page)
    page.wait_for_function(
        "title => [...document.querySelectorAll('#sc-stats-conversations td')]"
        ".some((c) => c.textContent.trim() === title)", arg=LONG_TITLE)
    layout = page.evaluate(STATS_LAYOUT, LONG_TITLE)
    if width >= 1000:
        assert layout["table"] <= layout["container"], layout
    else:
        assert layout["scroller"] is not None and layout["scroller"] <= layout["container"], \
            layout
    assert layout["wrapped"] == [], f"headers broken over lines: {layout['wrapped']}"
    assert layout["cut"] and layout["ellipsis"], layout
    assert layout["pickerClear"], "the picker's dropdown arrow covers its text"
    if width >= 1000:  # a pointer: the cut title shows whole as a tooltip
        at = page.wait_for_function(CELL_UNDER_ITS_CENTRE, arg=LONG_TITLE).json_value()
        page.mouse.move(*at)
        assert page.evaluate("([x, y]) => document.elementFromPoint(x, y)"
                             ".closest('.cell-wrap').title", at) == LONG_TITLE


@pytest.mark.parametrize("size", [(1280, 800), (390, 844)])
def test_the_first_screen_and_the_stats_table_fit_laptop_and_phone_sizes(served, size, tmp_path):
    sync_playwright = _sync_playwright()
    url, store = served
    width, height = size
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(url)
            page.wait_for_selector("#sc-input textarea", timeout=WAIT_MS)
            page.screenshot(path=str(tmp_path / f"first-screen-{width}.png"))
            box = page.locator("#sc-input textarea").bounding_box()
            assert box["y"] + box["height"] <= height, f"message box below the fold: {box}"
            assert box["width"] >= min(600, width * 0.7), f"message box too narrow: {box}"
            if width >= 1000:  # on a laptop the examples are on the first screen too
                chips = page.locator("#sc-examples .gallery-item")
                last = chips.nth(chips.count() - 1).bounding_box()
                assert last["y"] + last["height"] <= height, f"examples below the fold: {last}"
            # Each example chip is one line: whole, or ending with an ellipsis.
            assert page.evaluate(CHIPS_CUT_SILENTLY) == []
            # nothing wider than the screen: no sideways scrolling on a phone
            assert page.evaluate("document.documentElement.scrollWidth") <= width
            # Tab from the top reaches the message box in a bounded number of stops
            page.locator("body").click(position={"x": 1, "y": 1})
            for stops in range(1, 60):
                page.keyboard.press("Tab")
                if page.evaluate("document.activeElement?.closest('#sc-input') !== null"):
                    break
            assert stops < 40, f"{stops} tab stops before the message box"

            _check_stats_layout(page, store, width)
        finally:
            browser.close()


# Counts the animation frames the page asks of the browser: installed before any of the page's
# own scripts, so it sees the calls that reach the browser's requestAnimationFrame.
COUNT_FRAMES = """(() => {
  const frame = window.requestAnimationFrame.bind(window);
  window.__frames = 0;
  window.requestAnimationFrame = (callback) => { window.__frames++; return frame(callback); };
})()"""


def test_an_idle_page_asks_for_no_animation_frames(served):
    """gradio's status trackers tick by animation frame while a status is pending, and an idle
    page keeps one pending: 60 frames a second of the browser's work that the engine's cores
    pay for (head.FRAMES_SCRIPT sends those ticks to a timer). Once the page has settled it
    asks for none; a chat's reply still streams and ends."""
    sync_playwright = _sync_playwright()
    url, _ = served
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(WAIT_MS)
            page.add_init_script(COUNT_FRAMES)
            page.goto(url)
            page.wait_for_selector("#sc-status .sc-status-ready")
            _settled(page)
            for _ in range(15):  # the page's entrance transitions run for a few seconds
                page.evaluate("window.__frames = 0")
                time.sleep(1.0)
                if page.evaluate("window.__frames") <= 2:
                    break
            page.evaluate("window.__frames = 0")
            time.sleep(2.0)
            frames = page.evaluate("window.__frames")
            assert frames <= 6, f"an idle page asked for {frames} animation frames in 2 s"
            page.locator("#sc-input textarea").fill("the cat sat")
            page.click("#sc-send")
            # (attached: once the reply ends its tokens view is a click away, out of sight)
            page.wait_for_selector("#sc-chat .sc-turn .sc-reply .tk", state="attached")
            page.wait_for_selector("#sc-chat .sc-cursor", state="detached")
        finally:
            browser.close()


# ---------------------------------------------------------------------------------------------
# A finished reply as a document: its Markdown rendered, its code copied, its tokens a click
# (or a key) away, and nothing the model wrote run or fetched.

MARKDOWN_REPLY = ("## Results\n\n| drafter | speedup | note |\n|---|---:|---|\n"
                  "| ngram | 2.10× | copies the prompt |\n"
                  "| model | 1.40× | a_rather_long_cell_that_makes_the_table_wider_than_a_phone |\n\n"
                  "```python\nprint('hello')\n```\n\nDone: **yes**, see `k`.\n")


def _reply_reads(monkeypatch, text: str) -> None:
    """The served engine's replies read `text`: the real stream's token kinds, steps and stats,
    its tokens' texts replaced by `text` three characters at a time (what is left on a last
    token). The tiny random model writes random bytes; this is a reply with known Markdown."""
    import dataclasses

    from specchat.core.events import GenerationStats, TokenEvent

    real = Engine.stream

    def stream(self, *args, **kwargs):
        rest, last = text, None
        for event in real(self, *args, **kwargs):
            if isinstance(event, TokenEvent):
                piece, rest = rest[:3], rest[3:]
                event = last = dataclasses.replace(event, text=piece)
            elif isinstance(event, GenerationStats) and rest and last is not None:
                yield dataclasses.replace(last, text=rest)
                rest = ""
            yield event

    monkeypatch.setattr(Engine, "stream", stream)


def _send(page, text: str, replies: int) -> None:
    """Send a message; wait until `replies` replies have ended."""
    box = page.locator("#sc-input textarea")
    box.fill(text)
    box.press("Enter")
    page.wait_for_function(f"document.querySelectorAll('#sc-chat .sc-stats').length >= {replies}"
                           " && !document.querySelector('#sc-chat .sc-cursor')")


def test_a_finished_reply_renders_as_markdown_with_copy_and_a_keyboard_toggle(
        served, monkeypatch, tmp_path):
    sync_playwright = _sync_playwright()
    url, _ = served
    _reply_reads(monkeypatch, MARKDOWN_REPLY)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 800},
                                          permissions=["clipboard-read", "clipboard-write"])
            page = context.new_page()
            page.set_default_timeout(WAIT_MS)
            page.goto(url)
            page.wait_for_selector("#sc-status .sc-status-ready")
            _send(page, "a table, please", 1)
            turn = page.locator("#sc-chat .sc-turn.sc-has-views").first
            doc = turn.locator(".sc-md")
            doc.locator("table").wait_for()
            # A document: a heading, a table, a highlighted code block, bold, inline code; no
            # Markdown syntax left over.
            assert doc.locator("h2").inner_text() == "Results"
            assert doc.locator("td").all_inner_texts()[:3] == ["ngram", "2.10×",
                                                               "copies the prompt"]
            assert doc.locator("pre code .hl-nb").inner_text() == "print"
            assert doc.locator("strong").inner_text() == "yes"
            assert doc.locator(":not(pre) > code").inner_text() == "k"
            shown = doc.inner_text()
            assert "```" not in shown and "|---" not in shown and "**" not in shown
            assert not turn.locator(".sc-tokens-view").is_visible()
            assert turn.locator(".sc-stats").is_visible()

            # Copy: the block's code reaches the clipboard, and the button says so.
            turn.locator(".sc-md-copy").click()
            page.wait_for_function("document.querySelector('#sc-chat .sc-md-copy')"
                                   ".textContent === 'Copied'")
            assert page.evaluate("navigator.clipboard.readText()") == "print('hello')"

            # The switch by keyboard: Tab from Formatted to Tokens, Space shows the tokens (the
            # stats line stays), Shift+Tab and Enter show the document again.
            formatted, tokens = turn.locator(".sc-view-md"), turn.locator(".sc-view-tk")
            assert formatted.get_attribute("aria-pressed") == "true"
            assert tokens.get_attribute("aria-pressed") == "false"
            formatted.focus()
            page.keyboard.press("Tab")
            assert tokens.evaluate("b => b === document.activeElement")
            page.keyboard.press("Space")
            turn.locator(".sc-tokens-view .tk").first.wait_for()
            assert not doc.is_visible() and turn.locator(".sc-stats").is_visible()
            assert tokens.get_attribute("aria-pressed") == "true"
            assert formatted.get_attribute("aria-pressed") == "false"
            kinds = _kinds(page, "#sc-chat .sc-tokens-view span.tk")
            assert len(set(kinds)) >= 2, kinds  # the colored spans, as the reply streamed
            assert "| ngram | 2.10× |" in turn.locator(".sc-tokens-view").inner_text()
            # the choice survives the chat's repaint when the next reply comes
            _send(page, "and again", 2)
            assert turn.locator(".sc-tokens-view").is_visible() and not doc.is_visible()
            assert tokens.get_attribute("aria-pressed") == "true"
            page.keyboard.press("Shift+Tab") if tokens.evaluate(
                "b => b === document.activeElement") else formatted.focus()
            if not formatted.evaluate("b => b === document.activeElement"):
                formatted.focus()
            page.keyboard.press("Enter")
            doc.locator("table").wait_for()
            assert not turn.locator(".sc-tokens-view").is_visible()
            assert formatted.get_attribute("aria-pressed") == "true"
            # the second reply shows formatted, on its own
            second = page.locator("#sc-chat .sc-turn.sc-has-views").nth(1)
            assert second.locator(".sc-md table").is_visible()

            # Light and dark, laptop and phone: the wide table scrolls inside its box, never
            # the page.
            for theme in ("light", "dark"):
                page.goto(f"{url}?__theme={theme}")
                page.wait_for_selector("#sc-status .sc-status-ready")
                for width, height in ((1280, 800), (390, 844)):
                    page.set_viewport_size({"width": width, "height": height})
                    _send(page, "a table, please", 1)
                    table = page.locator("#sc-chat .sc-md table").first
                    table.scroll_into_view_if_needed()
                    page.screenshot(path=str(tmp_path / f"markdown-{theme}-{width}.png"))
                    assert page.evaluate("document.documentElement.scrollWidth") <= width
                    box = page.locator("#sc-chat .sc-md-table").first.bounding_box()
                    assert box["x"] + box["width"] <= width
                    page.locator("#sc-new").click()
                    page.wait_for_function("!document.querySelector('#sc-chat .sc-turn')")
        finally:
            browser.close()


def test_a_hostile_reply_runs_no_script_and_fetches_no_image(served, monkeypatch):
    sync_playwright = _sync_playwright()
    url, _ = served
    hits = []

    class Counter(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            hits.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    trap = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Counter)
    threading.Thread(target=trap.serve_forever, daemon=True).start()
    port = trap.server_address[1]
    hostile = (f"<script>window.__pwned = 1</script>\n\n"
               f"<img src=x onerror=\"window.__pwned = 2\">\n\n"
               f"![cat](http://127.0.0.1:{port}/cat.png)\n\n"
               f"[run me](javascript:window.__pwned=3) [data](data:text/html,hi)\n\n"
               f"<iframe src=\"http://127.0.0.1:{port}/frame\"></iframe>\n\n"
               f"```\"><img src=\"http://127.0.0.1:{port}/fence.png\" onerror=window.__pwned=4>\n"
               f"code\n```\n\n"
               f"[t](https://example.com \"x\\\" onmouseover=\\\"window.__pwned=5\")\n")
    _reply_reads(monkeypatch, hostile)
    inert = f"""() => {{
      const views = [...document.querySelectorAll('#sc-chat .sc-turn, #sc-stats-history .sc-turn')];
      return {{
        pwned: window.__pwned,
        elements: views.flatMap(v => [...v.querySelectorAll('img, iframe, script, svg, form')])
                       .map(e => e.outerHTML),
        links: views.flatMap(v => [...v.querySelectorAll('a')]).map(a => [a.href, a.rel]),
        handlers: views.flatMap(v => [...v.querySelectorAll('*')]).flatMap(
          e => [...e.attributes].map(a => a.name).filter(n => n.startsWith('on'))),
      }};
    }}"""
    dialogs = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 800})
                page.set_default_timeout(WAIT_MS)
                page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
                page.goto(url)
                page.wait_for_selector("#sc-status .sc-status-ready")
                _send(page, "something hostile", 1)
                doc = page.locator("#sc-chat .sc-md").first
                doc.wait_for()
                text = doc.inner_text()
                assert "<script>window.__pwned = 1</script>" in text  # shown as text
                assert "[run me](javascript:window.__pwned=3)" in text
                assert "[image: cat]" in text
                doc.get_by_text("run me").click()  # text, not a link: nothing happens
                page.locator("#sc-chat .sc-md a", has_text="t").first.hover()
                page.locator("#sc-chat .sc-view-tk").first.click()  # the tokens view too
                page.wait_for_timeout(1500)
                found = page.evaluate(inert)
                assert found["pwned"] is None and found["elements"] == [], found
                assert found["handlers"] == [], found
                assert found["links"] == [
                    [f"http://127.0.0.1:{port}/cat.png", "nofollow noopener noreferrer"],
                    ["https://example.com/", "nofollow noopener noreferrer"]], found["links"]

                # The Stats tab's read-only view renders the stored reply the same way.
                _open_stats(page)
                page.click("#sc-stats-picker input")
                page.get_by_role("option", name=re.compile("something hostile")).click()
                page.wait_for_function("document.querySelector('#sc-stats-history .sc-md')"
                                       "?.innerText.includes('[image: cat]')")
                assert "[image: cat]" in page.inner_text("#sc-stats-history .sc-md")
                page.wait_for_timeout(1000)
                found = page.evaluate(inert)
                assert found["pwned"] is None and found["elements"] == [], found
                assert found["handlers"] == [], found
            finally:
                browser.close()
    finally:
        trap.shutdown()
    assert hits == [] and dialogs == []  # no image, frame or script reached the trap
