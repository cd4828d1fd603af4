"""engine.hub against a fake hub on 127.0.0.1 (tests/hub_fake.py), driven by the real huggingface_hub client
through HF_ENDPOINT: listing, header fit before download, verified and resumable downloads, every bad input
of the issue, and the command line."""

from __future__ import annotations

import errno
import hashlib
import importlib
import threading
from pathlib import Path

import pytest

from engine.errors import EngineError, ModelFormatError, UnsupportedModelError
from engine.gguf.file import GGUFFile
from engine.registry import open_text
from engine.hub.download import (
    DownloadCancelled,
    download_model,
    fit_remote,
    pick_file,
    pick_mmproj,
    remote_header,
)
from engine.hub.fit import Machine, estimate
from engine.hub.hubapi import HubError, HubOffline, list_repo
from engine.hub.store import ModelStore, model_files
from tests.hub_fake import FakeHub, FakeRepo

dl = importlib.import_module("engine.hub.download")
REPO = "tester/Tiny-GGUF"
MACHINE = Machine(ram_bytes=24 << 30, bandwidth_gbps=10.0)


@pytest.fixture(scope="module")
def synth_files(tmp_path_factory) -> dict[str, bytes]:
    """The tiny synth model (Q8_0, real vocabulary) and its projector, as bytes."""
    from engine.testing.synth import synth
    from engine.testing.pairs import synth_mmproj_for
    d = tmp_path_factory.mktemp("synth")
    synth(d / "tiny.gguf", "tiny", quant="q8_0", seed=1)
    synth_mmproj_for(d / "tiny-mmproj.gguf", "tiny", seed=1)
    return {"Tiny-Q8_0.gguf": (d / "tiny.gguf").read_bytes(), "mmproj-F16.gguf": (d / "tiny-mmproj.gguf").read_bytes()}


