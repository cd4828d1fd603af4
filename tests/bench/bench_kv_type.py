"""Benchmark: the logit difference of an F16 KV cache against F32, by context length (a script, not a test).

    python tests/bench/bench_kv_type.py --model slice.gguf [--tokens 16384] [--at 1024,4096,16384] [--threads 2]

Prefills the same random token sequence twice on the native kernels, with F32 and with F16 KV rows, in
pieces of 512 (split-invariant, so the piece size changes no bit), and at each position of ``--at`` compares
the last position's logits: max |difference|, that over max |logit|, the KL divergence of the F16
distribution from the F32 one (nats) and whether the argmax agrees. docs/perf/kv-cache.md has the figures.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from engine.arch.qwen35.cpu import NativeQwen35Model
from engine.kernels import cpu
from engine.registry import open_text
from engine.turn.state import SequenceState

PIECE = 512


def run(model: NativeQwen35Model, tokens: np.ndarray, at: list[int], kv_type: str) -> dict[int, np.ndarray]:
    """Logits after each position of ``at`` (piece ends), prefilling ``tokens`` with ``kv_type`` KV rows."""
    state = SequenceState.new(model.hp, len(tokens), kv_type)
    cuts = sorted(set(range(PIECE, len(tokens), PIECE)) | set(at) | {len(tokens)})
    out, start, t0 = {}, 0, time.perf_counter()
    for end in cuts:
        logits = model.forward(tokens[start:end], state)[-1]
        if end in at:
            out[end] = logits.astype(np.float64)
            print(f"  {kv_type} {end} tokens, {time.perf_counter() - t0:.0f} s", flush=True)
        start = end
    return out


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p || q) in nats of the softmax distributions of two logit vectors."""
    lp = p_logits - p_logits.max()
    lp -= np.log(np.exp(lp).sum())
    lq = q_logits - q_logits.max()
    lq -= np.log(np.exp(lq).sum())
    return float((np.exp(lp) * (lp - lq)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--at", default="1024,4096,16384")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    at = [int(x) for x in args.at.split(",")]
    cpu.set_threads(args.threads)
    text = open_text(args.model)
    model = NativeQwen35Model(text.hparams, text.file)
    tokens = np.random.default_rng(0).integers(0, text.hparams.n_vocab, args.tokens)
    ref = run(model, tokens, at, "f32")
    half = run(model, tokens, at, "f16")
    print("tokens | max |dlogit| | / max |logit| | KL(f32 || f16) nats | argmax agrees")
    for pos in at:
        d = np.abs(half[pos] - ref[pos]).max()
        print(f"{pos} | {d:.3g} | {d / np.abs(ref[pos]).max():.3g} | {kl(ref[pos], half[pos]):.3g} | "
              f"{int(ref[pos].argmax()) == int(half[pos].argmax())}")


if __name__ == "__main__":
    main()
