"""Weights read into memory ("ram", engine.gguf.resident) against the file map ("map"): the same logits bit for
bit, read-only views with one writable handle, the errors of a file that does not fit or shrinks while being
read, and the "auto" choice."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil

import numpy as np
import pytest

from engine.api import Engine, EngineOptions
from engine.errors import EngineError, MemoryFitError, ModelFormatError
from engine.events import TokenEvent
from engine.gguf import header as header_mod
from engine.gguf import resident
from engine.gguf.file import GGUFFile
from engine.gguf.header import read_header
from engine.kernels import cpu
from engine.placement import weights_mode
from engine.registry import open_text
from engine.sampling import SamplingParams
from engine.turn.state import SequenceState

pytestmark = pytest.mark.skipif(not resident.supported(), reason="weights 'ram' needs POSIX readv")


def _logits(path, weights: str) -> tuple[np.ndarray, dict]:
    """Logits of a 5-token prompt and one decoded token, and the weight rules, on the native model when built."""
    text = open_text(path, weights)
    model = (text.arch.native_model if cpu.available() else text.arch.reference_model)(text.hparams, text.file)
    state = SequenceState.new(text.hparams, 16)
    first = model.forward(np.array([1, 2, 3, 4, 5]), state)
    second = model.forward(np.array([7]), state)
    return np.concatenate([np.ravel(first), np.ravel(second)]), getattr(model, "weight_rules", {})


@pytest.mark.parametrize("quant", ["q4_0", "q4_k_m"])
def test_ram_gives_the_logits_of_the_map_bit_for_bit(synth_model, quant):
    path = synth_model("tiny", quant)
    mapped, map_rules = _logits(path, "map")
    held, ram_rules = _logits(path, "ram")
    assert np.array_equal(mapped, held)
    if cpu.available():
        assert any(rule.endswith(" resident") for rule in _merged(ram_rules)), ram_rules
        assert not any(rule.endswith(" mapped") for rule in _merged(ram_rules)), ram_rules
        assert {r.replace(" mapped", " resident"): v for r, v in map_rules.items()} == _merged(ram_rules)


def _merged(rules: dict) -> dict:
    """The rules with the interleaved layout's (engine.arch.qwen35.cpu.interleaves) counted under its storage's."""
    out: dict = {}
    for rule, (count, nbytes) in rules.items():
        c, b = out.get(rule.removesuffix(" interleaved"), (0, 0))
        out[rule.removesuffix(" interleaved")] = (c + count, b + nbytes)
    return out


def test_views_are_read_only_and_writable_raw_is_the_one_handle(synth_model):
    path = synth_model("tiny", "q4_0")
    f = GGUFFile.open(path, "ram")
    assert f.resident and f.writable is not None and f.writable.flags.writeable
    assert f.writable.size == os.path.getsize(path)
    assert np.array_equal(f.writable, np.fromfile(path, dtype=np.uint8))
    name = "blk.0.ffn_down_exps.weight"
    raw = f.raw(name)
    assert not raw.flags.writeable and not f.header.data.flags.writeable
    with pytest.raises(ValueError):
        raw[0, 0] = 1
    w = f.writable_raw(name)
    assert w.flags.writeable and w.shape == raw.shape and np.shares_memory(w, raw)
    w[0, 0] ^= 0xFF                                  # a rewrite in place is what the read-only views read
    assert raw[0, 0] == w[0, 0]
    assert f.residence(raw) == "resident" and f.residence(raw.copy()) == ""
    mapped = GGUFFile.open(path)
    assert not mapped.resident and mapped.writable is None and mapped.writable_raw(name) is None
    assert mapped.residence(mapped.raw(name)) == "mapped"


def test_writable_raw_of_split_row_ranges(synth_model):
    f = GGUFFile.open(synth_model("tiny", "q4_0"), "ram")
    rows = f.info("blk.0.attn_qkv.weight").ne[1]
    f.split("blk.0.attn_qkv.weight", [("a", rows // 4), ("b", rows - rows // 4)])
    for name in ("a", "b"):
        w = f.writable_raw(name)
        assert np.array_equal(w, f.raw(name)) and np.shares_memory(w, f.raw(name))
    ne = f.info("blk.0.ffn_gate_exps.weight").ne
    f.split("blk.0.ffn_gate_exps.weight", [("g0", ne[1] // 2), ("g1", ne[1] - ne[1] // 2)])
    assert f.writable_raw("g1") is None                # rows of every expert: not one range (raw copies them)


def test_a_file_truncated_while_being_read_is_a_format_error(synth_model, tmp_path, monkeypatch):
    path = tmp_path / "shrinks.gguf"
    shutil.copyfile(synth_model("tiny", "q4_0"), path)
    size = path.stat().st_size
    read = resident.read_resident

    def truncate_then_read(source, n, available=None):
        os.truncate(source, size // 2)               # another process cuts the file after its header was parsed
        return read(source, n, available)

    monkeypatch.setattr(header_mod, "read_resident", truncate_then_read)
    monkeypatch.setattr(resident, "CHUNK", 1 << 20)  # several chunks before the end
    with pytest.raises(ModelFormatError, match=r"shrinks\.gguf: the file ended at byte \d+ while being read"):
        read_header(path, "ram")


def test_a_file_replaced_while_being_read_is_a_format_error(synth_model, tmp_path, monkeypatch):
    path = tmp_path / "replaced.gguf"
    shutil.copyfile(synth_model("tiny", "q4_0"), path)
    other = synth_model("tiny", "q8_0")
    assert other.stat().st_size >= path.stat().st_size   # the read then fills every byte: no short-read error
    read = resident.read_resident

    def replace_then_read(source, n, available=None):
        shutil.copyfile(other, tmp_path / "new.gguf")
        os.replace(tmp_path / "new.gguf", source)       # a download or a re-quantization lands on the same name
        return read(source, n, available)

    monkeypatch.setattr(header_mod, "read_resident", replace_then_read)
    with pytest.raises(ModelFormatError, match=r"replaced\.gguf: the file changed while being read into memory"):
        read_header(path, "ram")


def test_explicit_ram_without_the_memory_is_refused_before_reading(synth_model, monkeypatch):
    path = synth_model("tiny", "q4_0")
    size = os.path.getsize(path)
    monkeypatch.setattr(resident, "available_memory", lambda: size - 1)
    monkeypatch.setattr(os, "readv", lambda *a: pytest.fail("read after the fit check failed"))
    with pytest.raises(MemoryFitError, match=rf"tiny-q4_0\.gguf: reading its {size} bytes .* {size - 1} bytes"):
        GGUFFile.open(path, "ram")
    with pytest.raises(MemoryFitError):
        Engine.load(path, options=EngineOptions(device="cpu", weights="ram", prefix_cache=False, context=64))


def test_a_failed_allocation_is_a_memory_fit_error(synth_model, monkeypatch):
    import errno

    real = mmap.mmap

    def refuse_anonymous(fileno, *args, **kwargs):
        if fileno == -1:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(fileno, *args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", refuse_anonymous)
    with pytest.raises(MemoryFitError, match=r"tiny-q4_0\.gguf: cannot allocate \d+ bytes .*Cannot allocate memory"):
        GGUFFile.open(synth_model("tiny", "q4_0"), "ram")


def test_auto_picks_ram_only_when_the_file_fits_and_no_gpu_prefill_runs(synth_model, monkeypatch, tmp_path):
    path = synth_model("tiny", "q4_0")
    size = os.path.getsize(path)
    cpu_only = EngineOptions(device="cpu")
    monkeypatch.setattr(resident, "available_memory", lambda: int(size / resident.FIT_FRACTION) + 1)
    assert weights_mode(cpu_only, path) == "ram"
    monkeypatch.setattr(resident, "available_memory", lambda: int(size / resident.FIT_FRACTION) - 1)
    assert weights_mode(cpu_only, path) == "map"
    monkeypatch.setattr(resident, "available_memory", lambda: 1 << 50)
    monkeypatch.setattr("engine.placement._gpu_present", lambda: True)
    assert weights_mode(EngineOptions(device="auto"), path) == "map"
    assert weights_mode(EngineOptions(device="cpu"), path) == "ram"
    assert weights_mode(EngineOptions(device="auto", weights="ram"), path) == "ram"
    assert weights_mode(EngineOptions(device="cpu", weights="map"), path) == "map"
    assert weights_mode(cpu_only, tmp_path / "missing.gguf") == "map"
    with pytest.raises(EngineError, match="weights must be one of auto, map, ram, got 'disk'"):
        weights_mode(EngineOptions(weights="disk"), path)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelFormatError, match="model.gguf"):
        read_header(fifo, "ram")


def test_engine_load_ram_generates_what_map_generates(synth_model):
    path = synth_model("tiny", "q4_0")
    tokens = {}
    for weights in ("map", "ram"):
        engine = Engine.load(path, options=EngineOptions(device="cpu", weights=weights, prefix_cache=False,
                                                         context=64))
        assert engine.text.file.resident == (weights == "ram")
        tokens[weights] = [ev.token_id for ev in engine.generate([1, 2, 3], SamplingParams.greedy(6))
                           if isinstance(ev, TokenEvent)]
        engine.close()
    assert tokens["map"] == tokens["ram"] and len(tokens["ram"]) == 6


def _cached_bytes(path) -> int:
    """Bytes of ``path`` in the page cache (``mincore`` over a fresh map, which faults nothing in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        region = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ)
    view = np.frombuffer(region, dtype=np.uint8)
    vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    assert libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
    del view
    region.close()
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="the page cache is dropped with posix_fadvise")
def test_ram_holds_the_file_once_in_anonymous_memory_not_in_the_page_cache(synth_model, tmp_path):
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("finds the region's mapping in /proc/self/maps")
    path = tmp_path / "small.gguf"
    shutil.copyfile(synth_model("small", "q4_0"), path)
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())                        # dirty pages are not dropped: write them back first
        size = os.path.getsize(path)
        fh.read()                                    # the whole file in the page cache
    assert _cached_bytes(path) >= 0.9 * size
    f = GGUFFile.open(path, "ram")
    address = f.writable.ctypes.data
    assert _mapping_is_anonymous(address)
    assert _resident_bytes(address, f.writable.nbytes) >= 0.99 * size
    assert _cached_bytes(path) <= 0.02 * size
    assert f.identity == GGUFFile.open(path).identity