@pytest.fixture
def hub(synth_files, tmp_path, monkeypatch):
    """A fake hub serving the synth pair as REPO, with the environment pointing at it and a fresh store."""
    fake = FakeHub(repos={REPO: FakeRepo(dict(synth_files))}, tokens={"hf_good"}).start()
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("DELTADESK_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("PYTHON_KEYRING_BACKEND", "keyring.backends.null.Keyring")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    yield fake
    fake.close()


def _blob_gets(fake: FakeHub) -> list[str]:
    """Range headers of the GETs of file bytes ("" for a whole-file GET)."""
    return [rng for method, path, rng, _ in fake.requests if method == "GET" and path.startswith("/blob/")]


def test_listing_has_sizes_sha256_and_splits_mmproj(hub, synth_files):
    listing = list_repo(REPO)
    assert listing.commit == hub.repos[REPO].sha
    (model,) = listing.models
    assert (model.name, model.quant, model.size) == ("Tiny-Q8_0.gguf", "Q8_0", len(synth_files["Tiny-Q8_0.gguf"]))
    assert model.sha256 == hashlib.sha256(synth_files["Tiny-Q8_0.gguf"]).hexdigest()
    assert pick_mmproj(listing).name == "mmproj-F16.gguf"


def test_fit_from_ranged_header_equals_fit_of_local_file(hub, synth_files, tmp_path):
    listing = list_repo(REPO)
    f = pick_file(listing, quant="q8_0")
    remote = fit_remote(listing, f, pick_mmproj(listing), 4096, MACHINE)
    local_path = tmp_path / "local.gguf"
    local_path.write_bytes(synth_files["Tiny-Q8_0.gguf"])
    mm = tmp_path / "mm.gguf"
    mm.write_bytes(synth_files["mmproj-F16.gguf"])
    from engine.gguf.header import read_header
    local = estimate(open_text(local_path), local_path.stat().st_size, 4096, MACHINE, read_header(mm))
    assert remote == local
    ranges = _blob_gets(hub)
    assert ranges and all(r.startswith("bytes=") for r in ranges)      # never the whole file
    read = sum(int(r.split("-")[1]) - int(r[6:].split("-")[0]) + 1 for r in ranges)
    assert read < f.size + len(synth_files["mmproj-F16.gguf"])
    assert len(ranges) >= 3     # the text header (~12 MiB of vocabulary) needed more than the first 4 MiB read


def test_download_verifies_stores_pair_and_resolves(hub, synth_files):
    listing = list_repo(REPO)
    seen = []
    entry = download_model(listing, pick_file(listing, quant="Q8_0"), pick_mmproj(listing), report=seen.append)
    store = ModelStore()
    path, mmproj = store.files(entry)
    assert path.read_bytes() == synth_files["Tiny-Q8_0.gguf"]
    assert mmproj is not None and mmproj.parent == path.parent
    assert mmproj.read_bytes() == synth_files["mmproj-F16.gguf"]
    assert {p.stage for p in seen} == {"downloading", "verifying"} and seen[-1].done == seen[-1].total
    assert not any((store.root / ".partial").rglob("*.part"))
    assert model_files(f"{REPO}:q8_0") == (path, mmproj)
    assert store.models()[0].last_used > 0


def test_cancel_keeps_partial_and_next_pull_resumes(hub, synth_files):
    hub.delay = 0.002
    listing = list_repo(REPO)
    f = pick_file(listing, quant="Q8_0")
    cancel = threading.Event()

    def report(p):
        if p.done > 8 << 20:
            cancel.set()
    with pytest.raises(DownloadCancelled, match="resumes"):
        download_model(listing, f, None, report=report, cancel=cancel)
    part = ModelStore().partial(REPO, f.name, f.sha256)
    kept = part.stat().st_size
    assert 8 << 20 < kept < f.size
    hub.delay = 0.0
    hub.requests.clear()
    entry = download_model(listing, f, None)
    assert f"bytes={kept}-" in _blob_gets(hub)
    assert ModelStore().files(entry)[0].read_bytes() == synth_files["Tiny-Q8_0.gguf"]


def test_connection_dropped_mid_file_resumes(hub, synth_files):
    hub.drop_after = 24 << 20      # past the client's first 10 MiB chunks: it resumes from what it wrote
    listing = list_repo(REPO)
    entry = download_model(listing, pick_file(listing, quant="Q8_0"), None)
    first, retry = _blob_gets(hub)
    assert first == "" and retry.startswith("bytes=") and 0 < int(retry[6:-1]) <= 24 << 20
    assert ModelStore().files(entry)[0].read_bytes() == synth_files["Tiny-Q8_0.gguf"]


def test_sha256_mismatch_deletes_and_says_so(hub):
    hub.corrupt = True
    listing = list_repo(REPO)
    f = pick_file(listing, quant="Q8_0")
    with pytest.raises(HubError, match="sha256 mismatch.*deleted"):
        download_model(listing, f, None)
    store = ModelStore()
    assert not store.partial(REPO, f.name, f.sha256).exists()
    assert not store.path(REPO, f.name).exists() and store.models() == []


def test_disk_full_mid_download_keeps_bytes_then_resumes(hub, synth_files, monkeypatch):
    class Full:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def tell(self):
            return self.fh.tell()

        def write(self, b):
            if self.fh.tell() + len(b) > 5 << 20:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.fh.write(b)

        def flush(self):
            self.fh.flush()

    monkeypatch.setattr(dl, "open", lambda p, mode: Full(open(p, mode)), raising=False)  # noqa: SIM115 - Full closes it
    listing = list_repo(REPO)
    f = pick_file(listing, quant="Q8_0")
    with pytest.raises(HubError, match="disk is full.*kept.*resume"):
        download_model(listing, f, None)
    assert ModelStore().partial(REPO, f.name, f.sha256).stat().st_size <= 5 << 20
    monkeypatch.undo()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    entry = download_model(listing, f, None)
    assert ModelStore().files(entry)[0].read_bytes() == synth_files["Tiny-Q8_0.gguf"]


def test_free_disk_checked_before_any_byte(hub, monkeypatch):
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda p: type("U", (), {"free": 1 << 20})())
    listing = list_repo(REPO)
    with pytest.raises(HubError, match="not enough free disk"):
        download_model(listing, pick_file(listing, quant="Q8_0"), pick_mmproj(listing))
    assert _blob_gets(hub) == []


