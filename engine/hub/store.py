"""Downloaded models on disk: where they live, the index of what is there, and ``REPO:QUANT`` names.

Layout under :func:`models_dir` (the user data dir's ``models``, or ``DELTADESK_MODELS_DIR``)::

    <owner>/<name>/<file>.gguf          a verified model file
    <owner>/<name>/<mmproj>.gguf        its vision tower, beside it (shared by the quants of one repo)
    .partial/<owner>/<name>/<file>.<sha256[:16]>.part   a download under way or cut off (resumed later)
    index.json                          one record per model file (:class:`Downloaded`)

Only files that passed the sha256 check are moved out of ``.partial`` and recorded, so a partial or
corrupt file never reaches the loader. Nothing here talks to the network: downloaded models work offline.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import platformdirs

from ..errors import EngineError
from .catalogue import quant_of

INDEX = "index.json"


def models_dir() -> Path:
    """The folder downloaded models live in: ``DELTADESK_MODELS_DIR`` when set, else
    ``platformdirs.user_data_dir("deltadesk")/models``."""
    return Path(os.environ.get("DELTADESK_MODELS_DIR") or Path(platformdirs.user_data_dir("deltadesk")) / "models")


@dataclass(frozen=True)
class Downloaded:
    """One downloaded model file.

    Attributes:
        repo: ``owner/name``. file: its path in the repository. quant: the quant label of the name.
        size: bytes. sha256: the verified hex digest. commit: the hub commit it was downloaded at.
        mmproj: the vision tower's file name in the repository ("" when none). downloaded, last_used: unix
        seconds (last_used 0: never loaded).
    """

    repo: str
    file: str
    quant: str
    size: int
    sha256: str
    commit: str
    mmproj: str = ""
    downloaded: float = 0.0
    last_used: float = 0.0

    @property
    def name(self) -> str:
        """``repo:quant`` (``repo:file`` when the name carries no quant label)."""
        return f"{self.repo}:{self.quant or self.file}"


class ModelStore:
    """The downloaded models under ``root`` (default :func:`models_dir`) and their index."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else models_dir()

    def folder(self, repo: str) -> Path:
        """Where ``repo``'s files go."""
        return self.root.joinpath(*repo.split("/"))

    def path(self, repo: str, file: str) -> Path:
        """The local path of ``file`` of ``repo`` (its base name, in the repo's folder)."""
        return self.folder(repo) / Path(file).name

    def partial(self, repo: str, file: str, sha256: str) -> Path:
        """The staging path of a download of ``file`` whose hub sha256 is ``sha256``."""
        return self.root.joinpath(".partial", *repo.split("/"), f"{Path(file).name}.{sha256[:16]}.part")

    def models(self) -> list[Downloaded]:
        """The recorded models whose file is still there, most recently used (or downloaded) first."""
        found = [d for d in self._read() if self.path(d.repo, d.file).is_file()]
        return sorted(found, key=lambda d: -max(d.last_used, d.downloaded))

    def add(self, entry: Downloaded) -> None:
        """Record ``entry`` (replacing a record of the same repo and file)."""
        rest = [d for d in self._read() if (d.repo.lower(), d.file) != (entry.repo.lower(), entry.file)]
        self._write([*rest, entry])

    def touch(self, entry: Downloaded) -> None:
        """Set ``entry``'s last-used time to now."""
        self.add(replace(entry, last_used=time.time()))

    def files(self, entry: Downloaded) -> tuple[Path, Path | None]:
        """(model path, mmproj path or None) of a recorded model."""
        mmproj = self.path(entry.repo, entry.mmproj) if entry.mmproj else None
        return self.path(entry.repo, entry.file), mmproj if mmproj is not None and mmproj.is_file() else None

    def delete(self, entry: Downloaded) -> list[Path]:
        """Remove a model's file, and its mmproj when no other recorded model of the repo uses it; returns the
        paths removed."""
        others = [d for d in self._read() if (d.repo.lower(), d.file) != (entry.repo.lower(), entry.file)]
        removed = [self.path(entry.repo, entry.file)]
        if entry.mmproj and not any(d.repo.lower() == entry.repo.lower() and d.mmproj == entry.mmproj for d in others):
            removed.append(self.path(entry.repo, entry.mmproj))
        for p in removed:
            p.unlink(missing_ok=True)
        self._write(others)
        return removed

    def resolve(self, spec: str) -> Downloaded:
        """The downloaded model ``spec`` names: ``REPO:QUANT`` (``unsloth/Qwen3.6-35B-A3B-GGUF:UD-Q4_K_XL``),
        ``REPO:FILE``, or ``REPO`` alone when one file of it is downloaded. Case-insensitive.

        Raises:
            EngineError: nothing downloaded matches (the message lists what is, and the pull command).
        """
        repo, _, want = spec.partition(":")
        mine = [d for d in self.models() if d.repo.lower() == repo.lower()]
        hits = [d for d in mine if not want or want.upper() in (d.quant, d.file.upper(), Path(d.file).name.upper())]
        if len(hits) == 1:
            return hits[0]
        pull = f"engine pull {repo}" + (f" --quant {want}" if want and quant_of(f"x-{want}.gguf") else "")
        if not hits and not mine:
            raise EngineError(f"{spec}: not downloaded; fetch it with `python -m {pull}` (`python -m engine models` "
                              "lists what is downloaded)")
        have = ", ".join(d.name for d in mine)
        if hits:
            raise EngineError(f"{spec} names several downloaded files: {have} (name one as REPO:QUANT)")
        raise EngineError(f"{spec} is not downloaded (from {repo}: {have}); fetch it with `python -m {pull}`")

    def _read(self) -> list[Downloaded]:
        try:
            data = json.loads((self.root / INDEX).read_text(encoding="utf-8"))
            return [Downloaded(**d) for d in data["models"]]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise EngineError(f"{self.root / INDEX}: unreadable model index ({exc}); move it aside to start "
                              "a new one (the model files stay)") from exc

    def _write(self, entries: list[Downloaded]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{INDEX}.tmp"
        tmp.write_text(json.dumps({"models": [asdict(d) for d in entries]}, indent=1), encoding="utf-8")
        os.replace(tmp, self.root / INDEX)


def looks_like_repo(arg: str) -> bool:
    """True when a ``--model`` argument is a hub name (``owner/name`` or ``owner/name:QUANT``) rather than a
    path: not an existing file, one slash before any colon, no ``.gguf`` ending."""
    if Path(arg).exists() or arg.lower().endswith(".gguf"):
        return False
    repo = arg.partition(":")[0]
    return repo.count("/") == 1 and all(repo.split("/")) and not arg.startswith(("/", "."))


def model_files(arg: str, store: ModelStore | None = None) -> tuple[Path, Path | None] | None:
    """The (model, mmproj or None) files of a ``--model`` argument that names a downloaded model, marking it
    used; None when ``arg`` is a path.

    Raises:
        EngineError: a hub name that is not downloaded (see :meth:`ModelStore.resolve`).
    """
    if not looks_like_repo(arg):
        return None
    store = store or ModelStore()
    entry = store.resolve(arg)
    store.touch(entry)
    return store.files(entry)


def delete_model(entry: Downloaded, store: ModelStore | None = None,
                 snapshot_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Delete a downloaded model (see :meth:`ModelStore.delete`) and its prefix snapshots in ``snapshot_dir``
    (the engine's ``cache_disk_dir``: the subfolders of the file's identity, one per KV type,
    :func:`engine.turn.prefix_cache.snapshot_folder`);
    returns the paths removed. A file that no longer opens has no snapshots to find; only the file goes."""
    import shutil

    from ..gguf.file import GGUFFile
    from ..turn.prefix_cache import snapshot_folder
    from ..turn.state import KV_TYPES
    store = store or ModelStore()
    path = store.path(entry.repo, entry.file)
    removed: list[Path] = []
    if snapshot_dir is not None and path.is_file():
        try:
            identity = GGUFFile.open(path).identity
        except EngineError:
            identity = None
        for folder in [] if identity is None else [snapshot_folder(snapshot_dir, identity, t) for t in KV_TYPES]:
            if folder.is_dir():
                shutil.rmtree(folder)
                removed.append(folder)
    return removed + store.delete(entry)
