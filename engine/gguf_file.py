"""A validated, memory-mapped view of one Qwen3.5/3.6 GGUF model file.

Layout of a GGUF file (ggml ``docs/gguf.md``, gguf-py ``gguf_reader.py``; all little-endian):
``"GGUF"`` magic, u32 version (2 or 3), u64 tensor count, u64 key/value count, the key/value pairs
(u64-length UTF-8 key, u32 value type, value), the tensor table (name, u32 n_dims, u64 ne[n_dims]
fastest first, u32 ggml type, u64 offset relative to the data section), padding to
``general.alignment`` (default 32), then the tensor data.

The header is parsed here rather than with ``gguf.GGUFReader`` for two reasons measured on this
project: GGUFReader builds one numpy view per array element, so a file with the real 248320-token
vocabulary takes ~20 s to open (this parser: ~0.3 s), and it trusts the counts and lengths it reads,
so a hostile header makes it loop for hours or fail with a bare ``IndexError``. Every count and
length is checked against the bytes left in the file *before* anything is allocated, and every
failure is a :class:`~engine.errors.ModelFormatError` naming the file and the key or tensor.
Tensor data stays in a read-only ``numpy.memmap``: opening touches only the header pages.

Which tensors and shapes a file must hold comes from its architecture (:func:`engine.registry.text_arch`
of ``general.architecture``; for Qwen3.5/3.6 :func:`engine.arch.qwen35.tensors.tensor_shapes`).
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .errors import ModelFormatError, UnsupportedModelError
from .quant import check_supported, dequantize, row_bytes, type_name
from .registry import TextArch, text_arch

_MAX_HEADER = 1 << 30        # metadata + tensor table; real files have ~10 MB
_MAX_STRING = 64 << 20       # one metadata string (chat templates are ~20 KB)
_MAX_ARRAY_DEPTH = 3
_MAX_DIMS = 4                # GGML_MAX_DIMS
_SAMPLES = 16                # data samples hashed into GGUFFile.identity
_SAMPLE_BYTES = 4096

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


@dataclass(frozen=True)
class TensorInfo:
    """What the file says about one tensor.

    Attributes:
        name: GGUF tensor name (``blk.3.attn_q.weight``).
        qtype: storage type.
        ne: GGUF dims, fastest first (``(IN, OUT)`` for a 2-D weight).
        shape: math shape = reversed ``ne`` (``(OUT, IN)``).
        nbytes: bytes of stored data.
    """

    name: str
    qtype: GGMLQuantizationType
    ne: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class _Stored:
    """A tensor table entry: ``type_id`` may be unknown to ggml (then ``nbytes`` is -1)."""

    name: str
    type_id: int
    ne: tuple[int, ...]
    offset: int      # absolute file offset of the data
    nbytes: int


@dataclass(frozen=True)
class _View:
    """Where a tensor's rows live: rows ``row0 .. row0+ne1`` of each of ``n_slabs`` slabs of ``slab_rows`` rows.

    A plain tensor is one view of itself (``row0`` = 0, ``slab_rows`` = ne1); the split names of a fused
    tensor (``attn_qkv`` on an attention layer, ``ffn_gate_up_exps``) are row ranges of the fused one.
    """

    info: TensorInfo
    offset: int
    slab_rows: int
    row0: int
    row_bytes: int
    n_slabs: int

    @property
    def rows(self) -> int:
        """Rows per slab (ne1 of the view; 1 for a 1-D tensor)."""
        return self.info.ne[1] if len(self.info.ne) > 1 else 1


class _HeaderReader:
    """Bounds-checked sequential reader over the header bytes of a memory-mapped file.

    Header bytes are copied from the map into ``buf`` on demand (growing by doubling), so a
    header of a few MB costs a few MB, and no read ever goes past the file end or ``_MAX_HEADER``.
    """

    def __init__(self, data: np.ndarray, path: str):
        self._data = data
        self.size = int(data.size)
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


def _parse_header(r: _HeaderReader) -> tuple[dict[str, Any], dict[str, tuple[int, int]], list[_Stored], int]:
    """Parse magic, version, metadata and tensor table.

    Returns:
        (metadata key -> value, key -> byte range ``[start, end)`` of its whole record (key, type,
        value) in the file, tensor table in file order, absolute offset of the data section).
    """
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
    if n_kv * _MIN_KV > left:
        raise r.fail(f"header claims {n_kv} metadata keys; the {left} bytes of the file cannot hold that many "
                     "(truncated or corrupt GGUF)")
    if n_tensors * _MIN_TENSOR > left:
        raise r.fail(f"header claims {n_tensors} tensors; the {left} bytes of the file cannot hold that many "
                     "(truncated or corrupt GGUF)")

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

    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise r.fail(f"key general.alignment = {alignment!r} is not a power of two")

    table: list[tuple[str, int, tuple[int, ...], int]] = []
    for i in range(n_tensors):
        name = r.string(f"the name of tensor #{i}")
        n_dims = r.scalar(_U32, f"n_dims of tensor {name}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise r.fail(f"tensor {name} has {n_dims} dimensions (expected 1..{_MAX_DIMS})")
        ne = tuple(r.scalar(_U64, f"ne[{j}] of tensor {name}") for j in range(n_dims))
        type_id = r.scalar(_U32, f"the type of tensor {name}")
        table.append((name, type_id, ne, r.scalar(_U64, f"the data offset of tensor {name}")))
    data_start = -(-r.off // alignment) * alignment

    tensors, seen = [], set()
    for name, type_id, ne, rel in table:
        if name in seen:
            raise r.fail(f"tensor {name} appears twice in the tensor table")
        seen.add(name)
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
        tensors.append(_Stored(name, type_id, ne, data_start + rel, nbytes))
    return meta, records, tensors, data_start


def _map(source: str) -> tuple[np.ndarray, _HeaderReader]:
    """Memory-map ``source`` read-only; the map and a header reader over it.

    Raises:
        ModelFormatError: the file cannot be opened or is shorter than a GGUF header.
    """
    try:
        size = os.path.getsize(source)
        if size < 24:
            raise ModelFormatError(f"{source}: file is {size} bytes, too short for a GGUF header (24 bytes)")
        data = np.asarray(np.memmap(source, dtype=np.uint8, mode="r"))
    except OSError as e:
        raise ModelFormatError(f"{source}: cannot open: {e.strerror or e}") from e
    return data, _HeaderReader(data, source)


def _parse(reader: _HeaderReader) -> tuple[dict[str, Any], dict[str, tuple[int, int]], list[_Stored], int]:
    """:func:`_parse_header` with every low-level failure turned into a ModelFormatError naming the offset."""
    try:
        return _parse_header(reader)
    except (ValueError, OverflowError, struct.error, MemoryError) as e:
        raise ModelFormatError(f"{reader.source}: malformed GGUF header near offset {reader.off}: {e}") from e


def _python(value: Any) -> Any:
    """A metadata value as python data (numpy arrays and lists become new lists)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return list(value)
    return value


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata of any GGUF file (a model, a projector), bounds-checked like :meth:`GGUFFile.open`
    but without any architecture check; only the header pages are read.

    Returns:
        key -> value as python data (str, int, float, bool, or list), in file order.

    Raises:
        ModelFormatError: unreadable, truncated or malformed header; the message names the file.
    """
    source = str(path)
    _, reader = _map(source)
    meta = _parse(reader)[0]
    return {key: _python(value) for key, value in meta.items()}


class GGUFFile:
    """One opened, validated GGUF model file (see ``docs/interfaces.md``, ``engine.gguf_file``).

    Use :meth:`open`. Tensor data is read lazily from a read-only memory map; the accessors
    :meth:`raw`, :meth:`expert` and :meth:`row` touch only the bytes they return.

    Attributes:
        path: the file path (``pathlib.Path``).
        source: ``str(path)``, the file name used in error messages.
        arch: ``general.architecture`` (``"qwen35moe"`` or ``"qwen35"``).
        text_arch: the :class:`engine.registry.TextArch` that runs it.
        hparams: its validated hyper-parameters (:class:`engine.arch.qwen35.hparams.Qwen35HParams`).
        identity: stable id of the file contents (see :meth:`open`).
        tensor_names: the tensors stored in the file, in file order (the split names of a fused
            tensor are readable, see :meth:`has`, but not listed, so sums over this list count each
            stored byte once).
    """

    def __init__(self, path: str | os.PathLike[str]):
        """Parse and validate; prefer :meth:`open`."""
        self.path = Path(path)
        self.source = str(path)
        self._data, reader = _map(self.source)
        self._meta, self._records, stored, self._data_start = _parse(reader)
        self._header_digest = hashlib.sha256(reader.buf[:reader.off])
        self._stored = {t.name: t for t in stored}
        tokens = self._meta.get("tokenizer.ggml.tokens")
        arch = self._meta.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFormatError(f"{self.source}: key general.architecture is missing or not a string")
        self.text_arch: TextArch = text_arch(arch, self.source)
        self.hparams = self.text_arch.hparams(self.meta, len(tokens) if isinstance(tokens, list) else None,
                                              self.source)
        self.arch = arch
        self._views: dict[str, _View] = {}
        self._validate()
        self.tensor_names = tuple(self._stored)
        try:
            self.identity = self._identity()
        except OSError as e:
            raise ModelFormatError(f"{self.source}: cannot read: {e.strerror or e}") from e

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "GGUFFile":
        """Open, memory-map and validate a GGUF file.

        Checks the magic, version, every count and length in the header against the file size,
        the tensor data extents, the architecture, the hyper-parameters
        (``text_arch.hparams``) and every tensor of ``text_arch.tensor_shapes`` (exact ``ne``,
        supported type). Fused ``attn_qkv`` on full-attention layers and ``ffn_gate_up_exps`` are
        accepted and exposed under the split names. Tensors of MTP blocks and unknown extras are kept
        but not checked.

        Raises:
            ModelFormatError: malformed, truncated or inconsistent file; message names file and key/tensor.
            UnsupportedModelError: other architecture, or a needed tensor in an unsupported quant type.
        """
        return cls(path)

    # ---------------------------------------------------------------- metadata
    def meta(self, key: str, default: Any = None) -> Any:
        """Value of a metadata key as python data (str, int, float, bool, or list), ``default`` if absent."""
        if key not in self._meta:
            return default
        return _python(self._meta[key])

    @property
    def meta_keys(self) -> tuple[str, ...]:
        """Every metadata key, in file order."""
        return tuple(self._records)

    @property
    def alignment(self) -> int:
        """``general.alignment``: tensor data offsets are multiples of it, bytes (default 32)."""
        return self._meta.get("general.alignment", 32)

    def kv_record(self, key: str) -> bytes:
        """The stored bytes of one metadata record: u64-length key, u32 value type, value.

        Copying these records keeps every value byte for byte, with its exact type (a writer
        re-encoding python values could turn a u64 into a u32, or drop an empty array).

        Raises:
            KeyError: no such key.
        """
        start, end = self._records[key]
        return bytes(self._data[start:end])

    def has(self, name: str) -> bool:
        """True if ``name`` is readable (a stored tensor or a split name of a fused one)."""
        return name in self._views or name in self._stored

    def info(self, name: str) -> TensorInfo:
        """Name, type, ne, math shape and byte size of a tensor.

        Raises:
            ModelFormatError: no such tensor in the file.
            UnsupportedModelError: the tensor's type id is unknown to ggml (its size is unknown).
        """
        return self._view(name).info

    # ---------------------------------------------------------------- tensor data
    def raw(self, name: str) -> np.ndarray:
        """Stored block bytes of a tensor.

        Returns:
            ``(rows, row_bytes)`` uint8, rows = ne1 * ne2 * ne3 (1 for a 1-D tensor), read-only view of
            the memory map; a copy only for the split names of a fused ``ffn_gate_up_exps``.
        """
        v = self._view(name)
        return self._slab_rows(v, 0, v.n_slabs).reshape(-1, v.row_bytes)

    def f32(self, name: str) -> np.ndarray:
        """Dequantized copy of a tensor in math shape (reversed ne), float32.

        Raises:
            UnsupportedModelError: a type the engine cannot dequantize (also for :meth:`expert`, :meth:`row`).
        """
        v = self._decodable_view(name)
        return dequantize(self.raw(name), v.info.qtype, v.info.shape)

    def expert(self, name: str, e: int) -> np.ndarray:
        """Expert ``e``'s matrix of a 3-D expert tensor, reading only that expert's bytes.

        Returns:
            ``(ne1, ne0)`` float32.

        Raises:
            ValueError: the tensor is not 3-D. IndexError: ``e`` outside ``0..ne2-1``.
        """
        v = self._decodable_view(name)
        if len(v.info.ne) != 3:
            raise ValueError(f"{self.source}: tensor {name} has ne={v.info.ne}, not an expert tensor (3-D)")
        if not 0 <= e < v.n_slabs:
            raise IndexError(f"{self.source}: expert {e} out of range 0..{v.n_slabs - 1} for {name}")
        return dequantize(self._slab_rows(v, e, e + 1), v.info.qtype, (v.rows, v.info.ne[0]))

    def row(self, name: str, i: int) -> np.ndarray:
        """Row ``i`` of a 2-D tensor (an embedding lookup), reading only that row's bytes.

        Returns:
            ``(ne0,)`` float32.

        Raises:
            ValueError: the tensor is not 2-D. IndexError: ``i`` outside ``0..ne1-1``.
        """
        v = self._decodable_view(name)
        if len(v.info.ne) != 2:
            raise ValueError(f"{self.source}: tensor {name} has ne={v.info.ne}, not a matrix")
        if not 0 <= i < v.rows:
            raise IndexError(f"{self.source}: row {i} out of range 0..{v.rows - 1} for {name}")
        start = v.offset + (v.row0 + i) * v.row_bytes
        return dequantize(self._data[start:start + v.row_bytes], v.info.qtype, (v.info.ne[0],))

    # ---------------------------------------------------------------- summaries
    def quant_mix(self) -> dict[str, tuple[int, int]]:
        """Storage types of all tensors in the file: type name -> (tensor count, bytes), largest first."""
        mix: dict[str, list[int]] = {}
        for t in self._stored.values():
            entry = mix.setdefault(type_name(t.type_id), [0, 0])
            entry[0] += 1
            entry[1] += max(t.nbytes, 0)
        return {k: (c, b) for k, (c, b) in sorted(mix.items(), key=lambda kv: -kv[1][1])}

    def bytes_per_token(self) -> int:
        """Weight bytes read to decode one token, in bytes.

        Every trunk tensor of ``text_arch.tensor_shapes`` in full, except: routed expert tensors count
        ``n_expert_used`` experts, and ``token_embd`` counts one row when ``output.weight`` exists
        (it is then only a lookup; without it, it is also the LM head and counts in full).
        """
        total = 0
        for name in self.text_arch.tensor_shapes(self.hparams):
            if not self.has(name):
                continue
            v = self._view(name)
            if len(v.info.ne) == 3:
                total += self.hparams.n_expert_used * v.rows * v.row_bytes
            elif name == "token_embd.weight" and self.has("output.weight"):
                total += v.row_bytes
            else:
                total += v.info.nbytes
        return total

    # ---------------------------------------------------------------- internals
    def _view(self, name: str) -> _View:
        view = self._views.get(name)
        if view is None:
            t = self._stored.get(name)
            if t is None:
                raise ModelFormatError(f"{self.source}: the file has no tensor {name}")
            view = self._plain_view(t)
            self._views[name] = view
        return view

    def _decodable_view(self, name: str) -> _View:
        view = self._view(name)
        check_supported(view.info.qtype, f"{self.source}: tensor {name}")
        return view

    def _plain_view(self, t: _Stored) -> _View:
        if t.nbytes < 0:
            raise UnsupportedModelError(f"{self.source}: tensor {t.name} has ggml type id {t.type_id}, "
                                        "unknown to this version of gguf")
        qtype = GGMLQuantizationType(t.type_id)
        ne = t.ne
        info = TensorInfo(t.name, qtype, ne, tuple(reversed(ne)), t.nbytes)
        slab_rows = ne[1] if len(ne) > 1 else 1
        return _View(info, t.offset, slab_rows, 0, row_bytes(qtype, ne[0]), int(np.prod(ne[2:], dtype=np.int64)))

    def _split_view(self, base: _View, name: str, row0: int, rows: int) -> _View:
        ne = (base.info.ne[0], rows, *base.info.ne[2:])
        info = TensorInfo(name, base.info.qtype, ne, tuple(reversed(ne)), rows * base.row_bytes * base.n_slabs)
        return _View(info, base.offset, base.slab_rows, row0, base.row_bytes, base.n_slabs)

    def _slab_rows(self, v: _View, s0: int, s1: int) -> np.ndarray:
        """``(s1-s0, rows, row_bytes)`` uint8 view of the view's rows in slabs ``s0 .. s1-1``."""
        slab = v.slab_rows * v.row_bytes
        block = self._data[v.offset + s0 * slab:v.offset + s1 * slab].reshape(s1 - s0, v.slab_rows, v.row_bytes)
        return block[:, v.row0:v.row0 + v.rows, :]

    def _validate(self) -> None:
        """Check every tensor of the architecture's tensor table; register split views of fused tensors."""
        hp, arch = self.hparams, self.text_arch
        for fused, ne, parts in arch.fused_tensors(hp):
            if parts[0][0] not in self._stored:
                self._fused(fused, ne, parts)
        for name, ne in arch.tensor_shapes(hp).items():
            if name in self._views:
                continue
            t = self._stored.get(name)
            if t is None:
                if name in arch.optional_tensors:
                    continue
                raise ModelFormatError(f"{self.source}: required tensor {name} (ne={ne}) is missing "
                                       f"for {self.arch} with {hp.n_layer} layers")
            self._check_shape(t, ne)
            self._views[name] = self._plain_view(t)

    def _fused(self, name: str, ne: tuple[int, ...], parts: list[tuple[str, int]]) -> None:
        """Register ``parts`` (split name, rows per slab) as consecutive row ranges of fused tensor ``name``."""
        t = self._stored.get(name)
        if t is None:
            raise ModelFormatError(f"{self.source}: required tensor {parts[0][0]} (or fused {name} with ne={ne}) "
                                   f"is missing")
        self._check_shape(t, ne)
        base = self._plain_view(t)
        row0 = 0
        for part, rows in parts:
            self._views[part] = self._split_view(base, part, row0, rows)
            row0 += rows

    def _check_shape(self, t: _Stored, ne: tuple[int, ...]) -> None:
        moe_tensor = "_exps." in t.name or t.name.endswith(".ffn_gate_inp.weight")
        if moe_tensor and len(t.ne) == len(ne) and t.ne[:-1] == ne[:-1] and t.ne[-1] != ne[-1]:
            raise UnsupportedModelError(
                f"{self.source}: tensor {t.name} holds {t.ne[-1]} experts but {self.hparams.arch}.expert_count = "
                f"{ne[-1]}; per-layer expert counts are not supported (every layer needs the same count)")
        if t.ne != ne:
            raise ModelFormatError(f"{self.source}: tensor {t.name} has ne={t.ne}, expected ne={ne} "
                                   f"for {self.hparams.arch} with these hyper-parameters")
        check_supported(t.type_id, f"{self.source}: tensor {t.name}")

    def _identity(self) -> str:
        """``gguf-<size>-<sha256 prefix>`` over the header, tensor table and 16 fixed 4 KiB data samples.

        The samples make files with equal headers but different weights (e.g. two synth seeds)
        differ. They are read with file reads, not through the map, so they add nothing to RSS.
        """
        digest = self._header_digest.copy()
        size = self._data.size
        span = size - self._data_start
        with open(self.source, "rb") as fh:
            for k in range(_SAMPLES):
                fh.seek(self._data_start + span * k // _SAMPLES)
                digest.update(fh.read(_SAMPLE_BYTES))
        return f"gguf-{size}-{digest.hexdigest()[:32]}"
