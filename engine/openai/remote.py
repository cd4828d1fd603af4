"""A :class:`engine.api.ChatEngine` that talks to an OpenAI-compatible server (vLLM, SGLang, llama-server,
another DeltaDesk's ``engine serve``).

A turn is one streamed ``POST {base_url}/chat/completions`` read with ``httpx`` and turned into the
in-process engine's events (TTFT here includes the network). Nothing the server sends is trusted
(:mod:`engine.openai.remote_http`); failures are :class:`~engine.errors.RemoteError` naming the URL.
Design: docs/design/remote-engine.md.
"""

from __future__ import annotations

import base64
import io
import logging
import mimetypes
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import httpx

from ..api_types import ModelInfo
from ..channels import THINK_CLOSE, THINK_OPEN, raw_text_splitter
from ..errors import ImageError, RemoteError, UnsupportedModelError
from ..events import Event, Part, PrefillStats, TokenEvent, TurnSummary
from ..turn.prefix_cache import SnapshotInfo
from ..prompt.builder import Message
from ..gguf.regular import MAX_IMAGE_FILE_BYTES, FileRefused, read_regular
from .remote_http import Watch, clean, lines, loads, read_body
from ..sampling import SamplingParams

log = logging.getLogger(__name__)

_STOP = {"stop": "eos", "length": "max_tokens", "content_filter": "eos", "tool_calls": "eos"}
_NO_REUSE = httpx.Limits(max_keepalive_connections=0)   # every request connects anew: its socket can be cut
_ERROR_BODY = 1 << 20       # bytes of an error reply read at most
_MAX_CONTEXT = 10**8        # a max_model_len at or beyond this is not believed
_IDS_QUOTED = 5             # model ids an error message names at most


def _timeout(seconds: float) -> httpx.Timeout:
    """``seconds`` to connect and between two pieces of an answer (a long prefill sends nothing until its end)."""
    return httpx.Timeout(seconds, connect=min(seconds, 10.0))


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _refusal(url: str, response: httpx.Response) -> RemoteError:
    """The error of a non-2xx response: the server's own message when it sent the OpenAI error shape."""
    try:
        raw = read_body(response, _ERROR_BODY)
    except (httpx.HTTPError, ValueError):
        raw = b""
    try:
        error = loads(raw)["error"]
        detail = clean(error["message"] if isinstance(error, Mapping) else error)
    except (ValueError, KeyError, TypeError):
        detail = clean(raw[:200].decode("utf-8", "replace").strip())
    hint = " (check the API key in the settings)" if response.status_code in (401, 403) else ""
    return RemoteError(f"{url} answered {response.status_code}{hint}: {detail or clean(response.reason_phrase)}")


def _unreachable(url: str, exc: httpx.HTTPError, timeout: float) -> RemoteError:
    if isinstance(exc, httpx.TimeoutException):
        return RemoteError(f"{url}: no answer within {timeout:g} s ({type(exc).__name__})")
    return RemoteError(f"cannot reach {url}: {clean(exc) or type(exc).__name__} (is the server running, and the base "
                       "URL right?)")


