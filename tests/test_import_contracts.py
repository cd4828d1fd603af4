"""The app's allow-list of engine modules (pyproject's import-linter contract) names every other one.

import-linter has no "only these" contract, so the app contract forbids each engine module that is not
public; this test fails when a new engine module is added without deciding whether the app may use it.
"""

import pkgutil
import tomllib
from pathlib import Path

import engine

PUBLIC = {"engine.api", "engine.events", "engine.errors", "engine.sampling", "engine.hub", "engine.session"}


def test_app_contract_forbids_every_non_public_engine_module():
    config = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    (app,) = [c for c in contracts if c["type"] == "forbidden" and c["source_modules"] == ["app"]]
    modules = {f"engine.{m.name}" for m in pkgutil.iter_modules(engine.__path__)
               if not m.name.startswith("_") or m.name == "__main__"}
    assert PUBLIC <= modules
    assert set(app["forbidden_modules"]) == modules - PUBLIC
