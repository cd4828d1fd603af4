"""KV pages shared by prefix: the attention rows of prefix snapshots, stored once per prefix.

Page ``p`` holds rows ``[p * PAGE_ROWS, (p + 1) * PAGE_ROWS)`` and is named by the chain key of the prefix
ending with it (prefill is split-invariant, so the rows depend on that prefix alone); a snapshot stores
references to its whole pages and its own tail rows. :class:`PageStore` keeps each page's owners, a RAM
copy and a checksummed file written once; a missing or damaged page is a miss, never an error.
Design: docs/design/kv-cache.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

import numpy as np

from .snapshot import open_regular, read_framed_header, take_array, write_atomic
from .kv_types import kv_row_shape
from .state import KV_PAGE_ROWS, SequenceState, StateLayout, kv_dtype

log = logging.getLogger(__name__)

PAGE_ROWS = KV_PAGE_ROWS
"""Positions per page (the attention kernels' block, DD_ATTN_BLOCK)."""
PAGE_MAGIC = b"DDKVPG\x00\x01"
PAGE_VERSION = 1
PAGE_NAME = re.compile(r"[0-9a-f]{32}\.page")
_SHA = 32
_MAX_HEADER = 1 << 20
_STALE_S = 600.0   # an unowned page file this old is a crashed writer's, not one whose snapshot is being written


def page_arrays(state: SequenceState, p: int) -> dict[str, np.ndarray]:
    """Copies of page ``p``'s rows of ``state``: ``k.IL`` / ``v.IL`` (PAGE_ROWS, *row) of the KV type."""
    rows = slice(p * PAGE_ROWS, (p + 1) * PAGE_ROWS)
    return {f"{kind}.{il}": table[il][rows].copy() for kind, table in (("k", state.k), ("v", state.v))
            for il in table}


def page_layout(layout: StateLayout, kv_type: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype string, shape) of every array of a page of ``layout`` and ``kv_type``."""
    dtype = kv_dtype(kv_type).str
    return {f"{kind}.{il}": (dtype, (PAGE_ROWS, *kv_row_shape(layout.kv[il], kv_type))) for kind in ("k", "v")
            for il in sorted(layout.kv)}


def encode_page(identity: str, kv_type: str, key: bytes, arrays: Mapping[str, np.ndarray]) -> bytes:
    """One page file's bytes: magic, u64 header length, JSON header, the arrays in header order, SHA-256."""
    head = json.dumps({"version": PAGE_VERSION, "identity": identity, "key": key.hex(), "kv_type": kv_type,
                       "arrays": {n: [a.dtype.str, list(a.shape)] for n, a in arrays.items()}}).encode()
    payload = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values())
    return PAGE_MAGIC + struct.pack("<Q", len(head)) + head + payload + hashlib.sha256(head + payload).digest()


def read_page(path: Path, layout: StateLayout, identity: str, kv_type: str,
              key: bytes) -> dict[str, np.ndarray] | str:
    """Read and verify page file ``path``, which must hold page ``key`` of this model and KV type.

    Returns: name -> array (native byte order), or why the file is not usable: not a regular file,
    bad magic, truncated, a header that does not fit (version, identity, key, KV type, arrays), a NaN or
    infinite value, a checksum mismatch.
    """
    opened = open_regular(path)
    if isinstance(opened, str):
        return opened
    f, size = opened
    try:
        with f:
            framed = read_framed_header(f, size, PAGE_MAGIC, _MAX_HEADER, "page")
            if isinstance(framed, str):
                return framed
            meta, digest, payload_bytes = framed
            want = page_layout(layout, kv_type)
            fail = _check_page_header(meta, identity, kv_type, key, want)
            if fail is None and payload_bytes != sum(np.dtype(d).itemsize * int(np.prod(s)) for d, s in want.values()):
                fail = "its size does not match its header"
            if fail is not None:
                return fail
            return _read_arrays(f, want, digest)
    except OSError as exc:
        return f"cannot read it ({exc.strerror or exc})"


def _read_arrays(f: Any, want: dict[str, tuple[str, tuple[int, ...]]], digest: Any) -> dict[str, np.ndarray] | str:
    """The payload arrays ``want`` (name -> (dtype, shape)) read from ``f``, then the checksum over the header
    already in ``digest`` and the payload; or why they are not usable."""
    arrays: dict[str, np.ndarray] = {}
    for name, (dtype, shape) in want.items():
        fail = take_array(f, name, np.dtype(dtype), shape, digest, arrays)
        if fail is not None:
            return fail
    if f.read(_SHA) != digest.digest():
        return "checksum mismatch (corrupt or partial write)"
    return arrays


def _check_page_header(meta: object, identity: str, kv_type: str, key: bytes,
                       want: Mapping[str, tuple[str, tuple[int, ...]]]) -> str | None:
    """Why a page file's parsed header is not that of page ``key`` of this model and KV type, or None."""
    if not isinstance(meta, dict) or meta.get("version") != PAGE_VERSION:
        return "not a page header of this version"
    if meta.get("identity") != identity:
        return "belongs to another model file"
    if meta.get("key") != key.hex():
        return "holds another page (swapped or renamed)"
    if meta.get("kv_type") != kv_type:
        return f"KV type {meta.get('kv_type')!r}, expected {kv_type!r}"
    arrays = meta.get("arrays")
    if not isinstance(arrays, dict) or list(arrays) != list(want) or any(
            arrays[n] != [d, list(s)] for n, (d, s) in want.items()):
        return "its arrays do not match the model's attention layers"
    return None


