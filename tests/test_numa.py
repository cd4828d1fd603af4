"""NUMA placement of the expert pages (engine.kernels.numa): the decision with a faked node count and a recording
``syscall`` (this machine has one node), the real calls without a crash, and which tensors the loader hands over."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from engine.kernels import numa


def test_node_count(tmp_path):
    for name in ("node0", "node1", "node12", "possible", "nodex"):
        (tmp_path / name).mkdir()
    assert numa.node_count(tmp_path) == 3
    assert numa.node_count(tmp_path / "absent") == 1


class Recorder:
    """A fake libc ``syscall``: records (number, args); ``fail`` = syscall numbers that return -1."""

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)

    def __call__(self, number, *args):
        self.calls.append((number, args))
        return -1 if number in self.fail else 0


def test_interleave_is_a_no_op_on_one_node():
    rec = Recorder()
    assert numa.interleave([np.ones(10000, np.uint8)], nodes=1, syscall=rec, machine="x86_64") == 0
    assert rec.calls == []


def test_interleave_binds_each_region_on_two_nodes():
    rec = Recorder()
    regions = [np.arange(3 * 4096 + 100, dtype=np.uint8)[100:], np.ones((5, 333), np.float32)]
    assert numa.interleave(regions, nodes=2, syscall=rec, machine="x86_64") == sum(r.nbytes for r in regions)
    numbers = numa.SYSCALLS["x86_64"]
    assert [c[0] for c in rec.calls] == [numbers["set_mempolicy"], numbers["mbind"], numbers["mbind"],
                                         numbers["set_mempolicy"]]
    assert rec.calls[0][1][0] == numa.MPOL_INTERLEAVE and rec.calls[-1][1][0] == numa.MPOL_DEFAULT
    for (_, (addr, length, mode, mask, maxnode, flags)), a in zip(rec.calls[1:3], regions):
        assert addr.value % 4096 == 0 and addr.value <= a.ctypes.data
        assert addr.value + length.value == a.ctypes.data + a.nbytes
        assert (mode, list(mask), maxnode.value, flags) == (numa.MPOL_INTERLEAVE, [0b11], 65, numa.MPOL_MF_MOVE)


def test_interleave_survives_failing_calls():
    numbers = numa.SYSCALLS["x86_64"]
    rec = Recorder(fail={numbers["mbind"], numbers["set_mempolicy"]})
    assert numa.interleave([np.ones(4096, np.uint8)], nodes=4, syscall=rec, machine="x86_64") == 0
    assert rec.calls[-1][1][0] == numa.MPOL_DEFAULT                          # the policy is reset regardless
    assert numa.interleave([np.ones(4096, np.uint8)], nodes=4, syscall=rec, machine="sparc64") == 0


def test_interleave_calls_the_real_kernel_without_crashing():
    """The real syscalls on this host (ctypes argument types included), asked for 2 nodes: the kernel refuses
    (EINVAL, logged) or accepts the node it has; either way nothing is raised and the thread's policy is reset."""
    if sys.platform != "linux":
        pytest.skip("Linux syscalls")
    assert numa.interleave([np.ones(8192, np.uint8)], nodes=2) in (0, 8192)


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    from engine.testing.synth import synth
    path = tmp_path_factory.mktemp("numa") / "tiny.gguf"
    synth(path, "tiny", quant="q4_0", vocab=None)
    return path


def test_interleave_experts_picks_the_expert_tensors(tiny_q4, monkeypatch):
    from engine.gguf.file import GGUFFile
    from engine.placement import interleave_experts
    seen = []
    monkeypatch.setattr(numa, "interleave", lambda regions: seen.extend(regions) or 0)
    gguf = GGUFFile.open(tiny_q4)
    interleave_experts(gguf)
    expected = [n for n in gguf.tensor_names if "_exps." in n]
    assert expected and [a.nbytes for a in seen] == [gguf.raw(n).nbytes for n in expected]