def _mapping_is_anonymous(address: int) -> bool:
    """Whether the mapping of this process that holds ``address`` has no file behind it (/proc/self/maps)."""
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return len(fields) < 6 or fields[5].startswith("[")
    raise AssertionError(f"no mapping holds {address:#x}")


def _resident_bytes(address: int, size: int) -> int:
    """Resident bytes of ``[address, address + size)`` alone (``mincore``; a neighbouring mapping merged
    into the same VMA does not count)."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = address - address % mmap.PAGESIZE
    length = address + size - start
    vec = (ctypes.c_ubyte * ((length + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


def test_cli_says_where_the_weights_are_and_takes_weights(synth_model, monkeypatch, capsys):
    from engine.__main__ import build_parser, main
    path = synth_model("tiny", "q4_0")
    monkeypatch.setattr(resident, "available_memory", lambda: 1 << 50)
    monkeypatch.setattr("engine.placement._gpu_present", lambda: False)
    assert main(["generate", "--model", str(path), "-p", "Hi", "-n", "1", "--temp", "0", "--context", "64"]) == 0
    assert f"[loaded {path.name} in" in (err := capsys.readouterr().err) and "weights read into memory]" in err
    parser = build_parser()
    assert parser.parse_args(["serve", "--weights", "map"]).weights == "map"
    assert parser.parse_args(["bench", str(path), "--weights", "ram"]).weights == "ram"
    assert parser.parse_args(["bench", str(path)]).weights == "auto"
