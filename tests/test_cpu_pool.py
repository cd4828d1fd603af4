"""The kernels' thread pool (native/cpu/runtime/pool.c): every chunk of a job runs exactly once, whatever the
thread count, and a chunk's result does not depend on which thread ran it.

The pool cuts a job into one contiguous home range of chunks per thread and lets a thread that has
finished its own range claim chunks from the others' ranges; these tests use more threads than this
machine has cores (so threads are preempted mid-job and ranges are taken over by others), thread counts
that do not divide the chunk count, and jobs with fewer chunks than threads (empty home ranges). The stream
read that runs on the pool (dd_stream_read, read_bandwidth's probe) is checked here too.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from test_cpu_kernels import random_weights, rng  # noqa: F401 (fixture)
from test_cpu_kquants import random_kquant

from engine.kernels import cpu

THREADS = (1, 2, 3, 4, 7)


@pytest.fixture(autouse=True)
def default_threads():
    yield
    cpu.set_threads()


@pytest.mark.parametrize("runs", [*cpu.READ_RUNS, 3, 0, 99])
def test_stream_read_sums_every_word_once(runs, rng):
    """dd_stream_read adds every 64-bit word of the buffer once (chunks of 2^17 words read as `runs`
    interleaved runs of a multiple of 8 words, then the words after the runs), so its wrapping sum equals
    numpy's for any thread count, run count (the patterns read_bandwidth tries, an odd one, and counts
    outside 1..8, clamped) and length: a chunk, run or tail word read twice or skipped would show. The
    lengths give a ragged last chunk whose runs have a tail (4099), one too short for any run (63) and whole
    chunks only."""
    ffi, lib = cpu._native_cpu.ffi, cpu._native_cpu.lib
    for size in ((5 << 17) + 4099, 63, 3 << 17):
        words = rng.integers(1, 2**63, size=size, dtype=np.uint64)
        want = int(np.sum(words, dtype=np.uint64))
        ptr = ffi.cast("uint8_t *", words.ctypes.data)
        for n in THREADS:
            cpu.set_threads(n)
            assert lib.dd_stream_read(ptr, words.nbytes, runs) == want, (size, n)


@pytest.mark.parametrize("rows", [3, 61, 1001])
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q6_K])
def test_gemv_same_bits_for_any_thread_count(rows, qtype, rng):
    """One column (decode's GEMV) and three (a GEMM), odd row counts from fewer chunks than threads
    (3 and 61 rows) to ~40 chunks (1001 rows of Q4_0): every thread count gives the 1-thread bits."""
    k = 2048
    make = random_kquant if qtype == GGMLQuantizationType.Q6_K else random_weights
    raw = make(rng, rows, k, qtype)
    x = rng.standard_normal((3, k)).astype(np.float32)
    mat = cpu.Matrix(raw, k, qtype)
    cpu.set_threads(1)
    want_vec, want_mat = mat(x[1:2]), mat(x)
    assert np.all(want_vec != 0)
    for n in THREADS[1:]:
        cpu.set_threads(n)
        for _ in range(3):
            assert np.array_equal(mat(x[1:2]), want_vec), n
            assert np.array_equal(mat(x), want_mat), n


def _huge_bytes_in(address: int, size: int) -> int:
    """AnonHugePages (bytes) of the mappings of /proc/self/smaps that overlap [address, address + size)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo < address + size and address < hi
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) << 10
    return total


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")
def test_read_bandwidth_buffer_in_small_pages(monkeypatch):
    """The probe's buffer takes no 2 MiB pages while it is read (where the OS would give them to a madvised
    buffer, numpy's default) and is unmapped after the call."""
    from engine.tools.cpu_bench import memory
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        thp = "[never]"
    if "[never]" in thp or not os.path.exists("/proc/self/smaps"):
        pytest.skip("no transparent huge pages (or no /proc/self/smaps) here: nothing to tell the pages apart")
    ffi, seen = cpu._native_cpu.ffi, []
    timed = cpu.best_seconds

    def watch(fn, repeats):
        seen.append(_huge_bytes_in(int(ffi.cast("uintptr_t", fn.args[0])), fn.args[1]))
        return timed(fn, repeats)

    monkeypatch.setattr(cpu, "best_seconds", watch)
    rss = memory()["rss"]
    assert cpu.read_bandwidth(64 << 20, repeats=1) > 0
    assert seen and seen == [0] * len(seen)
    assert memory()["rss"] - rss < 32 << 20
