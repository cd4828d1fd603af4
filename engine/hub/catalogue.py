"""The model catalogue shipped with DeltaDesk (``catalogue.json``) and the names of GGUF files.

The catalogue lists public GGUF repositories of the families the engine runs (Qwen3.5/3.6 MoE and dense,
MiniCPM-V 4.6): per repository the quant files and ``mmproj`` files whose names were confirmed, with the
size and sha256 where the hub's listing was seen, and where each was confirmed (``source``). A file the
catalogue does not name comes from the live listing of its repository (:mod:`engine.hub.hubapi`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_QUANT = re.compile(r"(?:UD-)?(?:I?Q\d_[0-9A-Z_]+?|BF16|F16|F32|MXFP4)(?=\.gguf$|-\d{5}-of-\d{5}\.gguf$)",
                    re.IGNORECASE)
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def quant_of(filename: str) -> str:
    """The quant label a GGUF file name carries (``Qwen3.6-35B-A3B-UD-Q4_K_XL.gguf`` -> ``UD-Q4_K_XL``,
    ``MiniCPM-V-4_6-Q8_0.gguf`` -> ``Q8_0``), upper case; "" when it names none."""
    name = filename.rsplit("/", 1)[-1]
    m = _QUANT.search(name)
    return m.group(0).upper() if m else ""


def is_mmproj(filename: str) -> bool:
    """True for a vision tower (projector) file: its name starts with or contains ``mmproj``."""
    return "mmproj" in filename.rsplit("/", 1)[-1].lower()


def is_split(filename: str) -> bool:
    """True for one part of a split GGUF (``...-00001-of-00003.gguf``), which the engine does not load."""
    return _SPLIT.search(filename) is not None


@dataclass(frozen=True)
class HubFile:
    """One file of a hub repository.

    Attributes:
        repo: ``owner/name``. name: the path in the repository. size: bytes, None when not known.
        sha256: the hub's LFS sha256 (hex), None when not known.
    """

    repo: str
    name: str
    size: int | None = None
    sha256: str | None = None

    @property
    def quant(self) -> str:
        """The quant label of the name (:func:`quant_of`)."""
        return quant_of(self.name)


@dataclass(frozen=True)
class CatalogueRepo:
    """A repository in the catalogue: its model files, its ``mmproj`` names, who publishes it and the source."""

    repo: str
    publisher: str
    files: tuple[HubFile, ...]
    mmproj: tuple[str, ...]
    source: str


@dataclass(frozen=True)
class CatalogueModel:
    """A model of the catalogue and the repositories that publish GGUFs of it; ``shape``: the synth preset with
    its real dimensions ("" when none), for :func:`engine.hub.fit.estimate_from_size`."""

    id: str
    name: str
    arch: str
    summary: str
    repos: tuple[CatalogueRepo, ...]
    shape: str = ""

    def matches(self, text: str) -> bool:
        """True when every word of ``text`` is in the model's name, summary or a repository id (any case)."""
        hay = " ".join([self.id, self.name, self.summary, *(r.repo for r in self.repos)]).lower()
        return all(word in hay for word in text.lower().split())


def _repo(entry: dict) -> CatalogueRepo:
    repo = entry["repo"]
    files = tuple(HubFile(repo, f["name"], f.get("size"), f.get("sha256")) for f in entry["files"])
    return CatalogueRepo(repo, entry["publisher"], files, tuple(entry["mmproj"]), entry["source"])


@cache
def catalogue() -> tuple[CatalogueModel, ...]:
    """The shipped catalogue (``engine/hub/catalogue.json``), parsed once."""
    data = json.loads((Path(__file__).with_name("catalogue.json")).read_text(encoding="utf-8"))
    return tuple(CatalogueModel(m["id"], m["name"], m["arch"], m["summary"], tuple(_repo(r) for r in m["repos"]),
                                m.get("shape", "")) for m in data["models"])


def catalogue_repo(repo: str) -> CatalogueRepo | None:
    """The catalogue's entry for ``repo`` (case-insensitive), or None."""
    for model in catalogue():
        for r in model.repos:
            if r.repo.lower() == repo.lower():
                return r
    return None
