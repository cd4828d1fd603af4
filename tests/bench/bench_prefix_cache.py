"""Benchmark: the prefix snapshot cache on the CPU path (a script, not a test).

    python tests/bench/bench_prefix_cache.py [--preset small] [--prompt-tokens 4096] [--turns 10]

Prints (1) a long prompt cold vs repeated: restore ms and time to first token, and their ratio;
(2) a multi-turn chat: tokens prefilled per turn with and without the cache, thinking off and on;
(3) snapshot sizes: measured for the preset, and computed for the real 35B-A3B shape.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from engine.api import Engine, EngineOptions
from engine.events import PrefillStats
from engine.arch.qwen35.hparams import Qwen35HParams
from engine.sampling import SamplingParams
from engine.testing.synth import synth

WORDS = ("delta net state snapshot prefix cache expert router token prefill decode gated "
         "attention window memory bandwidth kernel vector block scale quant").split()


def first_stats(engine: Engine, messages, sampling, thinking=False) -> tuple[PrefillStats, str]:
    text = ""
    stats = None
    for ev in engine.chat(messages, sampling, enable_thinking=thinking):
        if isinstance(ev, PrefillStats):
            stats = ev
        text = getattr(ev, "text", text)
    return stats, text


def snapshot_bytes(hp: Qwen35HParams, tokens: int) -> int:
    """Bytes of one snapshot: conv + delta-net state per GDN layer, f32 KV of the prefix, logits."""
    n_attn = sum(not hp.is_recurrent(i) for i in range(hp.n_layer))
    n_gdn = hp.n_layer - n_attn
    recurrent = n_gdn * 4 * ((hp.conv_kernel - 1) * hp.conv_dim + hp.num_v_heads * hp.head_k_dim * hp.head_v_dim)
    kv = n_attn * 2 * hp.n_head_kv * hp.head_dim * 4 * tokens
    return recurrent + kv + 4 * hp.n_vocab + 4 * tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--turns", type=int, default=10)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp())
    model = folder / f"{args.preset}.gguf"
    synth(model, args.preset, quant="q8_0", seed=0)
    greedy = SamplingParams.greedy(max_tokens=8)

    disk = folder / "snapshots"
    engine = Engine.load(model, options=EngineOptions(context=args.prompt_tokens + 512, cache_disk_dir=disk))
    words = " ".join(WORDS[i % len(WORDS)] for i in range(args.prompt_tokens))
    ids = engine.tokenizer.encode(words)[: args.prompt_tokens - 40]
    long_msg = [{"role": "user", "content": engine.tokenizer.decode(ids)}]
    t0 = time.perf_counter()
    cold, _ = first_stats(engine, long_msg, greedy)
    cold_s = time.perf_counter() - t0
    warm, _ = first_stats(engine, long_msg, greedy)
    print(f"[1] {cold.prompt_tokens}-token prompt: cold TTFT {cold.ttft_ms:.0f} ms "
          f"(prefill {cold.prefill_tok_s:.1f} tok/s, wall {cold_s:.1f} s); repeat TTFT {warm.ttft_ms:.1f} ms, "
          f"restore {warm.restore_ms:.1f} ms, {warm.prefilled_tokens} tokens prefilled -> "
          f"{cold.ttft_ms / warm.ttft_ms:.0f}x faster to first token")
    engine.close()
    restarted = Engine.load(model, options=EngineOptions(context=args.prompt_tokens + 512, cache_disk_dir=disk))
    from_disk, _ = first_stats(restarted, long_msg, greedy)
    print(f"    after a restart, from the disk tier: restore {from_disk.restore_ms:.1f} ms, TTFT "
          f"{from_disk.ttft_ms:.1f} ms, {from_disk.prefilled_tokens} tokens prefilled")

    for thinking in (False, True):
        for cached in (True, False):
            eng = Engine.load(model, options=EngineOptions(prefix_cache=cached, context=16384))
            msgs = [{"role": "system", "content": "You are a helpful assistant."}]
            per_turn = []
            for turn in range(args.turns):
                msgs.append({"role": "user", "content": f"Question {turn}: tell me about {WORDS[turn]}."})
                stats, answer = first_stats(eng, msgs, greedy, thinking)
                per_turn.append(stats.prefilled_tokens)
                msgs.append({"role": "assistant", "content": answer})
            print(f"[2] thinking {'on ' if thinking else 'off'} cache {'on ' if cached else 'off'}: "
                  f"prefilled per turn {per_turn} (total {sum(per_turn)})")

    hp = engine.text.hparams
    measured = max(s.nbytes for s in engine.cache.snapshots())
    print(f"[3] {args.preset}: largest snapshot {measured / 2**20:.2f} MiB measured; "
          f"computed {snapshot_bytes(hp, cold.prompt_tokens) / 2**20:.2f} MiB at {cold.prompt_tokens} tokens")
    real = Qwen35HParams(arch="qwen35moe", n_layer=40, nextn_predict_layers=0, n_embd=2048, n_vocab=248320,
                         context_length=262144, rms_eps=1e-6, n_head=16, n_head_kv=2, head_dim=256,
                         rope_theta=1e7, rope_dims=64, rope_sections=(11, 11, 10, 0), full_attention_interval=4,
                         conv_kernel=4, head_k_dim=128, num_k_heads=16, num_v_heads=32, head_v_dim=128,
                         n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512)
    for t in (0, 4096, 32768):
        print(f"    35b-a3b shape: snapshot at {t} tokens = {snapshot_bytes(real, t) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
