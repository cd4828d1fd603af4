"""``python -m engine bench`` and its llama-bench peer, without building or running llama.cpp: the JSON parser on
output captured from the real llama-bench (``tests/data/llama_bench_sample.json``: llama-cpp-python 0.3.36's
vendored build, ``llama-bench -m small_q4_0.gguf -t 1 -p 16 -n 8 -d 0,64 -r 2 -o json``), the build step
with a fake ``cmake``, the interleaved bench with a fake ``llama-bench`` script, and the NUMA decision with
a faked node count and a recording ``syscall``."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.kernels import numa
from engine.tools import cpu_llama
from engine.registry import open_text

SAMPLE = Path(__file__).parent / "data" / "llama_bench_sample.json"


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_parse_results_of_real_llama_bench_output():
    raw = json.loads(SAMPLE.read_text())
    results = cpu_llama.parse_results(SAMPLE.read_text())
    assert len(results) == len(raw) == 4
    for r, test in zip(results, raw):
        assert (r.n_prompt, r.n_gen, r.n_depth, r.n_threads) == (test["n_prompt"], test["n_gen"], test["n_depth"], 1)
        assert r.samples_ts == tuple(test["samples_ts"]) and len(r.samples_ts) == 2
        assert r.build == f"{test['build_commit']} (build {test['build_number']})"
    assert {(r.n_prompt, r.n_gen, r.n_depth) for r in results} == {(16, 0, 0), (0, 8, 0), (16, 0, 64), (0, 8, 64)}


@pytest.mark.parametrize("text, match", [
    ("not json", "not JSON"),
    ('{"a": 1}', "JSON array"),
    ("[1]", "test 0 is not an object"),
])
def test_parse_results_rejects_bad_output(text, match):
    with pytest.raises(ValueError, match=match):
        cpu_llama.parse_results(text)


@pytest.mark.parametrize("field, value", [("samples_ts", None), ("samples_ts", [0.0]), ("n_gen", "8"),
                                          ("build_commit", 3), ("n_threads", True)])
def test_parse_results_names_the_bad_field(field, value):
    tests = json.loads(SAMPLE.read_text())
    tests[1][field] = value
    with pytest.raises(ValueError, match=f"test 1: .*{field}"):
        cpu_llama.parse_results(json.dumps(tests))


def test_build_commands_use_the_project_flags(tmp_path):
    configure, build = cpu_llama.build_commands(tmp_path / "src", 3)
    assert configure[:5] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "src" / "build")]
    for flag in cpu_llama.LLAMA_CMAKE_ARGS.split() + ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF"]:
        assert flag in configure
    assert build == ["cmake", "--build", str(tmp_path / "src" / "build"), "--target", "llama-bench", "-j", "3"]


FAKE_CMAKE = """import pathlib, sys
args = sys.argv[1:]
log = pathlib.Path(__file__).with_name("calls.txt")
log.write_text(log.read_text() + " ".join(args) + "\\n" if log.exists() else " ".join(args) + "\\n")
if args[0] == "--build":
    for p in (10, 10, 55, 100):
        print(f"[{p:3d}%] Building CXX object x.o", flush=True)
    if (pathlib.Path(__file__).parent / "fail").exists():
        print("error: boom"); sys.exit(1)
    out = pathlib.Path(args[1]) / "bin" / "llama-bench"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("#!/bin/sh\\n"); out.chmod(0o755)
else:
    print("-- Configuring done")
"""


def _fake_source(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(cache folder holding an unpacked fake source tree, that tree, the fake cmake)."""
    cache = tmp_path / "cache"
    source = cpu_llama.source_dir(cache)
    source.mkdir(parents=True)
    (source / "CMakeLists.txt").write_text("project(fake)\n")
    return cache, source, _script(tmp_path / "cmake", FAKE_CMAKE)


