"""scripts/run and scripts/test install the project only when the install-defining files changed.

The scripts run in a scratch copy of those files with a stand-in venv whose ``python`` records
``-m pip`` / ``-m app`` / ``-m pytest`` calls instead of running them (a successful ``pip`` "builds"
the native kernels by touching ``engine/_native_cpu.abi3.so``, unless ``FAKE_NO_COMPILER`` is set;
anything else, such as the stamp's hash, goes to the real interpreter).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-m" ]; then
    echo "$*" >> "{log}"
    if [ "$2" = "pip" ] && [ "${{FAKE_STATUS:-0}}" = 0 ] && [ -z "${{FAKE_NO_COMPILER:-}}" ]; then
        touch engine/_native_cpu.abi3.so
    fi
    exit "${{FAKE_STATUS:-0}}"
fi
exec "{python}" "$@"
"""


@pytest.fixture
def repo(tmp_path):
    """A scratch checkout: the scripts, the install-defining files and one Python module."""
    root = tmp_path / "repo"
    for rel in ["scripts/run", "scripts/test", "scripts/_venv.sh", "pyproject.toml", "setup.py",
                "engine/errors.py", *(str(p.relative_to(ROOT)) for p in (ROOT / "native/cpu").rglob("*")
                                      if p.suffix in {".py", ".c", ".h"})]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, root / rel)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    log.touch()
    for name in ("python", "lint-imports"):
        exe = venv / "bin" / name
        exe.write_text(FAKE_PYTHON.format(log=log, python=sys.executable) if name == "python" else "#!/bin/sh\n")
        exe.chmod(0o755)
    return root, venv, log


def launch(repo, script: str, status: int = 0, compiler: bool = True) -> tuple[int, list[str]]:
    """Run ``scripts/<script>``; return its exit status and the module calls it made."""
    root, venv, log = repo
    before = log.read_text().splitlines()
    env = {**os.environ, "DELTADESK_VENV": str(venv), "FAKE_STATUS": str(status)}
    if not compiler:
        env["FAKE_NO_COMPILER"] = "1"
    done = subprocess.run(["bash", str(root / "scripts" / script)], env=env, capture_output=True, timeout=60)
    return done.returncode, log.read_text().splitlines()[len(before):]


def test_run_installs_on_first_use_then_only_when_the_install_changes(repo) -> None:
    root = repo[0]
    assert launch(repo, "run") == (0, ["-m pip install -q -e .", "-m app.platform_check", "-m app"])
    assert launch(repo, "run") == (0, ["-m app.platform_check", "-m app"])
    with open(root / "engine/errors.py", "a") as f:       # editable install: Python edits need nothing
        f.write("# edited\n")
    assert launch(repo, "run") == (0, ["-m app.platform_check", "-m app"])
    for rel in ("native/cpu/runtime/pool.c", "native/cpu/quant/kernels.h", "setup.py", "pyproject.toml"):
        with open(root / rel, "a") as f:
            f.write("\n")
        assert launch(repo, "run") == (0, ["-m pip install -q -e .", "-m app.platform_check", "-m app"]), rel
        assert launch(repo, "run") == (0, ["-m app.platform_check", "-m app"]), rel


def test_failed_install_is_retried_next_launch(repo) -> None:
    status, calls = launch(repo, "run", status=1)
    assert status == 1 and calls == ["-m pip install -q -e ."]
    assert launch(repo, "run") == (0, ["-m pip install -q -e .", "-m app.platform_check", "-m app"])


def test_test_script_keeps_its_own_stamp_for_the_dev_extra(repo) -> None:
    assert launch(repo, "run") == (0, ["-m pip install -q -e .", "-m app.platform_check", "-m app"])
    assert launch(repo, "test") == (0, ['-m pip install -q -e .[dev]', "-m pytest"])
    assert launch(repo, "test") == (0, ["-m pytest"])
    assert launch(repo, "run") == (0, ["-m app.platform_check", "-m app"])


def test_missing_native_kernels_are_built_again(repo) -> None:
    """A stamp that matches does not hide a checkout without the kernels (git clean, another worktree)."""
    root = repo[0]
    assert launch(repo, "run") == (0, ["-m pip install -q -e .", "-m app.platform_check", "-m app"])
    (root / "engine/_native_cpu.abi3.so").unlink()
    assert launch(repo, "run") == (0, ["-m pip install -q -e .", "-m app.platform_check", "-m app"])
    assert launch(repo, "run") == (0, ["-m app.platform_check", "-m app"])


def test_install_without_a_compiler_is_tried_again(repo) -> None:
    """pip succeeds without a C compiler (the extension is optional); no stamp is written, so the
    kernels are built by the first launch after a compiler is installed."""
    assert launch(repo, "run", compiler=False) == (0, ["-m pip install -q -e .", "-m app.platform_check", "-m app"])
    assert launch(repo, "run", compiler=False) == (0, ["-m pip install -q -e .", "-m app.platform_check", "-m app"])
    assert launch(repo, "run") == (0, ["-m pip install -q -e .", "-m app.platform_check", "-m app"])
    assert launch(repo, "run") == (0, ["-m app.platform_check", "-m app"])
