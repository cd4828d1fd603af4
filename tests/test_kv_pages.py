"""KV pages shared by prefix (engine/turn/kv_pages.py) in the prefix cache: snapshots of one prefix store each
KV row once, restore bit for bit from RAM and disk, part at the first divergent page, and a page file
that is missing, truncated, damaged or swapped makes its snapshots a miss, never an error.

The states are random stand-ins for a prefill whose rows depend only on the prefix (what split
invariance guarantees for the real model): every sequence's row t is drawn from the hash of its tokens
up to t, so two sequences share exactly the rows of their common prefix.
"""

from __future__ import annotations

import functools
import hashlib
import logging

import numpy as np
import pytest

from engine.arch.qwen35.hparams import Qwen35HParams
from engine.turn.kv_pages import PAGE_ROWS
from engine.turn.kv_types import kv_row_bytes, kv_store
from engine.turn.prefix_cache import PrefixCache, chain_keys
from engine.turn.state import SequenceState

HP = Qwen35HParams(arch="qwen35moe", n_layer=4, nextn_predict_layers=0, n_embd=16, n_vocab=50,
                   context_length=4096, rms_eps=1e-6, n_head=2, n_head_kv=1, head_dim=32, rope_theta=1e7,
                   rope_dims=4, rope_sections=(1, 1, 0, 0), full_attention_interval=4, conv_kernel=4,
                   head_k_dim=4, num_k_heads=1, num_v_heads=2, head_v_dim=4, n_expert=4,
                   n_expert_used=2, n_ff_exp=8, n_ff_shexp=8)
CAP = 2048
ROW = 2 * 1 * 32 * 2                   # bytes of one position's K and V rows: 1 attention layer, 1 x 32 halves each
PAGE = PAGE_ROWS * ROW


def prefill(tokens: list[int], kv_type: str = "f16") -> SequenceState:
    """A state after ``tokens`` whose KV row t is a function of tokens[:t + 1] only, recurrent state of all."""
    s = SequenceState.new(HP, CAP, kv_type)
    rows = HP.state_layout().kv
    h = hashlib.blake2b(digest_size=8)
    for t, tok in enumerate(tokens):
        h.update(int(tok).to_bytes(4, "little"))
        rng = np.random.default_rng(int.from_bytes(h.digest(), "little"))
        for table in (s.k, s.v):
            for il, a in table.items():
                kv_store(a, t, rng.normal(size=(1, *rows[il])).astype(np.float32))
    rng = np.random.default_rng(len(tokens))
    for table in (s.conv, s.ssm):
        for a in table.values():
            a[...] = rng.normal(size=a.shape)
    s.pos = len(tokens)
    return s


def same(a: SequenceState, b: SequenceState) -> bool:
    return a.pos == b.pos and all(
        np.array_equal(x[il][:a.pos].view(np.uint8), y[il][:b.pos].view(np.uint8))
        for x, y in ((a.conv, b.conv), (a.ssm, b.ssm), (a.k, b.k), (a.v, b.v)) for il in x)


def own_bytes(pos: int) -> int:
    """A snapshot's own bytes: recurrent arrays (float32), its rows after the last whole page, its tokens."""
    layout = HP.state_layout()
    fixed = 4 * sum(int(np.prod(s)) for s in (*layout.conv.values(), *layout.ssm.values()))
    return fixed + (pos % PAGE_ROWS) * ROW + 4 * pos


def chat(turns: int, step: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50, turns * step).tolist()


def test_snapshots_of_one_prefix_store_each_row_once_and_restore_exactly():
    """N snapshots of a growing chat (the old cache stored sum(pos) rows, O(N^2)) hold each whole page once:
    RAM = the snapshots' own bytes + the distinct pages, O(N)."""
    toks = chat(12, 150)
    cache = PrefixCache(HP, "m", kv_type="f16")
    positions = list(range(150, len(toks) + 1, 150))
    for pos in positions:
        cache.put(chain_keys("m", toks[:pos])[-1], prefill(toks[:pos]), toks[:pos], None)
    pages = max(positions) // PAGE_ROWS
    assert cache.ram_bytes == sum(own_bytes(p) for p in positions) + pages * PAGE
    assert cache.ram_bytes < sum(positions) * ROW          # the old layout's KV bytes alone
    for pos in positions:
        hit = cache.lookup(toks[:pos] + [7], CAP)
        assert hit.reused == pos and same(hit.state, prefill(toks[:pos]))


