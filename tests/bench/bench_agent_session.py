"""An agent's session against a real ``engine serve`` and llama.cpp's ``llama-server``: TTFT, RAM and disk per turn.

A scripted coding-agent session through the official ``openai`` client: a ~12k-token system prompt plus 8
function tools, a user task, then each request adds the call the agent made (an assistant message with
``tool_calls``) and that call's result (a ``tool`` message of ``--result-lines`` lines, ~30 tokens each). The
calls are scripted, not the model's (a random-weight synth model's own calls would be noise); what each
request costs does not depend on who wrote them, because the template re-renders the previous answer either way.

Per request: the prompt tokens, the tokens resumed from a prefix snapshot or checkpoint (``usage.
prompt_tokens_details.cached_tokens``) and so prefilled, the TTFT (the latency of a non-streamed 1-token
answer: prefill plus one sampled token plus the loopback HTTP round trip), the server's RSS, and what its
prefix state takes. Ours: the prefix cache's RAM (snapshots and KV pages, from ``/metrics``), its snapshot
and page files on disk (``--cache-dir``), and the restore / prefill seconds of the turn (``/metrics``).
llama-server: its context checkpoints (count and MiB, from its trace log, ``-lv 4``) and its prompt cache
(``--cache-ram``'s MiB, same log), and its own ``timings.prompt_ms``. Each server runs with its default
cache flags; llama-server's are printed with its table (:data:`PEER_FLAGS`).

Usage: ``python tests/bench/bench_agent_session.py --model slice.gguf --work /tmp/me/agent [--requests 30]
[--result-lines 42] [--context 65536] [--server ours|llama-server|both] [--llama-server PATH] [--every 5]``;
each server's rows go to ``WORK/<server>.jsonl`` as they come; ``--report`` prints the tables of the files
already in ``WORK`` without running anything. Note the machine's load (``uptime``) beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

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

MIB = 1 << 20
_CHECKPOINT = re.compile(r"id +(\d+) \| task -?\d+ \| (created|erasing old|erasing|erased invalidated|superseding) "
                         r"context checkpoint.*?n_tokens = (\d+)(?:.*?size = ([\d.]+) MiB)?")
_SUPERSEDE = re.compile(r"id +(\d+) \| task -?\d+ \| superseding context checkpoint at n_tokens = (\d+)")
_PROMPT_CACHE = re.compile(r"cache state: (\d+) prompts, ([\d.]+) MiB")


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


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> tuple[float, float]:
    """(resident, peak resident) MiB of process ``pid`` (``/proc/PID/status`` VmRSS, VmHWM)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) / 1024
    return round(fields["VmRSS"], 1), round(fields["VmHWM"], 1)


def files_mib(folder: Path, suffix: str) -> float:
    """MiB of the files named ``*suffix`` under ``folder``."""
    return round(sum(p.stat().st_size for p in folder.rglob(f"*{suffix}") if p.is_file()) / MIB, 1)


@dataclass
class Server:
    """One server under test: how to start it, and what it reports after each request."""

    name: str
    command: list[str]
    port: int
    log: Path
    cache_dir: Path | None = None
    proc: subprocess.Popen | None = None
    _scraped: dict = field(default_factory=dict)
    _log_at: int = 0
    _checkpoints: dict = field(default_factory=dict)
    _prompt_cache: tuple[int, float] = (0, 0.0)

    def start(self) -> None:
        """Start the server; returns once its ``/health`` answers 200 (10 minutes at most)."""
        out = self.log.open("wb")
        self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": os.getcwd()})
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.command[0]} exited with {self.proc.returncode}; see {self.log}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{self.command[0]} did not answer /health within 600 s; see {self.log}")

    def stop(self) -> None:
        """Stop the server as Ctrl+C does (SIGINT: ours then writes its RAM snapshots to the disk tier) and wait."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=300)

    def probe(self, reply) -> dict:
        """What the server holds after a request, and the parts of that request's TTFT it reports."""
        rss, peak = rss_mib(self.proc.pid)
        row = {"rss_mib": rss, "peak_rss_mib": peak}
        if self.cache_dir is not None:
            row.update(self._ours())
        else:
            row.update(self._peer(reply))
        return row

    def _ours(self) -> dict:
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=30).text
        now = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
        before, self._scraped = self._scraped, now

        def grew(name: str) -> float:
            return round((now.get((name, ()), 0.0) - before.get((name, ()), 0.0)) * 1e3, 1)

        return {"cache_ram_mib": round(now[("deltadesk_prefix_cache_ram_bytes", ())] / MIB, 1),
                "snapshots_ram": int(now[("deltadesk_prefix_cache_snapshots", (("tier", "ram"),))]),
                "snapshots_disk": int(now[("deltadesk_prefix_cache_snapshots", (("tier", "disk"),))]),
                "disk_snap_mib": files_mib(self.cache_dir, ".snap"),
                "disk_page_mib": files_mib(self.cache_dir, ".page"),
                "restore_ms": grew("deltadesk_snapshot_restore_seconds_total"),
                "prefill_ms": grew("deltadesk_prefill_seconds_total")}

    def _peer(self, reply) -> dict:
        """llama-server's checkpoints and prompt cache, from the log lines written since the last request."""
        with self.log.open("rb") as f:
            f.seek(self._log_at)
            new = f.read()
            self._log_at += len(new)
        for line in new.decode(errors="replace").splitlines():
            self._read_line(line)
        timings = (reply.model_extra or {}).get("timings") or {}
        return {"checkpoints": len(self._checkpoints),
                "checkpoint_mib": round(sum(self._checkpoints.values()), 1),
                "prompt_cache_entries": self._prompt_cache[0], "prompt_cache_mib": self._prompt_cache[1],
                "prompt_ms": round(timings.get("prompt_ms", 0.0), 1)}

    def _read_line(self, line: str) -> None:
        if m := _SUPERSEDE.search(line):
            self._checkpoints.pop((m[1], int(m[2])), None)
        elif m := _CHECKPOINT.search(line):
            key = (m[1], int(m[3]))
            if m[2] == "created":
                self._checkpoints[key] = float(m[4])
            else:
                self._checkpoints.pop(key, None)
        elif m := _PROMPT_CACHE.search(line):
            self._prompt_cache = (int(m[1]), float(m[2]))


