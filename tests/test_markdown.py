"""A finished reply's formatted view (specchat/ui/markdown.py): each Markdown construct renders,
and nothing the model writes becomes markup of its own: no script, no image, no event handler,
no link to anything but http, https or mailto. The tokens view stays in the message."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest

from specchat.core.events import ACCEPTED, BONUS, TARGET, GenerationStats, StepRecord, TokenEvent
from specchat.ui.markdown import LINK_REL, code_block, markdown_html, safe_link
from specchat.ui.render import render_turn
from specchat.ui.state import Turn


class Elements(HTMLParser):
    """Every start tag of some HTML, as (tag, {attribute: value}), and its text."""

    def __init__(self, markup: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.text = ""
        self.feed(markup)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    handle_startendtag = handle_starttag

    def handle_data(self, data):
        self.text += data

    def named(self, tag: str) -> list[dict]:
        return [attrs for t, attrs in self.tags if t == tag]


def assert_inert(markup: str) -> Elements:
    """No element of the model's making: only the renderer's own tags, no event handler, no
    inline script, every link http(s) or mailto."""
    assert "<script" not in markup.lower() and "<img" not in markup.lower()
    found = Elements(markup)
    allowed = {"div", "p", "br", "h1", "h2", "h3", "h4", "h5", "h6", "ul", "ol", "li",
               "blockquote", "strong", "em", "s", "code", "pre", "span", "a", "button", "table",
               "thead", "tbody", "tr", "th", "td", "hr"}
    assert {t for t, _ in found.tags} <= allowed, {t for t, _ in found.tags} - allowed
    for tag, attrs in found.tags:
        assert not [a for a in attrs if a.startswith("on")], (tag, attrs)
        assert set(attrs) <= {"class", "href", "title", "rel", "target", "type", "role",
                              "style", "aria-pressed", "tabindex"}, (tag, attrs)
        if "style" in attrs:  # markdown-it's own, for a table column's alignment
            assert tag in ("th", "td") and attrs["style"].startswith("text-align:"), attrs
    for a in found.named("a"):
        assert a["href"].lower().startswith(("http://", "https://", "mailto:")), a
        assert a["rel"] == LINK_REL and a["target"] == "_blank"
    return found


def test_each_construct_renders():
    out = markdown_html(
        "# Title\n## Part\n\nSome **bold**, *em*, `a<b`, ~~gone~~.\n\n- one\n- two\n\n"
        "1. first\n2. second\n\n> quoted\n\n| a | b |\n|:--|--:|\n| 1 | `2` |\n\n"
        "```python\ndef f(x):\n    return x  # done\n```\n\n    indented code\n\n"
        "[docs](https://example.com/a?b=1&c=2 \"the docs\") <https://example.org> "
        "[mail](mailto:me@example.com)\n")
    found = assert_inert(out)
    for tag in ("h1", "h2", "strong", "em", "s", "ul", "ol", "li", "blockquote", "table",
                "th", "td", "pre", "code"):
        assert found.named(tag), tag
    assert "<code>a&lt;b</code>" in out  # inline code, escaped
    # the fence: its language, a Copy button, Pygments' classes (no inline style)
    assert '<span class="sc-md-lang">python</span>' in out
    assert out.count('<button type="button" class="sc-md-copy"') == 2  # the fence, the indented
    assert '<span class="hl-k">def</span>' in out and '<span class="hl-c1"># done</span>' in out
    assert '<div class="sc-md-table"><table>' in out  # scrolls in its own box
    hrefs = [a["href"] for a in found.named("a")]
    assert hrefs == ["https://example.com/a?b=1&c=2", "https://example.org",
                     "mailto:me@example.com"]
    assert found.named("a")[0]["title"] == "the docs"
    # nothing is a token span: those belong to the tokens view
    assert not [t for t, a in found.tags if "tk" in (a.get("class") or "").split()]


def test_a_code_block_of_an_unknown_language_is_shown_escaped():
    out = code_block("<b>x</b>\n", "no-such-language")
    assert "&lt;b&gt;x&lt;/b&gt;" in out and "hl-" not in out
    assert '<span class="sc-md-lang">no-such-language</span>' in out
    assert "hl-" not in code_block("x = 1\n" * 10_000, "python")  # too long to highlight


@pytest.mark.parametrize("target", [
    "javascript:alert(1)", "JaVaScRiPt:alert(1)", "&#106;avascript:alert(1)",
    "<javascript:alert(1)>", "data:text/html,<b>x</b>", "vbscript:msgbox(1)",
    "file:///etc/passwd", "/login", "#top"])
def test_a_link_to_anything_but_http_https_or_mailto_stays_text(target):
    out = markdown_html(f"[click me](<{target}>) [again]({target})\n\n[ref][1]\n\n[1]: {target}\n")
    found = assert_inert(out)
    assert found.named("a") == [] and "click me" in found.text
    assert not safe_link(target)


@pytest.mark.parametrize("text", [
    "[x](javascript:alert(1))",
    "![a](http://127.0.0.1:8999/x.png)",
    "![a](data:image/png;base64,iVBORw0KGgo=)",
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    '<iframe src="http://127.0.0.1:8999/"></iframe>',
    '<a href="javascript:alert(1)">x</a>',
    '```"><script>alert(1)</script>\ncode\n```',
    '``` onmouseover="alert(1)\ncode\n```',
    '[t](http://example.com "a\\" onmouseover=\\"alert(1)") [u](http://example.com \'b\' onclick=x\')',
    "<style>body{display:none}</style> <form action=/x><input name=pw></form>",
    "**<b onclick=alert(1)>bold</b>** `<script>` > <svg onload=alert(1)>",
])
def test_hostile_text_is_shown_as_text(text):
    out = markdown_html(text)
    found = assert_inert(out)
    assert "javascript:" not in " ".join(a.get("href", "") for _, a in found.tags)


def test_an_image_is_a_link_the_reader_may_follow_never_an_image():
    out = markdown_html('![a cat *photo*](http://127.0.0.1:8999/x.png "t")')
    found = assert_inert(out)
    assert found.named("img") == []
    (link,) = found.named("a")
    assert link["href"] == "http://127.0.0.1:8999/x.png" and "sc-md-image" in link["class"]
    assert "[image: a cat photo]" in found.text


def test_a_fence_info_string_cannot_inject_attributes():
    out = markdown_html('```"><script>alert(1)</script> x\nprint(1)\n```')
    assert_inert(out)
    assert '<span class="sc-md-lang">&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;</span>' \
        in out


def test_a_link_title_with_quotes_stays_one_attribute():
    out = markdown_html('[t](https://example.com "say \\"hi\\" onmouseover=alert(1)")')
    (link,) = assert_inert(out).named("a")
    assert link["title"] == 'say "hi" onmouseover=alert(1)'
    assert set(link) == {"class", "href", "title", "rel", "target"}


def _turn(text: str) -> Turn:
    kinds = [TARGET, ACCEPTED, ACCEPTED, BONUS]
    turn = Turn("hi")
    turn.tokens = [TokenEvent(0, text[i:i + 4], kinds[(i // 4) % 4], i // 16 + 1, 3, 2)
                   for i in range(0, len(text), 4)]
    turn.steps = [StepRecord(step=s, drafted=3, accepted=2, emitted=3, draft_s=0.0,
                             verify_s=0.0) for s in range(1, len(text) // 16 + 2)]
    turn.stats = GenerationStats(new_tokens=len(turn.tokens), tokens_per_s=12.5, speculation=True,
                                 drafted=9, accepted=6, drafter="ngram", draft_len=3)
    return turn


def test_a_finished_reply_carries_both_views_and_the_stats_line():
    text = "# Hello\n\n```js\nalert('<b>')\n```\n<script>window.__pwned = 1</script>\n"
    turn = _turn(text)
    out = render_turn(turn)
    found = Elements(out)
    # (the inspector and the stats line have tags of their own: none of them the model's)
    assert "<script" not in out and not {"script", "img", "iframe"} & {t for t, _ in found.tags}
    assert not [a for _, attrs in found.tags for a in attrs if a.startswith("on")]
    assert_inert(out[:out.index('<div class="sc-tokens-view">')])  # the formatted view
    classes = [a.get("class", "") for _, a in found.tags]
    assert f"sc-turn sc-turn-{turn.key} sc-has-views" in classes
    # the formatted view first, then the tokens view exactly as the streaming reply showed it
    assert out.index('<div class="sc-md">') < out.index('<div class="sc-tokens-view">')
    spans = [c for c in classes if c.split()[:1] == ["tk"]]
    assert len(spans) >= len(turn.tokens) and any("tk-accepted" in c for c in spans)
    assert "sc-step sc-step-1" in " ".join(spans) and "sc-card" in out  # the inspector
    # the switch: two real buttons, Formatted pressed, in the stats line (shown in both views)
    buttons = found.named("button")
    views = [b for b in buttons if "sc-view" in b["class"].split()]
    assert [(b["class"], b["aria-pressed"]) for b in views] == [
        ("sc-view sc-view-md", "true"), ("sc-view sc-view-tk", "false")]
    stats = out[out.index('<div class="sc-stats">'):]
    assert stats.index("sc-view-switch") < stats.index("tok/s")
    assert "12.5</b> tok/s" in stats
    assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in out


def test_a_streaming_reply_is_its_tokens_only():
    turn = _turn("# Hello\n\n**bold**")
    turn.stats = None
    out = render_turn(turn, streaming=True)
    assert 'class="sc-md"' not in out and "sc-view" not in out and "sc-cursor" in out
    assert "sc-has-views" not in out


def test_a_reply_of_blank_text_has_no_switch():
    turn = _turn("\n\n")
    out = render_turn(turn)
    assert "sc-view-switch" not in out and 'class="sc-md"' not in out
