"""Fit before download, then download: a file's header from a ranged read, the fit, the transfer with
progress, cancel and resume, the sha256 check, and the move into the store.

The transfer is a ranged GET through ``huggingface_hub``'s HTTP session of the file's resolved URL
(``get_hf_file_metadata`` follows the hub's redirect), appending to a staging file under ``.partial`` from
its current length, each network read as it arrives (a cancel ends a stalled read at once): a download
that was cancelled, cut off or stopped by a full disk resumes where it stopped, at the next call or in
this call's own retries. Once the bytes are all there the file's
sha256 is compared with the hub's LFS sha256; a mismatch deletes the staging file. Only then is the
file moved into the store (:class:`~engine.hub.store.ModelStore`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self
from urllib.parse import urlsplit

from ..gguf.file import GGUFFile
from ..registry import load_text
from ..gguf.header import Header, HeaderIncomplete, parse_prefix
from .catalogue import HubFile, catalogue_repo
from .fit import Fit, Machine, estimate
from .hubapi import HubError, RepoListing, endpoint, hub_errors, read_range, token
from .store import Downloaded, ModelStore

if TYPE_CHECKING:
    import httpx2

FIRST_READ = 4 << 20
"""Bytes of the first ranged read of a header (a Qwen3.5/3.6 header with its vocabulary is ~12 MiB)."""
MAX_HEADER_READ = 256 << 20
"""The most bytes read to find the end of a header."""
DISK_MARGIN = 64 << 20
"""Free disk kept beyond the bytes a download still needs."""
_HASH_CHUNK = 8 << 20
_RETRIES = 5
"""Connection attempts in a row that may fail without a byte of progress before a transfer gives up."""


class DownloadCancelled(HubError):
    """The download was cancelled; what was downloaded is kept and the next pull resumes it."""


@dataclass(frozen=True)
class Progress:
    """Where a download stands: ``stage`` "downloading" or "verifying", bytes ``done`` of ``total`` of
    ``file``, ``rate`` in bytes/s (this session's), ``eta`` in seconds (None when unknown)."""

    file: str
    stage: str
    done: int
    total: int
    rate: float
    eta: float | None


Report = Callable[[Progress], None]


def remote_header(repo: str, f: HubFile, revision: str) -> Header:
    """The parsed GGUF header of a hub file from ranged reads of its start: :data:`FIRST_READ` bytes, more
    while the header goes on (up to :data:`MAX_HEADER_READ`).

    Raises:
        HubError: the reads failed, or the header is larger than :data:`MAX_HEADER_READ`.
        ModelFormatError: the header is malformed or claims tensor data past the file's listed size.
    """
    if not f.size:
        raise HubError(f"{repo}/{f.name}: the hub lists no size for the file")
    data = b""
    want = min(FIRST_READ, f.size)
    while True:
        data += read_range(repo, f.name, revision, len(data), want)
        try:
            return parse_prefix(data, f.size, f"{repo}/{f.name}")
        except HeaderIncomplete as exc:
            if exc.needed > MAX_HEADER_READ:
                raise HubError(f"{repo}/{f.name}: the GGUF header is larger than {MAX_HEADER_READ >> 20} MiB "
                               "(corrupt or not a model file)") from exc
            want = min(f.size, max(exc.needed, 2 * len(data)))


def fit_remote(listing: RepoListing, f: HubFile, mmproj: HubFile | None, context: int, machine: Machine) -> Fit:
    """The fit of a hub file and its mmproj from their headers, before downloading them.

    Raises:
        UnsupportedModelError: an architecture or projector type the engine does not run.
        ModelFormatError / HubError: see :func:`remote_header`.
    """
    text = load_text(GGUFFile.from_header(remote_header(listing.repo, f, listing.commit)))
    mm = _tower_header(listing.repo, mmproj, listing.commit) if mmproj is not None else None
    return estimate(text, f.size or 0, context, machine, mm)


@functools.lru_cache(maxsize=4)
def _tower_header(repo: str, f: HubFile, revision: str) -> Header:
    """:func:`remote_header` of a vision tower, kept for the next file's fit: every quant of a repository is
    fitted with the same tower, which would otherwise be read once per quant (failures are not kept)."""
    return remote_header(repo, f, revision)


def pick_mmproj(listing: RepoListing) -> HubFile | None:
    """The repo's vision tower to download with a model: the catalogue's first named one that is listed,
    else an F16 one, else the first listed; None when the repo has none."""
    named = catalogue_repo(listing.repo)
    by_name = {f.name: f for f in listing.mmproj}
    for name in named.mmproj if named is not None else ():
        if name in by_name:
            return by_name[name]
    f16 = [f for f in listing.mmproj if "f16" in f.name.lower() and "bf16" not in f.name.lower()]
    return (f16 or list(listing.mmproj) or [None])[0]


def pick_file(listing: RepoListing, file: str | None = None, quant: str | None = None) -> HubFile:
    """The model file ``file`` (its name) or ``quant`` (its label, any case) names in the listing.

    Raises:
        HubError: no such file or quant (the message lists those there are).
    """
    models = listing.models
    hits = ([f for f in models if file in (f.name, Path(f.name).name)] if file
            else [f for f in models if f.quant == (quant or "").upper()])
    if len(hits) == 1:
        return hits[0]
    have = ", ".join(f"{f.quant or '?'} ({f.name})" for f in models)
    split = f"; split files are not supported: {', '.join(listing.split[:3])}" if listing.split else ""
    what = f"file {file!r}" if file else f"quant {quant!r}"
    raise HubError(f"{listing.repo}: no single {what}; it has: {have or 'no loadable model file'}{split}")


class _Bar:
    """Counts the bytes of a transfer, reports them, and stops it by raising :class:`DownloadCancelled` when
    ``cancel`` is set."""

    def __init__(self, name: str, report: Report | None, cancel: threading.Event | None, **kw: object) -> None:
        self.name, self.report, self.cancel = name, report, cancel
        self.total = int(kw.get("total") or 0)
        self.start = self.done = int(kw.get("initial") or 0)
        self.t0, self.last = time.monotonic(), 0.0       # the first bytes are reported at once

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def cancelled(self) -> DownloadCancelled:
        """The error that says the download was cancelled and what is kept."""
        return DownloadCancelled(f"{self.name}: download cancelled; {self.done / 2**20:.1f} MiB kept, the next pull "
                                 "resumes it")

    def restart(self) -> None:
        """The server ignored the range: the count starts again from 0."""
        self.start = self.done = 0

    def update(self, n: int = 1) -> None:
        """Count ``n`` more bytes; report at most 10 times a second and at the end.

        Raises:
            DownloadCancelled: ``cancel`` is set (checked before the bytes are counted and written).
        """
        if self.cancel is not None and self.cancel.is_set():
            raise self.cancelled()
        self.done += n
        now = time.monotonic()
        if self.report is not None and (now - self.last >= 0.1 or self.done >= self.total):
            self.last = now
            rate = (self.done - self.start) / max(now - self.t0, 1e-6)
            eta = (self.total - self.done) / rate if rate > 0 else None
            self.report(Progress(self.name, "downloading", self.done, self.total, rate, eta))


def _verify(path: Path, f: HubFile, report: Report | None, cancel: threading.Event | None) -> None:
    """Compare the sha256 of ``path`` with the hub's; on a mismatch delete it and raise HubError."""
    digest = hashlib.sha256()
    done, t0 = 0, time.monotonic()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            if cancel is not None and cancel.is_set():
                raise DownloadCancelled(f"{f.name}: cancelled while checking the sha256; the file is kept")
            digest.update(chunk)
            done += len(chunk)
            if report is not None:
                rate = done / max(time.monotonic() - t0, 1e-6)
                report(Progress(f.name, "verifying", done, f.size or done, rate, ((f.size or done) - done) / rate))
    if digest.hexdigest() != f.sha256:
        path.unlink(missing_ok=True)
        raise HubError(f"{f.repo}/{f.name}: sha256 mismatch (got {digest.hexdigest()[:16]}..., the hub lists "
                       f"{(f.sha256 or '')[:16]}...): the download was corrupt and has been deleted; pull again")


def _transfer(f: HubFile, commit: str, part: Path, report: Report | None, cancel: threading.Event | None) -> None:
    """Append the rest of ``f`` to ``part`` (resuming from its length); a dropped or stalled connection is
    retried from what arrived, up to :data:`_RETRIES` times in a row without progress."""
    import httpx2
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(f.repo, f.name, revision=commit, endpoint=endpoint())
    tok = token() or False
    with hub_errors(f"{f.repo}/{f.name}"):
        meta = get_hf_file_metadata(url, token=tok, endpoint=endpoint())
    headers = build_hf_headers(token=tok)
    target = meta.location or url
    if urlsplit(target).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)
    part.touch()
    bar = _Bar(f.name, report, cancel, total=f.size, initial=part.stat().st_size)
    failures = 0
    try:
        while (have := part.stat().st_size) < (f.size or 0):
            why: HubError | None = None
            try:
                with hub_errors(f"{f.repo}/{f.name}"):
                    _stream(target, headers, part, f.size or 0, bar, cancel)
            except DownloadCancelled:
                raise
            except HubError as exc:
                if cancel is not None and cancel.is_set():
                    raise bar.cancelled() from exc
                if not isinstance(exc.__cause__, httpx2.TransportError):
                    raise
                why = exc
            failures = 0 if part.stat().st_size > have else failures + 1
            if failures > _RETRIES:
                raise why or HubError(f"{f.repo}/{f.name}: the server ends the transfer at byte {have} of {f.size} "
                                      "without sending more")
            if why is not None:
                (cancel or threading.Event()).wait(1.0)
    except DownloadCancelled:
        raise
    except HubError as exc:
        raise HubError(f"{exc}; {part.stat().st_size / 2**20:.1f} MiB downloaded are kept in {part.parent}, the next "
                       "pull resumes") from exc
    except OSError as exc:
        kept = f"{part.stat().st_size / 2**20:.1f}" if part.exists() else "0"
        why = "the disk is full" if exc.errno == errno.ENOSPC else f"the transfer failed ({exc})"
        raise HubError(f"{f.repo}/{f.name}: {why}; {kept} MiB downloaded are kept in {part.parent}: free space "
                       "and pull again to resume") from exc


