"""The app's allow-list of engine modules (pyproject's import-linter contract) names every other one.

import-linter has no "only these" contract, so the app contract forbids every other top-level engine module
or wing; this test fails when a new one is added without deciding whether the app may use it
(tests/app/test_app_imports.py reads the app's import statements against the list itself).
"""

import pkgutil
import tomllib
from pathlib import Path

import engine

ROOT = Path(__file__).parents[1]
ALLOWED = {"engine.api", "engine.events", "engine.errors", "engine.sampling", "engine.hub", "engine.openai",
           "engine.session"}


def _top_level_engine_modules() -> set[str]:
    return {f"engine.{m.name}" for m in pkgutil.iter_modules(engine.__path__)
            if not m.name.startswith("_") or m.name == "__main__"}


def test_app_contract_forbids_every_engine_module_off_the_allow_list():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    (app,) = [c for c in contracts if c["type"] == "forbidden" and c["source_modules"] == ["app"]]
    modules = _top_level_engine_modules()
    assert ALLOWED <= modules
    assert set(app["forbidden_modules"]) == modules - ALLOWED

