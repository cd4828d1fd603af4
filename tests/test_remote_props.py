"""What a remote server says about its model: context and vision tower from ``/v1/models`` (vLLM, ``engine
serve``) or llama-server's ``/props``, and the image sizes left to the server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.errors import UnsupportedModelError
from engine.openai.remote import RemoteEngine


class _Fake:
    """A loopback server answering GET ``routes`` (path -> JSON body; any other path is a 404)."""

    def __init__(self, routes: dict[str, object]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server name
                body = json.dumps(routes[self.path]).encode() if self.path in routes else b"{}"
                self.send_response(200 if self.path in routes else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    servers = []

    def make(routes):
        servers.append(_Fake(routes))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


LLAMA_MODELS = {"object": "list", "data": [{"id": "qwen.gguf", "object": "model", "owned_by": "llamacpp"}]}


def test_llama_server_props_give_the_context_and_the_vision_tower(fake) -> None:
    server = fake({"/v1/models": LLAMA_MODELS, "/props": {
        "default_generation_settings": {"n_ctx": 4096, "temperature": 0.8}, "total_slots": 1,
        "modalities": {"vision": True, "audio": False}}})
    engine = RemoteEngine.connect(server.url, "qwen.gguf")
    assert engine.info.context == 4096 and engine.info.has_vision and engine.info.vision_note == ""
    assert engine.image_info("any.png") is None          # the server sizes the image


def test_llama_server_without_mmproj_is_text_only_with_the_reason(fake) -> None:
    server = fake({"/v1/models": LLAMA_MODELS, "/props": {
        "default_generation_settings": {"n_ctx": 8192}, "modalities": {"vision": False, "audio": False}}})
    engine = RemoteEngine.connect(server.url, "qwen.gguf")
    assert engine.info.context == 8192 and not engine.info.has_vision
    with pytest.raises(UnsupportedModelError, match="does not say that qwen.gguf reads images.*--mmproj"):
        engine.image_info("any.png")


def test_vllm_lists_max_model_len_and_no_props(fake) -> None:
    server = fake({"/v1/models": {"data": [{"id": "Qwen/Qwen3.6", "max_model_len": 32768}]}})
    engine = RemoteEngine.connect(server.url, "Qwen/Qwen3.6")
    assert engine.info.context == 32768 and not engine.info.has_vision
    assert "no modalities.vision in /props" in engine.info.vision_note


def test_a_deltadesk_peer_says_vision_in_its_model_entry(served_vision) -> None:
    server, engine = served_vision
    remote = RemoteEngine.connect(server.url, "tiny-vl")
    assert remote.info.has_vision and remote.info.context == engine.info.context


def test_thinking_is_sent_as_reasoning_effort_too() -> None:
    from engine.sampling import SamplingParams
    remote = RemoteEngine("http://127.0.0.1:9/v1", "m")
    on, off = (remote.body([{"role": "user", "content": "hi"}], SamplingParams(), t) for t in (True, False))
    assert on["reasoning_effort"] == "medium" and on["chat_template_kwargs"] == {"enable_thinking": True}
    assert "reasoning_effort" not in off and off["chat_template_kwargs"] == {"enable_thinking": False}
    remote.close()
