"""Model files read into anonymous memory ("ram" weights) in place of the page cache, and the choice of mode.

The bytes go into a private anonymous region advised ``MADV_HUGEPAGE`` (2 MiB pages where transparent huge
pages are on, ``madvise`` mode included), read in :data:`CHUNK` pieces; each piece's page-cache pages are
dropped right after (``POSIX_FADV_DONTNEED``), so RSS plus page cache peaks near the file size, not twice it.
Design and trade-offs against the read-only file map ("map"): docs/design/weights-in-ram.md.
"""

from __future__ import annotations

import mmap
import os
import stat

import numpy as np

from ..errors import MemoryFitError, ModelFormatError, UnsupportedModelError

WEIGHTS_MODES = ("auto", "map", "ram")
"""``EngineOptions.weights`` values: "map" (the read-only file map), "ram" (read into memory), "auto" (pick)."""
CHUNK = 64 << 20
"""Bytes read (and then dropped from the page cache) per system call."""
FIT_FRACTION = 0.7
""""auto" reads a file into memory only when it is at most this fraction of the available memory."""


def available_memory() -> int:
    """Bytes of memory the OS reports available (``psutil``: free plus reclaimable page cache)."""
    import psutil
    return int(psutil.virtual_memory().available)


def supported() -> bool:
    """True where "ram" can be read (POSIX ``readv`` and anonymous maps); elsewhere only "map" loads."""
    return hasattr(os, "readv") and hasattr(mmap, "MAP_ANONYMOUS")


def fits(size: int, available: int | None = None) -> bool:
    """True when a file of ``size`` bytes leaves room beside it: ``size <= FIT_FRACTION * available`` bytes."""
    available = available_memory() if available is None else available
    return size <= FIT_FRACTION * available


def check_fits(source: str, size: int, available: int | None = None) -> None:
    """Refuse to read ``source`` (``size`` bytes) into memory when it exceeds the available memory.

    Raises:
        MemoryFitError: naming the file, its bytes and the available bytes.
    """
    available = available_memory() if available is None else available
    if size > available:
        raise MemoryFitError(f"{source}: reading its {size} bytes ({size / 2**30:.2f} GiB) into memory needs more than "
                             f"the {available} bytes ({available / 2**30:.2f} GiB) available; load it with "
                             "weights 'map' (read from the file as needed) instead")


def read_resident(source: str, size: int, available: int | None = None) -> np.ndarray:
    """Read the ``size`` bytes of ``source`` into new anonymous memory (see the module doc).

    Returns:
        ``(size,)`` uint8, writable, owning its region (freed with the last view of it).

    Raises:
        MemoryFitError: ``size`` exceeds the available memory (checked before anything is read), or the
            allocation fails.
        ModelFormatError: the file is not a regular file, cannot be read, or ends before ``size`` bytes (it
            shrank after its header was read, e.g. truncated by another process); the message names the file.
        UnsupportedModelError: no POSIX ``readv`` here (see :func:`supported`).
    """
    check_fits(source, size, available)
    if not supported():
        raise UnsupportedModelError(f"{source}: weights 'ram' needs POSIX readv; use weights 'map'")
    try:
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise MemoryFitError(f"{source}: cannot allocate {size} bytes to read it into memory ({e.strerror or e}); "
                             "load it with weights 'map' instead") from e
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)
        except OSError:
            pass
    data = np.frombuffer(region, dtype=np.uint8)
    try:
        fd = os.open(source, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ModelFormatError(f"{source}: cannot open: {e.strerror or e}") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ModelFormatError(f"{source}: not a regular file (a model is read from a file on disk)")
        _read_chunks(fd, data, source)
    except OSError as e:
        raise ModelFormatError(f"{source}: cannot read: {e.strerror or e}") from e
    finally:
        os.close(fd)
    return data


def _read_chunks(fd: int, data: np.ndarray, source: str) -> None:
    """Fill ``data`` from offset 0 of ``fd``, dropping each chunk's page-cache pages once copied.

    Raises:
        ModelFormatError: end of file before ``data.size`` bytes.
    """
    drop = getattr(os, "posix_fadvise", None)
    size, off = data.size, 0
    os.lseek(fd, 0, os.SEEK_SET)
    while off < size:
        got = os.readv(fd, [data[off:off + min(CHUNK, size - off)]])
        if got == 0:
            raise ModelFormatError(f"{source}: the file ended at byte {off} while being read into memory, but its "
                                   f"header describes {size} bytes (truncated or replaced while loading?)")
        if drop is not None:
            drop(fd, off, got, os.POSIX_FADV_DONTNEED)
        off += got