def _stream(url: str, headers: dict[str, str], part: Path, size: int, bar: _Bar,
            cancel: threading.Event | None) -> None:
    """One GET of bytes ``[len(part), size)`` of ``url``, appended to ``part`` as they arrive. A server that
    ignores the range starts the file over. Each chunk is flushed before it is reported, so progress and the
    staging file's length agree. Setting ``cancel`` shuts the socket, so a stalled read ends at once.

    Raises:
        DownloadCancelled: ``cancel`` was set. httpx2 errors: the connection failed, stalled past the timeout
            or was cut. HfHubHTTPError: an HTTP error status. OSError: the file could not be written.
    """
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session, hf_raise_for_status

    have = part.stat().st_size
    ranged = {**headers, "Accept-Encoding": "identity", **({"Range": f"bytes={have}-"} if have else {})}
    timeout = httpx2.Timeout(constants.HF_HUB_DOWNLOAD_TIMEOUT)
    with get_session().stream("GET", url, headers=ranged, follow_redirects=True, timeout=timeout) as response, \
            _shut_on(cancel, response):
        hf_raise_for_status(response)
        if response.status_code != 206 and have:
            os.truncate(part, 0)
            bar.restart()
            have = 0
        with open(part, "ab") as fh:
            for chunk in response.iter_bytes():
                chunk = chunk[:size - have]
                fh.write(chunk)
                fh.flush()
                bar.update(len(chunk))
                have += len(chunk)
                if have >= size:
                    return
    if cancel is not None and cancel.is_set():
        raise bar.cancelled()