def test_ensure_llama_bench_builds_once_with_progress(tmp_path):
    cache, source, cmake = _fake_source(tmp_path)
    lines: list[str] = []
    binary = cpu_llama.ensure_llama_bench(cache, lines.append, jobs=2, cmake=str(cmake))
    assert binary == cpu_llama.binary_path(cache) and os.access(binary, os.X_OK)
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls == [" ".join(c[1:]) for c in cpu_llama.build_commands(source, 2, str(cmake))]
    progress = [line for line in lines if line.startswith("building llama-bench: ")]
    assert [p.split(": ")[1].split("%")[0] for p in progress] == ["10", "55", "100"]
    assert "-- Configuring done" in (cache / "build.log").read_text()
    assert cpu_llama.ensure_llama_bench(cache, lines.append, cmake=str(cmake)) == binary
    assert len((tmp_path / "calls.txt").read_text().splitlines()) == 2          # cached: cmake not run again


def test_ensure_llama_bench_reports_a_failed_build(tmp_path):
    cache, _, cmake = _fake_source(tmp_path)
    (tmp_path / "fail").write_text("")
    with pytest.raises(RuntimeError, match="exit 1.*error: boom"):
        cpu_llama.ensure_llama_bench(cache, lambda _: None, cmake=str(cmake))



def test_ensure_llama_bench_without_cmake_says_what_to_install(tmp_path):
    cache, _, _ = _fake_source(tmp_path)
    with pytest.raises(RuntimeError, match="needs cmake and a C\\+\\+ compiler.*--llama-bench PATH"):
        cpu_llama.ensure_llama_bench(cache, lambda _: None, cmake=str(tmp_path / "no-such-cmake"))
    assert not (cache / "build.log").exists()

FAKE_LLAMA_BENCH = """import json, sys
a = sys.argv[1:]
get = lambda flag: a[a.index(flag) + 1]
if "FAIL" in get("-m"):
    print("llama_model_load: error loading model", file=sys.stderr); sys.exit(1)
t, p, n = int(get("-t")), int(get("-p")), int(get("-n"))
sample = json.load(open(%r))[0]
tests = []
for d in map(int, (get("-d") if "-d" in a else "0").split(",")):
    for n_p, n_g, rate in ((p, 0, 100.0 * t), (0, n, 10.0 * t / (1 + d / 1000))):
        if n_p or n_g:
            tests.append(dict(sample, n_prompt=n_p, n_gen=n_g, n_depth=d, n_threads=t, samples_ts=[rate]))
print(json.dumps(tests))
""" % str(SAMPLE)


def test_fetch_source_unpacks_the_sdist(tmp_path, monkeypatch):
    """``pip download`` (faked: it writes an archive shaped like the sdist) then unpacking into the cache folder."""
    import io
    import subprocess
    import tarfile
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        if "llama-cpp-python==0.0-broken" in " ".join(cmd):
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")
        name = f"llama_cpp_python-{cpu_llama.LLAMA_CPP_PYTHON_VERSION}"
        with tarfile.open(Path(cmd[cmd.index("-d") + 1]) / f"{name}.tar.gz", "w:gz") as tar:
            info = tarfile.TarInfo(f"{name}/vendor/llama.cpp/CMakeLists.txt")
            info.size = 5
            tar.addfile(info, io.BytesIO(b"x\n\n\n\n"))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(cpu_llama.subprocess, "run", fake_pip)
    source = cpu_llama.fetch_source(tmp_path / "cache", lambda _: None)
    assert source == cpu_llama.source_dir(tmp_path / "cache") and (source / "CMakeLists.txt").is_file()
    assert calls[0][1:6] == ["-m", "pip", "download", "--no-deps", "--no-binary"]
    monkeypatch.setattr(cpu_llama, "LLAMA_CPP_PYTHON_VERSION", "0.0-broken")
    with pytest.raises(RuntimeError, match="No matching distribution"):
        cpu_llama.fetch_source(tmp_path / "other", lambda _: None)


