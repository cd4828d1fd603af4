"""The snapshot folder as another process or a hostile user leaves it: links, FIFOs, device nodes,
stray names, huge or NaN-filled files, and a second process trimming the same folder."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from test_prefix_cache import HP, assert_same, filled_state

from engine.turn.prefix_cache import PrefixCache, chain_keys
from engine.turn.snapshot import FORMAT_MAGIC

ROOT = Path(__file__).resolve().parent.parent


def _one_snapshot(folder: Path, seed: int, n: int = 16) -> tuple[list[int], Path, object]:
    """Write one snapshot (with logits) of ``n`` random tokens into ``folder``; (tokens, its file, the state)."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 50, n).tolist()
    cache = PrefixCache(HP, "m", disk_dir=folder)
    state = filled_state(rng, n)
    cache.put(chain_keys("m", toks)[n], state, toks, rng.normal(size=50).astype(np.float32))
    cache.persist()
    [path] = [p for p in cache._disk.iterdir() if p.suffix == ".snap"]
    return toks, path, state


def _scan_in_thread(folder: Path, timeout: float = 20.0) -> PrefixCache:
    """Open the cache on a daemon thread: a FIFO that is read would block it forever."""
    box: list[PrefixCache] = []
    t = threading.Thread(target=lambda: box.append(PrefixCache(HP, "m", disk_dir=folder)), daemon=True)
    t.start()
    t.join(timeout)
    assert box, "opening the cache folder blocked (a FIFO was read?)"
    return box[0]


def test_links_fifos_folders_and_devices_named_like_snapshots_are_never_opened(tmp_path, caplog) -> None:
    toks, real, _state = _one_snapshot(tmp_path / "elsewhere", 1)
    folder = PrefixCache(HP, "m", disk_dir=tmp_path / "cache")._disk
    folder.mkdir(parents=True)
    os.symlink(real, folder / real.name)                       # a link to a valid snapshot: not followed
    hexes = [hashlib.blake2b(bytes([i]), digest_size=16).hexdigest() for i in range(5)]
    os.symlink(folder / "nowhere", folder / f"{hexes[0]}.snap")             # dangling
    os.symlink(folder / f"{hexes[2]}.snap", folder / f"{hexes[1]}.snap")   # a loop
    os.symlink(folder / f"{hexes[1]}.snap", folder / f"{hexes[2]}.snap")
    os.mkfifo(folder / f"{hexes[3]}.snap")
    (folder / f"{hexes[4]}.snap").mkdir()
    names = {real.name, *(f"{h}.snap" for h in hexes)}
    if os.geteuid() == 0:
        os.mknod(folder / ("0" * 32 + ".snap"),
                 stat.S_IFCHR | 0o600, os.makedev(1, 3))        # /dev/null's numbers
        names.add("0" * 32 + ".snap")
    with caplog.at_level(logging.WARNING, logger="engine.turn.prefix_cache"):
        cache = _scan_in_thread(tmp_path / "cache")
    assert cache.snapshots() == []
    assert cache.lookup(toks, 64).reused == 0
    assert not [r for r in caplog.records if any(n in r.getMessage() for n in names)]   # never opened
    assert all(os.path.lexists(folder / n) for n in names)                                # nor removed


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_device_node_is_not_read_even_when_it_never_ends(tmp_path) -> None:
    folder = PrefixCache(HP, "m", disk_dir=tmp_path)._disk
    folder.mkdir(parents=True)
    os.mknod(folder / ("ab" * 16 + ".snap"), stat.S_IFCHR | 0o600, os.makedev(1, 5))   # /dev/zero's numbers
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
            "sys.path[:0] = [sys.argv[1], sys.argv[1] + '/tests']; "
            "from test_prefix_cache import HP; from engine.turn.prefix_cache import PrefixCache; "
            "c = PrefixCache(HP, 'm', disk_dir=sys.argv[2]); print(len(c.snapshots()))")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT), str(tmp_path)], check=False, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stderr[-500:]


