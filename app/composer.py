"""The composer: a multi-line editor, image attachments with thumbnails, Send / Stop.

Enter sends, Shift+Enter starts a new line. Images arrive by drag-and-drop (on the composer, or
anywhere on the main window, which hands them on), paste or the attach dialog; each is copied into
the :class:`~app.history.ImageStore` at once, so a message refers to a file that stays put. When
the loaded model has a vision tower, each thumbnail also shows the size the image will have when
it reaches the model (the engine worker measures it).

Reading, hashing, copying and thumbnailing an image run on one attachment thread
(:func:`prepare_attachment`, with Pillow and hashlib, which release the GIL while they work), in
the order the images came; the window only places the finished thumbnail. A 20 MB PNG took the
window's thread 188 ms when all of it ran there.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from io import BytesIO
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError
from PySide6.QtCore import QMimeData, Qt, Signal
from PySide6.QtGui import QImage, QKeyEvent, QPixmap
from PySide6.QtWidgets import (QCheckBox, QFileDialog, QFrame, QHBoxLayout, QLabel, QPlainTextEdit,
                               QPushButton, QToolButton, QVBoxLayout, QWidget)

from .engine_worker import human_size
from .history import ImageStore

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
THUMB_PX = 64


@dataclass(frozen=True)
class Attachment:
    """An image attached to the message being written: its stored path, pixel size and bytes."""

    path: str
    width: int
    height: int
    nbytes: int

    @property
    def caption(self) -> str:
        """E.g. "1920\u00d71080 \u00b7 245.3 KB"."""
        return f"{self.width}\u00d7{self.height} \u00b7 {human_size(self.nbytes)}"


@dataclass(frozen=True)
class Prepared:
    """An attachment made ready off the window's thread: the stored image and its thumbnail
    (RGBA bytes, ``thumb_size`` = (width, height), at most :data:`THUMB_PX` a side)."""

    attachment: Attachment
    thumb: bytes
    thumb_size: tuple[int, int]


@dataclass(frozen=True)
class RawImage:
    """A pasted image's pixels (RGBA8888 rows, no padding), to be stored as PNG."""

    data: bytes
    width: int
    height: int


def prepare_attachment(store: ImageStore, source: Path | RawImage | None, stored: Path | None = None) -> Prepared:
    """Store an image (a file, or pasted pixels as PNG) and make its thumbnail; or, with ``stored``
    (an image already in the store), only describe it. Runs on the attachment thread.

    Raises:
        OSError: the file cannot be read or written.
        ValueError: the file is not an image Pillow can open, or its data is truncated or corrupt (the message
            names neither path: the caller names the user's file); the copy just stored is removed.
        ValueError: neither ``source`` nor ``stored`` was given.
    """
    if isinstance(source, RawImage):
        image = Image.frombuffer("RGBA", (source.width, source.height), source.data, "raw", "RGBA", 0, 1)
        buffer = BytesIO()
        image.save(buffer, "PNG")
        stored = store.add_bytes(buffer.getvalue(), ".png")
    elif source is not None:
        stored = store.add_file(source)
    if stored is None:
        raise ValueError("prepare_attachment needs an image to store or a stored path")
    try:
        with Image.open(stored) as image:
            width, height = image.size
            image.draft("RGB", (THUMB_PX, THUMB_PX))
            image.thumbnail((THUMB_PX, THUMB_PX))
            thumb = image.convert("RGBA")
    except (OSError, SyntaxError, ValueError) as exc:
        if source is not None:            # just stored for this attachment, which nothing else refers to
            stored.unlink(missing_ok=True)
        if isinstance(exc, UnidentifiedImageError):
            raise ValueError("not an image Pillow can read; expected PNG, JPEG, GIF, WebP, BMP or TIFF data") from exc
        raise ValueError(f"truncated or corrupt image data ({exc})") from exc
    return Prepared(Attachment(str(stored), width, height, stored.stat().st_size), thumb.tobytes(), thumb.size)


