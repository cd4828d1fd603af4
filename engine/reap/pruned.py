"""The pruned GGUF file: the experts chosen by :mod:`engine.reap.prune` kept, the rest sliced out, streamed.

The router ``ffn_gate_inp`` keeps the rows and every routed expert tensor the slabs of the kept experts
(the reference's ``prune()`` in CerebrasResearch/reap ``src/reap/prune.py`` does the same on the torch
modules); ``expert_count`` becomes the kept count, ``expert_used_count`` (top-k) stays, shared experts
are not touched, and a ``general.pruning`` JSON note records what was done.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from ..gguf import write as gguf_write
from ..errors import ModelFormatError, UnsupportedModelError
from ..gguf.file import GGUFFile
from ..registry import LoadedText
from .prune import check_keep

PRUNING_KEY = "general.pruning"
"""Metadata key of the note a pruned file carries: a JSON object (see :func:`prune_file`)."""

_EXPERT_TENSOR_SUFFIXES = ("_exps.weight", "_exps.bias", "_exps.scale")


def _layer_of(name: str) -> int | None:
    if not name.startswith("blk."):
        return None
    head = name.split(".", 2)[1]
    return int(head) if head.isdigit() else None


def is_expert_tensor(name: str) -> bool:
    """Whether ``name`` is indexed by routed expert along its last dim: the router ``ffn_gate_inp`` and
    the routed expert tensors ``ffn_*_exps`` (shared-expert tensors ``*_shexp`` are not)."""
    base = name.split(".", 2)[2] if _layer_of(name) is not None else name
    return base == "ffn_gate_inp.weight" or base.endswith(_EXPERT_TENSOR_SUFFIXES)


def pruning_note(gguf: GGUFFile) -> dict[str, Any] | None:
    """The ``general.pruning`` note of a file written by :func:`prune_file` as a dict, or None.

    A note that is not a JSON object is returned as ``{"note": text}``.
    """
    raw = gguf.meta(PRUNING_KEY)
    if raw is None:
        return None
    try:
        note = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError:
        note = None
    return note if isinstance(note, dict) else {"note": str(raw)}


def pruning_summary(text: LoadedText) -> str:
    """One line for a banner: ``"128 of 256 experts kept (REAP)"``, or "" for a file without the note."""
    note = pruning_note(text.file)
    if note is None:
        return ""
    before, method = note.get("experts_before"), note.get("method")
    if isinstance(before, int) and text.hparams.is_moe:
        how = f" ({str(method).upper() if method == 'reap' else method})" if method else ""
        return f"{text.hparams.n_expert} of {before} experts kept{how}"
    return "experts pruned"


def prune_file(text: LoadedText, out: str | os.PathLike[str], kept: Sequence[Sequence[int]],
               note: Mapping[str, Any], progress: Callable[[int, int], None] | None = None) -> int:
    """Write the model ``text`` with only the experts ``kept`` of each layer, streaming tensor by tensor.

    Every tensor that is not indexed by routed expert (:func:`is_expert_tensor`) is copied byte for byte
    in its stored type; the router ``ffn_gate_inp`` keeps the rows and each routed expert tensor the
    slabs (last GGUF dim) of the kept experts, in ascending order, in their stored quant type. Metadata
    records are copied verbatim except ``{arch}.expert_count`` (the kept count) and the new
    ``general.pruning`` JSON note (``note`` plus ``experts_before``, ``experts_kept`` and the kept indices
    per layer). MTP blocks (layers ``>= n_layer``), for which no statistics exist, are dropped with
    ``nextn_predict_layers`` set to 0, so the file keeps one expert count throughout.

    Args:
        kept: per trunk layer, the expert indices to keep; every layer the same count.
        note: method, calibration size and similar, recorded in ``general.pruning``.
        progress: ``progress(bytes_done, bytes_total)`` while writing.

    Returns: the size of the written file, bytes.

    Raises:
        ValueError: ``kept`` has the wrong number of layers, unequal counts, repeated or out-of-range indices.
        ModelFormatError: ``out`` is the source file, or an expert tensor whose last dim is not expert_count.
        UnsupportedModelError: a dense model, or a tensor of a type unknown to ggml (its size is unknown).
        OSError: the output cannot be written (see :func:`engine.gguf.write.write`).
    """
    n_keep = _check_kept(text, kept)
    gguf = text.file
    out = Path(out)
    if out.exists() and out.resolve() == gguf.path.resolve():
        raise ModelFormatError(f"{out}: the output must not be the model being pruned")
    return gguf_write.write(out, _pruned_records(text, kept, n_keep, note), _pruned_tensors(text, kept, n_keep),
                            gguf.alignment, progress)


def _check_kept(text: LoadedText, kept: Sequence[Sequence[int]]) -> int:
    """The expert count every layer keeps, after checking ``kept`` (see :func:`prune_file`'s Raises)."""
    hp = text.hparams
    if not hp.is_moe:
        raise UnsupportedModelError(f"{text.source}: {hp.arch} is a dense model: it has no experts to prune")
    if len(kept) != hp.n_layer:
        raise ValueError(f"kept lists {len(kept)} layers, the model has {hp.n_layer}")
    counts = {len(k) for k in kept}
    if len(counts) != 1:
        raise ValueError(f"every layer must keep the same number of experts, got {sorted(counts)}")
    n_keep = counts.pop()
    check_keep(n_keep, hp.n_expert, hp.n_expert_used)
    for il, k in enumerate(kept):
        if len(set(k)) != len(k) or not all(0 <= e < hp.n_expert for e in k):
            raise ValueError(f"layer {il}: kept experts {list(k)} must be distinct indices in 0..{hp.n_expert - 1}")
    return n_keep


def _pruned_records(text: LoadedText, kept: Sequence[Sequence[int]], n_keep: int,
                    note: Mapping[str, Any]) -> list[bytes]:
    """The source's metadata records, verbatim but for the expert count, the pruning note and (MTP dropped)
    the block count."""
    hp, gguf = text.hparams, text.file
    a = hp.arch
    replaced = {
        f"{a}.expert_count": gguf_write.kv_record(f"{a}.expert_count", n_keep, GGUFValueType.UINT32),
        PRUNING_KEY: gguf_write.kv_record(PRUNING_KEY, json.dumps(
            {**note, "experts_before": hp.n_expert, "experts_kept": n_keep,
             "kept": [sorted(int(e) for e in k) for k in kept]}, separators=(",", ":")), GGUFValueType.STRING),
    }
    if hp.nextn_predict_layers:
        replaced[f"{a}.block_count"] = gguf_write.kv_record(f"{a}.block_count", hp.n_layer, GGUFValueType.UINT32)
        replaced[f"{a}.nextn_predict_layers"] = gguf_write.kv_record(f"{a}.nextn_predict_layers", 0,
                                                                     GGUFValueType.UINT32)
    records = [replaced.pop(key, None) or gguf.kv_record(key) for key in gguf.meta_keys]
    return records + list(replaced.values())


def _pruned_tensors(text: LoadedText, kept: Sequence[Sequence[int]], n_keep: int) -> list[gguf_write.TensorOut]:
    """Every trunk tensor in file order: expert tensors cut to the kept slabs, the rest copied as stored."""
    hp, gguf = text.hparams, text.file
    tensors = []
    for name in gguf.tensor_names:
        il = _layer_of(name)
        if il is not None and il >= hp.n_layer:
            continue
        info = gguf.info(name)
        if il is not None and is_expert_tensor(name):
            if info.ne[-1] != hp.n_expert:
                raise ModelFormatError(f"{gguf.source}: tensor {name} has ne={info.ne}; its last dim should be "
                                       f"expert_count = {hp.n_expert}")
            ne = (*info.ne[:-1], n_keep)
            tensors.append(gguf_write.TensorOut(name, ne, int(info.qtype), info.nbytes // hp.n_expert * n_keep,
                                                lambda n=name, k=kept[il]: _expert_slabs(gguf, n, k, hp.n_expert)))
        else:
            tensors.append(gguf_write.TensorOut(name, info.ne, int(info.qtype), info.nbytes,
                                                lambda n=name: (gguf.raw(n).reshape(-1),)))
    return tensors


def _expert_slabs(gguf: GGUFFile, name: str, kept: Sequence[int], n_expert: int) -> Iterable[np.ndarray]:
    """The stored bytes of experts ``kept`` of tensor ``name`` (of ``n_expert``), one expert (a view of the
    map) at a time."""
    slabs = gguf.raw(name).reshape(n_expert, -1)
    for e in sorted(kept):
        yield slabs[e]
