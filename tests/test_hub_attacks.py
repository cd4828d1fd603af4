"""engine.hub against a hostile or broken hub (tests/hub_fake.py on 127.0.0.1): odd repository ids, redirect
loops, a listing whose sha256 is not a digest, stalled and trickling transfers, and two downloads of one file
at once. Every case ends in a HubError with plain words (or a finished, verified file), never a traceback, a
hang, or a byte written outside the store."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

from engine.hub.download import DownloadCancelled, download_model, fit_remote, pick_file
from engine.hub.hubapi import HubError, list_repo
from engine.hub.store import ModelStore
from tests import test_hub
from tests.hub_fake import FakeRepo
from tests.test_hub import MACHINE, REPO

synth_files, hub = test_hub.synth_files, test_hub.hub      # the fake hub serving the synth pair, as fixtures



@pytest.mark.parametrize("repo", ["a/b c", "../x", "x/..", "owner/na--me", "tester/Tiny-GGUF/extra", "a/b\x00"])
def test_odd_repo_ids_are_refused_in_words(hub, repo):
    with pytest.raises(HubError, match="not a repository id"):
        list_repo(repo)


def test_cli_pull_takes_repo_quant_and_refuses_odd_ids(hub, capsys):
    from engine.__main__ import main
    assert main(["pull", "a/b c"]) == 2
    err = capsys.readouterr().err
    assert "not a repository id" in err and "Traceback" not in err
    assert main(["pull", f"{REPO}:q8_0", "--no-mmproj", "--context", "512"]) == 0
    assert "downloaded tester/Tiny-GGUF:Q8_0" in capsys.readouterr().err


def test_redirect_loop_is_a_hub_error(hub):
    hub.redirect_loop = True
    listing = list_repo(REPO)
    f = pick_file(listing, quant="Q8_0")
    with pytest.raises(HubError, match="loop"):
        fit_remote(listing, f, None, 1024, MACHINE)
    with pytest.raises(HubError, match="loop|redirect"):
        download_model(listing, f, None)
    assert ModelStore().models() == []


def test_listed_sha256_that_is_not_a_digest_writes_nothing(hub, tmp_path):
    hub.listed_sha256 = "../../../../../../escaped" + "0" * 40
    listing = list_repo(REPO)
    f = pick_file(listing, quant="Q8_0")
    assert f.sha256 is None
    with pytest.raises(HubError, match="could not be verified"):
        download_model(listing, f, None)
    assert not any(p.name.startswith("Tiny") for p in tmp_path.rglob("*") if "models" not in p.parts)


def _start(listing, f, cancel, seen):
    """Run download_model on a thread; returns (thread, outcome list: the entry or the exception)."""
    out = []

    def body():
        try:
            out.append(download_model(listing, f, None, report=seen.append, cancel=cancel))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out.append(exc)
    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


def _wait(cond, limit=10.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, "timed out waiting"
        time.sleep(0.02)


def test_cancel_ends_a_stalled_transfer(hub, monkeypatch):
    """The server sends 1 MiB and then nothing: the bytes show as progress at once (not after a 10 MiB
    buffer fills) and Cancel ends the blocked read (it takes tens of ms; the bound allows a loaded machine,
    and the read timeout is made longer than the test, so only Cancel can end it); the next pull resumes."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DOWNLOAD_TIMEOUT", 600)
    hub.stall_after = 1 << 20
    listing = list_repo(REPO)
    f = pick_file(listing, quant="Q8_0")
    cancel, seen = threading.Event(), []
    part = ModelStore().partial(REPO, f.name, f.sha256)
    t, out = _start(listing, f, cancel, seen)
    _wait(lambda: part.exists() and part.stat().st_size == 1 << 20 and seen)
    time.sleep(0.3)                                 # the read is blocked on the silent server by now, as a rule
    t0 = time.monotonic()
    cancel.set()
    t.join(30)
    took = time.monotonic() - t0
    hub.release.set()
    assert not t.is_alive() and isinstance(out[0], DownloadCancelled) and took < 10, (out, took)
    assert part.stat().st_size == 1 << 20
    entry = download_model(listing, f, None)
    assert ModelStore().files(entry)[0].stat().st_size == f.size


