"""The tables of ``bench_agent_session.py``: each server's rows, and TTFT ours against llama-server.

Reads ``WORK/ours.jsonl`` and ``WORK/llama-server.jsonl`` (one JSON object a line: request rows, and notes
with the load, the command, warm-ups and what was on disk after exit) and prints markdown tables.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def load_rows(path: Path) -> tuple[list[dict], list[dict]]:
    """(request rows, other lines: uptime, command, warm-ups, after exit) of one server's ``.jsonl``."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in lines if "request" in r], [r for r in lines if "request" not in r]


def _shown(rows: list[dict], every: int) -> list[dict]:
    return [r for r in rows if r["request"] == 1 or r["request"] % every == 0 or r is rows[-1]]


_COLUMNS = {
    "ours": [("cache RAM MiB", "cache_ram_mib"), ("snapshots RAM / disk", ("snapshots_ram", "snapshots_disk")),
             ("disk MiB snap + page", ("disk_snap_mib", "disk_page_mib")), ("restore ms", "restore_ms"),
             ("prefill ms", "prefill_ms"), ("load 1 min", "load1")],
    "llama-server": [("checkpoints", "checkpoints"), ("checkpoint MiB", "checkpoint_mib"),
                     ("prompt cache MiB", "prompt_cache_mib"), ("prompt_ms", "prompt_ms"), ("load 1 min", "load1")],
}


def _cell(row: dict, key) -> str:
    return " / ".join(str(row.get(k, "")) for k in key) if isinstance(key, tuple) else str(row.get(key, ""))


def spread(values: list[float]) -> str:
    """``median (min-max)`` of ``values`` to 2 decimals; an empty list gives "-"."""
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def server_table(name: str, rows: list[dict], notes: list[dict], every: int) -> None:
    """Print ``name``'s notes and a table of its rows (the first, every ``every``-th and the last request,
    then totals)."""
    columns = _COLUMNS[name]
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


def comparison(ours: list[dict], peer: list[dict]) -> None:
    """Print TTFT per request of both servers, their ratio (ours / llama-server), the CPU seconds each took,
    the load as each was sent and which went first; then the ratio's median (min-max) over requests 2.. and
    the first request's."""
    theirs = {r["request"]: r for r in peer}
    pairs = [(r, theirs[r["request"]]) for r in ours if r["request"] in theirs]
    if not pairs:
        return
    print("\n| request | prompt tokens ours / llama | prefilled ours / llama | TTFT ms ours | TTFT ms llama-server "
          "| ratio | CPU s ours / llama | load 1 min ours / llama | first |")
    print("|---" * 9 + "|")
    for a, b in pairs:
        first = {1: "ours", 2: "llama-server"}.get(a.get("order"), "")
        print(f"| {a['request']} | {a['prompt_tokens']} / {b['prompt_tokens']} | {a['prefilled_tokens']} / "
              f"{b['prefilled_tokens']} | {a['ttft_ms']:.0f} | {b['ttft_ms']:.0f} | {a['ttft_ms'] / b['ttft_ms']:.2f} "
              f"| {a.get('cpu_s', '-')} / {b.get('cpu_s', '-')} | {a.get('load1', '-')} / {b.get('load1', '-')} "
              f"| {first} |")
    ratios = {a["request"]: a["ttft_ms"] / b["ttft_ms"] for a, b in pairs}
    later = [v for k, v in ratios.items() if k > 1]
    loads = [r["load1"] for pair in pairs for r in pair if "load1" in r]
    print(f"\nTTFT ours / llama-server: request 1 {spread([ratios[1]] if 1 in ratios else [])}; requests "
          f"2-{max(ratios)}: median {spread(later)} over {len(later)} requests; 1-minute load as sent: "
          f"median {spread(loads)}")


def report(work: Path, every: int) -> None:
    """Print each server's table of the rows in ``work``, then the comparison when both have rows."""
    found = {}
    for name in _COLUMNS:
        path = work / f"{name}.jsonl"
        if path.exists():
            rows, notes = load_rows(path)
            if rows:
                server_table(name, rows, notes, every)
                found[name] = rows
    if len(found) == 2:
        comparison(found["ours"], found["llama-server"])
