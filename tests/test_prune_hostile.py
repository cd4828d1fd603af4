"""``python -m engine prune`` against hostile paths and files: outputs that are FIFOs, folders, devices, links
or the input itself, an input named ``OUT.part``, unwritable, missing, full or read-only places, hostile
statistics and calibration files. Every refusal is one ``error:`` line with exit status 2, before any work."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.reap import prune
from engine.__main__ import main
from engine.gguf.file import GGUFFile
from engine.registry import open_text

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model(synth_model):
    return synth_model("tiny", "q8_0")


@pytest.fixture
def stats(model, tmp_path) -> Path:
    """Valid statistics for ``model`` (random counts), so a prune needs no calibration."""
    st = prune.ExpertStats.for_model(open_text(model))
    rng = np.random.default_rng(0)
    st.frequency[...] = rng.integers(1, 100, st.frequency.shape)
    st.reap_sum[...] = rng.random(st.reap_sum.shape)
    st.tokens[...] = st.frequency.sum(axis=1) // st.n_expert_used
    path = tmp_path / "stats.json"
    st.save(path)
    return path


def _refused(capsys, argv: list[str], *fragments: str, before_work: bool = True) -> str:
    """Run the command; it must exit 2 with one ``error:`` line (no traceback) holding ``fragments``, and
    nothing else when refused ``before_work`` (else after the progress lines of the work done)."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and sum("error" in line for line in err) == 1, err
    assert len(err) == 1 or not before_work, err
    for fragment in fragments:
        assert fragment in err[-1], err[-1]
    return err[-1]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("kind", ["fifo", "folder", "symlink", "device"])
