"""One-shot end-to-end check on a GPU machine (a script, not a test): Engine with device="auto"
prefills on the GPU and its greedy answer equals the CPU engine's.

    python tests/gpu_e2e_check.py MODEL.gguf [--stream] [--kv-type f16|f32|q8_0]

``--stream`` sets the VRAM budget so low that every layer's routed experts stream from pinned host RAM
(tests/bench/bench_gpu_prefill.py's ``stream`` budget); without it the engine's default budget applies.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.api import Engine, EngineOptions
from engine.arch.qwen35.cuda import PLAN_TOKENS
from engine.events import PrefillProgress, PrefillStats, TokenEvent
from engine.registry import open_text
from engine.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

from bench_gpu_prefill import stream_budget  # noqa: E402


def run(engine: Engine, messages) -> tuple[PrefillStats, list[int]]:
    events = [e for e in engine.chat(messages, SamplingParams.greedy(16)) if not isinstance(e, PrefillProgress)]
    return events[0], [e.token_id for e in events if isinstance(e, TokenEvent)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--stream", action="store_true", help="stream every layer's routed experts")
    ap.add_argument("--kv-type", default=EngineOptions.kv_type, help="KV cache type of both engines")
    args = ap.parse_args()
    budget = None
    if args.stream:
        text = open_text(args.model)
        budget = stream_budget(text.hparams, text.file, PLAN_TOKENS)
    messages = [{"role": "system", "content": "You are a careful assistant. " * 40},
                {"role": "user", "content": "Summarise the rules of chess in three sentences."}]
    gpu = Engine.load(args.model, options=EngineOptions(device="auto", prefix_cache=False, vram_budget=budget,
                                                                  kv_type=args.kv_type))
    print("device:", gpu.info.device, gpu.info.device_note)
    print(gpu.info.placement)
    cpu = Engine.load(args.model, options=EngineOptions(device="cpu", prefix_cache=False, kv_type=args.kv_type))
    g_stats, g_ids = run(gpu, messages)
    c_stats, c_ids = run(cpu, messages)
    t = gpu.telemetry()
    print(f"prompt {g_stats.prompt_tokens} tok: GPU prefill {g_stats.prefill_tok_s:.0f} tok/s ({g_stats.device}), "
          f"CPU prefill {c_stats.prefill_tok_s:.0f} tok/s; H2D {t.h2d_bytes / 2**20:.1f} MiB" if t else "no telemetry")
    print("greedy tokens equal:", g_ids == c_ids, g_ids[:8], c_ids[:8])


if __name__ == "__main__":
    main()
