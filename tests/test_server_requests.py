"""Hostile request bodies checked by :mod:`engine.openai.requests` (no model needed): every bad field is an
:class:`APIError` 400 naming it, never another exception (which the server answers with a 500)."""

from __future__ import annotations

import os

import pytest

from engine.openai.requests import APIError, chat_request, image_source, sampling_of

HUGE = 10 ** 400            # a JSON integer Python parses, but too large for a float


def _png_bytes() -> bytes:
    import io

    from PIL import Image
    out = io.BytesIO()
    Image.new("RGB", (4, 4)).save(out, format="PNG")
    return out.getvalue()


_PNG = _png_bytes()


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


@pytest.mark.parametrize("kind", ["pipe", "folder"])
def test_a_file_url_to_a_pipe_or_a_folder_is_400(kind, tmp_path) -> None:
    """Not a regular file: a named pipe (reading it would block the server) or a folder."""
    target = tmp_path / kind
    if kind == "pipe":
        os.mkfifo(target)
    else:
        target.mkdir()
    with pytest.raises(APIError) as info:
        image_source(target.as_uri(), "messages[0].content[0].image_url.url")
    assert info.value.status == 400 and "regular file" in info.value.message


def test_a_file_url_to_a_folder_is_400(tmp_path) -> None:
    with pytest.raises(APIError, match="regular file"):
        image_source(tmp_path.as_uri(), "url")


def test_file_urls_are_refused_when_not_allowed(tmp_path) -> None:
    picture = tmp_path / "a.png"
    picture.write_bytes(_PNG)
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": picture.as_uri()}}]}]}
    assert chat_request(body, "m", 512).messages[0]["content"][0]["image"] == _PNG
    with pytest.raises(APIError) as info:
        chat_request(body, "m", 512, file_urls=False)
    assert info.value.status == 400 and info.value.param == "messages[0].content[0].image_url.url"


def test_a_server_beyond_loopback_refuses_file_urls(tmp_path) -> None:
    import types

    import httpx

    from engine.openai import ServerConfig, ServerThread
    picture = tmp_path / "a.png"
    picture.write_bytes(_PNG)
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

    from starlette.testclient import TestClient

    from engine.openai import ServerConfig, create_app
    picture = tmp_path / "a.png"
    picture.write_bytes(_PNG)
    engine = types.SimpleNamespace(info=types.SimpleNamespace(context=512, has_vision=False))
    # in process (Starlette's TestClient): a served loopback server refuses such a Host before this
    # (test_a_loopback_server_answers_only_its_own_host_names); this is the check behind that one
    client = TestClient(create_app(engine, ServerConfig("m")))
    r = client.post("/v1/chat/completions", headers={"Host": host},
                    json={"model": "m", "messages": [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": picture.as_uri()}}]}]})
    message = r.json()["error"]["message"]
    assert r.status_code == 400
    # a file URL that is read reaches the (absent) vision tower's check; a refused one never gets there
    assert ("no vision tower" in message) == reads and ("does not read its own files" in message) != reads


class _Untouchable:
    """A served "engine" whose turns must never start (a refused request reaches no model)."""

    info = __import__("types").SimpleNamespace(context=512, has_vision=False)

    def chat(self, *args, **kwargs):
        raise AssertionError("a refused request reached the engine")

    complete = chat


@pytest.fixture(scope="module")
def guarded():
    """``engine serve``'s server (uvicorn) on a loopback port, without a key, on :class:`_Untouchable`."""
    from engine.openai import ServerConfig, ServerThread

    server = ServerThread(_Untouchable(), ServerConfig("m"), port=0).start()
    yield server
    server.stop()


def _refused(response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error"
    return error["message"]


CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize("headers, got", [
    ({"Content-Type": "text/plain"}, "'text/plain'"),                                     # fetch() with a string
    ({"Content-Type": "text/plain;charset=UTF-8"}, "'text/plain;charset=UTF-8'"),
    ({"Content-Type": "application/x-www-form-urlencoded"}, "'application/x-www-form-urlencoded'"),  # a <form>
    ({"Content-Type": "multipart/form-data; boundary=x"}, "'multipart/form-data; boundary=x'"),
    ({}, "no Content-Type"),                                                              # fetch() with a Blob
])
@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_a_body_not_sent_as_json_is_415(guarded, headers, got, path) -> None:
    """The bodies a web page can POST cross-site without a CORS preflight are refused, JSON inside or not."""
    import httpx

    r = httpx.post(guarded.url + path, content=CHAT, headers=headers)
    message = _refused(r, 415, "unsupported_media_type")
    assert "'Content-Type: application/json'" in message and message.endswith(f"(got {got})")


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                                          "application/vnd.api+json"])
def test_a_json_body_passes_the_guard(guarded, content_type) -> None:
    import httpx

    r = httpx.post(guarded.url + "/chat/completions", content=b'{"model": "m"}', headers={"Content-Type": content_type})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"      # checked as a request


@pytest.mark.parametrize("host", ["evil.example:{port}", "127.0.0.1.evil.example:{port}",
                                  "localhost.evil.example:{port}", "[::2]:{port}", "", "127.0.0.1:{other}", "localhost",
                                  "127.0.0.1:{port}x", "[::1"])
def test_a_loopback_server_answers_only_its_own_host_names(guarded, host) -> None:
    """A page whose domain was re-pointed at 127.0.0.1 (DNS rebinding) sends its own domain as the Host;
    a name without the server's port, or with another, is not this server either."""
    import httpx

    port = guarded.port
    given = host.format(port=port, other=port + 1 if port < 65535 else port - 1)
    for r in (httpx.get(guarded.url + "/models", headers={"Host": given}),
              httpx.get(f"http://127.0.0.1:{port}/health", headers={"Host": given}),
              httpx.post(guarded.url + "/chat/completions", content=CHAT, headers={
                  "Host": given, "Content-Type": "application/json"})):
        message = _refused(r, 403, "host_not_allowed")
        assert repr(given) in message and f"127.0.0.1:{port}" in message


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST:{port}", "127.0.0.2:{port}"])
def test_loopback_host_names_with_the_port_are_answered(guarded, host) -> None:
    import httpx

    r = httpx.get(guarded.url + "/models", headers={"Host": host.format(port=guarded.port)})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"


def test_the_openai_client_passes_the_guard(guarded) -> None:
    import openai

    client = openai.OpenAI(base_url=guarded.url, api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["m"]
    with pytest.raises(openai.NotFoundError, match="this server serves 'm'"):    # its POST is JSON: read and checked
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
