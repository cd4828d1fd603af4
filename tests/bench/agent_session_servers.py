"""The servers of ``bench_agent_session.py``: start, probe and stop ``engine serve`` and ``llama-server``.

Each server runs in a session of its own (a terminal's Ctrl+C reaches only the bench, which then stops the
servers itself: SIGINT, so ours writes its RAM snapshots to the disk tier) and is sent SIGTERM by the kernel
if the bench dies without stopping it (``PR_SET_PDEATHSIG``), so a cut-short run leaves no server behind.
A server that exits or fails a request raises :class:`ServerFailed` naming it, its exit code and its log.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

MIB = 1 << 20
_PR_SET_PDEATHSIG = 1
OURS_WORK_MIB = 1024
"""Ours' memory beyond its KV cache and prefix-cache budget (runtime, prefill buffers), rounded up from the
8-layer slice's 52k-token session (anonymous RSS 2.8 GiB at a 2 GiB budget and 256 MiB of KV)."""
PEER_WORK_MIB = 3072
"""llama-server's memory beyond its KV cache and checkpoints (compute buffers), rounded up from the same
session (peak RSS 7.9 GiB against 5.2 GiB after the first request)."""
PEER_CHECKPOINTS = 32
_CHECKPOINT = re.compile(r"id +(\d+) \| task -?\d+ \| (created|erasing old|erasing|erased invalidated|superseding) "
                         r"context checkpoint.*?n_tokens = (\d+)(?:.*?size = ([\d.]+) MiB)?")
_SUPERSEDE = re.compile(r"id +(\d+) \| task -?\d+ \| superseding context checkpoint at n_tokens = (\d+)")
_PROMPT_CACHE = re.compile(r"cache state: (\d+) prompts, ([\d.]+) MiB")


