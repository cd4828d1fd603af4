"""F16 KV cache: the attention kernels read half rows (widened exactly) and the decode step writes them
rounded to nearest even, as numpy's ``astype(float16)`` does.

So an F16 cache must give exactly the bits of an F32 cache holding the same rounded values, at every
ISA level and thread count and for every split of a prompt (decode = prefill: the step's rounding in C
must store the halves numpy's prefill stores). Tolerance vs the
float64 reference on the rounded values: that of tests/test_attention_prefill.py (1e-5 of max |ref|),
since the arithmetic after widening is the F32 kernel's.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.arch.qwen35 import cpu_mixers
from engine.kernels import cpu
from engine.registry import open_text
from engine.turn.state import SequenceState

pytestmark = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")

REL_TOL = 1e-5



def halves(rng, m, n_kv, hd):
    k = rng.standard_normal((m, n_kv, hd)).astype(np.float16)
    v = (rng.uniform(0.1, 2.0, (m, n_kv, hd)) * rng.choice([-1, 1], (m, n_kv, hd))).astype(np.float16)
    return k, v


@pytest.mark.parametrize("m, n, n_head, n_kv, hd", [(37, 37, 8, 2, 64), (531, 259, 8, 8, 48), (300, 1, 16, 2, 256)])
def test_f16_cache_gives_the_bits_of_f32_rows_holding_its_values(isa_reset, m, n, n_head, n_kv, hd):
    rng = np.random.default_rng(m + n)
    q = rng.standard_normal((n, n_head, hd)).astype(np.float32) * 2.5
    gate = rng.standard_normal((n, n_head, hd)).astype(np.float32)
    k, v = halves(rng, m, n_kv, hd)
    assert_cache_gives_f32_bits(q, gate, k, v, k.astype(np.float32), v.astype(np.float32))


def assert_cache_gives_f32_bits(q: np.ndarray, gate: np.ndarray, k: np.ndarray, v: np.ndarray, k32: np.ndarray,
                                v32: np.ndarray) -> None:
    """Attention over the stored rows ``k``, ``v`` (F16 or Q8_0) gives, at every native level and 1-2 threads,
    the bits of the same attention over F32 rows ``k32``, ``v32`` holding their values (prefill, and decode
    of the last query); within REL_TOL of the numpy reference over ``k32``, ``v32``."""
    n, m = len(q), len(k)
    ref = np.stack([cpu_mixers.attention_decode_np(q[i], gate[i], k32[:m - n + i + 1], v32[:m - n + i + 1])
                    for i in range(n)])
    for level in cpu.supported_isas():
        if level == "numpy":
            continue
        cpu.set_isa(level)
        for threads in (1, 2):
            cpu.set_threads(threads)
            got = cpu_mixers.attention_prefill(q, gate, k, v)
            assert np.array_equal(got, cpu_mixers.attention_prefill(q, gate, k32, v32)), (level, threads)
            last = cpu_mixers.attention_decode(q[-1], gate[-1], k, v)
            assert np.array_equal(last, got[-1]), (level, threads)
            assert np.array_equal(last, cpu_mixers.attention_decode(q[-1], gate[-1], k32, v32))
    assert np.abs(got - ref).max() <= REL_TOL * np.abs(ref).max()


def test_mixed_or_unknown_cache_types_are_refused():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    k, v = halves(rng, 8, 2, 16)
    with pytest.raises(ValueError, match="float16"):
        cpu_mixers.attention_decode(q, q, k, v.astype(np.float32))
    with pytest.raises(ValueError, match="float16"):
        cpu_mixers.attention_decode(q, q, k.astype(np.float64), v.astype(np.float64))


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    from engine.arch.qwen35.cpu import NativeQwen35Model
    from engine.testing.synth import synth
    path = tmp_path_factory.mktemp("kvf16") / "tiny.gguf"
    synth(path, "tiny", quant="q8_0", seed=5)
    text = open_text(path)
    yield NativeQwen35Model(text.hparams, text.file)
    cpu.set_isa(None)
    cpu.set_threads()


def run(model, tokens, cuts, kv_type):
    state = SequenceState.new(model.hp, 64, kv_type)
    for a, b in zip([0] + cuts, cuts + [len(tokens)]):
        logits = model.forward(tokens[a:b], state)[-1]
    return logits, state


def test_f16_state_is_split_invariant_and_decode_rounds_as_numpy(native):
    """One pass, random cuts and token-by-token decode (the native step, which rounds the rows in C)
    give the same logits and the same stored half rows; the F32 run differs only by the rounding."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, native.hp.n_vocab, 40)
    want, ws = run(native, tokens, [], "f16")
    assert native.step is not None and native.step.takes(1, None)
    for cuts in ([17, 18, 30], list(range(1, 40)), [5]):
        got, gs = run(native, tokens, cuts, "f16")
        assert np.array_equal(got, want), cuts
        for il in ws.k:
            assert gs.k[il].dtype == np.float16
            assert np.array_equal(gs.k[il].view(np.uint16), ws.k[il].view(np.uint16))
            assert np.array_equal(gs.v[il].view(np.uint16), ws.v[il].view(np.uint16))
    f32, fs = run(native, tokens, [], "f32")
    for il in ws.k:
        assert np.array_equal(fs.k[il][:40].astype(np.float16), ws.k[il][:40])
    assert not np.array_equal(f32, want)



