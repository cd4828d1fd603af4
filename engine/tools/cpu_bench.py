"""``python -m engine bench``: prompt and decode speed of the native CPU model, like llama-bench.

For each thread count and ISA level: prompt processing (one forward of ``n_prompt`` random tokens)
and decode (``n_gen`` one-token forwards after it) in tokens/s, and the bandwidth roofline: weight
bytes read per decoded token (``GGUFFile.bytes_per_token``) times decode tok/s, as a fraction of
the streaming-read bandwidth measured with the same thread count
(:func:`engine.kernels.cpu.read_bandwidth`). The LM head is also timed alone, so the table splits
a token into the LM head and the mean layer (a 248k-token vocabulary makes the head a large share
of small slices). With ``llama_python`` set, llama.cpp runs on the same file and thread count
through llama-cpp-python (:mod:`engine.tools.cpu_llama`, in that interpreter).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from engine.arch.qwen35.cpu import NativeQwen35Model
from engine.gguf_file import GGUFFile
from engine.kernels import cpu
from engine.ops import reference as ops
from engine.state import SequenceState


@dataclass(frozen=True)
class BenchRow:
    """One measurement. Rates in tokens/s, bandwidths in GB/s (1e9 B/s), times in ms."""

    engine: str            # "deltadesk" or "llama.cpp"
    isa: str
    threads: int
    pp_tok_s: float
    tg_tok_s: float
    stream_gb_s: float = 0.0
    head_ms: float = 0.0   # LM head (output norm + product) of one token
    layer_ms: float = 0.0  # mean time of one layer of one decoded token


def measure(model: NativeQwen35Model, threads: int, isa: str, n_prompt: int, n_gen: int,
            stream_gb_s: float, seed: int = 0) -> BenchRow:
    """One DeltaDesk row: prompt and decode speed with this thread count and ISA level."""
    cpu.set_threads(threads)
    cpu.set_isa(isa)
    hp = model.hp
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, hp.n_vocab, n_prompt + n_gen + 4)
    model.forward(tokens[:4], SequenceState.new(hp, 8))
    state = SequenceState.new(hp, n_prompt + n_gen + 1)
    t0 = time.perf_counter()
    model.forward(tokens[:n_prompt], state)
    pp = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in tokens[n_prompt:n_prompt + n_gen]:
        model.forward(np.array([t]), state)
    tg = (time.perf_counter() - t0) / n_gen
    h = rng.standard_normal((1, hp.n_embd)).astype(np.float32)
    head = cpu.best_seconds(lambda: model.linear(ops.rmsnorm(h, model.w("output_norm.weight"), hp.rms_eps),
                                      model.output_name))
    return BenchRow("deltadesk", isa, threads, n_prompt / pp, 1 / tg, stream_gb_s, head * 1e3,
                    (tg - head) * 1e3 / hp.n_layer)


LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
                    "-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF "
                    "-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF")
"""CMake options (llama-cpp-python 0.3.36) for a portable x86-64 build: a ``-march=native`` build dies with
"Illegal instruction" in ggml's AMX code on the first Q4_0 product on CPUs that report AMX (seen on this
project's 2-core machines), so native detection and AMX are off and AVX2 / AVX-512 (VNNI, BF16) are named."""


def llama_venv(folder: Path, out=print) -> str:
    """The interpreter of a venv in ``folder`` holding llama-cpp-python, built there on first use.

    The build compiles llama.cpp from source with :data:`LLAMA_CMAKE_ARGS` (about 5-15 minutes on
    2 cores). Returns the venv's python path.

    Raises:
        RuntimeError: venv creation or the pip build failed (with pip's last lines).
    """
    python = folder / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True) if python.exists() else None
    if probe is not None and probe.returncode == 0:
        return str(python)
    out(f"building llama-cpp-python {LLAMA_CPP_VERSION} into {folder} (compiles llama.cpp: 5-15 minutes)")
    steps = [[sys.executable, "-m", "venv", str(folder)],
             [str(python), "-m", "pip", "install", "-q", f"llama-cpp-python=={LLAMA_CPP_VERSION}"]]
    env = dict(os.environ, CMAKE_ARGS=LLAMA_CMAKE_ARGS)
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:4])} failed: {done.stderr.strip().splitlines()[-3:]}")
    return str(python)