class ServerFailed(RuntimeError):
    """A server under test exited, or answered a request with an error; the message names it and its log."""


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> tuple[float, float]:
    """(resident, peak resident) MiB of process ``pid`` (``/proc/PID/status`` VmRSS, VmHWM)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) / 1024
    return round(fields["VmRSS"], 1), round(fields["VmHWM"], 1)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of all threads of process ``pid`` so far (``/proc/PID/stat``, proc(5))."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def files_mib(folder: Path, suffix: str) -> float:
    """MiB of the files named ``*suffix`` under ``folder``."""
    return round(sum(p.stat().st_size for p in folder.rglob(f"*{suffix}") if p.is_file()) / MIB, 1)


def memory_need_mib(model: str, context: int, threads: int) -> dict[str, int]:
    """MiB that ``engine serve`` and ``llama-server`` need at once on ``model`` at ``context`` tokens: the
    mapped file once (both map it, the page cache holds it once), each one's F16 KV cache of the context, ours'
    prefix-cache budget, llama-server's :data:`PEER_CHECKPOINTS` recurrent-state checkpoints, plus each one's
    working memory (:data:`OURS_WORK_MIB`, :data:`PEER_WORK_MIB`). Raises SystemExit when ours would not run
    ``threads`` threads (it uses the physical cores), so the two would not be measured alike."""
    from engine.api_types import EngineOptions
    from engine.kernels.cpu import physical_cores
    from engine.registry import open_text
    from engine.turn.state import state_nbytes

    if physical_cores() != threads:
        raise SystemExit(f"engine serve uses the {physical_cores()} physical cores of this machine, not --threads "
                         f"{threads}: pass --threads {physical_cores()} so both servers run as many threads")
    layout = open_text(model).hparams.state_layout()
    kv = (state_nbytes(layout, context, "f16") - state_nbytes(layout, 0, "f16")) // MIB
    recurrent = state_nbytes(layout, 0, "f32") // MIB + 1
    return {"model file": Path(model).stat().st_size // MIB,
            "engine serve": kv + EngineOptions().cache_ram_bytes // MIB + OURS_WORK_MIB,
            "llama-server": kv + PEER_CHECKPOINTS * recurrent + PEER_WORK_MIB}


def check_memory(model: str, context: int, threads: int, available: int | None = None) -> None:
    """Refuse (SystemExit with the figures) to start both servers at once when :func:`memory_need_mib` exceeds
    ``available`` MiB (None: the memory available now, ``MemAvailable`` of ``/proc/meminfo``)."""
    need = memory_need_mib(model, context, threads)
    if available is None:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(meminfo["MemAvailable"].split()[0]) // 1024
    if sum(need.values()) > available:
        parts = ", ".join(f"{name} {mib:,}" for name, mib in need.items())
        raise SystemExit(f"both servers at once need about {sum(need.values()):,} MiB ({parts}) but "
                         f"{available:,} MiB is available: free memory, lower --context, or run them one after "
                         f"the other with --sequential")


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends SIGTERM when the bench that started it dies, and SIGINT
    stops it even when the bench was started with SIGINT ignored (``cmd &`` in a script)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Server:
    """One server under test: how to start it, and what it reports after each request."""

    name: str
    command: list[str]
    port: int
    log: Path
    cache_dir: Path | None = None
    proc: subprocess.Popen | None = None
    _scraped: dict = field(default_factory=dict)
    _log_at: int = 0
    _checkpoints: dict = field(default_factory=dict)
    _prompt_cache: tuple[int, float] = (0, 0.0)
    _cpu_at: float = 0.0
    _idle_from: float = 0.0

    def launch(self) -> None:
        """Start the server (in a session of its own, its output appended to ``log``); see :meth:`wait_ready`."""
        self._log_at = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent, env={**os.environ, "PYTHONPATH": os.getcwd()})

    def wait_ready(self, timeout: float = 600) -> None:
        """Return once ``/health`` answers 200; ServerFailed when the server exits or ``timeout`` s pass first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive("while loading")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    if self.cache_dir is not None:
                        self._scrape()
                    self._idle_from = cpu_seconds(self.proc.pid)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerFailed(f"{self.name} did not answer /health within {timeout:.0f} s; see {self.log}")

    def check_alive(self, when: str) -> None:
        """ServerFailed naming the server, its exit code and its log's last lines if it has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log.read_bytes()[-2000:].decode(errors="replace").strip().splitlines()[-8:]
            code = self.proc.returncode
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise ServerFailed(f"{self.name} (pid {self.proc.pid}) {how} {when}; its log {self.log} ends:\n    "
                               + "\n    ".join(tail))

    def complete(self, client: openai.OpenAI, when: str, **request):
        """``client.chat.completions.create(**request)``; ServerFailed naming the server if it fails."""
        self.check_alive(f"before {when}")
        try:
            self._cpu_at = cpu_seconds(self.proc.pid)
            return client.chat.completions.create(**request)
        except openai.APIError as exc:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=2)
            self.check_alive(f"during {when}")
            raise ServerFailed(f"{self.name} failed {when}: {exc}; see {self.log}") from exc

    def stop(self, timeout: float = 300) -> None:
        """Stop the server as Ctrl+C does (SIGINT: ours then writes its RAM snapshots to the disk tier) and wait
        ``timeout`` s at most, then kill it; a Ctrl+C meanwhile kills it at once (and is raised again)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        except KeyboardInterrupt:
            self.proc.kill()
            self.proc.wait()
            raise

    def probe(self, reply) -> dict:
        """What the server holds after a request, the parts of that request's TTFT it reports, the CPU seconds
        it took (all threads) and those it took since its previous request (``idle_cpu_s``: ~0 when idle)."""
        rss, peak = rss_mib(self.proc.pid)
        row = {"cpu_s": round(cpu_seconds(self.proc.pid) - self._cpu_at, 2),
               "idle_cpu_s": round(self._cpu_at - self._idle_from, 2), "rss_mib": rss, "peak_rss_mib": peak}
        row.update(self._ours() if self.cache_dir is not None else self._peer(reply))
        self._idle_from = cpu_seconds(self.proc.pid)
        return row

    def _scrape(self) -> tuple[dict, dict]:
        """(samples now, samples at the last scrape) of ours' ``/metrics``."""
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=30).text
        now = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
        before, self._scraped = self._scraped, now
        return now, before

    def _ours(self) -> dict:
        now, before = self._scrape()

        def grew(name: str) -> float:
            return round((now.get((name, ()), 0.0) - before.get((name, ()), 0.0)) * 1e3, 1)

        return {"cache_ram_mib": round(now[("deltadesk_prefix_cache_ram_bytes", ())] / MIB, 1),
                "snapshots_ram": int(now[("deltadesk_prefix_cache_snapshots", (("tier", "ram"),))]),
                "snapshots_disk": int(now[("deltadesk_prefix_cache_snapshots", (("tier", "disk"),))]),
                "disk_snap_mib": files_mib(self.cache_dir, ".snap"),
                "disk_page_mib": files_mib(self.cache_dir, ".page"),
                "restore_ms": grew("deltadesk_snapshot_restore_seconds_total"),
                "prefill_ms": grew("deltadesk_prefill_seconds_total")}

    def _peer(self, reply) -> dict:
        """llama-server's checkpoints and prompt cache, from the log lines written since the last request."""
        with self.log.open("rb") as f:
            f.seek(self._log_at)
            new = f.read()
            self._log_at += len(new)
        for line in new.decode(errors="replace").splitlines():
            self._read_line(line)
        timings = (reply.model_extra or {}).get("timings") or {}
        return {"checkpoints": len(self._checkpoints),
                "checkpoint_mib": round(sum(self._checkpoints.values()), 1),
                "prompt_cache_entries": self._prompt_cache[0], "prompt_cache_mib": self._prompt_cache[1],
                "prompt_ms": round(timings.get("prompt_ms", 0.0), 1)}

    def _read_line(self, line: str) -> None:
        if m := _SUPERSEDE.search(line):
            self._checkpoints.pop((m[1], int(m[2])), None)
        elif m := _CHECKPOINT.search(line):
            key = (m[1], int(m[3]))
            if m[2] == "created":
                self._checkpoints[key] = float(m[4])
            else:
                self._checkpoints.pop(key, None)
        elif m := _PROMPT_CACHE.search(line):
            self._prompt_cache = (int(m[1]), float(m[2]))
