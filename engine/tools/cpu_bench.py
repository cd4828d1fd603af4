"""``python -m engine bench``: DeltaDesk's CPU prompt and decode speed beside the peers' ``llama-bench``.

Measures the host (NUMA nodes), warms the page cache, loads, then runs rounds that measure the stream
bandwidth (GB/s) and interleave DeltaDesk (per ISA level and thread count) with each peer on the same file,
and summarises medians (min-max), the roofline fraction (against each round's bandwidth) and the
per-round ratio to each peer.
Design: docs/design/engine-bench.md (the method, step by step).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from pathlib import Path

import numpy as np

from engine.gguf.header import advise_huge_pages
from engine.registry import LoadedText, open_text
from engine.kernels import cpu, numa
from engine.ops import reference as ops
from engine.api_types import EngineOptions
from engine.placement import interleave_experts, weights_mode
from engine.turn.state import SequenceState

from . import cpu_llama

Out = Callable[[str], None]

@dataclass(frozen=True)
class Sample:
    """One engine's figures in one round. Rates in tokens/s, times in ms; ``depth_tg``: depth -> decode tok/s."""

    engine: str            # "deltadesk" or the peer's name (cpu_llama.Peer.name)
    isa: str               # DeltaDesk's ISA level; "" for a peer
    threads: int
    round: int
    pp_tok_s: float        # NaN: no prompt test (-p 0)
    tg_tok_s: float
    depth_tg: dict[int, float] = field(default_factory=dict)
    head_ms: float = 0.0   # LM head (output norm + product) of one token
    layer_ms: float = 0.0  # mean time of one layer of one decoded token
    stream_gb_s: float = math.nan  # median stream read of this round at these threads, measured before its samples


def spread(values: Sequence[float], fmt: str = ".2f") -> str:
    """``median (min-max)`` of ``values``; one value prints alone; NaN (a test not run: ``-p 0``) prints "-"."""
    if any(math.isnan(v) for v in values):
        return "-"
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def memory() -> dict[str, int]:
    """This process's resident memory in bytes (psutil): ``rss``, ``file`` (file-backed and shared pages,
    Linux ``statm`` shared) and ``anon`` (the rest: owned memory)."""
    import psutil
    info = psutil.Process().memory_info()
    shared = getattr(info, "shared", 0)
    return {"rss": info.rss, "file": shared, "anon": info.rss - shared}


