"""Benchmark: the logit difference of F16 and Q8_0 KV caches against F32, by context length (a script, not a test).

    python tests/bench/bench_kv_type.py --model slice.gguf [--tokens 16384] [--at 1024,4096,16384] [--threads 2]
        [--types f16,q8_0] [--save DIR [--only TYPE]]
    python tests/bench/bench_kv_type.py --kernels [--tokens 16384]

Prefills the same random token sequence once per KV type (F32 first, the reference) on the native kernels,
in pieces of 512 (split-invariant, so the piece size changes no bit), and at each position of ``--at``
compares the last position's logits with F32's: max |difference|, that over max |logit|, the KL divergence
of the type's distribution from F32's (nats), whether the argmax agrees, and where it does not, F32's gap
between its top two logits and between its argmax and the type's. Also prints the KV bytes per token of
each type. ``--kernels`` instead times the attention kernels alone over a cache of each type (random rows of
the 35B-A3B's shape; one thread, thread CPU time, the best of 5 interleaved rounds). docs/perf/kv-cache.md
has the figures.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from engine.arch.qwen35 import cpu_mixers
from engine.arch.qwen35.cpu import NativeQwen35Model
from engine.kernels import cpu
from engine.registry import open_text
from engine.turn.kv_types import quantize_q8_0
from engine.turn.state import SequenceState, state_nbytes

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
            print(f"  {kv_type} {end} tokens, {time.perf_counter() - t0:.0f} s wall", flush=True)
        start = end
    return out


def kept(folder: str | None, model: NativeQwen35Model, tokens: np.ndarray, at: list[int],
         kv_type: str, identity: str) -> dict[int, np.ndarray]:
    """:func:`run`, its logits kept in ``folder`` (``TYPE-TOKENS.npz``, with the model file's identity and the
    token sequence) so a cut-short run resumes without redoing a finished type; a file of another model,
    sequence or set of positions (``identity``: the model file's, ``GGUFFile.identity``) is recomputed."""
    if folder is None:
        return run(model, tokens, at, kv_type)
    path = Path(folder) / f"{kv_type}-{len(tokens)}.npz"
    ident = np.frombuffer(identity.encode(), np.uint8)
    if path.is_file():
        with np.load(path) as saved:
            if (np.array_equal(saved["identity"], ident) and np.array_equal(saved["tokens"], tokens)
                    and set(at) <= {int(k) for k in saved.files if k.isdigit()}):
                print(f"  {kv_type}: logits from {path}", flush=True)
                return {pos: saved[str(pos)] for pos in at}
    out = run(model, tokens, at, kv_type)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, identity=ident, tokens=tokens, **{str(pos): v for pos, v in out.items()})
    return out


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p || q) in nats of the softmax distributions of two logit vectors."""
    lp = p_logits - p_logits.max()
    lp -= np.log(np.exp(lp).sum())
    lq = q_logits - q_logits.max()
    lq -= np.log(np.exp(lq).sum())
    return float((np.exp(lp) * (lp - lq)).sum())


def compare(ref: np.ndarray, got: np.ndarray) -> str:
    """One table row's cells: max |d|, / max |ref|, KL(ref || got), argmax agrees, and where it does not,
    ref's top-two gap and ref's gap between its argmax and got's."""
    d = np.abs(got - ref).max()
    a, b = int(ref.argmax()), int(got.argmax())
    top2 = np.sort(ref)[-2:]
    gaps = "" if a == b else f" | {top2[1] - top2[0]:.3g} | {ref[a] - ref[b]:.3g}"
    return f"{d:.3g} | {d / np.abs(ref).max():.3g} | {kl(ref, got):.3g} | {a == b}{gaps}"


def kernel_times(m: int, rounds: int = 5) -> None:
    """Print the best thread CPU time of one decode query and of 64 prefill queries over an m-row cache of
    each KV type (16 q heads on 2 KV heads of 256, one thread)."""
    cpu.set_threads(1)
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((m, 2, 256)).astype(np.float32) for _ in range(2))
    caches = {"f32": (k, v), "f16": (k.astype(np.float16), v.astype(np.float16)),
              "q8_0": (quantize_q8_0(k), quantize_q8_0(v))}
    q, g = (rng.standard_normal((64, 16, 256)).astype(np.float32) for _ in range(2))
    best = {(t, n): float("inf") for t in caches for n in ("decode", "prefill")}
    for _ in range(rounds):
        for t, (kc, vc) in caches.items():
            for name, call in (("decode", lambda: cpu_mixers.attention_decode(q[-1], g[-1], kc, vc)),
                               ("prefill", lambda: cpu_mixers.attention_prefill(q, g, kc, vc))):
                c0 = time.thread_time()
                call()
                best[t, name] = min(best[t, name], time.thread_time() - c0)
    print(f"ISA {cpu.isa()}, {m} cache rows")
    for t in caches:
        print(f"{t} | decode {1e3 * best[t, 'decode']:.1f} ms | prefill (64 queries) {1e3 * best[t, 'prefill']:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model")
    ap.add_argument("--kernels", action="store_true", help="time the attention kernels alone (no model)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--at", default="1024,4096,16384")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="f16,q8_0", help="KV types compared with f32, comma-separated")
    ap.add_argument("--save", help="folder keeping each type's logits (TYPE-TOKENS.npz), reused by a later run")
    ap.add_argument("--only", help="with --save: compute and keep one type's logits (f32 is one), compare nothing "
                    "(several such runs at once, then one run to compare)")
    args = ap.parse_args()
    if args.kernels:
        kernel_times(args.tokens)
        return
    if args.model is None:
        ap.error("--model is required without --kernels")
    at = [int(x) for x in args.at.split(",")]
    types = args.types.split(",")
    cpu.set_threads(args.threads)
    text = open_text(args.model)
    model = NativeQwen35Model(text.hparams, text.file)
    layout = text.hparams.state_layout()
    for kv_type in ["f32", *types]:
        per_token = state_nbytes(layout, 1, kv_type) - state_nbytes(layout, 0, kv_type)
        print(f"{kv_type}: {per_token} bytes of KV per token")
    tokens = np.random.default_rng(0).integers(0, text.hparams.n_vocab, args.tokens)
    if args.only:
        if args.save is None:
            ap.error("--only needs --save")
        kept(args.save, model, tokens, at, args.only, text.file.identity)
        return
    ref = kept(args.save, model, tokens, at, "f32", text.file.identity)
    got = {kv_type: kept(args.save, model, tokens, at, kv_type, text.file.identity) for kv_type in types}
    print("type | tokens | max |dlogit| | / max |logit| | KL(f32 || type) nats | argmax agrees "
          "[| f32 top-two gap | f32 gap to the type's argmax]")
    for kv_type in types:
        for pos in at:
            print(f"{kv_type} | {pos} | {compare(ref[pos], got[kv_type][pos])}")


if __name__ == "__main__":
    main()
