"""Command line: ``python -m engine {info,generate,chat,serve,synth,bench,prune,pull,models}``.

Each subcommand's options are in its ``--help`` and in docs/cli.md. Engine errors and inputs that
cannot work (``--image`` without a vision tower, a prompt larger than ``--context``) are printed as one
line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from .errors import EngineError
from .events import PrefillStats, TokenEvent, TurnSummary
from .sampling import SamplingParams
from .session import Session, engine_parallel

if TYPE_CHECKING:
    from .gguf.file import GGUFFile
    from .reap.prune import ExpertStats


MODEL_HELP = "a GGUF file, or a downloaded model's REPO:QUANT (`engine models` lists them)"
"""The help of a positional model argument."""
DEFAULT_CONTEXT = 8192
"""The context window, tokens, of generate / chat / serve without ``--context``."""

def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          presence_penalty=args.presence_penalty,
                          repetition_penalty=args.repeat_penalty, seed=args.seed,
                          max_tokens=args.max_tokens)


def _model_paths(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """The (text model, vision tower or None) files that ``--model`` / ``--mmproj`` name.

    Without ``--model``: :func:`engine.demo_model.default_model` and its tower. With ``--model`` the tower
    is ``--mmproj``, or the bundled demo's own when that is the model named
    (:func:`engine.demo_model.bundled_mmproj_for`); any other model needs ``--mmproj``.

    Raises:
        EngineError: no model named and the bundled demo is missing (:func:`engine.demo_model.default_model`).
    """
    from .demo_model import bundled_mmproj_for, default_model
    if not args.model:
        path, mmproj = default_model()
        return path, Path(args.mmproj) if args.mmproj else mmproj
    hub = _hub_model(args.model)
    if hub is not None:
        return hub[0], Path(args.mmproj) if args.mmproj else hub[1]
    path = Path(args.model)
    return path, Path(args.mmproj) if args.mmproj else bundled_mmproj_for(path)


def _hub_model(arg: str) -> tuple[Path, Path | None] | None:
    """The (model, mmproj) files of a downloaded ``REPO:QUANT``, None when ``arg`` is a path
    (:func:`engine.hub.store.model_files`). Raises EngineError for a hub name not downloaded."""
    from .hub.store import model_files
    return model_files(arg)


def _served_name(args: argparse.Namespace, path: Path) -> str:
    """The model id ``serve`` answers to: ``--model-name``, else a downloaded model's ``REPO:QUANT`` as the user
    named it (the id LM Studio and Ollama users send), else the file name without ``.gguf``."""
    if args.model_name:
        return args.model_name
    return args.model if args.model and _hub_model(args.model) is not None else path.stem


def _model_arg(arg: str) -> str:
    """A positional model argument as a path: a downloaded ``REPO:QUANT`` resolved, a path as it is."""
    hub = _hub_model(arg)
    return str(hub[0]) if hub is not None else arg


def _context(args: argparse.Namespace) -> int:
    """The context window ``--context`` asks for, tokens (:data:`DEFAULT_CONTEXT` when not given)."""
    return DEFAULT_CONTEXT if args.context is None else args.context

def _load(args: argparse.Namespace, path: Path, mmproj: Path | None):
    """Load ``path`` (and the vision tower ``mmproj``) with the CLI's options (``--parallel`` turns at once where the
    command has it, else 1); one line on stderr.

    Raises:
        EngineError: the files could not be loaded (see :meth:`engine.api.Engine.load`).
    """
    from .api import Engine, EngineOptions
    t0 = time.perf_counter()
    options = EngineOptions(context=_context(args), kv_type=args.kv_type, parallel=getattr(args, "parallel", 1),
                            cache_disk_dir=getattr(args, "cache_dir", None), weights=getattr(args, "weights", "auto"))
    engine = Engine.load(path, mmproj, options=options)
    tower = f" + {mmproj.name}" if mmproj is not None else ""
    where = "read into memory" if engine.text.file.resident else "mapped"
    print(f"[loaded {path.name}{tower} in {time.perf_counter() - t0:.2f} s, weights {where}]", file=sys.stderr)
    if args.context is not None and engine.info.context < args.context:
        print(f"[note: --context {args.context} is above {path.name}'s own limit: the context window holds "
              f"{engine.info.context} tokens]", file=sys.stderr)
    note = engine.info.template_note
    if note:
        print(f"[note: {path.name}: {note}]", file=sys.stderr)
    return engine


def _stream(events, out=None) -> TurnSummary:
    """Write each token's text to ``out`` (None: ``sys.stdout`` as it is at the call) and return the summary."""
    out = out or sys.stdout
    summary = None
    for ev in events:
        if isinstance(ev, TokenEvent):
            out.write(ev.text)
            out.flush()
        elif isinstance(ev, PrefillStats):
            pass
        elif isinstance(ev, TurnSummary):
            summary = ev
    assert summary is not None
    return summary


