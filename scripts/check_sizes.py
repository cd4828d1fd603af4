"""The size gate: source files over WARN lines are listed, any over FAIL lines fails the check.

Usage: python scripts/check_sizes.py [ROOT]  (default: the repository this script is in)

Counts the lines of the Python, C and CUDA sources under engine/, app/, training/, native/ and tests/.
Prints one line per file over WARN ("warning" or "too long"); exits 1 when any file is over FAIL, else 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

WARN = 500
FAIL = 700
FOLDERS = ("engine", "app", "training", "native", "tests")
SUFFIXES = {".py", ".c", ".h", ".cu", ".cuh"}


def line_count(path: Path) -> int:
    """Lines in ``path`` (a last line without a newline counts)."""
    data = path.read_bytes()
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def oversized(root: Path) -> list[tuple[Path, int]]:
    """(path relative to ``root``, lines) of every source file over WARN lines, longest first."""
    found = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                n = line_count(path)
                if n > WARN:
                    found.append((path.relative_to(root), n))
    return sorted(found, key=lambda item: (-item[1], str(item[0])))


def main(argv: list[str]) -> int:
    """Print the oversized files; 1 when one is over FAIL lines."""
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    found = oversized(root)
    for path, n in found:
        kind = "too long" if n > FAIL else "warning"
        print(f"{path}: {n} lines ({kind}: warn over {WARN}, fail over {FAIL})")
    return 1 if any(n > FAIL for _, n in found) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