def test_a_stray_file_named_like_a_snapshot_is_ignored_when_trimming(tmp_path) -> None:
    rng = np.random.default_rng(2)
    folder = PrefixCache(HP, "m", disk_dir=tmp_path)._disk
    folder.mkdir(parents=True)
    (folder / "my notes.snap").write_bytes(b"x" * 100)
    one = filled_state(rng, 8)
    cache = PrefixCache(HP, "m", ram_budget=1, disk_dir=tmp_path, disk_budget=1)
    toks = rng.integers(0, 50, 8).tolist()
    cache.put(chain_keys("m", toks)[8], one, toks, None)     # spills to disk, then trims: no ValueError
    assert (folder / "my notes.snap").exists()


def test_a_huge_file_is_refused_by_its_header_before_it_is_read(tmp_path) -> None:
    folder = PrefixCache(HP, "m", disk_dir=tmp_path)._disk
    folder.mkdir(parents=True)
    head = json.dumps({"version": 1, "identity": "m", "key": "00", "pos": 4, "arrays": {}}).encode()
    path = folder / ("cd" * 16 + ".snap")
    with open(path, "wb") as f:
        f.write(FORMAT_MAGIC + struct.pack("<Q", len(head)) + head)
        f.truncate(256 << 20)                                  # sparse: 256 MiB the header does not describe
    tracemalloc.start()
    try:
        cache = PrefixCache(HP, "m", disk_dir=tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert cache.snapshots() == [] and peak < 8 << 20


def test_a_snapshot_is_streamed_not_read_whole(tmp_path, monkeypatch) -> None:
    toks, _path, state = _one_snapshot(tmp_path, 3)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"{self} read whole"))
    cache = PrefixCache(HP, "m", disk_dir=tmp_path)
    hit = cache.lookup(toks, 64)
    assert hit.reused == 16
    assert_same(hit.state, state)


def _poison(path: Path, value: float) -> None:
    """Put ``value`` into the first float of the file's last array and recompute the checksum (a damaged
    state that is otherwise a valid file)."""
    data = bytearray(path.read_bytes())
    struct.pack_into("<f", data, len(data) - 32 - 4, value)
    start = len(FORMAT_MAGIC) + 8
    data[-32:] = hashlib.sha256(bytes(data[start:-32])).digest()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_state_holding_nan_or_infinity_is_damaged_and_a_miss(tmp_path, caplog, value) -> None:
    toks, path, _ = _one_snapshot(tmp_path, 4)
    _poison(path, value)
    with caplog.at_level(logging.WARNING, logger="engine.turn.prefix_cache"):
        cache = PrefixCache(HP, "m", disk_dir=tmp_path)
    assert cache.snapshots() == [] and cache.lookup(toks, 64).reused == 0
    assert any("NaN or infinite" in r.getMessage() for r in caplog.records)


def test_a_file_damaged_after_listing_is_a_miss(tmp_path) -> None:
    toks, path, _ = _one_snapshot(tmp_path, 5)
    cache = PrefixCache(HP, "m", disk_dir=tmp_path)
    assert len(cache.snapshots()) == 1
    _poison(path, float("nan"))
    hit = cache.lookup(toks, 64)
    assert hit.reused == 0 and cache.snapshots() == []


def test_a_lookup_never_evicts_the_snapshot_it_restores(tmp_path, monkeypatch) -> None:
    gone, path, _ = _one_snapshot(tmp_path / "a", 6)
    toks, _, state = _one_snapshot(tmp_path / "b", 7)
    cache = PrefixCache(HP, "m", ram_budget=1, disk_dir=tmp_path / "a")
    path.unlink()        # removed by another process after listing, and the disk now refuses writes:

    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("engine.turn.prefix_cache.write_atomic", full)
    assert cache.lookup(gone, 64).reused == 0            # the vanished file is a miss, not an error
    cache = PrefixCache(HP, "m", ram_budget=1, disk_dir=tmp_path / "b")
    hit = cache.lookup(toks, 64)                          # restoring it must not spill it (or drop it) meanwhile
    assert hit.reused == 16
    assert_same(hit.state, state)
    assert [i.tier for i in cache.snapshots()] == ["ram"]


