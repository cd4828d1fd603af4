"""scripts/check_sizes.py: warns over 500 lines, fails over 700, counts only sources in the checked folders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_sizes.py"


def _write(root: Path, rel: str, lines: int, newline_at_end: bool = True) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(f"x{i} = {i}" for i in range(lines))
    path.write_text(text + ("\n" if newline_at_end else ""))


def _run(root: Path) -> tuple[int, list[str]]:
    done = subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout.splitlines()


def test_warns_over_500_and_fails_over_700_lines(tmp_path):
    _write(tmp_path, "engine/at_the_limit.py", 500)
    _write(tmp_path, "app/one_over.py", 501)
    _write(tmp_path, "native/cpu/kernel.c", 700)
    _write(tmp_path, "tests/too_long.py", 701, newline_at_end=False)
    rc, lines = _run(tmp_path)
    assert rc == 1
    assert lines == ["tests/too_long.py: 701 lines (too long: warn over 500, fail over 700)",
                     "native/cpu/kernel.c: 700 lines (warning: warn over 500, fail over 700)",
                     "app/one_over.py: 501 lines (warning: warn over 500, fail over 700)"]


def test_warnings_alone_pass_and_other_files_are_not_counted(tmp_path):
    _write(tmp_path, "training/long.py", 650)
    _write(tmp_path, "engine/notes.md", 900)
    _write(tmp_path, "engine/__pycache__/cached.py", 900)
    _write(tmp_path, "docs/long.py", 900)
    _write(tmp_path, "native/cuda/prefill.cu", 120)
    rc, lines = _run(tmp_path)
    assert (rc, lines) == (0, ["training/long.py: 650 lines (warning: warn over 500, fail over 700)"])
