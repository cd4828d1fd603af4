"""By hand, not CI: the ``openai`` client checks of ``tests/test_server.py`` against ``engine serve`` and
against llama.cpp's server (``llama-cpp-python[server]`` built with the bench peer's flags,
:data:`engine.tools.cpu_llama.LLAMA_CMAKE_ARGS`, into a venv: :func:`llama_venv`) on the same f32 synth file,
and the greedy texts of the two compared.

Usage::

    .venv/bin/python tests/bench/compare_llama_server.py [--llama-python PY] [--file F.gguf] [--tokens 24]

Without ``--file`` it writes the ``tiny`` synth model in f32 (real Qwen3.5 vocabulary and template, random
weights) to a temporary folder; without ``--llama-python`` it uses (or builds, 5-15 minutes) a venv in the
user cache dir holding ``llama-cpp-python[server]``. Prints one line per check and server, then
each prompt's greedy text from both and whether they are equal.

Chats ask for ``enable_thinking`` (llama-cpp-python renders the file's template without that
variable, which the Qwen template reads as on: the header opens ``<think>``); a chat's text is its
``reasoning_content`` followed by its ``content``, since ``engine serve`` returns the thinking apart.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
CHATS = [[{"role": "user", "content": "Say hello."}], [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Name a colour."}]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_venv(folder: Path) -> str:
    """The interpreter of a venv in ``folder`` holding ``llama-cpp-python[server]``, built there on first use.

    The pip build compiles llama.cpp from source with the bench peer's CMake flags (5-15 minutes on 2 cores).

    Raises:
        RuntimeError: venv creation or the pip build failed (with pip's last lines).
    """
    from engine.tools.cpu_llama import LLAMA_CMAKE_ARGS, LLAMA_CPP_PYTHON_VERSION
    python = folder / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import llama_cpp.server.app"],
                                          capture_output=True).returncode == 0:
        return str(python)
    print(f"building llama-cpp-python[server] {LLAMA_CPP_PYTHON_VERSION} into {folder} (compiles llama.cpp)")
    steps = [[sys.executable, "-m", "venv", str(folder)],
             [str(python), "-m", "pip", "install", "-q", f"llama-cpp-python[server]=={LLAMA_CPP_PYTHON_VERSION}"]]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, CMAKE_ARGS=LLAMA_CMAKE_ARGS))
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:4])} failed: {done.stderr.strip().splitlines()[-3:]}")
    return str(python)


def _llama_python(given: str | None) -> str:
    if given:
        return given
    import platformdirs
    return llama_venv(Path(platformdirs.user_cache_dir("deltadesk")) / "llama-cpp-venv")


def _start_llama(python: str, model: Path, port: int, threads: int) -> subprocess.Popen:
    proc = subprocess.Popen([python, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", "2048", "--n_threads", str(threads),
                             "--model_alias", "tiny"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama.cpp's server exited: {proc.stderr.read()[-800:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("llama.cpp's server did not come up in 120 s")


def _greedy_texts(client: openai.OpenAI, tokens: int) -> dict[str, list[str]]:
    """The greedy texts of :data:`PROMPTS` (completions) and :data:`CHATS` (reasoning + content)."""
    out: dict[str, list[str]] = {"completion": [], "chat": []}
    for prompt in PROMPTS:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=tokens, temperature=0)
        out["completion"].append(r.choices[0].text)
    for messages in CHATS:
        try:
            r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=tokens, temperature=0,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": True}})
            message = r.choices[0].message
            out["chat"].append((getattr(message, "reasoning_content", None) or "") + (message.content or ""))
        except openai.APIError as exc:
            out["chat"].append(f"<error: {exc}>")
    return out


def _checks(name: str, url: str, tokens: int) -> dict[str, list[str]]:
    """Run the client checks; print each; return the greedy texts (completions, then chats)."""
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)

    def check(what: str, fn) -> None:
        try:
            detail = fn()
            print(f"  {name:13s} ok    {what}{': ' + detail if detail else ''}")
        except Exception as exc:  # noqa: BLE001 - a by-hand report: every outcome is a line
            print(f"  {name:13s} FAIL  {what}: {type(exc).__name__}: {str(exc)[:160]}")

    out = _greedy_texts(client, tokens)

    def streaming() -> str:
        chunks = list(client.chat.completions.create(model="tiny", messages=CHATS[0], max_tokens=8, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        return f"{len(chunks)} chunks, usage {usage.completion_tokens if usage else None} tokens"

    def cached() -> str:
        client.chat.completions.create(model="tiny", messages=CHATS[1], max_tokens=2, temperature=0)
        r = client.chat.completions.create(model="tiny", messages=CHATS[1], max_tokens=2, temperature=0)
        details = r.usage.prompt_tokens_details
        return f"prompt {r.usage.prompt_tokens}, cached {details.cached_tokens if details else None}"

    def unknown_model() -> str:
        try:
            client.chat.completions.create(model="no-such-model", messages=CHATS[0], max_tokens=1)
        except openai.APIStatusError as exc:
            return f"status {exc.status_code}"
        raise AssertionError("accepted")

    def bad_json() -> str:
        reply = httpx.post(url + "/chat/completions", content=b"{bad", headers={"content-type": "application/json"})
        return f"status {reply.status_code}"

    def over_context() -> str:
        try:
            client.completions.create(model="tiny", prompt="word " * 9000, max_tokens=1)
        except openai.APIStatusError as exc:
            return f"status {exc.status_code}"
        raise AssertionError("accepted")

    for what, fn in (("streaming + include_usage", streaming), ("cached tokens on a repeated prompt", cached),
                     ("unknown model refused", unknown_model), ("bad JSON refused", bad_json),
                     ("prompt over the context refused", over_context)):
        check(what, fn)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-python")
    ap.add_argument("--file", type=Path)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from engine.api import Engine, EngineOptions
    from engine.openai import ServerConfig, ServerThread
    folder = Path(tempfile.mkdtemp(prefix="compare-llama-"))
    path = args.file
    if path is None:
        from engine.testing.synth import synth
        path = folder / "tiny-f32.gguf"
        synth(path, "tiny", quant="f32", seed=0)
    python = _llama_python(args.llama_python)
    engine = Engine.load(path, options=EngineOptions(context=2048, threads=args.threads))
    ours = ServerThread(engine, ServerConfig("tiny"), port=0).start()
    port = _free_port()
    peer = _start_llama(python, path, port, args.threads)
    try:
        print(f"file {path}")
        texts = {"engine serve": _checks("engine serve", ours.url, args.tokens),
                 "llama.cpp": _checks("llama.cpp", f"http://127.0.0.1:{port}/v1", args.tokens)}
    finally:
        peer.terminate()
        ours.stop()
    same = 0
    rows = [("completion", p) for p in PROMPTS] + [("chat", m[-1]["content"]) for m in CHATS]
    for k, (kind, label) in enumerate(rows):
        i = k if kind == "completion" else k - len(PROMPTS)
        a, b = texts["engine serve"][kind][i], texts["llama.cpp"][kind][i]
        same += a == b
        print(f"{kind} {label!r}: {'EQUAL' if a == b else 'DIFFERENT'}\n  engine serve: {a!r}\n  llama.cpp:    {b!r}")
    print(f"greedy texts equal: {same} of {len(rows)}")


if __name__ == "__main__":
    main()
