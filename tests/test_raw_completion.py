"""Raw completion (``Engine.complete``, ``generate --raw``) and the ChatML fallback of files without a
chat template."""

from __future__ import annotations

import pytest

from engine.__main__ import main
from engine.api import CHATML_NOTE
from engine.errors import EngineError
from engine.events import TurnSummary
from engine.sampling import SamplingParams
from engine.prompt.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(synth_model):
    return synth_model("tiny", "q8_0")


@pytest.fixture
def engine(served):
    """The shared served engine, held (no request runs meanwhile), with the file's own chat
    template restored after the test (a test may drop it)."""
    eng, hold, _ = served
    with hold:
        template = eng.tokenizer.chat_template
        yield eng
        eng.tokenizer.chat_template = template


def _summary(events) -> TurnSummary:
    return [e for e in events if isinstance(e, TurnSummary)][-1]


def test_raw_completion_continues_the_text_as_it_is(engine) -> None:
    text = "The quick brown fox"
    done = _summary(engine.complete(text, SamplingParams.greedy(6)))
    assert done.prompt_tokens == len(engine.tokenizer.encode(text, special=False))
    assert done.generated_tokens == 6 and done.stop_reason == "max_tokens"


def test_raw_completion_of_an_empty_text_is_an_error(engine) -> None:
    with pytest.raises(EngineError, match="needs a prompt"):
        engine.complete("", SamplingParams.greedy(2))


def test_a_file_without_a_chat_template_chats_in_chatml(engine) -> None:
    engine.tokenizer.chat_template = None
    assert engine.info.template_note == CHATML_NOTE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    by_hand = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
               "<|im_start|>assistant\n")
    assert engine.render(messages) == engine.tokenizer.encode(by_hand, special=True)
    chat = _summary(engine.chat(messages, SamplingParams.greedy(5)))
    raw = _summary(engine.complete(by_hand, SamplingParams.greedy(5)))
    assert chat.text == raw.text and chat.prompt_tokens == raw.prompt_tokens


def test_chatml_writes_an_image_part_as_qwen_vl_does(engine) -> None:
    engine.tokenizer.chat_template = None
    messages = [{"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "What?"}]}]
    by_hand = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What?<|im_end|>\n<|im_start|>assistant\n"
    assert engine.render(messages) == engine.tokenizer.encode(by_hand, special=True)


def test_a_file_with_a_template_has_no_note(engine) -> None:
    assert engine.info.template_note == ""


def test_cli_generate_raw(tiny, engine, capsys) -> None:
    assert main(["generate", "--raw", "--model", str(tiny), "--prompt", "Once upon a time", "-n", "4",
                 "--temp", "0"]) == 0
    out = capsys.readouterr()
    assert "generated" in out.err and "note:" not in out.err
    expected = _summary(engine.complete("Once upon a time", SamplingParams.greedy(4))).text
    assert out.out == expected + "\n"


def test_cli_raw_refuses_chat_only_options(tiny, capsys) -> None:
    assert main(["generate", "--raw", "--model", str(tiny), "--system", "x", "-p", "a"]) == 2
    assert "--raw" in capsys.readouterr().err


def test_cli_notes_the_chatml_fallback(tiny, capsys, monkeypatch) -> None:
    real = Tokenizer.from_gguf.__func__

    def without_template(cls, meta, source):
        tok = real(cls, meta, source)
        tok.chat_template = None
        return tok

    monkeypatch.setattr(Tokenizer, "from_gguf", classmethod(without_template))
    assert main(["generate", "--model", str(tiny), "--prompt", "Hi", "-n", "2", "--temp", "0"]) == 0
    err = capsys.readouterr().err
    assert f"[note: {tiny.name}: {CHATML_NOTE}]" in err
