"""Prefix snapshot cache: keys, restore, eviction and the disk tier (model-free parts).

End-to-end checks (greedy tokens after a restore equal a cold prefill) live in test_engine_api.py.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from engine.arch.qwen35.hparams import Qwen35HParams
from engine.turn.prefix_cache import PrefixCache, chain_keys
from engine.turn.snapshot import FORMAT_MAGIC
from engine.turn.state import SequenceState

HP = Qwen35HParams(arch="qwen35moe", n_layer=4, nextn_predict_layers=0, n_embd=16, n_vocab=50,
                   context_length=256, rms_eps=1e-6, n_head=2, n_head_kv=1, head_dim=8, rope_theta=1e7,
                   rope_dims=4, rope_sections=(1, 1, 0, 0), full_attention_interval=4, conv_kernel=4,
                   head_k_dim=4, num_k_heads=1, num_v_heads=2, head_v_dim=4, n_expert=4,
                   n_expert_used=2, n_ff_exp=8, n_ff_shexp=8)


def filled_state(rng: np.random.Generator, pos: int, capacity: int = 64) -> SequenceState:
    """A state at ``pos`` with random (non-zero) contents, standing in for a real prefill."""
    s = SequenceState.new(HP, capacity)
    for table in (s.conv, s.ssm):
        for a in table.values():
            a[...] = rng.normal(size=a.shape) + 0.5
    for table in (s.k, s.v):
        for a in table.values():
            a[:pos] = rng.normal(size=(pos,) + a.shape[1:]) + 0.5
    s.pos = pos
    return s


def assert_same(a: SequenceState, b: SequenceState) -> None:
    assert a.pos == b.pos
    for ta, tb in ((a.conv, b.conv), (a.ssm, b.ssm)):
        for il in ta:
            np.testing.assert_array_equal(ta[il], tb[il])
    for ta, tb in ((a.k, b.k), (a.v, b.v)):
        for il in ta:
            np.testing.assert_array_equal(ta[il][: a.pos], tb[il][: b.pos])


def test_chain_keys_name_model_tokens_and_images() -> None:
    toks = [5, 9, 2, 7]
    k = chain_keys("model-a", toks)
    assert len(k) == 5 and len(set(k)) == 5
    assert chain_keys("model-a", toks[:2]) == k[:3]                  # a prefix has the prefix's keys
    assert chain_keys("model-b", toks)[2] != k[2]                     # another model file: no reuse
    assert chain_keys("model-a", [5, 8, 2, 7])[1] == k[1]            # an edit changes keys from there on
    assert chain_keys("model-a", [5, 8, 2, 7])[2] != k[2]
    img = chain_keys("model-a", toks, {1: b"digest-1"})
    assert img[1] == k[1] and img[2] != k[2]                          # an image enters the key at its position
    assert chain_keys("model-a", toks, {1: b"digest-2"})[2] != img[2]  # a changed image at the same position


def test_lookup_restores_deepest_snapshot_exactly() -> None:
    rng = np.random.default_rng(0)
    cache = PrefixCache(HP, "m")
    toks = rng.integers(0, 50, 40).tolist()
    keys = chain_keys("m", toks)
    s10, s25 = filled_state(rng, 10), filled_state(rng, 25)
    cache.put(keys[10], s10, toks[:10], None)
    cache.put(keys[25], s25, toks[:25], None)
    hit = cache.lookup(toks + [1, 2], capacity=64)
    assert hit.reused == 25 and hit.logits is None
    assert_same(hit.state, s25)
    edited = toks[:17] + [49] + toks[18:]
    hit = cache.lookup(edited, capacity=64)
    assert hit.reused == 10                                          # reuse stops before the edit
    assert_same(hit.state, s10)
    assert hit.diverge == 17                                         # and the runtime snapshots where it parts
    assert cache.lookup([3, 3, 3], capacity=64).reused == 0


def test_exact_repeat_returns_logits_and_needs_them() -> None:
    rng = np.random.default_rng(1)
    cache = PrefixCache(HP, "m")
    toks = rng.integers(0, 50, 12).tolist()
    keys = chain_keys("m", toks)
    cache.put(keys[12], filled_state(rng, 12), toks, None)
    assert cache.lookup(toks, 64).reused == 0                        # no logits: cannot skip the forward
    logits = rng.normal(size=50).astype(np.float32)
    cache.put(keys[12], filled_state(rng, 12), toks, logits)
    hit = cache.lookup(toks, 64)
    assert hit.reused == 12
    np.testing.assert_array_equal(hit.logits, logits)


def test_ram_budget_evicts_least_recently_used() -> None:
    rng = np.random.default_rng(2)
    toks = rng.integers(0, 50, 30).tolist()
    keys = chain_keys("m", toks)
    one = PrefixCache(HP, "m").put(keys[5], filled_state(rng, 5), toks[:5], None).nbytes
    cache = PrefixCache(HP, "m", ram_budget=int(2.5 * one))
    for pos in (5, 6, 7):
        cache.put(keys[pos], filled_state(rng, pos), toks[:pos], None)
    positions = sorted(s.pos for s in cache.snapshots())
    assert positions == [6, 7]
    assert cache.ram_bytes <= 2.5 * one


def test_disk_tier_survives_restart(tmp_path) -> None:
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 50, 20).tolist()
    keys = chain_keys("m", toks)
    state = filled_state(rng, 20)
    logits = rng.normal(size=50).astype(np.float32)
    cache = PrefixCache(HP, "m", disk_dir=tmp_path)
    cache.put(keys[20], state, toks, logits, conversation="c1")
    cache.persist()
    again = PrefixCache(HP, "m", disk_dir=tmp_path)
    [info] = again.snapshots()
    assert (info.tier, info.pos, info.conversation) == ("disk", 20, "c1")
    hit = again.lookup(toks, 64)
    assert hit.reused == 20
    assert_same(hit.state, state)
    np.testing.assert_array_equal(hit.logits, logits)


def test_spill_to_disk_when_ram_is_full(tmp_path) -> None:
    rng = np.random.default_rng(4)
    toks = rng.integers(0, 50, 30).tolist()
    keys = chain_keys("m", toks)
    cache = PrefixCache(HP, "m", ram_budget=1, disk_dir=tmp_path)
    s = filled_state(rng, 9)
    cache.put(keys[9], s, toks[:9], None)
    assert [i.tier for i in cache.snapshots()] == ["disk"]
    hit = cache.lookup(toks, 64)
    assert hit.reused == 9
    assert_same(hit.state, s)


@pytest.mark.parametrize("damage", ["truncate", "flip", "magic", "other_model"])
def test_damaged_or_foreign_file_is_ignored_with_a_log_line(tmp_path, caplog, damage) -> None:
    rng = np.random.default_rng(5)
    toks = rng.integers(0, 50, 16).tolist()
    cache = PrefixCache(HP, "m", disk_dir=tmp_path)
    cache.put(chain_keys("m", toks)[16], filled_state(rng, 16), toks, None)
    cache.persist()
    [path] = list(tmp_path.rglob("*.snap"))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "magic":
        data[: len(FORMAT_MAGIC)] = b"NOTASNAP"
    path.write_bytes(bytes(data))
    identity = "another-model" if damage == "other_model" else "m"
    if damage == "other_model":   # the same folder, as if two files shared an identity hash prefix
        target = PrefixCache(HP, identity, disk_dir=tmp_path)._disk
        target.mkdir(parents=True, exist_ok=True)
        path.rename(target / path.name)
    with caplog.at_level(logging.WARNING, logger="engine.turn.prefix_cache"):
        again = PrefixCache(HP, identity, disk_dir=tmp_path)
    assert again.snapshots() == []
    assert again.lookup(toks, 64).reused == 0
    assert any("ignoring" in r.getMessage() for r in caplog.records)


def test_clear_one_and_all(tmp_path) -> None:
    rng = np.random.default_rng(6)
    toks = rng.integers(0, 50, 20).tolist()
    keys = chain_keys("m", toks)
    cache = PrefixCache(HP, "m", disk_dir=tmp_path)
    for pos in (4, 8, 12):
        cache.put(keys[pos], filled_state(rng, pos), toks[:pos], None)
    cache.persist()
    deepest = cache.snapshots()[0]
    cache.clear(deepest.key)
    assert [i.pos for i in cache.snapshots()] == [8, 4]
    cache.clear()
    assert cache.snapshots() == [] and list(tmp_path.rglob("*.snap")) == []
    assert PrefixCache(HP, "m", disk_dir=tmp_path).snapshots() == []


def retamper(path, edit) -> None:
    """Apply ``edit(meta)`` to a snapshot file's JSON header and recompute its checksum, as a hostile
    user (or another build) could."""
    import hashlib
    import json
    import struct
    data = path.read_bytes()
    start = len(FORMAT_MAGIC) + 8
    (n_head,) = struct.unpack_from("<Q", data, len(FORMAT_MAGIC))
    meta = json.loads(data[start:start + n_head])
    edit(meta)
    head = json.dumps(meta).encode()
    payload = data[start + n_head:-32]
    path.write_bytes(FORMAT_MAGIC + struct.pack("<Q", len(head)) + head + payload
                     + hashlib.sha256(head + payload).digest())


def _set(key, value):
    def edit(meta):
        meta[key] = value
    return edit


def _array(name, entry):
    def edit(meta):
        meta["arrays"][name] = entry
    return edit


def _drop(name):
    def edit(meta):
        del meta["arrays"][name]
    return edit


TAMPERS = {
    "pos 10^12": _set("pos", 10**12), "pos 0": _set("pos", 0), "pos a string": _set("pos", "16"),
    "pos shorter": _set("pos", 15), "arrays null": _set("arrays", None), "header a list": b"[1, 2]",
    "header nested 10^5 deep": b"[" * 100_000 + b"]" * 100_000, "hits infinite": _set("hits", float("inf")),
    "created 10^400": _set("created", 10**400),
    "another dtype": _array("conv.0", ["<f8", [3, 16]]), "another shape": _array("ssm.0", ["<f4", [2, 4, 5]]),
    "a layer missing": _drop("k.3"), "an extra array": _array("conv.3", ["<f4", [3, 16]]),
    "images not hex": _set("images", {"2": "zz"}), "images a list": _set("images", [1]),
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_tampered_header_with_a_valid_checksum_is_skipped(tmp_path, caplog, tamper) -> None:
    rng = np.random.default_rng(8)
    toks = rng.integers(0, 50, 16).tolist()
    cache = PrefixCache(HP, "m", disk_dir=tmp_path)
    cache.put(chain_keys("m", toks)[16], filled_state(rng, 16), toks, None)
    cache.put(chain_keys("m", toks)[8], filled_state(rng, 8), toks[:8], None)
    cache.persist()
    [path] = [p for p in tmp_path.rglob("*.snap") if p.stem == chain_keys("m", toks)[16].hex()]
    edit = TAMPERS[tamper]
    if isinstance(edit, bytes):
        import hashlib
        import struct
        head = edit
        path.write_bytes(FORMAT_MAGIC + struct.pack("<Q", len(head)) + head + hashlib.sha256(head).digest())
    else:
        retamper(path, edit)
    with caplog.at_level(logging.WARNING, logger="engine.turn.prefix_cache"):
        again = PrefixCache(HP, "m", disk_dir=tmp_path)
    assert [s.pos for s in again.snapshots()] == [8]           # the tampered one is not listed
    assert again.lookup(toks + [1], 64).reused == 8             # nor restored; the other one is
    assert sum("ignoring" in r.getMessage() for r in caplog.records) == 1


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch, caplog) -> None:
    import os
    rng = np.random.default_rng(9)
    toks = rng.integers(0, 50, 12).tolist()
    cache = PrefixCache(HP, "m", disk_dir=tmp_path)
    cache.put(chain_keys("m", toks)[12], filled_state(rng, 12), toks, None)

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with caplog.at_level(logging.WARNING, logger="engine.turn.prefix_cache"):
        cache.persist()
    assert list(tmp_path.rglob("*.tmp")) == [] and list(tmp_path.rglob("*.snap")) == []
    assert any("No space left" in r.getMessage() for r in caplog.records)


def test_temporary_files_of_a_crashed_write_are_swept_at_start(tmp_path) -> None:
    cache = PrefixCache(HP, "m", disk_dir=tmp_path)
    cache._disk.mkdir(parents=True)
    (cache._disk / "tmpabc123.tmp").write_bytes(b"partial")
    os.utime(cache._disk / "tmpabc123.tmp", (0, 0))          # a crashed write's, not one in flight
    PrefixCache(HP, "m", disk_dir=tmp_path)
    assert list(tmp_path.rglob("*.tmp")) == []
