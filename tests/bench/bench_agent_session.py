"""An agent's session against a real ``engine serve`` and llama.cpp's ``llama-server``: TTFT, RAM and disk per turn.

A scripted coding-agent session through the official ``openai`` client: a ~12k-token system prompt plus 8
function tools, a user task, then each request adds the call the agent made (an assistant message with
``tool_calls``) and that call's result (a ``tool`` message of ``--result-lines`` lines, ~30 tokens each). The
calls are scripted, not the model's (a random-weight synth model's own calls would be noise); what each
request costs does not depend on who wrote them, because the template re-renders the previous answer either way.

With ``--server both`` the two servers run at once, interleaved: request k goes to one, then (once answered)
to the other, the first one alternating, so both meet the same machine state and each is idle while the other
answers (``--sequential``: one whole session after the other). Per request and server: the prompt tokens, the
tokens resumed from a prefix snapshot or checkpoint (``usage.prompt_tokens_details.cached_tokens``) and so
prefilled, the TTFT (the latency of a non-streamed 1-token answer: prefill, one sampled token, the loopback
HTTP round trip), the 1-minute load average as it was sent, the server's RSS, and its prefix state. Ours: the
prefix cache's RAM (``/metrics``), its snapshot and page files (``--cache-dir``), the restore / prefill seconds
of the turn. llama-server: its context checkpoints and prompt cache (its trace log, ``-lv 4``) and its
``timings.prompt_ms``. Each runs with its default cache flags; llama-server's are :data:`PEER_FLAGS`.

Usage: ``python tests/bench/bench_agent_session.py --model slice.gguf --work /tmp/me/agent --llama-server PATH
[--requests 30] [--result-lines 42] [--context 65536] [--server ours|llama-server|both] [--sequential]
[--resume] [--every 5]``. Rows go to ``WORK/<server>.jsonl`` as they come; Ctrl+C stops both servers, and
``--resume`` goes on after the last request both answered (both start afresh and first re-read that request's
prompt, unrecorded, to rebuild their prefix state). ``--report`` prints the tables of the rows in ``WORK``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
from agent_session_report import report
from agent_session_servers import Server, ServerFailed, check_memory, files_mib, free_port

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

PEER_FLAGS = ["--ctx-checkpoints 32", "--checkpoint-min-step 8192", "--cache-ram 8192", "-np -1 (auto)",
              "--kv-unified (auto)", "-ctk/-ctv f16"]
"""llama-server's defaults for a hybrid model's prefix state (its ``--help``), none passed: the bench
passes only ``-m -c -t --port --alias`` and ``-lv 4`` (trace log lines, to read the checkpoints off)."""

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


def tool_result(step: int, lines: int) -> str:
    """A tool's output of ``lines`` lines (a listing with sizes, about 29 tokens a line)."""
    return "\n".join(f"src/module_{step}_{k:02d}.py  {1000 + 37 * k * (step + 1)} bytes  def f_{k}(x): return x + {k}"
                     for k in range(lines))


def messages_for(request: int, system_tokens: int, result_lines: int) -> list[dict]:
    """The conversation sent as request ``request`` (from 1): the system prompt and the task, then for each
    earlier request the call the agent made and its result."""
    messages: list[dict] = [{"role": "system", "content": system_prompt(system_tokens)},
                            {"role": "user", "content": "The tests in tests/test_io.py fail since yesterday. Find out "
                                                        "why and fix it."}]
    for step in range(request - 1):
        call_id = f"call_{step}"
        name = TOOLS[step % len(TOOLS)]["function"]["name"]
        messages.append({"role": "assistant", "content": "", "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps({"path": f"src/module_{step}.py"})}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": tool_result(step, result_lines)})
    return messages


def ask(server: Server, client: openai.OpenAI, messages: list[dict], when: str) -> dict:
    """Send ``messages`` for a 1-token answer; the row of what it cost and what ``server`` holds after."""
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    reply = server.complete(client, when, model="agent-bench", messages=messages, tools=TOOLS, max_tokens=1,
                            temperature=0)
    ms = (time.perf_counter() - t0) * 1e3
    usage = reply.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"prompt_tokens": usage.prompt_tokens, "cached_tokens": cached,
            "prefilled_tokens": usage.prompt_tokens - cached, "ttft_ms": round(ms, 1), "load1": round(load, 2),
            **server.probe(reply)}


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", timeout=3600, max_retries=0)


def drive(group: list[Server], args: argparse.Namespace, start: int) -> None:
    """Requests ``start``..``--requests`` to each server of ``group`` in turn (the first one alternating by
    request, its place in ``order``), each row appended to ``WORK/<server>.jsonl`` as it comes. A ``start``
    past 1 first sends the previous request once more, recorded as a warm-up note, so each server holds that
    prefix again."""
    clients = {s.name: _client(s) for s in group}
    if start > 1:
        messages = messages_for(start - 1, args.system_tokens, args.result_lines)
        for server in group:
            row = ask(server, clients[server.name], messages, f"the warm-up request {start - 1}")
            _append(args.work / f"{server.name}.jsonl", {"warmup": start - 1, **row})
    for request in range(start, args.requests + 1):
        messages = messages_for(request, args.system_tokens, args.result_lines)
        for order, server in enumerate(group if request % 2 else group[::-1], 1):
            row = ask(server, clients[server.name], messages, f"request {request}")
            sent = {"order": order} if len(group) > 1 else {}
            _append(args.work / f"{server.name}.jsonl", {"request": request, **sent, **row})