def test_f16_snapshots_round_trip_and_other_kv_types_are_a_miss(tmp_path, caplog):
    """An F16 cache writes its KV rows as ``<f2`` and restores them bit for bit; the same folder opened
    by an F32 cache ignores those files (a miss with a log line), and a state of the wrong type is refused."""
    import shutil

    from engine.turn.prefix_cache import PrefixCache, chain_keys, snapshot_folder
    from tests.test_prefix_cache import HP, filled_state
    rng = np.random.default_rng(2)
    toks = rng.integers(0, 50, 20).tolist()
    key = chain_keys("m", toks)[-1]
    src = filled_state(rng, 20)
    state = SequenceState.new(HP, 64, "f16")
    state.pos = 20
    for table, other in ((state.conv, src.conv), (state.ssm, src.ssm), (state.k, src.k), (state.v, src.v)):
        for il in table:
            table[il][...] = other[il]
    cache = PrefixCache(HP, "m", disk_dir=tmp_path, kv_type="f16")
    with pytest.raises(ValueError, match="KV type"):
        cache.put(key, src, toks, None)
    cache.put(key, state, toks, None)
    cache.persist()
    hit = PrefixCache(HP, "m", disk_dir=tmp_path, kv_type="f16").lookup(toks + [1], 64)
    assert hit.reused == 20 and hit.state.kv_type == "f16"
    for il in state.k:
        assert np.array_equal(hit.state.k[il][:20].view(np.uint16), state.k[il][:20].view(np.uint16))
        assert np.array_equal(hit.state.v[il][:20].view(np.uint16), state.v[il][:20].view(np.uint16))
    f16_dir, f32_dir = snapshot_folder(tmp_path, "m", "f16"), snapshot_folder(tmp_path, "m")
    shutil.copytree(f16_dir, f32_dir)       # each KV type has its folder: put F16 files where F32 ones go
    with caplog.at_level("WARNING"):
        f32 = PrefixCache(HP, "m", disk_dir=tmp_path)
    assert f32.lookup(toks + [1], 64).reused == 0
    assert "'<f2'" in caplog.text and "expected ['<f4'" in caplog.text


def _as(state: SequenceState, hp, kv_type: str) -> SequenceState:
    """``state``'s contents in a state of ``kv_type`` (KV rows rounded to it)."""
    out = SequenceState.new(hp, state.k[next(iter(state.k))].shape[0], kv_type)
    out.pos = state.pos
    for table, other in ((out.conv, state.conv), (out.ssm, state.ssm), (out.k, state.k), (out.v, state.v)):
        for il in table:
            table[il][...] = other[il]
    return out


def test_f16_and_f32_caches_over_one_folder_keep_their_own_files(tmp_path):
    """Caches of both KV types on one disk folder (the app switched ``kv_type`` and back) each keep and restore
    their own snapshots and pages of the same prefix: neither takes the other's file for its own."""
    import dataclasses

    from engine.turn.prefix_cache import PrefixCache, chain_keys
    from engine.turn.state import KV_PAGE_ROWS
    from tests.test_prefix_cache import HP
    hp = dataclasses.replace(HP, context_length=2 * KV_PAGE_ROWS)
    rng = np.random.default_rng(5)
    n, cap = KV_PAGE_ROWS + 20, KV_PAGE_ROWS + 28                  # one whole page and a tail
    toks = rng.integers(0, 50, n).tolist()
    keys = chain_keys("m", toks)
    src = SequenceState.new(hp, cap)
    for table in (src.conv, src.ssm, src.k, src.v):
        for a in table.values():
            a[...] = rng.normal(size=a.shape) + 0.5
    src.pos = n
    for kv_type in ("f32", "f16", "f32"):
        cache = PrefixCache(hp, "m", disk_dir=tmp_path, kv_type=kv_type)
        cache.put(keys[-1], _as(src, hp, kv_type), toks, None, keys=keys)
        cache.persist()
    for kv_type in ("f16", "f32"):
        hit = PrefixCache(hp, "m", disk_dir=tmp_path, kv_type=kv_type).lookup(toks + [1], cap)
        want = _as(src, hp, kv_type)
        assert hit.reused == n and hit.state.kv_type == kv_type
        for il in want.k:
            assert np.array_equal(hit.state.k[il][:n], want.k[il][:n])
            assert np.array_equal(hit.state.v[il][:n], want.v[il][:n])
