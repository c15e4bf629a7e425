"""Accessibility of the page in real headless Chromium: axe-core's WCAG 2 A and AA rules find
nothing serious or critical (contrast of every token kind, ghost, button, radio, help text,
chip and placeholder among them) on the chat with a step card open, the race's runs and results,
the Stats tab, in the light and the dark theme; and the chat tab's controls are all reached
with the Tab key, the step inspector opened from the keyboard.

axe-core's script comes from the axe-playwright-python package (requirements.txt), which ships
it as a file: it is injected into the page as is, no wrapper API used.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from test_browser import (  # noqa: F401 (`served`: a fixture, used by its name)
    CHROMIUM,
    CHROMIUM_ARGS,
    WAIT_MS,
    _settled,
    _sync_playwright,
    served,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|copy keyword)")


def _axe_script() -> Path:
    spec = importlib.util.find_spec("axe_playwright_python")
    path = Path(spec.origin).parent / "axe.min.js" if spec and spec.origin else None
    if path is None or not path.exists():
        reason = "the accessibility test needs axe-core (pip install -r requirements.txt)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must run it, not skip it")
        pytest.skip(reason)
    return path


# axe.run over the whole document, WCAG 2 A and AA: the violations of serious or critical
# impact, each with its nodes' selectors and axe's own account of what fails (for contrast:
# the colors and the ratio it measured).
RUN_AXE = """async () => {
  const result = await axe.run(document, {runOnly: {type: 'tag', values: ['wcag2a', 'wcag2aa']},
                                          resultTypes: ['violations']});
  return result.violations.filter((v) => ['serious', 'critical'].includes(v.impact))
    .map((v) => ({id: v.id, impact: v.impact, help: v.help,
                  nodes: v.nodes.map((n) => ({target: n.target.join(' '),
                                              html: n.html.slice(0, 160),
                                              message: n.failureSummary}))}));
}"""


def _axe(page, axe: Path, where: str) -> list[str]:
    """The serious and critical violations on the page as it is, one readable line a node."""
    if not page.evaluate("typeof window.axe !== 'undefined'"):
        page.add_script_tag(path=str(axe))
    found = []
    for v in page.evaluate(RUN_AXE):
        for n in v["nodes"]:
            message = " ".join(n["message"].split())
            found.append(f"[{where}] {v['id']} ({v['impact']}: {v['help']}): {n['target']} "
                         f":: {message} :: {n['html']}")
    return found


def _new_page(browser, theme: str, width: int = 1280, height: int = 800):
    context = browser.new_context(viewport={"width": width, "height": height},
                                  color_scheme=theme)
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    return page


def _open(page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("#sc-status .sc-status-ready")
    _settled(page)


def _reply(page, text: str) -> None:
    """Send a message; wait until every reply in the chat has ended."""
    before = page.locator("#sc-chat .sc-stats").count()
    box = page.locator("#sc-input textarea")
    box.fill(text)
    box.press("Enter")
    page.wait_for_function(
        f"document.querySelectorAll('#sc-chat .sc-stats').length > {before}"
        " && !document.querySelector('#sc-chat .sc-cursor')")
    _settled(page)


def _show_tokens(page) -> None:
    """The first finished reply's tokens view, where its colored tokens and ghosts show (a
    finished reply shows formatted first)."""
    switch = page.locator("#sc-chat .sc-view-tk")
    if switch.count():
        switch.first.click()


def _no_sideways_scroll(page, width: int) -> None:
    wide = page.evaluate("document.documentElement.scrollWidth")
    assert wide <= width, f"at {width} px the page is {wide} px wide: it scrolls sideways"


SHOW_SERVED = ".sc-legend-served { display: inline !important; }"


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_axe_finds_no_serious_violation_in_either_theme(served, theme, tmp_path):
    sync_playwright = _sync_playwright()
    axe = _axe_script()
    url, _ = served
    found = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = _new_page(browser, theme)
            _open(page, url)
            dark = page.evaluate("document.body.classList.contains('dark') || "
                                 "document.documentElement.classList.contains('dark')")
            assert dark == (theme == "dark"), "the page does not follow the color scheme"
            # The legend's `served` entry shows only beside a served token (a serving engine's
            # backend, not this one): shown here, so its colors are checked too.
            page.add_style_tag(content=SHOW_SERVED)

            # The chat after one reply, its tokens view shown and a step card open.
            _reply(page, "the cat sat on the mat. the cat sat on the mat. the cat")
            _show_tokens(page)
            page.locator("#sc-chat .tk.sc-step").first.click()
            page.wait_for_selector("#sc-chat .sc-card:not([hidden])")
            page.screenshot(path=str(tmp_path / f"chat-{theme}.png"))
            found += _axe(page, axe, "chat")

            # The race's runs and results.
            page.click("#sc-race")
            page.wait_for_selector("#sc-race-verdict .sc-race-grid")
            _settled(page)
            found += _axe(page, axe, "race")
            page.screenshot(path=str(tmp_path / f"race-{theme}.png"), full_page=True)
            _no_sideways_scroll(page, 1280)

            # The Stats tab with the conversation picked: its tables, charts and replay.
            page.get_by_role("tab", name="Stats").click()
            page.wait_for_selector("#sc-stats-history .sc-turn")
            page.wait_for_selector("#sc-stats-speedup :is(canvas, svg)")
            _settled(page)
            page.screenshot(path=str(tmp_path / f"stats-{theme}.png"), full_page=True)
            found += _axe(page, axe, "Stats")
            page.context.close()

            # A phone: the reply with its tokens and the race, in the width.
            page = _new_page(browser, theme, 390, 844)
            _open(page, url)
            page.add_style_tag(content=SHOW_SERVED)
            _reply(page, "the cat sat on the mat. the cat sat on the mat. the cat")
            _show_tokens(page)
            page.click("#sc-race")
            page.wait_for_selector("#sc-race-verdict .sc-race-grid")
            _settled(page)
            page.screenshot(path=str(tmp_path / f"phone-{theme}.png"), full_page=True)
            _no_sideways_scroll(page, 390)
            found += _axe(page, axe, "phone")
        finally:
            browser.close()
    assert not found, f"{len(found)} serious/critical axe violations ({theme}):\n" + \
        "\n".join(found)


# ---------------------------------------------------------------------------------------------
# The keyboard alone

# Every control of the chat tab a visitor acts on, as a name and a selector; each must exist.
CHAT_CONTROLS = {
    "message box": "#sc-input textarea",
    "Send": "#sc-send",
    "Stop": "#sc-stop",
    "examples": "#sc-examples button",
    "Retry": "#sc-retry",
    "Undo": "#sc-undo",
    "New conversation": "#sc-new",
    "Race drafters": "#sc-race",
    "Mode": "#sc-mode input[type=radio]",
    "Samplers": "#sc-samplers input[type=radio]",
    "Show refused drafts": "#sc-ghosts input",
    "Speculative decoding": "#sc-speculation input",
    "Drafter": "#sc-drafter input[type=radio]",
    "sliders": "#sc-settings input[type=range]",
    "slider numbers": "#sc-settings input[type=number]",
    "System prompt": "#sc-settings textarea",
    "accordion headers": "#sc-settings button.label-wrap",
}

# The chat tab's focusable controls as shown now, tagged with their number (`data-a11y`): every
# visible, enabled one; radios of one group (one name) count once, as Tab enters a group at one
# radio and the arrows move within it. -> [(number, a description)]
TAG_CONTROLS = """(names) => {
  const panel = document.querySelector('#sc-input').closest('[role=tabpanel]') || document.body;
  const focusable = 'a[href], button, input, textarea, select, summary, [tabindex]';
  const out = [];
  const groups = new Map();
  for (const el of panel.querySelectorAll(focusable)) {
    if (el.disabled || el.tabIndex < 0 || !el.checkVisibility({visibilityProperty: true})) continue;
    if (el.closest('[inert]')) continue;
    let id = out.length;
    if (el.type === 'radio' && el.name) {
      if (groups.has(el.name)) id = groups.get(el.name);
      else groups.set(el.name, id);
    }
    el.dataset.a11y = String(id);
    if (id === out.length) {
      const what = Object.entries(names).find(([, sel]) => el.matches(sel));
      const label = (el.getAttribute('aria-label') || el.textContent || el.placeholder
                     || el.closest('label')?.textContent || '').trim().slice(0, 40);
      out.push([id, `${what ? what[0] : el.tagName.toLowerCase()}: ${label}`]);
    }
  }
  return out;
}"""

FOCUSED = """() => {
  const el = document.activeElement;
  return el && el.dataset.a11y !== undefined ? Number(el.dataset.a11y) : -1;
}"""


def test_every_chat_control_is_reached_by_tab_and_the_inspector_opens_by_keyboard(served):
    sync_playwright = _sync_playwright()
    url, _ = served
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = _new_page(browser, "light")
            _open(page, url)
            _reply(page, "the cat sat on the mat. the cat sat on the mat. the cat")
            for name, selector in CHAT_CONTROLS.items():
                assert page.locator(selector).count(), f"no {name} ({selector}) on the page"
            controls = dict(page.evaluate(TAG_CONTROLS, CHAT_CONTROLS))
            named = {name for name, selector in CHAT_CONTROLS.items()
                     if any(d.startswith(f"{name}:") for d in controls.values())}
            assert named == set(CHAT_CONTROLS), \
                f"controls not visible: {sorted(set(CHAT_CONTROLS) - named)}"

            # Tab from the top of the page until the focus has gone round once.
            page.locator("body").click(position={"x": 1, "y": 1})
            reached, trail = set(), []
            for _ in range(400):
                page.keyboard.press("Tab")
                at = page.evaluate("() => { const e = document.activeElement; return e === "
                                   "document.body ? 'body' : e.outerHTML.slice(0, 60); }")
                if trail and at == trail[0]:
                    break
                trail.append(at)
                reached.add(page.evaluate(FOCUSED))
                if reached >= set(controls):
                    break
            missed = [controls[i] for i in sorted(set(controls) - reached)]
            assert not missed, f"never focused by Tab: {json.dumps(missed, ensure_ascii=False)}"

            # The step inspector by keyboard: Tab to the reply's Tokens switch, Enter; back to
            # the reply's one token stop, Enter opens its step card, Escape closes it.
            page.locator("body").click(position={"x": 1, "y": 1})
            on = "(sel) => document.activeElement?.matches(sel) ?? false"
            switch = "#sc-chat .sc-view-tk"
            if page.locator(switch).count():
                for _ in range(200):
                    page.keyboard.press("Tab")
                    if page.evaluate(on, switch):
                        break
                assert page.evaluate(on, switch), "Tab never reached the reply's Tokens switch"
                page.keyboard.press("Enter")
                page.locator("#sc-chat .sc-tokens-view .tk").first.wait_for()
                for _ in range(20):
                    page.keyboard.press("Shift+Tab")
                    if page.evaluate(on, "#sc-chat .tk.sc-step"):
                        break
            else:
                for _ in range(200):
                    page.keyboard.press("Tab")
                    if page.evaluate(on, "#sc-chat .tk.sc-step"):
                        break
            assert page.evaluate(on, "#sc-chat .tk.sc-step"), "no token of the reply takes focus"
            page.keyboard.press("Enter")
            page.wait_for_selector("#sc-chat .sc-card:not([hidden])", timeout=5_000)
            page.keyboard.press("Escape")
            page.wait_for_selector("#sc-chat .sc-card:not([hidden])", state="detached",
                                   timeout=5_000)
        finally:
            browser.close()