@dataclass
class Page:
    """One page: its owners (snapshot keys), its RAM copy (or None), whether its file is written, bytes."""

    key: bytes
    nbytes: int
    arrays: dict[str, np.ndarray] | None = None
    on_disk: bool = False
    owners: set[bytes] = field(default_factory=set)


class PageStore:
    """The pages of one prefix cache (see the module docstring). Not locked: its cache's lock guards it.

    Args: layout: the model's state layout. identity: the model file's identity. kv_type: the cache's
    KV type. folder: the disk tier's folder, or None for RAM only.
    """

    def __init__(self, layout: StateLayout, identity: str, kv_type: str, folder: Path | None) -> None:
        self.layout, self.identity, self.kv_type, self.folder = layout, identity, kv_type, folder
        self.pages: dict[bytes, Page] = {}
        self.page_bytes = sum(np.dtype(d).itemsize * int(np.prod(s))
                              for d, s in page_layout(layout, kv_type).values())

    def attach(self, owner: bytes, keys: Iterable[bytes], state: SequenceState | None = None) -> None:
        """Make ``owner`` reference pages ``keys``; a page not held yet is copied from ``state`` (page p of
        ``state`` for the p-th key), or registered as on disk when ``state`` is None (a scanned file)."""
        for p, key in enumerate(keys):
            page = self.pages.get(key)
            if page is None:
                page = self.pages[key] = Page(key, self.page_bytes, on_disk=state is None,
                                              arrays=None if state is None else page_arrays(state, p))
            elif page.arrays is None and state is not None:
                page.arrays = page_arrays(state, p)
            page.owners.add(owner)

    def detach(self, owner: bytes, keys: Iterable[bytes]) -> list[bytes]:
        """Drop ``owner``'s references; a page left without owners is removed, its file too. Returns the
        keys of the page files removed."""
        removed = []
        for key in keys:
            page = self.pages.get(key)
            if page is None:
                continue
            page.owners.discard(owner)
            if not page.owners:
                del self.pages[key]
                if page.on_disk:
                    self._unlink(key)
                    removed.append(key)
        return removed

    def load(self, keys: Iterable[bytes]) -> list[dict[str, np.ndarray]] | None:
        """The arrays of pages ``keys`` (read from disk where not in RAM, then kept in RAM), or None when one
        is missing or its file is not usable (logged; that page is then held by no file)."""
        out = []
        for key in keys:
            page = self.pages.get(key)
            if page is None:
                return None
            if page.arrays is None:
                got = self._read(key) if page.on_disk else "not held"
                if isinstance(got, str):
                    log.warning("prefix cache: page %s is not usable: %s", key.hex(), got)
                    page.on_disk = False
                    return None
                page.arrays = got
            out.append(page.arrays)
        return out

    def write(self, keys: Iterable[bytes]) -> bool:
        """Write every page of ``keys`` not on disk yet (atomically); False if one cannot be written."""
        assert self.folder is not None
        for key in keys:
            page = self.pages[key]
            if page.on_disk:
                continue
            if page.arrays is None:
                return False
            try:
                write_atomic(self._path(key), encode_page(self.identity, self.kv_type, key, page.arrays))
            except OSError as exc:
                log.warning("prefix cache: cannot write page %s: %s", key.hex(), exc)
                return False
            page.on_disk = True
        return True

    def release_ram(self, needed: set[bytes]) -> None:
        """Drop the RAM copy of every page on disk whose key is not in ``needed`` (pages of RAM snapshots)."""
        for page in self.pages.values():
            if page.on_disk and page.arrays is not None and page.key not in needed:
                page.arrays = None

    def ram_bytes(self) -> int:
        """Bytes of the pages' RAM copies."""
        return sum(p.nbytes for p in self.pages.values() if p.arrays is not None)

    def disk_files(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of the folder's page files, oldest first."""
        out = []
        if self.folder is None:
            return out
        try:
            with os.scandir(self.folder) as entries:
                for entry in entries:
                    try:
                        if PAGE_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                            st = entry.stat(follow_symlinks=False)
                            out.append((st.st_mtime, st.st_size, Path(entry.path)))
                    except OSError:
                        continue
        except OSError:
            return []
        return sorted(out, key=lambda t: t[0])

    def sweep(self) -> None:
        """Remove page files no snapshot references that are older than a write in flight could be."""
        now = time.time()
        for mtime, _, path in self.disk_files():
            key = bytes.fromhex(path.stem)
            if key not in self.pages and now - mtime > _STALE_S:
                self._unlink(key)

    def _path(self, key: bytes) -> Path:
        assert self.folder is not None
        return self.folder / f"{key.hex()}.page"

    def _read(self, key: bytes) -> dict[str, np.ndarray] | str:
        return read_page(self._path(key), self.layout, self.identity, self.kv_type, key)

    def _unlink(self, key: bytes) -> None:
        if self.folder is None:
            return
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("prefix cache: cannot remove page %s: %s", key.hex(), exc)
