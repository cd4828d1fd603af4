"""An agent's session against a real ``engine serve``: is the long system prompt with its tools read once?

A scripted coding-agent session of 10 requests through the official ``openai`` client: a ~12k-token system
prompt plus 8 function tools, a user task, then each request adds the call the agent made (an assistant
message with ``tool_calls``) and that call's result (a ``tool`` message of ~700 tokens). The calls are
scripted, not the model's (a random-weight synth model's own calls would be noise); what each request costs
does not depend on who wrote them, because the template re-renders the previous answer either way.

Per request: the prompt tokens, the tokens resumed from a prefix snapshot (``usage.prompt_tokens_details.
cached_tokens``) and so prefilled, and the TTFT, measured as the latency of a non-streamed 1-token answer
(prefill plus one sampled token plus the loopback HTTP round trip). The goal: every request
after the first prefills only what is new and its TTFT is under 5 % of the first's.

Usage: ``.venv/bin/python tests/bench/bench_agent_session.py --model synth-35b-a3b-8l-q4_k_m.gguf [--requests 10]
[--system-tokens 12000] [--llama-server PATH]``; it starts ``python -m engine serve`` on a free loopback port and
stops it after; with ``--llama-server`` the same session then runs against llama.cpp's ``llama-server`` on the
same file (its default flags, the same ``-c`` context; it reports the reused tokens in the same usage field).
Note the machine's load (``uptime``) beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import openai

TOOLS = [{"type": "function", "function": {"name": name, "description": desc, "parameters": {
    "type": "object", "properties": props, "required": list(props)[:1]}}} for name, desc, props in [
    ("read_file", "Read a text file of the repository.", {"path": {"type": "string"},
                                                          "start_line": {"type": "integer"}}),
    ("list_dir", "List a folder.", {"path": {"type": "string"}, "depth": {"type": "integer", "minimum": 1}}),
    ("search", "Search the code with a regular expression.", {"pattern": {"type": "string"},
                                                              "glob": {"type": "string"}}),
    ("edit_file", "Replace text in a file.", {"path": {"type": "string"}, "old": {"type": "string"},
                                              "new": {"type": "string"}}),
    ("run_tests", "Run pytest on some files.", {"paths": {"type": "array", "items": {"type": "string"}},
                                                "keyword": {"type": "string"}}),
    ("git_diff", "Show the working tree's diff.", {"staged": {"type": "boolean"}}),
    ("web_fetch", "Fetch a documentation page.", {"url": {"type": "string"}}),
    ("ask_user", "Ask the user a question.", {"question": {"type": "string"},
                                              "options": {"type": "array", "items": {"type": "string"}}}),
]]

_RULES = ["Read before you edit.", "Keep functions small.", "Run the tests you touch.", "Name files in errors.",
          "Prefer well-kept libraries.", "Never print secrets.", "Explain each change in one line.",
          "Ask when the request is ambiguous."]


def system_prompt(tokens: int) -> str:
    """A coding agent's long system prompt: numbered rules and a made-up repository map, ~``tokens`` tokens
    (about 2.8 characters per token for this English-and-paths text)."""
    lines = ["You are a coding agent working in a Python repository. Follow these rules."]
    i = 0
    while sum(map(len, lines)) < tokens * 2.8:
        lines.append(f"{i + 1}. {_RULES[i % len(_RULES)]} (section {i // 8}, module engine/part_{i:04d}.py, "
                     f"function handle_{i * 7 % 1000:03d}, see docs/notes_{i % 37:02d}.md)")
        i += 1
    return "\n".join(lines)


def tool_result(step: int) -> str:
    """About 700 tokens of a tool's output (a listing with sizes)."""
    return "\n".join(f"src/module_{step}_{k:02d}.py  {1000 + 37 * k * (step + 1)} bytes  def f_{k}(x): return x + {k}"
                     for k in range(24))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(command: list[str], port: int) -> subprocess.Popen:
    """Start a server (``command``) listening on ``port``; returns once its ``/health`` answers 200."""
    proc = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise RuntimeError(f"{command[0]} did not answer /health within 600 s")


def session(client: openai.OpenAI, requests: int, system_tokens: int) -> list[dict]:
    """Run the scripted session; one row per request."""
    messages: list[dict] = [{"role": "system", "content": system_prompt(system_tokens)},
                            {"role": "user", "content": "The tests in tests/test_io.py fail since yesterday. Find out "
                                                        "why and fix it."}]
    rows = []
    for step in range(requests):
        t0 = time.perf_counter()
        reply = client.chat.completions.create(model="agent-bench", messages=messages, tools=TOOLS, max_tokens=1,
                                               temperature=0)
        ms = (time.perf_counter() - t0) * 1e3
        usage = reply.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        rows.append({"request": step + 1, "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached,
                     "prefilled_tokens": usage.prompt_tokens - cached, "ttft_ms": round(ms, 1)})
        print(json.dumps(rows[-1]), flush=True)
        call_id = f"call_{step}"
        name = TOOLS[step % len(TOOLS)]["function"]["name"]
        messages.append({"role": "assistant", "content": "", "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps({"path": f"src/module_{step}.py"})}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": tool_result(step)})
    return rows


def run(command: list[str], port: int, requests: int, system_tokens: int) -> list[dict]:
    """The session against the server ``command`` starts on ``port``, stopped after."""
    proc = start_server(command, port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=1800, max_retries=0)
        return session(client, requests, system_tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def table(name: str, rows: list[dict]) -> None:
    first = rows[0]["ttft_ms"]
    print(f"{name}\n| request | prompt tokens | resumed | prefilled | TTFT ms | % of first |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['request']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['prefilled_tokens']} | "
              f"{r['ttft_ms']:.0f} | {100 * r['ttft_ms'] / first:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--system-tokens", type=int, default=12000)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--llama-server", metavar="PATH", help="also run the session against this llama-server")
    args = parser.parse_args()
    port = free_port()
    ours = [sys.executable, "-m", "engine", "serve", "--model", args.model, "--port", str(port), "--context",
            str(args.context), "--model-name", "agent-bench"]
    tables = [("engine serve", run(ours, port, args.requests, args.system_tokens))]
    if args.llama_server:
        port = free_port()
        peer = [args.llama_server, "-m", args.model, "--port", str(port), "-c", str(args.context), "--alias",
                "agent-bench"]
        tables.append(("llama-server", run(peer, port, args.requests, args.system_tokens)))
    for name, rows in tables:
        table(name, rows)


if __name__ == "__main__":
    main()