def _timing(s: TurnSummary) -> str:
    note = f" ({s.message})" if s.stop_reason not in ("eos", "max_tokens") else ""
    return (f"[prompt {s.prompt_tokens} tok, {s.generated_tokens} generated, stop: {s.stop_reason}{note} | "
            f"TTFT {s.ttft_ms:.0f} ms | prefill {s.prefill_tok_s:.1f} tok/s | decode {s.decode_tok_s:.2f} tok/s]")


def cmd_info(args: argparse.Namespace) -> int:
    """``engine info``: print a model file's architecture, hyper-parameters and tensor types."""
    from .registry import open_text
    text = open_text(_model_arg(args.model))
    f, hp = text.file, text.hparams
    kinds = "".join("D" if hp.is_recurrent(i) else "A" for i in range(hp.n_layer))
    print(f"file           {f.path}")
    print(f"architecture   {hp.arch}")
    print(f"layers         {hp.n_layer} ({kinds.count('D')} Gated DeltaNet, {kinds.count('A')} full attention)"
          + (f" + {hp.nextn_predict_layers} MTP (skipped)" if hp.nextn_predict_layers else ""))
    print(f"hidden         {hp.n_embd}, vocab {hp.n_vocab}, context {hp.context_length}")
    print(f"attention      {hp.n_head} Q heads / {hp.n_head_kv} KV heads x {hp.head_dim}, "
          f"RoPE {hp.rope_dims} dims theta {hp.rope_theta:g} sections {list(hp.rope_sections)}")
    print(f"delta-net      {hp.num_k_heads} q/k heads x {hp.head_k_dim}, {hp.num_v_heads} v heads x {hp.head_v_dim},"
          f" conv {hp.conv_kernel}")
    if hp.is_moe:
        from .reap.pruned import pruning_summary
        pruned = pruning_summary(text)
        print(f"MoE            {hp.n_expert} experts, top-{hp.n_expert_used}, expert FFN {hp.n_ff_exp},"
              f" shared expert FFN {hp.n_ff_shexp}" + (f" ({pruned})" if pruned else ""))
    else:
        print(f"FFN            dense SwiGLU {hp.n_ff}")
    total = sum(b for _, b in f.quant_mix().values())
    print("quant mix      " + ", ".join(f"{name}: {n} tensors {b / 2**20:.1f} MiB"
                                        for name, (n, b) in sorted(f.quant_mix().items())))
    print(f"weights        {total / 2**30:.3f} GiB")
    print(f"decode reads   {text.bytes_per_token() / 2**20:.1f} MiB of weights per token")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """``engine generate``: one answer to a prompt (or raw continuation), streamed to stdout."""
    if args.raw and (args.image or args.system or args.think):
        print("error: --raw continues the prompt text as it is: --image, --system and --think need the chat "
              "template, leave them out or drop --raw", file=sys.stderr)
        return 2
    path, mmproj = _model_paths(args)
    if args.raw:
        mmproj = None
    if args.image and mmproj is None and path.is_file():
        print(f"error: {path.name}: no vision tower (mmproj file) is loaded, so it cannot read --image: "
              "pass the model's vision tower with --mmproj FILE", file=sys.stderr)
        return 2
    bad = next((img for img in args.image if not Path(img).is_file()), None)
    if bad is not None:
        print(f"error: --image {bad}: no such file", file=sys.stderr)
        return 2
    engine = _load(args, path, mmproj)
    with Session(parallel=engine_parallel(engine)) as session:
        if args.raw:
            return _finish(session.stream(lambda c: engine.complete(args.prompt, _sampling(args), c)), engine, args)
        return _generate_chat(args, engine, session)


