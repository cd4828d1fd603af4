"""What ``engine serve`` refuses before any work: a full waiting queue, text the tokenizer cannot take, a
``file:`` image that is too large or not an image, and a prompt whose images cannot fit the context.

Each refusal is an :class:`APIError` (429 with ``Retry-After``, or 400 naming the field), never a 500;
a ``file:`` image's contents are never quoted. Design: docs/design/http-server.md (the guarantees).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any



from .requests import APIError

"""Largest image file a ``file:`` URL may name, bytes."""
DEFAULT_MAX_WAITING = 8
DEFAULT_MAX_WAITING_BYTES = 64 << 20
RETRY_AFTER_S = 5


class QueueFull(APIError):
    """429: too many requests (or request bytes) wait already; ``headers`` carry ``Retry-After``."""

    def __init__(self, message: str) -> None:
        super().__init__(429, message, code="rate_limit_exceeded")
        self.headers = {"Retry-After": str(RETRY_AFTER_S)}


class WaitingQueue:
    """Counts the requests waiting for the engine and the bytes of their bodies (one event loop: no lock).

    Args:
        max_waiting: requests that may wait at once (each from when its body is read until its turn starts).
        max_waiting_bytes: bytes of request bodies those may hold together.
    """

    def __init__(self, max_waiting: int = DEFAULT_MAX_WAITING,
                 max_waiting_bytes: int = DEFAULT_MAX_WAITING_BYTES) -> None:
        self.max_waiting, self.max_waiting_bytes = max_waiting, max_waiting_bytes
        self.waiting = 0
        self.bytes = 0

    @contextlib.contextmanager
    def enter(self) -> Iterator[Ticket]:
        """A place in the queue for one request, given back when the block ends or :meth:`Ticket.leave` is called.

        Raises:
            QueueFull: ``max_waiting`` requests wait already.
        """
        if self.waiting >= self.max_waiting:
            raise QueueFull(f"{self.waiting} requests are waiting for the model already (at most "
                            f"{self.max_waiting}); retry in {RETRY_AFTER_S} s")
        ticket = Ticket(self)
        self.waiting += 1
        try:
            yield ticket
        finally:
            ticket.leave()


class Ticket:
    """One request's place in a :class:`WaitingQueue` and the body bytes it holds."""

    def __init__(self, queue: WaitingQueue) -> None:
        self.queue, self.bytes, self.left = queue, 0, False

    def grow(self, n: int) -> None:
        """``n`` more body bytes arrived.

        Raises:
            QueueFull: the waiting bodies would exceed ``max_waiting_bytes``.
        """
        if self.left:
            return
        if self.queue.bytes + n > self.queue.max_waiting_bytes:
            raise QueueFull(f"the requests waiting for the model hold {self.queue.bytes} bytes already (at most "
                            f"{self.queue.max_waiting_bytes}); retry in {RETRY_AFTER_S} s")
        self.bytes += n
        self.queue.bytes += n

    def leave(self) -> None:
        """The turn started (or the request ended): no longer waiting."""
        if not self.left:
            self.left = True
            self.queue.waiting -= 1
            self.queue.bytes -= self.bytes


def check_text(value: Any, where: str = "") -> None:
    """Refuse (400, naming the field) a string anywhere in ``value`` that is not valid Unicode text.

    JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer takes.

    Raises:
        APIError: the first such string, e.g. ``messages[0].content[1].text``.
    """
    stack = [(where, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise APIError(400, f"{path or 'the body'} holds a lone surrogate (\\u{ord(item[exc.start]):04x} "
                               f"at character {exc.start}), which is not text", param=path or None,
                               code="invalid_text") from None
        elif isinstance(item, Mapping):
            for key, sub in item.items():
                if isinstance(key, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in key):
                    raise APIError(400, f"a field name in {path or 'the body'} holds a lone surrogate",
                                   param=path or None, code="invalid_text")
                stack.append((f"{path}.{key}" if path else str(key), sub))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", sub) for i, sub in enumerate(item))


def check_fits(engine: Any, messages: list[dict], enable_thinking: bool, context: int,
               tools: list[dict] | None = None) -> None:
    """Refuse a chat whose text and images cannot fit ``context`` tokens, before any image is encoded.

    The rendered text (each image one placeholder; ``tools`` as the chat passes them) is checked first; then each
    image's tokens (``engine.image_info(source).tokens``) are added, stopping at the first that overflows.

    Raises:
        APIError: 400 ``context_length_exceeded`` naming the counts; the engine's own errors (a template or
            image error) as they are.
    """
    sources = [p["image"] for m in messages if isinstance(m.get("content"), list)
               for p in m["content"] if p.get("type") == "image"]
    if not sources or context <= 0:
        return
    total = len(engine.render(messages, enable_thinking, tools) if tools else engine.render(messages, enable_thinking))
    if total > context:
        raise _overflow(f"{len(sources)} images and {total} tokens of text", context)
    for k, source in enumerate(sources):
        total += engine.image_info(source).tokens - 1
        if total > context:
            raise _overflow(f"{len(sources)} images (the first {k + 1} already take more than the rest of "
                            "the window)", context)


def _overflow(what: str, context: int) -> APIError:
    return APIError(400, f"the prompt with {what} does not fit the context window of {context} tokens: send "
                    "fewer or smaller images, or a shorter conversation", param="messages",
                    code="context_length_exceeded")