def model_size_text(size: tuple[int, int, int, int]) -> str:
    """E.g. "model sees 448\u00d7288 \u00b7 126 tokens" for ``size`` = (height, width, image tokens, pieces), or
    "model sees 504\u00d7392 + 4 slices \u00b7 315 tokens" for an overview read with its slices (MiniCPM-V 4.6)."""
    height, width, tokens, pieces = size
    slices = f" + {pieces - 1} slices" if pieces > 1 else ""
    return f"model sees {width}\u00d7{height}{slices} \u00b7 {tokens} tokens"


class Thumbnail(QFrame):
    """One attached image: the picture, a remove button, its size and the size the model sees.

    Signals:
        remove_clicked(): the \u00d7 button was pressed.
    """

    remove_clicked = Signal()

    def __init__(self, prepared: Prepared) -> None:
        super().__init__()
        attachment = prepared.attachment
        self.attachment = attachment
        self.setFrameShape(QFrame.StyledPanel)
        self.setAccessibleName(f"Attached image {attachment.caption}")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(2)
        top = QHBoxLayout()
        picture = QLabel()
        width, height = prepared.thumb_size
        picture.setPixmap(QPixmap.fromImage(QImage(prepared.thumb, width, height, 4 * width,
                                                   QImage.Format_RGBA8888).copy()))
        top.addWidget(picture)
        remove = QToolButton()
        remove.setText("\u00d7")
        remove.setAutoRaise(True)
        remove.setToolTip("Remove image")
        remove.setAccessibleName("Remove image")
        remove.clicked.connect(self.remove_clicked)
        top.addWidget(remove, 0, Qt.AlignTop)
        top.addStretch(1)
        layout.addLayout(top)
        caption = QLabel(attachment.caption)
        caption.setEnabled(False)
        layout.addWidget(caption)
        self.model_size = QLabel()
        self.model_size.setAccessibleName("Size the model sees")
        self.model_size.hide()
        self.unreadable = ""
        layout.addWidget(self.model_size)

    def set_model_size(self, size: tuple[int, ...] | str | None) -> None:
        """Show the (height, width, image tokens, pieces) the model sees, that a remote server decides them
        (``()``), a reason it cannot see the image, or nothing (None).

        With a reason, :attr:`unreadable` holds it (the composer then refuses to send).
        """
        self.unreadable = size if isinstance(size, str) else ""
        self.model_size.setVisible(size is not None)
        if isinstance(size, str):
            self.model_size.setText("model cannot read it")
            self.model_size.setToolTip(size)
            self.model_size.setStyleSheet("color: #b35c00;")
        elif size == ():
            self.model_size.setText("the server decides its size and token cost")
            self.model_size.setToolTip("A remote engine's vision tower resizes the image and counts its tokens; "
                                       "the image is sent whole.")
            self.model_size.setStyleSheet("")
        elif size is not None:
            self.model_size.setText(model_size_text(size))
            self.model_size.setToolTip("")
            self.model_size.setStyleSheet("")


def image_files(mime: QMimeData) -> list[Path]:
    """Local image files among the URLs of a drop or paste."""
    return [Path(url.toLocalFile()) for url in mime.urls()
            if url.isLocalFile() and Path(url.toLocalFile()).suffix.lower() in IMAGE_SUFFIXES]


class ComposerEdit(QPlainTextEdit):
    """The text box: Enter emits ``submit``; pasted or dropped images go to ``images_received``."""

    submit = Signal()
    images_received = Signal(object)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        """Enter sends; Shift+Enter inserts a newline."""
        if event.key() in (Qt.Key_Return, Qt.Key_Enter) and not event.modifiers() & Qt.ShiftModifier:
            self.submit.emit()
            return
        super().keyPressEvent(event)

    def canInsertFromMimeData(self, source: QMimeData) -> bool:
        """Accept images and image files besides text."""
        return source.hasImage() or bool(image_files(source)) or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:
        """Route images to the attachment strip; insert anything else as text."""
        files = image_files(source)
        if files:
            self.images_received.emit(files)
        elif source.hasImage():
            self.images_received.emit(QImage(source.imageData()))
        else:
            super().insertFromMimeData(source)