def test_a_divergent_sequence_shares_the_pages_before_it_and_owns_the_rest():
    base = chat(1, 1000, seed=1)
    other = base[:600] + [(t + 1) % 50 for t in base[600:]]      # parts inside page 2
    cache = PrefixCache(HP, "m", kv_type="f16")
    for toks in (base, other):
        cache.put(chain_keys("m", toks)[-1], prefill(toks), toks, None)
    assert cache.ram_bytes == own_bytes(1000) * 2 + (3 + 1) * PAGE   # pages 0, 1 shared; page 2 one each
    for toks in (base, other):
        hit = cache.lookup(toks + [1], CAP)
        assert hit.reused == 1000 and same(hit.state, prefill(toks))


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_disk_tier_writes_each_page_once_and_survives_a_restart(tmp_path, monkeypatch, kv_type):
    from engine.turn import kv_pages
    writes: list[str] = []
    real = kv_pages.write_atomic
    monkeypatch.setattr(kv_pages, "write_atomic", lambda path, data: (writes.append(path.name), real(path, data)))
    toks = chat(5, 200, seed=2)
    cache = PrefixCache(HP, "m", disk_dir=tmp_path, kv_type=kv_type)
    for pos in (200, 400, 600, 800, 1000):
        cache.put(chain_keys("m", toks[:pos])[-1], prefill(toks[:pos], kv_type), toks[:pos], None)
    cache.persist()
    cache.persist()
    assert sorted(writes) == sorted(set(writes)) and len(writes) == 1000 // PAGE_ROWS
    again = PrefixCache(HP, "m", disk_dir=tmp_path, kv_type=kv_type)
    assert again.ram_bytes == 0
    for pos in (1000, 600, 200):
        hit = again.lookup(toks[:pos] + [3], CAP)
        assert hit.reused == pos and same(hit.state, prefill(toks[:pos], kv_type))
    folder = again._disk
    page_files = sorted(p.name for p in folder.glob("*.page"))
    assert len(page_files) == 3
    page_kv = 2 * PAGE_ROWS * kv_row_bytes(HP.state_layout().kv[3], kv_type)   # K and V of the one attention layer
    assert all(page_kv < (folder / name).stat().st_size < page_kv + 4096 for name in page_files)
    again.clear(chain_keys("m", toks)[-1].hex())        # page 2 is still the snapshot at 800's
    assert len(list(folder.glob("*.page"))) == 3
    again.clear(chain_keys("m", toks[:800])[-1].hex())  # its last owner
    assert len(list(folder.glob("*.page"))) == 2
    assert again.lookup(toks[:600] + [3], CAP).reused == 600
    again.clear()
    assert list(folder.glob("*.page")) == [] and list(folder.glob("*.snap")) == []


