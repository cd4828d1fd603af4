"""Export a run of :mod:`training.train` to the engine's files: a ``qwen35moe`` text GGUF (written by
``engine.arch.qwen35.writer.write_gguf`` with the demo vocabulary and the Qwen3.5 chat template) and a Qwen3.5
``mmproj`` GGUF (``engine.arch.qwen3vl.mmproj.write_mmproj``), both Q8_0 by default.

    python training/export.py runs/demo --out assets/models

The HF -> GGUF conventions (norms stored ``1 + w``, ``ssm_a = -exp(A_log)``, V heads grouped ->
tiled, stacked experts; llama.cpp's mmproj tensor names) are the ones the conformance fixtures use:
this module uses ``text_to_gguf`` and ``vision_to_gguf`` of ``tests/fixtures/hf_to_gguf.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

import data  # noqa: E402
import train  # noqa: E402
from hf_to_gguf import text_to_gguf, vision_to_gguf  # noqa: E402

from engine.arch.qwen35.hparams import Qwen35HParams  # noqa: E402
from engine.arch.qwen3vl.mmproj import VisionHParams, write_mmproj  # noqa: E402
from engine.arch.qwen35.writer import write_gguf  # noqa: E402
from engine.arch.qwen35.vocab import GGUFVocab  # noqa: E402

TEXT_NAME = "deltadesk-demo.gguf"
MMPROJ_NAME = "deltadesk-demo-mmproj.gguf"


def load_run(run: Path) -> Qwen3_5MoeForConditionalGeneration:
    """The trained model of ``run`` in float32 (its float16 shards, as trained)."""
    cfg = Qwen3_5MoeConfig.from_dict(json.loads((run / "config.json").read_text()))
    cfg.text_config._attn_implementation = "eager"
    model = Qwen3_5MoeForConditionalGeneration(cfg).float().eval()
    model.load_state_dict({k: v.float() for k, v in train.read_shards(run).items()})
    return model


def text_hparams(tc) -> Qwen35HParams:
    """GGUF hyper-parameters of the HF text config (its ``layer_types`` must follow the 3:1 pattern)."""
    assert tc.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * (tc.num_hidden_layers // 4)
    rp = tc.rope_parameters
    return Qwen35HParams(
        arch="qwen35moe", n_layer=tc.num_hidden_layers, nextn_predict_layers=0, n_embd=tc.hidden_size,
        n_vocab=tc.vocab_size, context_length=tc.max_position_embeddings, rms_eps=tc.rms_norm_eps,
        n_head=tc.num_attention_heads, n_head_kv=tc.num_key_value_heads, head_dim=tc.head_dim,
        rope_theta=rp["rope_theta"], rope_dims=int(tc.head_dim * rp["partial_rotary_factor"]),
        rope_sections=(*rp["mrope_section"], 0), full_attention_interval=4,
        conv_kernel=tc.linear_conv_kernel_dim, head_k_dim=tc.linear_key_head_dim,
        num_k_heads=tc.linear_num_key_heads, num_v_heads=tc.linear_num_value_heads,
        head_v_dim=tc.linear_value_head_dim, n_expert=tc.num_experts, n_expert_used=tc.num_experts_per_tok,
        n_ff_exp=tc.moe_intermediate_size, n_ff_shexp=tc.shared_expert_intermediate_size)


def vision_hparams(vc) -> VisionHParams:
    """mmproj hyper-parameters of the HF vision config, with ``image_max_pixels`` =
    ``data.MAX_IMAGE_PIXELS``: the engine scales larger images down to the sizes the tower was trained on."""
    side = int(round(vc.num_position_embeddings ** 0.5))
    return VisionHParams(n_embd=vc.hidden_size, n_ff=vc.intermediate_size, n_layer=vc.depth, n_head=vc.num_heads,
                         patch_size=vc.patch_size, merge=vc.spatial_merge_size, out_dim=vc.out_hidden_size,
                         pos_side=side, image_max_pixels=data.MAX_IMAGE_PIXELS)


def export(model: Qwen3_5MoeForConditionalGeneration, out: Path, quant: str = "q8_0") -> tuple[Path, Path]:
    """Write ``out/deltadesk-demo.gguf`` and ``out/deltadesk-demo-mmproj.gguf``; returns both paths."""
    out.mkdir(parents=True, exist_ok=True)
    tc = model.config.text_config
    vocab = GGUFVocab(**data.load_vocab())
    text_path, mmproj_path = out / TEXT_NAME, out / MMPROJ_NAME
    write_gguf(text_path, text_hparams(tc), text_to_gguf(model, tc, prefix="model.language_model."), quant, vocab=vocab,
               chat_template=data.chat_template())
    write_mmproj(mmproj_path, vision_hparams(model.config.vision_config), vision_to_gguf(model.model.visual),
                 quant.upper())
    return text_path, mmproj_path


def main() -> None:
    """Export a training run's checkpoint to the text and projector GGUF files."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="folder written by training/train.py")
    ap.add_argument("--out", type=Path, default=ROOT / "assets" / "models")
    ap.add_argument("--quant", default="q8_0", choices=["q8_0", "f16", "f32"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    for p in export(load_run(args.run), args.out, args.quant):
        print(f"{p}: {p.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
