"""Exporting a conversation to a file and importing one, on the history thread.

A Markdown export is portable: the images its messages hold are copied into a folder beside the file
(``NAME_images/``) and linked by relative paths, so the file and that folder can be moved or sent
together. A JSON export keeps every branch and names the images by their stored paths.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from urllib.parse import unquote, urlparse

from .history import HistoryStore

_IMAGE_LINK = re.compile(r"!\[image\]\((file://[^)\s]+)\)")


def export_conversation(store: HistoryStore, conversation_id: int, path: Path, kind: str) -> None:
    """Write a conversation to ``path``: "md" (active branch, images copied beside it) or "json" (every branch).

    Raises:
        OSError: the file or the image folder cannot be written.
    """
    if kind == "md":
        path.write_text(portable_markdown(store.export_markdown(conversation_id), path), encoding="utf-8")
    else:
        path.write_text(json.dumps(store.export_json(conversation_id), ensure_ascii=False, indent=1),
                        encoding="utf-8")


def portable_markdown(text: str, path: Path) -> str:
    """``text`` with each ``file:`` image link replaced by a copy in ``PATH-STEM_images/`` beside ``path``,
    linked relatively; an image file that is gone is left as a note ("image missing: NAME")."""
    folder = path.with_name(path.stem + "_images")

    def copy(match: re.Match) -> str:
        source = Path(unquote(urlparse(match.group(1)).path))
        if not source.is_file():
            return f"*(image missing: {source.name})*"
        folder.mkdir(exist_ok=True)
        target = folder / source.name
        if not target.exists():
            shutil.copyfile(source, target)
        return f"![image]({folder.name}/{target.name})"

    return _IMAGE_LINK.sub(copy, text)


def import_conversation(store: HistoryStore, path: Path) -> int:
    """Add the conversation of a JSON export file; returns its id."""
    return store.import_json(json.loads(path.read_text(encoding="utf-8")))
