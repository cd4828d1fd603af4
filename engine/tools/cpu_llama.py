"""llama.cpp's prompt and decode speed on a GGUF, through ``llama-cpp-python`` (the bench's peer).

Imports nothing of the engine (only the standard library and ``llama_cpp``), so it also runs as a
script under another interpreter, e.g. a separate venv that holds llama-cpp-python built with
the portable build flags of :data:`engine.tools.cpu_bench.LLAMA_CMAKE_ARGS`::

    /work/venv-llama/bin/python engine/tools/cpu_llama.py MODEL.gguf THREADS N_PROMPT N_GEN

prints one JSON object ``{"pp_tok_s": ..., "tg_tok_s": ..., "version": ...}``. Timing is done as
llama-bench does it: one ``llama_decode`` of the whole prompt (batch = prompt), then N_GEN
one-token decodes, each on random token ids (seeded), logits of the last token only.
"""

from __future__ import annotations

import json
import random
import sys
import time


def measure(model: str, threads: int, n_prompt: int, n_gen: int, seed: int = 0) -> dict:
    """Prompt-processing and decode tok/s of llama.cpp on ``model`` with ``threads`` threads.

    Raises ImportError without llama_cpp; RuntimeError if llama.cpp cannot load or decode.
    """
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, n_threads=threads, n_threads_batch=threads,
                          n_ctx=n_prompt + n_gen + 8, n_batch=max(n_prompt, 8), n_ubatch=max(n_prompt, 8),
                          verbose=False)
    ctx, n_vocab = llm._ctx.ctx, llm.n_vocab()
    rng = random.Random(seed)
    tokens = [rng.randrange(n_vocab) for _ in range(n_prompt + n_gen)]
    batch = llama_cpp.llama_batch_init(max(n_prompt, 1), 0, 1)

    def decode(ids: list[int], pos0: int) -> None:
        batch.n_tokens = len(ids)
        for i, t in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(ids) - 1
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError(f"llama_decode failed on {model}")

    try:
        t0 = time.perf_counter()
        decode(tokens[:n_prompt], 0)
        pp = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(n_gen):
            decode([tokens[n_prompt + i]], n_prompt + i)
        tg = time.perf_counter() - t0
    finally:
        llama_cpp.llama_batch_free(batch)
    return {"pp_tok_s": n_prompt / pp, "tg_tok_s": n_gen / tg, "version": llama_cpp.__version__}


if __name__ == "__main__":
    path, n_threads, n_pp, n_tg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(measure(path, n_threads, n_pp, n_tg)))
