"""The public Engine API end to end on synthetic models: events, stops, cancel, prefix reuse, CLI."""

from __future__ import annotations

import threading
import time

import pytest

from engine.__main__ import main
from engine.api import Engine, EngineOptions
from engine.errors import EngineError
from engine.events import PrefillProgress, PrefillStats, TokenEvent, TurnSummary
from engine.sampling import SamplingParams

GREEDY = SamplingParams.greedy(max_tokens=12)


@pytest.fixture(scope="module")
def tiny(synth_model):
    return synth_model("tiny", "q8_0")


@pytest.fixture(scope="module")
def cold(tiny):
    """An engine without a prefix cache: every turn prefills its whole prompt."""
    return Engine.load(tiny, options=EngineOptions(prefix_cache=False))


@pytest.fixture(scope="module")
def _warm(tiny):
    return Engine.load(tiny)


@pytest.fixture
def warm(_warm):
    """An engine with an empty RAM prefix cache."""
    _warm.cache.clear()
    return _warm


def run(events):
    events = list(events)
    events = [e for e in events if not isinstance(e, PrefillProgress)]
    assert isinstance(events[0], (PrefillStats, TurnSummary))
    assert isinstance(events[-1], TurnSummary)
    return events[0], [e for e in events if isinstance(e, TokenEvent)], events[-1]


def chat(engine, messages, sampling=GREEDY, **kw):
    return run(engine.chat(messages, sampling, **kw))


def test_events_and_summary(cold) -> None:
    engine = cold
    stats, tokens, summary = chat(engine, [{"role": "user", "content": "Hello there"}])
    assert stats.prompt_tokens == len(engine.render([{"role": "user", "content": "Hello there"}]))
    assert stats.reused_tokens == 0 and stats.prefilled_tokens == stats.prompt_tokens
    assert [t.index for t in tokens] == list(range(len(tokens)))
    assert summary.generated_tokens == len(tokens)
    assert summary.text.startswith("".join(t.text for t in tokens))
    assert summary.stop_reason in ("eos", "max_tokens")
    if summary.stop_reason == "max_tokens":
        assert len(tokens) == GREEDY.max_tokens
    assert summary.ttft_ms > 0 and all(t.ms > 0 for t in tokens)


def test_cancel_takes_effect_within_one_token(cold) -> None:
    engine = cold
    cancel = threading.Event()
    seen = 0
    for ev in engine.chat([{"role": "user", "content": "Count to ten"}], SamplingParams.greedy(200), cancel):
        if isinstance(ev, TokenEvent):
            seen += 1
            if seen == 3:
                cancel.set()
        if isinstance(ev, TurnSummary):
            summary = ev
    assert summary.stop_reason == "cancelled" and summary.generated_tokens == 3


def test_cancel_from_another_thread(cold) -> None:
    engine = cold
    cancel = threading.Event()
    stamps: list[float] = []
    set_at: list[float] = []

    def stopper() -> None:
        while len(stamps) < 2:
            time.sleep(0.001)
        set_at.append(time.perf_counter())
        cancel.set()

    t = threading.Thread(target=stopper)
    t.start()
    for ev in engine.chat([{"role": "user", "content": "Go on"}], SamplingParams.greedy(500), cancel):
        if isinstance(ev, TokenEvent):
            stamps.append(time.perf_counter())
        summary = ev
    t.join()
    assert summary.stop_reason == "cancelled"
    assert sum(s > set_at[0] for s in stamps) <= 1     # at most the token in flight when cancel was set


def test_context_full_is_a_clear_stop(tiny) -> None:
    engine = Engine.load(tiny, options=EngineOptions(context=24, prefix_cache=False))
    prompt = engine.render([{"role": "user", "content": "hi"}])
    assert len(prompt) < 24
    _, tokens, summary = chat(engine, [{"role": "user", "content": "hi"}], SamplingParams.greedy(100))
    if summary.stop_reason != "eos":
        assert summary.stop_reason == "context_full" and "24" in summary.message
        assert len(prompt) + len(tokens) == 24
    _, _, summary = chat(engine, [{"role": "user", "content": "word " * 40}])
    assert summary.stop_reason == "context_full" and "24" in summary.message


