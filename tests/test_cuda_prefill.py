"""GPU prefill (engine.arch.qwen35.cuda) against the numpy reference.

Three kinds of tests:

* planning tests (no GPU): placement under a budget, pass sizes, routing tables, the DeviceError
  a machine without pycuda gets;
* CudaPrefill's host side on an emulated device (no GPU; tests/cuda_fakes.py): numpy stand-ins for
  pycuda.driver and the kernels, against Qwen35Model on the CPU (resident, streamed, selective, several
  passes, continuation);
* GPU tests (skipped without pycuda and a CUDA device): every kernel against its numpy twin in
  engine.ops.reference, then whole prefills of synth models (dense and MoE; prompts of 1, 63, 64,
  65 and 1000 tokens; a budget that keeps everything resident and one that streams every expert
  layer) against Qwen35Model.forward on the CPU: last logits and the whole final state.

Tolerance: max |gpu - cpu| <= 2e-3 * max |cpu| for logits and every state array (float32 on both
sides; the GEMMs sum in another order than numpy's sgemm, the rest rounds at the same op boundaries,
so differences are ~1e-5 relative; a flipped top-k expert choice would show as ~1e-1).
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.arch.qwen35.cuda_plan import activation_bytes, kv_bytes, pass_tokens, plan_placement, state_bytes
from engine.testing.synth import preset_hparams
from engine.errors import DeviceError
from cuda_fakes import FakeDriver, FakeKernels
from engine.kernels.cuda_layout import TILE_ROWS, Matrix, gemm_matrix
from engine.kernels.moe_stream import copy_runs, route_tables, use_selective
from engine.registry import open_text
from gguf import GGMLQuantizationType as Q

TOL = 2e-3


def rel_err(got: np.ndarray, want: np.ndarray, label: str = "") -> float:
    """max |got - want| / max |want| (NaN anywhere -> inf); printed with ``label`` (run with -s to see them)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    scale = max(float(np.max(np.abs(want))), 1e-30)
    err = float(np.max(np.abs(got - want))) / scale
    if label:
        print(f"[max rel err] {label}: {err:.2e}")
    return err


# ---- planning (runs everywhere) -----------------------------------------------------------------

def _plan(budget: int, plan_tokens: int = 256):
    hp = preset_hparams("35b-a3b", n_vocab=1024, layers=8)
    mats = [Matrix(f"m{i}", Q.Q4_0, 1024, 2048, 1152, False) for i in range(10)]
    layer = 256 * 3 * 512 * 2048 * 18 // 32
    return hp, layer, plan_placement(hp, budget, mats, 1 << 20, layer, plan_tokens)


def test_everything_fits_when_budget_is_large():
    hp, layer, p = _plan(64 << 30)
    assert p.resident_experts == tuple(range(8)) and p.streamed_experts == () and p.n_slots == 0
    assert "resident" in p.text() and "streamed" not in p.text()


def test_small_budget_streams_the_later_layers_through_two_buffers():
    hp, layer, p = _plan(2 << 30)
    assert p.n_slots == 2 and p.slot_bytes >= layer
    assert p.resident_experts == tuple(range(len(p.resident_experts)))
    assert p.resident_experts + p.streamed_experts == tuple(range(8))
    assert len(p.streamed_experts) >= 4
    assert p.fixed_bytes + p.reserve <= p.budget
    text = p.text()
    assert "streamed" in text and "pinned host RAM" in text and "2 x" in text


def test_budget_below_the_minimum_is_a_device_error():
    with pytest.raises(DeviceError, match="VRAM budget"):
        _plan(200 << 20)


def test_pass_tokens_whole_prompt_or_multiples_of_64():
    hp = preset_hparams("35b-a3b", n_vocab=1024, layers=4)
    assert pass_tokens(hp, 947, 947, 8 << 30) == 947
    room = activation_bytes(hp, 300) + kv_bytes(hp, 4000)
    n = pass_tokens(hp, 4000, 4000, room)
    assert n % 64 == 0 and 0 < n <= 300
    with pytest.raises(DeviceError):
        pass_tokens(hp, 4000, 4000, kv_bytes(hp, 4000))
    assert state_bytes(hp) == 3 * (3 * 8192 * 4 + 32 * 128 * 128 * 4)


