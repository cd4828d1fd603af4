"""OpenAI request bodies -> what the engine takes; every bad field an :class:`APIError` naming it.

The field names, defaults and error shape follow the OpenAI API reference (Chat Completions and
Completions, https://platform.openai.com/docs/api-reference/chat/create) and the extensions llama.cpp's
and vLLM's servers accept (``top_k``, ``min_p``, ``repetition_penalty``,
``chat_template_kwargs``); ``n`` is at most :data:`MAX_CHOICES`. The agent fields (tools, response
format, logprobs, logit bias, thinking controls) are checked by :mod:`engine.openai.fields`. Fields the
engine cannot honour (``echo``, ``suffix``, ``best_of``) are refused rather than ignored; fields that
change nothing here (``user``, ``metadata``, ``store``, ...) are ignored.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import urllib.parse
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from PIL import Image, UnidentifiedImageError

from engine.errors import EngineError
from engine.gguf.regular import MAX_IMAGE_FILE_BYTES, read_regular
from engine.sampling import SamplingParams

MAX_STOP_STRINGS = 16
MAX_CHOICES = 8
"""Most choices (``n``) one request may ask for: each is a whole answer decoded in turn."""
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class APIError(Exception):
    """A request the server answers with an OpenAI-shaped error.

    Attributes:
        status: the HTTP status (400 bad request, 401 bad key, 403 a ``Host`` a loopback server does not
            answer, 404 unknown model or route, 413 body too large, 415 a body not sent as JSON, 500
            engine failure).
        message: plain words naming the field and what was expected.
        type: OpenAI's error type ("invalid_request_error", "authentication_error", "server_error").
        param: the offending field ("messages[1].content[0].image_url"), or None.
        code: a machine-readable code ("model_not_found", "context_length_exceeded", ...), or None.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        """The response body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class TurnRequest:
    """One chat or completion request, checked.

    Attributes:
        model: the model named (already matched to the served one).
        messages: the conversation in the engine's format (chat), or None (completion).
        prompt: the raw text to continue (completion), or None (chat).
        sampling: the engine's sampling settings; ``max_tokens`` is the request's or the context size.
        enable_thinking: ``chat_template_kwargs.enable_thinking``.
        stop: strings that end the answer (not included in it).
        stream: answer as server-sent events.
        include_usage: ``stream_options.include_usage``: a last chunk with the usage.
        n: how many choices to answer (each a whole answer; all resume the same prompt snapshot).
        tools: the OpenAI function tools offered (``{"type": "function", "function": {name, description,
            parameters, strict}}``), checked; () when none.
        tool_choice: "auto", "none", "required", or "function" (then ``tool_name`` names the one to call).
        tool_name: the function ``tool_choice`` forces, or None.
        parallel_tool_calls: more than one call allowed where calls are enforced.
        response_format: None (free text), ``{"type": "json_object"}`` or ``{"type": "json_schema",
            "schema": {...}, "name": str, "strict": bool}``.
    """

    model: str
    messages: list[dict] | None
    prompt: str | None
    sampling: SamplingParams
    enable_thinking: bool = False
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    tools: tuple[dict, ...] = ()
    tool_choice: str = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    response_format: dict | None = None

    def choice_sampling(self, index: int) -> SamplingParams:
        """Choice ``index``'s sampling settings: the request's, its seed (when given) plus ``index``."""
        if index == 0 or self.sampling.seed is None:
            return self.sampling
        return replace(self.sampling, seed=self.sampling.seed + index)


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _number(body: Mapping[str, Any], name: str, low: float | None = None, high: float | None = None,
            integer: bool = False) -> Any:
    """``body[name]`` checked: a number (an integer when asked) within [low, high], or None when absent/null."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise _bad(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    if isinstance(value, int) and abs(value) > 2 ** 63:  # JSON integers are unbounded; floats overflow
        raise _bad(f"{name} must be at most 2^63 in magnitude, got an integer of {len(str(abs(value)))} digits", name)
    if not math.isfinite(value) or (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise _bad(f"{name} must be in {bounds}, got {value!r}", name)
    return value


def _flag(body: Mapping[str, Any], name: str, where: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"{where}{name} must be true or false, got {value!r}", where + name)
    return value


def _object(body: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _bad(f"{name} must be an object, got {type(value).__name__}", name)
    return value


def _refuse(body: Mapping[str, Any], names: Mapping[str, Any]) -> None:
    """Refuse each field of ``names`` set to something other than its harmless value."""
    for name, harmless in names.items():
        value = body.get(name)
        if value is not None and value != harmless:
            raise _bad(f"{name} is not supported by this server (got {value!r})", name, "unsupported_parameter")


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise _bad(f"stop must be a non-empty string or a list of them, got {value!r}", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise _bad(f"stop holds {len(items)} strings; at most {MAX_STOP_STRINGS}", "stop")
    return tuple(items)


def _choices(body: Mapping[str, Any]) -> int:
    """``n``: 1 to :data:`MAX_CHOICES` answers to the one prompt."""
    n = _number(body, "n", 1, integer=True)
    if n is not None and n > MAX_CHOICES:
        raise _bad(f"n must be at most {MAX_CHOICES} (each choice is a whole answer decoded in turn), got {n}", "n")
    return 1 if n is None else n


def sampling_of(body: Mapping[str, Any], context: int, default_max_tokens: int | None = None) -> SamplingParams:
    """The engine's sampling settings from the request's fields; an absent field keeps the engine's default.

    ``max_completion_tokens`` (the newer name) wins over ``max_tokens``; with neither the answer may run
    to ``default_max_tokens`` or, when None, to the end of the context window of ``context`` tokens.

    Raises:
        APIError: a field of the wrong type or out of range (400).
    """
    base = SamplingParams()
    values = {
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": _number(body, "top_p", 0.0, 1.0),
        "top_k": _number(body, "top_k", -1, integer=True),
        "min_p": _number(body, "min_p", 0.0, 1.0),
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0),
        "repetition_penalty": _number(body, "repetition_penalty", 0.0),
        "seed": _number(body, "seed", 0, integer=True),
    }
    if values["top_k"] == -1:
        values["top_k"] = 0  # vLLM's "off"
    limit = _number(body, "max_completion_tokens", 1, integer=True)
    if limit is None:
        limit = _number(body, "max_tokens", 1, integer=True)
    values["max_tokens"] = limit if limit is not None else (default_max_tokens or max(1, context))
    if values["top_p"] == 0.0:
        raise _bad("top_p must be above 0", "top_p")
    if values["repetition_penalty"] == 0.0:
        raise _bad("repetition_penalty must be above 0", "repetition_penalty")
    try:
        return SamplingParams(**{name: getattr(base, name) if v is None else v for name, v in values.items()})
    except EngineError as exc:
        raise _bad(str(exc)) from exc


def image_source(url: Any, param: str, file_urls: bool = True) -> bytes:
    """An ``image_url`` part's URL as what the engine reads: the bytes of a ``data:`` URL (base64) or of the
    local image file a ``file:`` URL names (:func:`read_image_file`: a regular file,
    size-checked before reading, its contents never quoted). Web URLs are not fetched (the server makes no
    outgoing requests).

    Args:
        file_urls: whether ``file:`` URLs are read at all (False on a server reachable from other
            machines, whose clients must not read the server's files).

    Raises:
        APIError: not a string, not base64, not a readable local image file, a file URL when ``file_urls``
            is False, or an http(s) URL (400).
    """
    if not isinstance(url, str) or not url:
        raise _bad(f"{param} must be a data: or file: URL string", param)
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        head, comma, payload = url.partition(",")
        if not comma or not head.endswith(";base64"):
            raise _bad(f"{param}: a data URL must be 'data:image/...;base64,<data>'", param, "invalid_image")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise _bad(f"{param}: the data URL's base64 payload is malformed ({exc})", param, "invalid_image") from exc
    if scheme == "file":
        parts = urllib.parse.urlparse(url)
        if parts.netloc not in ("", "localhost"):
            raise _bad(f"{param}: a file URL must name a file on this machine, not on {parts.netloc!r}", param,
                       "invalid_image")
        if not file_urls:
            raise _bad(f"{param}: this server does not read its own files for this request (it listens beyond "
                       "this machine, or the request's Host is not this machine); send the image as a data: URL "
                       "(base64)", param, "invalid_image")
        return read_image_file(Path(urllib.request.url2pathname(parts.path)), param)
    raise _bad(f"{param}: {scheme}: URLs are not fetched; send the image as a data: URL (base64) or a file: URL",
               param, "invalid_image")


def _content(content: Any, param: str, file_urls: bool) -> str | list[dict]:
    """A message's ``content`` in the engine's format: a string, or parts (text and images; ``file_urls``
    as :func:`image_source` takes it)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad(f"{param} must be a string or a list of parts, got {type(content).__name__}", param)
    parts: list[dict] = []
    for k, part in enumerate(content):
        where = f"{param}[{k}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise _bad(f"{where}.text must be a string", where + ".text")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, Mapping) else image
            parts.append({"type": "image", "image": image_source(url, where + ".image_url.url", file_urls)})
        else:
            raise _bad(f"{where}: part type {kind!r} is not supported (expected 'text' or 'image_url')", where)
    return parts


def messages_of(value: Any, file_urls: bool = True) -> list[dict]:
    """The request's ``messages`` in the engine's format (roles, text, image parts; an assistant's
    ``reasoning_content`` passed on for the template); ``file_urls`` as :func:`image_source` takes it.

    Raises:
        APIError: not a non-empty list of ``{"role", "content"}`` objects with a known role (400).
    """
    if not isinstance(value, list) or not value:
        raise _bad("messages must be a non-empty list of {role, content} objects", "messages")
    out: list[dict] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise _bad(f"{where} must be an object", where)
        role = ROLES.get(m.get("role")) if isinstance(m.get("role"), str) else None
        if role is None:
            raise _bad(f"{where}.role must be one of {', '.join(ROLES)}, got {m.get('role')!r}", where + ".role")
        message: dict[str, Any] = {"role": role, "content": _content(m.get("content"), where + ".content", file_urls)}
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            message["reasoning_content"] = m["reasoning_content"]
        out.append(message)
    return out


def _common(body: Any, served: str) -> tuple[str, bool, bool]:
    """(model, stream, include_usage) of any request body; the model must be the one served."""
    if not isinstance(body, Mapping):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required: the name GET /v1/models lists", "model")
    if model != served:
        raise APIError(404, f"the model {model!r} does not exist: this server serves {served!r}", param="model",
                       code="model_not_found")
    stream = _flag(body, "stream")
    options = _object(body, "stream_options")
    if options and not stream:
        raise _bad("stream_options is only allowed with stream: true", "stream_options")
    return model, stream, _flag(options, "include_usage", "stream_options.")


def chat_request(body: Any, served: str, context: int, file_urls: bool = True) -> TurnRequest:
    """A ``POST /v1/chat/completions`` body, checked (see the module doc for the fields).

    Args:
        served: the model name the server answers to. context: the context window, tokens.
        file_urls: whether ``file:`` image URLs are read (see :func:`image_source`).

    Raises:
        APIError: the body names another model (404) or a field is bad (400).
    """
    model, stream, usage = _common(body, served)
    return TurnRequest(model, messages_of(body.get("messages"), file_urls), None, sampling_of(body, context), False,
                       _stop(body), stream, usage, n=_choices(body))


def completion_request(body: Any, served: str, context: int) -> TurnRequest:
    """A ``POST /v1/completions`` body, checked: ``prompt`` is a string (or a list holding one) continued
    as it is; ``max_tokens`` defaults to 16 as in the OpenAI API.

    Raises:
        APIError: the body names another model (404) or a field is bad (400).
    """
    model, stream, usage = _common(body, served)
    _refuse(body, {"best_of": 1, "echo": False, "suffix": ""})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise _bad("prompt must be a non-empty string (token-id prompts and batches are not supported)", "prompt")
    return TurnRequest(model, None, prompt, sampling_of(body, context, default_max_tokens=16), False, _stop(body),
                       stream, usage, n=_choices(body))


def read_image_file(path: Path, param: str) -> bytes:
    """The bytes of the image file a ``file:`` URL names, checked before and after reading.

    Opened only if it is a regular file (a FIFO or device is never read; opening does not block), its size
    checked on the open file against ``MAX_IMAGE_FILE_BYTES`` before reading, and its header parsed as an
    image. The errors never say whether the file is missing, unreadable, a folder or too large, and never
    quote its contents.

    Raises:
        APIError: 400 "does not name a readable regular file" or "not an image".
    """
    unreadable = APIError(400, f"{param}: the file: URL does not name a readable regular file of at most "
                          f"{MAX_IMAGE_FILE_BYTES >> 20} MiB", param=param, code="invalid_image")
    try:
        data = read_regular(path, MAX_IMAGE_FILE_BYTES)
    except (OSError, ValueError):
        raise unreadable from None
    try:
        Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        pass                     # an image: the engine refuses its size with its own message
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
        raise APIError(400, f"{param}: not an image", param=param, code="invalid_image") from None
    return data