def _generate_chat(args: argparse.Namespace, engine, session: Session) -> int:
    """``generate`` through the chat template: the prompt (with its images) as one user message."""
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    if args.image:
        content = [{"type": "image", "image": img} for img in args.image]
        messages.append({"role": "user", "content": content + [{"type": "text", "text": args.prompt}]})
        for img in args.image:
            info = session.call(lambda img=img: engine.image_info(img)).result()
            slices = f" overview + {info.pieces - 1} slices" if info.pieces > 1 else ""
            print(f"[image {img}: {info.width}x{info.height} px{slices} reach the vision tower, {info.tokens} image "
                  "tokens]", file=sys.stderr)
    else:
        messages.append({"role": "user", "content": args.prompt})
    return _finish(session.stream(lambda c: engine.chat(messages, _sampling(args), c, enable_thinking=args.think)),
                   engine, args)


def _finish(events, engine, args: argparse.Namespace) -> int:
    """Stream a turn's answer to stdout, then its timing line (or why the prompt did not fit) to stderr."""
    summary = _stream(events)
    if summary.stop_reason == "context_full" and summary.generated_tokens == 0:
        print(f"error: {_prompt_too_long(summary, engine.info.context, _context(args))}", file=sys.stderr)
        return 2
    print()
    print(_timing(summary), file=sys.stderr)
    return 0


def _prompt_too_long(summary: TurnSummary, context: int, asked: int) -> str:
    """The one-line reason a prompt of ``summary.prompt_tokens`` tokens did not fit, and the way out.

    Args: context: the window in use, tokens; asked: the ``--context`` given, tokens (more than
    ``context`` when the model's own ``context_length`` capped it).
    """
    fix = ("that is the model's own limit: shorten the prompt" if context < asked
           else f"pass --context N with N above {summary.prompt_tokens} plus room for the answer")
    return f"the prompt is {summary.prompt_tokens} tokens but the context window holds {context}: {fix}"


CHAT_HELP = """Commands:
  /image PATH   attach an image to your next message (needs a vision tower: --mmproj FILE)
  /help         this list
An empty line or Ctrl+D quits; Ctrl+C stops an answer."""


def cmd_chat(args: argparse.Namespace) -> int:
    """``engine chat``: an interactive chat on the terminal, one turn per input line."""
    engine = _load(args, *_model_paths(args))
    with Session(parallel=engine_parallel(engine)) as session:
        return _chat_loop(args, engine, session)


def _chat_loop(args: argparse.Namespace, engine, session: Session) -> int:
    """The interactive chat: each line a turn of ``session``, until an empty line or end of input."""
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Type a message; /help lists the commands; an empty line or Ctrl+D quits.", file=sys.stderr)
    images: list[str] = []
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/help" or line.startswith("/image"):
            _chat_command(engine, session, line.strip(), images)
            continue
        parts = [{"type": "image", "image": img} for img in images]
        messages.append({"role": "user", "content": parts + [{"type": "text", "text": line}] if parts else line})
        images = []
        cancel = threading.Event()
        try:
            summary = _stream(session.stream(lambda c: engine.chat(messages, _sampling(args), c,
                                                                    enable_thinking=args.think), cancel))
        except KeyboardInterrupt:
            cancel.set()
            print("\n[stopped]", file=sys.stderr)
            messages.pop()
            continue
        print()
        print(_timing(summary), file=sys.stderr)
        messages.append({"role": "assistant", "content": summary.text})
    return 0


def _chat_command(engine, session: Session, line: str, images: list[str]) -> None:
    """``/help``, or ``/image PATH``: add the image to ``images`` (the next message's) after checking it."""
    if line == "/help":
        print(CHAT_HELP, file=sys.stderr)
        return
    path = line[len("/image"):].strip()
    if not engine.info.has_vision:
        print("[no vision tower is loaded, so the model cannot read images: start the chat with --mmproj FILE]",
              file=sys.stderr)
    elif not path:
        print("[/image needs a file: /image PATH]", file=sys.stderr)
    else:
        try:
            info = session.call(lambda: engine.image_info(path)).result()
        except EngineError as exc:
            print(f"[{exc}]", file=sys.stderr)
            return
        images.append(path)
        print(f"[image {path}: {info.width}x{info.height} px, {info.tokens} image tokens; attached to your next "
              "message]", file=sys.stderr)


