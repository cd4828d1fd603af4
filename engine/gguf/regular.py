"""Reading a file the engine did not write: only a regular file is read, and only up to a byte cap.

A path that names a FIFO, a device, a folder or a socket is never read (a FIFO or device is not even
opened, so ``/dev/zero`` cannot fill memory and a FIFO cannot hang the reader); the file is opened
without blocking and checked again on the open descriptor (it may have been swapped after the first
look), and its size is checked there before any byte is read. Links are followed.
"""

from __future__ import annotations

import os
import stat

MAX_IMAGE_FILE_BYTES = 64 << 20
"""Largest image file read, bytes (a 64 MiB PNG or JPEG is far beyond any photo a vision tower reads)."""

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISSOCK, "a socket"))
_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)


class FileRefused(ValueError):
    """The path exists but is not a regular file, or is larger than the cap; the message says which."""


def kind(mode: int) -> str:
    """Plain words for a file type from its ``st_mode`` ("a FIFO", "a folder", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them.

    Raises:
        FileRefused: not a regular file ("is a FIFO, not a regular file") or over ``limit`` bytes (also
            when it grows past it while read).
        OSError: missing or unreadable (the system's own error).
    """
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise FileRefused(f"is {kind(mode)}, not a regular file")
    fd = os.open(path, _FLAGS)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(f"is {kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise FileRefused(f"is {st.st_size} bytes; at most {limit} are read")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FileRefused(f"grew beyond {limit} bytes while read")
    return data
