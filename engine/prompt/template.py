"""The sandboxed chat template: a model's ``tokenizer.chat_template`` rendered safely.

The template runs in jinja2's ``ImmutableSandboxedEnvironment`` configured as HF transformers does
(``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, ``strftime_now``,
``tojson``), hardened so that unsafe attribute access fails at once and a runaway template stops:
every render has a step and size budget, and a template that exceeds it raises
:class:`~engine.errors.TemplateError` naming its origin.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from ..errors import TemplateError


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)



class _Budget:
    """Allowance of one render: work steps (loop iterations, calls, attribute/item lookups,
    operators) and the size of any string or list it builds, characters / items."""

    def __init__(self, steps: int, origin: str, max_size: int) -> None:
        self.left = steps
        self.origin = origin
        self.max_size = max_size

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise TemplateError(f"{self.origin}: the template runs too long (endless loop?); stopped")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("deltadesk_template_budget", default=None)


def _spend() -> None:
    """Spend one step of the current render's budget (none outside a render, e.g. constant folding)."""
    budget = _BUDGET.get()
    if budget is not None:
        budget.spend()


_GUARD_FILTER = "deltadesk_guard_loop"
_BOUND_FILTER = "deltadesk_bound_size"


class _SandboxEnvironment(ImmutableSandboxedEnvironment):
    """HF's chat-template sandbox, hardened.

    * An unsafe attribute (``__class__``, ``__globals__``, ``mro``, list ``append``, ...) raises
      SecurityError immediately instead of yielding a silent undefined.
    * Every call, attribute / item lookup, intercepted operator and loop iteration spends one step
      of the render's :class:`_Budget`, so no template runs forever.
    * ``*``, ``**``, ``+``, ``%`` and ``~`` results are size-checked, so no template allocates
      gigabytes in a few operations.
    """

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, max_size: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.max_size = max_size
        self.filters["tojson"] = _tojson
        self.filters[_GUARD_FILTER] = self._guard_loop
        self.filters[_BOUND_FILTER] = self._bound
        self.globals["strftime_now"] = _strftime_now

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _spend()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _spend()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _spend()
        return super().getitem(obj, argument)

    def _limit(self) -> int:
        budget = _BUDGET.get()
        return self.max_size if budget is None else budget.max_size

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _spend()
        limit = self._limit()
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and _is_int(count) and len(seq) * count > limit:
                    raise SecurityError(f"'*' would build a sequence of {len(seq) * count} items (limit {limit})")
        if operator in ("*", "**") and _is_int(left) and _is_int(right):
            bits = (left.bit_length() + right.bit_length() if operator == "*"
                    else left.bit_length() * max(right, 0))
            if bits > 8 * limit:
                raise SecurityError(f"{operator!r} on integers would exceed {8 * limit} bits")
        return self._bound(super().call_binop(context, operator, left, right))

    def _bound(self, value: Any) -> Any:
        """Pass ``value`` on, unless it is a string / list / tuple larger than the size limit."""
        limit = self._limit()
        if isinstance(value, (str, list, tuple)) and len(value) > limit:
            raise SecurityError(f"a value of {len(value)} items exceeds the limit of {limit}")
        return value

    @staticmethod
    def _guard_loop(iterable: Any) -> Iterator[Any]:
        """Iterate ``iterable``, spending one budget step per item."""
        for item in iterable:
            _spend()
            yield item