def test_turn_two_reuses_turn_one_and_matches_cold(warm, cold) -> None:
    """Greedy tokens after a restore equal a cold prefill of the same prompt."""
    sys_user = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    _, _, first = chat(warm, sys_user)
    turn2 = sys_user + [{"role": "assistant", "content": first.text},
                        {"role": "user", "content": "And a shape?"}]
    stats, tokens, summary = chat(warm, turn2)
    prompt2 = warm.render(turn2)
    assert stats.reused_tokens > 0
    # everything up to the previous assistant header is reused: at most the answer and the new message are read
    header_end = warm.checkpoints(warm.render(sys_user))[-1]
    assert stats.reused_tokens >= header_end
    assert stats.prefilled_tokens == len(prompt2) - stats.reused_tokens
    _, cold_tokens, cold_summary = chat(cold, turn2)
    assert [t.token_id for t in tokens] == [t.token_id for t in cold_tokens]


def test_regenerate_prefills_nothing(warm) -> None:
    engine = warm
    msgs = [{"role": "user", "content": "Tell me something."}]
    _, first, _ = chat(engine, msgs)
    stats, again, _ = chat(engine, msgs)
    assert stats.prefilled_tokens == 0 and stats.reused_tokens == stats.prompt_tokens
    assert [t.token_id for t in again] == [t.token_id for t in first]


def test_edit_reuses_only_up_to_the_edit(warm) -> None:
    engine = warm
    base = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "first question"}]
    chat(engine, base)
    edited = [base[0], {"role": "user", "content": "first question, edited"}]
    stats, _, _ = chat(engine, edited)
    prompt_a, prompt_b = engine.render(base), engine.render(edited)
    common = next(i for i, (a, b) in enumerate(zip(prompt_a, prompt_b)) if a != b)
    assert 0 < stats.reused_tokens <= common


def test_snapshots_survive_restart_from_disk(tiny, tmp_path) -> None:
    opts = EngineOptions(cache_disk_dir=tmp_path)
    msgs = [{"role": "user", "content": "Persist me."}]
    first = Engine.load(tiny, options=opts)
    _, tokens, _ = chat(first, msgs)
    first.cache.persist()
    second = Engine.load(tiny, options=opts)
    stats, again, _ = chat(second, msgs)
    assert stats.prefilled_tokens == 0
    assert [t.token_id for t in again] == [t.token_id for t in tokens]


def test_cli_synth_info_generate(tmp_path, capsys) -> None:
    path = tmp_path / "t.gguf"
    assert main(["synth", "--preset", "tiny", "--quant", "q8_0", "-o", str(path)]) == 0
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "qwen35moe" in out and "MiB of weights per token" in out
    assert main(["generate", "--model", str(path), "--prompt", "Hello", "-n", "8", "--temp", "0"]) == 0
    err = capsys.readouterr().err
    assert "TTFT" in err and "prefill" in err and "decode" in err and "tok/s" in err


