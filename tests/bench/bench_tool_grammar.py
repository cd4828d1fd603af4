"""What enforcing tool calls costs the server: compiling a request's call grammar
(:func:`engine.openai.tool_grammar.call_grammar` through ``Engine.grammar``) for an agent-sized tool list,
in the XML form of Qwen3.5/3.6 and the JSON form of older templates, and the first token's mask.

The token table is built once per engine (timed separately: the first grammar a server compiles pays
it); the server keeps compiled grammars, so an agent pays the compile once per distinct tool list.

Usage: ``.venv/bin/python tests/bench/bench_tool_grammar.py [--model M] [--tools 20] [--runs 5]`` (default
model: the bundled demo; any Qwen3.5/3.6 GGUF has the real 248,320-token vocabulary). Prints medians;
note the machine's load (``uptime``) beside the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine.api import Engine, EngineOptions, default_model
from engine.openai.fields import tools_of
from engine.openai.tool_grammar import call_grammar


def agent_tools(count: int) -> tuple[dict, ...]:
    """``count`` tools shaped like a coding agent's: a path, a count, an enum and a nested object each."""
    return tools_of([{"type": "function", "function": {"name": f"tool_{i}", "description": "x" * 200, "parameters": {
        "type": "object", "required": ["path"], "properties": {
            "path": {"type": "string"}, "count": {"type": "integer", "minimum": 0},
            "mode": {"type": "string", "enum": ["a", "b", "c"]},
            "opts": {"type": "object", "properties": {"x": {"type": "boolean"}}}}}}} for i in range(count)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tools", type=int, default=20)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    engine = Engine.load(args.model or default_model(), options=EngineOptions(context=512))
    start = time.perf_counter()
    engine.grammar(json_object=True)
    print(f"token table + first grammar: {time.perf_counter() - start:.2f} s (vocabulary {engine.tokenizer.n_vocab})")
    tools = agent_tools(args.tools)
    for fmt in ("xml", "json"):
        lark = call_grammar(tools, fmt, "required", None, True, None)
        compiles, masks = [], []
        for _ in range(args.runs):
            start = time.perf_counter()
            grammar = engine.grammar(lark=lark)
            compiles.append(time.perf_counter() - start)
            matcher = grammar.matcher()
            start = time.perf_counter()
            matcher.allowed()
            masks.append(time.perf_counter() - start)
        print(f"{fmt}: {args.tools} tools, compile median {statistics.median(compiles) * 1e3:.1f} ms, "
              f"first mask median {statistics.median(masks) * 1e3:.2f} ms")
    engine.close()


if __name__ == "__main__":
    main()