def cmd_serve(args: argparse.Namespace) -> int:
    """``engine serve``: the OpenAI-compatible HTTP server until interrupted."""
    from .openai import ServerConfig, StopSignals, bind_address, check_bind, serve
    api_key = args.api_key or os.environ.get("DELTADESK_API_KEY") or None
    check_bind(args.host, api_key)
    sock = bind_address(args.host, args.port)          # a port in use fails before the model loads
    try:
        path, mmproj = _model_paths(args)
        engine = _load(args, path, mmproj)
    except BaseException:
        sock.close()
        raise
    name = _served_name(args, path)
    host = f"[{args.host}]" if ":" in args.host else args.host
    with StopSignals() as stop:                        # SIGINT, SIGTERM: stop serving, then close the engine
        print(f"[serving {name} on http://{host}:{sock.getsockname()[1]}/v1 (OpenAI API)"
              f"{'; API key required' if api_key else ''}; Ctrl+C stops]", file=sys.stderr, flush=True)
        try:
            serve(engine, ServerConfig(name, api_key, max_waiting=args.queue, max_waiting_bytes=args.queue_mib << 20),
                  args.host, args.port, sock, stop=stop)
        finally:
            engine.close()                             # writes the prefix snapshots to --cache-dir
    if stop.signal is not None:
        print(f"[{stop.signal.name}: stopped serving; engine closed]", file=sys.stderr)
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    """``engine synth``: write a synthetic model of a preset's shapes (random weights)."""
    from .testing.synth import synth
    t0 = time.perf_counter()
    synth(args.output, args.preset, layers=args.layers, experts=args.experts, quant=args.quant,
          seed=args.seed)
    size = Path(args.output).stat().st_size
    print(f"wrote {args.output}: {size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if not args.no_mmproj:
        from .testing.pairs import synth_mmproj_for
        out = Path(args.output)
        mmproj = synth_mmproj_for(out.with_name(out.stem + "-mmproj.gguf"), args.preset, seed=args.seed)
        print(f"wrote {mmproj}: {mmproj.stat().st_size / 2**20:.1f} MiB", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """``engine bench``: CPU prompt and decode speed beside llama-bench (:mod:`engine.tools.cpu_bench`)."""
    from .kernels import cpu
    from .tools import cpu_bench, cpu_llama
    if not cpu.available():
        print("error: the native CPU kernels are not built: nothing to benchmark", file=sys.stderr)
        return 2
    peers: list = []
    for flag, value in (("--llama-bench", args.llama_bench), ("--ik-llama-bench", args.ik_llama_bench)):
        if value and not (Path(value).is_file() and os.access(value, os.X_OK)):
            print(f"error: {flag} {value}: not an executable file", file=sys.stderr)
            return 2
    if args.llama_bench:
        peers.append(cpu_llama.Peer("llama.cpp", Path(args.llama_bench)))
    elif args.llama_cpp:
        try:
            binary = cpu_llama.ensure_llama_bench(out=lambda line: print(f"[{line}]", file=sys.stderr))
        except RuntimeError as exc:
            print(f"error: llama-bench: {exc}", file=sys.stderr)
            return 2
        peers.append(cpu_llama.Peer("llama.cpp", binary))
    if args.ik_llama_bench:
        peers += cpu_llama.ik_llama_peers(Path(args.ik_llama_bench))
    cpu_bench.run(_model_arg(args.model), args.threads or sorted({1, cpu.physical_cores()}),
                  args.isa or list(cpu.supported_isas()), args.prompt, args.gen, args.depth, args.depth_gen,
                  args.repeat, peers, args.stream_gib, args.stream_runs, weights=args.weights)
    return 0


def _progress(what: str, unit: str = "") -> Callable[[int, int], None]:
    """A one-line progress bar on stderr: ``progress(done, total)``, redrawn at most 5 times a second;
    a newline once done == total."""
    t0 = time.perf_counter()
    last = [0.0]

    def show(done: int, total: int) -> None:
        now = time.perf_counter()
        if done < total and now - last[0] < 0.2:
            return
        last[0] = now
        frac = done / total if total else 1.0
        bar = "#" * int(24 * frac)
        scale, name = (2**20, " MiB") if unit == "bytes" else (1, "")
        print(f"\r[{what}] [{bar:<24}] {done / scale:.0f}/{total / scale:.0f}{name} "
              f"{now - t0:.1f} s", end="\n" if done >= total else "", file=sys.stderr, flush=True)
    return show


def cmd_prune(args: argparse.Namespace) -> int:
    """``prune``: every failure (a bad path or file, a full or read-only disk) is one ``error:`` line, exit 2."""
    try:
        return _prune(args)
    except (OSError, ValueError) as exc:
        where = f"{exc.filename}: " if isinstance(exc, OSError) and exc.filename else ""
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"error: {where}{detail}", file=sys.stderr)
        return 2


def _prune(args: argparse.Namespace) -> int:
    from .reap import prune, pruned as pruned_file
    from .registry import open_text
    from .reap.inputs import check_output
    if args.max_tokens < 1:
        raise EngineError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    args.model = _model_arg(args.model)
    inputs = (args.model, args.mmproj, args.calib, args.stats)
    check_output(args.output, inputs)
    src_text = open_text(args.model)
    src, hp = src_text.file, src_text.hparams
    if not hp.is_moe:
        print(f"error: {src.path.name} is a dense {hp.arch} model: it has no experts to prune", file=sys.stderr)
        return 2
    try:
        prune.check_keep(args.keep, hp.n_expert, hp.n_expert_used)
    except ValueError as exc:
        print(f"error: {src.path.name}: {exc}", file=sys.stderr)
        return 2
    stats_path = Path(args.stats) if args.stats else _stats_path(args.model, args.output)
    if (args.stats is not None and not args.stats.strip()) or Path(args.output).absolute() == stats_path.absolute():
        raise EngineError(f"--stats {args.stats!r}: give a statistics file path other than the output")
    if args.calib or args.images or not stats_path.is_file():
        check_output(str(stats_path), (args.model, args.mmproj, args.calib, args.output), "statistics file")
    stats = None
    if not (args.calib or args.images) and stats_path.is_file():
        stats = prune.ExpertStats.load(stats_path)
        try:
            stats.check_model(src, str(stats_path))
            print(f"[expert statistics from {stats_path}: {stats.calibration.get('samples', '?')} samples, "
                  f"{stats.calibration.get('tokens', '?')} tokens]", file=sys.stderr)
        except EngineError as exc:
            if args.stats:
                raise
            print(f"[{exc}: calibrating again]", file=sys.stderr)
            stats = None
    if stats is None:
        stats = _calibrate(args, src)
        try:
            stats.save(stats_path)
            print(f"[expert statistics saved to {stats_path}]", file=sys.stderr)
        except OSError as exc:
            print(f"[could not save the expert statistics to {stats_path}: {exc.strerror or exc}]", file=sys.stderr)
    kept = stats.kept_experts(args.keep, args.method)
    print(f"[{prune.describe_kept(stats, kept, args.method)}]", file=sys.stderr)
    note = {"method": args.method, "calibration_samples": stats.calibration.get("samples"),
            "calibration_tokens": stats.calibration.get("tokens"),
            "calibration": stats.calibration.get("source")}
    size = pruned_file.prune_file(src_text, args.output, kept, note, _progress("writing", "bytes"))
    out = open_text(args.output)
    print(f"wrote {args.output}: {size / 2**20:.1f} MiB (was {src.path.stat().st_size / 2**20:.1f} MiB), "
          f"{hp.n_expert} -> {args.keep} experts per layer, top-{hp.n_expert_used}; decode reads "
          f"{out.bytes_per_token() / 2**20:.2f} MiB per token (was {src_text.bytes_per_token() / 2**20:.2f})",
          file=sys.stderr)
    return 0


def _stats_path(model: str, output: str) -> Path:
    """``--stats``' default: ``MODEL.expert-stats.json`` beside the model when one is there (as
    ``training/calibration.py`` writes it), else beside the output file (never the current folder)."""
    from .reap.prune import default_stats_path
    beside_model = default_stats_path(model)
    return beside_model if beside_model.is_file() else default_stats_path(model, Path(output).resolve().parent)


def _calibrate(args: argparse.Namespace, src: GGUFFile) -> ExpertStats:
    """Gather :class:`engine.reap.prune.ExpertStats` for ``args.model`` on the calibration set the flags name."""
    from .reap import prune
    from .api import Engine, EngineOptions
    from .demo_model import bundled_mmproj_for
    convs = prune.calibration_set(args.calib, args.images)
    has_images = any(isinstance(m.get("content"), list) and any(
        isinstance(p, dict) and p.get("type") == "image" for p in m["content"]) for c in convs for m in c)
    mmproj = Path(args.mmproj) if args.mmproj else bundled_mmproj_for(args.model)
    if has_images and mmproj is None:
        raise EngineError(f"{src.path.name}: the calibration set has images but no vision tower is loaded: "
                          "pass the model's vision tower with --mmproj FILE")
    engine = Engine.load(args.model, mmproj if has_images else None,
                         EngineOptions(device="cpu", prefix_cache=False))
    images = f" + images of {args.images}" if args.images else ""
    source = str(args.calib) if args.calib else "built-in chat set" + images
    bar = _progress("calibrating")
    try:
        return prune.calibrate(engine, convs, args.max_tokens, lambda d, t, _: bar(d, t), {"source": source})
    finally:
        engine.close()


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m",
                   help="GGUF text model, or a downloaded REPO:QUANT (default: the bundled demo model)")
    p.add_argument("--mmproj", help="GGUF vision tower (mmproj) for image input "
                   "(the bundled demo model brings its own)")
    p.add_argument("--system", default="", help="system prompt")
    p.add_argument("--max-tokens", "-n", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.7, help="temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--top-p", type=float, default=0.8)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--context", type=int, default=None,
                   help=f"context window, tokens (default {DEFAULT_CONTEXT}, capped at the model's own)")
    p.add_argument("--kv-type", choices=["f16", "f32", "q8_0"], default="f16",
                   help="KV cache element type (default f16; q8_0 is about half of f16)")
    p.add_argument("--think", action="store_true", help="let the model think before answering")