def test_cli_reports_bad_file_in_one_line(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert main(["info", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.gguf" in err[0]


@pytest.fixture(scope="module")
def tiny_mmproj(tmp_path_factory):
    from engine.testing.pairs import synth_mmproj_for
    return synth_mmproj_for(tmp_path_factory.mktemp("mm") / "tiny-mmproj.gguf", "tiny", seed=0)


@pytest.fixture(scope="module")
def vision_engine(tiny, tiny_mmproj):
    return Engine.load(tiny, tiny_mmproj)


def shape_image(path, colour, size=(96, 64)):
    from PIL import Image, ImageDraw
    im = Image.new("RGB", size, (240, 240, 240))
    ImageDraw.Draw(im).ellipse((10, 10, 50, 50), fill=colour)
    im.save(path)
    return path


def test_image_prompt_expands_pads_and_positions(vision_engine, tmp_path) -> None:
    eng = vision_engine
    img = shape_image(tmp_path / "a.png", (200, 20, 20))
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(img)}, {"type": "text", "text": "Colour?"}]}]
    prompt = eng.prepare(msgs)
    pad = eng.tokenizer.token_id("<|image_pad|>")
    [(start, emb, digest)] = prompt.images
    [enc] = prompt.encoded
    rows, cols = enc.grid
    assert emb.shape == (rows * cols, eng.text.hparams.n_embd)
    assert prompt.tokens[start - 1] == eng.tokenizer.token_id("<|vision_start|>")
    assert prompt.tokens[start:start + rows * cols] == [pad] * (rows * cols)
    assert prompt.tokens[start + rows * cols] == eng.tokenizer.token_id("<|vision_end|>")
    pos = prompt.positions
    assert pos.shape == (3, len(prompt.tokens))
    assert (pos[0, start:start + rows * cols] == start).all()                  # t is constant over the image
    assert pos[1, start + cols] == start + 1 and pos[2, start + 1] == start + 1  # h follows rows, w columns
    assert pos[0, start + rows * cols] == start + max(rows, cols)                # text resumes after the image


def test_image_turn_greedy_equal_cold_and_cache_keyed_by_image(vision_engine, tmp_path) -> None:
    eng = vision_engine
    red = shape_image(tmp_path / "red.png", (200, 20, 20))
    blue = shape_image(tmp_path / "blue.png", (20, 20, 200))

    def ask(path):
        return [{"role": "user", "content": [{"type": "image", "image": str(path)},
                                              {"type": "text", "text": "What colour is it?"}]}]

    eng.cache.clear()
    _, first, _ = chat(eng, ask(red))
    stats, again, _ = chat(eng, ask(red))
    assert stats.prefilled_tokens == 0 and [t.token_id for t in again] == [t.token_id for t in first]
    stats, _, _ = chat(eng, ask(blue))
    start = eng.prepare(ask(blue)).images[0][0]
    assert stats.reused_tokens <= start          # same token ids, other image: no reuse past the image
    cold = Engine(eng.text, eng.tokenizer, eng.model, EngineOptions(prefix_cache=False), eng.vision)
    _, cold_tokens, _ = chat(cold, ask(red))
    assert [t.token_id for t in cold_tokens] == [t.token_id for t in first]


def test_reading_ahead_an_image_chat_leaves_only_the_new_message(vision_engine, tmp_path) -> None:
    """The read-ahead of turn N+1 works when an earlier message holds an image (it compared a render with the
    images unexpanded against one with them expanded, so it never did): afterwards the next turn prefills only
    its new message, and answers as a cold engine does."""
    eng = vision_engine
    img = shape_image(tmp_path / "a.png", (200, 20, 20))
    messages = [{"role": "user", "content": [{"type": "image", "image": str(img)},
                                             {"type": "text", "text": "Colour?"}]}]
    eng.cache.clear()
    _, _, summary = chat(eng, messages)
    messages.append({"role": "assistant", "content": summary.text})
    stats = eng.prefill_ahead(messages)
    assert stats is not None and stats.prefilled_tokens > 0
    assert eng.prefill_ahead(messages).prefilled_tokens == 0          # already read
    messages.append({"role": "user", "content": "And the shape?"})
    stats, tokens, _ = chat(eng, messages)
    full = eng.render(messages)                   # images unexpanded; they all come before the new message
    assert stats.prefilled_tokens == len(full) - eng.prompts.message_starts(full)[-2]
    cold = Engine(eng.text, eng.tokenizer, eng.model, EngineOptions(prefix_cache=False), eng.vision)
    _, cold_tokens, _ = chat(cold, messages)
    assert [t.token_id for t in tokens] == [t.token_id for t in cold_tokens]


def test_image_without_vision_tower_is_a_clear_error(cold, tmp_path) -> None:
    from engine.errors import UnsupportedModelError
    img = shape_image(tmp_path / "x.png", (0, 200, 0))
    with pytest.raises(UnsupportedModelError, match="vision tower"):
        cold.prepare([{"role": "user", "content": [{"type": "image", "image": str(img)}]}])


