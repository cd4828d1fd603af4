"""The versioned disk format of one prefix snapshot, and its checks against the loaded model.

A file is ``FORMAT_MAGIC``, a u64 (little-endian) header length, a JSON header, the payload (``pos``
int32 token ids, then every array in the header's order: little-endian float32, the KV rows in the
cache's KV type: float32, float16 or Q8_0 block bytes) and the SHA-256 of
header + payload. The header names the format version, the model file's identity, the chain key,
``pos``, the image digests by position, the conversation, ``created`` / ``hits``, ``interval`` (true for a
periodic snapshot the cache may thin; absent otherwise), and every array's dtype and shape. A file is
written to a temporary file, flushed, fsynced and renamed, so a crash never leaves a partial snapshot
under its real name.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .kv_types import kv_row_shape
from .state import KV_PAGE_ROWS, HasStateLayout, StateLayout, kv_dtype

FORMAT_MAGIC = b"DDSNAP\x00\x01"
FORMAT_VERSION = 1
_SHA = 32
_MAX_HEADER = 16 << 20           # bytes of JSON header read at most
_PIECE = 1 << 18                 # float32 values hashed per piece when only checking a file
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)   # opening a FIFO that slipped past lstat must not wait for a writer


def expected_arrays(hp: HasStateLayout, pos: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every float32 array a snapshot at ``pos`` holds for ``hp`` (``logits`` aside):
    :meth:`engine.turn.state.StateLayout.arrays`."""
    return hp.state_layout().arrays(pos)


def check_header(hp: HasStateLayout, identity: str, meta: object, payload_bytes: int,
                 kv_type: str = "f32") -> str | None:
    """Why a snapshot file's parsed JSON header does not fit the loaded model, or None when it does.

    Args:
        hp: the loaded model's hyper-parameters. identity: its file identity.
        meta: the parsed header (anything JSON gives).
        payload_bytes: bytes between the header and the checksum (tokens and arrays).
        kv_type: the cache's KV type (:data:`engine.turn.state.KV_TYPES`): the dtype of the ``k.*`` / ``v.*`` arrays.
    Checks: version, identity, ``pos`` an int in 1..context_length, ``key`` a hex string, ``pages`` (when
    present) the hex chain keys of the pos // KV_PAGE_ROWS whole KV pages the snapshot references
    (:mod:`engine.turn.kv_pages`; its own KV arrays then hold only the rows after them), ``images``
    position -> hex digest, ``arrays`` exactly :func:`expected_arrays` (plus an optional ``logits`` of
    (n_vocab,)), every one ``<f4`` (KV rows: ``kv_type``'s, e.g. ``<f2``, Q8_0 ``|u1`` blocks), the payload's
    size = 4 * pos + the arrays' bytes, ``conversation`` a string, ``interval`` (when present) a boolean,
    ``created`` and ``hits`` numbers within +-1e18 (not NaN or infinite).
    """
    if not isinstance(meta, dict):
        return "the header is not an object"
    layout = hp.state_layout()
    return (_head_problem(meta, identity, layout) or _array_problem(meta, layout, payload_bytes, kv_type)
            or _field_problem(meta))


def _head_problem(meta: dict, identity: str, layout: StateLayout) -> str | None:
    """What is wrong with the version, identity, ``pos``, ``key`` and image table, or None."""
    if meta.get("version") != FORMAT_VERSION:
        return f"format version {meta.get('version')!r} (this build reads {FORMAT_VERSION})"
    if meta.get("identity") != identity:
        return "belongs to another model file"
    pos = meta.get("pos")
    if not isinstance(pos, int) or isinstance(pos, bool) or not 1 <= pos <= layout.context_length:
        return f"pos {pos!r} is not a position within the context (1..{layout.context_length})"
    if not isinstance(meta.get("key"), str):
        return "no key"
    images = meta.get("images", {})
    if not isinstance(images, dict) or not all(isinstance(p, str) and p.isdigit() and int(p) < pos
                                               and isinstance(d, str) for p, d in images.items()):
        return "malformed image table"
    return None


