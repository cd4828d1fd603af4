"""Image and text files the engine did not write: a FIFO, a device, a folder or an oversized file is refused
by name and never read (a FIFO would hang the reader, ``/dev/zero`` would fill memory), through every reader
that takes a user's path: the engine's images, the remote client's image parts and prune's text inputs."""

from __future__ import annotations

import io
import os
import stat
import threading

import pytest
from PIL import Image

from engine.errors import ImageError, ModelFormatError
from engine.vision.images import read_source
from engine.reap.inputs import read_text
from engine.gguf.regular import MAX_IMAGE_FILE_BYTES, FileRefused, read_regular
from engine.openai.remote import openai_messages


def _png(path):
    buffer = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 10, 10)).save(buffer, format="PNG")
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


def _returns_within(fn, seconds=5.0):
    """Run ``fn`` on a thread; fail the test if it has not returned (a FIFO read would block forever)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the reader blocked"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_regular_file_is_read_whole(tmp_path):
    data = _png(tmp_path / "a.png")
    assert read_regular(tmp_path / "a.png", len(data)) == data
    with pytest.raises(FileRefused, match=f"is {len(data)} bytes; at most {len(data) - 1}"):
        read_regular(tmp_path / "a.png", len(data) - 1)


def test_a_link_to_a_regular_file_is_followed(tmp_path):
    data = _png(tmp_path / "a.png")
    os.symlink(tmp_path / "a.png", tmp_path / "link.png")
    assert read_source(tmp_path / "link.png").data == data


@pytest.mark.parametrize("make, words", [
    (lambda p: os.mkfifo(p), "a FIFO"),
    (lambda p: p.mkdir(), "a folder"),
])
def test_the_engine_refuses_an_image_that_is_no_regular_file(tmp_path, make, words):
    path = tmp_path / "photo.png"
    make(path)
    with pytest.raises(ImageError, match=f"photo.png: the image file is {words}, not a regular file"):
        _returns_within(lambda: read_source(path))
    with pytest.raises(ImageError, match=f"photo.png: the image file is {words}"):
        _returns_within(lambda: openai_messages([{"role": "user", "content": [{"type": "image", "image": path}]}]))


@pytest.mark.skipif(not os.path.exists("/dev/zero") or not stat.S_ISCHR(os.stat("/dev/zero").st_mode),
                    reason="no /dev/zero character device here")
def test_a_device_is_never_read():
    with pytest.raises(ImageError, match="a character device"):
        _returns_within(lambda: read_source("/dev/zero"))


def test_an_oversized_image_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.png"
    with open(path, "wb") as f:
        f.truncate(MAX_IMAGE_FILE_BYTES + 1)         # sparse: no memory or disk spent
    with pytest.raises(ImageError, match=f"is {MAX_IMAGE_FILE_BYTES + 1} bytes"):
        read_source(path)


def test_prune_text_inputs_use_the_same_rule(tmp_path):
    os.mkfifo(tmp_path / "calib.jsonl")
    with pytest.raises(ModelFormatError, match="calib.jsonl: the calibration file is a FIFO"):
        _returns_within(lambda: read_text(tmp_path / "calib.jsonl", "calibration file"))
