"""NUMA placement of the expert weights: pages interleaved over every memory node; a no-op on one node.

``mbind`` on each region, and ``set_mempolicy(MPOL_INTERLEAVE)`` while the calling thread faults the
file's pages in (a shared file mapping ignores a VMA policy), through libc's ``syscall`` (ctypes).
Failures are logged and skipped: placement never stops a load.
Design: docs/design/native-cpu.md (the Linux rules and sources).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MPOL_DEFAULT = 0
MPOL_INTERLEAVE = 3
MPOL_MF_MOVE = 1 << 1
SYSCALLS = {"x86_64": {"mbind": 237, "set_mempolicy": 238}, "aarch64": {"mbind": 235, "set_mempolicy": 237}}
"""Syscall numbers per machine (``platform.machine()``)."""

NODE_ROOT = Path("/sys/devices/system/node")

Syscall = Callable[..., int]
"""``syscall(number, *args) -> int`` (libc's: -1 and errno on failure)."""


def node_count(root: Path = NODE_ROOT) -> int:
    """Memory nodes of this host (``/sys/devices/system/node/nodeN``); 1 where the folder is absent (not Linux)."""
    try:
        return max(1, sum(1 for p in root.iterdir() if p.name.startswith("node") and p.name[4:].isdigit()))
    except OSError:
        return 1


def _libc_syscall() -> Syscall | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


def interleave(regions: Iterable[np.ndarray], nodes: int | None = None, syscall: Syscall | None = None,
               machine: str | None = None) -> int:
    """Interleave the pages of ``regions`` over ``nodes`` memory nodes (see the module doc).

    Args:
        regions: arrays whose memory to place (any dtype/shape; memory-mapped views or owned copies).
        nodes: node count (default :func:`node_count`); 1 or less: nothing is done.
        syscall: libc's ``syscall`` (default: looked up); tests pass a recorder.
        machine: ``platform.machine()`` by default, to pick the syscall numbers.

    Returns:
        bytes of the regions whose ``mbind`` succeeded (0 on one node, or when the calls are not available).
    """
    n = node_count() if nodes is None else nodes
    if n <= 1:
        return 0
    numbers = SYSCALLS.get(machine or platform.machine())
    call = syscall or _libc_syscall()
    if numbers is None or call is None:
        log.info("NUMA: %d nodes, but no mbind on %s: expert pages are not interleaved", n,
                 machine or platform.machine())
        return 0
    words = (n + 63) // 64
    mask = (ctypes.c_ulong * words)(*[(((1 << n) - 1) >> (64 * w)) & (2 ** 64 - 1) for w in range(words)])
    maxnode = ctypes.c_ulong(64 * words + 1)
    page = mmap.PAGESIZE
    placed = 0
    if call(numbers["set_mempolicy"], MPOL_INTERLEAVE, mask, maxnode) != 0:
        log.warning("NUMA: set_mempolicy(MPOL_INTERLEAVE) failed: %s", os.strerror(ctypes.get_errno()))
    try:
        for a in regions:
            if a.nbytes == 0:
                continue
            start = a.ctypes.data & ~(page - 1)
            length = a.ctypes.data + a.nbytes - start
            if call(numbers["mbind"], ctypes.c_void_p(start), ctypes.c_ulong(length), MPOL_INTERLEAVE, mask,
                    maxnode, MPOL_MF_MOVE) != 0:
                log.warning("NUMA: mbind of %d bytes failed: %s", length, os.strerror(ctypes.get_errno()))
                continue
            placed += a.nbytes
            flat = a.reshape(-1).view(np.uint8)
            int(flat[::page].sum())              # fault each page in under the interleave policy
    finally:
        call(numbers["set_mempolicy"], MPOL_DEFAULT, None, ctypes.c_ulong(0))
    log.info("NUMA: %d nodes: %.1f MiB of expert pages interleaved", n, placed / 2**20)
    return placed
