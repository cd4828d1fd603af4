""""Serve on localhost": ``engine serve`` on 127.0.0.1 running the app's loaded engine.

The engine worker owns it and starts it on the engine it loaded, so the server shares that engine's
weights, GPU placement and prefix-snapshot cache; both submit their turns to the engine's one
:class:`engine.session.Session`, so the app's answers and the server's requests take turns on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import EngineError

LOOPBACK = "127.0.0.1"


class LocalServer:
    """The OpenAI-compatible server of the app (at most one, loopback only, no key: nothing beyond this
    machine can reach it)."""

    def __init__(self) -> None:
        self._thread: Any = None

    @property
    def running(self) -> bool:
        """Whether it listens."""
        return self._thread is not None

    def start(self, engine: Any, port: int, session: Any) -> str:
        """Serve ``engine`` on ``http://127.0.0.1:port/v1``, its turns run by ``session`` (the worker's); a
        running server is stopped first.

        Returns:
            One line for the status area: where it listens, or why it does not (a remote engine, a port
            in use). Never raises.
        """
        self.stop()
        info = engine.info
        if info.remote:
            return "Not serving: the model runs on a remote server (serve on localhost needs a model loaded here)"
        from engine.openai import ServerConfig, ServerThread
        name = Path(info.path).stem if info.path is not None else "deltadesk"
        try:
            self._thread = ServerThread(engine, ServerConfig(name), LOOPBACK, port, session).start()
        except EngineError as exc:
            return f"Not serving: {exc}"
        return f"Serving {name} on {self._thread.url}"

    def stop(self) -> None:
        """Stop listening (a request in progress is cut off); harmless when not running."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop()
