"""Trace four walks through the code on the bundled demo model and count their hops between modules.

The walks: a model load, a chat message, a message with an image, and an HTTP chat completion through
the local server. For each: the project modules it enters, the distinct module-to-module calls, and the
deepest chain of modules on one call stack. Run from the repository root:
``python scripts/walks.py`` (CPU only, a few seconds).
"""

from __future__ import annotations

import importlib
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODEL = ROOT / "assets/models/deltadesk-demo.gguf"
MMPROJ = ROOT / "assets/models/deltadesk-demo-mmproj.gguf"
PACKAGES = ("engine", "app")


class Tracer:
    """A profile hook that records, per thread, the stack of project modules being executed."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.edges: set[tuple[str, str]] = set()
        self.deepest: list[str] = []
        self._stacks: dict[int, list[tuple[object, list[str]]]] = {}

    def _module(self, frame) -> str | None:
        path = Path(frame.f_code.co_filename)
        if not path.is_relative_to(ROOT) or path.parent.name == "scripts":
            return None
        rel = path.relative_to(ROOT)
        return ".".join(rel.with_suffix("").parts) if rel.parts[0] in PACKAGES else None

    def hook(self, frame, event: str, _arg) -> None:
        """Keep a stack of (frame, module chain) for project frames; calls between modules extend the chain."""
        stack = self._stacks.setdefault(threading.get_ident(), [])
        if event == "return":
            if stack and stack[-1][0] is frame:
                stack.pop()
            return
        if event != "call" or (mod := self._module(frame)) is None:
            return
        chain = stack[-1][1] if stack else []
        if not chain or chain[-1] != mod:
            if chain:
                self.edges.add((chain[-1], mod))
            chain = [*chain, mod]
        self.modules.add(mod)
        if len(chain) > len(self.deepest):
            self.deepest = chain
        stack.append((frame, chain))

    def run(self, body: Callable[[], object]) -> None:
        """Run ``body`` with the hook on this and every new thread."""
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)
        try:
            body()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)


def _first(*names: str):
    """The first of ``names`` (dotted ``module:attr``) that imports: the walks run before and after a move."""
    for name in names:
        mod, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {names}")


def main() -> None:
    """Load the demo model, run the four walks and print one line each."""
    from PIL import Image

    from engine.api import Engine, EngineOptions, SamplingParams
    opts = EngineOptions(context=1024, prefix_cache=False, device="cpu")
    sampling = SamplingParams(temperature=0.0, max_tokens=4)
    image = Path(tempfile.mkdtemp()) / "red.png"
    Image.new("RGB", (64, 48), (200, 20, 20)).save(image)
    holder: dict[str, Engine] = {}

    def load() -> None:
        holder["e"] = Engine.load(MODEL, MMPROJ, options=opts)

    def message() -> None:
        list(holder["e"].chat([{"role": "user", "content": "Hello there"}], sampling))

    def with_image() -> None:
        content = [{"type": "image", "image": str(image)}, {"type": "text", "text": "Colour?"}]
        list(holder["e"].chat([{"role": "user", "content": content}], sampling))

    def http() -> None:
        from starlette.testclient import TestClient
        app = _first("engine.openai.app:create_app", "engine.server.app:create_app")
        config = _first("engine.openai.app:ServerConfig", "engine.server.app:ServerConfig")
        with TestClient(app(holder["e"], config(model_name="demo"))) as client:
            r = client.post("/v1/chat/completions", json={"model": "demo", "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": "Hi"}]})
            r.raise_for_status()

    print(f"{'walk':<10} {'modules':>7} {'calls between modules':>22} {'deepest chain':>14}")
    for name, body in (("load", load), ("message", message), ("image", with_image), ("http", http)):
        t = Tracer()
        t.run(body)
        print(f"{name:<10} {len(t.modules):>7} {len(t.edges):>22} {len(t.deepest):>14}   {' > '.join(t.deepest)}")


if __name__ == "__main__":
    main()