def list_models(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The models a server lists at ``GET {base_url}/models`` (OpenAI shape: ``{"data": [{"id": ...}]}``).

    Raises:
        RemoteError: unreachable, refused, not whole within ``timeout`` s, over 16 MiB, or not the OpenAI
            list shape.
    """
    url = base_url.rstrip("/") + "/models"
    watch = Watch(None, timeout)
    try:
        with httpx.Client(headers=_headers(api_key), timeout=_timeout(timeout), limits=_NO_REUSE) as client, \
                watch, client.stream("GET", url, extensions=watch.extensions) as response:
            if response.status_code != 200:
                raise _refusal(url, response)
            raw = read_body(response)
        if watch.fired:
            raise httpx.ReadTimeout("cut at the deadline")
    except httpx.HTTPError as exc:
        if watch.fired:
            raise RemoteError(f"{url}: the model list did not arrive whole within {timeout:g} s") from exc
        raise _unreachable(url, exc, timeout) from exc
    except ValueError as exc:
        raise RemoteError(f"{url}: {exc}") from exc
    try:
        data = loads(raw)["data"]
        if not isinstance(data, list) or not all(isinstance(m, Mapping) and isinstance(m.get("id"), str)
                                                 for m in data):
            raise TypeError("an entry without an id")
    except (ValueError, KeyError, TypeError) as exc:
        raise RemoteError(f"{url}: not an OpenAI model list ({clean(exc)})") from exc
    return list(data)


def server_props(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """What llama-server tells at ``GET /props`` (beside ``/v1``): ``{"n_ctx": int, "vision": bool}``, the keys
    it says (``default_generation_settings.n_ctx``, ``modalities.vision``); {} from a server without that route
    or with another shape (vLLM, SGLang), or when it cannot be reached or answers out of bounds (not whole within
    ``timeout`` s, over 16 MiB, JSON nested too deep): the chat request will say what is wrong."""
    root = base_url.rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    watch = Watch(None, timeout)
    try:
        with httpx.Client(headers=_headers(api_key), timeout=_timeout(timeout), limits=_NO_REUSE) as client, \
                watch, client.stream("GET", root + "/props", extensions=watch.extensions) as response:
            props = loads(read_body(response)) if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}
    out: dict[str, Any] = {}
    if isinstance(props, Mapping) and not watch.fired:
        settings, modalities = props.get("default_generation_settings"), props.get("modalities")
        n_ctx = settings.get("n_ctx") if isinstance(settings, Mapping) else props.get("n_ctx")
        if _context(n_ctx, root + "/props"):
            out["n_ctx"] = n_ctx
        if isinstance(modalities, Mapping) and isinstance(modalities.get("vision"), bool):
            out["vision"] = modalities["vision"]
    return out


def _context(value: Any, url: str) -> int:
    """A listed ``max_model_len`` when it is a positive integer below 10^8, else 0 (unknown) with a log line."""
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < _MAX_CONTEXT:
        return value
    log.warning("remote: %s lists max_model_len %s, not a positive integer below 10^8: ignored", url,
                clean(repr(value), 40))
    return 0


def _image_url(source: Any) -> str:
    """An engine image part's source (path, bytes or PIL image) as a ``data:`` URL.

    Raises:
        ImageError: the file cannot be read.
    """
    if isinstance(source, (bytes, bytearray)):
        data, mime = bytes(source), "image/png"
    elif isinstance(source, (str, Path)):
        try:
            data = read_regular(source, MAX_IMAGE_FILE_BYTES)
        except FileRefused as exc:
            raise ImageError(f"{source}: the image file {exc}") from None
        except OSError as exc:
            raise ImageError(f"{source}: cannot read the image: {exc.strerror or exc}") from exc
        mime = mimetypes.guess_type(str(source))[0] or "image/png"
    elif hasattr(source, "save"):
        buffer = io.BytesIO()
        source.save(buffer, format="PNG")
        data, mime = buffer.getvalue(), "image/png"
    else:
        raise ImageError(f"an image part must be a path, bytes or a PIL image, got {type(source).__name__}")
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def openai_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The engine's message format as OpenAI chat messages (image parts become ``image_url`` data URLs).

    Raises:
        ImageError: an image file cannot be read.
    """
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [{"type": "image_url", "image_url": {"url": _image_url(p.get("image"))}}
                       if p.get("type") == "image" else {"type": "text", "text": p.get("text", "")} for p in content]
        out.append({"role": m["role"], "content": content})
    return out


class RemoteEngine:
    """A model served elsewhere, behind the OpenAI chat API.

    Build it with :meth:`connect`. Like :class:`engine.api.Engine`, one turn at a time.

    Args:
        base_url: the API root, e.g. ``http://127.0.0.1:8080/v1``.
        model: the model id to ask for (one of :func:`list_models`).
        api_key: sent as ``Authorization: Bearer``; None = none.
        timeout: seconds to connect and, once asked, between two pieces of the answer.
        context: the server's context window, tokens (0 = unknown).
        has_vision: whether image parts are sent (False: the app leaves them out and says so).
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 300.0,
                 context: int = 0, has_vision: bool = True) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self._info = ModelInfo(arch="remote", context=context, has_vision=has_vision, device="remote", name=model,
                               remote=self.base_url)
        self._client = httpx.Client(headers=_headers(api_key), timeout=_timeout(timeout), limits=_NO_REUSE)

    @classmethod
    def connect(cls, base_url: str, model: str, api_key: str | None = None, timeout: float = 300.0) -> "RemoteEngine":
        """Check that the server lists ``model`` and read its context and whether it reads images.

        The context is the entry's ``max_model_len`` (vLLM, ``engine serve``), else llama-server's ``/props``
        ``n_ctx``; one that is not a positive integer below 10^8 is ignored (context unknown) with a log line.
        Images are read when the entry says ``"vision": true`` (``engine serve``) or ``/props`` says
        ``modalities.vision`` (llama-server with ``--mmproj``). A server that says neither is taken as text
        only, and :attr:`info`'s ``vision_note`` says why.

        Raises:
            RemoteError: unreachable, refused, or the model is not listed (the message names at most five
                of those that are).
        """
        models = list_models(base_url, api_key, min(timeout, 30.0))
        entry = next((m for m in models if m["id"] == model), None)
        if entry is None:
            names = ", ".join(clean(m["id"], 60) for m in models[:_IDS_QUOTED]) or "none"
            more = f" and {len(models) - _IDS_QUOTED} more" if len(models) > _IDS_QUOTED else ""
            raise RemoteError(f"{base_url} does not serve a model named {clean(model, 60)!r} (it lists: {names}{more})")
        context, vision = _context(entry.get("max_model_len"), base_url), entry.get("vision")
        if not context or not isinstance(vision, bool):
            props = server_props(base_url, api_key, min(timeout, 30.0))
            context = context or props.get("n_ctx", 0)
            vision = vision if isinstance(vision, bool) else props.get("vision")
        engine = cls(base_url, model, api_key, timeout, context, vision is True)
        if vision is not True:
            engine._info = replace(engine._info, vision_note=(
                f"{base_url} does not say that {model} reads images (no \"vision\" in its /v1/models entry, no "
                "modalities.vision in /props): serve it with its vision tower (llama-server --mmproj, "
                "engine serve --mmproj) to send images"))
        return engine

    @property
    def info(self) -> ModelInfo:
        """The model as far as the server tells (see :class:`engine.api.ModelInfo`: no file fields)."""
        return self._info

    def body(self, messages: Sequence[Message], sampling: SamplingParams, enable_thinking: bool) -> dict[str, Any]:
        """The request body of one turn: messages, sampling fields (``top_k``, ``min_p`` and
        ``repetition_penalty`` are the vLLM / llama.cpp extensions), a streamed answer with usage, and
        thinking said both ways servers read it: ``chat_template_kwargs.enable_thinking`` (vLLM, SGLang,
        llama-server, ``engine serve``) and, when on, ``reasoning_effort`` (the OpenAI field; "medium", its
        default level) for servers that read only that one."""
        body: dict[str, Any] = {
            "model": self.model, "messages": openai_messages(messages), "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "min_p": sampling.min_p, "presence_penalty": sampling.presence_penalty,
            "repetition_penalty": sampling.repetition_penalty,
            "chat_template_kwargs": {"enable_thinking": enable_thinking}}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if enable_thinking:
            body["reasoning_effort"] = "medium"
        return body

    def chat(self, messages: Sequence[Message], sampling: SamplingParams = SamplingParams(),
             cancel: threading.Event | None = None, enable_thinking: bool = False,
             conversation: str = "") -> Iterator[Event]:
        """One turn on the server, as the in-process engine's events (see the module doc).

        ``conversation`` is not sent (the server keeps its own cache). Setting ``cancel`` (from any thread)
        cuts the connection within about 0.05 s, even while the server sends nothing, which stops the turn
        on servers that watch for it (``engine serve``, vLLM, llama-server), and ends with a "cancelled"
        summary. An answer whose data lines stop for ``timeout`` s ends then (keep-alive comments do not
        count).

        Raises:
            ImageError: an image file cannot be read (before anything is sent).
            RemoteError: see the module doc; raised after the events of what had arrived.
        """
        return self._turn(self.body(messages, sampling, enable_thinking), cancel or threading.Event(), enable_thinking)

    def _turn(self, body: dict[str, Any], cancel: threading.Event, thinking: bool) -> Iterator[Event]:
        url = self.base_url + "/chat/completions"
        started = time.perf_counter()
        state = _StreamState(thinking)
        watch = Watch(cancel, self.timeout)
        try:
            with watch, self._client.stream("POST", url, json=body, extensions=watch.extensions) as response:
                if response.status_code != 200:
                    raise _refusal(url, response)
                for line in lines(response):
                    if cancel.is_set():
                        break
                    chunk = _chunk(line, url)
                    if chunk is None:
                        continue
                    watch.progress()
                    if chunk is _DONE:
                        state.done = True
                        break
                    yield from state.take(chunk, started)
        except httpx.HTTPError as exc:
            if not cancel.is_set():
                raise self._failure(url, exc, state, watch.fired == "deadline") from exc
        except ValueError as exc:
            raise RemoteError(f"{url} sent {exc} after {len(state.texts)} pieces; the partial answer is kept") from exc
        if cancel.is_set():
            yield state.summary("cancelled", "Stopped.", started)
        elif not state.done and watch.fired == "deadline":
            raise self._failure(url, None, state, True)
        elif not state.done:
            raise RemoteError(f"{url} ended the answer without 'data: [DONE]' after {len(state.texts)} pieces (the "
                              "server dropped the connection?); the partial answer is kept")
        else:
            yield state.summary(_STOP.get(state.finish or "stop", "eos"), "", started)

    def _failure(self, url: str, exc: httpx.HTTPError | None, state: _StreamState, deadline: bool) -> RemoteError:
        """The error of a turn whose connection failed, timed out or was cut at its deadline."""
        if deadline or exc is None:
            return RemoteError(f"{url}: no answer within {self.timeout:g} s (no data, or only keep-alive "
                               f"comments) after {len(state.texts)} pieces; the partial answer is kept")
        if not state.texts:
            return _unreachable(url, exc, self.timeout)
        return RemoteError(f"{url} dropped the connection mid-answer after {len(state.texts)} pieces "
                           f"({type(exc).__name__}: {clean(exc)}); the partial answer is kept")

    def telemetry(self) -> Any:
        """None: GPU prefill telemetry is the server's."""
        return None

    def snapshots(self) -> list[SnapshotInfo]:
        """[]: the prefix snapshots are the server's."""
        return []

    def clear_snapshots(self, key: str | None = None) -> None:
        """Nothing to drop here: the snapshots are the server's."""

    def image_info(self, source: Any) -> None:
        """None: the server's vision tower decides the size an image reaches its model at and the tokens it
        takes; the image is sent whole as a ``data:`` URL.

        Raises:
            UnsupportedModelError: the server does not say that it reads images (see :meth:`connect`).
        """
        if not self._info.has_vision:
            raise UnsupportedModelError(self._info.vision_note or f"{self.base_url} does not read images")
        return None

    def close(self) -> None:
        """Close the HTTP connections."""
        self._client.close()


_DONE = object()


def _chunk(line: str, url: str) -> Any:
    """One SSE line: a chunk dict, ``_DONE``, or None (blank, comment, other field).

    Raises:
        RemoteError: the line is not JSON, or it carries the server's error.
    """
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    try:
        chunk = loads(data)
    except ValueError as exc:
        raise RemoteError(f"{url} sent a stream line that is not JSON ({clean(exc, 60)}): {clean(data, 120)!r}") \
            from exc
    if not isinstance(chunk, dict):
        raise RemoteError(f"{url} sent a stream line that is not a JSON object: {clean(data, 120)!r}")
    if "error" in chunk:
        error = chunk["error"]
        raise RemoteError(f"{url} reported an error mid-answer: "
                          f"{clean(error.get('message') if isinstance(error, Mapping) else error)}")
    return chunk


def _count(value: Any) -> int | None:
    """A server's token count when it is one (a non-negative integer, not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class _StreamState:
    """What one streamed answer has brought so far."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking
        self.texts: list[str] = []
        self.ms: list[float] = []
        self.usage: Mapping[str, Any] = {}
        self.finish: str | None = None
        self.done = False
        self.prefill: PrefillStats | None = None
        self._last = 0.0
        self._in_reasoning = False
        self._separated = False       # the server sends reasoning apart: its content is content
        self._raw = raw_text_splitter(thinking)

    def take(self, chunk: Mapping[str, Any], started: float) -> Iterator[Event]:
        if isinstance(chunk.get("usage"), Mapping):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], Mapping) else {}
        finish = choice.get("finish_reason")
        self.finish = finish if isinstance(finish, str) and finish else self.finish
        delta = choice.get("delta") if isinstance(choice.get("delta"), Mapping) else {}
        reasoning, content = delta.get("reasoning_content") or delta.get("reasoning"), delta.get("content")
        parts = self._parts(reasoning, content)
        text = self._text(reasoning, content)
        if not text:
            return
        now = time.perf_counter()
        if self.prefill is None:
            ttft_ms = (now - started) * 1e3
            self._last = now
            self.prefill = PrefillStats(prompt_tokens=0, reused_tokens=0, prefilled_tokens=0, prefill_ms=ttft_ms,
                                        restore_ms=0.0, device="remote", ttft_ms=ttft_ms)
            yield self.prefill
        ms = self.prefill.ttft_ms if not self.texts else (now - self._last) * 1e3
        self._last = now
        self.texts.append(text)
        self.ms.append(ms)
        channel = parts[-1][0] if parts else self._raw.channel
        yield TokenEvent(token_id=-1, text=text, ms=ms, index=len(self.texts) - 1, channel=channel, parts=tuple(parts))

    def _parts(self, reasoning: Any, content: Any) -> list[Part]:
        """The piece's channels: ``reasoning_content`` is reasoning; content is content once the server has
        sent reasoning apart, else raw text to split."""
        parts: list[Part] = []
        if isinstance(reasoning, str) and reasoning:
            self._separated = True
            parts.append(("reasoning", reasoning))
        if isinstance(content, str) and content:
            parts += [("content", content)] if self._separated else self._raw.push(content)
        return parts

    def _text(self, reasoning: Any, content: Any) -> str:
        """The piece as the model wrote it: reasoning inside ``<think>`` ... ``</think>``."""
        out = ""
        if isinstance(reasoning, str) and reasoning:
            if not self._in_reasoning:
                self._in_reasoning = True
                out += "" if self.thinking and not self.texts else THINK_OPEN
            out += reasoning
        if isinstance(content, str) and content:
            if self._in_reasoning:
                self._in_reasoning = False
                out += THINK_CLOSE + "\n\n"
            out += content
        return out

    def summary(self, reason: str, message: str, started: float) -> TurnSummary:
        details = self.usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, Mapping) else None
        prompt = _count(self.usage.get("prompt_tokens"))
        generated = _count(self.usage.get("completion_tokens"))
        return TurnSummary.of_turn(
            reason, message, self.prefill, self.ms, "".join(self.texts),  # type: ignore[arg-type]
            prompt_tokens=prompt or 0, reused_tokens=cached or 0, generated_tokens=generated,
            parts=tuple(self._raw.close()))
