"""Markdown rendering of finished answers, the thinking split, and the message widget's actions."""

from __future__ import annotations

from PySide6.QtGui import QColor, QGuiApplication, QImage

from app.chat_view import MessageWidget, format_stats
from app.history import Message
from app.markdown_render import MarkdownRenderer, split_thinking


def test_raw_html_is_shown_as_text_never_interpreted():
    html = MarkdownRenderer().render("<b>hi</b> <script>alert(1)</script> <img src=x onerror=y>").html
    assert "<b>" not in html and "<script" not in html and "<img" not in html
    assert "&lt;script&gt;" in html


def test_code_blocks_are_highlighted_and_copyable():
    rendered = MarkdownRenderer().render("Text\n\n```python\ndef f():\n    return 1\n```\n\n```\nplain <x>\n```\n")
    assert rendered.code_blocks == ("def f():\n    return 1\n", "plain <x>\n")
    assert 'href="copy-code:0"' in rendered.html and 'href="copy-code:1"' in rendered.html
    assert "style=\"color:" in rendered.html and "&lt;x&gt;" in rendered.html
    dark = MarkdownRenderer(dark=True).render("```nosuchlang\nx\n```").html
    assert "#272822" in dark and "x" in dark


def test_tables_get_borders():
    assert '<table border="1"' in MarkdownRenderer().render("| a | b |\n|---|---|\n| 1 | 2 |\n").html


def test_split_thinking():
    assert split_thinking("<think>\nplan\n</think>\n\nAnswer", False) == ("plan", "Answer", False)
    assert split_thinking("plan so far", True) == ("plan so far", "", True)
    assert split_thinking("<think>plan", False) == ("plan", "", True)
    assert split_thinking("just text", False) == ("", "just text", False)


def test_format_stats():
    line = format_stats({"ttft_ms": 123.4, "prefill_tok_s": 850.0, "decode_tok_s": 23.15, "generated_tokens": 40,
                         "reused_tokens": 412, "prompt_tokens": 500})
    assert line == ("TTFT 123 ms \u00b7 prefill 850 tok/s \u00b7 decode 23.1 tok/s \u00b7 40 tokens"
                    " \u00b7 412 of 500 prompt tokens reused")
    assert format_stats({}) == ""


def test_message_widget_copy_thumbnails_and_code_link(qtbot, tmp_path):
    image = QImage(200, 100, QImage.Format_RGB32)
    image.fill(QColor("green"))
    image.save(str(tmp_path / "g.png"))
    user = MessageWidget(Message(1, 1, None, "user", "look", 0.0, images=(str(tmp_path / "g.png"), "/gone.png")),
                         MarkdownRenderer(), [1])
    qtbot.addWidget(user)
    thumbs = [w for w in user.findChildren(type(user.stats_label)) if w.accessibleName() == "Attached image"]
    assert thumbs[0].pixmap().width() == 96 and "missing image" in thumbs[1].text()
    answer = MessageWidget(Message(2, 1, 1, "assistant", "<think>x</think>Run `ls`:\n\n```sh\nls -la\n```", 0.0,
                                   stats={"thinking_s": 3.2}), MarkdownRenderer(), [2])
    qtbot.addWidget(answer)
    assert answer.thinking_button.text() == "Thought for 3.2 s"
    answer.copy_button.click()
    assert QGuiApplication.clipboard().text() == "Run `ls`:\n\n```sh\nls -la\n```"
    answer.body.link_clicked.emit("copy-code:0")
    assert QGuiApplication.clipboard().text() == "ls -la\n"