def test_missing_repo_no_gguf_and_unknown_quant(hub):
    with pytest.raises(HubError, match="no such repository"):
        list_repo("tester/Nope-GGUF")
    hub.repos["tester/Text"] = FakeRepo({"model.safetensors": b"x" * 10})
    with pytest.raises(HubError, match="holds no GGUF"):
        list_repo("tester/Text")
    with pytest.raises(HubError, match="no single quant 'Q4_K_M'.*Q8_0"):
        pick_file(list_repo(REPO), quant="Q4_K_M")
    with pytest.raises(HubError, match="not a repository id"):
        list_repo("just-a-name")


def test_gated_without_token_and_wrong_token(hub, monkeypatch):
    hub.repos[REPO].gated = True
    listing = list_repo(REPO)
    f = pick_file(listing, quant="Q8_0")
    with pytest.raises(HubError, match="gated and no token is set"):
        fit_remote(listing, f, None, 4096, MACHINE)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(HubError, match="rejected the token"):
        list_repo(REPO)
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    assert fit_remote(listing, f, None, 4096, MACHINE).verdict == "fits"
    cdn_auth = [auth for _, path, _, auth in hub.requests if path.startswith("/blob/")]
    assert cdn_auth and not any(cdn_auth)      # the token never leaves the hub's origin


def test_unsupported_architecture_is_refused_before_download(hub, synth_files):
    data = synth_files["Tiny-Q8_0.gguf"]
    key = data.index(b"general.architecture")
    at = data.index(b"qwen35moe", key)
    hub.repos["tester/Llama-GGUF"] = FakeRepo({"Llama-Q8_0.gguf": data[:at] + b"llama_moe" + data[at + 9:]})
    listing = list_repo("tester/Llama-GGUF")
    with pytest.raises(UnsupportedModelError, match="'llama_moe'"):
        fit_remote(listing, listing.models[0], None, 4096, MACHINE)
    assert all(r and int(r[6:].split("-")[0]) < 64 << 20 for r in _blob_gets(hub))