def _add_generate(p: argparse.ArgumentParser) -> None:
    _add_sampling(p)
    p.add_argument("--prompt", "-p", default="Hello! Who are you?")
    p.add_argument("--image", action="append", default=[], help="an image to ask about (repeatable)")
    p.add_argument("--raw", action="store_true", help="continue the prompt text as it is (no chat template)")


WEIGHTS_HELP = ("map: read weights from the file map; ram: read the file into memory at load (2 MiB pages, faster "
                "decode); auto: ram when the file takes at most 0.7 of the available memory and no GPU prefill runs "
                "(default auto)")


def _add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m",
                   help="GGUF text model, or a downloaded REPO:QUANT (default: the bundled demo model)")
    p.add_argument("--mmproj", help="GGUF vision tower (mmproj) for image input")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only; any "
                   "other needs --api-key)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", help="key clients must send as 'Authorization: Bearer KEY' (or set "
                   "DELTADESK_API_KEY)")
    p.add_argument("--model-name", help="the model id clients name (default: a downloaded model's REPO:QUANT as "
                   "given, else the file name without .gguf)")
    p.add_argument("--context", type=int, default=None,
                   help=f"context window, tokens (default {DEFAULT_CONTEXT}, capped at the model's own)")
    p.add_argument("--kv-type", choices=["f16", "f32", "q8_0"], default="f16",
                   help="KV cache element type (default f16; q8_0 is about half of f16)")
    p.add_argument("--queue", type=_positive, default=8, help="requests that may wait for the model at once; "
                   "more are answered 429 with Retry-After (default 8)")
    p.add_argument("--queue-mib", type=_positive, default=64, help="MiB of request bodies those may hold "
                   "together (default 64)")
    p.add_argument("--parallel", type=_positive, default=4, help="requests answered at once, their tokens decoded "
                   "together in one batch, each with its own KV cache: a --context whose N caches do not fit in "
                   "memory is refused at load (default 4; 1 answers one at a time)")
    p.add_argument("--cache-dir", type=Path, help="folder of the prefix snapshots' disk tier: snapshots beyond "
                   "the RAM budget move there, and all are written there on exit (default: none, RAM only)")
    p.add_argument("--weights", choices=["auto", "map", "ram"], default="auto", help=WEIGHTS_HELP)