def _array_problem(meta: dict, layout: StateLayout, payload_bytes: int, kv_type: str) -> str | None:
    """What is wrong with the page list, the array table (KV rows of ``kv_type``) and the payload's size
    (``pos`` already checked), or None."""
    pos = meta["pos"]
    arrays = meta.get("arrays")
    if not isinstance(arrays, dict):
        return "no array table"
    pages = meta.get("pages", [])
    if not isinstance(pages, list) or (pages and len(pages) != pos // KV_PAGE_ROWS) or not all(
            isinstance(k, str) and len(k) == 32 and all(c in "0123456789abcdef" for c in k) for k in pages):
        return f"malformed page list (expected {pos // KV_PAGE_ROWS} hex keys, or none)"
    want = layout.arrays(pos)
    for name in want:
        if name[:2] in ("k.", "v."):
            want[name] = (pos - KV_PAGE_ROWS * len(pages), *kv_row_shape(want[name][1:], kv_type))
    extra = set(arrays) - set(want) - {"logits"}
    if extra or set(want) - set(arrays):
        return f"its arrays do not match the model's layers (unexpected {sorted(extra)[:3]}, " \
               f"missing {sorted(set(want) - set(arrays))[:3]})"
    want["logits"] = (layout.n_vocab,)
    kv = kv_dtype(kv_type)
    size = 4 * pos
    for name, entry in arrays.items():
        dtype = kv if name[:2] in ("k.", "v.") else np.dtype("<f4")
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == dtype.str and isinstance(entry[1], list)
                and tuple(entry[1]) == want[name]):
            return f"array {name} is {entry!r}, expected [{dtype.str!r}, {list(want[name])}]"
        size += dtype.itemsize * int(np.prod(want[name]))
    if size != payload_bytes:
        return f"{payload_bytes} bytes of data where the header describes {size}"
    return None


def _field_problem(meta: dict) -> str | None:
    """What is wrong with ``conversation``, ``interval``, ``created`` and ``hits``, or None."""
    for name in ("conversation",):
        if not isinstance(meta.get(name, ""), str):
            return f"{name} is not a string"
    if not isinstance(meta.get("interval", False), bool):
        return "interval is not a boolean"
    for name in ("created", "hits"):
        value = meta.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1e18 < value < 1e18:
            return f"{name} is not a number within +-1e18 (got {str(value)[:20]})"
    return None