def test_header_that_lies_about_sizes_is_refused(hub, synth_files):
    data = synth_files["Tiny-Q8_0.gguf"]
    hub.repos["tester/Short-GGUF"] = FakeRepo({"Short-Q8_0.gguf": data[:len(data) // 2]})
    listing = list_repo("tester/Short-GGUF")
    with pytest.raises(ModelFormatError, match="extends past the end of the file"):
        remote_header("tester/Short-GGUF", listing.models[0], listing.commit)


def test_hub_unreachable_and_offline_mode_keep_downloads_usable(hub, monkeypatch):
    listing = list_repo(REPO)
    download_model(listing, pick_file(listing, quant="Q8_0"), pick_mmproj(listing))
    hub.close()
    with pytest.raises(HubOffline, match="cannot be reached.*still work"):
        list_repo(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubOffline, match="offline mode"):
        list_repo(REPO)
    path, mmproj = model_files(f"{REPO}:Q8_0")
    assert open_text(path).hparams.n_layer == 4 and mmproj is not None
    with pytest.raises(EngineError, match="not downloaded.*engine pull tester/Other-GGUF --quant Q4_0"):
        model_files("tester/Other-GGUF:Q4_0")


def test_cli_pull_models_and_repo_quant_as_model(hub, capsys):
    from engine.__main__ import main
    assert main(["pull", REPO, "--context", "2048"]) == 0
    err = capsys.readouterr().err
    assert "Tiny-Q8_0.gguf: fits: needs" in err and "an estimate" in err
    assert "mapped weights" in err and "downloaded tester/Tiny-GGUF:Q8_0" in err and "sha256 verified" in err
    assert "[downloading Tiny-Q8_0.gguf] [####" in err and "MiB/s" in err and "[verifying Tiny-Q8_0.gguf]" in err
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "tester/Tiny-GGUF:Q8_0" in out and "Q8_0" in out and "mmproj-F16.gguf" in out
    assert main(["info", f"{REPO}:Q8_0"]) == 0
    assert "qwen35moe" in capsys.readouterr().out
    assert main(["generate", "--model", f"{REPO}:Q8_0", "--prompt", "Hi", "-n", "2", "--temp", "0",
                 "--context", "256"]) == 0
    assert "mmproj-F16.gguf" in capsys.readouterr().err        # the downloaded tower loads with it
    from engine.__main__ import _served_name, build_parser
    served = build_parser().parse_args(["serve", "--model", f"{REPO}:Q8_0"])
    assert _served_name(served, Path("Tiny-Q8_0.gguf")) == f"{REPO}:Q8_0"      # the id the user pulled
    assert _served_name(build_parser().parse_args(["serve", "--model", "x.gguf"]), Path("x.gguf")) == "x"
    assert main(["info", "tester/Other-GGUF:Q4_0"]) == 2
    assert "not downloaded" in capsys.readouterr().err
    assert main(["pull", "tester/Nope-GGUF"]) == 2
    assert "no such repository" in capsys.readouterr().err


def test_store_paths_stay_inside_root(tmp_path):
    store = ModelStore(tmp_path)
    assert store.path("a/b", "sub/x.gguf") == tmp_path / "a" / "b" / "x.gguf"
    assert Path(store.partial("a/b", "x.gguf", "ab" * 32)).is_relative_to(tmp_path / ".partial")


def test_delete_removes_file_shared_mmproj_last_and_snapshots(hub, tmp_path):
    from engine.hub.store import delete_model
    from engine.turn.prefix_cache import snapshot_folder
    listing = list_repo(REPO)
    entry = download_model(listing, pick_file(listing, quant="Q8_0"), pick_mmproj(listing))
    store = ModelStore()
    path, mmproj = store.files(entry)
    snaps = snapshot_folder(tmp_path / "snapshots", GGUFFile.open(path).identity)
    snaps.mkdir(parents=True)
    (snaps / "x.snap").write_bytes(b"s")
    snaps16 = snapshot_folder(tmp_path / "snapshots", GGUFFile.open(path).identity, "f16")
    snaps16.mkdir()
    other = snapshot_folder(tmp_path / "snapshots", "another-model")
    other.mkdir()
    removed = delete_model(entry, store, tmp_path / "snapshots")
    assert set(removed) == {snaps, snaps16, path, mmproj}
    assert not path.exists() and not mmproj.exists() and not snaps.exists() and not snaps16.exists()
    assert other.is_dir()
    assert store.models() == []


def test_header_larger_than_the_bound_is_refused_unread(monkeypatch):
    """A header whose first value is a 300 MiB uint8 array (inside a 512 MiB file) needs more than
    MAX_HEADER_READ: refused after the first read, never fetched (growing reads: the listing test above)."""
    import struct

    from engine.hub.catalogue import HubFile
    size = 512 << 20
    prefix = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 0, 300 << 20)
    asked = []

    def read_range(repo, name, revision, start, stop):
        asked.append((start, stop))
        return (prefix + bytes(stop))[start:stop]
    monkeypatch.setattr(dl, "read_range", read_range)
    with pytest.raises(HubError, match="larger than 256 MiB"):
        remote_header("r/x", HubFile("r/x", "x.gguf", size, "0" * 64), "main")
    assert asked == [(0, dl.FIRST_READ)]


def test_vram_plan_under_the_budget_or_why_not(synth_files, tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(synth_files["Tiny-Q8_0.gguf"])
    f = open_text(path)
    roomy = estimate(f, path.stat().st_size, 1024, Machine(24 << 30, 10.0, vram_budget=1 << 30))
    assert "GiB placed at load" in roomy.vram and "of a 1.00 GiB budget" in roomy.vram
    tiny = estimate(f, path.stat().st_size, 1024, Machine(24 << 30, 10.0, vram_budget=1 << 20))
    assert tiny.vram.startswith("prefill runs on the CPU: VRAM budget")
    assert estimate(f, path.stat().st_size, 1024, MACHINE).vram == "no GPU: prefill runs on the CPU"