def session(server: Server, requests: int, system_tokens: int, result_lines: int, out: Path) -> list[dict]:
    """Run the scripted session against ``server``; one row per request, each also appended to ``out``."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", timeout=3600,
                           max_retries=0)
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
                     "prefilled_tokens": usage.prompt_tokens - cached, "ttft_ms": round(ms, 1),
                     **server.probe(reply)})
        _append(out, rows[-1])
        call_id = f"call_{step}"
        name = TOOLS[step % len(TOOLS)]["function"]["name"]
        messages.append({"role": "assistant", "content": "", "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps({"path": f"src/module_{step}.py"})}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": tool_result(step, result_lines)})
    return rows


def _append(out: Path, row: dict) -> None:
    print(json.dumps(row), flush=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


def run(server: Server, args: argparse.Namespace, out: Path) -> None:
    """The session against ``server``, stopped after; ours' disk tier is measured once more after exit."""
    out.unlink(missing_ok=True)
    _append(out, {"uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                  "command": " ".join(server.command)})
    server.start()
    try:
        session(server, args.requests, args.system_tokens, args.result_lines, out)
    finally:
        server.stop()
    end = {"uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    if server.cache_dir is not None:
        end.update(exit_snap_mib=files_mib(server.cache_dir, ".snap"), exit_page_mib=files_mib(server.cache_dir,
                                                                                                 ".page"))
    _append(out, end)


def servers(args: argparse.Namespace) -> list[Server]:
    """The servers ``--server`` names, each on a free port with its log under ``--work``."""
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
        port = free_port()
        chosen.append(Server("llama-server", [args.llama_server, "-m", args.model, "--port", str(port), "-c",
                                              str(args.context), "-t", str(args.threads), "--alias", "agent-bench",
                                              "-lv", "4"], port, work / "llama-server.log"))
    return chosen


def _load_rows(path: Path) -> tuple[list[dict], list[dict]]:
    """(request rows, other lines: uptime, command, after exit) of one server's ``.jsonl``."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in lines if "request" in r], [r for r in lines if "request" not in r]


def _shown(rows: list[dict], every: int) -> list[dict]:
    return [r for r in rows if r["request"] == 1 or r["request"] % every == 0 or r is rows[-1]]


_COLUMNS = {
    "ours": [("cache RAM MiB", "cache_ram_mib"), ("snapshots RAM / disk", ("snapshots_ram", "snapshots_disk")),
             ("disk MiB snap + page", ("disk_snap_mib", "disk_page_mib")), ("restore ms", "restore_ms"),
             ("prefill ms", "prefill_ms")],
    "llama-server": [("checkpoints", "checkpoints"), ("checkpoint MiB", "checkpoint_mib"),
                     ("prompt cache MiB", "prompt_cache_mib"), ("prompt_ms", "prompt_ms")],
}


def _cell(row: dict, key) -> str:
    return " / ".join(str(row.get(k, "")) for k in key) if isinstance(key, tuple) else str(row.get(key, ""))


def report(work: Path, every: int) -> None:
    """Print a markdown table per server whose rows are in ``work`` (the first, every ``every``-th and the last
    request, then totals), with the load before and after and the command it ran."""
    for name, columns in _COLUMNS.items():
        path = work / f"{name}.jsonl"
        if not path.exists():
            continue
        rows, notes = _load_rows(path)
        if not rows:
            continue
        extra = [title for title, _ in columns]
        print(f"\n{name}: " + " | ".join(json.dumps(n) for n in notes))
        print("| request | prompt tokens | resumed | prefilled | TTFT ms | RSS MiB | " + " | ".join(extra) + " |")
        print("|---" * (6 + len(extra)) + "|")
        for r in _shown(rows, every):
            print(f"| {r['request']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['prefilled_tokens']} | "
                  f"{r['ttft_ms']:.0f} | {r['rss_mib']:.0f} | " + " | ".join(_cell(r, k) for _, k in columns) + " |")
        print(f"| total {len(rows)} | | {sum(r['cached_tokens'] for r in rows)} | "
              f"{sum(r['prefilled_tokens'] for r in rows)} | {sum(r['ttft_ms'] for r in rows):.0f} | "
              f"peak {max(r['peak_rss_mib'] for r in rows):.0f} |" + " |" * len(extra))


def main() -> None:
    """Run the session against the chosen servers (or only print the tables of earlier runs)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--work", type=Path, required=True, help="folder of the rows, logs and our disk tier")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--system-tokens", type=int, default=12000)
    parser.add_argument("--result-lines", type=int, default=42, help="lines of each tool result (~29 tokens each)")
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--threads", type=int, default=2, help="llama-server's -t (ours uses the physical cores)")
    parser.add_argument("--server", choices=["ours", "llama-server", "both"], default="both")
    parser.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary")
    parser.add_argument("--every", type=int, default=5, help="the tables show every Nth request (and the first)")
    parser.add_argument("--report", action="store_true", help="only print the tables of the rows in --work")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.report:
        if not args.model:
            raise SystemExit("--model is required to run a session")
        for server in servers(args):
            run(server, args, args.work / f"{server.name}.jsonl")
    report(args.work, args.every)


if __name__ == "__main__":
    main()
