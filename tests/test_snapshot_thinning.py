"""Snapshot retention (docs/design/prefix-cache.md, "Which snapshots are kept"): an interval snapshot is
thinned once a later turn extends its prefix; message starts, branch points and prompt ends stay.

The engine-level tests compare a cache that takes interval snapshots (every 16 tokens) with one that takes
none (``snapshot_interval=0``): after thinning the first must hold exactly the second's snapshots plus the
latest turn's interval snapshots, resume every turn where the second does, and leave no orphan file.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from engine.events import PrefillProgress, PrefillStats, TokenEvent
from engine.sampling import SamplingParams
from engine.turn.prefix_cache import PrefixCache, chain_keys

from test_kv_pages import CAP, HP, prefill

EVERY = 16
LONG = " ".join(f"line {i}: the value of item {i} is {i * 7 % 11}." for i in range(12))
USERS = [f"Read this list first. {LONG} What is item 3?", "And item 5?", f"Now this one. {LONG} Which is largest?"]


def turn(engine, messages) -> tuple[list[int], int, str]:
    """One greedy turn: (prompt ids, reused tokens, answer text)."""
    prompt = engine.prepare(messages).tokens
    reused, ids = None, []
    for ev in engine.chat(messages, SamplingParams.greedy(max_tokens=4)):
        if isinstance(ev, PrefillStats):
            reused = ev.reused_tokens
        elif isinstance(ev, TokenEvent):
            ids.append(ev.token_id)
        assert not isinstance(ev, PrefillProgress) or ev.total == len(prompt)
    return list(prompt), reused, engine.tokenizer.decode(ids)


def session(engine) -> tuple[list[list[int]], list[int], list[dict]]:
    """The scripted chat of :data:`USERS`: (prompts, reused tokens per turn, messages with the answers)."""
    messages: list[dict] = [{"role": "system", "content": "You answer briefly."}]
    prompts, reused = [], []
    for user in USERS:
        messages.append({"role": "user", "content": user})
        prompt, got, answer = turn(engine, messages)
        prompts.append(prompt)
        reused.append(got)
        messages.append({"role": "assistant", "content": answer})
    return prompts, reused, messages


def held(engine) -> dict[str, int]:
    """hex key -> nbytes of every snapshot of the engine's cache."""
    return {s.key: s.nbytes for s in engine.snapshots()}


def latest_intervals(engine, prompt: list[int], reused: int, anchors: set[str]) -> dict[int, str]:
    """pos -> hex key of the interval snapshots the last turn took (every EVERY tokens it prefilled, where no
    anchor of its prompt's chain is)."""
    keys = [k.hex() for k in chain_keys(engine.cache.identity, prompt)]
    return {p: keys[p] for p in range(EVERY, len(prompt), EVERY) if p > reused and keys[p] not in anchors}


@pytest.fixture(scope="module")
def engines(synth_model):
    """(interval snapshots every EVERY tokens, no interval snapshots), each after the scripted session."""
    from engine.api import Engine, EngineOptions
    path = synth_model("tiny")
    thin = Engine.load(path, options=EngineOptions(context=4096, snapshot_interval=EVERY, threads=2))
    base = Engine.load(path, options=EngineOptions(context=4096, snapshot_interval=0, threads=2))
    runs = {"thin": session(thin), "base": session(base)}
    yield thin, base, runs
    thin.close()
    base.close()


def test_thinned_cache_holds_anchors_and_the_latest_turns_intervals(engines):
    """Bytes after a 3-turn chat: the anchors (what a cache without interval snapshots holds) plus the last
    turn's interval snapshots; earlier turns' interval snapshots are gone, and every turn resumed as far as
    the cache without them."""
    thin, base, runs = engines
    prompts, reused, _ = runs["thin"]
    assert runs["thin"][:2] == runs["base"][:2]
    anchors = held(base)
    kept = latest_intervals(thin, prompts[-1], reused[-1], set(anchors))
    assert len(kept) >= 4 and reused[1] > 2 * EVERY, (kept, reused)
    mine = held(thin)
    assert set(mine) == set(anchors) | set(kept.values())
    assert thin.cache.ram_bytes == base.cache.ram_bytes + sum(mine[k] for k in kept.values())