def test_run_llama_bench_parses_and_measures(tmp_path):
    fake = _script(tmp_path / "llama-bench", FAKE_LLAMA_BENCH)
    results, peak = cpu_llama.run_llama_bench(cpu_llama.bench_command(fake, "m.gguf", 2, 0, 16, (4096, 16384)))
    assert [(r.n_gen, r.n_depth, r.samples_ts) for r in results] == [(16, 4096, (20 / 5.096,)),
                                                                    (16, 16384, (20 / 17.384,))]
    assert peak > 0
    with pytest.raises(RuntimeError, match="exit 1.*error loading model"):
        cpu_llama.run_llama_bench(cpu_llama.bench_command(fake, "FAIL.gguf", 1, 16, 16))


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    from engine.testing.synth import synth
    path = tmp_path_factory.mktemp("bench") / "tiny.gguf"
    synth(path, "tiny", quant="q4_0", vocab=None)
    return path


def test_fill_context(tiny_q4):
    from engine.tools.cpu_bench import fill_context
    hp = open_text(tiny_q4).hparams
    state = fill_context(hp, 5, 9, np.random.default_rng(0))
    assert state.pos == 5 and state.k
    for a in (*state.k.values(), *state.v.values()):
        assert np.all(a[:5] != 0) and np.all(a[5:] == 0)
    assert all(np.all(a != 0) for a in state.ssm.values())


@pytest.mark.parametrize("weights", ["map", "ram"])
def test_bench_interleaves_with_the_peer(tiny_q4, tmp_path, weights):
    from engine.kernels import cpu
    from engine.tools import cpu_bench
    if not cpu.available():
        pytest.skip("native CPU kernels not built")
    fake = _script(tmp_path / "llama-bench", FAKE_LLAMA_BENCH)
    lines: list[str] = []
    level = cpu.supported_isas()[-1]
    samples = cpu_bench.run(tiny_q4, [1], [level], n_prompt=4, n_gen=2, depths=[8], depth_gen=2, repeat=2,
                            peers=[cpu_llama.Peer("llama.cpp", fake)], stream_gib=1 / 64, stream_runs=2,
                            out=lines.append, weights=weights)
    assert [(s.engine, s.round) for s in samples] == [("deltadesk", 0), ("llama.cpp", 0), ("deltadesk", 1),
                                                       ("llama.cpp", 1)]
    ours, peer = samples[0], samples[1]
    assert set(ours.depth_tg) == {8} and ours.tg_tok_s > 0 and ours.pp_tok_s > 0
    assert (peer.pp_tok_s, peer.tg_tok_s, peer.depth_tg) == (100.0, 10.0, {8: 10.0 / 1.008})
    text = "\n".join(lines)
    assert f"NUMA nodes: {numa.node_count()}" in text
    assert "RSS after load:" in text and "anonymous" in text and "file-backed" in text
    assert "llama.cpp peak RSS" in text
    rereads = [line for line in lines if "into page cache" in line]
    # map: only after the peer's round-1 run; ram: our weights do not live in the page cache
    assert [line.split()[0] for line in rereads] == (["2"] if weights == "map" else [])
    assert (f"weights ram: read {tiny_q4.name}" in text) == (weights == "ram")
    # on AVX-512 VNNI the bench's level, the Q4_0 rows read into memory are also interleaved at load
    assert re.search(r"Q4_0 resident( interleaved)?:" if weights == "ram" else "Q4_0 mapped:", text)
    summary = [line for line in lines if line.startswith("deltadesk") and "vs llama.cpp" in line]
    ratios = [a.tg_tok_s / b.tg_tok_s for a, b in zip(samples[0::2], samples[1::2])]
    assert len(summary) == 1 and f"tg {cpu_bench.spread(ratios)}x" in summary[0]
    assert "best peer" not in summary[0]