def test_stalled_server_times_out_and_resumes(hub, synth_files, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DOWNLOAD_TIMEOUT", 0.5)
    hub.stall_after = 2 << 20
    listing = list_repo(REPO)
    entry = download_model(listing, pick_file(listing, quant="Q8_0"), None)
    assert ModelStore().files(entry)[0].read_bytes() == synth_files["Tiny-Q8_0.gguf"]
    blob = [rng for m, p, rng, _ in hub.requests if m == "GET" and p.startswith("/blob/")]
    assert blob == ["", f"bytes={2 << 20}-"]


def test_two_downloads_of_one_file_never_share_the_staging_file(hub, synth_files):
    hub.stall_after = 1 << 20
    listing = list_repo(REPO)
    f = pick_file(listing, quant="Q8_0")
    cancel, seen = threading.Event(), []
    t, out = _start(listing, f, cancel, seen)
    _wait(lambda: bool(seen))
    with pytest.raises(HubError, match="already being downloaded"):
        download_model(listing, f, None)
    cancel.set()
    t.join(30)
    assert isinstance(out[0], DownloadCancelled)
    hub.release.set()
    entry = download_model(listing, f, None)
    assert ModelStore().files(entry)[0].read_bytes() == synth_files["Tiny-Q8_0.gguf"]


@pytest.mark.parametrize("odd", ["symlink", "fifo"])
def test_odd_thing_at_the_staging_path_is_replaced(hub, synth_files, tmp_path, odd):
    listing = list_repo(REPO)
    f = pick_file(listing, quant="Q8_0")
    part = ModelStore().partial(REPO, f.name, f.sha256)
    part.parent.mkdir(parents=True)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep")
    if odd == "symlink":
        part.symlink_to(outside)
    else:
        os.mkfifo(part)
    t, out = _start(listing, f, None, [])
    t.join(30)
    assert not t.is_alive(), "the download hung on the staging path"
    entry = out[0]
    assert ModelStore().files(entry)[0].read_bytes() == synth_files["Tiny-Q8_0.gguf"]
    assert outside.read_bytes() == b"keep"


def _many_keys(n: int) -> bytes:
    """A GGUF v3 header of ``n`` distinct one-byte metadata keys and no tensors."""
    import struct
    body = b"".join(struct.pack("<Q", 8) + b"k%07d" % i + struct.pack("<I", 0) + b"\x01" for i in range(n))
    return b"GGUF" + struct.pack("<IQQ", 3, 0, n) + body


def test_header_claiming_a_flood_of_keys_is_refused_at_the_count(hub, tmp_path):
    """A header with 100k real (distinct, well-formed) keys: refused from its count, before the keys are
    parsed (13 M such keys fit the 256 MiB read bound: minutes of parsing and GBs of dicts otherwise)."""
    from engine.errors import ModelFormatError
    from engine.gguf.header import read_header
    data = _many_keys(100_000)
    hub.repos["tester/Keys-GGUF"] = FakeRepo({"Keys-Q8_0.gguf": data + bytes(1 << 20)})
    listing = list_repo("tester/Keys-GGUF")
    with pytest.raises(ModelFormatError, match="claims 100000 metadata keys.*limits"):
        fit_remote(listing, listing.models[0], None, 1024, MACHINE)
    path = tmp_path / "keys.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelFormatError, match="claims 100000 metadata keys"):
        read_header(path)


def test_mmproj_of_another_model_is_refused_before_download(hub, synth_files, tmp_path):
    """The repo's tower projects to another hidden size (the "small" preset's 256, the model's is 64): the
    fit says so from the two headers, as the loader would after the download; nothing is downloaded."""
    from engine.errors import ModelFormatError
    from engine.testing.pairs import synth_mmproj_for
    other = synth_mmproj_for(tmp_path / "other.gguf", "small", seed=3).read_bytes()
    hub.repos[REPO].files["mmproj-F16.gguf"] = other
    listing = list_repo(REPO)
    from engine.hub.download import pick_mmproj
    with pytest.raises(ModelFormatError, match="projection_dim = 256 does not match.*= 64.*not its vision tower"):
        fit_remote(listing, pick_file(listing, quant="Q8_0"), pick_mmproj(listing), 1024, MACHINE)
    assert not [p for m, p, rng, _ in hub.requests if p.startswith("/blob/") and not rng]


def test_pulling_a_downloaded_file_again_fetches_nothing(hub):
    listing = list_repo(REPO)
    f = pick_file(listing, quant="Q8_0")
    from engine.hub.download import pick_mmproj
    download_model(listing, f, pick_mmproj(listing))
    hub.requests.clear()
    entry = download_model(listing, f, pick_mmproj(listing))
    assert [p for _, p, _, _ in hub.requests if p.startswith("/blob/")] == []
    assert ModelStore().files(entry)[0].stat().st_size == f.size


def test_server_that_stops_sending_is_given_up_on_not_hammered(hub):
    """Every answer ends cleanly after 1 MiB (then after none): the transfer goes on while bytes come, then
    gives up in words after a few empty answers instead of asking again forever."""
    hub.short = 1 << 20
    listing = list_repo(REPO)
    f = pick_file(listing, quant="Q8_0")
    out, seen = [], []

    def cut_after_two_mib(p):
        seen.append(p)
        if p.done >= 2 << 20:
            hub.short = 0
    t = threading.Thread(target=lambda: out.append(_outcome(listing, f, cut_after_two_mib)), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the transfer kept asking"
    assert isinstance(out[0], HubError)
    assert re.search(rf"ends the transfer at byte \d+ of {f.size} without sending more; [1-9]\d*\.\d MiB.*kept",
                     str(out[0]))
    assert len([p for _, p, _, _ in hub.requests if p.startswith("/blob/")]) < 12


def _outcome(listing, f, report):
    try:
        return download_model(listing, f, None, report=report)
    except HubError as exc:
        return exc


def test_fitting_every_quant_reads_the_tower_header_once(hub, synth_files):
    from engine.hub.download import pick_mmproj
    for q in ("Q4_0", "Q5_0"):      # more quants of the same model (same bytes: only the names differ)
        hub.repos[REPO].files[f"Tiny-{q}.gguf"] = synth_files["Tiny-Q8_0.gguf"]
    hub.repos[REPO].sha = "f" * 40
    listing = list_repo(REPO)
    tower = pick_mmproj(listing)
    fits = [fit_remote(listing, f, tower, 1024, MACHINE) for f in listing.models]
    assert len(fits) == 3 and {x.vision for x in fits} == {fits[0].vision} and fits[0].vision > 0
    mm_blob = f"/blob/{tower.sha256}"
    assert len([p for m, p, _, _ in hub.requests if m == "GET" and p == mm_blob]) == 1


@pytest.mark.parametrize("bad", ["notaurl", "ftp://mirror.example"])
def test_hf_endpoint_that_is_not_a_url_is_named(hub, monkeypatch, bad):
    monkeypatch.setenv("HF_ENDPOINT", bad)
    with pytest.raises(HubError, match="is not an http:// or https:// URL.*HF_ENDPOINT"):
        list_repo(REPO)


@pytest.mark.parametrize("name", ["/abs/Evil-Q8_0.gguf", "sub/../../../Evil-Q8_0.gguf", "a\\..\\Evil-Q8_0.gguf"])
def test_file_names_with_paths_are_left_out_of_the_listing(hub, synth_files, name):
    """A listing naming a file by an absolute path or with '..' (its URL would leave the repository, its
    name the store) is left out; with nothing else there, the repo holds no GGUF."""
    hub.repos[REPO].files = {name: synth_files["Tiny-Q8_0.gguf"]}
    with pytest.raises(HubError, match="holds no GGUF"):
        list_repo(REPO)
    hub.repos[REPO].files["ok/Tiny-Q8_0.gguf"] = synth_files["Tiny-Q8_0.gguf"]
    assert [f.name for f in list_repo(REPO).models] == ["ok/Tiny-Q8_0.gguf"]


def test_cli_pull_says_why_when_no_file_is_usable(hub, synth_files, capsys):
    """Two files of an architecture the engine does not run: the reasons, not "no file fits this RAM"."""
    from engine.__main__ import main
    data = synth_files["Tiny-Q8_0.gguf"]
    at = data.index(b"qwen35moe", data.index(b"general.architecture"))
    llama = data[:at] + b"llama_moe" + data[at + 9:]
    hub.repos["tester/Llama-GGUF"] = FakeRepo({"Llama-Q8_0.gguf": llama, "Llama-Q4_0.gguf": llama})
    assert main(["pull", "tester/Llama-GGUF"]) == 2
    err = capsys.readouterr().err
    assert "none of its 2 model files can be used here" in err and "llama_moe" in err and "RAM" not in err.split(
        "error:")[-1]
    assert main(["pull", REPO, "--context", "0"]) == 2
    assert "--context must be at least 1 token" in capsys.readouterr().err
    assert not [p for _, p, _, _ in hub.requests if p.startswith(f"/api/models/{REPO}")]
