"""Concurrent decode streams: aggregate and per-stream tok/s of ``forward_batch`` at 1, 2, 4, 8 streams,
against llama.cpp's ``llama-batched-bench`` on the same file and threads, interleaved (not a test).

Usage::

    .venv/bin/python tests/bench/bench_batch_decode.py /tmp/agent/slice.gguf --threads 2 --rounds 3 \\
        --llama-batched-bench <llama.cpp build>/bin/llama-batched-bench

Ours: one prompt of ``--npp`` tokens is prefilled once (not timed); each stream continues a copy of it
with its own 4 random tokens (so the streams' states differ), then every round decodes ``--ntg`` steps
of N rows at once (N = 1 is the one-call native step). The rows' tokens are random ids, so the batch
routes to as many experts as real text would, not to one shared set. llama.cpp:
``llama-batched-bench -c 8192 -b 2048 -ub 512 -npp NPP -ntg NTG -npl 1,2,4,8 -t THREADS``, its S_TG
column (N x NTG tokens over the generation time, each sequence with its own NPP-token prompt). A round
runs ours then llama.cpp (the order alternating by round). Prints per N the median of the rounds with
their min-max, aggregate and per-stream, the ratio of the medians, and the 1-minute load before and after.
``--weights`` (default ``map``; ``ram``: the layouts ``engine serve`` reads) as docs/design/batched-decode.md,
"Measuring it", says.
``--pairs R`` instead runs R interleaved rounds of ``--ntg`` steps each of 1 stream, 4 streams on the native
batched step, 4 on the per-hook path, 2 and 8 streams (order reversed every other round), and prints the
median (min) wall and process CPU ms per step of each and its aggregate against the single stream.
``--profile N`` instead times ``--ntg`` steps of N streams: the native step as a whole, then the per-hook path
by stage (wall and process CPU ms per step of the dense products, LM head, GDN, attention, MoE, the rest), then
the bytes a step moves against one stream's token and the aggregate ratio they allow (:func:`moved`).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import subprocess
import time

import numpy as np

from engine.api_types import EngineOptions
from engine.arch.qwen35.cpu import NativeQwen35Model
from engine.kernels import cpu
from engine.placement import weights_mode
from engine.registry import LoadedText, open_text
from engine.turn.state import SequenceState

STREAMS = (1, 2, 4, 8)


def streams(model: NativeQwen35Model, npp: int, ntg: int) -> list[SequenceState]:
    """max(STREAMS) states at depth npp + 4: one shared prefill, then 4 tokens of each stream's own."""
    rng = np.random.default_rng(0)
    base = SequenceState.new(model.hp, npp + 4 + ntg + 1, "f16")
    model.forward(rng.integers(0, model.hp.n_vocab, npp), base)
    out = []
    for _ in range(max(STREAMS)):
        s = base.copy()
        model.forward(rng.integers(0, model.hp.n_vocab, 4), s)
        out.append(s)
    return out


def ours(model: NativeQwen35Model, states: list[SequenceState], n: int, ntg: int, seed: int) -> float:
    """Aggregate decode tok/s of ntg batched steps of n streams (copies of the first n states)."""
    batch = [s.copy() for s in states[:n]]
    tokens = np.random.default_rng(seed).integers(0, model.hp.n_vocab, (ntg, n))
    t0 = time.perf_counter()
    for step in range(ntg):
        model.forward_batch(tokens[step], batch, [None] * n)
    return n * ntg / (time.perf_counter() - t0)