class Composer(QFrame):
    """Where the user writes the next message.

    Attributes:
        has_vision: whether the loaded model can see images (None while no model is loaded).

    Signals:
        send_requested(str, list): the text and the attached image paths.
        stop_requested(): the Stop button was pressed while an answer streams.
        measure_requested(str): an image path whose size for the model should be measured.
    """

    send_requested = Signal(str, list)
    stop_requested = Signal()
    measure_requested = Signal(str)
    _prepared = Signal(object)

    def __init__(self, images: ImageStore) -> None:
        super().__init__()
        self._images = images
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attach")
        self._prepared.connect(self._place)
        self.pending = 0
        self._send_when_ready = False
        self._failed: list[str] = []
        self.attachments: list[Attachment] = []
        self.editing_id: int | None = None
        self.busy = False
        self.unavailable = ""
        self.refusal = ""
        self.has_vision: bool | None = None
        self.vision_refusal = ""
        self.drop_highlighted = False
        self.setObjectName("composer")
        self.setAcceptDrops(True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 8)
        layout.setSpacing(4)

        self.edit_banner = QLabel()
        self.edit_banner.hide()
        layout.addWidget(self.edit_banner)
        self.warning = QLabel()
        self.warning.setWordWrap(True)
        self.warning.setStyleSheet("color: #b35c00;")
        self.warning.hide()
        layout.addWidget(self.warning)
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.status.setAccessibleName("Why the message cannot be sent now")
        self.status.hide()
        layout.addWidget(self.status)
        self._strip = QHBoxLayout()
        self._strip.addStretch(1)
        layout.addLayout(self._strip)

        row = QHBoxLayout()
        self.editor = ComposerEdit()
        self.editor.setPlaceholderText("Message (Enter sends, Shift+Enter new line)")
        self.editor.setAccessibleName("Message")
        self.editor.setFixedHeight(84)
        self.editor.submit.connect(self.submit)
        self.editor.images_received.connect(self._receive)
        row.addWidget(self.editor, 1)
        buttons = QVBoxLayout()
        self.send_button = QPushButton("Send")
        self.send_button.setAccessibleName("Send")
        self.send_button.setDefault(True)
        self.send_button.clicked.connect(self._send_or_stop)
        self.attach_button = QPushButton("Attach\u2026")
        self.attach_button.setAccessibleName("Attach images")
        self.attach_button.clicked.connect(self.attach_dialog)
        self.think_box = QCheckBox("Think")
        self.think_box.setToolTip("Let the model reason before it answers")
        self.think_box.setAccessibleName("Think before answering")
        for w in (self.send_button, self.attach_button, self.think_box):
            buttons.addWidget(w)
        row.addLayout(buttons)
        layout.addLayout(row)
        self._update_send()

    # attachments

    def _receive(self, what: object) -> None:
        if isinstance(what, QImage):
            self.add_image(what)
        else:
            for path in what:
                self.add_file(path)

    def add_file(self, path: str | Path) -> None:
        """Attach an image file (copied into the image store on the attachment thread)."""
        self._prepare(Path(path))

    def add_image(self, image: QImage) -> None:
        """Attach an image from the clipboard (stored as PNG on the attachment thread)."""
        rgba = image.convertToFormat(QImage.Format_RGBA8888)
        self._prepare(RawImage(bytes(rgba.constBits()), rgba.width(), rgba.height()))

    def _prepare(self, source: Path | RawImage | None, stored: Path | None = None) -> None:
        """Run :func:`prepare_attachment` on the attachment thread; :meth:`_place` gets the result."""
        self.pending += 1
        self._update_warning()
        name = source.name if isinstance(source, Path) else (stored.name if stored else "the pasted image")

        def job() -> None:
            try:
                result: object = prepare_attachment(self._images, source, stored)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a line in the composer
                result = f"{name}: {exc}"
            self._prepared.emit(result)

        self._worker.submit(job)

    def _place(self, result: Prepared | str) -> None:
        self.pending -= 1
        if isinstance(result, str):
            self._failed.append(result)
        else:
            attachment = result.attachment
            self.attachments.append(attachment)
            thumb = Thumbnail(result)
            thumb.remove_clicked.connect(lambda: self.remove_attachment(attachment, thumb))
            self._strip.insertWidget(self._strip.count() - 1, thumb)
            self._measure(thumb)
        self._update_warning()
        if not self.pending and self._send_when_ready:
            self._send_when_ready = False
            self.submit()

    def thumbnails(self) -> list[Thumbnail]:
        """The thumbnails shown, in order."""
        return [self._strip.itemAt(i).widget() for i in range(self._strip.count() - 1)]

    def on_measured(self, path: str, size: tuple[int, int, int, int] | str) -> None:
        """The engine worker measured ``path``: show what the model will see on its thumbnails."""
        if self.has_vision:
            for thumb in self.thumbnails():
                if thumb.attachment.path == path:
                    thumb.set_model_size(size)
            self._update_warning()

    def remove_attachment(self, attachment: Attachment, box: QWidget) -> None:
        """Drop one attachment and its thumbnail."""
        self._failed = []
        self.attachments.remove(attachment)
        box.hide()
        self._strip.removeWidget(box)
        box.deleteLater()
        self._update_warning()

    def clear_attachments(self) -> None:
        """Remove every attachment."""
        while self._strip.count() > 1:
            box = self._strip.takeAt(0).widget()
            box.hide()
            box.deleteLater()
        self.attachments = []
        self._update_warning()

    def attach_dialog(self) -> None:
        """Pick image files with a file dialog."""
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach images", "",
                                                "Images (" + " ".join("*" + s for s in IMAGE_SUFFIXES) + ")")
        for path in paths:
            self.add_file(path)

    def set_vision(self, has_vision: bool | None, refusal: str = "") -> None:
        """Tell the composer whether the loaded model can see images (None: no model loaded).

        With a vision tower, the attached images are measured again (the new model may resize
        them differently). ``refusal``: why images cannot be sent at all (a remote server that does not
        say it reads them); each image is then marked with it and the message is not sent.
        """
        self.has_vision = has_vision
        self.vision_refusal = refusal
        for thumb in self.thumbnails():
            thumb.set_model_size(None)
            self._measure(thumb)
        self._update_warning()

    def _measure(self, thumb: Thumbnail) -> None:
        """Ask for the size the model sees ``thumb`` at, or mark it with :attr:`vision_refusal`."""
        if self.vision_refusal:
            thumb.set_model_size(self.vision_refusal)
        elif self.has_vision:
            self.measure_requested.emit(thumb.attachment.path)

    def unreadable_images(self) -> list[str]:
        """Why the model cannot read attached images, "image N: reason" per such image (N counts the
        thumbnails from 1; empty: all readable)."""
        return [f"image {i}: {t.unreadable}" for i, t in enumerate(self.thumbnails(), 1) if t.unreadable]

    def refused(self, text: str, images: list[str], reason: str) -> None:
        """A sent message was refused (it does not fit the context): show ``reason`` and, when the
        editor is empty, put the message back to be shortened."""
        self.refusal = reason
        if not self.editor.toPlainText().strip() and not self.attachments:
            self.editor.setPlainText(text)
            for path in images:
                if Path(path).is_file():
                    self._prepare(None, Path(path))
        self._update_warning()

    def _update_warning(self) -> None:
        unreadable = self.unreadable_images()
        if self.refusal:
            text = self.refusal
        elif unreadable:
            text = ("The model cannot read an attached image; remove it (\u00d7) to send: "
                    + " ".join(unreadable))
        elif self._failed:
            text = "Could not attach " + "; ".join(self._failed)
        elif self.pending:
            text = f"Adding {self.pending} image{'s' if self.pending > 1 else ''}\u2026"
        elif self.attachments and self.has_vision is False:
            text = "This model has no vision tower: images stay in the chat but the model will not see them."
        else:
            text = ""
        self.warning.setText(text)
        self.warning.setVisible(bool(text))

    # drag and drop on the whole composer (the main window hands on the image drops made elsewhere)

    @staticmethod
    def can_attach(mime: QMimeData) -> bool:
        """Whether ``mime`` (a drop) holds local image files or an image, which :meth:`attach_dropped` takes."""
        return bool(image_files(mime)) or mime.hasImage()

    def attach_dropped(self, mime: QMimeData) -> None:
        """Attach the image files (or else the image) of a drop, as a paste into the editor does.

        Anything else in ``mime`` (other files, text) is left out; a drop without images does nothing.
        """
        if self.can_attach(mime):
            self.editor.insertFromMimeData(mime)

    def set_drop_highlight(self, on: bool) -> None:
        """Outline the composer while images are dragged over the window (they will land here)."""
        self.drop_highlighted = on
        self.setStyleSheet("#composer { border: 2px dashed palette(highlight); border-radius: 4px; }" if on else "")

    def dragEnterEvent(self, event) -> None:
        """Accept image files and images dragged onto the composer (outlined until they are dropped or leave)."""
        if self.can_attach(event.mimeData()):
            event.acceptProposedAction()
            self.set_drop_highlight(True)

    def dragLeaveEvent(self, event) -> None:
        """The drag left: no outline."""
        self.set_drop_highlight(False)

    def dropEvent(self, event) -> None:
        """Attach what was dropped."""
        self.set_drop_highlight(False)
        self.attach_dropped(event.mimeData())
        event.acceptProposedAction()

    # sending

    def set_busy(self, busy: bool) -> None:
        """While an answer streams the Send button becomes Stop."""
        self.busy = busy
        self._update_send()

    def set_unavailable(self, reason: str) -> None:
        """Refuse to send while ``reason`` (plain words, shown above the editor) holds; "" sends again.

        E.g. no model is loaded: a message sent then could not be answered. Stop stays usable.
        """
        self.unavailable = reason
        self.status.setText(reason)
        self.status.setVisible(bool(reason))
        self._update_send()

    def _update_send(self) -> None:
        busy = self.busy
        self.send_button.setText("Stop" if busy else "Send")
        self.send_button.setAccessibleName("Stop answering" if busy else "Send")
        self.send_button.setToolTip("Stop the answer (Esc)" if busy else self.unavailable or "Send (Enter)")
        self.send_button.setEnabled(busy or not self.unavailable)

    def _send_or_stop(self) -> None:
        if self.busy:
            self.stop_requested.emit()
        else:
            self.submit()

    def submit(self) -> None:
        """Send the text and images, unless an answer is streaming, sending is refused
        (:meth:`set_unavailable`), the model cannot read an attached image (the warning says which
        and why) or there is nothing to send. While images are still being added, the message
        goes once they are in."""
        text = self.editor.toPlainText().strip()
        if self.busy or self.unavailable or not (text or self.attachments or self.pending):
            return
        if self.pending:
            self._send_when_ready = True
            return
        if self.unreadable_images():
            self._update_warning()
            return
        paths = [a.path for a in self.attachments]
        self.refusal = ""
        self._failed = []
        self.editor.clear()
        self.clear_attachments()
        self.send_requested.emit(text, paths)

    def begin_edit(self, message_id: int, text: str, images: tuple[str, ...]) -> None:
        """Load a sent message for editing; sending it makes a new branch."""
        self.editing_id = message_id
        self.editor.setPlainText(text)
        self.clear_attachments()
        for path in images:
            if Path(path).is_file():
                self._prepare(None, Path(path))
        self.edit_banner.setText("Editing a message: Enter sends it as a new version, Esc cancels.")
        self.edit_banner.show()
        self.editor.setFocus()

    def end_edit(self) -> None:
        """Leave edit mode after the edited message was sent."""
        self.editing_id = None
        self.edit_banner.hide()

    def cancel_edit(self) -> None:
        """Abandon an edit: clear the text and images loaded for it."""
        if self.editing_id is not None:
            self.end_edit()
            self.editor.clear()
            self.clear_attachments()
