"""engine.hub against a hostile or broken hub (tests/hub_fake.py on 127.0.0.1): odd repository ids, redirect
loops, a listing whose sha256 is not a digest, stalled and trickling transfers, and two downloads of one file
at once. Every case ends in a HubError with plain words (or a finished, verified file), never a traceback, a
hang, or a byte written outside the store."""

from __future__ import annotations

import pytest

from engine.hub.download import download_model, fit_remote, pick_file
from engine.hub.hubapi import HubError, list_repo
from engine.hub.store import ModelStore
from tests import test_hub
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
