"""Benchmark of GPU prefill with streamed experts. A script, not a test; needs an NVIDIA GPU.

Writes (or takes) a synth ``35b-a3b`` slice (real per-layer shapes: hidden 2048, 256 experts top-8,
expert FFN 512, Q4_0; ``--layers`` layers, vocab 248320 without tokenizer), then:

1. measures pinned and pageable host->device copy bandwidth (1 GiB, median of 5, CUDA events) and the
   float32 matrix rate the compute bound uses (torch fp32 matmul with TF32 off, 8192^3, if torch is
   there; else the H200 datasheet's 67 TFLOP/s);
2. for budgets ``6 GiB``, ``stream`` (every expert layer streamed: the situation of most layers of the
   full 40-layer model under 6 GiB) and ``unlimited``: prefill of a ``--tokens`` prompt (947 by default,
   the length of the seed's prompt; random ids), median of ``--reps`` after one warm-up, with bytes
   streamed, achieved H2D GB/s, the PCIe bound (streamed bytes / pinned bandwidth), the compute bound
   (FLOPs / matrix rate) and time / max(bounds);
3. prefill tok/s at ``--long`` lengths (2k, 8k, 16k) for the ``stream`` and ``unlimited`` budgets;
4. with ``--check``, the last-position logits of each budget's ``--tokens`` prefill against the native CPU
   model's (the engine's CPU prefill) on the same prompt: max |gpu - cpu|, that over max |cpu|, and whether
   the greedy first token agrees;
5. with ``--profile``, GPU ms per kernel (and GEMM grid) of one ``--tokens`` prefill per budget, from
   CUDA events around every launch.

Usage: python tests/bench/bench_gpu_prefill.py [--layers 4] [--tokens 947] [--long 2048,8192,16384]
       [--model FILE] [--json OUT.json] [--profile] [--check]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.arch.qwen35.cuda import CudaPrefill  # noqa: E402
from engine.arch.qwen35.cuda_plan import plan_file  # noqa: E402
from engine.registry import open_text  # noqa: E402
from engine.kernels.cuda_kernels import load_driver  # noqa: E402
from engine.gguf.file import GGUFFile  # noqa: E402
from engine.arch.qwen35.hparams import Qwen35HParams  # noqa: E402
from engine.turn.state import SequenceState  # noqa: E402
from engine.testing.synth import synth  # noqa: E402

DATASHEET_FP32 = 67e12
"""H200 SXM float32 (non-tensor) rate by NVIDIA's datasheet, FLOP/s; used when torch is not installed."""


def prefill_flops(hp: Qwen35HParams, f: GGUFFile, n: int) -> float:
    """Floating-point operations of an n-token prefill from position 0 (multiply-add = 2).

    Every weight matrix once per token (routed experts: n_expert_used of them), the LM head once,
    causal attention 4 * n_head * head_dim per (query, key) pair, and the chunked delta rule
    ~2 * (3 dk dv + 64 (2 dk + dv)) per token and v-head.
    """
    total = 0.0
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        names = ["attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out"] if hp.is_recurrent(il) else \
            ["attn_q", "attn_k", "attn_v", "attn_output"]
        names += ["ffn_gate_inp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"] if hp.is_moe else \
            ["ffn_gate", "ffn_up", "ffn_down"]
        params = sum(int(np.prod(f.info(p + x + ".weight").shape)) for x in names if f.has(p + x + ".weight"))
        if hp.is_moe:
            params += hp.n_expert_used * 3 * hp.n_ff_exp * hp.n_embd
        total += 2.0 * params * n
        if hp.is_recurrent(il):
            dk, dv = hp.head_k_dim, hp.head_v_dim
            total += 2.0 * n * hp.num_v_heads * (3 * dk * dv + 64 * (2 * dk + dv))
        else:
            total += 4.0 * hp.n_head * hp.head_dim * n * (n + 1) / 2
    return total + 2.0 * hp.n_vocab * hp.n_embd


def copy_bandwidth(drv, pinned: bool, nbytes: int = 1 << 30) -> tuple[float, float]:
    """Host -> device GB/s (1e9 B/s) of one nbytes copy, median of 5, and the median ms the issuing
    thread spent inside memcpy_htod_async (an asynchronous copy should return at once)."""
    host = drv.pagelocked_empty(nbytes, np.uint8) if pinned else np.empty(nbytes, np.uint8)
    host[::4096] = 1
    dev = drv.mem_alloc(nbytes)
    stream = drv.Stream()
    times, held = [], []
    for _ in range(5):
        a, b = drv.Event(), drv.Event()
        a.record(stream)
        t = time.perf_counter()
        drv.memcpy_htod_async(dev, host, stream)
        held.append((time.perf_counter() - t) * 1e3)
        b.record(stream)
        b.synchronize()
        times.append(a.time_till(b))
    dev.free()
    return nbytes / statistics.median(times) / 1e6, statistics.median(held)