@contextlib.contextmanager
def _shut_on(cancel: threading.Event | None, response: httpx2.Response) -> Iterator[None]:
    """While the block runs, a watcher shuts ``response``'s socket down when ``cancel`` is set (a blocked read
    then returns at once; ``close`` alone would not wake it)."""
    if cancel is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if cancel.wait(0.05):
                stream = response.extensions.get("network_stream")
                sock = stream.get_extra_info("socket") if stream is not None else None
                with contextlib.suppress(OSError):
                    if sock is not None:
                        sock.shutdown(socket.SHUT_RDWR)
                return
    watcher = threading.Thread(target=watch, name="hub-cancel", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()


def _fetch(store: ModelStore, commit: str, f: HubFile, report: Report | None, cancel: threading.Event | None) -> Path:
    """Download, verify and move one file into the store; returns its path."""
    if not f.sha256 or not f.size:
        raise HubError(f"{f.repo}/{f.name}: the hub lists no sha256 or size for it, so it could not be verified")
    part = store.partial(f.repo, f.name, f.sha256)
    part.parent.mkdir(parents=True, exist_ok=True)
    with _only_one(part, f):
        if part.is_symlink() or (part.exists() and (not part.is_file() or part.stat().st_size > f.size)):
            part.unlink()
        _transfer(f, commit, part, report, cancel)
        _verify(part, f, report, cancel)
        dest = store.path(f.repo, f.name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, dest)
    return dest


@contextlib.contextmanager
def _only_one(part: Path, f: HubFile) -> Iterator[None]:
    """Hold the lock file beside ``part`` while the block runs, so that two downloads of one file (two
    windows, the app and ``engine pull``) never append to the same staging file.

    Raises:
        HubError: another download of the file holds the lock.
    """
    import filelock
    lock = filelock.FileLock(f"{part}.lock", timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout as exc:
        raise HubError(f"{f.repo}/{f.name} is already being downloaded (by another window or `engine pull`); "
                       "wait for that download or cancel it, then try again") from exc
    try:
        yield
    finally:
        lock.release()


def check_disk(store: ModelStore, files: list[HubFile]) -> None:
    """Raise HubError unless the store's disk has room for what ``files`` still need (beyond their staging
    files) plus :data:`DISK_MARGIN`."""
    need = 0
    for f in files:
        part = store.partial(f.repo, f.name, f.sha256 or "")
        need += (f.size or 0) - (part.stat().st_size if part.exists() else 0)
    store.root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(store.root).free
    if need + DISK_MARGIN > free:
        raise HubError(f"not enough free disk in {store.root}: the download needs {need / 2**30:.2f} GiB more, "
                       f"{free / 2**30:.2f} GiB are free (set DELTADESK_MODELS_DIR to use another disk)")


def download_model(listing: RepoListing, f: HubFile, mmproj: HubFile | None, store: ModelStore | None = None,
             report: Report | None = None, cancel: threading.Event | None = None) -> Downloaded:
    """Download model ``f`` and its ``mmproj`` into the store; a file already there and recorded (the model
    with the same sha256) is kept, not fetched again.

    Raises:
        HubError: see :func:`hub_errors`; no room on the disk; a sha256 mismatch (the file is deleted); a
            transfer cut off (what arrived is kept for the next call).
        DownloadCancelled: ``cancel`` was set (what arrived is kept).
    """
    store = store or ModelStore()
    mine = [d for d in store.models() if d.repo.lower() == listing.repo.lower()]
    have_mm = mmproj is not None and store.path(listing.repo, mmproj.name).is_file() and any(
        d.mmproj == mmproj.name for d in mine)
    have_f = any(d.file == f.name and d.sha256 == f.sha256 and store.path(d.repo, d.file).stat().st_size == f.size
                 for d in mine)
    todo = [x for x in (None if have_f else f, None if have_mm else mmproj) if x is not None]
    check_disk(store, todo)
    for x in todo:
        _fetch(store, listing.commit, x, report, cancel)
    entry = Downloaded(listing.repo, f.name, f.quant, f.size or 0, f.sha256 or "", listing.commit,
                       mmproj.name if mmproj is not None else "", time.time())
    store.add(entry)
    return entry
