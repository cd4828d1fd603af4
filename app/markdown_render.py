"""Finished answers as HTML for Qt's rich-text labels: Markdown (raw HTML off) plus Pygments colours.

Qt's rich text understands a subset of HTML and no CSS classes, so code is coloured with inline
styles and each code block sits in a one-cell table (the element whose background Qt paints),
followed by a "Copy code" link whose ``copy-code:N`` target the chat view handles.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from markdown_it import MarkdownIt
from markdown_it.token import Token
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Rendered:
    """An answer's HTML and the source of each code block, by the index its copy link names."""

    html: str
    code_blocks: tuple[str, ...]


def split_thinking(raw: str, thinking_first: bool) -> tuple[str, str, bool]:
    """Split a stored answer into ``(thinking, answer, still_thinking)``.

    The history keeps an answer as the model wrote it, one text: reasoning first, closed with
    ``</think>`` (the opening tag is usually part of the prompt). A live answer is shown from the
    engine's channels instead; this reads the stored ones. ``thinking_first`` says the turn was
    asked to think, so text with no closing tag yet is all thinking.
    """
    head, sep, tail = raw.partition(THINK_CLOSE)
    if sep:
        return head.replace(THINK_OPEN, "", 1).strip(), tail.lstrip(), False
    if thinking_first or raw.lstrip().startswith(THINK_OPEN):
        return raw.replace(THINK_OPEN, "", 1).strip(), "", True
    return "", raw, False


class MarkdownRenderer:
    """Renders Markdown with highlighted code in a light or a dark palette."""

    def __init__(self, dark: bool = False) -> None:
        self.dark = dark
        style = "monokai" if dark else "default"
        self._formatter = HtmlFormatter(style=style, noclasses=True, nowrap=True)
        self._code_bg = "#272822" if dark else "#f4f5f7"
        self._link = "#8ab4f8" if dark else "#1a5fb4"
        self._md = MarkdownIt("commonmark", {"html": False}).enable("table").enable("strikethrough")
        self._md.add_render_rule("fence", lambda _html, tokens, idx, _options, _env: self._fence(tokens[idx]))
        self._md.add_render_rule("code_block", lambda _html, tokens, idx, _options, _env: self._fence(tokens[idx]))
        self._md.add_render_rule("table_open", lambda *_: '<table border="1" cellspacing="0" cellpadding="4">\n')
        self._blocks: list[str] = []

    def _fence(self, token: Token) -> str:
        code = token.content
        lang = token.info.strip().split(" ")[0] if token.info else ""
        try:
            body = highlight(code, get_lexer_by_name(lang), self._formatter) if lang else html.escape(code)
        except ClassNotFound:
            body = html.escape(code)
        index = len(self._blocks)
        self._blocks.append(code)
        label = html.escape(lang) + " \u00b7 " if lang else ""
        return (f'<table width="100%" cellpadding="8" cellspacing="0" bgcolor="{self._code_bg}">'
                f'<tr><td><pre style="margin:0">{body.rstrip()}</pre></td></tr></table>'
                f'<p style="margin-top:2px"><small>{label}<a href="copy-code:{index}" '
                f'style="color:{self._link}">Copy code</a></small></p>')

    def render(self, text: str) -> Rendered:
        """Render Markdown ``text``; raw HTML in it is shown as text, never interpreted."""
        self._blocks = []
        body = self._md.render(text)
        return Rendered(html=body.strip(), code_blocks=tuple(self._blocks))
