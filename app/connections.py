"""The settings' Connections tab: serve on localhost, and a remote engine.

A remote engine is an OpenAI-compatible server: a base URL, a model it lists at ``/v1/models`` and an
API key. The key is kept in the system keyring (the ``keyring`` library: Secret Service, macOS
Keychain, Windows Credential Locker), never in the settings file; on a machine without a keyring
backend it is kept for this session only and the tab says so, and how to keep it: a keyring backend,
or the :data:`KEY_VARIABLE` environment variable, which is used when no key is stored.
"""

from __future__ import annotations

import os
from typing import Any

from PySide6.QtCore import Signal, Slot
from PySide6.QtWidgets import (QCheckBox, QComboBox, QFormLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit,
                               QPushButton, QSpinBox, QVBoxLayout, QWidget)

from .settings import Settings
from .thread_bridge import ThreadBridge

KEYRING_SERVICE = "DeltaDesk remote engine"
KEY_VARIABLE = "DELTADESK_REMOTE_API_KEY"
NO_KEYRING = ("This computer has no password store (keyring) that DeltaDesk can use, so the API key is kept only "
              "until DeltaDesk quits. To keep it, install one (GNOME Keyring or KWallet; or `pip install "
              f"keyrings.alt` for a file-based one), or set the environment variable {KEY_VARIABLE} before "
              "starting DeltaDesk.")


class KeyStore:
    """API keys per base URL, in the system keyring; in memory (this session) when there is none.

    Attributes:
        note: that keys are not kept and how to keep them, in plain words ("" while the keyring works).
        reason: the technical reason for ``note`` (the backend, or the error it raised).
    """

    def __init__(self, backend: Any = None) -> None:
        if backend is None:
            import keyring
            backend = keyring
        self._keyring = backend
        self._session: dict[str, str] = {}
        self.note = ""
        self.reason = ""
        ring = backend.get_keyring() if hasattr(backend, "get_keyring") else None
        if ring is not None and getattr(ring, "priority", 1) <= 0:      # keyring's "fail" and "null" backends
            self.note, self.reason = NO_KEYRING, f"keyring's backend is {type(ring).__module__}.{type(ring).__name__}"

    def _failed(self, exc: Exception) -> None:
        self.note, self.reason = NO_KEYRING, f"{type(exc).__name__}: {exc}"

    def get(self, url: str) -> str:
        """The key stored for ``url``, else :data:`KEY_VARIABLE`'s value ("" when neither)."""
        if not url:
            return ""
        if url in self._session:
            return self._session[url]
        stored = ""
        if not self.note:
            try:
                stored = self._keyring.get_password(KEYRING_SERVICE, url) or ""
            except Exception as exc:  # noqa: BLE001 - any backend failure means "no keyring", never a crash
                self._failed(exc)
        return stored or os.environ.get(KEY_VARIABLE, "")

    def set(self, url: str, key: str) -> None:
        """Keep ``key`` for ``url`` (an empty key deletes the stored one)."""
        if not url:
            return
        if self.note:
            self._session[url] = key
            return
        try:
            if key:
                self._keyring.set_password(KEYRING_SERVICE, url, key)
            elif self._keyring.get_password(KEYRING_SERVICE, url) is not None:
                self._keyring.delete_password(KEYRING_SERVICE, url)
            self._session.pop(url, None)
        except Exception as exc:  # noqa: BLE001 - any backend failure means "no keyring", never a crash
            self._failed(exc)
            self._session[url] = key


class _Lister(ThreadBridge):
    """Lists a server's models on a thread of its own; the answer comes back as a signal."""

    listed = Signal(object, str)   # model ids, "" / [] and why not

    def list(self, url: str, key: str) -> None:
        def run() -> None:
            from engine.openai.remote import list_models
            try:
                names, error = [m["id"] for m in list_models(url, key or None)], ""
            except Exception as exc:  # noqa: BLE001 - every failure becomes the tab's message
                names, error = [], str(exc)
            self.listed.emit(names, error)

        self.start(run, "list-models")


