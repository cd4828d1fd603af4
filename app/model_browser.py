"""The model browser: the catalogue and any hub repository, whether each file fits this machine, downloads
with progress, cancel and resume, and the downloaded models (open, delete with their snapshots).

Fit marks come from :mod:`engine.hub`: from a catalogue file's size and its model's shapes until its
repository is listed live (a typed ``owner/name``, or "Check fit"), then from each file's header, read with
ranged requests before anything is downloaded. Hub calls, and the first measurement of this machine's
memory bandwidth (about two seconds), run on threads of their own; their results come back as Qt signals
of :class:`_Bridge`, so nothing network- or measurement-bound runs on the GUI thread. Those threads hold
the bridge and plain data, never the dialog (:mod:`app.thread_bridge`).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QAbstractItemView, QDialog, QHBoxLayout, QHeaderView, QLabel, QLineEdit,
                               QMessageBox, QProgressBar, QPushButton, QTableWidget, QTableWidgetItem, QVBoxLayout)

from engine import hub
from engine.errors import EngineError

from .thread_bridge import ThreadBridge

GIB = 1 << 30
COLUMNS = ("Model / file", "Quant", "Size", "Fit", "RAM needed", "Decode (estimate)", "Publisher")
MARKS = {"fits": "\u2714 fits", "tight": "\u25cb tight", "does not fit": "\u2716 does not fit"}


@dataclass
class Row:
    """One file the browser offers: its repo and file, its catalogue model (None for a typed repo), and its
    fit with where the fit came from ("size" or "header"), or why its header says it cannot be used."""

    file: hub.HubFile
    model: hub.CatalogueModel | None
    publisher: str
    fit: hub.Fit | None = None
    basis: str = ""
    error: str = ""


class _Bridge(ThreadBridge):
    """Signals the hub threads emit; they arrive queued on the GUI thread."""

    listed = Signal(str, object, object, object)      # repo, RepoListing, {name: Fit}, {name: error}
    progress = Signal(object)                          # hub.Progress
    done = Signal(object)                              # hub.Downloaded
    failed = Signal(str, bool)                         # message, whether it was the download that failed
    measured = Signal(object)                          # hub.Machine
    deleted = Signal(str, int)                         # model name, paths removed


class _MachineCell:
    """This machine as the hub threads see it: ``get`` waits (at most ``timeout`` seconds) for the measurement
    and returns it, or None when it failed or has not ended."""

    def __init__(self, machine: hub.Machine | None) -> None:
        self._machine = machine
        self._ready = threading.Event()
        if machine is not None:
            self._ready.set()

    def set(self, machine: hub.Machine | None) -> None:
        self._machine = machine
        self._ready.set()

    def get(self, timeout: float) -> hub.Machine | None:
        self._ready.wait(timeout)
        return self._machine


def _size_fit(model: hub.CatalogueModel | None, f: hub.HubFile, context: int, machine: hub.Machine) -> hub.Fit | None:
    if model is None or not model.shape or not f.size:
        return None
    try:
        return hub.estimate_from_size(model.arch, model.shape, f.size, context, machine)
    except (EngineError, ValueError):
        return None


class ModelBrowser(QDialog):
    """The browser dialog.

    Args:
        machine: what fits are computed for (None: this machine, measured on a thread; the fits appear then).
        context: context window of the fits, tokens. snapshot_dir: the engine's snapshot folder (deleting a
        model deletes its snapshots there). store: the downloaded models (default store).

    Signals:
        open_requested(str, str): model path and mmproj path ("" when none) to load.
        status(str): a line for the main window's status bar.
    """

    open_requested = Signal(str, str)
    status = Signal(str)

    def __init__(self, parent=None, machine: hub.Machine | None = None, context: int = 8192,
                 snapshot_dir: Path | None = None, store: hub.ModelStore | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Models")
        self.resize(980, 620)
        self.machine = machine
        self._machine_cell = _MachineCell(machine)
        self.context = context
        self.snapshot_dir = snapshot_dir
        self.store = store or hub.ModelStore()
        self.rows: list[Row] = []
        self.cancel: threading.Event | None = None
        self.bridge = _Bridge(self)
        self.bridge.listed.connect(self._listed)
        self.bridge.progress.connect(self._progress)
        self.bridge.done.connect(self._downloaded)
        self.bridge.failed.connect(self._failed)
        self.bridge.measured.connect(self._measured)
        self.bridge.deleted.connect(self._deleted)
        self._build()
        self._catalogue_rows()
        self.refresh_downloaded()
        if machine is None:
            self._measure()

    # ---- layout ------------------------------------------------------------------------------------
    def _build(self) -> None:
        col = QVBoxLayout(self)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search the catalogue, or type a hub repo (owner/name) and press Enter")
        self.search.setAccessibleName("Search models")
        self.search.textChanged.connect(self._filter)
        self.search.returnPressed.connect(self._search_entered)
        col.addWidget(self.search)
        self.machine_line = QLabel()
        self.machine_line.setWordWrap(True)
        self._machine_text()
        col.addWidget(self.machine_line)
        token_row = QHBoxLayout()
        self.token = QLineEdit()
        self.token.setEchoMode(QLineEdit.Password)
        self.token.setPlaceholderText("Hugging Face token for gated repos (HF_TOKEN wins when set); kept in the "
                                      "system keyring")
        self.token.setAccessibleName("Hugging Face token")
        self.save_token_button = QPushButton("Save token")
        self.save_token_button.clicked.connect(self.save_token)
        token_row.addWidget(self.token, 1)
        token_row.addWidget(self.save_token_button)
        col.addLayout(token_row)
        self.table = self._table(COLUMNS)
        self.table.itemSelectionChanged.connect(self._update_buttons)
        col.addWidget(self.table, 3)
        buttons = QHBoxLayout()
        self.check_button = QPushButton("Check fit (read headers)")
        self.check_button.clicked.connect(self.check_selected)
        self.download_button = QPushButton("Download")
        self.download_button.clicked.connect(self.download_selected)
        self.cancel_button = QPushButton("Cancel download")
        self.cancel_button.clicked.connect(self.cancel_download)
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Download progress")
        self.progress_label = QLabel("")
        for w in (self.check_button, self.download_button, self.cancel_button):
            buttons.addWidget(w)
        buttons.addWidget(self.progress, 1)
        col.addLayout(buttons)
        col.addWidget(self.progress_label)
        col.addWidget(QLabel("Downloaded (stored in " + str(self.store.root) + "):"))
        self.downloaded = self._table(("Model", "Quant", "Size", "Last used", "Vision tower"))
        self.downloaded.itemSelectionChanged.connect(self._update_buttons)
        col.addWidget(self.downloaded, 2)
        row = QHBoxLayout()
        self.open_button = QPushButton("Open")
        self.open_button.clicked.connect(self.open_selected)
        self.delete_button = QPushButton("Delete")
        self.delete_button.clicked.connect(self.delete_selected)
        row.addStretch(1)
        row.addWidget(self.open_button)
        row.addWidget(self.delete_button)
        col.addLayout(row)
        self._update_buttons()

    def _machine_text(self) -> None:
        m = self.machine
        head = (f"This machine: {m.ram_bytes / GIB:.1f} GiB RAM, stream read {m.bandwidth_gbps:.1f} GB/s"
                if m is not None else "This machine: measuring its memory bandwidth for the fit estimates\u2026")
        self.machine_line.setText(
            f"{head}; fits at {self.context} tokens of context. Decode speeds are estimates (stream read x the "
            "measured roofline fraction); \u201c(size)\u201d marks come from the file size until its header is read.")

    def _measure(self) -> None:
        """Measure this machine on a thread (the bandwidth is cached after the first time)."""
        cell, bridge = self._machine_cell, self.bridge

        def body() -> None:
            try:
                machine = hub.this_machine()
            except Exception:  # noqa: BLE001 - no measurement: fits from RAM alone would mislead, so none
                machine = None
            cell.set(machine)
            if machine is not None:
                bridge.measured.emit(machine)
        bridge.start(body, "hub-measure")

    def _measured(self, machine: hub.Machine) -> None:
        """The machine is known: fill the size fits of the rows not yet read from a header."""
        self.machine = machine
        self._machine_text()
        for r in self.rows:
            if r.basis == "size":
                r.fit = _size_fit(r.model, r.file, self.context, machine)
        self._show_rows()

    def _table(self, headers: tuple[str, ...]) -> QTableWidget:
        t = QTableWidget(0, len(headers))
        t.setHorizontalHeaderLabels(headers)
        t.setSelectionBehavior(QAbstractItemView.SelectRows)
        t.setSelectionMode(QAbstractItemView.SingleSelection)
        t.setEditTriggers(QAbstractItemView.NoEditTriggers)
        t.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        t.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        t.verticalHeader().hide()
        return t

    def save_token(self) -> None:
        """Keep the typed token in the system keyring (:data:`engine.hub.KEYRING_SERVICE`); without a keyring,
        for this session only (as ``HF_TOKEN``)."""
        value = self.token.text().strip()
        try:
            import keyring
            if value:
                keyring.set_password(hub.KEYRING_SERVICE, hub.KEYRING_USER, value)
            elif keyring.get_password(hub.KEYRING_SERVICE, hub.KEYRING_USER) is not None:
                keyring.delete_password(hub.KEYRING_SERVICE, hub.KEYRING_USER)
            self.status.emit("Hugging Face token saved in the system keyring" if value else "Token removed")
        except Exception as exc:  # noqa: BLE001 - no keyring: keep it for this session
            os.environ["HF_TOKEN"] = value
            self.status.emit(f"No system keyring ({type(exc).__name__}): the token is kept until DeltaDesk quits")
        self.token.clear()

    # ---- the available files -----------------------------------------------------------------------
    def _catalogue_rows(self) -> None:
        for model in hub.catalogue():
            for repo in model.repos:
                for f in repo.files:
                    fit = _size_fit(model, f, self.context, self.machine) if self.machine is not None else None
                    self.rows.append(Row(f, model, repo.publisher, fit, "size"))
        self._show_rows()

    def _show_rows(self) -> None:
        """Fill the table from ``rows`` (recommended file of each model starred), then filter it."""
        recommended = self._recommended()
        self.table.setRowCount(len(self.rows))
        for i, r in enumerate(self.rows):
            name = f"{r.model.name if r.model else r.file.repo}: {r.file.name}"
            star = "\u2605 recommended" if id(r) in recommended else ""
            fit = r.fit
            cells = (name, r.file.quant or "?", f"{r.file.size / GIB:.2f} GiB" if r.file.size else "?",
                     (f"{MARKS[fit.verdict]} ({r.basis}) {star}".strip() if fit
                      else "\u2716 cannot be used" if r.error
                      else "measuring\u2026" if self.machine is None else "not checked"),
                     f"{fit.ram / GIB:.1f} GiB" if fit else "", f"~{fit.tok_s[1]:.1f} tok/s" if fit else "",
                     r.publisher)
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if fit is not None and c == 3:
                    item.setToolTip("\n".join([fit.summary(), *fit.details()]))
                elif r.error and c == 3:
                    item.setToolTip(r.error)
                self.table.setItem(i, c, item)
        self._filter(self.search.text())

    def _recommended(self) -> set[int]:
        groups: dict[str, list[Row]] = {}
        for r in self.rows:
            groups.setdefault(r.model.id if r.model else r.file.repo, []).append(r)
        out = set()
        for rows in groups.values():
            fits = {str(id(r)): r.fit for r in rows if r.fit is not None}
            best = hub.recommend(fits)
            if best is not None:
                out.add(int(best))
        return out

    def _filter(self, text: str) -> None:
        words = text.lower().split()
        for i, r in enumerate(self.rows):
            hay = " ".join([r.file.repo, r.file.name, r.publisher, r.model.name if r.model else "",
                            r.model.summary if r.model else ""]).lower()
            self.table.setRowHidden(i, not all(w in hay for w in words))

    def visible_rows(self) -> list[Row]:
        """The rows the search leaves shown."""
        return [r for i, r in enumerate(self.rows) if not self.table.isRowHidden(i)]

    def selected_row(self) -> Row | None:
        """The row selected in the available table."""
        sel = self.table.selectionModel().selectedRows()
        return self.rows[sel[0].row()] if sel else None

    def select(self, row: Row) -> None:
        """Select ``row`` in the available table."""
        self.table.selectRow(self.rows.index(row))

    # ---- hub calls (on a thread) -------------------------------------------------------------------
    def _run(self, what: str, fn, download: bool = False) -> None:
        """Call ``fn`` on a hub thread (it reaches the dialog only through the bridge); its failure is emitted
        as ``failed``."""
        bridge = self.bridge

        def body() -> None:
            try:
                fn()
            except EngineError as exc:
                bridge.failed.emit(str(exc), download)
            except Exception as exc:  # noqa: BLE001 - a failed hub call is reported, never a crash
                bridge.failed.emit(f"{what}: {type(exc).__name__}: {exc}", download)
        bridge.start(body, f"hub-{what}")

    def list_repo(self, repo: str) -> None:
        """List ``repo`` live and read each model file's header for its fit (on the hub thread)."""
        self.status.emit(f"Listing {repo} and reading the headers of its GGUF files\u2026")
        context, cell, bridge = self.context, self._machine_cell, self.bridge

        def work() -> None:
            listing = hub.list_repo(repo)
            machine = cell.get(120)
            if machine is None:
                raise EngineError("this machine's memory bandwidth could not be measured, so no fit is shown")
            mmproj = hub.pick_mmproj(listing)
            fits, errors = {}, {}
            for f in listing.models:
                try:
                    fits[f.name] = hub.fit_remote(listing, f, mmproj, context, machine)
                except EngineError as exc:
                    errors[f.name] = str(exc)
            bridge.listed.emit(repo, listing, fits, errors)
        self._run(f"listing {repo}", work)

    def _listed(self, repo: str, listing: hub.RepoListing, fits: dict, errors: dict) -> None:
        model = next((m for m in hub.catalogue() for r in m.repos if r.repo.lower() == repo.lower()), None)
        publisher = next((r.publisher for r in model.repos if r.repo.lower() == repo.lower()), "") if model else ""
        self.rows = [r for r in self.rows if r.file.repo.lower() != repo.lower()]
        self.rows += [Row(f, model, publisher or repo.split("/")[0], fits.get(f.name), "header", errors.get(f.name, ""))
                      for f in listing.models]
        self._show_rows()
        bad = "; ".join(f"{n}: {e}" for n, e in errors.items())
        self.status.emit(f"{repo}: {len(listing.models)} GGUF files listed" + (f"; not usable: {bad}" if bad else ""))

    def _search_entered(self) -> None:
        text = self.search.text().strip()
        if text.count("/") == 1 and " " not in text:
            self.list_repo(text)

    def check_selected(self) -> None:
        """List the selected file's repository live (header fits)."""
        row = self.selected_row()
        if row is not None:
            self.list_repo(row.file.repo)

    def download_selected(self) -> None:
        """Download the selected file and its repository's mmproj (resuming a cancelled download)."""
        row = self.selected_row()
        if row is None or row.error or self.cancel is not None:
            return
        self.cancel = cancel = threading.Event()
        repo, name, store, bridge = row.file.repo, row.file.name, self.store, self.bridge
        self.progress.setValue(0)
        self.status.emit(f"Downloading {name}\u2026")
        self._update_buttons()

        def work() -> None:
            listing = hub.list_repo(repo)
            f = hub.pick_file(listing, file=name)
            entry = hub.download_model(listing, f, hub.pick_mmproj(listing), store, bridge.progress.emit, cancel)
            bridge.done.emit(entry)
        self._run(f"downloading {name}", work, download=True)

    def cancel_download(self) -> None:
        """Stop the download under way; what arrived is kept and the next download resumes it."""
        if self.cancel is not None:
            self.cancel.set()

    def _progress(self, p: hub.Progress) -> None:
        self.progress.setMaximum(max(p.total, 1))
        self.progress.setValue(p.done)
        eta = f", {p.eta:.0f} s left" if p.eta is not None else ""
        text = (f"{p.stage.capitalize()} {p.file}: {p.done / 2**20:.1f} of {p.total / 2**20:.1f} MiB, "
                f"{p.rate / 2**20:.1f} MiB/s{eta}")
        self.progress_label.setText(text)
        self.status.emit(text)

    def _downloaded(self, entry: hub.Downloaded) -> None:
        self.cancel = None
        self.progress_label.setText(f"Downloaded {entry.name} (sha256 verified).")
        self.status.emit(f"Downloaded {entry.name} (sha256 verified)")
        self.refresh_downloaded(select=entry)

    def _failed(self, message: str, download: bool) -> None:
        if download:
            self.cancel = None
        self.progress_label.setText(message)
        self.status.emit(message)
        self._update_buttons()

    # ---- the downloaded models ---------------------------------------------------------------------
    def refresh_downloaded(self, select: hub.Downloaded | None = None) -> None:
        """Fill the downloaded table from the store (``select``: the entry to select)."""
        self.entries = self.store.models()
        self.downloaded.setRowCount(len(self.entries))
        for i, d in enumerate(self.entries):
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(d.last_used)) if d.last_used else "never"
            for c, text in enumerate((d.name, d.quant, f"{d.size / GIB:.2f} GiB", used, d.mmproj or "none")):
                self.downloaded.setItem(i, c, QTableWidgetItem(text))
            if select is not None and (d.repo, d.file) == (select.repo, select.file):
                self.downloaded.selectRow(i)
        self._update_buttons()

    def selected_entry(self) -> hub.Downloaded | None:
        """The downloaded model selected."""
        sel = self.downloaded.selectionModel().selectedRows()
        return self.entries[sel[0].row()] if sel else None

    def open_selected(self) -> None:
        """Load the selected downloaded model (and its vision tower) in the window, and close."""
        entry = self.selected_entry()
        if entry is None:
            return
        self.store.touch(entry)
        path, mmproj = self.store.files(entry)
        self.open_requested.emit(str(path), str(mmproj) if mmproj else "")
        self.accept()

    def delete_selected(self) -> None:
        """Delete the selected downloaded model, its snapshots, and its mmproj when no other quant uses it."""
        entry = self.selected_entry()
        if entry is None:
            return
        answer = QMessageBox.question(self, "Delete model", f"Delete {entry.name} ({entry.size / GIB:.2f} GiB) and "
                                      "its prefix snapshots from this disk?")
        if answer != QMessageBox.Yes:
            return
        store, snapshots, bridge = self.store, self.snapshot_dir, self.bridge

        def work() -> None:          # opening the file for its snapshot folder reads its ~11 MB header
            removed = hub.delete_model(entry, store, snapshots)
            bridge.deleted.emit(entry.name, len(removed))
        self.status.emit(f"Deleting {entry.name}\u2026")
        self._run(f"deleting {entry.name}", work)

    def _deleted(self, name: str, count: int) -> None:
        self.status.emit(f"Deleted {name} ({count} files and folders)")
        self.refresh_downloaded()

    def _update_buttons(self) -> None:
        busy = self.cancel is not None
        row = self.selected_row()
        self.download_button.setEnabled(not busy and row is not None and not row.error)
        self.check_button.setEnabled(self.selected_row() is not None)
        self.cancel_button.setEnabled(busy)
        has = self.selected_entry() is not None if hasattr(self, "entries") else False
        self.open_button.setEnabled(has)
        self.delete_button.setEnabled(has)

    def done(self, result: int) -> None:
        """Closing (the close button, Esc, Open) stops a download under way (it resumes next time)."""
        self.cancel_download()
        super().done(result)


def show_model_browser(window) -> ModelBrowser:
    """Open the browser over the main window ``window`` (its context and snapshot folder): its lines go to the
    window's status bar and its Open loads the chosen download as the configured model."""
    browser = ModelBrowser(window, context=window.prefs.context, snapshot_dir=window.snapshot_dir)
    browser.status.connect(lambda text: window.statusBar().showMessage(text, 15000))
    browser.open_requested.connect(lambda path, mmproj: window.load_model(path, mmproj or None, remember=True))
    browser.show()
    window.model_browser = browser
    return browser