def llama_row(llama_python: str, path: Path, threads: int, n_prompt: int, n_gen: int) -> BenchRow:
    """llama.cpp's row, run by ``llama_python`` (an interpreter with llama-cpp-python).

    Raises RuntimeError with llama.cpp's message when it fails.
    """
    script = Path(__file__).with_name("cpu_llama.py")
    done = subprocess.run([llama_python, str(script), str(path), str(threads), str(n_prompt), str(n_gen)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp run failed: {done.stderr.strip().splitlines()[-1:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return BenchRow(f"llama.cpp {r['version']}", "its own", threads, r["pp_tok_s"], r["tg_tok_s"])


def run(path: str | Path, threads: Sequence[int], isas: Sequence[str], n_prompt: int = 128, n_gen: int = 32,
        llama_python: str | None = None, out=print) -> list[BenchRow]:
    """Measure and print the table; returns its rows."""
    gguf = GGUFFile.open(path)
    hp = gguf.hparams
    model = NativeQwen35Model(hp, gguf)
    per_token = gguf.bytes_per_token()
    head_bytes = gguf.info(model.output_name).nbytes
    layer_bytes = (per_token - head_bytes - (gguf.info("token_embd.weight").nbytes // hp.n_vocab
                                            if model.output_name == "output.weight" else 0)) / hp.n_layer
    out(f"model {Path(path).name}: {hp.arch}, {hp.n_layer} layers, d={hp.n_embd}, vocab {hp.n_vocab}"
        + (f", {hp.n_expert} experts top-{hp.n_expert_used}, expert FFN {hp.n_ff_exp}" if hp.is_moe else ""))
    out(f"weights {', '.join(f'{k}: {n} tensors {b / 2**20:.0f} MiB' for k, (n, b) in model.weight_rules.items())}")
    out(f"bytes read per decoded token {per_token / 2**20:.1f} MiB = LM head {head_bytes / 2**20:.1f} MiB "
        f"+ {hp.n_layer} x {layer_bytes / 2**20:.2f} MiB per layer; prompt {n_prompt}, decode {n_gen} tokens")
    out(f"{'engine':<22} {'isa':>10} {'thr':>3} {'pp tok/s':>9} {'tg tok/s':>9} {'stream':>7} {'roofline':>8} "
        f"{'head ms':>8} {'layer ms':>8} {'layer GB/s':>10} {'layer %':>7}")
    rows = []
    for n in threads:
        cpu.set_threads(n)
        bw = cpu.read_bandwidth(1 << 30)
        for level in isas:
            r = measure(model, n, level, n_prompt, n_gen, bw)
            rows.append(r)
            layer_gb_s = layer_bytes / (r.layer_ms / 1e3) / 1e9
            out(f"{r.engine:<22} {level:>10} {n:>3} {r.pp_tok_s:>9.1f} {r.tg_tok_s:>9.2f} {bw:>7.1f} "
                f"{per_token * r.tg_tok_s / 1e9 / bw:>8.0%} {r.head_ms:>8.2f} {r.layer_ms:>8.2f} "
                f"{layer_gb_s:>10.1f} {layer_gb_s / bw:>7.0%}")
        if llama_python:
            best = max((r for r in rows if r.threads == n), key=lambda r: r.tg_tok_s)
            try:
                lr = llama_row(llama_python, Path(path), n, n_prompt, n_gen)
            except RuntimeError as exc:
                out(f"llama.cpp, {n} threads: {exc}")
                continue
            rows.append(lr)
            out(f"{lr.engine:<22} {lr.isa:>10} {n:>3} {lr.pp_tok_s:>9.1f} {lr.tg_tok_s:>9.2f} {bw:>7.1f} "
                f"{per_token * lr.tg_tok_s / 1e9 / bw:>8.0%}   ours/llama.cpp: decode "
                f"{best.tg_tok_s / lr.tg_tok_s:.2f}x, prompt {best.pp_tok_s / lr.pp_tok_s:.2f}x ({best.isa})")
    cpu.set_isa(None)
    cpu.set_threads()
    return rows