class ConnectionsTab(QWidget):
    """Serve on localhost (on/off, port) and the remote engine (base URL, model, API key)."""

    def __init__(self, settings: Settings, keys: KeyStore) -> None:
        super().__init__()
        self._keys = keys
        column = QVBoxLayout(self)
        serve = QGroupBox("Serve on localhost")
        form = QFormLayout(serve)
        self.serve = QCheckBox("Let other programs on this computer use the loaded model (OpenAI API)")
        self.serve.setAccessibleName("Serve on localhost")
        self.serve.setChecked(settings.serve_local)
        self.port = QSpinBox()
        self.port.setRange(1, 65535)
        self.port.setValue(settings.serve_port)
        self.port.setAccessibleName("Server port")
        form.addRow(self.serve)
        form.addRow("Port:", self.port)
        form.addRow(QLabel("Listens on 127.0.0.1 only; the status bar shows the address."))
        column.addWidget(serve)

        remote = QGroupBox("Remote engine (an OpenAI-compatible server: vLLM, SGLang, llama-server, DeltaDesk)")
        form = QFormLayout(remote)
        self.url = QLineEdit(settings.remote_url)
        self.url.setPlaceholderText("empty: run the model in DeltaDesk; e.g. http://127.0.0.1:8080/v1")
        self.url.setClearButtonEnabled(True)
        self.url.setAccessibleName("Remote base URL")
        self.model = QComboBox()
        self.model.setEditable(True)
        self.model.setAccessibleName("Remote model")
        if settings.remote_model:
            self.model.addItem(settings.remote_model)
        self.list_button = QPushButton("List models")
        self.list_button.setAccessibleName("List the server's models")
        self.list_button.clicked.connect(self.list_models)
        row = QHBoxLayout()
        row.addWidget(self.model, 1)
        row.addWidget(self.list_button)
        self.key = QLineEdit(keys.get(settings.remote_url))
        self.key.setEchoMode(QLineEdit.Password)
        self.key.setPlaceholderText("none")
        self.key.setAccessibleName("Remote API key")
        self.status = QLabel(keys.note or "The API key is kept in the system keyring, not in the settings file.")
        self.status.setWordWrap(True)
        self.status.setToolTip(keys.reason)
        form.addRow("Base URL:", self.url)
        form.addRow("Model:", row)
        form.addRow("API key:", self.key)
        form.addRow(self.status)
        column.addWidget(remote)
        column.addStretch(1)
        self._lister = _Lister(self)
        self._lister.listed.connect(self._listed)

    def list_models(self) -> None:
        """Ask the server at the base URL for its models (the answer fills the model list)."""
        url = self.url.text().strip()
        if not url:
            self.status.setText("Enter the server's base URL first.")
            return
        self.list_button.setEnabled(False)
        self.status.setText(f"Asking {url} for its models\u2026")
        self._lister.list(url, self.key.text().strip())

    @Slot(object, str)
    def _listed(self, names: list[str], error: str) -> None:
        self.list_button.setEnabled(True)
        if error:
            self.status.setText(f"{error}\n\n{self._keys.note}" if self._keys.note else error)
            return
        current = self.model.currentText()
        self.model.clear()
        self.model.addItems(names)
        if current in names:
            self.model.setCurrentText(current)
        listed = (f"The server lists {len(names)} model{'s' if len(names) != 1 else ''}." if names
                  else "The server lists no models.")
        self.status.setText(f"{listed}\n\n{self._keys.note}" if self._keys.note else listed)

    def values(self) -> dict[str, Any]:
        """The tab's fields of :class:`Settings`."""
        url = self.url.text().strip()
        return {"serve_local": self.serve.isChecked(), "serve_port": self.port.value(), "remote_url": url,
                "remote_model": self.model.currentText().strip() if url else ""}

    def save_key(self) -> None:
        """Keep the typed API key for the base URL (in the keyring; see :class:`KeyStore`)."""
        self._keys.set(self.url.text().strip(), self.key.text().strip())