def _guard_tree(tree: nodes.Template) -> nodes.Template:
    """Route every ``for`` loop's iterable through the budget and every ``~`` result through the size check."""
    for loop in list(tree.find_all(nodes.For)):
        loop.iter = nodes.Filter(loop.iter, _GUARD_FILTER, [], [], None, None, lineno=loop.lineno)
    for parent in list(tree.find_all(nodes.Node)):
        for field in parent.fields:
            child = getattr(parent, field)
            if isinstance(child, nodes.Concat):
                setattr(parent, field, nodes.Filter(child, _BOUND_FILTER, [], [], None, None, lineno=child.lineno))
            elif isinstance(child, list):
                child[:] = [nodes.Filter(c, _BOUND_FILTER, [], [], None, None, lineno=c.lineno)
                            if isinstance(c, nodes.Concat) else c for c in child]
    return tree


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """HF's ``tojson`` filter: plain ``json.dumps`` (no HTML escaping, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """HF's ``strftime_now`` global: the local time formatted with ``fmt``."""
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A model's Jinja chat template, rendered in a hardened sandbox (HF transformers conventions).

    Globals: ``raise_exception(msg)`` (raises TemplateError), ``strftime_now(fmt)``; filter ``tojson``.
    Limits: ``max_output`` characters of output and of any intermediate string/list (default 4 MiB),
    ``max_steps`` work steps per render (default 1,000,000: calls, lookups, loop iterations; the
    Qwen template spends ~30 per message).
    """

    def __init__(self, source: str, origin: str = "chat template", max_output: int = 4 << 20,
                 max_steps: int = 1_000_000) -> None:
        """Compile ``source``.

        Args:
            source: Jinja template text (e.g. GGUF ``tokenizer.chat_template``).
            origin: names the template in error messages (file and key).
            max_output: output size limit in characters.
            max_steps: work limit per render.

        Raises:
            TemplateError: the template does not compile.
        """
        self.source = source
        self.origin = origin
        self.max_output = max_output
        self.max_steps = max_steps
        self._env = _SandboxEnvironment(max_output)
        self._env.globals["raise_exception"] = self._raise_exception
        try:
            self._template = self._env.from_string(_guard_tree(self._env.parse(source)))
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"{origin}: syntax error at line {exc.lineno}: {exc.message}") from exc
        except Exception as exc:
            raise TemplateError(f"{origin}: does not compile: {type(exc).__name__}: {exc}") from exc

    def _raise_exception(self, message: str) -> None:
        raise TemplateError(f"{self.origin}: the template refused the conversation: {message}")

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
               enable_thinking: bool = True, tools: Sequence[dict[str, Any]] | None = None,
               room: int = 0) -> str:
        """Render a conversation to prompt text.

        Args:
            messages: ``{"role": "system"|"user"|"assistant"|"tool", "content": str | list of
                {"type": "text", "text": str} | {"type": "image"}, "reasoning_content": str (optional),
                "tool_calls": list (optional)}``.
            add_generation_prompt: end with the assistant header (Qwen: ``<|im_start|>assistant\\n<think>\\n``).
            enable_thinking: False makes Qwen's header close an empty think block.
            tools: JSON-schema function descriptions, or None.
            room: characters of text in the messages; the size limits grow by twice this (a long
                paste is the user's text, not a runaway template).

        Returns:
            The prompt text, special tokens written out (tokenize with ``special=True``).

        Raises:
            TemplateError: the template raised, failed, touched an unsafe attribute, ran past
                ``max_steps`` or produced more than ``max_output`` characters.
        """
        max_output = self.max_output + 2 * max(0, room)
        token = _BUDGET.set(_Budget(self.max_steps, self.origin, max_output))
        try:
            parts: list[str] = []
            size = 0
            for chunk in self._template.generate(messages=list(messages), tools=tools,
                                                 add_generation_prompt=add_generation_prompt,
                                                 enable_thinking=enable_thinking):
                size += len(chunk)
                if size > max_output:
                    raise TemplateError(f"{self.origin}: output exceeds {max_output} characters; stopped")
                parts.append(chunk)
            return "".join(parts)
        except TemplateError:
            raise
        except SecurityError as exc:
            raise TemplateError(f"{self.origin}: blocked by the sandbox: {exc}") from exc
        except RecursionError as exc:
            raise TemplateError(f"{self.origin}: recursion too deep") from exc
        except Exception as exc:
            raise TemplateError(f"{self.origin}: render failed: {type(exc).__name__}: {exc}") from exc
        finally:
            _BUDGET.reset(token)
