"""The bounds-checked GGUF header parser every reader here shares (text models and projectors alike).

Every count and length is checked against the bytes left in the file before anything is allocated;
every failure is a :class:`~engine.errors.ModelFormatError` naming the file and the key or tensor.
Tensor data stays in a read-only ``numpy.memmap``, or is read into memory (:mod:`.resident`). Design:
docs/design/gguf-files.md (the layout, and why not ``gguf.GGUFReader``).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import ModelFormatError
from .quant import type_name
from .resident import read_resident

_MAX_HEADER = 1 << 30        # metadata + tensor table; real files have ~10 MB
_MAX_STRING = 64 << 20       # one metadata string (chat templates are ~20 KB)
_MAX_ARRAY_DEPTH = 3
_MAX_DIMS = 4                # GGML_MAX_DIMS
_MAX_KV = 1 << 16            # metadata keys; real files have < 100 (a key of ~13 bytes parses in ~5 us: without
                             # a bound a 256 MiB header of tiny keys takes minutes and GBs of dicts)
_MAX_TENSORS = 1 << 17       # tensor-table entries; the largest released models have a few thousand

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SCALARS = {
    GGUFValueType.UINT8: struct.Struct("<B"), GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"), GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: _U32, GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"), GGUFValueType.BOOL: struct.Struct("<B"),
    GGUFValueType.UINT64: _U64, GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_ARRAY_DTYPES = {
    GGUFValueType.UINT8: "u1", GGUFValueType.INT8: "i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "u1", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}
# smallest encoding of one array element: used to bound an array length before reading it
_MIN_ELEMENT = {**{t: s.size for t, s in _SCALARS.items()}, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
_MIN_KV = 8 + 4 + 1          # empty key, type, one-byte value
_MIN_TENSOR = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dim, type, offset

class HeaderIncomplete(ModelFormatError):
    """The header goes on past the bytes given to :func:`parse_prefix`: ``needed`` bytes from the start would
    cover the read that failed (read more and parse again)."""

    def __init__(self, source: str, needed: int):
        super().__init__(f"{source}: the GGUF header goes on past the first bytes read (needs at least {needed})")
        self.needed = needed


@dataclass(frozen=True)
class StoredTensor:
    """A tensor table entry: ``type_id`` may be unknown to ggml (then ``nbytes`` is -1).

    Attributes:
        name: GGUF tensor name. type_id: the ggml type id as stored. ne: GGUF dims, fastest first.
        offset: absolute file offset of the data, bytes. nbytes: bytes of data (-1 for an unknown type).
    """

    name: str
    type_id: int
    ne: tuple[int, ...]
    offset: int      # absolute file offset of the data
    nbytes: int

class _HeaderReader:
    """Bounds-checked sequential reader over the header bytes of a memory-mapped file.

    Header bytes are copied from the map into ``buf`` on demand (growing by doubling), so a
    header of a few MB costs a few MB, and no read ever goes past the file end or ``_MAX_HEADER``.
    """

    def __init__(self, data: np.ndarray, path: str, size: int | None = None):
        self._data = data
        self.size = int(data.size) if size is None else size
        self.source = path
        self.buf = b""
        self.off = 0

    def fail(self, what: str) -> ModelFormatError:
        """A ModelFormatError about this file."""
        return ModelFormatError(f"{self.source}: {what}")

    def need(self, n: int, what: str) -> None:
        """Make ``buf`` cover ``n`` more bytes at ``off``; raises ModelFormatError past EOF / header limit."""
        end = self.off + n
        if end > self.size:
            raise self.fail(f"{what} needs {n} bytes at offset {self.off} but the file ends at byte "
                            f"{self.size} (truncated or corrupt GGUF)")
        if end > _MAX_HEADER:
            raise self.fail(f"{what} would make the GGUF header larger than {_MAX_HEADER >> 20} MiB")
        if end > self._data.size:
            raise HeaderIncomplete(self.source, end)
        if end > len(self.buf):
            self.buf = bytes(self._data[:min(self.size, _MAX_HEADER, max(end, 2 * len(self.buf), 1 << 16))])

    def scalar(self, fmt: struct.Struct, what: str) -> Any:
        """One little-endian scalar."""
        self.need(fmt.size, what)
        value = fmt.unpack_from(self.buf, self.off)[0]
        self.off += fmt.size
        return value

    def string(self, what: str) -> str:
        """A u64-length-prefixed UTF-8 string."""
        n = self.scalar(_U64, f"the length of {what}")
        if n > _MAX_STRING:
            raise self.fail(f"{what} claims a length of {n} bytes (limit {_MAX_STRING})")
        self.need(n, what)
        try:
            s = self.buf[self.off:self.off + n].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None
        self.off += n
        return s

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings, walked with local variables (the 248320-token vocabulary takes ~0.2 s)."""
        out: list[str] = []
        append, unpack = out.append, _U64.unpack_from
        buf, off = self.buf, self.off
        end = len(buf)
        for i in range(count):
            if off + 8 > end:
                self.off = off
                self.need(8, f"the length of {what}[{i}]")
                buf, end = self.buf, len(self.buf)
            n = unpack(buf, off)[0]
            off += 8
            if off + n > end:
                if n > _MAX_STRING:
                    raise self.fail(f"{what}[{i}] claims a length of {n} bytes (limit {_MAX_STRING})")
                self.off = off
                self.need(n, f"{what}[{i}]")
                buf, end = self.buf, len(self.buf)
            try:
                append(buf[off:off + n].decode("utf-8"))
            except UnicodeDecodeError:
                raise self.fail(f"{what}[{i}] is not valid UTF-8") from None
            off += n
        self.off = off
        return out

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        """One metadata value: python scalar, str, list of str / values, or numpy array of numbers."""
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.BOOL:
            return bool(self.scalar(_SCALARS[vtype], what))
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype != GGUFValueType.ARRAY:
            raise self.fail(f"{what} has unknown value type {vtype} (expected 0..12)")
        if depth >= _MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays deeper than {_MAX_ARRAY_DEPTH} levels")
        itype = self.scalar(_U32, f"the element type of {what}")
        count = self.scalar(_U64, f"the length of {what}")
        if itype not in _MIN_ELEMENT:
            raise self.fail(f"{what} has unknown element type {itype} (expected 0..12)")
        if count * _MIN_ELEMENT[itype] > self.size - self.off:
            raise self.fail(f"{what} claims {count} elements of type {GGUFValueType(itype).name}, more than "
                            f"the {self.size - self.off} bytes left in the file can hold")
        if itype == GGUFValueType.STRING:
            return self.strings(count, what)
        if itype == GGUFValueType.ARRAY:
            return [self.value(itype, f"{what}[{i}]", depth + 1) for i in range(count)]
        dtype = np.dtype(_ARRAY_DTYPES[itype])
        self.need(count * dtype.itemsize, what)
        arr = np.frombuffer(self.buf, dtype, count, self.off).copy()
        self.off += count * dtype.itemsize
        return arr.astype(bool) if itype == GGUFValueType.BOOL else arr


