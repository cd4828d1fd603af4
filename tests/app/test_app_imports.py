"""The app reaches the engine only through its allow-list of modules (DESIGN.md's arrows; the same list as
pyproject's import-linter contract, which tests/test_import_contracts.py keeps complete)."""

from __future__ import annotations

import ast
from pathlib import Path


def test_app_imports_only_the_engines_public_modules():
    allowed = {"engine.api", "engine.events", "engine.sampling", "engine.errors", "engine.hub", "engine.openai",
               "engine.session"}
    app_dir = Path(__file__).resolve().parents[2] / "app"
    for source in app_dir.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names
                                         if node.module == "engine"]
            for name in names:
                if name.startswith("engine") and name != "engine":
                    assert name in allowed or name.startswith("engine.openai."), f"{source.name} imports {name}"
