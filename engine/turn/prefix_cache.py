"""Prefix snapshot cache for the recurrent state.

A Gated DeltaNet state cannot be rolled back, so the sequence state is checkpointed at chosen positions
and a prompt resumes from the deepest snapshot whose prefix it shares. Keys are a hash chain over model
identity, token ids and image digests. A snapshot holds the recurrent state, the position, the logits and
its KV rows after the last whole page; earlier rows are pages shared by prefix (:mod:`engine.turn.kv_pages`).
RAM tier (byte budget, LRU) and a validated disk tier (:mod:`engine.turn.snapshot`); a bad file is a miss.
A periodic (``interval``) snapshot is thinned once a later turn extends its prefix (:meth:`PrefixCache.put`).
Design: docs/design/prefix-cache.md (retention); docs/design/kv-cache.md; docs/design/hostile-inputs.md.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .kv_pages import PAGE_ROWS, PageStore
from .snapshot import FORMAT_VERSION, encode, read_file, write_atomic
from .state import HasStateLayout, SequenceState, kv_dtype

log = logging.getLogger(__name__)

_DIGEST = 16  # bytes of each blake2b key
_SNAP_NAME = re.compile(r"[0-9a-f]{32}\.snap")   # the only names the cache opens
_STALE_TMP_S = 600.0   # a temporary file this old is a crashed write's, not one in flight


def _is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file (not followed if it is a link)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def chain_keys(identity: str, tokens: Sequence[int], images: Mapping[int, bytes] | None = None) -> list[bytes]:
    """The hash chain of a token sequence.

    Args:
        identity: the model file's identity (``GGUFFile.identity``).
        tokens: (n,) token ids.
        images: position -> content digest of the image whose embedding occupies that position
            (each image-pad token of an image carries its image's digest).

    Returns:
        n + 1 keys of 16 bytes; ``keys[i]`` names the prefix ``tokens[:i]``.
    """
    images = images or {}
    keys = [hashlib.blake2b(identity.encode(), digest_size=_DIGEST).digest()]
    pack = struct.Struct("<q").pack
    for i, t in enumerate(tokens):
        h = hashlib.blake2b(keys[-1], digest_size=_DIGEST)
        h.update(pack(int(t)))
        img = images.get(i)
        if img is not None:
            h.update(img)
        keys.append(h.digest())
    return keys


@dataclass
class Snapshot:
    """One checkpoint of a sequence state.

    Attributes:
        key: chain key of the prefix (16 bytes).
        pos: tokens read (the prefix length).
        tokens: (pos,) int32 the prefix's token ids (to find where a new prompt diverges).
        images: position -> image digest inside the prefix (see :func:`chain_keys`).
        arrays: state arrays by name: ``conv.{il}`` (K-1, conv_dim), ``ssm.{il}`` (n_v, dk, dv) float32,
            ``k.{il}`` / ``v.{il}`` (pos - PAGE_ROWS * len(pages), n_kv, head_dim) of the KV type (the rows
            after the pages); ``logits`` (n_vocab,) float32 of the last position when known.
        pages: chain keys of the KV pages holding rows [0, PAGE_ROWS * len(pages)) (:mod:`engine.turn.kv_pages`).
        conversation: the conversation it was taken in (for the app's list), or "".
        created / last_used: ``time.time()`` seconds.
        hits: how many times it was restored.
        tier: "ram" or "disk".
        nbytes: size of its own arrays and tokens (not the shared pages), bytes.
        has_logits: whether ``arrays`` holds the last position's logits.
        interval: taken only because ``snapshot_interval`` tokens passed (not at a message start, a branch
            point or a prompt's end): thinned once a later turn extends it (:meth:`PrefixCache.put`).
        turn: the :attr:`Lookup.turn` that took it (-1: read from disk, another process's or an earlier one's).
    """

    key: bytes
    pos: int
    tokens: np.ndarray
    arrays: dict[str, np.ndarray] | None
    images: dict[int, bytes] = field(default_factory=dict)
    conversation: str = ""
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    hits: int = 0
    tier: str = "ram"
    nbytes: int = 0
    has_logits: bool = False
    pages: list[bytes] = field(default_factory=list)
    interval: bool = False
    turn: int = -1


@dataclass(frozen=True)
class SnapshotInfo:
    """What the app lists per snapshot.

    Attributes:
        key: hex chain key (use it with :meth:`PrefixCache.clear`).
        conversation: conversation id it was taken in, or "".
        pos: prefix length, tokens.
        nbytes: size of the snapshot, bytes.
        age_s: seconds since it was taken.
        hits: times restored.
        tier: "ram" or "disk".
    """

    key: str
    conversation: str
    pos: int
    nbytes: int
    age_s: float
    hits: int
    tier: str


@dataclass(frozen=True)
class Lookup:
    """Result of :meth:`PrefixCache.lookup`.

    Attributes:
        state: the restored state (position = reused), or a fresh one when nothing matched.
        reused: prompt tokens covered by the snapshot (0 on a miss).
        logits: (n_vocab,) float32 logits at ``reused`` when the snapshot covers the whole prompt.
        restore_ms: time spent restoring, ms.
        diverge: the first position where the prompt leaves every cached path (>= reused): the
            runtime snapshots there so the next branch from the same point is reused.
        turn: a number new at every lookup, naming the turn that made it; pass it to :meth:`PrefixCache.put`.
    """

    state: SequenceState
    reused: int
    logits: np.ndarray | None
    restore_ms: float
    diverge: int
    turn: int = 0


def state_arrays(state: SequenceState, start: int = 0) -> dict[str, np.ndarray]:
    """Compact copies of a state's arrays: KV rows ``[start, state.pos)`` only (see :class:`Snapshot`)."""
    out: dict[str, np.ndarray] = {}
    for il, a in state.conv.items():
        out[f"conv.{il}"] = a.copy()
    for il, a in state.ssm.items():
        out[f"ssm.{il}"] = a.copy()
    for il, a in state.k.items():
        out[f"k.{il}"] = a[start: state.pos].copy()
    for il, a in state.v.items():
        out[f"v.{il}"] = a[start: state.pos].copy()
    return out


def restore_state(hp: HasStateLayout, arrays: Mapping[str, np.ndarray], pos: int, capacity: int,
                  kv_type: str = "f32", pages: Sequence[Mapping[str, np.ndarray]] = ()) -> SequenceState:
    """A new :class:`SequenceState` of ``capacity`` tokens and KV type ``kv_type`` holding a snapshot's
    arrays at ``pos``: the KV rows of ``pages`` (PAGE_ROWS each, in order), then the snapshot's own rows.

    Raises:
        ValueError: an array is missing or has the wrong shape, or KV rows of another type (a snapshot of
            another model or cache).
    """
    state = SequenceState.new(hp, capacity, kv_type)
    for kind, table in (("conv", state.conv), ("ssm", state.ssm)):
        for il, dst in table.items():
            src = arrays[f"{kind}.{il}"]
            if src.shape != dst.shape:
                raise ValueError(f"{kind}.{il} has shape {src.shape}, expected {dst.shape}")
            dst[...] = src
    start = PAGE_ROWS * len(pages)
    for kind, table in (("k", state.k), ("v", state.v)):
        for il, dst in table.items():
            src = arrays[f"{kind}.{il}"]
            if src.shape != (pos - start,) + dst.shape[1:] or src.dtype != dst.dtype:
                raise ValueError(f"{kind}.{il} is {src.dtype} {src.shape}, expected {dst.dtype} "
                                 f"{(pos - start,) + dst.shape[1:]}")
            for p, page in enumerate(pages):
                dst[p * PAGE_ROWS:(p + 1) * PAGE_ROWS] = page[f"{kind}.{il}"]
            dst[start:pos] = src
    state.pos = pos
    return state


def snapshot_folder(disk_dir: str | Path, identity: str, kv_type: str = "f32") -> Path:
    """The disk tier's subfolder of the model file whose identity is ``identity`` (``GGUFFile.identity``) and
    of KV type ``kv_type``: files are named by prefix alone, so each KV type keeps its own (F32: the bare
    digest, F16: the digest and ``-f16``)."""
    folder = hashlib.blake2b(identity.encode(), digest_size=8).hexdigest()
    return Path(disk_dir) / (folder if kv_type == "f32" else f"{folder}-{kv_type}")


class PrefixCache:
    """Snapshots of one model's sequence state, keyed by prefix hash chains.

    Args:
        hp: the model's hyper-parameters (state shapes).
        identity: the model file's identity; part of every key and of every disk file.
        ram_budget: bytes of snapshots kept in RAM (LRU beyond it).
        disk_dir: folder of the disk tier (None = RAM only); a subfolder per model identity.
        disk_budget: bytes of snapshot files kept on disk (oldest used removed beyond it).
        kv_type: the KV type of the states it takes and builds (:data:`engine.turn.state.KV_TYPES`); each type has
            its own subfolder (:func:`snapshot_folder`), and a file of another KV type is ignored like a foreign one.

    Thread-safe: every public method holds one lock, so the app may list or clear snapshots
    while a turn is running on another thread.
    """

    def __init__(self, hp: HasStateLayout, identity: str, ram_budget: int = 2 << 30,
                 disk_dir: Path | None = None, disk_budget: int = 8 << 30, kv_type: str = "f32") -> None:
        kv_dtype(kv_type)
        self.hp = hp
        self.identity = identity
        self.kv_type = kv_type
        self.ram_budget = ram_budget
        self.disk_budget = disk_budget
        self._entries: OrderedDict[bytes, Snapshot] = OrderedDict()
        self._lock = threading.RLock()
        self._turns = itertools.count(1)
        self._disk: Path | None = None
        if disk_dir is not None:
            self._disk = snapshot_folder(disk_dir, identity, kv_type)
        self._pages = PageStore(hp.state_layout(), identity, kv_type, self._disk)
        if self._disk is not None:
            self._scan_disk()

    # ---- lookup and restore -------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], capacity: int, images: Mapping[int, bytes] | None = None,
               keys: list[bytes] | None = None) -> Lookup:
        """Find the deepest snapshot whose prefix ``tokens`` starts with, and restore it.

        Args:
            tokens: (n,) prompt token ids.
            capacity: context window of the state to build, tokens.
            images: position -> image digest (see :func:`chain_keys`).
            keys: the prompt's chain keys when already computed.

        Returns:
            A :class:`Lookup`; on a miss ``reused`` is 0 and the state is fresh.
        """
        with self._lock:
            t0 = time.perf_counter()
            turn = next(self._turns)
            images = dict(images or {})
            keys = keys or chain_keys(self.identity, tokens, images)
            n = len(tokens)
            for pos in range(n, 0, -1):
                snap = self._entries.get(keys[pos])
                if snap is None or snap.pos != pos:
                    continue
                if pos == n and not snap.has_logits:
                    continue
                if pos >= capacity:
                    continue       # taken with a larger context window than this state holds
                from_disk = snap.arrays is None
                arrays = self._load_arrays(snap)
                pages = None if arrays is None else self._pages.load(snap.pages)
                if arrays is None or pages is None:
                    self._forget(snap)
                    continue
                try:
                    state = restore_state(self.hp, arrays, pos, capacity, self.kv_type, pages)
                except (KeyError, ValueError) as exc:   # cannot happen for a checked file: a miss all the same
                    log.warning("prefix cache: dropping snapshot %s: %s", snap.key.hex(), exc)
                    self._forget(snap)
                    continue
                if from_disk:
                    self._evict(keep=snap.key)
                snap.hits += 1
                snap.last_used = time.time()
                self._entries.move_to_end(snap.key)
                logits = arrays.get("logits") if pos == n else None
                return Lookup(state, pos, None if logits is None else logits.copy(),
                              (time.perf_counter() - t0) * 1e3, self._diverge(tokens, images, pos), turn)
            return Lookup(SequenceState.new(self.hp, capacity, self.kv_type), 0, None, (time.perf_counter() - t0) * 1e3,
                          self._diverge(tokens, images, 0), turn)

    def contains(self, key: bytes) -> bool:
        """Whether a snapshot is held (RAM or disk) under chain key ``key``."""
        with self._lock:
            return key in self._entries

    def _diverge(self, tokens: Sequence[int], images: Mapping[int, bytes], start: int) -> int:
        """Longest prefix of ``tokens`` (with ``images``) shared with any cached path, >= ``start``."""
        best = start
        arr = np.asarray(tokens, dtype=np.int64)
        for snap in self._entries.values():
            m = min(len(arr), snap.pos)
            if m <= best:
                continue
            diff = np.flatnonzero(arr[:m] != snap.tokens[:m])
            lcp = int(diff[0]) if diff.size else m
            for p in set(images) | set(snap.images):
                if p < lcp and images.get(p) != snap.images.get(p):
                    lcp = p
            best = max(best, lcp)
        return best

    # ---- taking snapshots ---------------------------------------------------------------

    def put(self, key: bytes, state: SequenceState, tokens: Sequence[int], logits: np.ndarray | None,
            images: Mapping[int, bytes] | None = None, conversation: str = "",
            keys: Sequence[bytes] | None = None, *, turn: int | None = None, interval: bool = False) -> Snapshot:
        """Checkpoint ``state`` (at ``state.pos`` = len(tokens)) under chain key ``key``; given a ``turn``, thin:
        every ``interval`` snapshot of another turn whose prefix ``tokens`` extends is dropped (RAM, file, pages).

        Args:
            key: chain key of ``tokens``.
            state: the sequence state after reading ``tokens``.
            tokens: (pos,) the prefix token ids.
            logits: (n_vocab,) float32 logits of the last position, or None.
            images: position -> image digest of the images inside the prefix.
            conversation: conversation id for the app's list.
            keys: the chain keys of ``tokens`` (or of a sequence that starts with them) when known; they name
                its KV pages (computed here otherwise).
            turn: the :attr:`Lookup.turn` of the turn whose prompt this is; it thins the interval snapshots of
                other turns on this path. None (a read-ahead, an answer's end): nothing is thinned.
            interval: taken only for ``snapshot_interval`` (see :class:`Snapshot`); an earlier non-interval
                snapshot under ``key`` stays one.

        Returns:
            The new (or refreshed) snapshot.

        Raises:
            ValueError: ``state`` keeps KV rows of another type than the cache's.
        """
        if state.kv_type != self.kv_type:
            raise ValueError(f"a state of KV type {state.kv_type} put into a cache of {self.kv_type}")
        with self._lock:
            old = self._entries.get(key)
            if old is not None and old.tier == "ram" and (logits is None or old.has_logits):
                old.last_used = time.time()
                if old.interval and not interval:
                    old.interval = False
                    self._remove_file(old)      # its file says "interval"; the next spill writes it anew
                self._entries.move_to_end(key)
                return old
            n_pages = state.pos // PAGE_ROWS
            if n_pages and (keys is None or len(keys) <= n_pages * PAGE_ROWS):
                keys = chain_keys(self.identity, tokens, images)
            pages = [keys[(p + 1) * PAGE_ROWS] for p in range(n_pages)] if keys is not None else []
            arrays = state_arrays(state, n_pages * PAGE_ROWS)
            if logits is not None:
                arrays["logits"] = np.asarray(logits, dtype=np.float32).copy()
            snap = Snapshot(key=key, pos=state.pos, tokens=np.asarray(tokens, dtype=np.int32).copy(),
                            arrays=arrays, images={p: d for p, d in (images or {}).items() if p < state.pos},
                            conversation=conversation,
                            nbytes=sum(a.nbytes for a in arrays.values()) + 4 * len(tokens),
                            has_logits=logits is not None, pages=pages, turn=-1 if turn is None else turn,
                            interval=interval and (old is None or old.interval))
            self._pages.attach(key, pages, state)
            if old is not None and old.tier == "disk":
                self._remove_file(old)
            self._entries[key] = snap
            self._entries.move_to_end(key)
            if turn is not None:
                self._thin(snap.pos, turn, keys if keys is not None else chain_keys(self.identity, tokens, images))
            self._evict()
            return snap

    def _thin(self, pos: int, turn: int, keys: Sequence[bytes]) -> None:
        """Drop every interval snapshot not of ``turn`` on the path ``keys`` (chain keys: same tokens and
        images) before ``pos``: a later turn's prompt went past it, and a resume from that path starts at a
        message start, a branch point or a prompt's end, which are kept (docs/design/prefix-cache.md,
        retention)."""
        for snap in [s for s in self._entries.values() if s.interval and s.turn != turn and s.pos < pos]:
            if snap.pos < len(keys) and keys[snap.pos] == snap.key:
                self._drop(snap)

    def _evict(self, keep: bytes | None = None) -> None:
        """Move least recently used RAM snapshots to disk (or drop them) beyond the RAM budget, never ``keep``
        (the one a lookup is restoring), then trim the disk tier."""
        ram = [s for s in self._entries.values() if s.tier == "ram" and s.key != keep]
        for snap in ram:  # least recently used first
            if self._ram_used() <= self.ram_budget:
                break
            if self._disk is not None and self._write(snap):
                snap.arrays = None
                snap.tier = "disk"
            else:
                self._drop(snap)
            self._pages.release_ram({k for s in self._entries.values() if s.tier == "ram" for k in s.pages})
        self._trim_disk()

    def _ram_used(self) -> int:
        """Bytes of the RAM snapshots' own arrays and of the pages held in RAM."""
        return sum(s.nbytes for s in self._entries.values() if s.tier == "ram") + self._pages.ram_bytes()

    def _drop(self, snap: Snapshot) -> None:
        """Remove ``snap`` from RAM and disk (see :meth:`_forget`)."""
        self._remove_file(snap)
        self._forget(snap)

    def _forget(self, snap: Snapshot) -> list[bytes]:
        """Drop ``snap``'s entry (its file, if any, stays: an unusable one is ignored at every scan) and its
        references to pages; returns the keys of the page files removed with their last owner."""
        self._entries.pop(snap.key, None)
        return self._pages.detach(snap.key, snap.pages)

    def persist(self) -> None:
        """Write every RAM snapshot to the disk tier too (e.g. when the app closes)."""
        with self._lock:
            if self._disk is None:
                return
            for snap in list(self._entries.values()):
                if snap.tier == "ram":
                    self._write(snap)
            self._trim_disk()

    # ---- the app's view -----------------------------------------------------------------

    def snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot, deepest first."""
        with self._lock:
            now = time.time()
            return [SnapshotInfo(s.key.hex(), s.conversation, s.pos, s.nbytes, now - s.created, s.hits, s.tier)
                    for s in sorted(self._entries.values(), key=lambda s: -s.pos)]

    def clear(self, key: str | None = None) -> None:
        """Drop one snapshot (hex key from :meth:`snapshots`) or all of them, RAM and disk."""
        with self._lock:
            targets: Iterable[Snapshot]
            if key is None:
                targets = list(self._entries.values())
            else:
                snap = self._entries.get(bytes.fromhex(key))
                targets = [snap] if snap is not None else []
            for snap in targets:
                self._drop(snap)

    @property
    def ram_bytes(self) -> int:
        """Bytes of snapshots held in RAM, their KV pages included (each page once)."""
        with self._lock:
            return self._ram_used()

    # ---- disk tier ----------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        assert self._disk is not None
        return self._disk / f"{key.hex()}.snap"

    def _write(self, snap: Snapshot) -> bool:
        """Atomically write ``snap`` (:func:`engine.turn.snapshot.write_atomic`). Returns False on an OS error."""
        assert self._disk is not None and snap.arrays is not None
        path = self._path(snap.key)
        if _is_regular(path):
            return True
        if not self._pages.write(snap.pages):
            return False
        meta = {"version": FORMAT_VERSION, "identity": self.identity, "key": snap.key.hex(), "pos": snap.pos,
                **({"pages": [k.hex() for k in snap.pages]} if snap.pages else {}),
                "images": {str(p): d.hex() for p, d in snap.images.items()},
                "conversation": snap.conversation, "created": snap.created, "hits": snap.hits,
                **({"interval": True} if snap.interval else {})}
        try:
            write_atomic(path, encode(meta, snap.tokens, snap.arrays))
        except OSError as exc:
            log.warning("prefix cache: cannot write %s: %s", path, exc)
            return False
        return True

    def _read(self, path: Path, with_arrays: bool = True) -> tuple[dict, np.ndarray, dict | None] | None:
        """Stream, parse and verify one snapshot file (:func:`engine.turn.snapshot.read_file`); None (with a
        log line) when it is not usable: vanished, not a regular file, damaged, foreign."""
        parsed = read_file(path, self.hp, self.identity, with_arrays, self.kv_type)
        if isinstance(parsed, str):
            log.warning("prefix cache: ignoring %s: %s", path, parsed)
            return None
        return parsed

    def _listing(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of the folder's regular files named like snapshots, oldest first; a file
        that vanishes while listed, a link, FIFO, device, folder or stray name is left out."""
        assert self._disk is not None
        out = []
        try:
            with os.scandir(self._disk) as entries:
                for entry in entries:
                    if not _SNAP_NAME.fullmatch(entry.name):
                        continue
                    try:
                        if entry.is_file(follow_symlinks=False):
                            st = entry.stat(follow_symlinks=False)
                            out.append((st.st_mtime, st.st_size, Path(entry.path)))
                    except OSError:
                        continue          # removed by another process meanwhile
        except OSError as exc:
            if not isinstance(exc, FileNotFoundError):
                log.warning("prefix cache: cannot read the folder %s: %s", self._disk, exc)
            return []
        return sorted(out, key=lambda t: t[0])

    def _sweep_temporary(self) -> None:
        """Remove temporary files of writes that crashed: regular ``*.tmp`` files older than
        ``_STALE_TMP_S`` (a younger one may be another process's write in flight)."""
        assert self._disk is not None
        now = time.time()
        try:
            with os.scandir(self._disk) as entries:
                for entry in entries:
                    try:
                        if (entry.name.endswith(".tmp") and entry.is_file(follow_symlinks=False)
                                and now - entry.stat(follow_symlinks=False).st_mtime > _STALE_TMP_S):
                            os.unlink(entry.path)
                    except OSError:
                        continue
        except OSError:
            return

    def _scan_disk(self) -> None:
        """List the valid snapshot files of the folder and sweep stale temporary files (a crashed write's).

        Never raises: an unreadable folder or file is logged and skipped."""
        assert self._disk is not None
        self._sweep_temporary()
        for _, size, path in self._listing():
            parsed = self._read(path, with_arrays=False)
            if parsed is None:
                continue
            meta, tokens, _ = parsed
            try:
                images = {int(p): bytes.fromhex(d) for p, d in meta.get("images", {}).items()}
            except ValueError as exc:   # a digest that is not hex
                log.warning("prefix cache: ignoring %s: %s", path, exc)
                continue
            chain = chain_keys(self.identity, tokens.tolist(), images)
            key = chain[-1]
            pages = [bytes.fromhex(k) for k in meta.get("pages", [])]
            if (path.stem != key.hex() or meta.get("key") != key.hex()
                    or pages != [chain[(p + 1) * PAGE_ROWS] for p in range(len(pages))]):
                log.warning("prefix cache: ignoring %s: its key does not match its contents", path)
                continue
            self._entries[key] = Snapshot(
                key=key, pos=meta["pos"], tokens=tokens, arrays=None, images=images,
                conversation=meta.get("conversation", ""), created=float(meta.get("created", 0.0)),
                hits=int(meta.get("hits", 0)), tier="disk", nbytes=size,
                has_logits="logits" in meta["arrays"], pages=pages, interval=meta.get("interval") is True)
            self._pages.attach(key, pages)
        self._pages.sweep()

    def _load_arrays(self, snap: Snapshot) -> dict[str, np.ndarray] | None:
        """The snapshot's arrays, read from its file when it is on disk (it is then a RAM snapshot, the most
        recently used, so trimming spares it); None when the file vanished or is not usable."""
        if snap.arrays is not None:
            return snap.arrays
        if self._disk is None:
            return None
        parsed = self._read(self._path(snap.key))
        if parsed is None or parsed[2] is None:
            return None
        snap.arrays, snap.tier = parsed[2], "ram"
        self._entries.move_to_end(snap.key)
        return parsed[2]

    def _remove_file(self, snap: Snapshot) -> None:
        if self._disk is not None:
            try:
                self._path(snap.key).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("prefix cache: cannot remove %s: %s", self._path(snap.key), exc)

    def _trim_disk(self) -> None:
        """Remove the folder's oldest snapshot files until they and the page files fit the disk budget (a page
        file goes with its last snapshot); files removed by another process meanwhile are simply gone."""
        if self._disk is None:
            return
        files = self._listing()
        page_sizes = {bytes.fromhex(p.stem): size for _, size, p in self._pages.disk_files()}
        used = sum(size for _, size, _ in files) + sum(page_sizes.values())
        for _, size, p in files:
            if used <= self.disk_budget:
                break
            used -= size
            try:
                p.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("prefix cache: cannot remove %s: %s", p, exc)
                continue
            snap = self._entries.get(bytes.fromhex(p.stem))
            if snap is not None and snap.tier == "disk":
                used -= sum(page_sizes.get(k, 0) for k in self._forget(snap))
