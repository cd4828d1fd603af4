"""Large prefill buffers from the reused heap, not a fresh kernel mapping per array (glibc only).

glibc serves an allocation above its mmap threshold with its own ``mmap`` and returns it with
``munmap`` on free; the threshold adapts upwards only to 32 MiB. A long prefill's activations pass that
(2048 tokens x 8192 query columns of float32 are 64 MiB), so every such numpy temporary was faulted in
page by page and zeroed by the kernel again. Design and figures: docs/design/prefill-heap.md.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's ``mallopt`` parameter numbers (malloc.h)."""

MMAP_THRESHOLD = 256 << 20
"""Bytes: allocations up to this size come from the heap (a 2048-token piece's largest array is 64 MiB)."""

TRIM_THRESHOLD = 512 << 20
"""Bytes of free memory at the heap's top kept for the next piece before glibc returns it to the system."""


def keep_large_buffers() -> bool:
    """Set glibc's mmap and trim thresholds to :data:`MMAP_THRESHOLD` / :data:`TRIM_THRESHOLD` (process-wide;
    the arithmetic is untouched, only where freed buffers go). Returns True where glibc took both, False
    elsewhere (other C libraries, or a libc without ``mallopt``). Raises nothing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
