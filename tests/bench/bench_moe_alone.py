"""The expert products inside ``dd_moe_ffn`` against the same products called alone (a script, not a test).

    python tests/bench/bench_moe_alone.py MODEL.gguf [BUILD.so] [--threads 1] [--rounds 5] [--tokens 16] [--only F]

For --tokens random activation rows (N(0, 1) + 0.1, float32) it runs every MoE layer's ``dd_moe_ffn`` token by
token, as decode does, and records each call's routing; then it runs the same experts' gate, up and down
products (the routed ones, then the shared one) as separate ``dd_matmul`` calls on the same rows, the down
products on a random hidden vector; and, as a reference, ``dd_matmul`` over each layer's gate experts stacked as
one matrix in turn (the same kernel on long streams), to about the tokens' expert bytes (process
CPU time of a short interval is only tick-accurate for the other threads), its time scaled to a token's. Rounds
alternate the three forms. It prints for each the median process CPU
time and wall time per token (milliseconds) and the weight bytes read per CPU second: the routed and shared
experts' bytes for both, plus the f32 router's for ``dd_moe_ffn`` (which also routes, prepares the
activations and sums). Process CPU time counts every pool thread, idle spinning included. An untimed round
first faults the mapped pages in. The load average before and after is printed with the figures. --only
times one form, so that ``perf record`` attributes the kernels' samples to it (the untimed rounds run both).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time

import numpy as np

from bench_gemv_ab import load
from bench_moe_ab import MoeWeights, moe_layers
from engine.gguf import quant

BUILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "engine", "_native_cpu.abi3.so")
KERNEL_TYPE = {t.cpu_kernel: t for t in quant.TYPES.values() if t.cpu_kernel is not None}


def row_bytes(kernel: int, k: int) -> int:
    """Bytes of one stored row of k values of the weight type whose native kernel id is ``kernel``."""
    t = KERNEL_TYPE[kernel]
    return k // t.block_values * t.block_bytes


def products(w: MoeWeights, sel: np.ndarray) -> list[tuple[int, int, int, int, bool]]:
    """(kernel, weight pointer, rows, k, reads the hidden vector) of each product of the experts in ``sel``
    (routed, in order) and the shared one, as ``dd_moe_ffn`` runs them."""
    out = []
    for s in sel:
        for ptr, kern, rows, k in ((w.gate, w.gate_type, w.ff, w.d), (w.up, w.up_type, w.ff, w.d),
                                   (w.down, w.down_type, w.d, w.ff)):
            out.append((kern, ptr + int(s) * rows * row_bytes(kern, k), rows, k, ptr == w.down))
    if w.sh_gate:
        out += [(w.sh_gate_type, w.sh_gate, w.ff_sh, w.d, False), (w.sh_up_type, w.sh_up, w.ff_sh, w.d, False),
                (w.sh_down_type, w.sh_down, w.d, w.ff_sh, True)]
    return out


def forms(lib: ctypes.CDLL, isa: int, layers: list[MoeWeights], xs: np.ndarray, hid: np.ndarray):
    """(the ``dd_moe_ffn`` pass over all tokens and layers, the ``dd_matmul`` pass over the same experts' products,
    the experts' weight bytes a token). Runs the first pass once to learn each call's routing."""
    y = np.empty(max(xs.shape[1], hid.size), np.float32)
    sels = np.zeros((len(xs), len(layers), layers[0].n_used), np.int32)

    def fused() -> None:
        for t, x in enumerate(xs):
            for i, w in enumerate(layers):
                if lib.dd_moe_ffn(isa, ctypes.byref(w), ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(y.ctypes.data),
                                  ctypes.c_void_p(sels[t, i].ctypes.data), None) != 0:
                    raise SystemExit("dd_moe_ffn failed")

    fused()
    calls = [(kern, ptr, rows, k, hid.ctypes.data if h else x.ctypes.data)
             for t, x in enumerate(xs) for i, w in enumerate(layers)
             for kern, ptr, rows, k, h in products(w, sels[t, i])]

    def alone() -> None:
        for kern, ptr, rows, k, x in calls:
            if lib.dd_matmul(isa, kern, ptr, rows, k, x, 1, y.ctypes.data) != 0:
                raise SystemExit("dd_matmul failed")

    alone()
    return fused, alone, sum(rows * row_bytes(kern, k) for kern, _p, rows, k, _x in calls) / len(xs)


def stacked(lib: ctypes.CDLL, isa: int, layers: list[MoeWeights], x: np.ndarray, reps: int):
    """(``reps`` ``dd_matmul`` calls, each over all of one layer's stacked gate experts as one matrix, the layers
    in turn, and their weight bytes): the same kernel on long streams instead of expert-sized matrices."""
    y = np.empty(max(w.n_expert * w.ff for w in layers), np.float32)
    calls = [layers[i % len(layers)] for i in range(reps)]

    def run() -> None:
        for w in calls:
            if lib.dd_matmul(isa, w.gate_type, w.gate, w.n_expert * w.ff, w.d, x.ctypes.data, 1, y.ctypes.data) != 0:
                raise SystemExit("dd_matmul failed")

    run()
    return run, sum(w.n_expert * w.ff * row_bytes(w.gate_type, w.d) for w in calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a qwen35moe GGUF")
    ap.add_argument("build", nargs="?", default=BUILD, help="a _native_cpu.abi3.so (default: the worktree's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--isa", type=int, default=-1, help="DD_ISA_* level (default: the best this CPU runs)")
    ap.add_argument("--only", choices=("dd_moe_ffn", "alone", "stacked"), help="time one form only (for perf record)")
    args = ap.parse_args()
    layers, _mapping, d = moe_layers(args.model)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((args.tokens, d)).astype(np.float32) + np.float32(0.1)
    hid = rng.standard_normal(max(max(w.ff, w.ff_sh) for w in layers)).astype(np.float32)
    load_before = os.getloadavg()[0]
    res = {"dd_moe_ffn": ([], []), "alone": ([], []), "stacked": ([], [])}
    with tempfile.TemporaryDirectory() as folder:
        lib = load(args.build, folder, 0, args.threads)
        isa = lib.dd_isa_best() if args.isa < 0 else args.isa
        fused, alone, expert_bytes = forms(lib, isa, layers, xs, hid)
        one = layers[0].n_expert * layers[0].ff * row_bytes(layers[0].gate_type, d)
        big, big_bytes = stacked(lib, isa, layers, xs[0], max(1, round(args.tokens * expert_bytes / one)))
        scale = {"dd_moe_ffn": args.tokens, "alone": args.tokens, "stacked": big_bytes / expert_bytes}
        for _ in range(args.rounds):
            for name, fn in (("dd_moe_ffn", fused), ("alone", alone), ("stacked", big)):
                if args.only in (None, name):
                    c0, w0 = time.process_time(), time.perf_counter()
                    fn()
                    res[name][0].append((time.process_time() - c0) / scale[name] * 1e3)
                    res[name][1].append((time.perf_counter() - w0) / scale[name] * 1e3)
    router_bytes = sum(w.n_expert * w.d * 4 for w in layers)
    print(f"{os.path.basename(args.model)}: {len(layers)} MoE layers, {args.tokens} tokens, isa {isa}, "
          f"{args.threads} thread(s), {args.rounds} rounds, load {load_before:.2f} -> {os.getloadavg()[0]:.2f}; "
          f"experts {expert_bytes / 1e6:.1f} MB + router {router_bytes / 1e6:.1f} MB a token")
    for name, (cpu, wall) in ((n, r) for n, r in res.items() if r[0]):
        nbytes = expert_bytes + (router_bytes if name == "dd_moe_ffn" else 0)
        c = statistics.median(cpu)
        print(f"  {name}: CPU {c:.3f} ms a token ({min(cpu):.3f}-{max(cpu):.3f}), wall "
              f"{statistics.median(wall):.3f} ms; {nbytes / c / 1e6:.1f} GB per CPU second")


if __name__ == "__main__":
    main()