FAKE_IK_LLAMA_BENCH = """import json, sys
a = sys.argv[1:]
get = lambda flag: a[a.index(flag) + 1]
repack = "-rtr" in a and get("-rtr") == "1"
t, p, n = int(get("-t")), int(get("-p")), int(get("-n"))
sample = json.load(open(%r))[0]
tests = []
for d in map(int, (get("-d") if "-d" in a else "0").split(",")):
    for n_p, n_g, rate in ((p, 0, (300.0 if repack else 200.0) * t), (0, n, (8.0 if repack else 12.0) * t)):
        if n_p or n_g:
            tests.append(dict(sample, n_prompt=n_p, n_gen=n_g, n_depth=d, n_threads=t, samples_ts=[rate]))
print(json.dumps(tests))
""" % str(SAMPLE)


def test_bench_compares_with_each_peer_and_the_best_per_figure(tiny_q4, tmp_path):
    """ik_llama.cpp runs twice (default flags, then -rtr 1, passed last on its command line); the summary gives
    the ratio to each peer and to the best peer, whose figures are the per-round maximum over the peers: here
    the rtr run's pp and the default run's tg, so both best-peer ratios are derived from different peers."""
    from engine.kernels import cpu
    from engine.tools import cpu_bench
    if not cpu.available():
        pytest.skip("native CPU kernels not built")
    fake = _script(tmp_path / "ik-llama-bench", FAKE_IK_LLAMA_BENCH)
    lines: list[str] = []
    level = cpu.supported_isas()[-1]
    samples = cpu_bench.run(tiny_q4, [1], [level], n_prompt=4, n_gen=2, depths=[], depth_gen=2, repeat=2,
                            peers=cpu_llama.ik_llama_peers(fake), stream_gib=1 / 64, stream_runs=2,
                            out=lines.append)
    assert [s.engine for s in samples] == ["deltadesk", "ik_llama", "ik_llama+rtr"] * 2
    assert [(s.pp_tok_s, s.tg_tok_s) for s in samples[1:3]] == [(200.0, 12.0), (300.0, 8.0)]
    ours = samples[0::3]
    summary = [line for line in lines if line.startswith("deltadesk")]
    assert len(summary) == 1
    best_tg = cpu_bench.spread([s.tg_tok_s / 12.0 for s in ours])
    best_pp = cpu_bench.spread([s.pp_tok_s / 300.0 for s in ours], ".2f")
    assert f"vs best peer: tg {best_tg}x, pp {best_pp}x" in summary[0]
    assert "vs ik_llama:" in summary[0] and "vs ik_llama+rtr:" in summary[0]
    assert "ik_llama peak RSS" in "\n".join(lines) and "ik_llama+rtr peak RSS" in "\n".join(lines)


def test_roofline_sets_each_round_against_its_own_stream_read(tiny_q4, tmp_path, monkeypatch):
    """A round's decode is divided by the bandwidth measured in that round at that thread count (the median of
    its runs), and the peer of the round carries the same figure; the bandwidths here are distinct per round."""
    from engine.kernels import cpu
    from engine.tools import cpu_bench
    if not cpu.available():
        pytest.skip("native CPU kernels not built")
    reads = iter([[4.0, 6.0, 5.0], [10.0, 30.0, 20.0]])
    calls = []
    monkeypatch.setattr(cpu_bench, "stream_bandwidth", lambda n, nbytes, runs: calls.append((n, runs)) or next(reads))
    fake = _script(tmp_path / "llama-bench", FAKE_LLAMA_BENCH)
    lines: list[str] = []
    samples = cpu_bench.run(tiny_q4, [1], [cpu.supported_isas()[-1]], n_prompt=4, n_gen=2, depths=[], depth_gen=2,
                            repeat=2, peers=[cpu_llama.Peer("llama.cpp", fake)], stream_gib=1 / 64, stream_runs=3,
                            out=lines.append)
    assert calls == [(1, 3), (1, 3)]
    assert [s.stream_gb_s for s in samples] == [5.0, 5.0, 20.0, 20.0]
    per_token = open_text(tiny_q4).bytes_per_token()
    ours = [s for s in samples if s.engine == "deltadesk"]
    roof = cpu_bench.spread([100 * per_token * s.tg_tok_s / 1e9 / s.stream_gb_s for s in ours], ".0f")
    summary = [line for line in lines if line.startswith("deltadesk")]
    assert len(summary) == 1 and f"roofline {roof} % of 12.5 (5.0-20.0) GB/s" in summary[0]
    assert sum("stream read, 1 thread(s)" in line and "5.0 (4.0-6.0) GB/s" in line for line in lines) == 1


