"""The README's packaged-size figure is the one measured in docs/perf/packaging.md, and no smaller than what the
bundle must hold (the cheap half; tests/test_packaging.py builds the app and checks the figure itself)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_size_is_the_measured_one_and_holds_the_model():
    readme = (ROOT / "README.md").read_text()
    measured = (ROOT / "docs" / "perf" / "packaging.md").read_text()
    on_disk, packed = re.search(r"one folder, (\d+) MB on disk,\s+(\d+) MB as a `\.tar\.gz`", readme).groups()
    assert f"= **{on_disk} MB**" in measured and f"= {packed} MB" in measured
    exact = int(re.search(r"\(`du -sb`\) \| ([\d,]+) bytes", measured).group(1).replace(",", ""))
    assert round(exact / 1e6) == int(on_disk)
    models = sum(p.stat().st_size for p in (ROOT / "assets" / "models").glob("*.gguf"))
    assert exact > models > 0 and int(packed) < int(on_disk)