def _append(out: Path, row: dict) -> None:
    print(json.dumps(row), flush=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def done_requests(out: Path) -> int:
    """The last request of the rows in ``out``; 0 when there are none."""
    if not out.exists():
        return 0
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return max((r["request"] for r in rows if "request" in r), default=0)


def keep_until(out: Path, last: int) -> None:
    """Drop the rows of requests after ``last`` from ``out`` (one server may have answered a request the
    other had not when the run was cut short)."""
    lines = [line for line in out.read_text().splitlines() if line.strip()]
    out.write_text("".join(line + "\n" for line in lines if json.loads(line).get("request", 0) <= last))


def run_group(group: list[Server], args: argparse.Namespace, start: int) -> None:
    """Start the servers of ``group`` at once, run requests ``start``.. against them, and stop them all
    (also on Ctrl+C or a failure); each one's notes (load, command, pid; after exit its disk tier) go to its
    ``.jsonl``."""
    try:
        for server in group:
            server.launch()
            _append(args.work / f"{server.name}.jsonl", {
                "uptime": _uptime(), "command": " ".join(server.command), "pid": server.proc.pid,
                "mode": "interleaved" if len(group) > 1 else "alone", "from_request": start})
        for server in group:
            server.wait_ready()
        drive(group, args, start)
    finally:
        stop_all(group)
    for server in group:
        end = {"uptime": _uptime()}
        if server.cache_dir is not None:
            end.update(exit_snap_mib=files_mib(server.cache_dir, ".snap"),
                       exit_page_mib=files_mib(server.cache_dir, ".page"))
        _append(args.work / f"{server.name}.jsonl", end)


def stop_all(group: list[Server]) -> None:
    """Stop every server of ``group``; after a Ctrl+C during a stop the rest are killed at once, and the
    Ctrl+C is raised again once all are gone."""
    interrupted: KeyboardInterrupt | None = None
    for server in group:
        try:
            server.stop(timeout=0 if interrupted else 300)
        except KeyboardInterrupt as exc:
            interrupted = exc
    if interrupted is not None:
        raise interrupted


def servers(args: argparse.Namespace) -> list[Server]:
    """The servers ``--server`` names, each on a free port with its log under ``--work``; ours' disk tier is
    emptied (a resumed run starts both afresh: a snapshot of a request not recorded must not help ours)."""
    work = args.work
    chosen = []
    if args.server in ("ours", "both"):
        cache = work / "ours-cache"
        shutil.rmtree(cache, ignore_errors=True)
        port = free_port()
        chosen.append(Server("ours", [sys.executable, "-m", "engine", "serve", "--model", args.model, "--port",
                                      str(port), "--context", str(args.context), "--model-name", "agent-bench",
                                      "--cache-dir", str(cache)], port, work / "ours.log", cache))
    if args.server in ("llama-server", "both"):
        if not args.llama_server:
            raise SystemExit("--server llama-server needs --llama-server PATH")
        if not os.access(args.llama_server, os.X_OK):
            raise SystemExit(f"--llama-server {args.llama_server}: not an executable file")
        port = free_port()
        chosen.append(Server("llama-server", [args.llama_server, "-m", args.model, "--port", str(port), "-c",
                                              str(args.context), "-t", str(args.threads), "--alias", "agent-bench",
                                              "-lv", "4"], port, work / "llama-server.log"))
    return chosen


def run(args: argparse.Namespace) -> None:
    """The session against the chosen servers: together (interleaved) or, with ``--sequential`` or one server,
    one after the other; with ``--resume`` from after the last request all of a group answered."""
    chosen = servers(args)
    interleaved = len(chosen) > 1 and not args.sequential
    if interleaved:
        check_memory(args.model, args.context, args.threads)
    for group in [chosen] if interleaved else [[s] for s in chosen]:
        outs = [args.work / f"{s.name}.jsonl" for s in group]
        done = min(done_requests(out) for out in outs) if args.resume else 0
        for out in outs:
            if done and out.exists():
                keep_until(out, done)
            else:
                out.unlink(missing_ok=True)
        if done < args.requests:
            run_group(group, args, done + 1)


def main() -> None:
    """Run the session against the chosen servers (or only print the tables of earlier runs)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--work", type=Path, required=True, help="folder of the rows, logs and our disk tier")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--system-tokens", type=int, default=12000)
    parser.add_argument("--result-lines", type=int, default=42, help="lines of each tool result (~29 tokens each)")
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--threads", type=int, default=2,
                        help="llama-server's -t; ours uses the physical cores, which must be as many with both")
    parser.add_argument("--server", choices=["ours", "llama-server", "both"], default="both")
    parser.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary")
    parser.add_argument("--sequential", action="store_true", help="with both: one whole session after the other")
    parser.add_argument("--resume", action="store_true", help="go on after the last request in --work's rows")
    parser.add_argument("--every", type=int, default=5, help="the tables show every Nth request (and the first)")
    parser.add_argument("--report", action="store_true", help="only print the tables of the rows in --work")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.report:
        if not args.model:
            raise SystemExit("--model is required to run a session")
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.default_int_handler)
        try:
            run(args)
        except ServerFailed as exc:
            raise SystemExit(f"{exc}\nthe servers are stopped; the rows so far are in {args.work}; go on with "
                             f"--resume") from None
        except KeyboardInterrupt:
            print(f"\ninterrupted: the servers are stopped; the rows so far are in {args.work}; go on with --resume",
                  file=sys.stderr)
            raise SystemExit(130) from None
    report(args.work, args.every)


if __name__ == "__main__":
    main()
