"""The files ``python -m engine prune`` reads and writes, checked before any work (:mod:`engine.reap.prune`).

Guarantees: an output path is refused (never replaced) when it is empty, its folder is missing or not
writable, or it exists as anything but a regular file (folder, FIFO, device, link) or as the same file
(inode) as an input; the output is written through a temporary file created exclusively beside it
(:func:`engine.gguf.write.write`), so no existing file, an input named ``OUT.part`` included, is ever
the temporary file. Statistics and calibration files are read only when they are regular files under a
size cap, and calibration images are accepted only as regular files under :data:`MAX_IMAGE_BYTES`.
Every failure is an :class:`~engine.errors.EngineError` naming the file and what was expected.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..errors import EngineError, ModelFormatError
from ..gguf.regular import FileRefused, kind, read_regular

MAX_TEXT_BYTES = 256 << 20
"""Largest statistics or calibration file read, bytes."""
MAX_IMAGE_BYTES = 64 << 20
"""Largest calibration image file, bytes."""


def check_output(path: str, inputs: Sequence[str | os.PathLike[str] | None], what: str = "output") -> Path:
    """Check that ``path`` may be written (before any work starts); its folder is probed with a temporary file.

    Raises:
        EngineError: empty, missing or unwritable folder, an existing non-regular file, or an input's inode.
    """
    if not str(path).strip():
        raise EngineError(f"the {what} path is empty")
    out = Path(path)
    folder = out.parent
    if not folder.is_dir():
        raise EngineError(f"{out}: the folder {folder} does not exist")
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise EngineError(f"{out}: cannot check the {what} path ({exc.strerror or exc})") from exc
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise EngineError(f"{out}: the {what} exists and is {kind(st.st_mode)}; refusing to replace it")
        for src in inputs:
            if src is not None and _same_file(st, src):
                raise EngineError(f"{out}: the {what} is the input {src} (the same file); choose another path")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{out.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise EngineError(f"{out}: cannot write in {folder} ({exc.strerror or exc})") from exc
    return out


def _same_file(st: os.stat_result, other: str | os.PathLike[str]) -> bool:
    try:
        o = os.stat(other)
    except OSError:
        return False
    return (o.st_dev, o.st_ino) == (st.st_dev, st.st_ino)


def read_text(path: str | os.PathLike[str], what: str, limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes (a FIFO or device is never opened).

    Raises:
        ModelFormatError: missing, not a regular file, too large, unreadable or not UTF-8, naming the file.
    """
    try:
        data = read_regular(path, limit)
    except FileRefused as exc:
        raise ModelFormatError(f"{path}: the {what} {exc}") from None
    except OSError as exc:
        raise ModelFormatError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelFormatError(f"{path}: the {what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def check_image(path: str | os.PathLike[str], where: str) -> None:
    """Accept a calibration image only as a regular file (links followed) of at most :data:`MAX_IMAGE_BYTES`.

    Raises:
        ModelFormatError: missing, not a regular file or too large, naming ``where`` and the file.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ModelFormatError(f"{where}: image {path}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise ModelFormatError(f"{where}: image {path} is {kind(st.st_mode)}, not a regular file")
    if st.st_size > MAX_IMAGE_BYTES:
        raise ModelFormatError(f"{where}: image {path} is {st.st_size} bytes; at most {MAX_IMAGE_BYTES} are read")
