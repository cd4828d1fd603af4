"""The model banner names a pruned file's expert count (``ModelInfo.pruning``, from its general.pruning note) and
whether the weights were read into memory (``ModelInfo.weights``)."""

from __future__ import annotations

from app.main_window import headline
from fake_engine import fake_info


def test_banner_says_how_many_experts_a_pruned_file_kept():
    line = headline(fake_info(pruning="128 of 256 experts kept (REAP)"), "prefill on CPU")
    assert line == ("fake-model \u00b7 12.0 M params \u00b7 128 of 256 experts kept (REAP) \u00b7 Q8_0 \u00b7 text only"
                    " \u00b7 prefill on CPU, decode on CPU")
    assert "experts kept" not in headline(fake_info(), "prefill on CPU")


def test_banner_says_when_the_weights_were_read_into_memory():
    assert headline(fake_info(weights="ram"), "prefill on CPU").endswith(
        "prefill on CPU, decode on CPU, weights in memory")
    assert "weights in memory" not in headline(fake_info(weights="map"), "prefill on CPU")
