"""A/B of the native one-token MoE feed-forward between builds, on a real file's layers (a script, not a test).

    python tests/bench/bench_moe_ab.py MODEL.gguf OLD.so,NEW.so [--threads 1] [--rounds 9] [--tokens 48] [--isa -1]

Each build argument is a copy of ``engine/_native_cpu.abi3.so`` (copy a build aside before rebuilding). The
script maps MODEL.gguf (a ``qwen35moe`` file; its tensors stay in the page cache, as the engine reads them) and
calls ``dd_moe_ffn`` for every MoE layer, routed experts and the shared one, on --tokens random activation rows
(N(0, 1) + 0.1, float32), as decode does token by token: each token's routing picks its own experts, so the
expert weights come from memory the way a decode step's do. Unlike bench_gemv_ab.py's one large matrix, this
times the expert-sized products with the MoE's own chunking, pool jobs and activation preparation. The builds
run interleaved round by round on the same inputs; it prints each build's median milliseconds per token (all
the MoE layers), the median of the per-round ratios against the first build, whether all gave the same output
bits, and the load average before and after. An untimed first round faults the mapped pages in.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import time

import numpy as np
from gguf import GGUFReader

from bench_gemv_ab import load
from engine.gguf import quant


class MoeWeights(ctypes.Structure):
    """native/cpu/deltadesk_cpu.h's ``dd_moe_weights``, field for field."""

    _fields_ = [("d", ctypes.c_size_t), ("n_expert", ctypes.c_size_t), ("n_used", ctypes.c_size_t),
                ("ff", ctypes.c_size_t), ("ff_sh", ctypes.c_size_t), ("router", ctypes.c_void_p),
                ("gate", ctypes.c_void_p), ("up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("gate_type", ctypes.c_int), ("up_type", ctypes.c_int), ("down_type", ctypes.c_int),
                ("sh_gate", ctypes.c_void_p), ("sh_up", ctypes.c_void_p), ("sh_down", ctypes.c_void_p),
                ("sh_gate_type", ctypes.c_int), ("sh_up_type", ctypes.c_int), ("sh_down_type", ctypes.c_int),
                ("sh_gate_inp", ctypes.c_void_p)]


def moe_layers(path: str) -> tuple[list[MoeWeights], np.ndarray, int]:
    """The MoE layers of the GGUF at ``path``: (one ``dd_moe_weights`` per layer, the file mapping that their
    pointers point into (uint8, keep it alive while they are used), the model width d). Raises SystemExit when the file
    has no MoE layers or a type that
    no native kernel reads as stored."""
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if f"{arch}.expert_used_count" not in reader.fields:
        raise SystemExit(f"{path}: architecture {arch} has no {arch}.expert_used_count (not a MoE model)")
    n_used = int(reader.fields[f"{arch}.expert_used_count"].parts[-1][0])
    with open(path, "rb") as f:
        view = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
    base = view.ctypes.data

    def ptr(name: str) -> int:
        return base + tensors[name].data_offset

    def kernel(name: str) -> int:
        k = quant.traits(tensors[name].tensor_type, name).cpu_kernel
        if k is None:
            raise SystemExit(f"{path}: {name} is {tensors[name].tensor_type.name}, which no native kernel reads")
        return k

    layers = []
    i = 0
    while f"blk.{i}.attn_norm.weight" in tensors:
        p = f"blk.{i}."
        if p + "ffn_gate_exps.weight" in tensors:
            d, ff, n_expert = (int(n) for n in tensors[p + "ffn_gate_exps.weight"].shape)
            shared = p + "ffn_gate_shexp.weight" in tensors
            ff_sh = int(tensors[p + "ffn_gate_shexp.weight"].shape[1]) if shared else 0
            sh = (lambda n: ptr(p + n)) if shared else (lambda n: None)
            sht = (lambda n: kernel(p + n)) if shared else (lambda n: 0)
            layers.append(MoeWeights(
                d, n_expert, n_used, ff, ff_sh, ptr(p + "ffn_gate_inp.weight"), ptr(p + "ffn_gate_exps.weight"),
                ptr(p + "ffn_up_exps.weight"), ptr(p + "ffn_down_exps.weight"), kernel(p + "ffn_gate_exps.weight"),
                kernel(p + "ffn_up_exps.weight"), kernel(p + "ffn_down_exps.weight"), sh("ffn_gate_shexp.weight"),
                sh("ffn_up_shexp.weight"), sh("ffn_down_shexp.weight"), sht("ffn_gate_shexp.weight"),
                sht("ffn_up_shexp.weight"), sht("ffn_down_shexp.weight"), sh("ffn_gate_inp_shexp.weight")))
        i += 1
    if not layers:
        raise SystemExit(f"{path}: no MoE layers (blk.N.ffn_gate_exps.weight)")
    return layers, view, layers[0].d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a qwen35moe GGUF")
    ap.add_argument("builds", help="comma-separated paths of _native_cpu.abi3.so copies; the first is the base")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=48, help="activation rows (tokens) per round")
    ap.add_argument("--isa", type=int, default=-1, help="DD_ISA_* level (default: the best this CPU runs)")
    args = ap.parse_args()
    layers, mapping, d = moe_layers(args.model)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((args.tokens, d)).astype(np.float32) + np.float32(0.1)
    paths = args.builds.split(",")
    outs = [np.empty((args.tokens, d), np.float32) for _ in paths]
    times: list[list[float]] = [[] for _ in paths]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        libs = [load(p, folder, i, args.threads) for i, p in enumerate(paths)]
        isa = libs[0].dd_isa_best() if args.isa < 0 else args.isa
        for r in range(args.rounds + 1):   # round 0: untimed, faults the file's pages into this process
            for lib, out, t in zip(libs, outs, times):
                t0 = time.perf_counter()
                for x, y in zip(xs, out):
                    for w in layers:
                        rc = lib.dd_moe_ffn(isa, ctypes.byref(w), ctypes.c_void_p(x.ctypes.data),
                                            ctypes.c_void_p(y.ctypes.data), None, None)
                        if rc != 0:
                            raise SystemExit(f"dd_moe_ffn returned {rc}")
                if r > 0:
                    t.append((time.perf_counter() - t0) / args.tokens * 1e3)
    same = all(np.array_equal(outs[0].view(np.uint32), o.view(np.uint32)) for o in outs[1:])
    print(f"{os.path.basename(args.model)}: {len(layers)} MoE layers, {args.tokens} tokens, isa {isa}, "
          f"{args.threads} thread(s), {args.rounds} rounds, load {load_before:.2f} -> {os.getloadavg()[0]:.2f}; "
          f"same bits: {same}")
    for path, t in zip(paths, times):
        ratio = statistics.median(a / b for a, b in zip(times[0], t))
        print(f"  {path}: median {statistics.median(t):.3f} ms a token ({min(t):.3f}-{max(t):.3f}); "
              f"first / this per round {ratio:.3f}")


if __name__ == "__main__":
    main()