def test_spilled_snapshots_drop_the_ram_copies_of_their_pages(tmp_path):
    toks = chat(1, 900, seed=3)
    cache = PrefixCache(HP, "m", disk_dir=tmp_path, ram_budget=1, kv_type="f16")
    cache.put(chain_keys("m", toks)[-1], prefill(toks), toks, None)
    assert cache.ram_bytes == 0 and len(list(cache._disk.glob("*.page"))) == 3
    hit = cache.lookup(toks + [1], CAP)
    assert hit.reused == 900 and same(hit.state, prefill(toks))


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("restart", [True, False], ids=["reopened", "in use"])
@pytest.mark.parametrize("damage", ["delete", "truncate", "flip", "swap", "foreign"])
def test_a_damaged_page_is_a_miss_not_an_error(tmp_path, caplog, damage, restart, kv_type):
    """Page 2 of the deep snapshot is damaged, after a restart or while the cache is open (its snapshots
    spilled, so the page is read from its file): the lookup falls back to the snapshot at 500 (pages 0, 1)."""
    toks = chat(1, 800, seed=4)
    cache = PrefixCache(HP, "m", disk_dir=tmp_path, kv_type=kv_type, ram_budget=1 << 30 if restart else 1)
    for pos in (500, 800):
        cache.put(chain_keys("m", toks[:pos])[-1], prefill(toks[:pos], kv_type), toks[:pos], None)
    cache.persist()
    keys = chain_keys("m", toks)
    page2, page1 = (cache._disk / f"{keys[p * PAGE_ROWS].hex()}.page" for p in (3, 2))
    data = page2.read_bytes()
    if damage == "delete":
        page2.unlink()
    elif damage == "truncate":
        page2.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        page2.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
    elif damage == "swap":
        page2.write_bytes(page1.read_bytes())
    else:
        page2.write_bytes(data.replace(b'"identity": "m"', b'"identity": "x"'))
    again = PrefixCache(HP, "m", disk_dir=tmp_path, kv_type=kv_type) if restart else cache
    with caplog.at_level(logging.WARNING):
        hit = again.lookup(toks + [1], CAP)
    assert hit.reused == 500 and same(hit.state, prefill(toks[:500], kv_type))
    assert "page" in caplog.text
    assert again.lookup(toks + [1], CAP).reused == 500               # and stays a miss


def test_page_and_snapshot_keys_must_agree(tmp_path, caplog):
    """A snapshot file whose page list names pages of another prefix is ignored at the scan."""
    import json
    import struct

    from engine.turn.snapshot import FORMAT_MAGIC
    toks, other = chat(1, 600, seed=5), chat(1, 600, seed=6)
    cache = PrefixCache(HP, "m", disk_dir=tmp_path, kv_type="f16")
    for t in (toks, other):
        cache.put(chain_keys("m", t)[-1], prefill(t), t, None)
    cache.persist()
    path = cache._disk / f"{chain_keys('m', toks)[-1].hex()}.snap"
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw, len(FORMAT_MAGIC))
    start = len(FORMAT_MAGIC) + 8
    meta = json.loads(raw[start:start + n])
    ok = chain_keys("m", other)
    meta["pages"] = [ok[(p + 1) * PAGE_ROWS].hex() for p in range(2)]
    head = json.dumps(meta).encode()
    body = raw[start + n:-32]
    path.write_bytes(FORMAT_MAGIC + struct.pack("<Q", len(head)) + head + body + hashlib.sha256(head + body).digest())
    with caplog.at_level(logging.WARNING):
        again = PrefixCache(HP, "m", disk_dir=tmp_path, kv_type="f16")
    assert "does not match its contents" in caplog.text
    assert again.lookup(toks + [1], CAP).reused == 0
    assert again.lookup(other + [1], CAP).reused == 600


def test_a_long_chat_is_the_same_with_paged_snapshots_and_without_a_cache(synth_model, tmp_path):
    """A chat whose prompts span several pages (F16 KV, the engine's default), its snapshots spilled to
    disk at once (a one-byte RAM budget: every restore reads page files), and the same chat without a
    cache: the same tokens, drawn from the same logits bit for bit."""
    from engine import sampling
    from engine.api import Engine, EngineOptions
    from engine.events import PrefillStats, TokenEvent
    from engine.sampling import SamplingParams

    system = " ".join(f"rule {i}: answer in plain words about item {i * 7 % 13}." for i in range(45))

    def chat(engine):
        seen, reused = [], []
        original = sampling.Sampler.sample

        def recording(self, logits, history):
            seen.append(np.array(logits, copy=True))
            return original(self, logits, history)

        msgs = [{"role": "system", "content": system}]
        sampling.Sampler.sample = recording
        try:
            for i in range(2):
                msgs.append({"role": "user", "content": f"Question {i}: what about item {i}?"})
                tokens = []
                for ev in engine.chat(msgs, SamplingParams(temperature=0.8, seed=i, max_tokens=6)):
                    if isinstance(ev, TokenEvent):
                        tokens.append(ev.token_id)
                    elif isinstance(ev, PrefillStats):
                        reused.append(ev.reused_tokens)
                msgs.append({"role": "assistant", "content": engine.tokenizer.decode(tokens)})
        finally:
            sampling.Sampler.sample = original
        return seen, reused

    path = synth_model("tiny")
    on = Engine.load(path, options=EngineOptions(context=4096, cache_ram_bytes=1, cache_disk_dir=tmp_path,
                                                 snapshot_interval=100, threads=2))
    off = Engine.load(path, options=EngineOptions(context=4096, prefix_cache=False, threads=2))
    seen_on, reused = chat(on)
    seen_off, _ = chat(off)
    assert len(seen_on) == len(seen_off) == 12
    assert all(np.array_equal(a, b) for a, b in zip(seen_on, seen_off))
    assert reused[1] > 2 * PAGE_ROWS, reused                  # later turns resumed across pages
    assert len(list(on.cache._disk.glob("*.page"))) >= 2