def test_an_edited_old_message_resumes_at_its_start_and_the_last_at_its_interval(engines):
    """Editing the end of the first user message resumes at that message's start (its interval snapshots were
    thinned by the next turns); editing the end of the last one resumes at its deepest interval snapshot.
    Both answers equal the cache-without-intervals engine's."""
    thin, base, runs = engines
    messages = runs["thin"][2]
    for index in (1, 5):
        edited = [dict(m) for m in messages[:index + 1]]
        edited[index]["content"] = edited[index]["content"].replace("largest?", "smallest?").replace(
            "item 3?", "item 4?")
        prompt = thin.prepare(edited).tokens
        old = runs["thin"][0][index // 2]
        d = next(i for i, (a, b) in enumerate(zip(prompt, old)) if a != b)
        start = max(p for p in thin.prompts.message_starts(prompt) if p <= d)
        want = start if index == 1 else EVERY * (d // EVERY)
        assert want > start or index == 1
        got_thin, got_base = turn(thin, edited), turn(base, edited)
        assert got_thin[1] == want, (index, d, start)
        assert got_thin[2] == got_base[2] and got_base[1] == start


def test_disk_tier_of_a_thinned_cache_has_no_orphan_file(synth_model, tmp_path):
    """Every snapshot spilled at once (one-byte RAM budget): the folder then holds one file per kept
    snapshot and one per page some kept snapshot references, and each page's owners are exactly the
    snapshots that list it; reopened, the folder lists the same snapshots."""
    from engine.api import Engine, EngineOptions
    path = synth_model("tiny")
    engine = Engine.load(path, options=EngineOptions(context=4096, snapshot_interval=EVERY, threads=2,
                                                     cache_ram_bytes=1, cache_disk_dir=tmp_path))
    prompts, reused, _ = session(engine)
    cache = engine.cache
    entries = list(cache._entries.values())
    assert all(s.tier == "disk" for s in entries)
    assert {p.stem for p in cache._disk.glob("*.snap")} == {s.key.hex() for s in entries}
    referenced = {k for s in entries for k in s.pages}
    assert {p.stem for p in cache._disk.glob("*.page")} == {k.hex() for k in referenced}
    assert set(cache._pages.pages) == referenced
    assert all(page.owners == {s.key for s in entries if k in s.pages} for k, page in cache._pages.pages.items())
    intervals = {s.pos for s in entries if s.interval}
    assert intervals and min(intervals) > reused[-1]                  # only the last turn's are left
    again = PrefixCache(engine.model.hp, cache.identity, disk_dir=tmp_path, kv_type=cache.kv_type)
    assert {(s.pos, s.interval) for s in again._entries.values()} == {(s.pos, s.interval) for s in entries}
    engine.close()


def test_a_later_process_thins_interval_snapshots_read_from_disk(tmp_path):
    """Interval snapshots persisted by one process are thinned (files removed) by a later process's turn that
    goes past them, not by their own turn; pages stay while a kept snapshot lists them, and go with the last."""
    toks = np.random.default_rng(3).integers(0, 50, 1000).tolist()
    keys = chain_keys("m", toks)
    first = PrefixCache(HP, "m", disk_dir=tmp_path)
    t1 = first.lookup(toks, CAP, keys=keys).turn
    for p in (300, 600):
        first.put(keys[p], prefill(toks[:p], "f32"), toks[:p], None, keys=keys, turn=t1, interval=True)
    first.put(keys[650], prefill(toks[:650], "f32"), toks[:650], None, keys=keys, turn=t1)
    assert {s.pos for s in first._entries.values()} == {300, 600, 650}      # its own turn thins nothing
    first.persist()
    second = PrefixCache(HP, "m", disk_dir=tmp_path)
    assert {s.pos: s.interval for s in second._entries.values()} == {300: True, 600: True, 650: False}
    hit = second.lookup(toks[:640] + [1], CAP)
    assert hit.reused == 600
    second.put(keys[900], prefill(toks[:900], "f32"), toks[:900], None, keys=keys, turn=hit.turn)
    folder = second._disk
    assert {s.pos for s in second._entries.values()} == {650, 900}
    assert {p.stem for p in folder.glob("*.snap")} == {keys[650].hex()}    # 900 is in RAM only
    second.persist()
    pages = {k.hex() for k in second._entries[keys[900]].pages}
    assert {p.stem for p in folder.glob("*.page")} == pages and len(pages) == 3
    second.clear(keys[900].hex())
    assert {p.stem for p in folder.glob("*.page")} == {k.hex() for k in second._entries[keys[650]].pages}
    second.clear()
    assert not list(folder.iterdir())


def test_a_non_boolean_interval_field_makes_the_file_unusable(tmp_path, caplog):
    """A header whose ``interval`` is not a boolean (checksum recomputed) is ignored with a log line."""
    import hashlib
    import json
    import struct
    from engine.turn.snapshot import FORMAT_MAGIC
    toks = np.random.default_rng(4).integers(0, 50, 40).tolist()
    cache = PrefixCache(HP, "m", disk_dir=tmp_path)
    cache.put(chain_keys("m", toks)[40], prefill(toks, "f32"), toks, None, interval=True)
    cache.persist()
    [path] = tmp_path.rglob("*.snap")
    data = path.read_bytes()
    n = struct.unpack_from("<Q", data, len(FORMAT_MAGIC))[0]
    head = json.loads(data[len(FORMAT_MAGIC) + 8:len(FORMAT_MAGIC) + 8 + n])
    assert head["interval"] is True
    head["interval"] = "yes"
    raw = json.dumps(head).encode()
    payload = data[len(FORMAT_MAGIC) + 8 + n:-32]
    path.write_bytes(FORMAT_MAGIC + struct.pack("<Q", len(raw)) + raw + payload
                     + hashlib.sha256(raw + payload).digest())
    with caplog.at_level(logging.WARNING):
        assert PrefixCache(HP, "m", disk_dir=tmp_path).snapshots() == []
    assert "interval is not a boolean" in caplog.text


def test_only_a_prompts_own_snapshots_thin(tmp_path):
    """A put without a turn (a read-ahead, an answer's end) and a re-put of a held snapshot by another turn (a
    second choice resuming at the same prompt end) leave the interval snapshots; another turn's new prompt
    snapshot deeper on the same path drops them."""
    toks = np.random.default_rng(5).integers(0, 50, 1000).tolist()
    keys = chain_keys("m", toks)
    cache = PrefixCache(HP, "m")
    t1 = cache.lookup(toks, CAP, keys=keys).turn
    for p in (300, 600):
        cache.put(keys[p], prefill(toks[:p], "f32"), toks[:p], None, keys=keys, turn=t1, interval=True)
    cache.put(keys[650], prefill(toks[:650], "f32"), toks[:650], None, keys=keys, turn=t1)
    cache.put(keys[700], prefill(toks[:700], "f32"), toks[:700], None, keys=keys)
    t2 = cache.lookup(toks, CAP, keys=keys).turn
    cache.put(keys[650], prefill(toks[:650], "f32"), toks[:650], None, keys=keys, turn=t2)
    assert {s.pos for s in cache._entries.values()} == {300, 600, 650, 700}
    cache.put(keys[900], prefill(toks[:900], "f32"), toks[:900], None, keys=keys, turn=t2)
    assert {s.pos for s in cache._entries.values()} == {650, 700, 900}


def test_an_interval_snapshot_put_again_as_an_anchor_is_written_as_one(tmp_path):
    """An interval snapshot read from disk and then taken again as an anchor (a message start at the same
    position) loses the flag in its file too, so a later process does not thin it."""
    toks = np.random.default_rng(6).integers(0, 50, 400).tolist()
    keys = chain_keys("m", toks)
    first = PrefixCache(HP, "m", disk_dir=tmp_path)
    first.put(keys[300], prefill(toks[:300], "f32"), toks[:300], None, keys=keys, interval=True)
    first.persist()
    second = PrefixCache(HP, "m", disk_dir=tmp_path)
    hit = second.lookup(toks[:310], CAP)
    assert hit.reused == 300
    second.put(keys[300], prefill(toks[:300], "f32"), toks[:300], None, keys=keys, turn=hit.turn)
    second.persist()
    third = PrefixCache(HP, "m", disk_dir=tmp_path)
    assert {s.pos: s.interval for s in third._entries.values()} == {300: False}
