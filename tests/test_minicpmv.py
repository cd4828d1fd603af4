"""MiniCPM-V 4.6 vision: preprocessing, position buckets, token counts and the tower against HF transformers
(``tests/fixtures/minicpmv/golden.npz``, made by ``make_fixtures.py`` there), plus the window-attention merger
against a loop reference, cancellation and the prompt layout (the projector file: test_minicpmv_file.py)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
from PIL import Image

from engine.arch.minicpmv import mmproj as mp
from engine.testing import minicpmv as mp_test
from engine.arch.minicpmv import preprocess as pre
from engine.arch.minicpmv import tower as tower_mod
from engine.arch.minicpmv.layout import expand_layout, image_layout, sequential_positions
from engine.arch.minicpmv.tower import MiniCPMVTower, window_attention, window_order
from engine.arch.qwen35.vocab import MINICPMV46_MARKERS, minicpmv46_vocab, qwen35_vocab
from engine.errors import GenerationCancelled, ImageError
from engine.kernels import cpu, sgemm
from engine.events import TokenEvent
from engine.sampling import SamplingParams
from engine.registry import LoadedVision, open_text
from engine.arch.minicpmv import ARCH as MINICPMV
from engine.vision.encoder import ImageEncoder

FIXTURES = Path(__file__).parent / "fixtures" / "minicpmv"
sys.path.insert(0, str(FIXTURES))

from cases import (COUNT_SIZES, E2E_IMAGE, E2E_TEXT, IMAGE_PAD,  # noqa: E402
                   MMPROJ, OUTPUT_ROWS, STOPS, TOWER_CASES, kept_rows, layout_ids, sample_image)

TOL = 1e-4
"""Largest relative error (Frobenius norm of the difference over that of HF's stage) at float32."""


@pytest.fixture(scope="module")
def gold():
    return np.load(FIXTURES / "golden.npz")


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    return mp.load_mmproj(mp_test.synth_mmproj(tmp_path_factory.mktemp("mcv") / "m-mmproj.gguf", **MMPROJ))


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(ours.astype(np.float64) - ref) / np.linalg.norm(ref))


# ------------------------------------------------------------------------------------ preprocessing

def test_token_counts_equal_hf_processor(gold):
    for i, (h, w) in enumerate(COUNT_SIZES):
        for mode in pre.MODES:
            plan = pre.plan_slices(h, w, mode=mode)
            assert sum(plan.token_counts) == gold[f"counts_{mode}"][i], (h, w, mode)
        grid = pre.plan_slices(h, w).grid
        assert (grid or (0, 0)) == tuple(gold["counts_grid"][i]), (h, w)


def test_known_token_counts():
    """The figures llama.cpp and HF publish for the released model (16x mode): 448x448 -> 64, 1024x768 -> 315
    (a 2x2 grid of 392x504 slices plus a 392x504 overview), 1920x1080 -> 578 (616x336 overview + 2x4 slices)."""
    assert pre.plan_slices(448, 448).token_counts == [64]
    p = pre.plan_slices(768, 1024)
    assert (p.grid, p.overview, p.slice_size, sum(p.token_counts)) == ((2, 2), (392, 504), (392, 504), 315)
    assert sum(pre.plan_slices(768, 1024, mode="4x").token_counts) == 1260
    p = pre.plan_slices(1080, 1920)
    assert (p.overview, p.grid, p.slice_size, sum(p.token_counts)) == ((336, 616), (2, 4), (448, 448), 578)


def test_pieces_equal_hf_pixel_values(gold):
    for seed, (name, hw, mode) in enumerate(TOWER_CASES):
        prep = pre.prepare_pieces(Image.fromarray(sample_image(*hw, seed)), mode=mode)
        assert [list(g) for g in prep.plan.piece_grids] == gold[f"{name}_pieces"].tolist(), name
        assert prep.plan.token_counts == gold[f"{name}_tokens"].tolist(), name
        rows = np.concatenate(prep.pieces)
        np.testing.assert_allclose(rows[kept_rows(len(rows))], gold[f"{name}_pixels"], rtol=0, atol=1e-6,
                                   err_msg=name)