def _counts(r: _HeaderReader) -> tuple[int, int]:
    """Magic and version checked; (tensor count, key/value count), each bounded by the bytes left."""
    r.need(24, "the GGUF header (magic, version, tensor and key counts)")
    magic = r.buf[:4]
    if magic != b"GGUF":
        raise r.fail(f"not a GGUF file: magic is {magic!r}, expected b'GGUF'")
    r.off = 4
    version = r.scalar(_U32, "the GGUF version")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version and not version & 0xFFFF else ""
        raise r.fail(f"GGUF version {version} is not supported (expected 2 or 3){hint}")
    n_tensors = r.scalar(_U64, "the tensor count")
    n_kv = r.scalar(_U64, "the key/value count")
    left = r.size - r.off
    if n_kv > _MAX_KV or n_tensors > _MAX_TENSORS:
        raise r.fail(f"header claims {n_kv} metadata keys and {n_tensors} tensors (limits {_MAX_KV} and "
                     f"{_MAX_TENSORS}; corrupt or not a model file)")
    if n_kv * _MIN_KV > left:
        raise r.fail(f"header claims {n_kv} metadata keys; the {left} bytes of the file cannot hold that many "
                     "(truncated or corrupt GGUF)")
    if n_tensors * _MIN_TENSOR > left:
        raise r.fail(f"header claims {n_tensors} tensors; the {left} bytes of the file cannot hold that many "
                     "(truncated or corrupt GGUF)")
    return n_tensors, n_kv


