"""The native CPU sources' layout: folders by kind, every source in the build, and no circle of calls between
translation units (a unit calls the ``dd_*`` functions another defines; headers count in every unit that
includes them, transitively).
"""

from __future__ import annotations

import re
import runpy
from pathlib import Path

NATIVE = Path(__file__).resolve().parents[1] / "native" / "cpu"
DEFINITION = re.compile(r"^[A-Za-z_][\w \*]*?\b(dd_\w+)\([^;{]*\)\s*\{", re.MULTILINE)
DECLARATION = re.compile(r"^[A-Za-z_][\w \*]*?\b(dd_\w+)\([^;{]*\);", re.MULTILINE)
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
CALL = re.compile(r"\b(dd_\w+)\s*\(")
INCLUDE = re.compile(r'^#include "([\w.]+)"', re.MULTILINE)


def _headers() -> dict[str, Path]:
    return {p.name: p for p in NATIVE.rglob("*.h")}


def _unit_text(source: Path, headers: dict[str, Path]) -> str:
    """The source with every local header it includes, transitively (each once), without comments and
    function declarations (what is left names a function only to call it or define it)."""
    seen, todo, parts = set(), [source], []
    while todo:
        path = todo.pop()
        text = COMMENT.sub(" ", path.read_text(encoding="utf-8"))
        parts.append(DECLARATION.sub(" ", text))
        for name in INCLUDE.findall(text):
            if name in headers and name not in seen:
                seen.add(name)
                todo.append(headers[name])
    return "\n".join(parts)


def _call_graph() -> dict[str, set[str]]:
    """Unit (path under native/cpu) -> the other units whose non-static ``dd_*`` functions it calls."""
    headers = _headers()
    units = {str(p.relative_to(NATIVE)): p for p in NATIVE.rglob("*.c")}
    owner = {}
    for name, path in units.items():
        text = path.read_text(encoding="utf-8")
        owner.update({m.group(1): name for m in DEFINITION.finditer(text) if not m.group(0).startswith("static")})
    return {name: {owner[f] for f in CALL.findall(_unit_text(path, headers)) if f in owner and owner[f] != name}
            for name, path in units.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of units, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u)):
            return found
    return None


def test_sources_sit_in_folders_by_kind_and_all_are_built():
    build = runpy.run_path(str(NATIVE / "build.py"))
    kinds = set(build["KINDS"])
    files = {str(p.relative_to(NATIVE)) for p in NATIVE.rglob("*") if p.suffix in {".c", ".h"}}
    assert {f.split("/")[0] for f in files if "/" in f} == kinds
    assert {f for f in files if "/" not in f} == {"deltadesk_cpu.h"}
    built = set(build["PORTABLE_SOURCES"]) | set(build["X86_ISA_SOURCES"]) | set(build["HEADERS"])
    assert built == files


def test_no_circle_of_calls_between_units():
    graph = _call_graph()
    assert graph["quant/matvec.c"] >= {"runtime/dispatch.c"}       # the graph sees calls across units
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_cycle_finder_reports_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
