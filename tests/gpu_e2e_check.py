"""One-shot end-to-end check on a GPU machine (a script, not a test): Engine with device="auto"
prefills on the GPU and its greedy answer equals the CPU engine's.

    python tests/gpu_e2e_check.py MODEL.gguf
"""

from __future__ import annotations

import sys

from engine.api import Engine, EngineOptions
from engine.events import PrefillProgress, PrefillStats, TokenEvent
from engine.sampling import SamplingParams


def run(engine: Engine, messages) -> tuple[PrefillStats, list[int]]:
    events = [e for e in engine.chat(messages, SamplingParams.greedy(16)) if not isinstance(e, PrefillProgress)]
    return events[0], [e.token_id for e in events if isinstance(e, TokenEvent)]


def main() -> None:
    path = sys.argv[1]
    messages = [{"role": "system", "content": "You are a careful assistant. " * 40},
                {"role": "user", "content": "Summarise the rules of chess in three sentences."}]
    gpu = Engine.load(path, options=EngineOptions(device="auto", prefix_cache=False))
    print("device:", gpu.info.device, gpu.info.device_note)
    print(gpu.info.placement)
    cpu = Engine.load(path, options=EngineOptions(device="cpu", prefix_cache=False))
    g_stats, g_ids = run(gpu, messages)
    c_stats, c_ids = run(cpu, messages)
    t = gpu.telemetry()
    print(f"prompt {g_stats.prompt_tokens} tok: GPU prefill {g_stats.prefill_tok_s:.0f} tok/s ({g_stats.device}), "
          f"CPU prefill {c_stats.prefill_tok_s:.0f} tok/s; H2D {t.h2d_bytes / 2**20:.1f} MiB" if t else "no telemetry")
    print("greedy tokens equal:", g_ids == c_ids, g_ids[:8], c_ids[:8])


if __name__ == "__main__":
    main()