def fp32_rate() -> tuple[float, str]:
    """float32 matrix-multiply FLOP/s measured with torch (TF32 off), or the datasheet value."""
    try:
        import torch
    except ImportError:
        return DATASHEET_FP32, "datasheet"
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(8192, 8192, device="cuda")
    b = torch.randn(8192, 8192, device="cuda")
    for _ in range(2):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    rate = 5 * 2 * 8192 ** 3 / (time.perf_counter() - t)
    del a, b
    torch.cuda.empty_cache()
    return rate, "torch fp32 matmul"


def prompt(hp: Qwen35HParams, n: int, seed: int = 0) -> np.ndarray:
    """The n random token ids every run of length n (and seed) prefills."""
    return np.random.default_rng(seed).integers(0, hp.n_vocab, n)


def run(eng: CudaPrefill, hp: Qwen35HParams, n: int, reps: int, seed: int = 0) -> tuple[float, object, np.ndarray]:
    """Median wall seconds of ``reps`` prefills of :func:`prompt` (n, seed) from a fresh state, the last
    telemetry and the last prefill's (n_vocab,) float32 logits of the final position."""
    toks = prompt(hp, n, seed)
    times = []
    for _ in range(reps):
        st = SequenceState.new(hp, n + 1)
        t = time.perf_counter()
        logits = eng.prefill(toks, st)
        times.append(time.perf_counter() - t)
    return statistics.median(times), eng.last_telemetry, logits


def stream_budget(hp: Qwen35HParams, f, plan_tokens: int) -> int:
    """The VRAM budget (bytes) under which every expert layer of a model with three or more streams: the
    placement's resident weights, state, reserve for ``plan_tokens`` and two stream buffers, plus half a
    layer (too little for one resident layer). Planned from the tensor table alone (no device)."""
    p = plan_file(hp, f, 1 << 60, plan_tokens).plan
    return p.resident_weights + p.state + 2 * p.expert_layer_bytes + p.reserve + p.expert_layer_bytes // 2


def cpu_logits(text, n: int) -> np.ndarray:
    """(n_vocab,) float32 last-position logits of :func:`prompt` (n) from the native CPU model."""
    hp = text.hparams
    model = text.arch.native_model(hp, text.file)
    return model.forward(prompt(hp, n), SequenceState.new(hp, n + 1))[-1]


def compare(gpu: np.ndarray, cpu: np.ndarray) -> dict[str, float]:
    """Max |gpu - cpu|, that over max |cpu|, and whether the argmax (greedy first token) agrees."""
    diff = float(np.max(np.abs(gpu.astype(np.float64) - cpu)))
    return {"logits_max_abs": diff, "logits_max_rel": diff / float(np.max(np.abs(cpu))),
            "argmax_equal": bool(np.argmax(gpu) == np.argmax(cpu))}


