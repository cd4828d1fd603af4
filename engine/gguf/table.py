"""The tensor-table check every model file passes: a text model's and a projector's alike.

A family states its table (tensor name -> GGUF ``ne``); this module checks a file's stored tensors
against it without knowing the family. Extra stored tensors are allowed (MTP blocks, unknown extras).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from ..errors import ModelFormatError
from .header import StoredTensor
from .quant import check_supported

Explain = Callable[[StoredTensor, tuple[int, ...]], Exception | None]
"""``(stored tensor, expected ne) -> error or None``: a family's clearer error for a shape mismatch."""


def check_tensors(source: str, stored: Mapping[str, StoredTensor], table: Mapping[str, tuple[int, ...]],
                  optional: Collection[str] = (), context: str = "", explain: Explain | None = None,
                  trailing_ones: bool = False) -> None:
    """Check that every tensor of ``table`` is stored with exactly that ``ne`` and a supported type.

    With ``trailing_ones`` a stored ``ne`` may carry 1s past the expected rank (projector converters
    write ``(n, 1)`` for a vector; their loaders reshape). ``context`` ends each message (e.g.
    " for qwen35moe with 4 layers").

    Raises:
        ModelFormatError: a tensor not in ``optional`` is missing, or has another ``ne``; names ``source``.
        UnsupportedModelError: a tensor's storage type cannot be read, or what ``explain`` returns.
    """
    for name, ne in table.items():
        t = stored.get(name)
        if t is None:
            if name in optional:
                continue
            raise ModelFormatError(f"{source}: missing tensor {name!r} (expected ne={ne}){context}")
        check_shape(source, t, ne, context, explain, trailing_ones)


def check_shape(source: str, t: StoredTensor, ne: tuple[int, ...], context: str = "",
                explain: Explain | None = None, trailing_ones: bool = False) -> None:
    """Check one stored tensor against its expected ``ne`` and its type (see :func:`check_tensors`)."""
    found = t.ne
    while trailing_ones and len(found) > len(ne) and found[-1] == 1:
        found = found[:-1]
    if found != ne:
        error = explain(t, ne) if explain is not None else None
        if error is not None:
            raise error
        raise ModelFormatError(f"{source}: tensor {t.name!r} has ne={t.ne}, expected ne={ne}{context}")
    check_supported(t.type_id, f"{source}: tensor {t.name!r}")
