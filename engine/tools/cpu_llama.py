"""The bench's peers: ``llama-bench`` of mainline llama.cpp and of ik_llama.cpp.

Mainline is built once from the llama.cpp vendored in llama-cpp-python :data:`LLAMA_CPP_PYTHON_VERSION`
into :func:`cache_dir`; ik_llama.cpp's binary is passed by the user (:func:`ik_llama_peers`).
:func:`bench_command`, :func:`parse_results`, :func:`run_llama_bench` run it and read its JSON.
Design: docs/design/engine-bench.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
                    "-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF "
                    "-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF")
"""CMake options (names as in llama-cpp-python 0.3.36's vendored llama.cpp) for a portable x86-64 build: a
``-march=native`` build dies with "Illegal instruction" in ggml's AMX code on the first Q4_0 product on
CPUs that report AMX (seen on this project's 2-core machines), so native detection and AMX are off and
AVX2 / AVX-512 (VNNI, BF16) are named."""

BUILD_ONLY_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF")
"""Added to :data:`LLAMA_CMAKE_ARGS` for the llama-bench build: an optimized build, without the tests and server."""

Out = Callable[[str], None]


def cache_dir() -> Path:
    """Where the peer is built: ``<user cache dir>/deltadesk/llama-bench-<version>``."""
    import platformdirs
    return Path(platformdirs.user_cache_dir("deltadesk")) / f"llama-bench-{LLAMA_CPP_PYTHON_VERSION}"


def source_dir(folder: Path) -> Path:
    """The vendored llama.cpp tree of the unpacked source package in ``folder``."""
    return folder / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"


def binary_path(folder: Path) -> Path:
    """The ``llama-bench`` a build in ``folder`` makes."""
    return source_dir(folder) / "build" / "bin" / "llama-bench"


def build_commands(source: Path, jobs: int, cmake: str = "cmake") -> list[list[str]]:
    """The configure and build command lines for ``source`` (a llama.cpp tree), building into ``source/build``."""
    build = source / "build"
    return [[cmake, "-S", str(source), "-B", str(build), *BUILD_ONLY_ARGS, *LLAMA_CMAKE_ARGS.split()],
            [cmake, "--build", str(build), "--target", "llama-bench", "-j", str(jobs)]]


def fetch_source(folder: Path, out: Out = print) -> Path:
    """Download the llama-cpp-python source package with pip and unpack it into ``folder``; returns :func:`source_dir`.

    Raises:
        RuntimeError: pip failed (its last lines), or the archive lacks the vendored llama.cpp.
    """
    folder.mkdir(parents=True, exist_ok=True)
    out(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} source package (pip download)")
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", tmp],
                              capture_output=True, text=True)
        archives = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise RuntimeError(f"pip download llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} failed: "
                               f"{(done.stderr or done.stdout).strip().splitlines()[-3:]}")
        with tarfile.open(archives[0]) as tar:
            tar.extractall(folder, filter="data")
    source = source_dir(folder)
    if not (source / "CMakeLists.txt").is_file():
        raise RuntimeError(f"{archives[0].name}: no vendored llama.cpp at {source.relative_to(folder)}")
    return source


def _run_with_progress(cmd: list[str], what: str, log_path: Path, out: Out) -> None:
    """Run ``cmd``, its output into ``log_path``; print cmake's ``[ NN%]`` progress as it changes.

    Raises:
        RuntimeError: non-zero exit, with the last lines of the log.
    """
    t0 = time.monotonic()
    last = None
    tail: list[str] = []
    with open(log_path, "a", encoding="utf-8") as log, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            tail = (tail + [line.rstrip()])[-8:]
            m = re.match(r"\[\s*(\d+)%\]", line)
            if m and m.group(1) != last:
                last = m.group(1)
                out(f"{what}: {last}% ({(time.monotonic() - t0) / 60:.1f} min)")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}; log {log_path}): "
                           + " | ".join(tail[-3:]))


def ensure_llama_bench(folder: Path | None = None, out: Out = print, jobs: int | None = None,
                       cmake: str = "cmake") -> Path:
    """The cached ``llama-bench`` in ``folder`` (default :func:`cache_dir`), built there on first use.

    Reuses the unpacked sources and an interrupted build. Returns the binary's path.

    Raises:
        RuntimeError: ``cmake`` is not on PATH, or download, configure or build failed (the build log is
            ``folder/build.log``).
    """
    folder = folder or cache_dir()
    binary = binary_path(folder)
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    if shutil.which(cmake) is None:
        raise RuntimeError(f"building it needs cmake and a C++ compiler, and {cmake!r} is not on PATH "
                           "(e.g. `sudo apt-get install cmake g++`); or pass --llama-bench PATH")
    source = source_dir(folder)
    if not (source / "CMakeLists.txt").is_file():
        source = fetch_source(folder, out)
    log_path = folder / "build.log"
    out(f"building llama-bench from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}'s vendored llama.cpp in {source} "
        f"(about 4 min on 2 idle cores, much longer on a busy machine; log {log_path})")
    configure, build = build_commands(source, jobs or os.cpu_count() or 2, cmake)
    _run_with_progress(configure, "configuring", log_path, out)
    _run_with_progress(build, "building llama-bench", log_path, out)
    if not binary.is_file():
        raise RuntimeError(f"the build finished but {binary} is missing (log {log_path})")
    return binary


@dataclass(frozen=True)
class PeerResult:
    """One llama-bench test: ``n_prompt`` tokens of prompt (pp) or ``n_gen`` decoded (tg) after ``n_depth``
    tokens of context, one rate per repetition (tokens/s)."""

    n_prompt: int
    n_gen: int
    n_depth: int
    n_threads: int
    samples_ts: tuple[float, ...]
    build: str           # "<commit> (build <n>)"
    model_size: int      # bytes of weights, as llama.cpp counts them


_FIELDS = {"n_prompt": int, "n_gen": int, "n_threads": int, "samples_ts": list, "build_commit": str,
           "build_number": int, "model_size": int}


def parse_results(text: str, source: str = "llama-bench") -> list[PeerResult]:
    """The tests of one ``llama-bench -o json`` output (a JSON array of objects).

    ``n_depth`` is 0 when absent (builds without ``-d``).

    Raises:
        ValueError: not JSON, not an array of objects, or a field missing or of the wrong type (named).
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: output is not JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(data, list):
        raise ValueError(f"{source}: expected a JSON array of tests, got {type(data).__name__}")
    results = []
    for i, test in enumerate(data):
        if not isinstance(test, dict):
            raise ValueError(f"{source}: test {i} is not an object")
        for key, kind in _FIELDS.items():
            if not isinstance(test.get(key), kind) or isinstance(test.get(key), bool):
                raise ValueError(f"{source}: test {i}: field {key!r} missing or not {kind.__name__}")
        samples = test["samples_ts"]
        if not samples or not all(isinstance(x, (int, float)) and x > 0 for x in samples):
            raise ValueError(f"{source}: test {i}: samples_ts must be positive numbers, got {samples!r}")
        results.append(PeerResult(test["n_prompt"], test["n_gen"], int(test.get("n_depth", 0)), test["n_threads"],
                                  tuple(float(x) for x in samples), f"{test['build_commit']} (build "
                                  f"{test['build_number']})", test["model_size"]))
    return results


@dataclass(frozen=True)
class Peer:
    """A ``llama-bench`` run as a peer: its label in the tables, the binary and the flags its users add.

    Mainline llama.cpp runs with its defaults; ik_llama.cpp twice, with its defaults and with ``-rtr 1``
    (run-time repack into its row-interleaved layouts), the two ways its users quote it.
    """

    name: str
    binary: Path
    flags: tuple[str, ...] = ()


def ik_llama_peers(binary: Path) -> list[Peer]:
    """ik_llama.cpp's ``llama-bench`` at ``binary`` as the two peers its users quote: default flags and ``-rtr 1``."""
    return [Peer("ik_llama", binary), Peer("ik_llama+rtr", binary, ("-rtr", "1"))]


def bench_command(binary: str | Path, model: str | Path, threads: int, n_prompt: int, n_gen: int,
                  depths: Sequence[int] = (0,), repetitions: int = 1, flags: Sequence[str] = ()) -> list[str]:
    """``llama-bench`` on ``model``: pp ``n_prompt`` (skipped at 0) and tg ``n_gen`` at each context depth,
    with the peer's own ``flags`` last. No ``-d`` when every depth is 0 (the default), so builds without
    that option (ik_llama.cpp's) run the depth-0 tests."""
    depth = ["-d", ",".join(str(d) for d in depths)] if any(depths) else []
    return [str(binary), "-m", str(model), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
            *depth, "-r", str(repetitions), "-o", "json", *flags]


def run_llama_bench(cmd: list[str]) -> tuple[list[PeerResult], int]:
    """Run a :func:`bench_command`; returns its tests and the process's peak RSS in bytes (``wait4``'s ru_maxrss).

    Raises:
        RuntimeError: llama-bench failed (its last stderr lines) or printed no valid JSON.
    """
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        text, err = stdout.read(), stderr.read()
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {proc.returncode}): {err.strip().splitlines()[-2:]}")
    try:
        return parse_results(text), usage.ru_maxrss * 1024
    except ValueError as exc:
        raise RuntimeError(f"{exc}; stderr: {err.strip().splitlines()[-2:]}") from None