def _positive(text: str) -> int:
    """An argparse type: a positive integer."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _count(text: str) -> int:
    """An argparse type: a whole number, 0 or more."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number (0 or more), got {text!r}")
    return int(text)


def _add_synth(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", required=True,
                   choices=["tiny", "small", "dense-tiny", "minicpmv46-tiny", "minicpmv46", "35b-a3b"])
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--quant", default="q4_0",
                   choices=["q4_0", "q8_0", "f16", "bf16", "f32", "q4_k_m", "ud_q4_k_xl", "q2_k", "q3_k", "iq2_xxs",
                            "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "mxfp4"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", "-o", required=True)
    p.add_argument("--no-mmproj", action="store_true", help="do not write the matching vision tower")


BENCH_DEFAULTS = dict(n_prompt=512, n_gen=64, depths=(4096, 16384), depth_gen=16, repeat=3, stream_gib=1.0,
                      stream_runs=5)
"""``bench``'s defaults (``--help`` shows them): pp512 as llama-bench users quote it, decode at 4k and 16k."""


def _add_bench(p: argparse.ArgumentParser) -> None:
    defaults = BENCH_DEFAULTS
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--weights", choices=["auto", "map", "ram"], default="auto", help=WEIGHTS_HELP)
    p.add_argument("--threads", "-t", type=_positive, nargs="+",
                   help="thread counts (default: 1 and the physical cores)")
    p.add_argument("--isa", nargs="+", help="ISA levels (default: every level this CPU runs)")
    p.add_argument("--prompt", "-p", type=_count, default=defaults["n_prompt"], help="prompt tokens, one forward; "
                   "0 skips the prompt test (default: %(default)s)")
    p.add_argument("--gen", "-n", type=_positive, default=defaults["n_gen"],
                   help="decoded tokens (default: %(default)s)")
    p.add_argument("--depth", "-d", type=int, nargs="*", default=list(defaults["depths"]),
                   help="context depths to decode at; none: --depth alone (default: %(default)s)")
    p.add_argument("--depth-gen", type=_positive, default=defaults["depth_gen"],
                   help="tokens decoded at each depth (default: %(default)s)")
    p.add_argument("--repeat", "-r", type=_positive, default=defaults["repeat"],
                   help="rounds, engines interleaved in each (default: %(default)s)")
    p.add_argument("--stream-gib", type=float, default=defaults["stream_gib"],
                   help="buffer of the bandwidth measurement, GiB (default: %(default)s)")
    p.add_argument("--stream-runs", type=_positive, default=defaults["stream_runs"],
                   help="bandwidth measurements per round and thread count (default: %(default)s)")
    p.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp's llama-bench, built on first use "
                   "from the llama-cpp-python 0.3.36 sources into the user cache dir (minutes to build)")
    p.add_argument("--llama-bench", metavar="PATH",
                   help="run this llama-bench binary as the peer (implies --llama-cpp)")
    p.add_argument("--ik-llama-bench", metavar="PATH", help="also run ik_llama.cpp's llama-bench at PATH (a native "
                   "build of its repository), twice: its default flags and -rtr 1")


