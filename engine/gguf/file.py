"""A memory-mapped view of one GGUF file: its metadata and its tensors, nothing about its family.

The header is read by :mod:`engine.gguf.header` (bounds-checked: a hostile or truncated file is a
:class:`~engine.errors.ModelFormatError` naming the file and the key or tensor; opening touches only
the header pages). Tensor data stays in the read-only memory map, or in memory it was read into
(``weights="ram"``, :mod:`engine.gguf.resident`). Which tensors a file must hold is
checked by whoever knows its family (:func:`engine.registry.open_text`, :mod:`engine.gguf.table`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from ..errors import ModelFormatError, UnsupportedModelError
from .header import Header, StoredTensor, read_header
from .quant import check_supported, dequantize, row_bytes, type_name

_SAMPLES = 16                # data samples hashed into GGUFFile.identity
_SAMPLE_BYTES = 4096


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


class GGUFFile:
    """One opened GGUF file, parsed and mapped (see ``docs/interfaces.md``, ``engine.gguf.file``).

    Use :meth:`open`. Tensor data is read lazily from a read-only memory map (or from the memory the file
    was read into); the accessors :meth:`raw`, :meth:`expert` and :meth:`row` touch only the bytes they return.

    Attributes:
        path: the file path (``pathlib.Path``).
        source: ``str(path)``, the file name used in error messages.
        header: the parsed :class:`engine.gguf.header.Header` (``meta``, ``tensors``, ``data``).
        identity: stable id of the file contents (see :meth:`open`).
        tensor_names: the tensors stored in the file, in file order (the split names of a fused
            tensor, see :meth:`split`, are readable but not listed, so sums over this list count each
            stored byte once).
        writable: ``(file size,)`` uint8, the file's bytes in private memory, writable, when it was opened with
            ``weights="ram"``; None when mapped. Every array the accessors hand out is read-only; this is the
            one handle for rewriting weights in place at load (a repacked layout): see :meth:`writable_raw`.
    """

    def __init__(self, path: str | os.PathLike[str], header: Header | None = None, weights: str = "map"):
        """Parse and map (or read, ``weights="ram"``); prefer :meth:`open` (or :meth:`from_header`)."""
        self.path = Path(path)
        self.source = str(path)
        remote = header is not None
        header = header if remote else read_header(self.source, weights)
        self.header = header
        self.writable = header.writable
        self._data, self._meta, self._records = header.data, header.meta, header.records
        self._data_start = header.data_start
        self._header_digest = hashlib.sha256(header.header_bytes)
        self._stored = header.tensors
        self._views: dict[str, _View] = {}
        self.tensor_names = tuple(self._stored)
        if remote:
            self.identity = ""
            return
        try:
            self.identity = self._identity()
        except OSError as e:
            raise ModelFormatError(f"{self.source}: cannot read: {e.strerror or e}") from e

    @classmethod
    def open(cls, path: str | os.PathLike[str], weights: str = "map") -> "GGUFFile":
        """Open and memory-map a GGUF file, checking the magic, version, every count and length in the
        header against the file size, and the tensor data extents. The tensor table is not checked
        against any family here (see :func:`engine.registry.open_text`). ``weights``: "map" (tensor data
        read from the file map on demand) or "ram" (the file read into memory now, see
        :func:`engine.gguf.header.read_header`).

        Raises:
            ModelFormatError: malformed, truncated or inconsistent file; message names file and key/tensor.
            MemoryFitError: "ram" and the file does not fit the available memory.
        """
        return cls(path, weights=weights)

    @property
    def resident(self) -> bool:
        """True when the tensor data was read into memory (``weights="ram"``), False when it is the file map."""
        return self.writable is not None

    def residence(self, a: np.ndarray) -> str:
        """Where the bytes of ``a`` live: "resident" or "mapped" for a view of this file's data, "" otherwise
        (a copy)."""
        if not np.may_share_memory(a, self._data):
            return ""
        return "resident" if self.resident else "mapped"

    @classmethod
    def from_header(cls, header: Header) -> "GGUFFile":
        """Wrap a header parsed from the first bytes of a file that is not here
        (:func:`engine.gguf.header.parse_prefix`): metadata, the tensor table and sizes work; tensor data
        cannot be read and ``identity`` is "".
        """
        return cls(header.source, header)

    def split(self, name: str, parts: list[tuple[str, int]]) -> None:
        """Expose ``parts`` (split name, rows per slab) as consecutive row ranges of the stored tensor
        ``name`` (a converter's fused storage, e.g. ``attn_qkv``): :meth:`raw`, :meth:`f32`, ... then
        read them by their split names.

        Raises:
            ModelFormatError: no tensor ``name`` in the file.
        """
        base = self._view(name)
        row0 = 0
        for part, rows in parts:
            self._views[part] = self._split_view(base, part, row0, rows)
            row0 += rows

    # ---------------------------------------------------------------- metadata
    def meta(self, key: str, default: Any = None) -> Any:
        """Value of a metadata key as python data (str, int, float, bool, or list), ``default`` if absent."""
        return self.header.value(key, default)

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

    def writable_raw(self, name: str) -> np.ndarray | None:
        """The bytes of :meth:`raw` as a writable view of :attr:`writable`, for rewriting them in place (a
        repacked layout; the read-only views of the same tensor then read the new bytes).

        Returns:
            ``(rows, row_bytes)`` uint8, or None when the file is mapped or the tensor's rows are not one
            contiguous range (the split names of a fused ``ffn_gate_up_exps``).
        """
        v = self._view(name)
        if self.writable is None or (v.n_slabs > 1 and v.rows != v.slab_rows):
            return None
        start = v.offset + v.row0 * v.row_bytes
        return self.writable[start:start + v.rows * v.n_slabs * v.row_bytes].reshape(-1, v.row_bytes)

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

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of a 2-D tensor (a prompt's embedding lookup): their bytes gathered, one dequantize.

        Returns:
            ``(len(ids), ne0)`` float32, row j equal to ``row(name, ids[j])``.

        Raises:
            ValueError: the tensor is not 2-D. IndexError: an id outside ``0..ne1-1``.
        """
        v = self._decodable_view(name)
        if len(v.info.ne) != 2:
            raise ValueError(f"{self.source}: tensor {name} has ne={v.info.ne}, not a matrix")
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= v.rows)]
        if bad.size:
            raise IndexError(f"{self.source}: row {int(bad[0])} out of range 0..{v.rows - 1} for {name}")
        if ids.size == 0:
            return np.empty((0, v.info.ne[0]), dtype=np.float32)
        start = v.offset + v.row0 * v.row_bytes
        table = self._data[start:start + v.rows * v.row_bytes].reshape(v.rows, v.row_bytes)
        return dequantize(table[ids], v.info.qtype, (ids.size, v.info.ne[0]))

    # ---------------------------------------------------------------- summaries
    def quant_mix(self) -> dict[str, tuple[int, int]]:
        """Storage types of all tensors in the file: type name -> (tensor count, bytes), largest first."""
        mix: dict[str, list[int]] = {}
        for t in self._stored.values():
            entry = mix.setdefault(type_name(t.type_id), [0, 0])
            entry[0] += 1
            entry[1] += max(t.nbytes, 0)
        return {k: (c, b) for k, (c, b) in sorted(mix.items(), key=lambda kv: -kv[1][1])}

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

    def _plain_view(self, t: StoredTensor) -> _View:
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

    def _identity(self) -> str:
        """``gguf-<size>-<sha256 prefix>`` over the header, tensor table and 16 fixed 4 KiB data samples.

        The samples make files with equal headers but different weights (e.g. two synth seeds)
        differ. They are read with file reads, not through the map, so they add nothing to RSS (from memory when
        the file was read into it, so its page cache stays dropped).
        """
        digest = self._header_digest.copy()
        size = self._data.size
        span = size - self._data_start
        starts = [self._data_start + span * k // _SAMPLES for k in range(_SAMPLES)]
        if self.resident:
            for start in starts:
                digest.update(self._data[start:start + _SAMPLE_BYTES].tobytes())
            return f"gguf-{size}-{digest.hexdigest()[:32]}"
        with open(self.source, "rb") as fh:
            for start in starts:
                fh.seek(start)
                digest.update(fh.read(_SAMPLE_BYTES))
        return f"gguf-{size}-{digest.hexdigest()[:32]}"