def test_an_existing_non_regular_output_is_refused_never_replaced(model, stats, tmp_path, capsys, kind) -> None:
    out = tmp_path / "out.gguf"
    if kind == "fifo":
        os.mkfifo(out)
    elif kind == "folder":
        out.mkdir()
    elif kind == "symlink":
        (tmp_path / "target.gguf").write_bytes(b"keep me")
        os.symlink(tmp_path / "target.gguf", out)
    elif os.geteuid() == 0:
        os.mknod(out, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    else:
        pytest.skip("making a device node needs root")
    before = os.lstat(out)
    _refused(capsys, ["prune", str(model), "--keep", "6", "-o", str(out), "--stats", str(stats)],
             str(out), "refusing to replace it")
    after = os.lstat(out)
    assert (after.st_ino, stat.S_IFMT(after.st_mode)) == (before.st_ino, stat.S_IFMT(before.st_mode))


def test_an_input_named_like_the_temporary_file_survives(model, stats, tmp_path, capsys) -> None:
    src = tmp_path / "out.gguf.part"
    src.write_bytes(Path(model).read_bytes())
    st = prune.ExpertStats.load(stats)
    st.model["identity"] = GGUFFile.open(src).identity
    st.save(stats)
    want = _digest(src)
    assert main(["prune", str(src), "--keep", "6", "-o", str(tmp_path / "out.gguf"), "--stats", str(stats)]) == 0
    assert _digest(src) == want
    assert open_text(tmp_path / "out.gguf").hparams.n_expert == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf", "out.gguf.part", "stats.json"]


def test_the_output_may_not_be_the_input(model, stats, tmp_path, capsys) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(Path(model).read_bytes())
    os.link(src, tmp_path / "hardlink.gguf")
    want = _digest(src)
    for out in (src, tmp_path / "hardlink.gguf"):
        _refused(capsys, ["prune", str(src), "--keep", "6", "-o", str(out), "--stats", str(stats)], "is the input")
    assert _digest(src) == want


@pytest.mark.parametrize("case", ["missing folder", "unwritable folder", "empty path", "max-tokens 0",
                                  "stats same as output", "stats a fifo"])
def test_bad_paths_and_flags_are_one_error_line(model, stats, tmp_path, capsys, case) -> None:
    out = str(tmp_path / "out.gguf")
    extra = ["--stats", str(stats)]
    (tmp_path / "c.jsonl").write_text(json.dumps([{"role": "user", "content": "hi"}]) + "\n")
    if case == "missing folder":
        out = str(tmp_path / "nope" / "out.gguf")
    elif case == "unwritable folder":
        out = "/proc/self/out.gguf"           # no file can be made there, not even by root
    elif case == "empty path":
        out = ""
    elif case == "max-tokens 0":
        extra = ["--max-tokens", "0", "--calib", str(tmp_path / "c.jsonl")]
    elif case == "stats same as output":
        extra = ["--stats", out, "--calib", str(tmp_path / "c.jsonl")]
    else:
        os.mkfifo(tmp_path / "fifo.json")
        extra = ["--stats", str(tmp_path / "fifo.json")]
    _refused(capsys, ["prune", str(model), "--keep", "6", "-o", out, *extra])
    assert not Path(tmp_path / "out.gguf").exists()


@pytest.mark.parametrize("errno_, words", [(errno.ENOSPC, "No space left"), (errno.EROFS, "Read-only file system")])
def test_a_full_or_read_only_disk_is_one_error_line(model, stats, tmp_path, capsys, monkeypatch, errno_, words):
    def fail(*args, **kwargs):
        raise OSError(errno_, os.strerror(errno_), str(tmp_path / "out.gguf"))

    monkeypatch.setattr("engine.gguf.write.tempfile.mkstemp", fail)     # the disk fails once the work is done
    _refused(capsys, ["prune", str(model), "--keep", "6", "-o", str(tmp_path / "out.gguf"), "--stats", str(stats)],
             words, before_work=False)
    monkeypatch.undo()
    monkeypatch.setattr("engine.gguf.write.shutil.disk_usage", lambda p: type("U", (), {"free": 0})())
    _refused(capsys, ["prune", str(model), "--keep", "6", "-o", str(tmp_path / "out.gguf"), "--stats", str(stats)],
             "GiB free", before_work=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.json"]


def _stats_json(**override) -> dict:
    layer = {"layer": 0, "tokens": 1, "frequency": [1] * 8, "reap": [0.0] * 8, "reap_sum": [0.0] * 8,
             "ean_sum": [0.0] * 8, "gate_sum": [0.0] * 8}
    d = {"format": prune.STATS_FORMAT, "version": prune.STATS_VERSION, "model": {}, "n_layer": 1, "n_expert": 8,
         "n_expert_used": 2, "calibration": {}, "layers": [layer]}
    d.update(override)
    return d


HOSTILE_STATS = {
    "10^6 x 10^6 experts": json.dumps(_stats_json(n_layer=10**6, n_expert=10**6)),
    "n_layer a float": json.dumps(_stats_json(n_layer=1.5)),
    "n_expert true": json.dumps(_stats_json(n_expert=True)),
    "tokens 10^30": json.dumps(_stats_json(layers=[_stats_json()["layers"][0] | {"tokens": 10**30}])),
    "frequency 1.5": json.dumps(_stats_json(layers=[_stats_json()["layers"][0] | {"frequency": [1.5] * 8}])),
    "a row of 10^5": json.dumps(_stats_json(layers=[_stats_json()["layers"][0] | {"ean_sum": [0] * 10**5}])),
    "model a list": json.dumps(_stats_json(model=[1])),
    "nested 10^5 deep": "[" * 100_000 + "]" * 100_000,
    "not UTF-8": b"\xff\xfe{}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_STATS))
def test_hostile_statistics_files_are_refused_before_allocating(model, tmp_path, capsys, name) -> None:
    path = tmp_path / "hostile.json"
    data = HOSTILE_STATS[name]
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    _refused(capsys, ["prune", str(model), "--keep", "6", "-o", str(tmp_path / "out.gguf"), "--stats", str(path)],
             str(path))


def _calib(tmp_path: Path, image: str) -> Path:
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image", "image": image}, {"type": "text", "text": "hi"}]}]}) + "\n")
    return path


@pytest.mark.parametrize("kind", ["fifo", "folder", "device", "huge", "missing", "bad part"])
def test_calibration_images_must_be_regular_files_under_a_cap(model, tmp_path, kind) -> None:
    """Run as a process of its own with a time and memory limit: a FIFO or /dev/zero that is read never ends."""
    target = tmp_path / "img.png"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "folder":
        target.mkdir()
    elif kind == "device":
        if os.geteuid() != 0:
            pytest.skip("making a device node needs root")
        os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(1, 5))          # /dev/zero's numbers
    elif kind == "huge":
        with open(target, "wb") as f:
            f.truncate(100 << 20)
    calib = _calib(tmp_path, "img.png")
    if kind == "bad part":
        calib.write_text(json.dumps([{"role": "user", "content": [{"type": "image", "image": 7}]}]) + "\n")
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
            "sys.path.insert(0, sys.argv[1]); from engine.__main__ import main; sys.exit(main(sys.argv[2:]))")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT), "prune", str(model), "--keep", "6", "-o",
                           str(tmp_path / "out.gguf"), "--calib", str(calib), "--stats", str(tmp_path / "s.json")],
                          check=False, capture_output=True, text=True, timeout=120)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), done.stderr[-800:]
    assert "c.jsonl:1" in err[0]
