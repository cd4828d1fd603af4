"""Benchmark: bytes the prefix cache stores over an N-turn chat (a script, not a test).

    python tests/bench/bench_kv_pages.py --model slice.gguf [--turns 30] [--words 110] [--kv-type f16]

Runs a scripted chat through ``Engine.chat`` (greedy, 4-token answers, thinking off) with the prefix cache
on and budgets large enough that nothing is evicted, and prints after every turn the prompt length, the
snapshots held, the cache's RAM bytes, and at the end the bytes of the disk tier after ``persist()``
(snapshot and page files). Run it with another checkout on PYTHONPATH to measure that one (an engine
without ``EngineOptions.kv_type`` runs with its own F32 KV). docs/perf/kv-cache.md has the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from engine.api import Engine, EngineOptions
from engine.events import PrefillStats
from engine.sampling import SamplingParams

WORDS = ["delta", "net", "state", "snapshot", "prefix", "cache", "expert", "router", "token", "prefill", "decode",
         "gated", "attention", "window", "memory", "bandwidth", "kernel", "vector", "block", "scale", "quant"]


def folder_bytes(folder: Path) -> dict[str, int]:
    """Bytes of the files under ``folder`` by suffix (``.snap``, ``.page``)."""
    out: dict[str, int] = {}
    for p in folder.rglob("*"):
        if p.is_file():
            out[p.suffix] = out.get(p.suffix, 0) + p.stat().st_size
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--words", type=int, default=110, help="words per user message")
    ap.add_argument("--kv-type", default="f16")
    ap.add_argument("--context", type=int, default=16384)
    args = ap.parse_args()
    disk = Path(tempfile.mkdtemp()) / "snapshots"
    opts = {"context": args.context, "cache_ram_bytes": 1 << 40, "cache_disk_dir": disk, "cache_disk_bytes": 1 << 40}
    if "kv_type" in {f.name for f in dataclasses.fields(EngineOptions)}:
        opts["kv_type"] = args.kv_type
    engine = Engine.load(args.model, options=EngineOptions(**opts))
    greedy = SamplingParams.greedy(max_tokens=4)
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    print(f"kv_type {opts.get('kv_type', 'f32 (this engine has no kv_type option)')}")
    print("turn | prompt tokens | prefilled | snapshots | cache RAM MiB | wall s")
    for turn in range(args.turns):
        text = " ".join(WORDS[(turn * 7 + i) % len(WORDS)] for i in range(args.words))
        msgs.append({"role": "user", "content": f"Turn {turn}: {text}"})
        t0, stats, answer = time.perf_counter(), None, ""
        for ev in engine.chat(msgs, greedy, enable_thinking=False):
            if isinstance(ev, PrefillStats):
                stats = ev
            answer = getattr(ev, "text", answer)
        msgs.append({"role": "assistant", "content": answer})
        print(f"{turn + 1} | {stats.prompt_tokens} | {stats.prefilled_tokens} | {len(engine.cache.snapshots())} | "
              f"{engine.cache.ram_bytes / 2**20:.1f} | {time.perf_counter() - t0:.1f}", flush=True)
    engine.cache.persist()
    files = folder_bytes(disk)
    print(f"disk tier after persist: {sum(files.values()) / 2**20:.1f} MiB "
          + ", ".join(f"{k or 'other'} {v / 2**20:.1f} MiB" for k, v in sorted(files.items())))
    engine.close()


if __name__ == "__main__":
    main()
