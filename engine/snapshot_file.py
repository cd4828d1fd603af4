"""The versioned disk format of one prefix snapshot, and its checks against the loaded model.

A file is ``FORMAT_MAGIC``, a u64 (little-endian) header length, a JSON header, the payload (``pos``
int32 token ids, then every array as little-endian float32 in the header's order) and the SHA-256 of
header + payload. The header names the format version, the model file's identity, the chain key,
``pos``, the image digests by position, the conversation, ``created`` / ``hits``, and every array's
dtype and shape. A file is written to a temporary file, flushed, fsynced and renamed, so a crash
never leaves a partial snapshot under its real name.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .state import HasStateLayout

FORMAT_MAGIC = b"DDSNAP\x00\x01"
FORMAT_VERSION = 1
_HEAD = len(FORMAT_MAGIC) + 8   # magic + header length
_SHA = 32


def expected_arrays(hp: HasStateLayout, pos: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every float32 array a snapshot at ``pos`` holds for ``hp`` (``logits`` aside):
    :meth:`engine.state.StateLayout.arrays`."""
    return hp.state_layout().arrays(pos)


def check_header(hp: HasStateLayout, identity: str, meta: object, payload_bytes: int) -> str | None:
    """Why a snapshot file's parsed JSON header does not fit the loaded model, or None when it does.

    Args:
        hp: the loaded model's hyper-parameters. identity: its file identity.
        meta: the parsed header (anything JSON gives).
        payload_bytes: bytes between the header and the checksum (tokens and arrays).
    Checks: version, identity, ``pos`` an int in 1..context_length, ``key`` a hex string, ``images``
    position -> hex digest, ``arrays`` exactly :func:`expected_arrays` (plus an optional ``logits`` of
    (n_vocab,)), every one ``<f4``, the payload's size = 4 * pos + the arrays' bytes, ``conversation`` a
    string, ``created`` and ``hits`` numbers within +-1e18 (not NaN or infinite).
    """
    if not isinstance(meta, dict):
        return "the header is not an object"
    if meta.get("version") != FORMAT_VERSION:
        return f"format version {meta.get('version')!r} (this build reads {FORMAT_VERSION})"
    if meta.get("identity") != identity:
        return "belongs to another model file"
    layout = hp.state_layout()
    pos = meta.get("pos")
    if not isinstance(pos, int) or isinstance(pos, bool) or not 1 <= pos <= layout.context_length:
        return f"pos {pos!r} is not a position within the context (1..{layout.context_length})"
    if not isinstance(meta.get("key"), str):
        return "no key"
    images = meta.get("images", {})
    if not isinstance(images, dict) or not all(isinstance(p, str) and p.isdigit() and int(p) < pos
                                               and isinstance(d, str) for p, d in images.items()):
        return "malformed image table"
    arrays = meta.get("arrays")
    if not isinstance(arrays, dict):
        return "no array table"
    want = layout.arrays(pos)
    extra = set(arrays) - set(want) - {"logits"}
    if extra or set(want) - set(arrays):
        return f"its arrays do not match the model's layers (unexpected {sorted(extra)[:3]}, " \
               f"missing {sorted(set(want) - set(arrays))[:3]})"
    want["logits"] = (layout.n_vocab,)
    size = 4 * pos
    for name, entry in arrays.items():
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == "<f4" and isinstance(entry[1], list)
                and tuple(entry[1]) == want[name]):
            return f"array {name} is {entry!r}, expected ['<f4', {list(want[name])}]"
        size += 4 * int(np.prod(want[name]))
    if size != payload_bytes:
        return f"{payload_bytes} bytes of data where the header describes {size}"
    for name in ("conversation",):
        if not isinstance(meta.get(name, ""), str):
            return f"{name} is not a string"
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


def _frame(data: bytes) -> tuple[int, int] | str:
    """(header start, header length) of a well-framed file whose checksum holds, or why not."""
    if len(data) < _HEAD + _SHA or not data.startswith(FORMAT_MAGIC):
        return "not a snapshot file (bad magic or too short)"
    (n_head,) = struct.unpack_from("<Q", data, len(FORMAT_MAGIC))
    if _HEAD + n_head + _SHA > len(data):
        return "truncated header"
    if hashlib.sha256(data[_HEAD:-_SHA]).digest() != data[-_SHA:]:
        return "checksum mismatch (corrupt or partial write)"
    return _HEAD, n_head


def decode(data: bytes, hp: HasStateLayout, identity: str) -> tuple[dict, np.ndarray, dict[str, np.ndarray]] | str:
    """Parse and verify one snapshot file against the loaded model.

    Returns:
        (header, (pos,) int32 tokens, name -> float32 array), or a string saying why the file is not usable
        (bad framing or checksum, unreadable header, :func:`check_header`'s reason, a token outside the vocabulary).
    """
    frame = _frame(data)
    if isinstance(frame, str):
        return frame
    start, n_head = frame
    try:
        meta = json.loads(data[start:start + n_head])
    except (ValueError, RecursionError):    # not JSON, or nested too deep to parse
        return "unreadable header"
    fail = check_header(hp, identity, meta, len(data) - _SHA - start - n_head)
    if fail is not None:
        return fail
    offset, pos = start + n_head, meta["pos"]
    tokens = np.frombuffer(data, dtype="<i4", count=pos, offset=offset).copy()
    if tokens.size and (tokens.min() < 0 or tokens.max() >= hp.state_layout().n_vocab):
        return "a token id outside the vocabulary"
    offset += 4 * pos
    arrays = {}
    for name, (_, shape) in meta["arrays"].items():
        a = np.frombuffer(data, dtype="<f4", count=int(np.prod(shape)), offset=offset)
        arrays[name] = a.reshape(shape).astype(np.float32)
        offset += a.nbytes
    return meta, tokens, arrays