def test_a_fresh_temporary_file_of_another_process_is_left_alone(tmp_path) -> None:
    folder = PrefixCache(HP, "m", disk_dir=tmp_path)._disk
    folder.mkdir(parents=True)
    (folder / "tmpwriting.tmp").write_bytes(b"in flight")
    old = folder / "tmpcrashed.tmp"
    old.write_bytes(b"partial")
    os.utime(old, (0, 0))
    PrefixCache(HP, "m", disk_dir=tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["tmpwriting.tmp"]


WORKER = textwrap.dedent("""
    import sys, time
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
    import numpy as np
    from test_prefix_cache import HP, filled_state
    from engine.turn.prefix_cache import PrefixCache, chain_keys
    folder, seed, seconds = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    rng = np.random.default_rng(seed)
    base = [7] * 6
    budget = 3 * sum(a.nbytes for a in filled_state(rng, 10).ssm.values()) * 4
    cache, hits, rounds = None, 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if rounds % 5 == 0:
            cache = PrefixCache(HP, "m", ram_budget=1, disk_dir=folder, disk_budget=budget)
        toks = base + rng.integers(0, 50, 4).tolist()
        hits += cache.lookup(toks + [1], 64).reused > 0
        cache.put(chain_keys("m", toks)[10], filled_state(rng, 10), toks, None)
        cache.put(chain_keys("m", base)[6], filled_state(rng, 6), base, None)
        cache.persist()
        rounds += 1
    print(rounds, hits)
""")


def test_two_processes_sharing_one_folder_never_fail(tmp_path) -> None:
    """Two real processes put, spill, trim, reopen and look up in one folder at once for a few seconds."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = [subprocess.Popen([sys.executable, str(script), str(ROOT), str(tmp_path / "shared"), str(seed), "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        rounds, hits = map(int, out.split())
        assert rounds > 5 and hits > 0


def test_a_chat_over_a_damaged_snapshot_answers_as_if_it_were_absent(synth_model, tmp_path) -> None:
    from engine.api import Engine, EngineOptions
    from engine.events import PrefillStats, TurnSummary
    from engine.sampling import SamplingParams

    def turn(engine):
        events = list(engine.chat([{"role": "user", "content": "Persist me."}], SamplingParams.greedy(6)))
        return next(e for e in events if isinstance(e, PrefillStats)), events[-1]

    opts = EngineOptions(cache_disk_dir=tmp_path)
    first = Engine.load(synth_model("tiny", "q8_0"), options=opts)
    _, want = turn(first)
    first.cache.persist()
    files = list(tmp_path.rglob("*.snap"))
    assert files
    for path in files:
        _poison(path, float("nan"))
    stats, got = turn(Engine.load(synth_model("tiny", "q8_0"), options=opts))
    assert isinstance(got, TurnSummary) and stats.reused_tokens == 0
    assert got.text == want.text


CHATTER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from engine.api import Engine, EngineOptions
    from engine.events import TurnSummary
    from engine.sampling import SamplingParams
    model, folder, seed = sys.argv[2], sys.argv[3], int(sys.argv[4])
    engine = Engine.load(model, options=EngineOptions(cache_disk_dir=folder, cache_ram_bytes=1,
                                                      cache_disk_bytes=400_000))
    done = 0
    for i in range(8):
        history = [{"role": "user", "content": f"Question {seed}-{i % 3}: tell me about the number {i}."}]
        events = list(engine.chat(history, SamplingParams.greedy(3)))
        assert isinstance(events[-1], TurnSummary) and events[-1].stop_reason in ("eos", "max_tokens"), events[-1]
        done += 1
    engine.close()
    print(done)
""")


def test_two_engines_chatting_over_one_snapshot_folder_never_fail(synth_model, tmp_path) -> None:
    """Two processes (as the app and ``engine serve``) chat with every snapshot spilled to one small folder."""
    script = tmp_path / "chatter.py"
    script.write_text(CHATTER)
    model = synth_model("tiny", "q8_0")
    procs = [subprocess.Popen([sys.executable, str(script), str(ROOT), str(model), str(tmp_path / "shared"), str(seed)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.strip() == "8", err[-2000:]
