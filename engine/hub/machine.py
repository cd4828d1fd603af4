"""This machine for the fit estimate: total RAM and the stream-read bandwidth, measured once and cached.

The bandwidth is :func:`engine.kernels.cpu.read_bandwidth` (the figure ``engine bench`` calls the stream
read) with the physical cores' threads over a 512 MiB buffer, best of 3; it is kept in the user cache
dir (``hub-bandwidth.json``, keyed by the CPU and thread count) so the browser opens without re-measuring.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import platformdirs

from .fit import Machine

_BUFFER = 512 << 20


def _cache_file() -> Path:
    return Path(platformdirs.user_cache_dir("deltadesk")) / "hub-bandwidth.json"


def stream_bandwidth(cache: Path | None = None) -> float:
    """The stream-read bandwidth in GB/s: from the cache when it was measured on this CPU and thread count with
    today's read patterns (``cpu.READ_RUNS``: a figure of another probe is measured again), else measured now
    (about a second) and cached (an unwritable cache is skipped)."""
    from ..kernels import cpu
    cache = cache or _cache_file()
    threads = cpu.physical_cores()
    probe = "native runs " + ",".join(map(str, cpu.READ_RUNS)) if cpu.available() else "numpy"
    key = f"{platform.processor() or platform.machine()}|{threads}|{probe}"
    try:
        stored = json.loads(cache.read_text(encoding="utf-8"))
        if stored.get("key") == key and float(stored["gbps"]) > 0:
            return float(stored["gbps"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    cpu.set_threads(threads)
    gbps = cpu.read_bandwidth(_BUFFER, repeats=3)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "gbps": gbps}), encoding="utf-8")
    except OSError:
        pass
    return gbps


def this_machine(vram_budget: int | None = None) -> Machine:
    """This machine: total RAM (psutil), the cached stream bandwidth, and ``vram_budget`` (None: no GPU)."""
    import psutil
    return Machine(psutil.virtual_memory().total, stream_bandwidth(), vram_budget)
