"""Decode with the weights mapped vs read into memory, one mode per process (a script, not a test).

    python tests/bench/bench_weights_ab.py MODEL.gguf --weights map|ram|both [--threads 2] [--isa avx512vnni]
        [--prompt 16] [--gen 16] [--rounds 2] [--fill map|read|small|scattered] [--no-repack]

Evicts MODEL.gguf from the page cache first (``POSIX_FADV_DONTNEED``: pages another process maps stay), then
loads it. "map" fills the page cache (``--fill map``: through a map advised ``MADV_HUGEPAGE``, ``engine bench``'s
warm-up; ``--fill read``: with plain ``read()`` calls, as a copy or another program leaves it; ``--fill small``:
reads under ``POSIX_FADV_RANDOM``, which cache 4 KiB pages; ``--fill scattered``: the same while every other
4 KiB page of twice the file's size of anonymous memory is held, so the cache gets the holes, physically
scattered, as on a machine whose memory is fragmented) and opens it mapped;
"ram" reads it into anonymous memory (:mod:`engine.gguf.resident`). Prints one JSON line: the load seconds, the
page-cache (``Cached``) and RSS growth of the load, this process's ``AnonHugePages`` and ``FilePmdMapped``
(bytes in 2 MiB pages), and per round the decode tok/s and the process CPU seconds per token (all threads;
steadier than wall time on a shared machine), after an untimed warm-up round. Run the modes alternately and
compare CPU time per token where other load makes wall time noisy. "both" holds the file twice (read into
memory first, then the page cache filled and mapped) and alternates the two models round by round in one
process, printing each round's CPU time per token of both and their ratio (map / ram). ``--no-repack`` keeps
"ram"'s weights in their stored row-major layouts (no Q4_0, MXFP4, Q4_K or Q2_K repack: cpu.LAYOUTS;
docs/design/q4-0-row-interleave.md, q4-k-row-interleave.md: the layouts' A/B on the same memory).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time

import numpy as np

from engine.kernels import cpu
from engine.registry import open_text
from engine.tools.cpu_bench import memory, warm_page_cache
from engine.turn.state import SequenceState


def meminfo(key: str, path: str = "/proc/meminfo") -> int:
    """One ``key: N kB`` field of a /proc meminfo-style file, bytes (0 when absent)."""
    with open(path) as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) << 10
    return 0


def evict(path: str) -> None:
    """Drop the file's unmapped page-cache pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_through(path: str, small: bool = False, chunk: int = 1 << 20) -> None:
    """Fill the page cache with plain ``read()`` calls: the kernel picks the folio sizes, or (``small``, no
    readahead under ``POSIX_FADV_RANDOM``) 4 KiB pages."""
    with open(path, "rb", buffering=0) as fh:
        if small:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        while fh.read(chunk):
            pass


def decode_round(model, hp, n_prompt: int, n_gen: int, seed: int) -> tuple[float, float]:
    """Prefill ``n_prompt`` random tokens, then decode ``n_gen``: (tok/s, process CPU seconds per token)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, hp.n_vocab, n_prompt + n_gen)
    state = SequenceState.new(hp, n_prompt + n_gen + 1)
    model.forward(tokens[:n_prompt], state)
    c0, t0 = time.process_time(), time.perf_counter()
    for t in tokens[n_prompt:]:
        model.forward(np.array([t]), state)
    return n_gen / (time.perf_counter() - t0), (time.process_time() - c0) / n_gen


def fill(path: str, how: str) -> None:
    """Fill the page cache with the file as ``--fill`` says."""
    if how == "map":
        warm_page_cache(path)
    elif how == "scattered":
        holes = fragment(2 * os.path.getsize(path))
        read_through(path, small=True)
        holes.close()
    else:
        read_through(path, small=how == "small")


def fragment(nbytes: int) -> mmap.mmap:
    """``nbytes`` of anonymous memory in 4 KiB pages, every other page given back: free memory full of holes."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_NOHUGEPAGE)
    pages = np.frombuffer(region, dtype=np.uint8)
    pages[::mmap.PAGESIZE] = 1
    del pages
    for off in range(0, nbytes, 2 * mmap.PAGESIZE):
        region.madvise(mmap.MADV_DONTNEED, off, mmap.PAGESIZE)
    return region


def paired(args: argparse.Namespace) -> None:
    """``--weights both``: the two modes in one process, alternated round by round (see the module doc)."""
    evict(args.model)
    models = {}
    for weights in ("ram", "map"):
        if weights == "map":
            fill(args.model, args.fill)
        text = open_text(args.model, weights)
        models[weights] = (text.arch.native_model(text.hparams, text.file, repack=not args.no_repack), text.hparams)
        decode_round(*models[weights], args.prompt, 4, seed=99)
    cpu_ms: dict[str, list[float]] = {"ram": [], "map": []}
    for r in range(args.rounds):
        for weights in (("ram", "map") if r % 2 == 0 else ("map", "ram")):
            cpu_ms[weights].append(round(decode_round(*models[weights], args.prompt, args.gen, seed=r)[1] * 1e3, 1))
    smaps = "/proc/self/smaps_rollup"
    print(json.dumps({
        "file": os.path.basename(args.model), "weights": "both", "fill": args.fill, "threads": args.threads,
        "cpu_ms_per_tok": cpu_ms, "map_over_ram": [round(m / r, 3) for m, r in zip(cpu_ms["map"], cpu_ms["ram"])],
        "anon_huge_gib": round(meminfo("AnonHugePages", smaps) / 2**30, 2),
        "file_pmd_gib": round(meminfo("FilePmdMapped", smaps) / 2**30, 2), "loadavg": os.getloadavg()}))


def main() -> None:
    """Parse the arguments, measure, print the JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--weights", choices=["map", "ram", "both"], required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", default=None)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fill", choices=["map", "read", "small", "scattered"], default="map")
    ap.add_argument("--no-repack", action="store_true", help="ram: keep the stored row-major layouts (no repack)")
    args = ap.parse_args()
    cpu.set_threads(args.threads)
    cpu.set_isa(args.isa)
    if args.weights == "both":
        paired(args)
        return
    evict(args.model)
    cached0, rss0 = meminfo("Cached"), memory()["rss"]
    t0 = time.perf_counter()
    if args.weights == "map":
        fill(args.model, args.fill)
    text = open_text(args.model, args.weights)
    model = text.arch.native_model(text.hparams, text.file, repack=not args.no_repack)
    load_s = time.perf_counter() - t0
    cached1, rss1 = meminfo("Cached"), memory()["rss"]
    decode_round(model, text.hparams, args.prompt, 4, seed=99)
    rounds = [decode_round(model, text.hparams, args.prompt, args.gen, seed=r) for r in range(args.rounds)]
    smaps = "/proc/self/smaps_rollup"
    print(json.dumps({
        "file": os.path.basename(args.model), "weights": args.weights, "fill": args.fill, "threads": args.threads,
        "isa": args.isa,
        "load_s": round(load_s, 2), "file_gib": round(os.path.getsize(args.model) / 2**30, 2),
        "cached_growth_gib": round((cached1 - cached0) / 2**30, 2), "rss_growth_gib": round((rss1 - rss0) / 2**30, 2),
        "anon_huge_gib": round(meminfo("AnonHugePages", smaps) / 2**30, 2),
        "file_pmd_gib": round(meminfo("FilePmdMapped", smaps) / 2**30, 2),
        "tok_s": [round(r[0], 2) for r in rounds], "cpu_ms_per_tok": [round(r[1] * 1e3, 1) for r in rounds],
        "rules": sorted(model.weight_rules), "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main()
