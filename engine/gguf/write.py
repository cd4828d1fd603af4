"""Streaming GGUF writer: metadata records and tensor data written in order, one piece at a time.

Tensor bytes come from :class:`TensorOut` producers that yield pieces, so a file larger than RAM is
written holding one piece. The file is written under an exclusive temporary name beside ``PATH`` and
renamed only once complete. Records: :meth:`engine.gguf.file.GGUFFile.kv_record` (verbatim) or
:func:`kv_record` (new). Design: docs/design/gguf-files.md (the byte layout).
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from .quant import quantize, row_bytes

GGUF_VERSION = 3

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class TensorOut:
    """One tensor to write.

    Attributes:
        name: GGUF tensor name.
        ne: GGUF dims, fastest first.
        type_id: ggml type id (``GGMLQuantizationType`` value), written as stored.
        nbytes: bytes of data; the pieces of ``chunks`` must add up to exactly this.
        chunks: called once while writing; yields the data as C-contiguous arrays or bytes, in order.
    """

    name: str
    ne: tuple[int, ...]
    type_id: int
    nbytes: int
    chunks: Callable[[], Iterable[Any]]


def float_tensors(weights: Mapping[str, Any], types: Mapping[str, tuple[tuple[int, ...], GGMLQuantizationType]],
                  writer: str) -> list[TensorOut]:
    """One :class:`TensorOut` per name of ``types`` (name -> (math shape, storage type)), each float array of
    ``weights`` checked and encoded (F32, F16 or quantized) only when it is written.

    Raises:
        ValueError: a weight missing (here) or of another shape (while writing), naming ``writer``.
    """
    outs = []
    for name, (shape, qtype) in types.items():
        if name not in weights:
            raise ValueError(f"{writer}: weight {name!r} missing")
        ne = tuple(reversed(shape))
        nbytes = row_bytes(qtype, ne[0]) * int(np.prod(ne[1:], dtype=np.int64))

        def chunks(name: str = name, shape: tuple[int, ...] = shape, qtype: GGMLQuantizationType = qtype):
            x = np.asarray(weights[name], dtype=np.float32)
            if x.shape != shape:
                raise ValueError(f"{writer}: weight {name!r} has shape {x.shape}, expected {shape}")
            if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                yield np.ascontiguousarray(x, dtype=np.float32 if qtype == GGMLQuantizationType.F32 else np.float16)
            else:
                yield np.ascontiguousarray(quantize(x, qtype))

        outs.append(TensorOut(name, ne, int(qtype), nbytes, chunks))
    return outs


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(value: Any, vtype: GGUFValueType, sub_type: GGUFValueType | None) -> bytes:
    if vtype in _SCALAR_FORMATS:
        return struct.pack(_SCALAR_FORMATS[vtype], value)
    if vtype == GGUFValueType.STRING:
        return _string(value)
    if vtype == GGUFValueType.ARRAY:
        if sub_type is None or sub_type == GGUFValueType.ARRAY:
            raise ValueError("an array record needs a scalar or string element type")
        items = list(value)
        head = struct.pack("<IQ", int(sub_type), len(items))
        if sub_type == GGUFValueType.STRING:
            return head + b"".join(_string(x) for x in items)
        return head + np.asarray(items, dtype=np.dtype(_SCALAR_FORMATS[sub_type])).tobytes()
    raise ValueError(f"unknown GGUF value type {vtype!r}")


def kv_record(key: str, value: Any, vtype: GGUFValueType, sub_type: GGUFValueType | None = None) -> bytes:
    """Encode one metadata record (u64-length key, u32 value type, value).

    Args:
        key: the full key (``qwen35moe.expert_count``).
        value: a python number / bool / str, or a sequence for an array.
        vtype: the value type; ``sub_type`` is the element type of an ARRAY (scalars or strings).

    Raises:
        ValueError: an unknown type, or an array without a scalar/string element type.
        struct.error: a number out of range of its type.
    """
    return _string(key) + struct.pack("<I", int(vtype)) + _value(value, vtype, sub_type)


def _pad(n: int, alignment: int) -> int:
    return -n % alignment


def write(path: str | os.PathLike[str], records: Sequence[bytes], tensors: Sequence[TensorOut],
          alignment: int = 32, progress: Callable[[int, int], None] | None = None) -> int:
    """Write a GGUF file from metadata records and tensor producers, streaming the data.

    Args:
        path: the output file; written to a new temporary file beside it (see the module doc) and renamed
            when complete (an existing file at ``path`` is replaced only then).
        records: encoded metadata records (:func:`kv_record`, ``GGUFFile.kv_record``), in order. A
            ``general.alignment`` record, if any, must say ``alignment``.
        tensors: the tensors, in file order.
        alignment: data alignment in bytes, a power of two.
        progress: called as ``progress(bytes_done, bytes_total)`` after each piece of tensor data.

    Returns:
        The size of the written file, bytes.

    Raises:
        ValueError: bad alignment, duplicate tensor names, or a producer whose pieces do not add up to
            its ``nbytes`` (the partial file is removed).
        OSError: the folder is not writable or the disk has less free space than the file needs (checked
            before writing); the partial file is removed.
    """
    header, data_bytes = _header(records, tensors, alignment)
    size = len(header) + data_bytes
    out = Path(path)
    folder = out.parent if str(out.parent) else Path(".")
    free = shutil.disk_usage(folder).free
    if free < size:
        raise OSError(f"{out}: needs {size / 2**30:.2f} GiB but the disk has {free / 2**30:.2f} GiB free")
    fd, name = tempfile.mkstemp(dir=folder, prefix=f".{out.name}.", suffix=".part")
    part = Path(name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(header)
            _write_data(fh, tensors, alignment, progress)
        os.replace(part, out)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return size


def _header(records: Sequence[bytes], tensors: Sequence[TensorOut], alignment: int) -> tuple[bytes, int]:
    """(magic + counts + metadata + tensor table, padded to ``alignment``; bytes of the data section).

    Raises:
        ValueError: ``alignment`` not a power of two, or duplicate tensor names.
    """
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in the tensor table")
    table = bytearray()
    offset = 0
    for t in tensors:
        table += _string(t.name) + struct.pack(f"<I{len(t.ne)}QIQ", len(t.ne), *t.ne, t.type_id, offset)
        offset += t.nbytes + _pad(t.nbytes, alignment)
    header = struct.pack("<4sIQQ", b"GGUF", GGUF_VERSION, len(tensors), len(records)) + b"".join(records) + table
    return header + bytes(_pad(len(header), alignment)), offset


def _write_data(fh: Any, tensors: Sequence[TensorOut], alignment: int,
                progress: Callable[[int, int], None] | None) -> None:
    """Stream every tensor's pieces to ``fh``, each tensor padded to ``alignment``.

    Raises:
        ValueError: a producer whose pieces do not add up to its ``nbytes``.
    """
    total_data = sum(t.nbytes for t in tensors)
    done = 0
    for t in tensors:
        written = 0
        for piece in t.chunks():
            buf = memoryview(piece).cast("B") if not isinstance(piece, bytes) else memoryview(piece)
            fh.write(buf)
            written += buf.nbytes
            done += buf.nbytes
            if progress is not None:
                progress(done, total_data)
        if written != t.nbytes:
            raise ValueError(f"tensor {t.name}: its producer gave {written} bytes, expected {t.nbytes}")
        fh.write(bytes(_pad(t.nbytes, alignment)))
