"""Check, before Qt starts, that the system libraries of Qt's X11 (xcb) platform plugin are there.

Without one of them Qt aborts (exit 134) with a message that names ``xcb-cursor0`` whatever is
missing. ``python -m app.platform_check`` (run by ``scripts/run``, and by the packaged app before
its window opens) asks ``ldd`` which libraries the plugin cannot find and, when one is missing,
prints their Debian/Ubuntu packages and the one ``apt-get`` line that installs everything the
plugin needs (README's "Set-up" gives the same line). Only QtCore is imported here: QtGui itself
needs some of these libraries.

The soname -> package table was read off ``ldd`` of PySide6 6.11's ``libqxcb.so`` and its
``xcbglintegrations`` plugins, with ``dpkg -S`` on Debian 12 (the names are the same on
Debian 13 and Ubuntu 22.04 / 24.04, where apt picks ``libglib2.0-0t64`` for ``libglib2.0-0``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGES = {
    "libEGL.so.1": "libegl1", "libGL.so.1": "libgl1", "libfontconfig.so.1": "libfontconfig1",
    "libfreetype.so.6": "libfreetype6", "libglib-2.0.so.0": "libglib2.0-0", "libdbus-1.so.3": "libdbus-1-3",
    "libX11.so.6": "libx11-6", "libX11-xcb.so.1": "libx11-xcb1", "libxcb.so.1": "libxcb1",
    "libxcb-cursor.so.0": "libxcb-cursor0", "libxcb-glx.so.0": "libxcb-glx0", "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-image.so.0": "libxcb-image0", "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-randr.so.0": "libxcb-randr0", "libxcb-render.so.0": "libxcb-render0",
    "libxcb-render-util.so.0": "libxcb-render-util0", "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-shm.so.0": "libxcb-shm0", "libxcb-sync.so.1": "libxcb-sync1", "libxcb-util.so.1": "libxcb-util1",
    "libxcb-xfixes.so.0": "libxcb-xfixes0", "libxcb-xkb.so.1": "libxcb-xkb1", "libxkbcommon.so.0": "libxkbcommon0",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
}
APT_LINE = "apt-get update && apt-get install -y " + " ".join(sorted(set(PACKAGES.values())))
"""As root and unattended; a user with sudo rights puts ``sudo`` before each ``apt-get``."""


def uses_xcb(env: dict[str, str]) -> bool:
    """Whether Qt will pick its xcb plugin: ``QT_QPA_PLATFORM`` unset or naming xcb first, and not
    a Wayland session (where Qt 6 prefers its wayland plugin)."""
    platform = env.get("QT_QPA_PLATFORM", "")
    if platform:
        return platform.split(";")[0].split(":")[0] == "xcb"
    return not (env.get("WAYLAND_DISPLAY") and env.get("XDG_SESSION_TYPE") == "wayland")


def missing_libraries(plugins: list[Path]) -> list[str]:
    """The sonames ``ldd`` reports "not found" for any of ``plugins``, in the order first met.

    Returns [] when ``ldd`` is not on PATH (nothing is known then; Qt will say what it lacks).
    """
    ldd = shutil.which("ldd")
    missing: list[str] = []
    if ldd is None:
        return missing
    for plugin in plugins:
        out = subprocess.run([ldd, str(plugin)], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            name, _, where = line.strip().partition(" => ")
            if where.strip() == "not found" and name not in missing:
                missing.append(name)
    return missing


def xcb_plugins() -> list[Path]:
    """Qt's xcb platform plugin and its GL integrations, from Qt's own plugin path."""
    from PySide6.QtCore import QLibraryInfo

    root = Path(QLibraryInfo.path(QLibraryInfo.LibraryPath.PluginsPath))
    return sorted((root / "platforms").glob("libqxcb*.so")) + sorted((root / "xcbglintegrations").glob("*.so"))


def problem(env: dict[str, str], plugins: list[Path]) -> str:
    """Why Qt's window cannot open here, in words with the fix, or "" when nothing is known to be wrong."""
    if not uses_xcb(env):
        return ""
    missing = missing_libraries(plugins)
    if missing:
        packages = sorted({PACKAGES.get(name, name) for name in missing})
        return ("DeltaDesk cannot open its window: Qt's X11 plugin needs system libraries that are missing: "
                f"{', '.join(missing)} (Debian/Ubuntu packages: {' '.join(packages)}).\n"
                f"Install everything it needs with (as root; otherwise put sudo before each apt-get):\n"
                f"    {APT_LINE}")
    if not env.get("DISPLAY"):
        return ("DeltaDesk cannot open its window: no X display (DISPLAY is not set). Start it from a desktop "
                "session, or set QT_QPA_PLATFORM=offscreen to run without one.")
    return ""


def main() -> int:
    """Print the problem to stderr and return 1, or return 0 when the window can be tried."""
    message = problem(dict(os.environ), xcb_plugins())
    if message:
        print(message, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
