"""GGUFFile: opening synth files of every preset, accessors against full dequantization, fused
variants, summaries, and the memory map (opening a ~1 GB file must not read it).

Accessor checks are exact: ``expert``/``row``/``raw`` slices must equal the same slice of ``f32``
bit for bit (the same bytes go through the same dequantizer).
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct

import numpy as np
import psutil
import pytest
from gguf import GGMLQuantizationType as Q

from engine.gguf import quant
from engine.errors import UnsupportedModelError
from engine.gguf.file import GGUFFile
from engine.registry import open_text
from engine.arch.qwen35.tensors import tensor_shapes
from engine.testing.synth import preset_hparams, synth, write_gguf

VOCAB = [f"tok{i}" for i in range(320)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(preset, quant) -> path of a synth file with the small fake vocabulary."""
    folder = tmp_path_factory.mktemp("gguf_file")
    made = {}

    def make(preset="tiny", q="q4_0", **kw):
        key = (preset, q, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = folder / f"{preset}-{q}-{len(made)}.gguf"
            synth(made[key], preset, quant=q, vocab=VOCAB, **kw)
        return made[key]

    return make


def stored(hp):
    """``hp`` as read back: the f32 keys (rms eps, rope theta) round to float32."""
    return dataclasses.replace(hp, rms_eps=float(np.float32(hp.rms_eps)), rope_theta=float(np.float32(hp.rope_theta)))


@pytest.fixture
def rng():
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    print(f"random seed {seed}")
    return np.random.default_rng(seed)


@pytest.mark.parametrize("preset,kw", [("tiny", {}), ("small", {}), ("dense-tiny", {}),
                                       ("35b-a3b", {"layers": 4, "experts": 2})])
def test_open_every_preset(files, preset, kw):
    path = files(preset, **kw)
    text = open_text(path)
    f = text.file
    want = preset_hparams(preset, len(VOCAB), kw.get("layers"), kw.get("experts"))
    assert text.hparams == stored(want)
    assert text.hparams.arch == want.arch and f.path == path and f.source == str(path)
    assert set(f.tensor_names) == set(tensor_shapes(want))
    for name, ne in tensor_shapes(want).items():
        info = f.info(name)
        assert info.ne == ne and info.shape == ne[::-1]
        assert info.nbytes == math.prod(ne[1:]) * quant.row_bytes(info.qtype, ne[0])
    assert f.meta("general.architecture") == want.arch
    assert f.meta("tokenizer.ggml.tokens") == VOCAB
    assert f.meta("no.such.key", 7) == 7


def test_identity_is_stable_and_content_sensitive(files):
    a, b = files("tiny"), files("tiny", seed=1)
    assert GGUFFile.open(a).identity == GGUFFile.open(a).identity
    assert GGUFFile.open(a).identity != GGUFFile.open(b).identity
    assert GGUFFile.open(a).identity.startswith(f"gguf-{a.stat().st_size}-")


@pytest.mark.parametrize("q", ["q4_0", "q8_0", "f16", "f32"])
def test_expert_row_raw_are_slices_of_f32(files, rng, q):
    text = open_text(files("tiny", q))
    f = text.file
    hp = text.hparams
    for part in ("gate", "up", "down"):
        name = f"blk.{rng.integers(hp.n_layer)}.ffn_{part}_exps.weight"
        full = f.f32(name)
        assert full.shape == f.info(name).shape and full.dtype == np.float32
        for e in rng.choice(hp.n_expert, 3, replace=False):
            np.testing.assert_array_equal(f.expert(name, int(e)), full[e])
    emb = f.f32("token_embd.weight")
    for i in rng.choice(hp.n_vocab, 5, replace=False):
        np.testing.assert_array_equal(f.row("token_embd.weight", int(i)), emb[i])
    ids = rng.integers(0, hp.n_vocab, 40)   # with repeats
    np.testing.assert_array_equal(f.rows("token_embd.weight", ids), emb[ids])
    assert f.rows("token_embd.weight", ids[:0]).shape == (0, hp.n_embd)
    name = "blk.0.attn_qkv.weight"
    raw = f.raw(name)
    info = f.info(name)
    assert raw.dtype == np.uint8 and raw.shape == (info.ne[1], quant.row_bytes(info.qtype, info.ne[0]))
    assert not raw.flags.writeable
    np.testing.assert_array_equal(quant.dequantize(raw, info.qtype, info.shape), f.f32(name))
    assert f.raw("blk.0.ffn_down_exps.weight").shape[0] == hp.n_expert * hp.n_embd
    with pytest.raises(IndexError):
        f.expert("blk.0.ffn_up_exps.weight", hp.n_expert)
    with pytest.raises(IndexError):
        f.row("token_embd.weight", hp.n_vocab)
    with pytest.raises(IndexError, match="row -1"):
        f.rows("token_embd.weight", np.array([3, -1]))
    with pytest.raises(ValueError, match="not a matrix"):
        f.rows("blk.0.ffn_down_exps.weight", np.array([0]))
    with pytest.raises(ValueError):
        f.expert("token_embd.weight", 0)


def test_storage_types_and_summaries(files):
    text = open_text(files("tiny", "q8_0"))
    f = text.file
    hp = text.hparams
    assert f.info("blk.0.ssm_conv1d.weight").qtype == Q.F32
    assert f.info("blk.0.ffn_gate_inp.weight").qtype == Q.F32
    assert f.info("blk.3.attn_q.weight").qtype == Q.Q8_0
    mix = f.quant_mix()
    assert set(mix) == {"Q8_0", "F32"}
    assert sum(n for n, _ in mix.values()) == len(f.tensor_names)
    assert sum(b for _, b in mix.values()) == sum(f.info(n).nbytes for n in f.tensor_names)
    # bytes per token: everything but the unused experts and all but one embedding row
    want = 0
    for name in f.tensor_names:
        info = f.info(name)
        if len(info.ne) == 3:
            want += info.nbytes * hp.n_expert_used // hp.n_expert
        elif name == "token_embd.weight":
            want += info.nbytes // hp.n_vocab
        else:
            want += info.nbytes
    assert text.bytes_per_token() == want


def tiny_float_tensors(hp, rng):
    return {name: (0.1 * rng.standard_normal(ne[::-1])).astype(np.float32) for name, ne in tensor_shapes(hp).items()}


def test_write_gguf_round_trip(tmp_path, rng):
    hp = preset_hparams("tiny", n_vocab=64)
    tensors = tiny_float_tensors(hp, rng)
    for q in ("f32", "q8_0"):
        path = tmp_path / f"rt-{q}.gguf"
        write_gguf(path, hp, tensors, q, vocab=None)
        text = open_text(path)
        f = text.file
        assert text.hparams == stored(hp) and f.meta("qwen35moe.vocab_size") == 64
        for name, x in tensors.items():
            qtype = f.info(name).qtype
            np.testing.assert_array_equal(f.f32(name), quant.dequantize(quant.quantize(x, qtype), qtype, x.shape))


def test_fused_variants_exposed_under_split_names(tmp_path, rng):
    hp = preset_hparams("tiny", n_vocab=64)
    t = tiny_float_tensors(hp, rng)
    p = "blk.3."
    t[p + "attn_qkv.weight"] = np.concatenate([t.pop(p + "attn_q.weight"), t.pop(p + "attn_k.weight"),
                                               t.pop(p + "attn_v.weight")])
    gate, up = t.pop("blk.1.ffn_gate_exps.weight"), t.pop("blk.1.ffn_up_exps.weight")
    t["blk.1.ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
    del t["output.weight"]
    path = tmp_path / "fused.gguf"
    write_gguf(path, hp, t, "q8_0", vocab=None)
    text = open_text(path)
    f = text.file
    assert not f.has("output.weight")
    assert "blk.3.attn_q.weight" not in f.tensor_names and f.has("blk.3.attn_q.weight")
    qkv = f.f32(p + "attn_qkv.weight")
    nq, nkv = 2 * hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    np.testing.assert_array_equal(f.f32(p + "attn_q.weight"), qkv[:nq])
    np.testing.assert_array_equal(f.f32(p + "attn_k.weight"), qkv[nq:nq + nkv])
    np.testing.assert_array_equal(f.f32(p + "attn_v.weight"), qkv[nq + nkv:])
    assert f.info(p + "attn_v.weight").ne == (hp.n_embd, nkv)
    fused = f.f32("blk.1.ffn_gate_up_exps.weight")
    for name, part in (("blk.1.ffn_gate_exps.weight", fused[:, :hp.n_ff_exp]),
                       ("blk.1.ffn_up_exps.weight", fused[:, hp.n_ff_exp:])):
        np.testing.assert_array_equal(f.f32(name), part)
        np.testing.assert_array_equal(f.expert(name, 5), part[5])
        assert f.raw(name).shape == (hp.n_expert * hp.n_ff_exp, quant.row_bytes(Q.Q8_0, hp.n_embd))
    # bytes per token counts the fused tensor once; the LM head is token_embd in full
    assert text.bytes_per_token() > f.info("token_embd.weight").nbytes


def test_mtp_blocks_are_ignored(tmp_path, rng):
    hp = dataclasses.replace(preset_hparams("tiny", n_vocab=64), nextn_predict_layers=1)
    t = tiny_float_tensors(hp, rng)
    t["blk.4.nextn.eh_proj.weight"] = np.zeros((hp.n_embd, 2 * hp.n_embd), np.float32)
    t["blk.4.attn_q.weight"] = np.zeros((3, 32), np.float32)  # wrong shape, never checked
    path = tmp_path / "mtp.gguf"
    write_gguf(path, hp, t, "q4_0", vocab=None)
    # store the MTP projection as NVFP4 (unsupported; 64-value blocks of 36 bytes, Q4_0's bytes): still opens
    data = bytearray(path.read_bytes())
    name = b"blk.4.nextn.eh_proj.weight"
    type_at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4 + 2 * 8
    assert data[type_at] == Q.Q4_0
    data[type_at] = Q.NVFP4
    path.write_bytes(bytes(data))
    text = open_text(path)
    f = text.file
    assert text.hparams.n_layer == 4 and f.meta("qwen35moe.block_count") == 5
    assert f.info("blk.4.nextn.eh_proj.weight").qtype == Q.NVFP4
    assert f.raw("blk.4.nextn.eh_proj.weight").shape == (64, 72)
    with pytest.raises(UnsupportedModelError, match=r"mtp\.gguf: tensor blk\.4\.nextn\.eh_proj\.weight.*NVFP4"):
        f.f32("blk.4.nextn.eh_proj.weight")


@pytest.mark.slow
def test_memory_map_does_not_read_the_file(tmp_path):
    """A ~0.9 GB file (35b-a3b, 4 layers, 32 experts, Q4_0): RSS grows < 100 MB while opening and reading.

    Marked slow: writing the file takes 7-12 s on the shared 2-core test machine (disk bound).
    """
    path = tmp_path / "big.gguf"
    synth(path, "35b-a3b", layers=4, experts=32, vocab=None)
    try:
        size = path.stat().st_size
        assert size > 800e6
        proc = psutil.Process()
        before = proc.memory_info().rss
        text = open_text(path)
        f = text.file
        opened = proc.memory_info().rss - before
        e = f.expert("blk.2.ffn_down_exps.weight", 17)
        r = f.row("token_embd.weight", 123456)
        read = proc.memory_info().rss - before
        print(f"file {size / 1e6:.0f} MB: RSS +{opened / 1e6:.1f} MB after open, +{read / 1e6:.1f} MB after reads")
        assert opened < 100e6 and read < 100e6
        assert e.shape == (2048, 512) and r.shape == (2048,)
        assert 0.5 < float(np.std(r)) < 2.0
    finally:
        path.unlink()


@pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                    reason="no transparent huge pages (not Linux, or a kernel without them)")
def test_file_map_asks_for_huge_page_folios(files):
    """The open file's map carries MADV_HUGEPAGE: /proc/self/smaps lists its VmFlags with "hg"."""
    path = files("tiny")
    f = GGUFFile.open(path)
    lines = open("/proc/self/smaps", encoding="utf-8").read().splitlines()
    flags = []
    for i, line in enumerate(lines):
        if line.endswith(os.path.realpath(path)):
            flags += [ln for ln in lines[i + 1:] if ln.startswith("VmFlags:")][:1]
    assert flags, f"no map of {path} in /proc/self/smaps"
    assert all("hg" in ln.split() for ln in flags), flags
    assert f.path == path