SYSTEM = " ".join(f"rule {i}: reply in short words about object {i * 3 % 17}." for i in range(45))
OTHER_SYSTEM = " ".join(f"note {i}: speak briefly of thing {i * 5 % 11}." for i in range(45))


def sampled_logits(engine, system: str, user: str) -> list[np.ndarray]:
    """The logits every token of one seeded turn (a new conversation: ``system``, ``user``) was drawn from."""
    from engine import sampling
    from engine.sampling import SamplingParams
    seen = []
    original = sampling.Sampler.sample

    def recording(self, logits, history):
        seen.append(np.array(logits, copy=True))
        return original(self, logits, history)

    sampling.Sampler.sample = recording
    try:
        list(engine.chat([{"role": "system", "content": system}, {"role": "user", "content": user}],
                         SamplingParams(temperature=0.8, seed=1, max_tokens=6)))
    finally:
        sampling.Sampler.sample = original
    return seen


@functools.cache
def uncached_logits(path, kv_type: str, system: str, user: str) -> list[np.ndarray]:
    """:func:`sampled_logits` on an engine without a prefix cache (once per model, KV type and prompt)."""
    from engine.api import Engine, EngineOptions
    off = Engine.load(path, options=EngineOptions(context=4096, prefix_cache=False, threads=2, kv_type=kv_type))
    return sampled_logits(off, system, user)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("how", ["delete", "truncate", "swap"])
def test_page_files_damaged_while_the_engine_runs_are_a_miss_and_the_answer_is_right(synth_model, tmp_path, caplog,
                                                                                     how, kv_type):
    """A running engine (every snapshot spilled: a resume reads page files) has the page files of one system
    prompt deleted, truncated, or one of them swapped with a page file of another prompt (contents exchanged:
    each is a valid page of the wrong prefix); a new conversation on that prompt then misses those pages and
    draws every token from the logits a run without a cache gives, bit for bit."""
    from engine.api import Engine, EngineOptions

    path = synth_model("tiny")
    on = Engine.load(path, options=EngineOptions(context=4096, cache_ram_bytes=1, cache_disk_dir=tmp_path,
                                                 snapshot_interval=100, threads=2, kv_type=kv_type))
    sampled_logits(on, SYSTEM, "Question 0: what about item 0?")
    mine = sorted(on.cache._disk.glob("*.page"))
    sampled_logits(on, OTHER_SYSTEM, "Question 0: what about item 0?")
    other = sorted(set(on.cache._disk.glob("*.page")) - set(mine))
    assert len(mine) >= 2 and other
    if how == "delete":
        for p in mine:
            p.unlink()
    elif how == "truncate":
        for p in mine:
            p.write_bytes(p.read_bytes()[:-1000])
    else:
        a, b = mine[0].read_bytes(), other[0].read_bytes()
        mine[0].write_bytes(b)
        other[0].write_bytes(a)
    user = "Question 1: and item 1?"
    with caplog.at_level(logging.WARNING):
        got = sampled_logits(on, SYSTEM, user)
    want = uncached_logits(path, kv_type, SYSTEM, user)
    assert len(got) == len(want) == 6
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert "is not usable" in caplog.text                    # the resume met a damaged page: a miss
