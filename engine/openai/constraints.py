"""What a chat request's answer is held to: the grammar that constrains its decoding (tool calls that
must come, strict tool arguments, a response format) and the reader of its tool calls.

Grammars are compiled by the engine (:meth:`engine.api.Engine.grammar`, llguidance) on the turn's own
thread, so that neither the first compile (the token table, about a second on the real vocabulary) nor
a large schema stalls the event loop; compiled grammars are kept (least recently used first out), so
an agent that sends the same tools and format with every request compiles them once.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from engine.turn.grammar import Grammar, GrammarError

from .requests import APIError, TurnRequest
from .tool_calls import CallReader, call_format
from .tool_grammar import call_grammar

KEEP_GRAMMARS = 32
"""Compiled grammars kept per server."""


class Constraints:
    """The grammars and call readers of one engine's requests.

    Args:
        engine: an :class:`engine.api.Engine` (``grammar``, ``tokenizer.chat_template``).

    Attributes:
        format: the template's call format, "xml" or "json" (:func:`~engine.openai.tool_calls.call_format`).
        renders_tools: the template writes ``tools`` into the prompt (the ChatML fallback does not).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        template = getattr(getattr(engine, "tokenizer", None), "chat_template", None)
        source = template.source if template is not None else ""
        self.format = call_format(source)
        self.renders_tools = "tools" in source
        self._kept: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, req: TurnRequest) -> None:
        """Refuse (400) tools that the model's template would leave out of the prompt."""
        if req.tools and not self.renders_tools:
            raise APIError(400, "tools: this model's chat template does not write tools into the prompt (the file "
                           "has no tokenizer.chat_template, or its template ignores them), so it cannot be "
                           "offered tools", param="tools", code="unsupported_parameter")

    def reader(self, req: TurnRequest) -> CallReader | None:
        """What reads the tool calls out of ``req``'s answers: None without tools or with ``tool_choice``
        "none" (then a call the model writes anyway stays content)."""
        if not req.tools or req.tool_choice == "none":
            return None
        return CallReader({t["function"]["name"]: t["function"] for t in req.tools}, self.format)

    def spec(self, req: TurnRequest) -> dict[str, Any] | None:
        """The keyword arguments of ``Engine.grammar`` for ``req``, or None when its answer is free."""
        tools = req.tools if req.tool_choice != "none" else ()
        lark = call_grammar(tools, self.format, req.tool_choice, req.tool_name, req.parallel_tool_calls,
                            req.response_format)
        if lark is not None:
            return {"lark": lark, "reasoning": req.enable_thinking}
        fmt = req.response_format
        if fmt is None:
            return None
        if fmt["type"] == "json_object":
            return {"json_object": True, "reasoning": req.enable_thinking}
        return {"json_schema": fmt["schema"], "reasoning": req.enable_thinking}

    def grammar(self, req: TurnRequest) -> Grammar | None:
        """The compiled grammar of ``req`` (call on the turn's thread), or None.

        Raises:
            APIError: 400 when llguidance cannot enforce the schema or tools (its message names the feature).
        """
        try:
            spec = self.spec(req)
        except GrammarError as exc:
            raise APIError(400, f"tools: {exc}", param="tools", code="unsupported_schema") from exc
        if spec is None:
            return None
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key]
        try:
            grammar = self.engine.grammar(**spec)
        except GrammarError as exc:
            param = "response_format" if "lark" not in spec else "tools"
            raise APIError(400, f"{param}: {exc}", param=param, code="unsupported_schema") from exc
        with self._lock:
            self._kept[key] = grammar
            while len(self._kept) > KEEP_GRAMMARS:
                self._kept.popitem(last=False)
        return grammar
