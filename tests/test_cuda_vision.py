"""The vision tower on the GPU (engine.arch.qwen3vl.cuda) against the CPU VisionTower, and the CPU fallback.

* GPU tests (skipped without pycuda and a CUDA device): CudaVisionTower.encode against VisionTower.encode on
  random 2-block projectors written as F32, F16 and Q8_0 files, head widths 48 (D 192, ffn 200) and 72
  (D 144, ffn 304: rows that are not whole 32-value blocks, padded on the GPU), grids of 2x2 to 20x34
  patches (non-square, odd merged sides, one and several query / key tiles), growing and reserved
  activation buffers, the VRAM budget check, close(); and an engine loaded with device="cuda" encodes
  images to the same embeddings as one loaded with device="cpu".
* CudaVisionTower's host side on an emulated device (runs everywhere): tests/cuda_fakes.py's numpy stand-in
  for pycuda.driver (allocations poisoned with NaN) plus the numpy twins of the vision kernels, so weight
  padding, the patch-kernel interleave, buffer strides and the merger's row layout are checked without a GPU.
* Fallback tests (run everywhere): a stand-in GPU tower that raises DeviceError -> the CPU result, a note,
  the GPU tower closed, later images on the CPU; no pycuda -> DeviceError; the engine reports where images
  are encoded.

Tolerance: max |gpu - cpu| <= TOL * max |cpu| over the whole output, TOL = 1e-4 (float32 on both sides;
the GEMMs and the softmax sum in another order than numpy, so the expected error is ~1e-6).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.errors import DeviceError
from engine.arch.qwen3vl.mmproj import VisionHParams, load_mmproj, write_mmproj
from engine.testing.qwen3vl import RandomWeights
from engine.arch.qwen3vl.tower import VisionTower
from engine.registry import LoadedVision
from engine.arch.qwen3vl import ARCH as QWEN3VL
from engine.vision.encoder import ImageEncoder
from test_cuda_prefill import gpu, gpu_available

FIX = Path(__file__).parent / "fixtures" / "vision"
TOL = 1e-4
GRIDS = [(2, 2), (4, 6), (6, 10), (8, 8), (14, 10), (20, 34)]
SHAPES = {"hd48": dict(n_embd=192, n_head=4, n_ff=200), "hd72": dict(n_embd=144, n_head=2, n_ff=304)}


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (inf when got holds a NaN or an infinity)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))




def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


# ---- GPU ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    """``get(shape, ftype) -> (hp, cpu VisionTower, CudaVisionTower)``, each made once; GPU towers closed at the end."""
    from engine.arch.qwen3vl.cuda import CudaVisionTower

    folder = tmp_path_factory.mktemp("cuda-vision")
    made: dict[tuple[str, str], tuple] = {}

    def get(shape: str, ftype: str):
        if (shape, ftype) not in made:
            hp = VisionHParams(n_layer=2, patch_size=16, merge=2, out_dim=96, pos_side=8, **SHAPES[shape])
            mm = load_mmproj(write_mmproj(folder / f"{shape}-{ftype}.gguf", hp, RandomWeights(hp, seed=7), ftype))
            made[(shape, ftype)] = (hp, VisionTower(mm, threads=1), CudaVisionTower(mm))
        return made[(shape, ftype)]

    yield get
    for _, _, tower in made.values():
        tower.close()


@gpu
@pytest.mark.parametrize("grid", GRIDS, ids=[f"{h}x{w}" for h, w in GRIDS])
@pytest.mark.parametrize("ftype", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gpu_tower_matches_cpu_tower(towers, shape, ftype, grid):
    hp, cpu, tower = towers(shape, ftype)
    s = grid[0] * grid[1]
    pixels = np.random.default_rng(s).uniform(-1, 1, (s, hp.patch_dim)).astype(np.float32)
    want = cpu.encode(pixels, grid)
    got = tower.encode(pixels, grid)
    assert got.shape == want.shape == (s // 4, hp.out_dim) and got.dtype == np.float32
    err = rel_err(got, want)
    print(f"[max rel err] {shape} {ftype} {grid}: {err:.2e}")
    assert err <= TOL


@gpu
def test_gpu_tower_reserve_budget_and_close(tmp_path):
    from engine.arch.qwen3vl.cuda import CudaVisionTower, activation_bytes

    hp = VisionHParams(n_layer=1, patch_size=16, merge=2, out_dim=64, pos_side=8, **SHAPES["hd72"])
    mm = load_mmproj(write_mmproj(tmp_path / "t.gguf", hp, RandomWeights(hp, seed=1), "F16"))
    with pytest.raises(DeviceError, match="VRAM budget"):
        CudaVisionTower(mm, budget_bytes=1 << 16)
    tower = CudaVisionTower(mm, reserve_patches=256)
    assert tower.vram_bytes >= tower.weight_bytes + activation_bytes(hp, 256)
    pixels = np.random.default_rng(0).uniform(-1, 1, (4 * 6, hp.patch_dim)).astype(np.float32)
    assert rel_err(tower.encode(pixels, (4, 6)), VisionTower(mm, threads=1).encode(pixels, (4, 6))) <= TOL
    with pytest.raises(ValueError, match="grid"):
        tower.encode(pixels, (4, 5))
    tower.close()
    assert tower.vram_bytes == 0
    with pytest.raises(DeviceError, match="closed"):
        tower.encode(pixels, (4, 6))


@gpu
def test_engine_on_cuda_encodes_images_like_the_cpu(synth_model, tmp_path):
    from engine.api import Engine, EngineOptions
    from engine.testing.pairs import synth_mmproj_for

    model = synth_model("tiny", "q8_0")
    mmproj = synth_mmproj_for(tmp_path / "tiny-mmproj.gguf", "tiny", seed=0)
    cpu = Engine.load(model, mmproj, EngineOptions(device="cpu", prefix_cache=False))
    eng = Engine.load(model, mmproj, EngineOptions(device="cuda", prefix_cache=False))
    try:
        assert eng.vision.device == "cuda" and eng.info.vision_device == "cuda" and eng.info.vision_note == ""
        assert cpu.info.vision_device == "cpu"
        for seed, size in ((0, (96, 64)), (1, (200, 130))):
            img = _image(seed, size)
            got, want = eng.vision.encode(img), cpu.vision.encode(img)
            assert got.grid == want.grid
            assert rel_err(got.embeddings, want.embeddings) <= TOL
        assert eng.vision.device == "cuda"
    finally:
        eng.close()
    assert eng.vision.gpu is None


# ---- the host side on an emulated device (runs everywhere) ----------------------------------------

def _emulated_device():
    """(driver, kernels class): the emulated device of tests/cuda_fakes.py plus the vision kernels' numpy twins."""
    from cuda_fakes import FakeDriver, FakeKernels

    from engine.ops import vision_reference as ops

    class Driver(FakeDriver):
        def memset_d32(self, ptr, value, count):
            self.mem.arr(int(ptr), (count,), np.uint32)[:] = value

        def pagelocked_zeros(self, shape, dtype):
            return np.zeros(shape, dtype)

    class VisionKernels(FakeKernels):
        def _put(self, ptr, ld, rows):
            for r, row in enumerate(rows):
                self.m.arr(ptr + r * ld * 4, (row.size,))[:] = row

        def layer_norm(self, stream, x, x_ld, w, b, y, y_group, y_ld, rows, d, eps):
            out = ops.layer_norm(self.m.rows(x, range(rows), x_ld, d), self.m.arr(w, (d,)), self.m.arr(b, (d,)), eps)
            for r in range(rows):
                self.m.arr(y + ((r // y_group) * y_ld + (r % y_group) * d) * 4, (d,))[:] = out[r]

        def bias_act(self, stream, x, ld, b, rows, n, act):
            v = self.m.rows(x, range(rows), ld, n) + self.m.arr(b, (n,))
            self._put(x, ld, (v, ops.gelu_tanh(v), ops.gelu_erf(v))[act])

        def rope_2d(self, stream, qkv, ld, cos, sin, s, heads, hd):
            x = self.m.rows(qkv, range(s), ld, 2 * heads * hd).reshape(s, 2 * heads, hd)
            out = ops.apply_rope(x, self.m.arr(cos, (s, hd // 2)), self.m.arr(sin, (s, hd // 2)))
            self._put(qkv, ld, out.reshape(s, -1))

        def vision_attention(self, stream, qkv, ld, out, out_ld, s, heads, hd, scale):
            x = self.m.rows(qkv, range(s), ld, 3 * heads * hd).reshape(s, 3, heads, hd)
            self._put(out, out_ld, ops.attention(x[:, 0], x[:, 1], x[:, 2]))

    return Driver(), VisionKernels


@pytest.mark.parametrize("ftype", ["F32", "Q8_0"])
def test_emulated_gpu_tower_matches_cpu_tower(monkeypatch, tmp_path, ftype):
    import engine.kernels.cuda_context as cuda_context
    import engine.arch.qwen3vl.cuda as cuda_vision

    drv, kernels = _emulated_device()
    monkeypatch.setattr(cuda_context, "load_driver", lambda: drv)
    monkeypatch.setattr(cuda_vision, "Kernels", kernels)
    hp = VisionHParams(n_layer=2, patch_size=16, merge=2, out_dim=40, pos_side=6, **SHAPES["hd72"])
    mm = load_mmproj(write_mmproj(tmp_path / "t.gguf", hp, RandomWeights(hp, seed=2), ftype))
    cpu = VisionTower(mm, threads=1)
    tower = cuda_vision.CudaVisionTower(mm, reserve_patches=24)
    assert tower.mat["v.blk.0.ffn_down.weight"][0].cols == 320 and tower.mat["v.blk.0.attn_qkv.weight"][0].cols == 160
    for grid in ((4, 6), (2, 2), (6, 10)):
        s = grid[0] * grid[1]
        pixels = np.random.default_rng(s).uniform(-1, 1, (s, hp.patch_dim)).astype(np.float32)
        assert rel_err(tower.encode(pixels, grid), cpu.encode(pixels, grid)) <= TOL, grid
    tower.close()
    assert not drv.mem.blocks, "close() left device memory allocated"


def _emulated_tower(monkeypatch, tmp_path, **kwargs):
    """(driver, module, mm, make(**kw) -> CudaVisionTower) on the emulated device; 1-block hd72 tower, F32."""
    import engine.kernels.cuda_context as cuda_context
    import engine.arch.qwen3vl.cuda as cuda_vision

    drv, kernels = _emulated_device()
    monkeypatch.setattr(cuda_context, "load_driver", lambda: drv)
    monkeypatch.setattr(cuda_vision, "Kernels", kernels)
    hp = VisionHParams(n_layer=1, patch_size=16, merge=2, out_dim=40, pos_side=6, **SHAPES["hd72"])
    mm = load_mmproj(write_mmproj(tmp_path / "t.gguf", hp, RandomWeights(hp, seed=2), "F32"))
    return drv, cuda_vision, mm


@pytest.mark.parametrize("error", [ValueError("cannot reshape (stand-in)"), KeyboardInterrupt()])
def test_emulated_load_failure_frees_the_gpu(monkeypatch, tmp_path, error):
    """Any exception while loading frees the device memory; an Exception becomes a DeviceError (CPU fallback),
    a KeyboardInterrupt passes through."""
    drv, cuda_vision, mm = _emulated_tower(monkeypatch, tmp_path)
    calls, original = [], cuda_vision.CudaVisionTower._rows

    def rows(self, m, tensors):
        calls.append(m.name)
        if len(calls) == 3:
            raise error
        return original(self, m, tensors)

    monkeypatch.setattr(cuda_vision.CudaVisionTower, "_rows", rows)
    if isinstance(error, ValueError):
        with pytest.raises(DeviceError, match="ValueError: cannot reshape"):
            cuda_vision.CudaVisionTower(mm, reserve_patches=24)
    else:
        with pytest.raises(KeyboardInterrupt):
            cuda_vision.CudaVisionTower(mm, reserve_patches=24)
    assert len(calls) == 3 and not drv.mem.blocks, "a failed load left device memory allocated"


@pytest.mark.parametrize("head_dim", [66, 132])
def test_unsupported_head_width_is_refused_before_the_gpu(monkeypatch, tiny_mm, head_dim):
    """The attention kernel's head-width limits are checked at load, before any GPU memory is taken (the
    projector reader refuses widths that are not multiples of 4 already; the tower does not rely on it)."""
    import dataclasses

    import engine.kernels.cuda_context as cuda_context
    from engine.arch.qwen3vl.cuda import CudaVisionTower

    hp = dataclasses.replace(tiny_mm.hparams, n_embd=head_dim * tiny_mm.hparams.n_head)
    monkeypatch.setattr(cuda_context, "load_driver", lambda: pytest.fail("the GPU was touched"))
    with pytest.raises(DeviceError, match=f"steps of 4, the tower has {head_dim}"):
        CudaVisionTower(dataclasses.replace(tiny_mm, hparams=hp))


def test_emulated_projector_file_changed_since_load(monkeypatch, tmp_path):
    drv, cuda_vision, mm = _emulated_tower(monkeypatch, tmp_path)
    write_mmproj(mm.path, mm.hparams, RandomWeights(mm.hparams, seed=3), "F32")
    with pytest.raises(DeviceError, match="changed since it was loaded"):
        cuda_vision.CudaVisionTower(mm)
    assert not drv.mem.blocks


def test_emulated_budget_bounds_growth_and_keeps_the_tower(monkeypatch, tmp_path, caplog):
    """An image whose activations would pass the budget raises DeviceBudgetError without touching the buffers
    held; ImageEncoder encodes just that image on the CPU and keeps the GPU tower."""
    from engine.arch.qwen3vl.cuda import activation_bytes
    from engine.errors import DeviceBudgetError

    drv, cuda_vision, mm = _emulated_tower(monkeypatch, tmp_path)
    probe = cuda_vision.CudaVisionTower(mm)
    budget = probe.weight_bytes + activation_bytes(mm.hparams, 24)
    probe.close()
    tower = cuda_vision.CudaVisionTower(mm, reserve_patches=24, budget_bytes=budget)
    held = tower.vram_bytes
    big = np.random.default_rng(1).uniform(-1, 1, (60, mm.hparams.patch_dim)).astype(np.float32)
    with pytest.raises(DeviceBudgetError, match="activations for 60 patches"):
        tower.encode(big, (6, 10))
    assert tower.vram_bytes == held
    small = big[:24]
    cpu = VisionTower(mm, threads=1)
    assert rel_err(tower.encode(small, (4, 6)), cpu.encode(small, (4, 6))) <= TOL
    enc = ImageEncoder(LoadedVision(QWEN3VL, mm), min_pixels=1024, gpu=tower)
    img = _image(7, (160, 96))  # 10 x 6 patches: above the budget
    with caplog.at_level(logging.WARNING, logger="engine.vision.encoder"):
        got = enc.encode(img)
    want = ImageEncoder(LoadedVision(QWEN3VL, mm), min_pixels=1024).encode(img).embeddings
    assert np.array_equal(got.embeddings, want)
    assert enc.gpu is tower and enc.device_note == "" and "on the CPU" in caplog.text
    enc.close()
    assert not drv.mem.blocks


# ---- fallback (runs everywhere) -------------------------------------------------------------------

class StandInTower:
    """``encode(pixel_values, grid)`` like CudaVisionTower, computed by the CPU tower, or failing with DeviceError."""

    def __init__(self, cpu: VisionTower, fail: bool, close_fails: bool = False) -> None:
        self.cpu, self.fail, self.close_fails = cpu, fail, close_fails
        self.calls = 0
        self.closed = False

    def encode(self, pixel_values, grid):
        self.calls += 1
        if self.fail:
            raise DeviceError("CUDA error while encoding (stand-in)")
        return self.cpu.encode(pixel_values, grid) + np.float32(1.0)

    vram_bytes = 1 << 30

    def close(self) -> None:
        self.closed = True
        if self.close_fails:
            raise RuntimeError("context is gone (stand-in)")


@pytest.fixture(scope="module")
def tiny_mm():
    return load_mmproj(FIX / "tiny-mmproj-f16.gguf")


def test_encoder_uses_the_gpu_tower_when_it_works(tiny_mm):
    cpu = ImageEncoder(LoadedVision(QWEN3VL, tiny_mm), min_pixels=1024)
    stand = StandInTower(cpu.tower, fail=False)
    enc = ImageEncoder(LoadedVision(QWEN3VL, tiny_mm), min_pixels=1024, gpu=stand)
    assert enc.device == "cuda"
    img = _image(3, (64, 96))
    assert np.array_equal(enc.encode(img).embeddings, cpu.encode(img).embeddings + np.float32(1.0))
    assert stand.calls == 1 and enc.device_note == ""
    enc.close()
    assert stand.closed and enc.device == "cpu"


@pytest.mark.parametrize("close_fails", [False, True])
def test_gpu_tower_failure_falls_back_to_the_cpu_for_this_and_later_images(tiny_mm, caplog, close_fails):
    cpu = ImageEncoder(LoadedVision(QWEN3VL, tiny_mm), min_pixels=1024)
    stand = StandInTower(cpu.tower, fail=True, close_fails=close_fails)
    enc = ImageEncoder(LoadedVision(QWEN3VL, tiny_mm), min_pixels=1024, gpu=stand)
    first, second = _image(4, (64, 96)), _image(5, (128, 64))
    with caplog.at_level(logging.WARNING, logger="engine.vision.encoder"):
        got = enc.encode(first)
    assert np.array_equal(got.embeddings, cpu.encode(first).embeddings)
    assert enc.device == "cpu" and enc.gpu is None and stand.closed
    assert "GPU vision tower failed" in enc.device_note and "stand-in" in enc.device_note
    assert "GPU vision tower failed" in caplog.text
    assert np.array_equal(enc.encode(second).embeddings, cpu.encode(second).embeddings)
    assert stand.calls == 1


def test_no_pycuda_is_a_device_error(tiny_mm):
    try:
        import pycuda.driver  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("pycuda is importable here")
    from engine.arch.qwen3vl.cuda import CudaVisionTower

    with pytest.raises(DeviceError, match="pycuda"):
        CudaVisionTower(tiny_mm)


def test_engine_reports_where_images_are_encoded(synth_model, tmp_path):
    from engine.api import Engine, EngineOptions
    from engine.testing.pairs import synth_mmproj_for

    model = synth_model("tiny", "q8_0")
    mmproj = synth_mmproj_for(tmp_path / "tiny-mmproj.gguf", "tiny", seed=0)
    eng = Engine.load(model, mmproj, EngineOptions(device="cpu", prefix_cache=False))
    assert eng.info.vision_device == "cpu" and eng.info.vision_note == ""
    assert Engine.load(model, options=EngineOptions(device="cpu")).info.vision_device == ""
    if not gpu_available():
        auto = Engine.load(model, mmproj, EngineOptions(device="auto", prefix_cache=False))
        assert auto.info.vision_device == "cpu" and "No GPU vision tower" in auto.info.vision_note
    eng.vision.gpu = StandInTower(eng.vision.tower, fail=True)
    assert eng.info.vision_device == "cuda"
    msgs = [{"role": "user", "content": [{"type": "image", "image": _image(6, (96, 64))},
                                         {"type": "text", "text": "What is it?"}]}]
    prompt = eng.prepare(msgs)
    assert len(prompt.encoded) == 1
    assert eng.info.vision_device == "cpu" and "GPU vision tower failed" in eng.info.vision_note


def test_encoder_close_logs_a_failing_gpu_close(tiny_mm, caplog):
    stand = StandInTower(VisionTower(tiny_mm), fail=False, close_fails=True)
    enc = ImageEncoder(LoadedVision(QWEN3VL, tiny_mm), gpu=stand)
    with caplog.at_level(logging.WARNING, logger="engine.vision.encoder"):
        enc.close()
    assert stand.closed and enc.gpu is None and "context is gone" in caplog.text


class StandInPrefill:
    """CudaPrefill's constructor contract: raises ``error(budget)`` when it returns one, else loads."""

    made: list["StandInPrefill"] = []

    def __init__(self, hp, gguf, budget, error=lambda budget: None) -> None:
        self.budget, self.closed = budget, False
        exc = error(budget)
        if exc is not None:
            raise exc
        self.plan = type("Plan", (), {"text": lambda self: "stand-in plan", "budget": budget})()
        StandInPrefill.made.append(self)

    def close(self) -> None:
        self.closed = True


def _load_with_stand_ins(monkeypatch, synth_model, tmp_path, error, **options):
    """Engine.load with a StandInTower as the GPU vision tower and StandInPrefill (raising ``error``) as prefill."""
    import engine.api as api
    import engine.arch.qwen35.cuda as cuda
    import engine.placement as placement
    from engine.testing.pairs import synth_mmproj_for

    towers = []

    def open_tower(projector, opts):
        towers.append(StandInTower(VisionTower(projector.projector, threads=1), fail=False))
        return towers[-1], ""

    StandInPrefill.made = []
    monkeypatch.setattr(placement, "open_vision_gpu", open_tower)
    monkeypatch.setattr(cuda, "CudaPrefill", lambda hp, g, budget: StandInPrefill(hp, g, budget, error))
    mmproj = synth_mmproj_for(tmp_path / "tiny-mmproj.gguf", "tiny", seed=0)
    opts = api.EngineOptions(device="cuda", prefix_cache=False, **options)
    return towers, lambda: api.Engine.load(synth_model("tiny", "q8_0"), mmproj, opts)


@pytest.mark.parametrize("error", [RuntimeError("not a DeviceError (stand-in)"), KeyboardInterrupt()])
def test_engine_load_releases_the_gpu_tower_on_any_exception(monkeypatch, synth_model, tmp_path, error):
    towers, load = _load_with_stand_ins(monkeypatch, synth_model, tmp_path, lambda budget: error)
    with pytest.raises(type(error)):
        load()
    assert len(towers) == 1 and towers[0].closed


def test_tight_budget_gives_the_gpu_to_prefill(monkeypatch, synth_model, tmp_path):
    """Prefill does not fit what the tower leaves of the budget: the tower goes, prefill gets the whole budget."""
    from engine.errors import DeviceBudgetError

    budget = 3 << 30
    towers, load = _load_with_stand_ins(
        monkeypatch, synth_model, tmp_path,
        lambda b: DeviceBudgetError(f"VRAM budget {b} (stand-in)") if b < budget else None, vram_budget=budget)
    eng = load()
    assert towers[0].closed and eng.vision.gpu is None and eng.info.vision_device == "cpu"
    assert "GPU prefill fits the VRAM budget" in eng.info.vision_note
    assert eng.info.device == "cuda" and eng.gpu.budget == budget
    eng.close()
    assert eng.gpu is None and StandInPrefill.made[0].closed


def test_engine_close_releases_every_part_when_one_fails(monkeypatch, synth_model, tmp_path):
    towers, load = _load_with_stand_ins(monkeypatch, synth_model, tmp_path, lambda budget: None)
    eng = load()
    eng.cache = type("Cache", (), {"persist": lambda self: (_ for _ in ()).throw(OSError("disk full (stand-in)"))})()
    towers[0].close_fails = True
    with pytest.raises(OSError, match="disk full"):
        eng.close()
    assert towers[0].closed and eng.vision.gpu is None
    assert eng.gpu is None and StandInPrefill.made[0].closed