def _metadata(r: _HeaderReader, n_kv: int) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    """The key/value pairs: key -> value, and key -> byte range of its whole record."""
    meta: dict[str, Any] = {}
    records: dict[str, tuple[int, int]] = {}
    for i in range(n_kv):
        start = r.off
        key = r.string(f"metadata key #{i}")
        vtype = r.scalar(_U32, f"the value type of key {key}")
        if key in meta:
            raise r.fail(f"metadata key {key} appears twice")
        meta[key] = r.value(vtype, f"key {key}")
        records[key] = (start, r.off)
    return meta, records


def _table(r: _HeaderReader, n_tensors: int) -> list[tuple[str, int, tuple[int, ...], int]]:
    """The tensor table as read: (name, type id, ne, data offset relative to the data section)."""
    table: list[tuple[str, int, tuple[int, ...], int]] = []
    for i in range(n_tensors):
        name = r.string(f"the name of tensor #{i}")
        n_dims = r.scalar(_U32, f"n_dims of tensor {name}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise r.fail(f"tensor {name} has {n_dims} dimensions (expected 1..{_MAX_DIMS})")
        ne = tuple(r.scalar(_U64, f"ne[{j}] of tensor {name}") for j in range(n_dims))
        type_id = r.scalar(_U32, f"the type of tensor {name}")
        table.append((name, type_id, ne, r.scalar(_U64, f"the data offset of tensor {name}")))
    return table


def _stored(r: _HeaderReader, entry: tuple[str, int, tuple[int, ...], int], alignment: int,
            data_start: int) -> StoredTensor:
    """One table entry with its offset aligned and, for a type ggml knows, its data inside the file."""
    name, type_id, ne, rel = entry
    if rel % alignment:
        raise r.fail(f"tensor {name} data offset {rel} is not a multiple of the alignment {alignment}")
    n_elem = 1
    for n in ne:
        n_elem *= n
    nbytes = -1
    if type_id in GGML_QUANT_SIZES.keys():
        bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        if ne[0] % bs:
            raise r.fail(f"tensor {name} has ne0 = {ne[0]}, not a multiple of the {type_name(type_id)} "
                         f"block size {bs}")
        nbytes = n_elem // bs * ts
        end = data_start + rel + nbytes
        if end > r.size:
            raise r.fail(f"tensor {name} data [{data_start + rel}, {end}) extends past the end of the file "
                         f"({r.size} bytes): truncated download?")
    return StoredTensor(name, type_id, ne, data_start + rel, nbytes)


def _parse_header(r: _HeaderReader) -> tuple[dict[str, Any], dict[str, tuple[int, int]], list[StoredTensor], int]:
    """Parse magic, version, metadata and tensor table.

    Returns:
        (metadata key -> value, key -> byte range ``[start, end)`` of its whole record (key, type,
        value) in the file, tensor table in file order, absolute offset of the data section).
    """
    n_tensors, n_kv = _counts(r)
    meta, records = _metadata(r, n_kv)
    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise r.fail(f"key general.alignment = {alignment!r} is not a power of two")
    table = _table(r, n_tensors)
    data_start = -(-r.off // alignment) * alignment
    tensors, seen = [], set()
    for entry in table:
        if entry[0] in seen:
            raise r.fail(f"tensor {entry[0]} appears twice in the tensor table")
        seen.add(entry[0])
        tensors.append(_stored(r, entry, alignment, data_start))
    return meta, records, tensors, data_start


@dataclass(frozen=True)
class Header:
    """The parsed header of one GGUF file, over the read-only bytes of the whole file.

    Attributes:
        source: the file name used in error messages.
        data: (file size,) uint8, read-only: the file map (tensor bytes are read from it on demand), or a
            view of ``writable`` when the file was read into memory.
        meta: key -> value (numeric arrays as numpy arrays, string arrays as lists), in file order.
        records: key -> byte range ``[start, end)`` of its whole record (key, type, value).
        tensors: name -> :class:`StoredTensor`, in file order.
        data_start: absolute offset of the tensor data section.
        header_bytes: bytes of magic, metadata and tensor table (before the alignment padding).
        writable: the file's bytes in private memory, writable (``read_header(..., weights="ram")``), else None.
    """

    source: str
    data: np.ndarray
    meta: dict[str, Any]
    records: dict[str, tuple[int, int]]
    tensors: dict[str, StoredTensor]
    data_start: int
    header_bytes: bytes
    writable: np.ndarray | None = None

    def value(self, key: str, default: Any = None) -> Any:
        """Value of a metadata key as python data (str, int, float, bool, or list), ``default`` if absent."""
        if key not in self.meta:
            return default
        value = self.meta[key]
        if isinstance(value, np.ndarray):
            return value.tolist()
        if isinstance(value, list):
            return list(value)
        return value

    def tensor_bytes(self, t: StoredTensor) -> np.ndarray:
        """The stored bytes of ``t`` (a uint8 view of the map, no copy); the extent was checked at parse."""
        return self.data[t.offset:t.offset + t.nbytes]


def advise_huge_pages(mapped: np.memmap) -> None:
    """Ask for 2 MiB page-cache folios for the pages this read-only map faults in (``MADV_HUGEPAGE``, Linux).

    A hint with no effect on the bytes: the pages a fault reads from disk come in physically contiguous
    2 MiB folios instead of scattered 4 KiB pages. A Q4_0 GEMV read such pages 1.44x faster a core (fewer TLB
    misses; docs/perf/log/cpu-q4dec-2026-12-05.md). Pages already cached keep their folios. Ignored where
    the platform or the kernel does not take it.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    region = getattr(mapped, "_mmap", None)
    if advice is None or region is None:
        return
    try:
        region.madvise(advice)
    except OSError:
        pass


def read_header(path: str | os.PathLike[str], weights: str = "map") -> Header:
    """Memory-map a GGUF file read-only and parse its header with every count and length bounds-checked.

    ``weights`` "ram" then reads the whole file into memory (:func:`.resident.read_resident`) and the
    header's ``data`` is that memory, read-only (``writable`` the same bytes, writable); "map" keeps the map.

    Raises:
        ModelFormatError: the file cannot be opened, is shorter than a header, or its header is
            malformed or truncated, or ("ram") it shrank or was replaced while being read; the message names the file
            (and the key or tensor).
        MemoryFitError: "ram" and the file is larger than the available memory (before reading it).
        ValueError: ``weights`` is neither "map" nor "ram".
    """
    if weights not in ("map", "ram"):
        raise ValueError(f"weights must be 'map' or 'ram' here, got {weights!r}")
    header = _map_and_parse(str(path))
    if weights == "map":
        return header
    size = header.data.size
    header = replace(header, data=np.empty(0, np.uint8))   # unmaps: the read below drops every page it caches
    writable = read_resident(header.source, size)
    if not np.array_equal(writable[:len(header.header_bytes)], np.frombuffer(header.header_bytes, np.uint8)):
        raise ModelFormatError(f"{header.source}: the file changed while being read into memory (its header is not "
                               "the one parsed a moment before: replaced while loading?); load it again")
    readonly = writable.view()
    readonly.flags.writeable = False
    return replace(header, data=readonly, writable=writable)


def _map_and_parse(source: str) -> Header:
    """:func:`read_header` over the read-only map of ``source``. Raises: see there."""
    try:
        size = os.path.getsize(source)
        if size < 24:
            raise ModelFormatError(f"{source}: file is {size} bytes, too short for a GGUF header (24 bytes)")
        mapped = np.memmap(source, dtype=np.uint8, mode="r")
        advise_huge_pages(mapped)
        data = np.asarray(mapped)
    except OSError as e:
        raise ModelFormatError(f"{source}: cannot open: {e.strerror or e}") from e
    reader = _HeaderReader(data, source)
    try:
        meta, records, tensors, data_start = _parse_header(reader)
    except (ValueError, OverflowError, struct.error, MemoryError) as e:
        raise ModelFormatError(f"{source}: malformed GGUF header near offset {reader.off}: {e}") from e
    return Header(source, data, meta, records, {t.name: t for t in tensors}, data_start, reader.buf[:reader.off])


def parse_prefix(prefix: bytes, file_size: int, source: str) -> Header:
    """Parse a GGUF header from the first bytes of a file of ``file_size`` bytes that is not here (a ranged
    download of a remote file); every count, length and tensor extent is checked against ``file_size``.

    ``Header.data`` holds only ``prefix``: the tensor data cannot be read from the result.

    Raises:
        HeaderIncomplete: the header is longer than ``prefix`` (``needed`` says how much to read).
        ModelFormatError: the header is malformed, or a tensor's data would end past ``file_size``.
    """
    if file_size < 24:
        raise ModelFormatError(f"{source}: file is {file_size} bytes, too short for a GGUF header (24 bytes)")
    data = np.frombuffer(prefix[:file_size], dtype=np.uint8)
    reader = _HeaderReader(data, source, file_size)
    try:
        meta, records, tensors, data_start = _parse_header(reader)
    except (ValueError, OverflowError, struct.error, MemoryError) as e:
        raise ModelFormatError(f"{source}: malformed GGUF header near offset {reader.off}: {e}") from e
    return Header(source, data, meta, records, {t.name: t for t in tensors}, data_start, reader.buf[:reader.off])


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata of any GGUF file (a model, a projector) as python data, bounds-checked; only the
    header pages are read.

    Raises:
        ModelFormatError: see :func:`read_header`.
    """
    header = read_header(path)
    return {key: header.value(key) for key in header.meta}


def file_identity(path: str | os.PathLike[str]) -> str:
    """A cheap identity of a file's contents as they are now: the SHA-256 hex digest of its size and its first
    and last MiB (projector weights differ in both; the embedding caches are scoped by it).

    Raises:
        OSError: the file cannot be read.
    """
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    span = 1 << 20
    with open(path, "rb") as fh:
        h.update(fh.read(span))
        if size > span:
            fh.seek(max(span, size - span))
            h.update(fh.read(span))
    return h.hexdigest()


class MetaReader:
    """Typed reads of a header's metadata whose errors name the file and the key (for the projector readers).

    Raises (every read): ModelFormatError: the key is missing or its value has the wrong type.
    """

    def __init__(self, header: Header):
        self._header = header
        self._source = header.source

    def has(self, key: str) -> bool:
        """True if the file stores ``key``."""
        return key in self._header.meta

    def get(self, key: str) -> Any:
        """The value of a required key (python data)."""
        if key not in self._header.meta:
            raise ModelFormatError(f"{self._source}: missing metadata key {key!r}")
        return self._header.value(key)

    def string(self, key: str) -> str:
        """A string key."""
        v = self.get(key)
        if not isinstance(v, str):
            raise ModelFormatError(f"{self._source}: key {key!r} should be a string, found {v!r}")
        return v

    def positive_int(self, key: str) -> int:
        """An integer key > 0."""
        v = self.get(key)
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ModelFormatError(f"{self._source}: key {key!r} should be a positive integer, found {v!r}")
        return int(v)

    def number(self, key: str) -> float:
        """A number key, as the shortest decimal of its float32 value (1e-6, not 9.99999997e-07)."""
        v = self.get(key)
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise ModelFormatError(f"{self._source}: key {key!r} should be a number, found {v!r}")
        return float(str(np.float32(v)))

    def floats(self, key: str, n: int) -> tuple[float, ...]:
        """An array key of exactly ``n`` numbers."""
        v = self.get(key)
        if not isinstance(v, list) or len(v) != n or not all(isinstance(x, (float, int)) for x in v):
            raise ModelFormatError(f"{self._source}: key {key!r} should be {n} numbers, found {v!r}")
        return tuple(float(x) for x in v)