def llama(binary: str, gguf: str, npp: int, ntg: int, threads: int) -> dict[int, float]:
    """llama-batched-bench's S_TG (aggregate generation tok/s) per parallel sequence count."""
    cmd = [binary, "-m", gguf, "-c", "8192", "-b", "2048", "-ub", "512", "-npp", str(npp), "-ntg", str(ntg),
           "-npl", ",".join(map(str, STREAMS)), "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[0]) and int(cells[0]) == npp:
            rows[int(cells[2])] = float(cells[7])
    if sorted(rows) != list(STREAMS):
        raise SystemExit(f"could not read llama-batched-bench's table:\n{out}")
    return rows


def moved(text: LoadedText, state: SequenceState, distinct: list[int], n: int) -> tuple[float, float]:
    """(bytes a step of n rows moves, bytes one row alone moves): the weights as
    :meth:`~engine.registry.LoadedText.bytes_per_token` counts them but the routed experts, as many as
    ``distinct`` gives (the experts a step's rows chose, per MoE layer and step in the order run; one row alone:
    n_expert_used), plus each row's recurrent state read and written (2 x state.ssm's bytes); the KV cache read
    (small at a short context) is left out. At one read rate n streams give at most n x one / step one stream's
    aggregate (docs/design/batched-decode.md, "What the bytes allow")."""
    f, hp = text.file, text.hparams
    per_expert = [sum(f.info(name).nbytes // f.info(name).ne[2] for name in text.arch.tensor_shapes(hp)
                      if f.has(name) and name.startswith(f"blk.{il}.") and len(f.info(name).ne) == 3)
                  for il in range(hp.n_layer)]
    moe_layers = [b for b in per_expert if b]
    routed = sum(b * hp.n_expert_used for b in moe_layers)
    state_rw = 2 * sum(a.nbytes for a in state.ssm.values())
    steps = len(distinct) // len(moe_layers) if moe_layers else 1
    chosen = sum(c * moe_layers[i % len(moe_layers)] for i, c in enumerate(distinct)) / steps
    return text.bytes_per_token() - routed + chosen + n * state_rw, text.bytes_per_token() + state_rw


def profile(model: NativeQwen35Model, text: LoadedText, states: list[SequenceState], n: int, ntg: int) -> None:
    """Print wall / process CPU ms per batched step of n streams: the native step whole, the hooks' stages."""
    t0, c0 = time.perf_counter(), time.process_time()
    ours(model, states, n, ntg, seed=1)
    print(f"N = {n}, {ntg} steps, load {os.getloadavg()[0]:.2f}: native step | "
          f"{(time.perf_counter() - t0) * 1e3 / ntg:.1f} | {(time.process_time() - c0) * 1e3 / ntg:.1f}")
    model.step = None
    spent: dict[str, list[float]] = {}

    def timed(stage, fn):
        @functools.wraps(fn)
        def run(*a, **k):
            name = stage(*a) if callable(stage) else stage
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                acc = spent.setdefault(name, [0.0, 0.0])
                acc[0] += time.perf_counter() - t0
                acc[1] += time.process_time() - c0
        return run

    model.linear = timed(lambda x, name: "LM head" if name == model.output_name else "dense products", model.linear)
    model.delta_rule = timed("GDN recurrence", model.delta_rule)
    model.attend = timed("attention", model.attend)
    distinct: list[int] = []
    moe = model.moe

    def routed(il, y, cb):
        def seen(name, layer, value):
            if name == "ffn_moe_topk":
                distinct.append(len(np.unique(value)))
            cb(name, layer, value)
        return moe(il, y, seen)

    model.moe = timed("MoE (router, experts, shared expert)", routed)
    t0, c0 = time.perf_counter(), time.process_time()
    ours(model, states, n, ntg, seed=1)
    spent["rest (norms, RoPE, KV append, Python)"] = [time.perf_counter() - t0 - sum(v[0] for v in spent.values()),
                                                      time.process_time() - c0 - sum(v[1] for v in spent.values())]
    print(f"N = {n}, {ntg} steps, load {os.getloadavg()[0]:.2f}: stage | wall ms/step | process CPU ms/step")
    for name, (wall, cpu_s) in spent.items():
        print(f"{name} | {wall * 1e3 / ntg:.1f} | {cpu_s * 1e3 / ntg:.1f}")
    step, one = moved(text, states[0], distinct, n)
    experts = f" ({statistics.mean(distinct):.1f} routed experts a layer)" if distinct else ""
    print(f"moved a step: {step / 2**20:.0f} MiB{experts}; one "
          f"stream's token: {one / 2**20:.0f} MiB; bound on the aggregate of {n} streams / one stream: "
          f"{n * one / step:.2f}x")


def pairs(model: NativeQwen35Model, states: list[SequenceState], rounds: int, ntg: int) -> None:
    """Print per-step wall / CPU ms of interleaved runs (see the module doc): paired figures on a busy machine."""
    step, spent = model.step, {}
    runs = [("1 native", 1, step), ("4 native", 4, step), ("4 per-hook", 4, None), ("2 native", 2, step),
            ("8 native", 8, step)]
    for r in range(rounds):
        for label, n, path in (runs if r % 2 == 0 else runs[::-1]):
            model.step = path
            t0, c0 = time.perf_counter(), time.process_time()
            ours(model, states, n, ntg, seed=r)
            spent.setdefault(label, []).append(((time.perf_counter() - t0) * 1e3 / ntg,
                                                (time.process_time() - c0) * 1e3 / ntg))
    model.step = step
    one = [statistics.median(v[i] for v in spent["1 native"]) for i in (0, 1)]
    print(f"{rounds} rounds x {ntg} steps, load {os.getloadavg()[0]:.2f}: run | wall ms/step | CPU ms/step | "
          "aggregate / single stream by wall, by CPU")
    for label, v in spent.items():
        n, med = int(label.split()[0]), [statistics.median(x[i] for x in v) for i in (0, 1)]
        print(f"{label} | {med[0]:.1f} ({min(x[0] for x in v):.1f}) | {med[1]:.1f} ({min(x[1] for x in v):.1f}) | "
              f"{n * one[0] / med[0]:.2f}x, {n * one[1] / med[1]:.2f}x")


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--npp", type=int, default=512, help="prompt tokens before decoding")
    ap.add_argument("--ntg", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-batched-bench", dest="llama", help="path of llama.cpp's llama-batched-bench")
    ap.add_argument("--profile", type=int, metavar="N", help="time the stages of N streams instead")
    ap.add_argument("--pairs", type=int, metavar="R", help="R interleaved rounds of paired per-step timings instead")
    ap.add_argument("--weights", choices=("auto", "map", "ram"), default="map",
                    help="as engine serve's --weights (default map; ram: in memory, row-grouped layouts)")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    cpu.set_threads(args.threads)
    mode = weights_mode(EngineOptions(device="cpu", weights=args.weights), args.gguf)
    print(f"weights {mode}", flush=True)
    gguf = open_text(args.gguf, mode)
    model = NativeQwen35Model(gguf.hparams, gguf.file)
    states = streams(model, args.npp, args.ntg)
    ours(model, states, 2, 2, seed=99)     # warm-up: pages and pool
    if args.profile:
        profile(model, gguf, states, args.profile, args.ntg)
        return
    if args.pairs:
        pairs(model, states, args.pairs, args.ntg)
        return
    mine: dict[int, list[float]] = {n: [] for n in STREAMS}
    theirs: dict[int, list[float]] = {n: [] for n in STREAMS}
    for r in range(args.rounds):
        for side in (("ours", "llama") if r % 2 == 0 else ("llama", "ours")):
            if side == "ours":
                for n in (STREAMS if r % 2 == 0 else STREAMS[::-1]):
                    mine[n].append(ours(model, states, n, args.ntg, seed=r))
            elif args.llama:
                for n, v in llama(args.llama, args.gguf, args.npp, args.ntg, args.threads).items():
                    theirs[n].append(v)
        print(f"round {r + 1}/{args.rounds} done, load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"{args.gguf}: {args.threads} threads, isa {cpu.isa()}, npp {args.npp}, ntg {args.ntg}, "
          f"{args.rounds} rounds; load {load0:.2f} before, {os.getloadavg()[0]:.2f} after")
    print("streams | ours aggregate tok/s | ours per stream | llama.cpp aggregate | llama.cpp per stream | ours/llama")
    for n in STREAMS:
        line = f"{n:7d} | {summary(mine[n])} | {summary([v / n for v in mine[n]])}"
        if theirs[n]:
            ratio = statistics.median(mine[n]) / statistics.median(theirs[n])
            line += f" | {summary(theirs[n])} | {summary([v / n for v in theirs[n]])} | {ratio:.2f}x"
        print(line)


if __name__ == "__main__":
    main()
