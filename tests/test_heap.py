"""engine.kernels.heap: a prefill-sized array comes from glibc's heap, not a mapping of its own, once set."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.arch.qwen35.cpu import NativeQwen35Model
from engine.kernels import heap
from engine.registry import open_text

# Run in a fresh interpreter: the setting is process-wide, and the first half checks glibc's default.
PROBE = r"""
import ctypes
import numpy as np
from engine.kernels import heap

class Info(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info

def mapped_growth():
    before = libc.mallinfo2().hblkhd
    a = np.ones(64 << 18, dtype=np.float32)   # 64 MiB, a 2048-token piece's query projection
    grown = libc.mallinfo2().hblkhd - before
    del a
    return grown

print(mapped_growth(), heap.keep_large_buffers(), mapped_growth())
"""


def test_large_buffers_come_from_the_heap():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    if "mallinfo2" in run.stderr:
        pytest.skip("not glibc >= 2.33")
    assert run.returncode == 0, run.stderr
    default, taken, kept = run.stdout.split()
    assert int(default) >= 64 << 20      # glibc's default maps the array by itself (the premise)
    assert taken == "True"
    assert int(kept) == 0                # after the setting: no new mapping, heap memory


def test_the_native_model_sets_it(synth_model, monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "keep_large_buffers", lambda: calls.append(1) or True)
    gguf = open_text(synth_model())
    NativeQwen35Model(gguf.hparams, gguf.file)
    assert calls == [1]
