"""The engine's one exception family.

Every error the engine raises on bad input derives from :class:`EngineError`, and its message
names the file, key or tensor involved and what was expected, so the app can show it to a user
as it is.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelFormatError(EngineError):
    """A model file is malformed: truncated, wrong magic, missing or mis-shaped tensor, absurd metadata."""


class UnsupportedModelError(EngineError):
    """A well-formed file the engine cannot run: unknown architecture or unsupported quant type."""


class TokenizerError(EngineError):
    """The tokenizer metadata or chat template in a model file is missing or unusable."""


class TemplateError(TokenizerError):
    """The chat template failed to render, or tried to leave its sandbox."""


class ContextFullError(EngineError):
    """A prompt (or prompt plus answer) does not fit the context window."""


class MemoryFitError(EngineError):
    """A requested size (the context's KV cache) needs more memory than the machine has available."""


class GenerationCancelled(EngineError):
    """Raised inside the engine when a cancel flag was set; the API turns it into a final event."""


class ImageError(EngineError):
    """An image file is unreadable, corrupt, too large to decode safely, or of an unusable shape."""


class DeviceError(EngineError):
    """The GPU path cannot run: no GPU or pycuda, a driver or compile error, or out of GPU memory."""


class DeviceBudgetError(DeviceError):
    """The work does not fit the GPU memory budget it was given; the GPU itself works (smaller work may fit)."""


class RemoteError(EngineError):
    """An OpenAI-compatible server could not be reached, refused a request, went silent past the timeout or
    dropped the connection mid-answer (:mod:`engine.openai.remote`); the message names the URL."""
