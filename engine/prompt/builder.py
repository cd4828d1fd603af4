"""The one place where chat messages and images become prompt token rows, rotary positions and the
prompt positions worth a prefix snapshot.

The chat template (the model's own, or ChatML) renders the messages; each image part stays one
image-pad placeholder there, which :meth:`PromptBuilder.prepare` expands to as many pads as the
vision tower makes tokens for that image, and whose rows the tower's embeddings replace. The text
family's chat markup (:class:`engine.registry.ChatMarkup`: message start, assistant header, image
placeholder and opener) marks the snapshot points and the images.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from ..errors import ContextFullError, ImageError, TemplateError, UnsupportedModelError
from ..registry import ChatMarkup
from .template import ChatTemplate
from .tokenizer import Tokenizer
from ..vision.encoder import EncodedImage, ImageEncoder

Message = Mapping[str, Any]

CHATML = ChatMarkup(message_start="<|im_start|>", assistant_header="<|im_start|>assistant\n", image_pad="",
                    image_start="")
"""The markup of the ChatML fallback template (:func:`chatml`), for a family that names none: no image markers."""


@dataclass(frozen=True)
class Prompt:
    """A prepared prompt.

    Attributes:
        tokens: (n,) token ids, each image expanded to its image-pad tokens.
        positions: (3, n) int64 M-RoPE positions, or None for text only (plain positions).
        images: (first pad index, (k, n_embd) float32 embeddings, digest bytes) per image.
        encoded: the vision tower's results (sizes used, timings, cache hits), one per image.
    """

    tokens: list[int]
    positions: np.ndarray | None
    images: list[tuple[int, np.ndarray, bytes]]
    encoded: list[EncodedImage]


@functools.cache
def chatml() -> ChatTemplate:
    """The ChatML template of files without their own (compiled once)."""
    source = (resources.files("engine") / "prompt" / "templates" / "chatml.jinja").read_text(encoding="utf-8")
    return ChatTemplate(source, origin="engine/prompt/templates/chatml.jinja (ChatML fallback)")


def text_bytes(value: Any) -> int:
    """UTF-8 bytes of every string inside ``value`` (messages: contents, text parts, tool calls)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", errors="surrogatepass"))
    if isinstance(value, Mapping):
        return sum(text_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_bytes(v) for v in value)
    return 0


def image_sources(messages: Sequence[Message]) -> list[Any]:
    """The ``image`` of every ``{"type": "image", ...}`` part, in message order (None where it is missing)."""
    return [part.get("image") for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, Mapping) and part.get("type") == "image"]