def _add_prune(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--keep", type=int, required=True, help="experts kept per layer (top-k <= N < expert count)")
    p.add_argument("--output", "-o", required=True)
    p.add_argument("--method", choices=["reap", "frequency"], default="reap")
    p.add_argument("--calib", help="calibration conversations, one JSON per line (default: a built-in chat set)")
    p.add_argument("--images", help="folder the --calib image paths are relative to; without --calib, each "
                   "image in it is added to the built-in set as an image prompt")
    p.add_argument("--mmproj", help="the model's vision tower, for image prompts (the bundled demo brings its own)")
    p.add_argument("--max-tokens", type=int, default=1024, help="longest calibration prompt used, tokens")
    p.add_argument("--stats", help="expert statistics JSON: read when it exists and no --calib/--images is "
                   "given, else written (default MODEL.expert-stats.json beside the model when it is there, else "
                   "beside the output file)")


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m engine`` argument parser."""
    from .hub import cli as hub_cli
    ap = argparse.ArgumentParser(prog="python -m engine", description="DeltaDesk engine")
    sub = ap.add_subparsers(dest="command", required=True)
    commands = [("info", "summarise a GGUF model", lambda p: p.add_argument("model", help=MODEL_HELP), cmd_info),
                ("generate", "answer one prompt, streamed", _add_generate, cmd_generate),
                ("chat", "interactive chat on the terminal", _add_sampling, cmd_chat),
                ("serve", "an OpenAI-compatible HTTP server on the model", _add_serve, cmd_serve),
                ("synth", "write a random-weight GGUF", _add_synth, cmd_synth),
                ("bench", "prompt and decode speed on the CPU, beside llama-bench", _add_bench, cmd_bench),
                ("prune", "remove experts (REAP or frequency) to make a MoE file smaller", _add_prune, cmd_prune),
                ("pull", "fit and download a GGUF from the Hugging Face hub", hub_cli.add_pull, hub_cli.cmd_pull),
                ("models", "list the downloaded models", hub_cli.add_models, hub_cli.cmd_models)]
    for name, help_text, add_arguments, func in commands:
        p = sub.add_parser(name, help=help_text)
        add_arguments(p)
        p.set_defaults(func=func)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status (2 on an engine error)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
