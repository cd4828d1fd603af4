"""app.platform_check: Qt's X11 plugin libraries are checked before Qt starts, with the apt line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app import platform_check

ROOT = Path(__file__).resolve().parent.parent

FAKE_LDD = """#!/bin/sh
echo "	linux-vdso.so.1 (0x00007ffd)"
echo "	libxcb-cursor.so.0 => /lib/x86_64-linux-gnu/libxcb-cursor.so.0 (0x00007f01)"
{missing}
echo "	libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f02)"
"""


def _check(tmp_path, missing: list[str], **env: str) -> subprocess.CompletedProcess:
    """``python -m app.platform_check`` with a stand-in ``ldd`` that reports ``missing`` as not found."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    ldd = bin_dir / "ldd"
    ldd.write_text(FAKE_LDD.format(missing="\n".join(f'echo "	{m} => not found"' for m in missing)))
    ldd.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("QT_QPA_PLATFORM", "WAYLAND_DISPLAY", "DISPLAY")}
    return subprocess.run([sys.executable, "-m", "app.platform_check"], cwd=ROOT, capture_output=True, text=True,
                          env=base | {"PATH": f"{bin_dir}:{os.environ['PATH']}"} | env, timeout=60)


def test_a_missing_library_names_its_package_and_prints_the_apt_line(tmp_path):
    done = _check(tmp_path, ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"], DISPLAY=":0")
    assert done.returncode == 1
    assert "libxcb-icccm.so.4, libxcb-keysyms.so.1" in done.stderr
    assert "packages: libxcb-icccm4 libxcb-keysyms1" in done.stderr
    assert platform_check.APT_LINE in done.stderr


def test_nothing_missing_or_another_platform_passes(tmp_path):
    assert _check(tmp_path, [], DISPLAY=":0").returncode == 0
    assert _check(tmp_path, ["libxcb-icccm.so.4"], QT_QPA_PLATFORM="offscreen").returncode == 0
    assert _check(tmp_path, ["libxcb-icccm.so.4"], WAYLAND_DISPLAY="wayland-0", XDG_SESSION_TYPE="wayland",
                  DISPLAY=":0").returncode == 0
    assert _check(tmp_path, ["libxcb-icccm.so.4"], QT_QPA_PLATFORM="xcb:foo", DISPLAY=":0").returncode == 1


def test_no_display_is_said_plainly(tmp_path):
    done = _check(tmp_path, [])
    assert done.returncode == 1 and "DISPLAY is not set" in done.stderr and "offscreen" in done.stderr


def test_every_library_of_the_real_plugin_has_a_package_and_the_check_agrees_with_the_loader():
    """On this machine: the sonames the plugin links are all in the table, and the check finds a
    library missing exactly when the dynamic loader cannot load the plugin."""
    plugins = platform_check.xcb_plugins()
    if not plugins:
        pytest.skip("this PySide6 has no xcb plugin")
    out = subprocess.run(["ldd", str(plugins[0])], capture_output=True, text=True).stdout
    linked = {line.split()[0] for line in out.splitlines() if "=>" in line}
    direct = {n for n in linked if n.startswith(("libxcb", "libxkb", "libX11"))}
    assert direct <= set(platform_check.PACKAGES)
    loads = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(plugins[0])!r})"],
                           capture_output=True, text=True).returncode == 0
    assert loads == (platform_check.missing_libraries(plugins[:1]) == [])


def test_readme_gives_the_same_apt_line():
    assert platform_check.APT_LINE in (ROOT / "README.md").read_text()


def test_the_apt_line_runs_unattended_as_root_and_names_real_packages():
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("apt-get update"))
    assert line == platform_check.APT_LINE and "sudo" not in line      # root has no sudo in a bare container
    update, install = line.split(" && ")
    assert update == "apt-get update" and install.startswith("apt-get install -y ")
    packages = install.split()[3:]
    assert sorted(packages) == sorted(set(platform_check.PACKAGES.values()))
    if not shutil.which("apt-get") or not any(Path("/var/lib/apt/lists").glob("*_Packages*")):
        pytest.skip("no apt-get with package lists here")
    simulated = subprocess.run(["apt-get", "-s", "install", "-y", *packages], capture_output=True, text=True)
    assert simulated.returncode == 0, simulated.stdout[-2000:] + simulated.stderr[-2000:]