class PromptBuilder:
    """Renders and tokenizes conversations for one loaded model.

    Args:
        tokenizer: the model's tokenizer (its chat template, or None for ChatML).
        vision: the image encoder, or None for a text-only model.
        source: the model file, for messages. name: its file name, for messages about what it lacks.
        context: the context window, tokens.
        markup: the text family's marker tokens (:attr:`engine.registry.TextArch.markup`; None: :data:`CHATML`).
    """

    def __init__(self, tokenizer: Tokenizer, vision: ImageEncoder | None, source: str, name: str,
                 context: int, markup: ChatMarkup | None = None) -> None:
        self.tokenizer = tokenizer
        self.vision = vision
        self.source = source
        self.name = name
        self.context = context
        self.markup = markup or CHATML
        im_start = tokenizer.token_id(self.markup.message_start)
        self.im_start = -1 if im_start is None else im_start
        self._header = tokenizer.encode(self.markup.assistant_header, special=True)
        self._image_pad = tokenizer.token_id(self.markup.image_pad) if self.markup.image_pad else None
        self._vision_start = tokenizer.token_id(self.markup.image_start) if self.markup.image_start else None

    def check_text_fits(self, size: int, what: str, advice: str) -> None:
        """Refuse text of ``size`` UTF-8 bytes that is more tokens than the context holds whatever its
        tokens (each stands for at most ``Tokenizer.max_token_bytes``), before tokenizing it.

        Raises:
            ContextFullError: naming ``what``, its size, the context window and ``advice``.
        """
        per_token = self.tokenizer.max_token_bytes
        if size > self.context * per_token:
            raise ContextFullError(
                f"{what} holds {size:,} bytes of text, at least {-(-size // per_token):,} tokens "
                f"(a token stands for at most {per_token} bytes), but the context window holds "
                f"{self.context:,} tokens: {advice}.")

    def render(self, messages: Sequence[Message], enable_thinking: bool = False,
               tools: Sequence[Message] | None = None) -> list[int]:
        """Render and tokenize ``messages`` (and the function ``tools`` offered); see
        :meth:`engine.api.Engine.render`."""
        template = self.tokenizer.chat_template or chatml()
        tools = list(tools or ())
        size = text_bytes(messages) + text_bytes(tools)
        self.check_text_fits(size, "The conversation", "shorten it or start a new conversation")
        # the tools' text is escaped with the messages' (one set of stand-ins) so it cannot make control ids either
        escaped, literals = self.tokenizer.escape_messages([*messages, *tools], template.source)
        kept = escaped[:len(escaped) - len(tools)]
        text = template.render(kept, add_generation_prompt=True, enable_thinking=enable_thinking,
                               tools=escaped[len(kept):] or None, room=size)
        return self.tokenizer.encode_rendered(text, literals)

    def prepare(self, messages: Sequence[Message], enable_thinking: bool = False,
                cancel: threading.Event | None = None, tools: Sequence[Message] | None = None) -> Prompt:
        """Render, tokenize and encode the images of ``messages``; see :meth:`engine.api.Engine.prepare`."""
        return self._with_images(self.render(messages, enable_thinking, tools), messages, cancel)

    def _with_images(self, ids: list[int], messages: Sequence[Message], cancel: threading.Event | None) -> Prompt:
        """The prompt of ``ids`` (``messages`` rendered by :meth:`render`) with their images encoded and expanded.

        Raises:
            UnsupportedModelError, ImageError, TemplateError: as :meth:`prepare`.
        """
        sources = image_sources(messages)
        if not sources:
            return Prompt(ids, None, [], [])
        vision = self._vision_for_images()
        if any(src is None for src in sources):
            raise ImageError('an image part has no "image" (a path, bytes or a PIL image)')
        encoded = [vision.encode(src, cancel=cancel) for src in sources]
        tokens, spans = self._expand(ids, encoded)
        try:
            positions = vision.arch.positions(tokens, [img.grid for img in encoded], self._image_pad,
                                              self._vision_start)
        except ValueError as exc:
            raise TemplateError(f"{self.source}: the prompt's image tokens are malformed: {exc}") from exc
        return Prompt(tokens, positions, spans, encoded)

    def _vision_for_images(self) -> ImageEncoder:
        """The image encoder, when this model can read images at all.

        Raises:
            UnsupportedModelError: no vision tower, or no image tokens in the vocabulary.
        """
        if self.vision is None:
            raise UnsupportedModelError(
                f"{self.name}: no vision tower (mmproj file) is loaded, so this model cannot read images")
        if self._image_pad is None or self._vision_start is None:
            pad, start = self.markup.image_pad or "image-pad", self.markup.image_start or "image-start"
            raise UnsupportedModelError(f"{self.source}: the vocabulary has no {pad} / {start} token for images")
        return self.vision

    def _expand(self, ids: Sequence[int], encoded: Sequence[EncodedImage]
                ) -> tuple[list[int], list[tuple[int, np.ndarray, bytes]]]:
        """Each image placeholder in ``ids`` -> its image's pad tokens; the (start, embeddings, key) spans.

        Raises:
            TemplateError: the template wrote a different number of placeholders than there are images.
        """
        tokens: list[int] = []
        spans: list[tuple[int, np.ndarray, bytes]] = []
        used = 0
        for t in ids:
            if t != self._image_pad:
                tokens.append(t)
                continue
            if used == len(encoded):
                raise TemplateError(f"{self.source}: the chat template wrote more image placeholders than images")
            self._expand_image(encoded[used], used, tokens, spans)
            used += 1
        if used != len(encoded):
            raise TemplateError(f"{self.source}: the chat template wrote {used} image placeholders "
                                f"for {len(encoded)} images")
        return tokens, spans

    def _expand_image(self, img: EncodedImage, index: int, tokens: list[int],
                      spans: list[tuple[int, np.ndarray, bytes]]) -> None:
        """Append image ``index``'s tokens and spans: its architecture's layout (text and runs of pads, each run
        the next rows of the embeddings, e.g. MiniCPM-V's slices), or one run of ``n_tokens`` pads."""
        vision = self._vision_for_images()
        key = self.image_key(img)
        layout = vision.arch.layout
        segments = [img.n_tokens] if layout is None else layout(vision.tower, img, index)
        row = 0
        for seg in segments:
            if isinstance(seg, str):
                tokens.extend(self.tokenizer.encode(seg, special=True))
                continue
            spans.append((len(tokens), img.embeddings[row:row + seg], key))
            tokens.extend([self._image_pad] * seg)
            row += seg
        if row != img.n_tokens:
            raise TemplateError(f"{self.source}: an image layout placed {row} of the image's {img.n_tokens} rows")

    def image_key(self, img: EncodedImage) -> bytes:
        """What an image contributes to the prefix-cache key: its content, the tower and the resize
        bounds (the embeddings and the grid depend on all three)."""
        vision = self._vision_for_images()
        h = hashlib.blake2b(digest_size=16)
        for part in (vision.tower.identity, img.digest, vision.min_pixels, vision.max_pixels, img.grid):
            h.update(repr(part).encode())
        return h.digest()

    def checkpoints(self, prompt: Sequence[int]) -> list[int]:
        """Snapshot positions: every message start and the end of the last assistant header;
        see :meth:`engine.api.Engine.checkpoints`."""
        starts = [i for i, t in enumerate(prompt) if t == self.im_start and i > 0]
        points = list(starts)
        h = len(self._header)
        if starts and list(prompt[starts[-1]:starts[-1] + h]) == self._header:
            points.append(starts[-1] + h)
        return points

    def message_starts(self, prompt: Sequence[int]) -> list[int]:
        """Indices of every message-start token in ``prompt`` (the first token of each message)."""
        return [i for i, t in enumerate(prompt) if t == self.im_start]

    def ahead(self, messages: Sequence[Message], enable_thinking: bool, cancel: threading.Event | None,
              tools: Sequence[Message] | None = None) -> tuple[Prompt, int] | None:
        """The prompt the next turn will start with, and where its new user message will begin.

        None when the template renders the earlier messages differently depending on the next one
        (then no prefix can be read ahead), or when there is no earlier message.

        Raises:
            TemplateError, ImageError: as :meth:`prepare`.
        """
        # Whether the earlier messages render alike whatever follows them is asked of the renders before the
        # images are expanded (an image's rows depend on the image alone, the same in both).
        probe = list(messages) + [{"role": "user", "content": "."}]
        plain = self.render(probe, enable_thinking, tools)
        plain_starts = self.message_starts(plain)
        if len(plain_starts) < 2:
            return None
        other = self.render(list(messages) + [{"role": "user", "content": "?\n\n"}], enable_thinking, tools)
        if other[:plain_starts[-2]] != plain[:plain_starts[-2]]:
            return None
        follow = self._with_images(plain, probe, cancel)
        return follow, self.message_starts(follow.tokens)[-2]