def test_bucket_rule_is_exact_and_matches_hf(gold):
    sides, hf = gold["bucket_sides"], gold["bucket_rows"].astype(np.int64)
    start = 0
    for n in sides.tolist():
        ours = pre.bucket_position_ids(n, 1, 70) // 70
        assert ours.tolist() == [(70 * i) // n for i in range(n)]
        if n <= 128 or n in (196, 392):
            assert ours.tolist() == hf[start:start + n].tolist(), n
        start += n
    # the tie case: at n = 28 every other row is an exact tie 70*i/28 = 2.5*i (i even) and keeps its bucket
    assert pre.bucket_position_ids(28, 1)[::2].tolist() == [70 * (5 * i // 2) for i in range(0, 28, 2)]


def test_slicing_rules():
    assert pre.slice_grid(448, 448, 448, 9) is None                 # one slice's area: not sliced
    assert pre.slice_grid(300, 500, 448, 9) is None                 # a side above 448 but a smaller area
    assert pre.slice_grid(420, 1500, 448, 9) == (1, 4)
    assert pre.slice_grid(1500, 420, 448, 9) == (4, 1)
    assert pre.slice_grid(4000, 4000, 448, 9) == (3, 3)             # capped at 9 slices
    assert pre.ensure_divide(84, 56) == 112 and pre.ensure_divide(28, 56) == 56   # round half to even, floor 56
    up = pre.plan_slices(100, 100)
    assert up.grid is None and up.overview == (448, 448)             # small images are upscaled
    with pytest.raises(ImageError, match="elongated"):
        pre.plan_slices(1, 500)
    with pytest.raises(ValueError, match="mode"):
        pre.plan_slices(10, 10, mode="8x")


# ------------------------------------------------------------------------------------ the tower

def _run(tower: MiniCPMVTower, pieces, grids):
    stages: dict[str, list[np.ndarray]] = {}

    def cb(stage, il, x):
        stages.setdefault(stage if il < 0 else f"{stage}.{il}", []).append(np.array(x, copy=True))

    outs = tower.encode(pieces, grids, cb)
    return outs, {k: np.concatenate(v) for k, v in stages.items()}


@pytest.mark.parametrize("case", TOWER_CASES, ids=[c[0] for c in TOWER_CASES])
def test_tower_stages_match_hf(case, mm, gold, gemm_path):
    """Every stage within TOL of HF on both paths: the native kernels (GEMM, attention, LayerNorm) and the numpy
    fallback."""
    name, hw, mode = case
    seed = TOWER_CASES.index(case)
    prep = pre.prepare_pieces(Image.fromarray(sample_image(*hw, seed)), mode=mode)
    tower = MiniCPMVTower(mm, threads=2, mode=mode)
    outs, stages = _run(tower, prep.pieces, prep.plan.piece_grids)
    assert [len(o) for o in outs] == prep.plan.token_counts
    merged = np.concatenate(outs)
    errors = {"merger_out": rel_err(merged[kept_rows(len(merged), OUTPUT_ROWS)], gold[f"{name}_merger_out"])}
    expected = {"patch_embd", "embeddings", "post_ln", *(f"layer_out.{i}" for i in range(mm.hparams.n_layer))}
    if mode == "16x":
        expected.add("vit_merger")
    assert expected <= set(stages)
    for stage in expected:
        x = stages[stage]
        errors[stage] = rel_err(x[kept_rows(len(x))], gold[f"{name}_{stage}"])
    assert max(errors.values()) <= TOL, errors


def test_window_attention_matches_loop_reference():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((24, 32)).astype(np.float32) + 0.1 for _ in range(3))
    out = window_attention(q, k, v, n_head=4)
    ref = np.empty_like(out, dtype=np.float64)
    for wi in range(6):
        r = slice(4 * wi, 4 * wi + 4)
        for h in range(4):
            c = slice(8 * h, 8 * h + 8)
            s = q[r, c].astype(np.float64) @ k[r, c].T.astype(np.float64) / np.sqrt(8)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            ref[r, c] = (p / p.sum(axis=1, keepdims=True)) @ v[r, c]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_window_order_groups_2x2_windows():
    """The window order (the vit_merger's and the final merger's 2x2 grouping): windows in raster order, inside
    one (0,0), (0,1), (1,0), (1,1); checked against the patch coordinates of each window."""
    gh, gw = 6, 8
    order = window_order(gh, gw)
    assert order[:8].tolist() == [0, 1, 8, 9, 2, 3, 10, 11]
    rows, cols = np.divmod(order.reshape(-1, 4), gw)
    for win, (r, c) in enumerate(zip(rows, cols, strict=True)):
        wr, wc = divmod(win, gw // 2)
        assert r.tolist() == [2 * wr, 2 * wr, 2 * wr + 1, 2 * wr + 1]
        assert c.tolist() == [2 * wc, 2 * wc + 1, 2 * wc, 2 * wc + 1]


def _two_pieces(mm, seed: int):
    rng = np.random.default_rng(seed)
    grids = [(8, 12), (4, 8)]
    return [rng.random((gh * gw, mm.hparams.patch_dim), dtype=np.float32) * 2 - 1 for gh, gw in grids], grids


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles small enough that the tiny tower's GEMMs, norms and windows are cut into many tasks."""
    monkeypatch.setattr(tower_mod, "TILE_ROWS", 32)
    monkeypatch.setattr(tower_mod, "TILE_COLS", 40)
    monkeypatch.setattr(tower_mod, "ROW_TASK", 8)


def test_tiles_cover_the_output_once():
    for m, n in [(1024, 1152), (256, 1152), (256, 4304), (5040, 4304), (16, 64), (1, 1), (260, 100)]:
        tiles = tower_mod._tiles(m, n)
        hit = np.zeros((m, n), np.int64)
        for r, c in tiles:
            hit[r, c] += 1
        assert (hit == 1).all(), (m, n)
        assert len(tiles) >= min(tower_mod.MIN_TILES, -(-n // 64)), (m, n)


@pytest.fixture(params=["native", "numpy"])
def gemm_path(request):
    """Runs a test on the native packed-weight GEMM (:mod:`engine.kernels.sgemm`) and on the numpy tiles (the
    fallback of CPUs without AVX-512, selected here by the "numpy" ISA level); the native pool gets 3 threads."""
    if request.param == "native" and not sgemm.available():
        pytest.skip("needs the native extension on an AVX-512 CPU")
    prev_isa, prev_threads = cpu.isa(), cpu.threads()
    cpu.set_isa(None if request.param == "native" else "numpy")
    cpu.set_threads(3)
    yield request.param
    cpu.set_isa(prev_isa)
    cpu.set_threads(prev_threads)


def test_tower_is_thread_invariant(mm, small_tiles, gemm_path):
    """Bit-identical output whatever the thread count: every numpy tile is the same GEMM call on any thread, and
    every native GEMM output one FMA chain whatever the task split."""
    pieces, grids = _two_pieces(mm, 5)
    one = MiniCPMVTower(mm, threads=1).encode(pieces, grids)
    assert MiniCPMVTower(mm).native == (gemm_path == "native")
    assert [o.shape for o in one] == [(6, mm.hparams.out_dim), (2, mm.hparams.out_dim)]
    for threads in (2, 3):
        many = MiniCPMVTower(mm, threads=threads).encode(pieces, grids)
        for a, b in zip(one, many, strict=True):
            np.testing.assert_array_equal(a, b)


def test_native_gemm_tower_equals_numpy_tower(mm):
    """The native GEMM changes only float32 rounding: both towers agree far below the conformance bound."""
    if not sgemm.available():
        pytest.skip("needs the native extension on an AVX-512 CPU")
    pieces, grids = _two_pieces(mm, 8)
    native = np.concatenate(MiniCPMVTower(mm, threads=2).encode(pieces, grids))
    prev = cpu.isa()
    try:
        cpu.set_isa("numpy")
        reference = np.concatenate(MiniCPMVTower(mm, threads=2).encode(pieces, grids))
    finally:
        cpu.set_isa(prev)
    assert rel_err(native, reference) <= 2e-6


def test_tiling_only_reshapes_the_gemms(mm, monkeypatch):
    """The numpy tiles change only how the GEMMs are cut (float32 rounding, far below the conformance bound)."""
    monkeypatch.setattr(tower_mod.sgemm, "available", lambda: False)
    pieces, grids = _two_pieces(mm, 6)
    ref = np.concatenate(MiniCPMVTower(mm, threads=2).encode(pieces, grids))
    for rows, cols in [(32, 40), (16, 64)]:
        monkeypatch.setattr(tower_mod, "TILE_ROWS", rows)
        monkeypatch.setattr(tower_mod, "TILE_COLS", cols)
        assert rel_err(np.concatenate(MiniCPMVTower(mm, threads=2).encode(pieces, grids)), ref) <= 1e-6


def test_stacked_pieces_equal_separate_ones(mm, small_tiles, gemm_path):
    """Pieces encoded together (one stack, shared GEMMs) give what each gives alone: no attention across pieces,
    windows and merges inside each piece. The native GEMM gives the same bits (a row's sums do not depend on the
    other rows); the numpy tiles cut the GEMMs differently (float32 rounding)."""
    pieces, grids = _two_pieces(mm, 7)
    tower = MiniCPMVTower(mm, threads=2)
    together = tower.encode(pieces, grids)
    for piece, grid, out in zip(pieces, grids, together, strict=True):
        if gemm_path == "native":
            np.testing.assert_array_equal(out, tower.encode_piece(piece, grid))
        else:
            assert rel_err(out, tower.encode_piece(piece, grid)) <= 1e-6


def test_cancel_between_layers(mm):
    tower = MiniCPMVTower(mm)
    cancel = threading.Event()
    seen = []

    def cb(stage, il, x):
        seen.append((stage, il))
        if stage == "layer_out" and il == 1:
            cancel.set()

    with pytest.raises(GenerationCancelled):
        tower.encode_piece(np.ones((16, mm.hparams.patch_dim), np.float32) * 0.3, (4, 4), cb, cancel)
    assert ("layer_out", 2) not in seen and ("layer_out", 1) in seen


def test_tower_rejects_mismatched_grid(mm):
    tower = MiniCPMVTower(mm)
    with pytest.raises(ValueError, match="do not fit grid"):
        tower.encode_piece(np.zeros((16, mm.hparams.patch_dim), np.float32), (2, 8))
    with pytest.raises(ValueError, match="do not fit grid"):
        tower.encode_piece(np.zeros((12, mm.hparams.patch_dim), np.float32), (4, 4))


# ------------------------------------------------------------------------------------ prompt layout, encoder

def test_image_layout_of_a_sliced_image():
    plan = pre.plan_slices(768, 1024)                                   # overview + 2x2 slices, 63 tokens each
    layout = image_layout(plan, 0)
    assert layout == ["<image_id>0</image_id><image>", 63, "</image><slice>", 63, "</slice><slice>", 63,
                      "</slice>\n<slice>", 63, "</slice><slice>", 63, "</slice>"]
    assert image_layout(pre.plan_slices(448, 448), 2) == ["<image_id>2</image_id><image>", 64, "</image>"]
    ids, starts = expand_layout(layout, lambda s: [ord(c) for c in s], pad_id=7)
    assert [ids[s:s + 63] == [7] * 63 for s in starts] == [True] * 5
    assert ids.count(7) == 315 and "".join(chr(i) for i in ids if i != 7).endswith("</slice>")


def test_image_encoder_runs_all_pieces_and_caches(mm):
    """engine.vision.encoder.ImageEncoder drives the registry tower: one prepared image holds every piece."""
    enc = ImageEncoder(LoadedVision(MINICPMV, mm))
    img = Image.fromarray(sample_image(700, 700, 3))
    first = enc.encode(img)
    again = enc.encode(img)
    plan = enc.tower.plan(700, 700)
    assert not first.from_cache and again.from_cache
    assert first.n_tokens == sum(plan.token_counts) == 320 and first.grid == (1, 320)
    assert first.size == plan.overview and first.original_size == (700, 700)
    ref = MiniCPMVTower(mm).encode(pre.prepare_pieces(img).pieces, plan.piece_grids)
    np.testing.assert_array_equal(first.embeddings, np.concatenate(ref))
    four_file = mp_test.synth_mmproj(mm.path.with_name("m4.gguf"), **{**MMPROJ, "scale_factor": 2})
    four = ImageEncoder(LoadedVision(MINICPMV, mp.load_mmproj(four_file)))
    assert four.tower.identity != enc.tower.identity and four.encode(img).n_tokens == 4 * 320


def test_engine_prompt_lays_out_slices(synth_model, tmp_path):
    """Engine.load picks the minicpmv folder by clip.projector_type; the prompt holds HF's layout with one span
    per piece, sequential positions, and the image digest in every span's prefix-cache key."""
    from engine.api import Engine, EngineOptions
    from engine.testing.pairs import synth_mmproj_for

    text = synth_model("minicpmv46-tiny", "q8_0")
    proj = synth_mmproj_for(tmp_path / "m-mmproj.gguf", "minicpmv46-tiny")
    engine = Engine.load(text, proj, options=EngineOptions(context=2048, device="cpu"))
    try:
        img = Image.fromarray(sample_image(700, 700, 3))
        msg = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "What?"}]}]
        prompt = engine.prepare(msg)
        tok = engine.tokenizer
        assert len(prompt.images) == 5 and [len(e) for _, e, _ in prompt.images] == [64] * 5
        info = engine.image_info(img)                      # the app's thumbnail count: every piece's tokens
        assert (info.tokens, info.pieces) == (5 * 64, 5)
        pad = tok.token_id("<|image_pad|>")
        for start, emb, _ in prompt.images:
            assert prompt.tokens[start:start + len(emb)] == [pad] * len(emb) and prompt.tokens[start + len(emb)] != pad
        text_between = tok.decode(prompt.tokens[prompt.images[0][0] + 64:prompt.images[3][0]])
        assert text_between.startswith("</image><slice>") and "</slice>\n<slice>" in text_between
        assert "<image_id>0</image_id><image>" in tok.decode(prompt.tokens[:prompt.images[0][0]])
        markers = {m: tok.token_id(m) for m in MINICPMV46_MARKERS}      # one special token each, as in HF
        for m, i in markers.items():
            assert tok.encode(m) == [i] and tok.decode([i]) == m
        head = prompt.tokens[:prompt.images[0][0]]
        assert head[-1] == markers["<image>"] and markers["<image_id>"] in head and markers["</image_id>"] in head
        after = [prompt.tokens[s + len(e)] for s, e, _ in prompt.images]
        assert after == [markers["</image>"]] + [markers["</slice>"]] * 4
        assert [prompt.tokens[s - 1] for s, _, _ in prompt.images[1:]] == [markers["<slice>"]] * 4
        np.testing.assert_array_equal(prompt.positions, np.repeat(np.arange(len(prompt.tokens))[None], 3, 0))
        keys = {k for _, _, k in prompt.images}
        other = engine.prepare([{"role": "user", "content": [{"type": "image", "image": Image.fromarray(
            sample_image(700, 700, 4))}, {"type": "text", "text": "What?"}]}])
        assert len(keys) == 1 and keys.isdisjoint({k for _, _, k in other.images})
        events = list(engine.chat(msg, SamplingParams(max_tokens=3, temperature=0.0)))
        assert sum(1 for e in events if isinstance(e, TokenEvent)) == 3
    finally:
        engine.close()


def test_cli_generate_answers_on_the_synth_pair(synth_model, tmp_path, capsys):
    """Issue 16's "done when" command: ``python -m engine generate --model m.gguf --mmproj m-mmproj.gguf --image
    photo.jpg --prompt ...`` on a synth pair answers, printing the overview's size and the image's token count (a
    1024x768 JPEG: a 504x392 overview and 2x2 slices, 315 tokens in 16x mode, as HF's processor counts it); a truncated
    JPEG is a
    one-line error naming the file."""
    from engine.__main__ import main
    from engine.testing.pairs import synth_mmproj_for

    text = synth_model("minicpmv46-tiny", "q8_0")
    proj = synth_mmproj_for(tmp_path / "m-mmproj.gguf", "minicpmv46-tiny")
    photo = tmp_path / "photo.jpg"
    Image.fromarray(sample_image(768, 1024, 5)).save(photo, quality=90)
    ask = ["generate", "--model", str(text), "--mmproj", str(proj), "-p", "What is in the picture?", "-n", "4",
           "--temp", "0"]
    assert main([*ask, "--image", str(photo)]) == 0
    out, err = capsys.readouterr()
    assert f"[image {photo}: 504x392 px overview + 4 slices reach the vision tower, 315 image tokens]" in err
    assert out.strip() and "decode" in err
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(photo.read_bytes()[:600])
    assert main([*ask, "--image", str(broken)]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and "broken.jpg" in lines[-1] and "Traceback" not in err


def test_synth_markers_only_in_the_minicpmv_vocabulary():
    """The minicpmv46 synth vocabulary is Qwen3.5's plus the six layout markers (control tokens, unused ids before);
    the qwen35 vocabulary is unchanged."""
    base, ours = qwen35_vocab(), minicpmv46_vocab()
    changed = [i for i, (a, b) in enumerate(zip(base.tokens, ours.tokens, strict=True)) if a != b]
    assert [ours.tokens[i] for i in changed] == list(MINICPMV46_MARKERS)
    assert all(base.tokens[i] == f"[PAD{i}]" for i in changed)
    assert {ours.token_types[i] for i in changed} == {int(gguf.TokenType.CONTROL)}
    assert not set(MINICPMV46_MARKERS) & set(base.tokens)
    assert ours.merges == base.merges


# ------------------------------------------------------------------------------------ end to end

def test_image_prompt_logits_match_hf(tmp_path):
    """An image question through the engine's text model against HF's MiniCPMV4_6ForConditionalGeneration:
    the prompt laid out by image_layout (a 2x2-sliced image: overview + 4 slice runs of pads), the pieces'
    rows spliced over the pads, sequential positions; logits after STOPS tokens and at the end."""
    import threading as th

    from engine.arch.qwen35.model import Qwen35Model
    from engine.turn.runtime import prefill
    from engine.turn.state import SequenceState

    gold = np.load(FIXTURES / "golden.npz")
    gguf = open_text(FIXTURES / "tiny-qwen35-f16.gguf")
    model = Qwen35Model(gguf.hparams, gguf.file)
    mm = mp.load_mmproj(mp_test.synth_mmproj(tmp_path / "m.gguf", **MMPROJ))
    name, (h, w), seed = E2E_IMAGE
    encoder = ImageEncoder(LoadedVision(MINICPMV, mm))
    enc = encoder.encode(Image.fromarray(sample_image(h, w, seed)))
    plan = encoder.tower.plan(h, w)
    layout_tokens, starts = expand_layout(image_layout(plan, 0), layout_ids, IMAGE_PAD)
    ids = gold["e2e_ids"]
    head = E2E_TEXT[0]
    assert ids[head:head + len(layout_tokens)].tolist() == layout_tokens
    rows_of = np.split(enc.embeddings, np.cumsum(plan.token_counts)[:-1])
    spans = [(head + s, e, b"image") for s, e in zip(starts, rows_of, strict=True)]
    positions = sequential_positions(ids, [], IMAGE_PAD, -1)
    rows: dict[int, np.ndarray] = {}
    last = prefill(model, ids.tolist(), SequenceState.new(model.hp, len(ids) + 8), th.Event(), list(STOPS),
                   lambda pos, logits: rows.__setitem__(pos, logits.copy()), positions, spans)
    ours = np.stack([rows[k] for k in STOPS] + [last])
    ref = gold["e2e_logits"]
    err = float(np.abs(ours - ref).max() / np.abs(ref).max())
    assert err <= TOL, err
    no_image = prefill(model, ids.tolist(), SequenceState.new(model.hp, len(ids) + 8), th.Event())
    assert float(np.abs(no_image - ref[-1]).max() / np.abs(ref).max()) > 100 * TOL   # the image rows matter