def test_gemm_matrix_converts_types_without_kernel():
    assert not gemm_matrix("w", Q.Q4_0, (64, 96)).converted
    m = gemm_matrix("w", Q.Q6_K, (64, 256))
    assert m.converted and m.qtype == Q.Q8_0 and m.row_bytes == 256 // 32 * 34
    with pytest.raises(DeviceError, match="multiple of 32"):
        gemm_matrix("w", Q.F32, (4, 40))


def test_route_tables_sort_by_expert_and_cut_tiles():
    rng = np.random.default_rng(1)
    n, k, E = 300, 4, 16
    idx = np.stack([rng.permutation(E)[:k] for _ in range(n)])
    w = rng.random((n, k)).astype(np.float32)
    off = np.arange(E, dtype=np.int64) * 1000
    t = route_tables(idx, w, E, off)
    flat = idx.reshape(-1)
    sorted_e = flat[np.argsort(flat, kind="stable")]
    assert np.all(np.diff(sorted_e) >= 0)
    assert np.array_equal(t.a_rows, np.argsort(flat, kind="stable") // k)
    assert np.array_equal(sorted_e[t.inv], flat)
    assert np.array_equal(t.row_w[t.inv], w.reshape(-1))
    assert t.tiles[:, 1].max() <= TILE_ROWS and t.tiles[:, 1].sum() == n * k
    for start, count, offset in t.tiles:
        assert np.all(sorted_e[start:start + count] == offset // 1000)
    assert np.array_equal(t.experts, np.unique(flat))


def test_copy_runs_and_selective_rule():
    assert copy_runs(np.array([0, 1, 2, 5, 7, 8])) == [(0, 3), (5, 1), (7, 2)]
    hp = preset_hparams("35b-a3b", n_vocab=1024, layers=4)
    E, k = hp.n_expert, hp.n_expert_used
    assert use_selective(E, k, 1) and use_selective(E, k, 40) and not use_selective(E, k, 947)


def test_no_pycuda_is_a_device_error(tmp_path):
    try:
        import pycuda.driver  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("pycuda is importable here")
    from engine.arch.qwen35.cuda import CudaPrefill
    from engine.testing.synth import synth

    path = tmp_path / "tiny.gguf"
    synth(path, "tiny", quant="q8_0", vocab=None)
    f = open_text(path)
    with pytest.raises(DeviceError, match="pycuda"):
        CudaPrefill(f.hparams, f.file)


# ---- the host side of CudaPrefill on an emulated device (runs everywhere: tests/cuda_fakes.py) ------


@pytest.fixture
def emulated(monkeypatch):
    """CudaPrefill on the emulated device: returns make(path, **kwargs) -> CudaPrefill."""
    import engine.arch.qwen35.cuda as cuda
    import engine.kernels.cuda_context as cuda_context

    drv = FakeDriver()
    monkeypatch.setattr(cuda_context, "load_driver", lambda: drv)
    monkeypatch.setattr(cuda, "Kernels", FakeKernels)
    made = []

    def make(f, **kwargs):
        eng = cuda.CudaPrefill(f.hparams, f.file, **kwargs)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()
    assert not drv.mem.blocks, "close() left device memory allocated"


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    from engine.testing.synth import synth

    folder = tmp_path_factory.mktemp("emulated")
    out = {}
    for preset, quant in (("tiny", "q4_0"), ("dense-tiny", "q8_0")):
        synth(folder / f"{preset}.gguf", preset, quant=quant, seed=3, vocab=[f"t{i}" for i in range(256)])
        out[preset] = open_text(folder / f"{preset}.gguf")
    return out


def test_emulated_prefill_of_a_k_quant_mix(emulated, tmp_path):
    """A Q4_K_M file (Q4_K / Q6_K / Q8_0 / Q5_0 tensors): resident matrices and routed experts without a
    GPU kernel are laid out as Q8_0 (converted on the host: 34 bytes per 32 weights, not F32's 128).
    Against the float reference that reads the stored blocks, the only difference is that conversion's
    rounding (about max|w| / 254 per 32 weights, ~1/16 of a 4-bit step)."""
    from engine.arch.qwen35.cuda_plan import stored_rows
    from engine.arch.qwen35.model import Qwen35Model
    from engine.gguf.quant import dequantize
    from engine.turn.state import SequenceState
    from engine.testing.synth import synth

    synth(tmp_path / "m.gguf", "small", layers=4, quant="q4_k_m", seed=5, vocab=[f"t{i}" for i in range(256)])
    f = open_text(tmp_path / "m.gguf")
    hp = f.hparams
    assert f.file.info("blk.0.ffn_gate_exps.weight").qtype == Q.Q4_K
    eng = emulated(f, plan_tokens=64)
    assert all(lay.gu_qtype == lay.down_qtype == Q.Q8_0 for lay in eng.layouts.values())
    converted = [m for m, _ in eng.mat.values() if m.converted]
    assert converted and all(m.qtype == Q.Q8_0 and m.nbytes == m.rows * m.cols // 32 * 34 for m in converted)
    assert "converted to Q8_0 on the host" in eng.plan.text()
    name = "blk.1.ffn_up_exps.weight"
    w = dequantize(f.file.raw(name), Q.Q4_K, (f.file.raw(name).shape[0], hp.n_embd))
    got = dequantize(stored_rows(f.file, name, Q.Q8_0), Q.Q8_0, w.shape)
    step = np.abs(w.reshape(w.shape[0], -1, 32)).max(axis=-1, keepdims=True) / 127
    # half a step, plus 127 steps times the f16 rounding of the step itself (2^-11 relative)
    assert np.all(np.abs(got - w).reshape(step.shape[0], -1, 32) <= (0.5 + 127 * 2.0**-11) * step * (1 + 1e-6))
    toks = np.random.default_rng(0).integers(0, hp.n_vocab, 40)
    want = Qwen35Model(hp, f.file).forward(toks, SequenceState.new(hp, 64))[-1]
    assert rel_err(eng.prefill(toks, SequenceState.new(hp, 64)), want) < 1e-2


@pytest.mark.parametrize("preset", ["tiny", "dense-tiny"])
def test_emulated_prefill_resident_streamed_selective_and_passes(emulated, tiny_files, preset):
    from engine.arch.qwen35.model import Qwen35Model
    from engine.turn.state import SequenceState

    f = tiny_files[preset]
    hp = f.hparams
    cpu = Qwen35Model(hp, f.file)
    toks = np.random.default_rng(0).integers(0, hp.n_vocab, 130)
    want_state = SequenceState.new(hp, 256)
    want = cpu.forward(toks, want_state)[-1]
    one_state = SequenceState.new(hp, 256)
    want_one = cpu.forward(toks[:1], one_state)[-1]

    full = emulated(f, plan_tokens=256)
    engines = [full]
    if hp.is_moe:
        p = full.plan
        assert p.resident_experts == tuple(range(hp.n_layer))
        tight = p.resident_weights + p.state + 2 * p.expert_layer_bytes + p.reserve + 1024
        stream = emulated(f, budget_bytes=tight, plan_tokens=256)
        assert stream.plan.streamed_experts == tuple(range(hp.n_layer)) and "streamed" in stream.plan.text()
        engines.append(stream)
        passes = emulated(f, budget_bytes=tight - activation_bytes(hp, 256) + activation_bytes(hp, 64),
                          plan_tokens=64)
        engines.append(passes)
    for eng in engines:
        st = SequenceState.new(hp, 256)
        assert rel_err(eng.prefill(toks, st), want) < 1e-4
        _assert_state_close(st, want_state)
        st1 = SequenceState.new(hp, 256)
        assert rel_err(eng.prefill(toks[:1], st1), want_one) < 1e-4
        _assert_state_close(st1, one_state)
        st2 = SequenceState.new(hp, 256)
        eng.prefill(toks[:70], st2)
        assert rel_err(eng.prefill(toks[70:], st2), want) < 1e-4
        _assert_state_close(st2, want_state)
    if hp.is_moe:
        st = SequenceState.new(hp, 256)
        stream.prefill(toks, st)
        tel = stream.last_telemetry
        assert tel.mode == "streamed" and tel.passes == 1
        assert tel.h2d_bytes == hp.n_layer * stream.layouts[0].nbytes
        stream.prefill(toks[:1], SequenceState.new(hp, 256))
        tel = stream.last_telemetry
        assert tel.mode == "selective"
        assert 0 < tel.h2d_bytes <= hp.n_layer * hp.n_expert_used * stream.layouts[0].stride
        passes.prefill(toks, SequenceState.new(hp, 256))
        assert passes.last_telemetry.passes == 3


def test_kernels_build_and_require_only_their_own_sources(monkeypatch, tmp_path):
    """Kernels(drv, sources) compiles just those sources (with native/cuda on the include path) and checks
    just their kernels: a broken vision.cu leaves GPU prefill's kernels intact."""
    import sys
    import types

    import engine.kernels.cuda_kernels as ck

    class Error(Exception):
        pass

    compiled = []

    class SourceModule:
        def __init__(self, source, nvcc, options, no_extern_c, cache_dir, include_dirs):
            name = next(n for n in ck._SIGNATURES if (ck.SOURCE_DIR / n).read_text() == source)
            if name == "vision.cu":
                raise Error("vision.cu: error (stand-in)")
            assert include_dirs == [str(ck.SOURCE_DIR)]
            compiled.append(name)
            self.kernels = ck._SIGNATURES[name]

        def get_function(self, kernel):
            if kernel not in self.kernels:
                raise Error(kernel)
            return types.SimpleNamespace(prepare=lambda fmt: None)

    monkeypatch.setitem(sys.modules, "pycuda.compiler", types.SimpleNamespace(SourceModule=SourceModule))
    monkeypatch.setattr(ck, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(ck, "cache_dir", lambda: str(tmp_path))
    drv = types.SimpleNamespace(Error=Error)
    k = ck.Kernels(drv, ck.PREFILL_SOURCES)
    assert compiled == list(ck.PREFILL_SOURCES)
    assert set(k._f) == {n for s in ck.PREFILL_SOURCES for n in ck._SIGNATURES[s]}
    with pytest.raises(DeviceError, match="compiling .*vision.cu failed"):
        ck.Kernels(drv, ck.VISION_SOURCES)


# ---- GPU ----------------------------------------------------------------------------------------

def gpu_available() -> bool:
    """Whether pycuda imports and sees a CUDA device (the ``gpu`` mark skips without one)."""
    try:
        import pycuda.driver as drv
        drv.init()
        return drv.Device.count() > 0
    except Exception:
        return False


_SKIP_WITHOUT_GPU = pytest.mark.skipif(not gpu_available(), reason="needs pycuda and an NVIDIA GPU")


def gpu(test):
    """Mark ``test`` ``gpu`` (``pytest -m gpu`` selects it) and skip it without pycuda and a CUDA device."""
    return pytest.mark.gpu(_SKIP_WITHOUT_GPU(test))


def test_gpu_tests_carry_the_gpu_mark():
    marks = {m.name for m in test_gemm_kernel_matches_dequantized_matmul.pytestmark}
    assert {"gpu", "skipif"} <= marks


@pytest.fixture(scope="module")
def cuda_ctx():
    import pycuda.driver as drv

    ctx = drv.Device(0).retain_primary_context()
    ctx.push()
    from engine.kernels.cuda_kernels import PREFILL_SOURCES, Kernels

    yield drv, Kernels(drv, PREFILL_SOURCES)
    _KEEP.clear()
    drv.Context.pop()
    ctx.detach()


_KEEP: list = []


def _dev(drv, a: np.ndarray) -> "object":
    return drv.to_device(np.ascontiguousarray(a))


@gpu
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gemm_kernel_matches_dequantized_matmul(cuda_ctx, qtype):
    from engine.gguf.quant import dequantize, quantize

    drv, k = cuda_ctx
    rng = np.random.default_rng(int(qtype))
    M, N, K = 150, 200, 96
    w = rng.standard_normal((N, K)).astype(np.float32)
    raw = quantize(w, qtype)
    wd = dequantize(raw, qtype, (N, K))
    a = rng.standard_normal((M, K)).astype(np.float32)
    m = gemm_matrix("w", qtype, (N, K))
    wg, ag = _dev(drv, raw), _dev(drv, a)
    c = drv.mem_alloc(M * N * 4)
    s = drv.Stream()
    k.gemm(s, m, int(wg), int(ag), K, int(c), N, M)
    s.synchronize()
    assert rel_err(drv.from_device(c, (M, N), np.float32), a @ wd.T, f"gemm {qtype.name}") < 1e-5
    y = drv.mem_alloc(N * 4)
    k.gemv(s, m, int(wg), int(ag), int(y))
    s.synchronize()
    assert rel_err(drv.from_device(y, (N,), np.float32), wd @ a[0], f"gemv {qtype.name}") < 1e-5
    emb = drv.mem_alloc(N * K * 4)
    k.embed(s, qtype, int(wg), m.row_bytes, int(emb), N, K)
    s.synchronize()
    assert np.array_equal(drv.from_device(emb, (N, K), np.float32), wd)

    # gathered rows, row scale and accumulate into a wider C
    rows = rng.integers(0, M, 70).astype(np.int32)
    scale = rng.random(70).astype(np.float32)
    base = rng.standard_normal((70, N + 8)).astype(np.float32)
    cg = _dev(drv, base)
    k.gemm(s, m, int(wg), int(ag), K, int(cg), N + 8, 70, a_rows=int(_keep(drv, rows)),
           row_scale=int(_keep(drv, scale)), accumulate=True)
    s.synchronize()
    want = base.copy()
    want[:, :N] += scale[:, None] * (a[rows] @ wd.T)
    assert rel_err(drv.from_device(cg, (70, N + 8), np.float32), want) < 1e-5


def _keep(drv, a: np.ndarray):
    """Upload and keep the allocation alive until the module's context goes."""
    g = _dev(drv, a)
    _KEEP.append(g)
    return g


@gpu
def test_grouped_gemm_over_experts(cuda_ctx):
    from engine.gguf.quant import dequantize, quantize

    drv, k = cuda_ctx
    rng = np.random.default_rng(5)
    E, N, K, n, top = 6, 64, 64, 90, 2
    w = rng.standard_normal((E, N, K)).astype(np.float32)
    raw = np.stack([quantize(w[e], Q.Q4_0) for e in range(E)])
    wd = np.stack([dequantize(raw[e], Q.Q4_0, (N, K)) for e in range(E)])
    idx = np.stack([rng.permutation(E)[:top] for _ in range(n)])
    rw = rng.random((n, top)).astype(np.float32)
    stride = raw[0].nbytes
    t = route_tables(idx, rw, E, np.arange(E, dtype=np.int64) * stride)
    x = rng.standard_normal((n, K)).astype(np.float32)
    m = gemm_matrix("w", Q.Q4_0, (N, K))
    out = drv.mem_alloc(n * top * N * 4)
    s = drv.Stream()
    k.gemm(s, m, int(_keep(drv, raw)), int(_keep(drv, x)), K, int(out), N, n * top,
           a_rows=int(_keep(drv, t.a_rows)), tiles=int(_keep(drv, t.tiles)), n_tiles=len(t.tiles),
           row_scale=int(_keep(drv, t.row_w)))
    s.synchronize()
    got = drv.from_device(out, (n * top, N), np.float32)
    flat = idx.reshape(-1)
    want = np.stack([rw.reshape(-1)[i] * (x[i // top] @ wd[flat[i]].T) for i in range(n * top)])
    assert rel_err(got[t.inv], want, "grouped gemm q4_0") < 1e-5

    # the same tables built on the GPU (rows of one expert in any order), the GEMM reading the tile count
    nk = n * top
    bufs = {name: drv.mem_alloc(size) for name, size in (("counts", E * 4), ("cursor", E * 4), ("n_tiles", 4),
            ("tiles", (nk // TILE_ROWS + E + 1) * 24), ("a_rows", nk * 4), ("row_w", nk * 4), ("inv", nk * 4))}
    b = {name: int(v) for name, v in bufs.items()}
    most = k.route(s, int(_keep(drv, idx.astype(np.int32))), int(_keep(drv, rw)), n, top, E, stride, b["counts"],
                   b["cursor"], b["tiles"], b["n_tiles"], b["a_rows"], b["row_w"], b["inv"])
    k.gemm(s, m, int(_keep(drv, raw)), int(_keep(drv, x)), K, int(out), N, nk, a_rows=b["a_rows"], tiles=b["tiles"],
           n_tiles=most, n_tiles_dev=b["n_tiles"], row_scale=b["row_w"])
    s.synchronize()
    n_tiles = int(drv.from_device(bufs["n_tiles"], (1,), np.int32)[0])
    assert n_tiles == len(t.tiles) <= most
    assert np.array_equal(drv.from_device(bufs["tiles"], (n_tiles, 3), np.int64), t.tiles)
    inv = drv.from_device(bufs["inv"], (nk,), np.int32)
    assert np.array_equal(np.sort(inv), np.arange(nk))
    assert np.array_equal(drv.from_device(bufs["a_rows"], (nk,), np.int32)[inv], np.arange(nk) // top)
    assert np.array_equal(drv.from_device(bufs["row_w"], (nk,), np.float32)[inv], rw.reshape(-1))
    row_expert = np.empty(nk, np.int64)
    row_expert[inv] = flat
    assert np.all(np.diff(row_expert) >= 0)
    got = drv.from_device(out, (nk, N), np.float32)
    assert rel_err(got[inv], want, "grouped gemm q4_0, GPU routing") < 1e-5


@gpu
@pytest.mark.parametrize("dims,n", [(d, n) for d in [(2, 4, 16, 16), (4, 8, 32, 32)] for n in (1, 63, 64, 65, 130)]
                         + [((16, 32, 128, 128), n) for n in (1, 130)])   # real head sizes: two lengths suffice
def test_gdn_chunked_kernel_matches_reference(cuda_ctx, dims, n):
    from engine.ops import reference as ops

    drv, k = cuda_ctx
    nk, nv, dk, dv = dims
    rng = np.random.default_rng(n + dk)
    C = 2 * nk * dk + nv * dv
    u = rng.standard_normal((n, C)).astype(np.float32)
    q = ops.l2norm(u[:, :nk * dk].reshape(n, nk, dk), 1e-6) * np.float32(dk ** -0.5)
    kk = ops.l2norm(u[:, nk * dk:2 * nk * dk].reshape(n, nk, dk), 1e-6)
    u[:, :nk * dk] = q.reshape(n, -1)
    u[:, nk * dk:2 * nk * dk] = kk.reshape(n, -1)
    v = u[:, 2 * nk * dk:].reshape(n, nv, dv)
    beta = ops.sigmoid(rng.standard_normal((n, nv)))
    g = (-np.exp(rng.uniform(np.log(0.5), np.log(4), nv))
         * ops.softplus(rng.standard_normal((n, nv)))).astype(np.float32)
    s0 = (0.1 * rng.standard_normal((nv, dk, dv))).astype(np.float32)
    o_ref, s_ref = ops.gdn_chunked(q, kk, v, g, beta, s0)

    nc = -(-n // 64)
    rows = nv * nc * 64
    st = _dev(drv, s0)
    o = drv.mem_alloc(n * nv * dv * 4)
    scratch = [drv.mem_alloc(rows * x * 4) for x in (dk, dv, 64)] + [drv.mem_alloc(rows * 8)]
    s = drv.Stream()
    k.gdn_chunked(s, int(_keep(drv, u)), int(_keep(drv, beta)), int(_keep(drv, g)), *(int(x) for x in scratch),
                  int(st), int(o), n, C, nk, nv, dk, dv)
    s.synchronize()
    assert rel_err(drv.from_device(o, (n, nv, dv), np.float32), o_ref, f"gdn out {dims} n={n}") < 1e-4
    assert rel_err(drv.from_device(st, (nv, dk, dv), np.float32), s_ref, f"gdn state {dims} n={n}") < 1e-4


@gpu
@pytest.mark.parametrize("hd,n_head,n_kv", [(32, 4, 2), (64, 8, 2), (256, 16, 2)])
@pytest.mark.parametrize("pos0,n", [(0, 1), (0, 130), (37, 70)])
def test_flash_attention_matches_reference(cuda_ctx, hd, n_head, n_kv, pos0, n):
    from engine.ops import reference as ops

    drv, k = cuda_ctx
    rng = np.random.default_rng(hd + n + pos0)
    m = pos0 + n
    q = rng.standard_normal((n, n_head, hd)).astype(np.float32)
    qg = rng.standard_normal((n, n_head, 2 * hd)).astype(np.float32)
    qg[..., :hd] = q
    kc = rng.standard_normal((m, n_kv, hd)).astype(np.float32)
    vc = rng.standard_normal((m, n_kv, hd)).astype(np.float32)
    want = ops.gated_attention(q, qg[..., hd:], kc, vc)
    out = drv.mem_alloc(n * n_head * hd * 4)
    s = drv.Stream()
    k.flash_attention(s, int(_keep(drv, q)), int(_keep(drv, qg)), int(_keep(drv, kc)), int(_keep(drv, vc)), int(out),
                      n, pos0, n_head, n_kv, hd)
    s.synchronize()
    assert rel_err(drv.from_device(out, (n, n_head * hd), np.float32), want,
                   f"attention hd={hd} pos0={pos0} n={n}") < 1e-4


@gpu
def test_router_topk_matches_reference(cuda_ctx):
    from engine.ops import reference as ops

    drv, k = cuda_ctx
    rng = np.random.default_rng(3)
    n, E, top = 500, 256, 8
    logits = rng.standard_normal((n, E)).astype(np.float32)
    idx = drv.mem_alloc(n * top * 4)
    w = drv.mem_alloc(n * top * 4)
    s = drv.Stream()
    k.router_topk(s, int(_keep(drv, logits)), n, E, top, int(idx), int(w))
    s.synchronize()
    ref_idx, ref_w = ops.topk_route(logits, top)
    assert np.array_equal(drv.from_device(idx, (n, top), np.int32), ref_idx)
    assert rel_err(drv.from_device(w, (n, top), np.float32), ref_w, "router weights") < 1e-6


# ---- whole prefills -------------------------------------------------------------------------------

MODELS = [("tiny", "q4_0"), ("dense-tiny", "q8_0"), ("small", "q4_0")]
LENGTHS = [1, 63, 64, 65, 1000]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(preset, quant) -> (GGUFFile, CPU model, {budget name: CudaPrefill}, {length: (logits, state)})."""
    from engine.arch.qwen35.cuda import CudaPrefill
    from engine.arch.qwen35.model import Qwen35Model
    from engine.testing.synth import synth

    folder = tmp_path_factory.mktemp("cuda-synth")
    made = {}

    def get(preset: str, quant: str):
        if (preset, quant) not in made:
            path = folder / f"{preset}-{quant}.gguf"
            synth(path, preset, quant=quant, seed=7, vocab=None)
            f = open_text(path)
            full = CudaPrefill(f.hparams, f.file, plan_tokens=1024)
            stream = full
            if f.hparams.is_moe:
                p = full.plan
                tight = p.resident_weights + p.state + 2 * p.expert_layer_bytes + p.reserve + (1 << 10)
                stream = CudaPrefill(f.hparams, f.file, budget_bytes=tight, plan_tokens=1024)
                assert stream.plan.resident_experts == () and stream.plan.n_slots == 2
            made[preset, quant] = (f, Qwen35Model(f.hparams, f.file), {"fits": full, "stream": stream}, {})
        return made[preset, quant]

    yield get
    for _, _, engines, _ in made.values():
        for e in {id(x): x for x in engines.values()}.values():
            e.close()


def _tokens(hp, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, hp.n_vocab, n)


def _cpu(model_entry, n: int):
    from engine.turn.state import SequenceState

    f, cpu, _, refs = model_entry
    if n not in refs:
        st = SequenceState.new(f.hparams, 2048)
        logits = cpu.forward(_tokens(f.hparams, n, n), st)[-1]
        refs[n] = (logits, st)
    return refs[n]


def _assert_state_close(got, want, label: str = ""):
    assert got.pos == want.pos
    errs = {}
    for name in ("conv", "ssm"):
        for il, a in getattr(want, name).items():
            errs[f"{name}[{il}]"] = rel_err(getattr(got, name)[il], a)
    for name in ("k", "v"):
        for il, a in getattr(want, name).items():
            errs[f"{name}[{il}]"] = rel_err(getattr(got, name)[il][:want.pos], a[:want.pos])
    worst = max(errs, key=errs.get)
    if label:
        print(f"[max rel err] {label} state: {errs[worst]:.2e} ({worst})")
    assert errs[worst] < TOL, worst


@gpu
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("preset,quant,budget", [(p, q, b) for p, q in MODELS for b in ("fits", "stream")
                                                 if b == "fits" or not p.startswith("dense")])
def test_gpu_prefill_matches_cpu(models, preset, quant, n, budget):
    """A dense model has no routed experts, so it is checked with the budget that fits only."""
    from engine.turn.state import SequenceState

    entry = models(preset, quant)
    f, cpu, engines, _ = entry
    want_logits, want_state = _cpu(entry, n)
    st = SequenceState.new(f.hparams, 2048)
    eng = engines[budget]
    logits = eng.prefill(_tokens(f.hparams, n, n), st)
    label = f"prefill {preset} {quant} n={n} {budget}"
    assert rel_err(logits, want_logits, label + " logits") < TOL
    _assert_state_close(st, want_state, label)
    tel = eng.last_telemetry
    assert tel.n_tokens == n and tel.passes == 1
    if budget == "stream":
        assert tel.mode in ("streamed", "selective") and tel.h2d_bytes > 0
    # CPU decode continues from the GPU state exactly as from the CPU state
    nxt = np.array([int(np.argmax(want_logits))])
    a = cpu.forward(nxt, st)[-1]
    b = cpu.forward(nxt, want_state.copy())[-1]
    assert rel_err(a, b) < TOL


@gpu
@pytest.mark.parametrize("preset,quant", [("tiny", "q4_0"), ("small", "q4_0")])
def test_gpu_prefill_continues_a_state_and_runs_in_passes(models, preset, quant):
    from engine.arch.qwen35.cuda import CudaPrefill
    from engine.turn.state import SequenceState

    entry = models(preset, quant)
    f, cpu, engines, _ = entry
    hp = f.hparams
    toks = _tokens(hp, 1000, 11)
    want_state = SequenceState.new(hp, 2048)
    want = cpu.forward(toks, want_state)[-1]

    # 400 tokens, then 600 more from the GPU-filled state
    st = SequenceState.new(hp, 2048)
    engines["stream"].prefill(toks[:400], st)
    got = engines["stream"].prefill(toks[400:], st)
    assert rel_err(got, want, f"{preset} 400+600 logits") < TOL
    _assert_state_close(st, want_state, f"{preset} 400+600")

    # a budget with room for 128 tokens of activations (all experts resident): several passes
    p = engines["fits"].plan
    tight = (p.resident_weights + p.state + hp.n_layer * p.expert_layer_bytes + activation_bytes(hp, 128)
             + kv_bytes(hp, 1000))
    eng = CudaPrefill(hp, f.file, budget_bytes=tight, plan_tokens=128)
    try:
        st2 = SequenceState.new(hp, 2048)
        got2 = eng.prefill(toks, st2)
        assert eng.last_telemetry.passes == 8
        assert rel_err(got2, want, f"{preset} 8 passes logits") < TOL
        _assert_state_close(st2, want_state, f"{preset} 8 passes")
    finally:
        eng.close()


def test_emulated_prefill_of_an_f16_state_widens_and_rounds_its_rows(emulated, tiny_files):
    """GPU prefill continuing an F16 state reads its rows widened exactly and writes the new rows rounded once:
    the same logits and state as an F32 state holding those rounded rows, its new rows then rounded."""
    from engine.turn.state import SequenceState

    f = tiny_files["tiny"]
    hp = f.hparams
    eng = emulated(f, plan_tokens=256)
    toks = np.random.default_rng(4).integers(0, hp.n_vocab, 130)
    half = SequenceState.new(hp, 256, "f16")
    eng.prefill(toks[:70], half)
    full = SequenceState.new(hp, 256)
    eng.prefill(toks[:70], full)
    for table in (full.k, full.v):
        for a in table.values():
            a[:70] = a[:70].astype(np.float16)
    got, want = eng.prefill(toks[70:], half), eng.prefill(toks[70:], full)
    assert np.array_equal(got, want)
    for il in half.k:
        assert half.k[il].dtype == np.float16
        assert np.array_equal(half.k[il][:130], full.k[il][:130].astype(np.float16))
        assert np.array_equal(half.v[il][:130], full.v[il][:130].astype(np.float16))
    for il in half.ssm:
        assert np.array_equal(half.ssm[il], full.ssm[il]) and np.array_equal(half.conv[il], full.conv[il])

