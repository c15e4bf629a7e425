"""A finished reply as a document: its text rendered as Markdown on the server, safely.

The model's text is untrusted. markdown-it-py parses it with raw HTML off, so every `<tag>` the
model wrote stays text (escaped), and the rules below decide every element the output holds:

- links: only http, https and mailto targets become anchors (opening in a new tab, with
  rel="nofollow noopener noreferrer"); any other target (javascript:, data:, vbscript:, file:,
  a relative path) fails markdown-it's link check, so the link stays text as written;
- images are never fetched: an image becomes an anchor reading "[image: alt]" that the reader
  may click, never an <img>;
- fenced and indented code: a block with its language, a Copy button (assets/markdown.js) and
  Pygments' highlighting as classes (`hl-*`, colored by assets/markdown.css), never inline
  styles; a language Pygments does not know is shown unhighlighted;
- tables scroll sideways inside their own box on a narrow screen.

Nothing here uses the class `tk`: token spans belong to the tokens view (ui/render.py).
"""

from __future__ import annotations

import html

from markdown_it import MarkdownIt
from markdown_it.common.utils import unescapeAll
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound

LINK_SCHEMES = ("http://", "https://", "mailto:")
LINK_REL = "nofollow noopener noreferrer"
# Past this many characters a code block is shown unhighlighted: a lexer's time grows with its
# input, and a reply is rendered on the server's thread.
HIGHLIGHT_MAX_CHARS = 40_000

_FORMATTER = HtmlFormatter(nowrap=True, classprefix="hl-")


def safe_link(url: str) -> bool:
    """Whether a link's (normalized) target may become an anchor: http, https, mailto only."""
    return url.strip().lower().startswith(LINK_SCHEMES)


def highlighted(code: str, lang: str) -> str:
    """`code` as HTML: Pygments' spans for a language it knows by that name, else escaped."""
    if lang and len(code) <= HIGHLIGHT_MAX_CHARS:
        try:
            lexer = get_lexer_by_name(lang, stripnl=False, ensurenl=False)
        except ClassNotFound:
            lexer = None
        if lexer is not None:
            return highlight(code, lexer, _FORMATTER).rstrip("\n")  # (the lexer ends with a newline)
    return html.escape(code, quote=False)


def code_block(code: str, lang: str = "") -> str:
    """A code block: a bar with its language and a Copy button, then the code."""
    code = code[:-1] if code.endswith("\n") else code
    label = html.escape(lang, quote=True)
    name = f'<span class="sc-md-lang">{label}</span>' if lang else \
        '<span class="sc-md-lang sc-md-lang-none">code</span>'
    # role="status": the button's "Copied" is also said to a screen reader
    return (f'<div class="sc-md-code"><div class="sc-md-code-bar">{name}'
            '<button type="button" class="sc-md-copy" title="Copy this code">Copy</button>'
            '<span class="sc-md-said" role="status"></span></div>'
            f'<pre class="sc-md-pre"><code class="sc-hl">{highlighted(code, lang)}</code></pre>'
            "</div>")


def _fence(renderer, tokens, idx, options, env) -> str:
    token = tokens[idx]
    info = unescapeAll(token.info).strip() if token.info else ""
    return code_block(token.content, info.split(maxsplit=1)[0] if info else "")


def _code_block(renderer, tokens, idx, options, env) -> str:
    return code_block(tokens[idx].content)


def _link_open(renderer, tokens, idx, options, env) -> str:
    # Only links that passed `safe_link` reach here: markdown-it leaves the others as text.
    token = tokens[idx]
    href = html.escape(token.attrGet("href") or "", quote=True)
    title = token.attrGet("title")
    title = f' title="{html.escape(title, quote=True)}"' if title else ""
    return f'<a class="sc-md-link" href="{href}"{title} rel="{LINK_REL}" target="_blank">'


def _image(renderer, tokens, idx, options, env) -> str:
    token = tokens[idx]
    text = renderer.renderInlineAsText(token.children, options, env) if token.children else ""
    alt = html.escape(text or "image", quote=False)
    src = token.attrGet("src") or ""
    # An anchor to the image, not the image: nothing is fetched unless the reader clicks.
    return (f'<a class="sc-md-link sc-md-image" href="{html.escape(src, quote=True)}" '
            f'title="{html.escape(src, quote=True)}" rel="{LINK_REL}" target="_blank">'
            f"[image: {alt}]</a>")


def _table_open(renderer, tokens, idx, options, env) -> str:
    return '<div class="sc-md-table"><table>'


def _table_close(renderer, tokens, idx, options, env) -> str:
    return "</table></div>"


def _parser() -> MarkdownIt:
    # commonmark with GFM's tables and strikethrough; raw HTML off; a single newline is a line
    # break (a model's lines stay lines, as in the tokens view); no typographer, no linkify:
    # the text stays what the model wrote.
    md = MarkdownIt("commonmark", {"html": False, "breaks": True, "linkify": False,
                                   "typographer": False})
    md.enable(["table", "strikethrough"])
    md.validateLink = safe_link
    # (markdown-it binds each rule to its renderer: the rule's first argument)
    for name, rule in (("fence", _fence), ("code_block", _code_block),
                       ("link_open", _link_open), ("image", _image),
                       ("table_open", _table_open), ("table_close", _table_close)):
        md.add_render_rule(name, rule)
    return md


_MD = _parser()


def markdown_html(text: str) -> str:
    """A reply's text as the formatted view's HTML (`<div class="sc-md">…</div>`)."""
    return f'<div class="sc-md">{_MD.render(text)}</div>'