def encode(meta: Mapping[str, object], tokens: np.ndarray, arrays: Mapping[str, np.ndarray]) -> bytes:
    """One snapshot file's bytes: ``meta`` (JSON-able) plus the array table, the tokens and the arrays."""
    head = json.dumps({**meta, "arrays": {name: [a.dtype.str, list(a.shape)] for name, a in arrays.items()}}).encode()
    body = io.BytesIO()
    body.write(np.asarray(tokens).astype("<i4").tobytes())
    for a in arrays.values():
        body.write(np.ascontiguousarray(a).tobytes())
    payload = body.getvalue()
    return FORMAT_MAGIC + struct.pack("<Q", len(head)) + head + payload + hashlib.sha256(head + payload).digest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in its folder (fsync, rename); the temporary file
    is removed when anything fails.

    Raises:
        OSError: the folder or the file cannot be written (disk full, read-only, ...).
    """
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass        # already gone (renamed, or never fully created)
        raise


def open_regular(path: Path) -> tuple[BinaryIO, int] | str:
    """Open ``path`` for reading only when it is a regular file (a symlink, FIFO, device or folder is never
    opened or followed): (binary file, size in bytes), or why not.

    The name is checked with ``lstat`` before opening, opened without following links and without blocking,
    and the open file's ``fstat`` must name the same inode, so a file swapped in between is refused too.
    """
    try:
        before = os.lstat(path)
        if not stat.S_ISREG(before.st_mode):
            return "not a regular file"
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        return f"cannot open it ({exc.strerror or exc})"
    after = os.fstat(fd)
    if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        return "not a regular file (replaced while opening)"
    return os.fdopen(fd, "rb"), after.st_size


def read_file(path: Path, hp: HasStateLayout, identity: str, with_arrays: bool = True,
              kv_type: str = "f32") -> tuple[dict, np.ndarray, dict[str, np.ndarray] | None] | str:
    """Read and verify one snapshot file by streaming it (only a regular file, see :func:`open_regular`).

    The header is read first and its sizes checked against the file's size before any array is allocated;
    the payload is then read in pieces into the arrays (or, with ``with_arrays=False``, only hashed and
    checked), so memory use is the arrays' size, never the file's twice.

    Returns:
        (header, (pos,) int32 tokens, name -> array or None), or a string saying why the file is not
        usable (see :func:`read_stream`; ``kv_type`` as there).
    """
    opened = open_regular(path)
    if isinstance(opened, str):
        return opened
    f, size = opened
    try:
        with f:
            return read_stream(f, size, hp, identity, with_arrays, kv_type)
    except OSError as exc:
        return f"cannot read it ({exc.strerror or exc})"


def decode(data: bytes, hp: HasStateLayout, identity: str,
           kv_type: str = "f32") -> tuple[dict, np.ndarray, dict[str, np.ndarray]] | str:
    """:func:`read_stream` over bytes already in memory."""
    return read_stream(io.BytesIO(data), len(data), hp, identity, True, kv_type)  # type: ignore[return-value]


def read_stream(f: BinaryIO, size: int, hp: HasStateLayout, identity: str, with_arrays: bool,
                kv_type: str = "f32") -> tuple[dict, np.ndarray, dict[str, np.ndarray] | None] | str:
    """Parse and verify a snapshot of ``size`` bytes read from ``f`` against the loaded model, whose cache
    keeps KV rows of ``kv_type`` (a file of another KV type is not usable).

    Returns:
        (header, (pos,) int32 tokens, name -> array (float32; KV rows of ``kv_type``), or None without
        ``with_arrays``), or a string
        saying why the file is not usable: bad framing, a header larger than the file, unreadable header,
        :func:`check_header`'s reason, a token outside the vocabulary, a NaN or infinite value in the state
        (damaged), a checksum mismatch, or a file shorter than it said.
    Raises:
        OSError: reading ``f`` failed.
    """
    framed = read_framed_header(f, size, FORMAT_MAGIC, _MAX_HEADER, "snapshot")
    if isinstance(framed, str):
        return framed
    meta, digest, payload_bytes = framed
    fail = check_header(hp, identity, meta, payload_bytes, kv_type)
    if fail is not None:
        return fail
    pos = meta["pos"]
    tokens = np.empty(pos, dtype="<i4")
    if not _fill(f, tokens, digest):
        return "truncated data"
    if tokens.size and (tokens.min() < 0 or tokens.max() >= hp.state_layout().n_vocab):
        return "a token id outside the vocabulary"
    arrays: dict[str, np.ndarray] | None = {} if with_arrays else None
    for name, (dtype, shape) in meta["arrays"].items():
        fail = take_array(f, name, np.dtype(dtype), tuple(shape), digest, arrays)
        if fail is not None:
            return fail
    if f.read(_SHA) != digest.digest():
        return "checksum mismatch (corrupt or partial write)"
    return meta, tokens.astype(np.int32), arrays


def read_framed_header(f: BinaryIO, size: int, magic: bytes, max_header: int,
                       kind: str) -> tuple[Any, Any, int] | str:
    """Read the framing every cache file shares: ``magic``, a little-endian u64 header length, that many
    bytes of JSON; then a payload and a SHA-256 of header + payload (``size`` bytes in all).

    Returns: ``(meta, digest, payload_bytes)`` (``digest``: a SHA-256 fed the header so far), or why the
    file is not usable (not a ``kind`` file, a header past ``max_header`` or the file, not JSON).
    """
    head_len = len(magic) + 8
    head = f.read(head_len)
    if size < head_len + _SHA or len(head) < head_len or not head.startswith(magic):
        return f"not a {kind} file (bad magic or too short)"
    (n_head,) = struct.unpack_from("<Q", head, len(magic))
    if n_head > min(size - head_len - _SHA, max_header):
        return "truncated header"
    raw = f.read(n_head)
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError):    # not JSON, or nested too deep to parse
        return "unreadable header"
    return meta, hashlib.sha256(raw), size - head_len - n_head - _SHA


def take_array(f: BinaryIO, name: str, dtype: np.dtype, shape: tuple[int, ...], digest: Any,
                arrays: dict[str, np.ndarray] | None) -> str | None:
    """Read one array of little-endian ``dtype`` (checked by :func:`check_header`) into ``arrays`` (native
    byte order), or in pieces only to hash and check it; why it is unusable, or None."""
    if arrays is not None:
        a = np.empty(shape, dtype=dtype)
        if not _fill(f, a, digest):
            return "truncated data"
        if not np.isfinite(a).all():
            return f"damaged: {name} holds NaN or infinite values"
        arrays[name] = a.astype(dtype.newbyteorder("="), copy=False)
        return None
    left = int(np.prod(shape))
    while left:
        piece = np.empty(min(left, _PIECE), dtype=dtype)
        if not _fill(f, piece, digest):
            return "truncated data"
        if not np.isfinite(piece).all():
            return f"damaged: {name} holds NaN or infinite values"
        left -= piece.size
    return None


def _fill(f: BinaryIO, a: np.ndarray, digest: Any) -> bool:
    """Read exactly ``a.nbytes`` bytes of ``f`` into ``a`` and hash them; False when the file ends first."""
    view = memoryview(a).cast("B")
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            return False
        done += n
    digest.update(view)
    return True