def huge_pages() -> int | None:
    """Bytes of this process's anonymous memory in 2 MiB pages (``AnonHugePages`` of /proc/self/smaps_rollup),
    None where that file does not exist."""
    try:
        with open("/proc/self/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) << 10
    except OSError:
        return None
    return None


def warm_page_cache(path: str | Path, chunk: int = 16 << 20) -> tuple[int, float]:
    """Read the whole file once into the page cache; returns (bytes, seconds).

    It reads through a map that asks for 2 MiB folios, as the engine's own map does
    (:func:`engine.gguf.header.advise_huge_pages`): one byte a page faults each page in. A ``read()`` would
    fill the cache in whatever folios the kernel picks. The pages that the engine's map later reads
    would then be scattered 4 KiB pages on a fragmented machine, which decode up to 1.7x slower.
    """
    t0 = time.perf_counter()
    n = Path(path).stat().st_size
    if n:
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        advise_huge_pages(mapped)
        for off in range(0, n, chunk):
            int(mapped[off:off + chunk:4096].sum())
        del mapped
    return n, time.perf_counter() - t0


def stream_bandwidth(threads: int, nbytes: int, runs: int) -> list[float]:
    """``runs`` streaming-read bandwidths (GB/s) of an ``nbytes`` buffer with ``threads`` threads."""
    cpu.set_threads(threads)
    return [cpu.read_bandwidth(nbytes, repeats=1) for _ in range(runs)]


def fill_context(hp, depth: int, capacity: int, rng: np.random.Generator) -> SequenceState:
    """A state at position ``depth``: KV rows ``[:depth]`` N(0, 1), delta-net conv/state N(0, 0.1^2) (float32)."""
    state = SequenceState.new(hp, capacity)
    for cache in (state.k, state.v):
        for a in cache.values():
            a[:depth] = rng.standard_normal(a[:depth].shape, dtype=np.float32)
    for cache in (state.conv, state.ssm):
        for a in cache.values():
            a[...] = 0.1 * rng.standard_normal(a.shape, dtype=np.float32)
    state.pos = depth
    return state


def measure(model, threads: int, isa: str, n_prompt: int, n_gen: int, depths: Sequence[int] = (),
            depth_gen: int = 16, round_: int = 0, seed: int = 0) -> Sample:
    """One DeltaDesk sample with this thread count and ISA level (see the module doc, step 4)."""
    cpu.set_threads(threads)
    cpu.set_isa(isa)
    hp = model.hp
    rng = np.random.default_rng([seed, round_])
    tokens = rng.integers(0, hp.n_vocab, n_prompt + n_gen + 4)
    model.forward(tokens[:4], SequenceState.new(hp, 8))
    state = SequenceState.new(hp, n_prompt + n_gen + 1)
    t0 = time.perf_counter()
    if n_prompt:
        model.forward(tokens[:n_prompt], state)
    pp = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in tokens[n_prompt:n_prompt + n_gen]:
        model.forward(np.array([t]), state)
    tg = (time.perf_counter() - t0) / n_gen
    depth_tg = {}
    for depth in depths:
        state = fill_context(hp, depth, depth + depth_gen + 1, rng)
        ids = rng.integers(0, hp.n_vocab, depth_gen)
        t0 = time.perf_counter()
        for t in ids:
            model.forward(np.array([t]), state)
        depth_tg[depth] = depth_gen / (time.perf_counter() - t0)
    h = rng.standard_normal((1, hp.n_embd)).astype(np.float32)
    head = cpu.best_seconds(lambda: model.linear(ops.rmsnorm(h, model.w("output_norm.weight"), hp.rms_eps),
                                                 model.output_name))
    return Sample("deltadesk", isa, threads, round_, n_prompt / pp if n_prompt else math.nan, 1 / tg, depth_tg,
                  head * 1e3, (tg - head) * 1e3 / hp.n_layer)


def peer_sample(peer: cpu_llama.Peer, path: Path, threads: int, n_prompt: int, n_gen: int, depths: Sequence[int],
                depth_gen: int, round_: int) -> tuple[Sample, int, str]:
    """One peer's sample (see the module doc, step 4); returns it, the peak RSS of its runs (bytes) and its build.

    Raises:
        RuntimeError: llama-bench failed or printed something else than its JSON.
    """
    def bench(n_p: int, n_g: int, at: Sequence[int]) -> tuple[list[cpu_llama.PeerResult], int]:
        return cpu_llama.run_llama_bench(cpu_llama.bench_command(peer.binary, path, threads, n_p, n_g, at,
                                                                 flags=peer.flags))

    results, peak = bench(n_prompt, n_gen, (0,))
    if depths:
        deep, peak_d = bench(0, depth_gen, depths)
        results, peak = results + deep, max(peak, peak_d)

    def rate(n_p: int, n_g: int, depth: int) -> float:
        found = [r for r in results if (r.n_prompt, r.n_gen, r.n_depth) == (n_p, n_g, depth)]
        if not found:
            raise RuntimeError(f"{peer.name}'s llama-bench printed no test pp{n_p} tg{n_g} at depth {depth} "
                               "(a build without -d / --n-depth?)")
        return statistics.median(found[0].samples_ts)

    sample = Sample(peer.name, "", threads, round_, rate(n_prompt, 0, 0) if n_prompt else math.nan,
                    rate(0, n_gen, 0), {d: rate(0, depth_gen, d) for d in depths})
    return sample, peak, results[0].build


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _open(path: Path, weights: str, out: Out) -> LoadedText:
    """Open ``path`` with the weights mode ``weights`` ("auto" as a CPU-only load picks it); "map" first reads the
    file into the page cache (:func:`warm_page_cache`), "ram" reads it into memory. Prints the time taken."""
    mode = weights_mode(EngineOptions(device="cpu", weights=weights), path)
    t0 = time.perf_counter()
    if mode == "map":
        size, seconds = warm_page_cache(path)
        out(f"warm-up: read {path.name} ({size / 2**30:.2f} GiB) into the page cache in {seconds:.1f} s")
    text = open_text(path, mode)
    if mode == "ram":
        hp = huge_pages()
        out(f"weights ram: read {path.name} ({path.stat().st_size / 2**30:.2f} GiB) into memory in "
            f"{time.perf_counter() - t0:.1f} s" + ("" if hp is None else f"; {_mib(hp)} in 2 MiB pages"))
    return text


def _load(path: Path, out: Out, weights: str = "auto") -> tuple[LoadedText, Any, float]:
    """The run's preamble, printed: host, the file read (page-cache warm-up or into memory, :func:`_open`), the
    native model's load with RSS before/after, the model's description.
    Returns (text, model, weight bytes read per layer and token)."""
    out(f"host: {cpu.physical_cores()} physical cores, NUMA nodes: {numa.node_count()}")
    before = memory()
    text = _open(path, weights, out)
    gguf, hp = text.file, text.hparams
    model = text.arch.native_model(hp, gguf)
    placed = interleave_experts(gguf)
    after = memory()
    out(f"RSS after load: {_mib(after['rss'])} = anonymous {_mib(after['anon'])} + file-backed {_mib(after['file'])} "
        f"(load added {_mib(after['anon'] - before['anon'])} anonymous, {_mib(after['file'] - before['file'])} "
        f"file-backed; file {_mib(path.stat().st_size)})"
        + (f"; {_mib(placed)} of expert pages interleaved" if placed else ""))
    per_token = text.bytes_per_token()
    head_bytes = gguf.info(model.output_name).nbytes
    layer_bytes = (per_token - head_bytes - (gguf.info("token_embd.weight").nbytes // hp.n_vocab
                                            if model.output_name == "output.weight" else 0)) / hp.n_layer
    out(f"model {path.name}: {hp.arch}, {hp.n_layer} layers, d={hp.n_embd}, vocab {hp.n_vocab}"
        + (f", {hp.n_expert} experts top-{hp.n_expert_used}, expert FFN {hp.n_ff_exp}" if hp.is_moe else ""))
    out(f"weights {', '.join(f'{k}: {n} tensors {b / 2**20:.0f} MiB' for k, (n, b) in model.weight_rules.items())}")
    return text, model, layer_bytes


def run(path: str | Path, threads: Sequence[int], isas: Sequence[str], n_prompt: int, n_gen: int,  # noqa: PLR0913
        depths: Sequence[int], depth_gen: int, repeat: int, peers: Sequence[cpu_llama.Peer], stream_gib: float,
        stream_runs: int, out: Out = print, weights: str = "auto") -> list[Sample]:
    """Measure and print (see the module doc); returns every sample. ``peers`` empty: DeltaDesk only.
    ``weights``: the load's weights mode (:attr:`engine.api.EngineOptions.weights`, as on a CPU-only load).
    The CLI's defaults: ``engine.__main__.BENCH_DEFAULTS``.

    Raises:
        EngineError: the file cannot be opened or its architecture has no native model.
    """
    path = Path(path)
    text, model, layer_bytes = _load(path, out, weights)
    hp = text.hparams
    per_token = text.bytes_per_token()
    head_bytes = text.file.info(model.output_name).nbytes
    out(f"bytes read per decoded token {per_token / 2**20:.1f} MiB = LM head {head_bytes / 2**20:.1f} MiB "
        f"+ {hp.n_layer} x {layer_bytes / 2**20:.2f} MiB per layer; pp{n_prompt}, tg{n_gen}, "
        f"tg{depth_gen} at depths {', '.join(map(str, depths)) or 'none'}; {repeat} round(s)")
    deep = "".join(f" {f'@{d}':>8}" for d in depths)
    out(f"{'round':>5} {'engine':<12} {'isa':>10} {'thr':>3} {'pp tok/s':>9} {'tg tok/s':>9}{deep} "
        f"{'head ms':>8} {'layer ms':>8} {'layer GB/s':>10}")
    samples: list[Sample] = []
    peer_rss: dict[str, int] = {}
    peer_build: dict[str, str] = {}
    peer_ran = False
    try:
        for r in range(repeat):
            for n in threads:
                if peer_ran and not text.file.resident:
                    peer_ran = False
                    _, seconds = warm_page_cache(path)
                    out(f"{r + 1:>5} re-read {path.name} into page cache in {seconds:.1f} s "
                        "(the peer ran since the last read)")
                bandwidth = stream_bandwidth(n, int(stream_gib * 2**30), stream_runs)
                stream = statistics.median(bandwidth)
                out(f"{r + 1:>5} stream read, {n} thread(s), {stream_gib:g} GiB buffer, {stream_runs} runs: "
                    f"{spread(bandwidth, '.1f')} GB/s")
                for level in isas:
                    s = replace(measure(model, n, level, n_prompt, n_gen, depths, depth_gen, r), stream_gb_s=stream)
                    samples.append(s)
                    pp = spread([s.pp_tok_s], '.1f')
                    out(f"{r + 1:>5} {s.engine:<12} {level:>10} {n:>3} {pp:>9} {s.tg_tok_s:>9.2f}"
                        + "".join(f" {s.depth_tg[d]:>8.2f}" for d in depths)
                        + f" {s.head_ms:>8.2f} {s.layer_ms:>8.2f} {layer_bytes / (s.layer_ms / 1e3) / 1e9:>10.1f}")
                for peer in peers:
                    peer_ran = True
                    try:
                        s, rss, build = peer_sample(peer, path, n, n_prompt, n_gen, depths, depth_gen, r)
                    except RuntimeError as exc:
                        out(f"{peer.name}, {n} threads: {exc}")
                        continue
                    peer_rss[peer.name] = max(peer_rss.get(peer.name, 0), rss)
                    peer_build[peer.name] = build
                    s = replace(s, stream_gb_s=stream)
                    samples.append(s)
                    out(f"{r + 1:>5} {s.engine:<12} {'':>10} {n:>3} {spread([s.pp_tok_s], '.1f'):>9} "
                        f"{s.tg_tok_s:>9.2f}" + "".join(f" {s.depth_tg[d]:>8.2f}" for d in depths))
    finally:
        cpu.set_isa(None)
        cpu.set_threads()
    end = memory()
    out(f"RSS after the runs: {_mib(end['rss'])} = anonymous {_mib(end['anon'])} + file-backed {_mib(end['file'])}"
        + "".join(f"; {name} peak RSS {_mib(rss)} (build {peer_build[name]})" for name, rss in peer_rss.items()))
    summarize(samples, per_token, depths, out)
    return samples


def summarize(samples: Sequence[Sample], per_token: int, depths: Sequence[int], out: Out = print) -> None:
    """Print the summary table (see the module doc, step 5): per engine, then DeltaDesk's ratio to each peer and
    to the best peer of each round (the fastest peer per figure, taken round by round)."""
    out("summary: median (min-max) over rounds; roofline = bytes/token x tg / the round's stream read; "
        "ratio = DeltaDesk / peer, round by round")
    keys = list(dict.fromkeys((s.engine, s.isa, s.threads) for s in samples))
    names = list(dict.fromkeys(s.engine for s in samples if s.engine != "deltadesk"))
    for engine, isa, n in keys:
        group = [s for s in samples if (s.engine, s.isa, s.threads) == (engine, isa, n)]
        roof = [per_token * s.tg_tok_s / 1e9 / s.stream_gb_s for s in group]
        line = (f"{engine:<12} {isa or 'its own':>10} {n:>2} thr: pp {spread([s.pp_tok_s for s in group], '.1f')}, "
                f"tg {spread([s.tg_tok_s for s in group])}"
                + "".join(f", tg@{d} {spread([s.depth_tg[d] for s in group])}" for d in depths)
                + f" tok/s; roofline {spread([100 * x for x in roof], '.0f')} % of "
                f"{spread([s.stream_gb_s for s in group], '.1f')} GB/s")
        if engine == "deltadesk":
            for name in names:
                line += _ratios(group, [s for s in samples if s.engine == name and s.threads == n], name, depths)
            if len(names) > 1:
                line += _ratios(group, _best_per_round([s for s in samples if s.engine in names and s.threads == n],
                                                       depths), "best peer", depths)
        out(line)


def _best_per_round(peers: Sequence[Sample], depths: Sequence[int]) -> list[Sample]:
    """Per round, a sample holding each figure's best value over ``peers`` of that round."""
    best = []
    for r in sorted({s.round for s in peers}):
        group = [s for s in peers if s.round == r]
        best.append(Sample("best peer", "", group[0].threads, r, max(s.pp_tok_s for s in group),
                           max(s.tg_tok_s for s in group), {d: max(s.depth_tg[d] for s in group) for d in depths}))
    return best


def _ratios(ours: Sequence[Sample], theirs: Sequence[Sample], name: str, depths: Sequence[int]) -> str:
    """``; vs NAME: tg ..x, pp ..x, tg@d ..x`` over the rounds both ran, or "" when none."""
    by_round = {s.round: s for s in theirs}
    pairs = [(a, by_round[a.round]) for a in ours if a.round in by_round]
    if not pairs:
        return ""
    return (f"; vs {name}: tg {spread([a.tg_tok_s / b.tg_tok_s for a, b in pairs])}x"
            + f", pp {spread([a.pp_tok_s / b.pp_tok_s for a, b in pairs])}x"
            + "".join(f", tg@{d} {spread([a.depth_tg[d] / b.depth_tg[d] for a, b in pairs])}x" for d in depths))