def profile(eng: CudaPrefill, hp: Qwen35HParams, n: int, top: int = 16) -> dict[str, float]:
    """GPU ms per kernel of one n-token prefill (GEMMs keyed by grid too), largest first; prints the top."""
    drv, kernels = eng._drv, eng.kernels
    launches = []
    launch = kernels._launch

    def timed(name, grid, block, stream, *args):
        a, b = drv.Event(), drv.Event()
        a.record(stream)
        launch(name, grid, block, stream, *args)
        b.record(stream)
        launches.append((f"{name} {grid}" if name.startswith("qgemm") else name, a, b))

    kernels._launch = timed
    try:
        run(eng, hp, n, 1)
    finally:
        kernels._launch = launch
    totals: dict[str, float] = {}
    for key, a, b in launches:
        totals[key] = totals.get(key, 0.0) + a.time_till(b)
    ranked = dict(sorted(totals.items(), key=lambda kv: -kv[1]))
    print(f"  profile: {len(launches)} launches, {sum(totals.values()):.1f} ms of kernels")
    for key, ms in list(ranked.items())[:top]:
        print(f"    {ms:8.3f} ms  {key}")
    return ranked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--quant", default="q4_0")
    ap.add_argument("--tokens", type=int, default=947)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--long", default="2048,8192,16384")
    ap.add_argument("--model", help="use this GGUF instead of writing a synth slice")
    ap.add_argument("--json", help="write all figures here")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU times of one --tokens prefill")
    ap.add_argument("--check", action="store_true", help="compare each budget's logits with the CPU prefill's")
    args = ap.parse_args()
    long = [int(x) for x in args.long.split(",") if x]

    tmp = tempfile.TemporaryDirectory()
    if args.model:
        path = Path(args.model)
    else:
        path = Path(tmp.name) / "slice.gguf"
        t = time.perf_counter()
        synth(path, "35b-a3b", layers=args.layers, experts=args.experts, quant=args.quant, seed=0, vocab=None)
        print(f"synth {args.layers}-layer 35b-a3b slice ({path.stat().st_size / 2**30:.2f} GiB) in "
              f"{time.perf_counter() - t:.1f} s", flush=True)
    f = open_text(path)
    hp = f.hparams

    drv = load_driver()
    ctx = drv.Device(0).retain_primary_context()
    ctx.push()
    (pinned, held), (pageable, _) = copy_bandwidth(drv, True), copy_bandwidth(drv, False)
    drv.Context.pop()
    rate, rate_src = fp32_rate()
    print(f"H2D pinned {pinned:.1f} GB/s (issuing thread held {held:.2f} ms per 1 GiB async copy), pageable "
          f"{pageable:.1f} GB/s; fp32 matmul {rate / 1e12:.1f} TFLOP/s ({rate_src})", flush=True)
    out = {"model": str(path), "layers": hp.n_layer, "experts": hp.n_expert, "quant": args.quant,
           "h2d_pinned_gbs": pinned, "h2d_async_call_ms": held, "h2d_pageable_gbs": pageable, "fp32_flops": rate,
           "fp32_source": rate_src, "runs": []}

    plan_tokens = max([args.tokens] + long)
    budgets = {"6 GiB": (6 << 30, args.tokens), "stream": (stream_budget(hp, f.file, plan_tokens), plan_tokens),
               "unlimited": (None, plan_tokens)}
    reference = None
    if args.check:
        t = time.perf_counter()
        reference = cpu_logits(f, args.tokens)
        print(f"CPU prefill of {args.tokens} tokens for --check: {time.perf_counter() - t:.1f} s", flush=True)

    rows = []
    for label, (budget, ptok) in budgets.items():
        t = time.perf_counter()
        eng = CudaPrefill(hp, f.file, budget_bytes=budget, plan_tokens=ptok)
        load_s = time.perf_counter() - t
        print(f"\n[{label}] load {load_s:.1f} s\n{eng.plan.text()}", flush=True)
        run(eng, hp, 64, 1)
        if args.profile:
            ctx.push()
            out.setdefault("profile", {})[label] = profile(eng, hp, args.tokens)
            drv.Context.pop()
        lengths = [args.tokens] + (long if label != "6 GiB" else [])
        for n in lengths:
            reps = args.reps if n == args.tokens else 1
            if n != args.tokens:
                run(eng, hp, n, 1, seed=1)
            sec, tel, logits = run(eng, hp, n, reps)
            pcie = tel.h2d_bytes / (pinned * 1e9)
            comp = prefill_flops(hp, f.file, n) / rate
            r = {"budget": label, "tokens": n, "seconds": sec, "tok_s": n / sec, "passes": tel.passes,
                 "mode": tel.mode, "h2d_bytes": tel.h2d_bytes, "h2d_gbs": tel.h2d_gbs, "gpu_ms": tel.gpu_ms,
                 "pcie_bound_s": pcie, "compute_bound_s": comp, "ratio": sec / max(pcie, comp),
                 "vram_used": tel.vram_used, "layer_ms": [round(lt.compute_ms, 3) for lt in tel.layers],
                 "layer_h2d_gbs": [round(lt.h2d_gbs, 1) for lt in tel.layers]}
            if reference is not None and n == args.tokens:
                r.update(compare(logits, reference))
                print(f"  vs CPU: logits max abs diff {r['logits_max_abs']:.3e} (rel {r['logits_max_rel']:.2e}), "
                      f"greedy first token equal: {r['argmax_equal']}", flush=True)
            rows.append(r)
            print(f"  {n:6d} tok: {n / sec:9.0f} tok/s  {sec * 1e3:8.1f} ms (gpu {tel.gpu_ms:7.1f})  "
                  f"passes {tel.passes} {tel.mode:9s} H2D {tel.h2d_bytes / 2**30:6.2f} GiB at {tel.h2d_gbs:5.1f} GB/s  "
                  f"bounds pcie {pcie * 1e3:7.1f} ms compute {comp * 1e3:7.1f} ms  ratio {r['ratio']:.2f}", flush=True)
            print(f"         per-layer ms {r['layer_ms']}  per-layer GB/s {r['layer_h2d_gbs']}", flush=True)
        eng.close()
    out["runs"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print("\nbudget      tokens     tok/s   ratio  H2D GB/s (pinned %.1f)" % pinned)
    for r in rows:
        print(f"{r['budget']:10s} {r['tokens']:7d} {r['tok_s']:9.0f} {r['ratio']:7.2f} {r['h2d_gbs']:9.1f}")


if __name__ == "__main__":
    main()
