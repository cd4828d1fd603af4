"""Hostile request bodies checked by :mod:`engine.server.requests` (no model needed): every bad field is an
:class:`APIError` 400 naming it, never another exception (which the server answers with a 500)."""

from __future__ import annotations

import os

import pytest

from engine.server.requests import APIError, chat_request, image_source, sampling_of

HUGE = 10 ** 400            # a JSON integer Python parses, but too large for a float


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
                                  "presence_penalty", "repetition_penalty"])
def test_an_integer_too_large_for_a_float_is_400(name) -> None:
    with pytest.raises(APIError) as info:
        sampling_of({name: HUGE}, 512)
    assert info.value.status == 400 and info.value.param == name


def test_a_negative_seed_is_400() -> None:
    with pytest.raises(APIError) as info:
        sampling_of({"seed": -1}, 512)
    assert info.value.status == 400 and info.value.param == "seed"


def test_top_k_minus_one_means_off() -> None:
    assert sampling_of({"top_k": -1}, 512).top_k == 0


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_file_url_to_a_device_is_400() -> None:
    with pytest.raises(APIError) as info:
        image_source("file:///dev/zero", "messages[0].content[0].image_url.url")
    assert info.value.status == 400 and "regular file" in info.value.message


def test_a_file_url_to_a_folder_is_400(tmp_path) -> None:
    with pytest.raises(APIError, match="regular file"):
        image_source(tmp_path.as_uri(), "url")


def test_file_urls_are_refused_when_not_allowed(tmp_path) -> None:
    picture = tmp_path / "a.png"
    picture.write_bytes(b"\x89PNG")
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": picture.as_uri()}}]}]}
    assert chat_request(body, "m", 512).messages[0]["content"][0]["image"] == picture
    with pytest.raises(APIError) as info:
        chat_request(body, "m", 512, file_urls=False)
    assert info.value.status == 400 and info.value.param == "messages[0].content[0].image_url.url"


def test_a_server_beyond_loopback_refuses_file_urls(tmp_path) -> None:
    import types

    import httpx

    from engine.server import ServerConfig, ServerThread
    picture = tmp_path / "a.png"
    picture.write_bytes(b"\x89PNG")
    engine = types.SimpleNamespace(info=types.SimpleNamespace(context=512, has_vision=True))
    server = ServerThread(engine, ServerConfig("m", api_key="k"), host="0.0.0.0", port=0).start()
    try:
        r = httpx.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", headers={"Authorization": "Bearer k"},
                       json={"model": "m", "messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": picture.as_uri()}}]}]})
    finally:
        server.stop()
    assert r.status_code == 400 and "does not read its own files" in r.json()["error"]["message"]


@pytest.mark.parametrize("host, reads", [("127.0.0.1:8080", True), ("localhost", True), ("[::1]:80", True),
                                         ("evil.example:8080", False), ("127.0.0.1.evil.example", False),
                                         ("", False)])
def test_file_urls_need_a_loopback_host_header(tmp_path, host, reads) -> None:
    """A loopback server reached through a rebound domain (Host: that domain) does not read files."""
    import types

    import httpx

    from engine.server import ServerConfig, ServerThread
    picture = tmp_path / "a.png"
    picture.write_bytes(b"\x89PNG")
    engine = types.SimpleNamespace(info=types.SimpleNamespace(context=512, has_vision=False))
    server = ServerThread(engine, ServerConfig("m"), port=0).start()
    try:
        r = httpx.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", headers={"Host": host},
                       json={"model": "m", "messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": picture.as_uri()}}]}]})
    finally:
        server.stop()
    message = r.json()["error"]["message"]
    assert r.status_code == 400
    # a file URL that is read reaches the (absent) vision tower's check; a refused one never gets there
    assert ("no vision tower" in message) == reads and ("does not read its own files" in message) != reads
