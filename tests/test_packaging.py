"""packaging/build makes the one-folder app; the frozen app starts offscreen and stays up for 10 s.

The build is slow, so it runs once per session (a module fixture).
"""

from __future__ import annotations

import configparser
import os
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from PIL import Image
from processes import wait_until_sigterm_is_handled

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def frozen(tmp_path_factory) -> Path:
    """The built app folder (``packaging/build DIST``)."""
    dist = tmp_path_factory.mktemp("dist")
    done = subprocess.run(["bash", str(ROOT / "packaging" / "build"), str(dist)], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str(dist / "deltadesk" / "deltadesk")
    return dist / "deltadesk"


def test_the_frozen_app_starts_offscreen_and_stays_up_for_10_s(frozen, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "PYTHON", "VIRTUAL_ENV"))} | {
        "QT_QPA_PLATFORM": "offscreen", "XDG_DATA_HOME": str(tmp_path / "share"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    app = subprocess.Popen([str(frozen / "deltadesk")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    started = wait_until_sigterm_is_handled(app)          # its window is up (on a loaded machine, 10 s may not do)
    time.sleep(10)
    alive = started and app.poll() is None
    app.terminate()
    out = app.communicate(timeout=60)[0]
    assert alive, out
    assert app.returncode == 0 and "Traceback" not in out, out
    try:
        from engine import _native_cpu  # noqa: F401
    except ImportError:
        return
    assert "kernels unavailable" not in out, out


def test_the_bundle_holds_the_model_and_the_desktop_files(frozen):
    internal = frozen / "_internal"
    assert (internal / "assets" / "models" / "deltadesk-demo.gguf").stat().st_size == \
        (ROOT / "assets" / "models" / "deltadesk-demo.gguf").stat().st_size
    assert (internal / "engine" / "prompt" / "templates" / "qwen35.jinja").is_file()
    assert (internal / "engine" / "hub" / "catalogue.json").is_file()
    entry = configparser.ConfigParser(interpolation=None)
    entry.optionxform = str
    entry.read(frozen / "share" / "applications" / "deltadesk.desktop")
    desktop = entry["Desktop Entry"]
    assert (desktop["Type"], desktop["Exec"], desktop["Icon"]) == ("Application", "deltadesk", "deltadesk")
    meta = ET.parse(frozen / "share" / "metainfo" / "org.deltadesk.DeltaDesk.metainfo.xml").getroot()
    assert meta.findtext("id") == "org.deltadesk.DeltaDesk"
    assert meta.find("launchable").text == "deltadesk.desktop"
    icons = frozen / "share" / "icons" / "hicolor"
    for size in (16, 32, 48, 128, 256, 512):
        with Image.open(icons / f"{size}x{size}" / "apps" / "deltadesk.png") as png:
            assert png.size == (size, size) and png.getextrema()[3][1] == 255
    assert (icons / "scalable" / "apps" / "deltadesk.svg").read_bytes().startswith(b"<svg")


def _readme_mb() -> int:
    """The packaged size the README gives, MB ("one folder, N MB on disk")."""
    import re
    return int(re.search(r"one folder, (\d+) MB on disk", (ROOT / "README.md").read_text()).group(1))


def test_the_readme_size_is_the_built_folders(frozen):
    size = sum(p.stat().st_size for p in frozen.rglob("*") if p.is_file() and not p.is_symlink())
    assert abs(size / 1e6 - _readme_mb()) <= 0.15 * _readme_mb(), f"built {size / 1e6:.0f} MB"