def test_cli_image_without_mmproj_says_to_pass_one(tiny, tmp_path, capsys) -> None:
    img = shape_image(tmp_path / "a.png", (200, 20, 20))
    assert main(["generate", "--model", str(tiny), "--image", str(img), "-p", "Colour?"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1
    assert err[0].startswith(f"error: {tiny.name}: no vision tower") and "--mmproj FILE" in err[0]


def test_cli_bundled_model_named_explicitly_brings_its_tower(tiny, tiny_mmproj, tmp_path, capsys,
                                                              monkeypatch) -> None:
    """The bundled model named by its path pairs its own mmproj; another model does not."""
    import engine.demo_model
    monkeypatch.setattr(engine.demo_model, "bundled_model", lambda: (tiny, tiny_mmproj))
    img = shape_image(tmp_path / "a.png", (200, 20, 20))
    ask = ["--image", str(img), "-p", "Colour?", "-n", "2", "--temp", "0"]
    assert main(["generate", "--model", str(tiny), *ask]) == 0
    assert f"[loaded {tiny.name} + {tiny_mmproj.name} in" in capsys.readouterr().err
    other = tmp_path / "other.gguf"
    other.write_bytes(tiny.read_bytes())
    assert main(["generate", "--model", str(other), *ask]) == 2
    assert "--mmproj FILE" in capsys.readouterr().err


def test_cli_prompt_larger_than_context_is_an_error(tiny, capsys) -> None:
    assert main(["generate", "--model", str(tiny), "--context", "24", "-p", "word " * 40]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and err[-1].startswith("error: the prompt is ")
    assert "context window holds 24" in err[-1] and "--context N" in err[-1]


def test_mismatched_mmproj_is_refused(tiny, tmp_path) -> None:
    from engine.errors import ModelFormatError
    from engine.testing.qwen3vl import synth_mmproj
    wrong = synth_mmproj(tmp_path / "wrong.gguf", "tiny", out_dim=32)
    with pytest.raises(ModelFormatError, match="projection_dim"):
        Engine.load(tiny, wrong)


def test_dense_model_restore_equals_cold(synth_model) -> None:
    """The dense qwen35 variant: turn 2 after a restore, restored mid-answer-free, equals a cold run."""
    path = synth_model("dense-tiny", "q8_0")
    warm = Engine.load(path, options=EngineOptions(snapshot_interval=7))
    cold = Engine.load(path, options=EngineOptions(prefix_cache=False))
    msgs = [{"role": "user", "content": "Describe a triangle in one sentence, please."}]
    _, first, _ = chat(warm, msgs)
    turn2 = msgs + [{"role": "assistant", "content": "It has three sides."},
                    {"role": "user", "content": "And a square?"}]
    stats, tokens, _ = chat(warm, turn2)
    assert stats.reused_tokens > 0
    _, cold_tokens, _ = chat(cold, turn2)
    assert [t.token_id for t in tokens] == [t.token_id for t in cold_tokens]


def test_snapshot_list_and_clear_through_the_api(warm) -> None:
    chat(warm, [{"role": "system", "content": "S."}, {"role": "user", "content": "Q?"}], conversation="conv-7")
    snaps = warm.snapshots()
    assert snaps and all(s.conversation == "conv-7" and s.tier == "ram" and s.nbytes > 0 for s in snaps)
    assert [s.pos for s in snaps] == sorted((s.pos for s in snaps), reverse=True)
    warm.clear_snapshots(snaps[0].key)
    assert [s.key for s in warm.snapshots()] == [s.key for s in snaps[1:]]
    warm.clear_snapshots()
    assert warm.snapshots() == []


def test_answer_end_snapshot_only_when_the_answer_rerenders(tiny) -> None:
    from engine.prompt.template import ChatTemplate
    engine = Engine.load(tiny, options=EngineOptions(prefix_cache=False))
    msgs = [{"role": "user", "content": "Name a shape."}]
    answer = engine.tokenizer.encode("A circle.") + [engine.tokenizer.token_id("<|im_end|>")]
    prompt = engine.render(msgs)
    assert not engine.answer_rerenders(msgs, prompt, answer)          # Qwen drops the (empty) think block
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    engine.tokenizer.chat_template = ChatTemplate(chatml)
    prompt = engine.render(msgs)
    assert engine.answer_rerenders(msgs, prompt, answer)              # plain ChatML re-renders it as generated


def test_prefill_progress_events(cold) -> None:
    import engine.turn.runtime as runtime
    msgs = [{"role": "user", "content": "word " * 300}]
    events = list(cold.chat(msgs, SamplingParams.greedy(2)))
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    stats_at = next(i for i, e in enumerate(events) if isinstance(e, PrefillStats))
    total = len(cold.render(msgs))
    assert total > runtime.PREFILL_PIECE and len(progress) >= 2
    assert all(isinstance(e, PrefillProgress) for e in events[:stats_at])
    assert [p.done for p in progress] == sorted(p.done for p in progress) and progress[-1].done == total
    assert all(p.total == total for p in progress)


def test_load_reports_stages_and_can_be_cancelled(tiny) -> None:
    from engine.errors import GenerationCancelled
    stages: list[str] = []
    Engine.load(tiny, options=EngineOptions(device="cpu"), progress=stages.append)
    assert stages == ["mapping tensors", "building the tokenizer", "preparing weights"]
    cancel = threading.Event()

    def stop_after_mapping(stage: str) -> None:
        if stage == "mapping tensors":
            cancel.set()

    with pytest.raises(GenerationCancelled, match="cancelled"):
        Engine.load(tiny, options=EngineOptions(device="cpu"), progress=stop_after_mapping, cancel=cancel)


def test_image_key_depends_on_resize_bounds(vision_engine, tmp_path) -> None:
    """The same image under another size limit gives other embeddings: no prefix reuse across it."""
    from engine.registry import open_projector
    from engine.vision.encoder import ImageEncoder
    from engine.testing.pairs import synth_mmproj_for
    img = shape_image(tmp_path / "k.png", (10, 160, 10), size=(320, 256))
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(img)}, {"type": "text", "text": "Hi"}]}]
    key_a = vision_engine.prepare(msgs).images[0][2]
    same_tower = open_projector(synth_mmproj_for(tmp_path / "same-mmproj.gguf", "tiny", seed=0))
    assert same_tower.projector.identity == vision_engine.vision.tower.identity
    small = ImageEncoder(same_tower, min_pixels=1024, max_pixels=64 * 64)
    other = Engine(vision_engine.text, vision_engine.tokenizer, vision_engine.model, EngineOptions(), small)
    assert other.prepare(msgs).images[0][2] != key_a
    prepared = vision_engine.prepare(msgs)
    info = vision_engine.image_info(str(img))
    assert (info.height, info.width) == prepared.encoded[0].size
    assert info.tokens == len(prepared.images[0][1]) == prepared.encoded[0].n_tokens


def test_default_model_without_the_bundled_demo_is_a_clear_error(tmp_path, monkeypatch) -> None:
    """No bundled demo: default_model names the missing file and how to get a model, and writes nothing."""
    import engine.api as api
    import engine.demo_model as demo_model
    monkeypatch.setattr(demo_model, "ASSETS", tmp_path / "models")
    missing = r"models/deltadesk-demo\.gguf is missing.*--model.*engine pull.*engine synth"
    with pytest.raises(EngineError, match=missing):
        api.default_model()
    assert not (tmp_path / "models").exists()


def test_default_model_is_the_bundled_demo() -> None:
    import engine.api as api
    import engine.demo_model as demo_model
    if not (demo_model.ASSETS / "deltadesk-demo.gguf").is_file():
        pytest.skip("the bundled demo model is absent")
    assert api.default_model() == (demo_model.ASSETS / "deltadesk-demo.gguf",
                                   demo_model.ASSETS / "deltadesk-demo-mmproj.gguf")