def test_bench_command_puts_the_peer_flags_last():
    cmd = cpu_llama.bench_command("ik", "m.gguf", 2, 512, 64, flags=("-rtr", "1"))
    assert cmd[-2:] == ["-rtr", "1"] and cmd[cmd.index("-p") + 1] == "512"


def test_bench_command_passes_depths_only_when_asked():
    """ik_llama.cpp's llama-bench has no -d: a depth-0-only run must not pass it; real depths still do."""
    assert "-d" not in cpu_llama.bench_command("ik", "m.gguf", 2, 512, 64)
    assert "-d" not in cpu_llama.bench_command("ik", "m.gguf", 2, 512, 64, (0,))
    cmd = cpu_llama.bench_command("lb", "m.gguf", 2, 0, 16, (4096, 16384))
    assert cmd[cmd.index("-d") + 1] == "4096,16384"


def test_bench_cli(tiny_q4, capsys, tmp_path):
    from engine.__main__ import main
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 512)", "(default: 64)", "(default: [4096, 16384])", "(default: 3)", "--llama-bench PATH"):
        assert shown in help_text
    assert main(["bench", str(tiny_q4), "--llama-bench", str(tmp_path / "absent")]) == 2
    assert "not an executable file" in capsys.readouterr().err
    assert main(["bench", str(tiny_q4), "--ik-llama-bench", str(tmp_path / "absent")]) == 2
    assert "--ik-llama-bench" in capsys.readouterr().err


def test_real_llama_bench_has_depth():
    """On a machine with the peer built (DELTADESK_LLAMA_BENCH = its path): its help lists -d / --n-depth,
    which the bench's 4k / 16k decode needs. Skipped elsewhere (CI)."""
    binary = os.environ.get("DELTADESK_LLAMA_BENCH")
    if not binary or not os.access(binary, os.X_OK):
        pytest.skip("no llama-bench binary (set DELTADESK_LLAMA_BENCH)")
    import subprocess
    done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    assert "--n-depth" in done.stdout + done.stderr


@pytest.mark.parametrize("flag", ["--gen", "--threads", "--depth-gen", "--repeat"])
def test_bench_refuses_counts_below_one_before_loading(flag, capsys) -> None:
    """A count of 0 (a tg0 rate would divide by zero) is an argparse error naming the flag; no file is read."""
    from engine.__main__ import main
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "no-such-file.gguf", flag, "0"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and flag in err and "positive integer" in err and "Traceback" not in err


def test_bench_refuses_a_negative_prompt_length(capsys) -> None:
    from engine.__main__ import main
    with pytest.raises(SystemExit):
        main(["bench", "no-such-file.gguf", "--prompt", "-5"])
    assert "whole number" in capsys.readouterr().err


def test_warm_page_cache_reads_the_file_through_a_huge_page_map(tmp_path, monkeypatch):
    """The whole length is reported (not a multiple of a page or a chunk; an empty file), and the pages are
    read through a map given the engine's huge-page advice, not by read()."""
    from engine.tools import cpu_bench

    advised = []
    monkeypatch.setattr(cpu_bench, "advise_huge_pages", lambda m: advised.append(m.size))
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 4099)
    assert cpu_bench.warm_page_cache(path, chunk=8192)[0] == 256 * 4099
    assert advised == [256 * 4099]
    (tmp_path / "empty.bin").write_bytes(b"")
    assert cpu_bench.warm_page_cache(tmp_path / "empty.bin")[0] == 0
