"""``GET /metrics``: the server's counters in the Prometheus text format (``prometheus-client``).

Each application has a :class:`ServerMetrics` of its own (its own ``CollectorRegistry``), so that
several servers in one process (the tests, the app beside ``engine serve``) count apart. Metric names
follow Prometheus' conventions (https://prometheus.io/docs/practices/naming/): a ``deltadesk_`` prefix,
base units (seconds), ``_total`` on counters (added by the client library).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from engine.events import Event, PrefillStats, TurnSummary

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Seconds: from a cached prompt's few tens of ms to a long prompt prefilled on the CPU."""
DECODE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 80.0, 120.0, 200.0)
"""Tokens/s of one answer's decode (after its first token)."""


class ServerMetrics:
    """The metrics of one server: requests by route and status, prompt tokens prefilled and resumed
    from prefix snapshots, time to first token, decode speed, and the requests waiting for the engine.

    Args:
        routes: the route paths counted by name; any other path is counted as ``other`` (a scanner
            trying many paths cannot grow the label set).
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, routes: tuple[str, ...]) -> None:
        self.routes = frozenset(routes)
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("deltadesk_requests", "HTTP requests answered, by route and status code",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("deltadesk_prompt_tokens", "Prompt tokens of the turns run, by how they "
                                     "were read: 'prefilled' through the model or 'resumed' from a prefix snapshot",
                                     ["source"], registry=r)
        self.prefill_time = Counter("deltadesk_prefill_seconds", "Wall time of the prompts' prefill (forward "
                                    "passes and snapshot writes)", registry=r)
        self.restore_time = Counter("deltadesk_snapshot_restore_seconds", "Wall time of restoring prefix "
                                    "snapshots (RAM or disk tier) before prefill", registry=r)
        self.generated = Counter("deltadesk_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("deltadesk_time_to_first_token_seconds", "Time to first token of each answer "
                              "(template, image encoding and prefill included)", buckets=TTFT_BUCKETS, registry=r)
        self.decode = Histogram("deltadesk_decode_tokens_per_second", "Decode speed of each answer of two tokens or "
                                "more, first token excluded", buckets=DECODE_BUCKETS, registry=r)
        self.queue = Gauge("deltadesk_queue_length", "Requests waiting for the engine (queued behind the "
                           "running turn)", registry=r)

    def track_cache(self, cache: Any) -> None:
        """Also expose ``cache`` (an :class:`engine.turn.prefix_cache.PrefixCache`, or None for none), read at
        each scrape: ``deltadesk_prefix_cache_ram_bytes`` (its snapshots and KV pages held in RAM, bytes) and
        ``deltadesk_prefix_cache_snapshots`` (its snapshots, RAM and disk tier, by tier)."""
        if cache is None:
            return
        ram = Gauge("deltadesk_prefix_cache_ram_bytes", "Bytes of prefix snapshots and their KV pages held in RAM",
                    registry=self.registry)
        ram.set_function(lambda: cache.ram_bytes)
        count = Gauge("deltadesk_prefix_cache_snapshots", "Prefix snapshots kept, by tier", ["tier"],
                      registry=self.registry)
        for tier in ("ram", "disk"):
            count.labels(tier).set_function(lambda tier=tier: sum(s.tier == tier for s in cache.snapshots()))

    def route(self, path: str) -> str:
        """The route label a request path is counted under ("other" for unknown paths)."""
        return path if path in self.routes else "other"

    def observe(self, event: Event) -> None:
        """Count one engine event of a served turn (thread-safe: called on the turn's thread)."""
        if isinstance(event, PrefillStats):
            self.prompt_tokens.labels("prefilled").inc(event.prefilled_tokens)
            self.prompt_tokens.labels("resumed").inc(event.reused_tokens)
            self.ttft.observe(event.ttft_ms / 1e3)
            self.prefill_time.inc(event.prefill_ms / 1e3)
            self.restore_time.inc(event.restore_ms / 1e3)
        elif isinstance(event, TurnSummary):
            self.generated.inc(event.generated_tokens)
            if event.generated_tokens > 1 and event.decode_tok_s > 0:
                self.decode.observe(event.decode_tok_s)

    def queued(self) -> Queued:
        """A request now waiting for the engine (counted in ``deltadesk_queue_length`` until released)."""
        return Queued(self.queue)

    def watch(self, start: Callable[..., Iterator[Event]], queued: Queued) -> Callable[..., Iterator[Event]]:
        """``start`` (a turn's event source, see ``engine.openai.app._Turn``) with each event counted and
        ``queued`` released when the engine takes the turn up; closing the watched iterator closes
        ``start``'s (which ends the engine's turn)."""
        def watched(*args: Any) -> Iterator[Event]:
            queued.release()
            with contextlib.closing(start(*args)) as events:
                for event in events:
                    self.observe(event)
                    yield event
        return watched

    def text(self) -> bytes:
        """The exposition (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware counting each HTTP response by route and status code in ``metrics.requests``;
    a request whose handler raised (answered 500 further out) is counted as 500, one whose client left
    before any answer as 499."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """ASGI entry: count the request by route and response status (499: no response was started)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            status.append(500)
            raise
        finally:
            self.metrics.requests.labels(self.metrics.route(scope["path"]), str(status[0] if status else 499)).inc()



class Queued:
    """One request counted in a queue-length gauge until :meth:`release` (idempotent, thread-safe)."""

    def __init__(self, gauge: Gauge) -> None:
        self._gauge = gauge
        self._lock = threading.Lock()
        self._waiting = True
        gauge.inc()

    def release(self) -> None:
        """Stop counting the request as waiting (once; later calls do nothing)."""
        with self._lock:
            if self._waiting:
                self._waiting = False
                self._gauge.dec()
