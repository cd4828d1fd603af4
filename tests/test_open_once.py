"""A model load opens each file once: one header parse and one family lookup per file (engine.registry)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

from engine import registry
from engine.gguf import header as gguf_header


@pytest.fixture
def counted(monkeypatch):
    """``(parses, lookups)``: header parses per file name (every module's reference to the header
    readers is wrapped) and family lookups per GGUF key value (``registry._pick``)."""
    parses: Counter[str] = Counter()
    lookups: Counter[str] = Counter()

    def counting(fn, path_arg):
        def wrapper(*args, **kwargs):
            parses[Path(str(args[path_arg])).name] += 1
            return fn(*args, **kwargs)
        return wrapper

    readers = {gguf_header.read_header: counting(gguf_header.read_header, 0),
               gguf_header.read_metadata: counting(gguf_header.read_metadata, 0),
               gguf_header.parse_prefix: counting(gguf_header.parse_prefix, 2)}
    for name, module in list(sys.modules.items()):
        if name.startswith("engine") and module is not None:
            for attr, value in list(vars(module).items()):
                if callable(value) and value in readers:
                    monkeypatch.setattr(module, attr, readers[value])
    pick = registry._pick

    def counting_pick(table, value, what, source):
        lookups[f"{what}={value}"] += 1
        return pick(table, value, what, source)

    monkeypatch.setattr(registry, "_pick", counting_pick)
    return parses, lookups


@pytest.mark.parametrize("preset, projector", [("tiny", "qwen3vl_merger"), ("minicpmv46-tiny", "minicpmv4_6")])
def test_a_load_parses_each_header_once_and_looks_each_family_up_once(tmp_path, counted, preset, projector):
    from engine.api import Engine, EngineOptions
    from engine.testing.synth import synth
    from engine.testing.pairs import synth_mmproj_for

    synth(tmp_path / "m.gguf", preset, quant="q8_0", seed=0)
    synth_mmproj_for(tmp_path / "m-mmproj.gguf", preset)
    parses, lookups = counted
    engine = Engine.load(tmp_path / "m.gguf", tmp_path / "m-mmproj.gguf",
                         options=EngineOptions(device="cpu", context=256))
    try:
        assert engine.vision is not None and engine.vision.arch.name in ("qwen3vl", "minicpmv")
        assert parses == {"m.gguf": 1, "m-mmproj.gguf": 1}
        text_key = f"general.architecture={engine.text.hparams.arch}"
        assert lookups == {text_key: 1, f"clip.projector_type={projector}": 1}
    finally:
        engine.close()
