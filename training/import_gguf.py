"""Import the engine's files back into a training run: the inverse of :mod:`training.export`.

    python training/import_gguf.py assets/models --out runs/shipped --samples N
    python training/train.py --out runs/next --init runs/shipped ...

Reads the demo's text and mmproj GGUFs with the engine's readers, undoes every convention of
``tests/fixtures/hf_to_gguf.py`` and writes a run folder as :mod:`training.train` does. Re-export is a
fixed point: ``1 + w`` norms and ``ssm_a = -exp(A_log)`` are inverted to values that export to the
same bits. Design: docs/design/training.md (the conventions undone, exactness).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

import data  # noqa: E402
import export  # noqa: E402
import train  # noqa: E402
from hf_to_gguf import tiled  # noqa: E402

from engine.gguf.file import GGUFFile  # noqa: E402
from engine.registry import open_text  # noqa: E402
from engine.arch.qwen35.hparams import Qwen35HParams  # noqa: E402
from engine.arch.qwen3vl.mmproj import Mmproj, VisionHParams, load_mmproj  # noqa: E402

TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
A_LOG_WINDOW = 2.0 ** -20
"""Half-width of the interval around ``ln(-ssm_a)`` that :func:`a_log` bisects (the exporter's float32
exp errs by about 2^-23 relative, which moves a preimage by about 2^-23)."""
A_LOG_SCAN = 16
"""Float32 neighbours on each side of ``fl32(ln(-ssm_a))`` that :func:`a_log` also tries."""


def grouped(x: np.ndarray, axis: int, n_k: int, n_v: int) -> np.ndarray:
    """Inverse of ``hf_to_gguf.tiled``: V heads along ``axis`` from GGUF tiled order back to HF grouped order.

    GGUF position ``j*n_k + g`` goes back to HF head ``g*r + j`` (r = n_v/n_k), which is ``tiled`` with
    the roles of ``n_k`` and ``r`` swapped. ``x``: any array whose ``axis`` holds n_v equal-width heads;
    returns an array of the same shape and dtype.
    """
    return tiled(x, axis, n_v // n_k, n_v)


def unit_offset(s: np.ndarray) -> np.ndarray:
    """``w`` of a zero-centred norm stored as ``s = fl32(1 + w)``: ``s - 1`` in float32, float32 of ``s``'s shape.

    The subtraction is exact for every ``s`` in [0.5, 2] (Sterbenz) and whenever ``s = 1 + w`` was
    exact, so ``fl32(1 + result) == s``.
    """
    return s.astype(np.float32) - np.float32(1.0)


def _ordered(x: np.ndarray) -> np.ndarray:
    """float32 -> int64 keys in the order of the values (adjacent floats differ by 1; -0 and +0 are both 0)."""
    i = x.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def _from_ordered(k: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_ordered` (0 -> +0.0), int64 -> float32."""
    return np.where(k < 0, -k | 0x80000000, k).astype(np.uint32).view(np.float32)


def a_log(ssm_a: np.ndarray) -> np.ndarray:
    """``A_log`` from ``ssm_a = -exp(A_log)``, float32 of any shape -> float32 of the same shape.

    ``text_to_gguf`` computed ``-np.exp`` in float32, which maps many floats to one value near
    ``A_log = 0`` (float32 exp is flat there). Per element, the result is the float32 ``x`` nearest to
    ``ln(-ssm_a)`` (taken in float64) with ``-np.exp(x) == ssm_a``, so a re-export writes the same file.
    Candidates: the run of such ``x`` found by bisection within :data:`A_LOG_WINDOW` of the log
    (clipped to the float nearest the log), and the :data:`A_LOG_SCAN` floats on each side of
    ``fl32(ln(-ssm_a))``, because numpy's float32 exp is not quite monotone (a float can map above its
    neighbours), which can leave a preimage off the bisected run. Where no candidate maps back (a file
    written with another ``exp``) the result is ``fl32(ln(-ssm_a))``.

    Raises:
        ValueError: an ``ssm_a`` value that is not negative (no ``A_log`` gives it).
    """
    s = np.asarray(ssm_a, dtype=np.float32)
    if not np.all(s < 0):
        raise ValueError(f"ssm_a must be negative (-exp(A_log)), got {s[~(s < 0)].tolist()}")
    target = np.log(-s.astype(np.float64))
    x0 = target.astype(np.float32)

    def first(above) -> np.ndarray:
        """Smallest key in the window whose float's ``-exp`` satisfies ``above`` (bisection)."""
        lo = _ordered((target - A_LOG_WINDOW).astype(np.float32))
        hi = _ordered((target + A_LOG_WINDOW).astype(np.float32))
        while np.any(lo < hi):
            mid = (lo + hi) // 2
            ok = above(-np.exp(_from_ordered(mid)))
            active = lo < hi
            hi, lo = np.where(active & ok, mid, hi), np.where(active & ~ok, mid + 1, lo)
        return lo

    start, stop = first(lambda v: v <= s), first(lambda v: v < s)     # the run is [start, stop)
    key = _ordered(x0)[..., None]
    x = _from_ordered(np.concatenate([np.clip(key, start[..., None], stop[..., None] - 1),
                                      key + np.arange(-A_LOG_SCAN, A_LOG_SCAN + 1)], axis=-1))
    dist = np.where(-np.exp(x) == s[..., None], np.abs(x - target[..., None]), np.inf)
    best = np.take_along_axis(x, dist.argmin(axis=-1)[..., None], axis=-1)[..., 0]
    return np.where(np.isfinite(dist.min(axis=-1)), best, x0)


def _float32_decimal(x: float) -> float:
    """The shortest decimal that rounds to ``float32(x)`` (GGUF stores ``1e-6`` as 9.99999997e-07)."""
    return float(str(np.float32(x)))


def hf_config(hp: Qwen35HParams, vp: VisionHParams, tied: bool) -> Qwen3_5MoeConfig:
    """The HF config of a text + vision file pair.

    ``train.model_config(data.load_vocab())`` (what ``train.py --init`` builds) is the template for what
    the files do not hold (special token ids, router loss settings, activations, mrope interleaving);
    every size the files hold replaces the template's. ``export.text_hparams`` / ``export.vision_hparams``
    of the result must give ``hp`` / ``vp`` back.

    Raises:
        ValueError: not a ``qwen35moe`` trunk without MTP layers, or the config does not round-trip
            (names the differing fields).
    """
    if hp.arch != "qwen35moe" or hp.nextn_predict_layers:
        raise ValueError(f"expected a qwen35moe text model without MTP layers, got arch {hp.arch} with "
                         f"{hp.nextn_predict_layers} nextn layers")
    d = train.model_config(data.load_vocab()).to_dict()
    d["tie_word_embeddings"] = tied
    d["text_config"].update(
        vocab_size=hp.n_vocab, hidden_size=hp.n_embd, num_hidden_layers=hp.n_layer,
        layer_types=["linear_attention" if hp.is_recurrent(i) else "full_attention" for i in range(hp.n_layer)],
        num_attention_heads=hp.n_head, num_key_value_heads=hp.n_head_kv, head_dim=hp.head_dim,
        linear_num_key_heads=hp.num_k_heads, linear_num_value_heads=hp.num_v_heads,
        linear_key_head_dim=hp.head_k_dim, linear_value_head_dim=hp.head_v_dim,
        linear_conv_kernel_dim=hp.conv_kernel, num_experts=hp.n_expert, num_experts_per_tok=hp.n_expert_used,
        moe_intermediate_size=hp.n_ff_exp, shared_expert_intermediate_size=hp.n_ff_shexp,
        max_position_embeddings=hp.context_length, rms_norm_eps=_float32_decimal(hp.rms_eps),
        tie_word_embeddings=tied)
    d["text_config"]["rope_parameters"].update(
        rope_theta=_float32_decimal(hp.rope_theta), partial_rotary_factor=hp.rope_dims / hp.head_dim,
        mrope_section=list(hp.rope_sections[:3]))
    d["vision_config"].update(
        depth=vp.n_layer, hidden_size=vp.n_embd, num_heads=vp.n_head, intermediate_size=vp.n_ff,
        patch_size=vp.patch_size, temporal_patch_size=vp.temporal_patch, in_channels=vp.in_channels,
        spatial_merge_size=vp.merge, num_position_embeddings=vp.pos_side ** 2, out_hidden_size=vp.out_dim)
    cfg = Qwen3_5MoeConfig.from_dict(d)
    diffs = [f"{part} {k}: file {a!r}, config {b!r}"
             for part, file_hp, cfg_hp in (("text", hp, export.text_hparams(cfg.text_config)),
                                           ("vision", vp, export.vision_hparams(cfg.vision_config)))
             for k, a, b in _differences(file_hp, cfg_hp)]
    if diffs:
        raise ValueError("the HF config built from the files does not give their hyper-parameters back: "
                         + "; ".join(diffs))
    return cfg


NOT_IN_HF_CONFIG = frozenset({"image_min_pixels", "image_max_pixels"})
"""mmproj fields that the HF config does not hold (``export.vision_hparams`` writes ``data.MAX_IMAGE_PIXELS``
whatever the file had), so files written before the key existed import too."""


def _differences(a, b) -> list[tuple[str, object, object]]:
    """Fields of two dataclasses that differ (floats compared at float32, as GGUF stores them), except
    :data:`NOT_IN_HF_CONFIG`."""
    out = []
    for f in dataclasses.fields(a):
        if f.name in NOT_IN_HF_CONFIG:
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        same = np.float32(x) == np.float32(y) if isinstance(x, float) else x == y
        if not same:
            out.append((f.name, x, y))
    return out


class _Tensors:
    """The tensors of one file, each to be taken exactly once; :meth:`check_used` names the rest."""

    def __init__(self, source: str, names, read):
        self.source, self.read = source, read
        self.left = dict.fromkeys(names)

    def take(self, name: str) -> np.ndarray:
        """float32 math-shape copy of tensor ``name``. Raises ValueError: not in the file, or taken twice."""
        if name not in self.left:
            raise ValueError(f"{self.source}: tensor {name} is missing (or read twice)")
        del self.left[name]
        return np.array(self.read(name), dtype=np.float32)

    def check_used(self) -> None:
        """Raises ValueError naming every tensor of the file no HF parameter was made from."""
        if self.left:
            raise ValueError(f"{self.source}: GGUF tensors left unused: {', '.join(self.left)}")


def text_state(f: GGUFFile, tc) -> dict[str, np.ndarray]:
    """HF state dict (``model.language_model.*``, ``lm_head.weight``; float32 arrays in HF shapes) of a
    text GGUF, inverting ``text_to_gguf``; ``tc`` is the text config from :func:`hf_config`.

    Raises:
        ValueError: a tensor is missing, or one is left unused (names them).
    """
    t = _Tensors(f.source, f.tensor_names, f.f32)
    n_k, n_v = tc.linear_num_key_heads, tc.linear_num_value_heads
    key_dim = n_k * tc.linear_key_head_dim
    p = TEXT_PREFIX
    sd = {p + "embed_tokens.weight": t.take("token_embd.weight"),
          p + "norm.weight": unit_offset(t.take("output_norm.weight"))}
    sd["lm_head.weight"] = t.take("output.weight") if not tc.tie_word_embeddings else sd[p + "embed_tokens.weight"]
    for i in range(tc.num_hidden_layers):
        hf, bk = f"{p}layers.{i}.", f"blk.{i}."
        sd[hf + "input_layernorm.weight"] = unit_offset(t.take(bk + "attn_norm.weight"))
        sd[hf + "post_attention_layernorm.weight"] = unit_offset(t.take(bk + "post_attention_norm.weight"))
        if tc.layer_types[i] == "linear_attention":
            la = hf + "linear_attn."
            qkv = t.take(bk + "attn_qkv.weight")
            sd[la + "in_proj_qkv.weight"] = np.concatenate([qkv[:2 * key_dim], grouped(qkv[2 * key_dim:], 0, n_k, n_v)])
            conv = t.take(bk + "ssm_conv1d.weight")
            sd[la + "conv1d.weight"] = np.concatenate(
                [conv[:2 * key_dim], grouped(conv[2 * key_dim:], 0, n_k, n_v)])[:, None, :]
            sd[la + "in_proj_z.weight"] = grouped(t.take(bk + "attn_gate.weight"), 0, n_k, n_v)
            sd[la + "in_proj_b.weight"] = grouped(t.take(bk + "ssm_beta.weight"), 0, n_k, n_v)
            sd[la + "in_proj_a.weight"] = grouped(t.take(bk + "ssm_alpha.weight"), 0, n_k, n_v)
            sd[la + "A_log"] = a_log(grouped(t.take(bk + "ssm_a"), 0, n_k, n_v))
            sd[la + "dt_bias"] = grouped(t.take(bk + "ssm_dt.bias"), 0, n_k, n_v)
            sd[la + "norm.weight"] = t.take(bk + "ssm_norm.weight")
            sd[la + "out_proj.weight"] = grouped(t.take(bk + "ssm_out.weight"), 1, n_k, n_v)
        else:
            sa = hf + "self_attn."
            for hf_name, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                                ("o_proj", "attn_output")):
                sd[sa + hf_name + ".weight"] = t.take(bk + gg + ".weight")
            sd[sa + "q_norm.weight"] = unit_offset(t.take(bk + "attn_q_norm.weight"))
            sd[sa + "k_norm.weight"] = unit_offset(t.take(bk + "attn_k_norm.weight"))
        mlp = hf + "mlp."
        sd[mlp + "gate.weight"] = t.take(bk + "ffn_gate_inp.weight")
        sd[mlp + "experts.gate_up_proj"] = np.concatenate(
            [t.take(bk + "ffn_gate_exps.weight"), t.take(bk + "ffn_up_exps.weight")], axis=1)
        sd[mlp + "experts.down_proj"] = t.take(bk + "ffn_down_exps.weight")
        for part in ("gate", "up", "down"):
            sd[mlp + f"shared_expert.{part}_proj.weight"] = t.take(bk + f"ffn_{part}_shexp.weight")
        sd[mlp + "shared_expert_gate.weight"] = t.take(bk + "ffn_gate_inp_shexp.weight").reshape(1, -1)
    t.check_used()
    return sd


VISION_BLOCK_NAMES = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
                      "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
"""mmproj block tensor -> HF ``blocks.N.`` module (inverse of ``vision_to_gguf``'s table)."""


def vision_state(m: Mmproj) -> dict[str, np.ndarray]:
    """HF state dict (``model.visual.*``, float32 arrays in HF shapes) of a loaded mmproj, inverting
    ``vision_to_gguf``: ``patch_embed.proj.weight`` (D, 3, 2, P, P) = the two temporal slices stacked on axis 2.

    Raises:
        ValueError: a tensor is missing, or a tensor of the file is left unused (names them).
    """
    t = _Tensors(str(m.path), [x.name for x in GGUFReader(m.path).tensors], m.f32)
    p = VISION_PREFIX
    sd = {p + "patch_embed.proj.weight": np.stack([t.take("v.patch_embd.weight"), t.take("v.patch_embd.weight.1")],
                                                   axis=2),
          p + "patch_embed.proj.bias": t.take("v.patch_embd.bias"),
          p + "pos_embed.weight": t.take("v.position_embd.weight")}
    for gg, hf in (("v.post_ln", "merger.norm"), ("mm.0", "merger.linear_fc1"), ("mm.2", "merger.linear_fc2")):
        for kind in ("weight", "bias"):
            sd[f"{p}{hf}.{kind}"] = t.take(f"{gg}.{kind}")
    for i in range(m.hparams.n_layer):
        for gg, hf in VISION_BLOCK_NAMES.items():
            for kind in ("weight", "bias"):
                sd[f"{p}blocks.{i}.{hf}.{kind}"] = t.take(f"v.blk.{i}.{gg}.{kind}")
    t.check_used()
    return sd


def fill(model: torch.nn.Module, state: dict[str, np.ndarray]) -> None:
    """Copy ``state`` (HF name -> float array) into every entry of ``model.state_dict()``.

    Raises:
        ValueError: an HF parameter with no value in ``state``, a value with no HF parameter, or a shape
            mismatch (names all of them).
    """
    want = model.state_dict()
    problems = [f"HF parameter {k} left unfilled" for k in want if k not in state]
    problems += [f"{k} is not an HF parameter" for k in state if k not in want]
    problems += [f"{k}: shape {state[k].shape} from the files, {tuple(want[k].shape)} in the model"
                 for k in want if k in state and tuple(state[k].shape) != tuple(want[k].shape)]
    if problems:
        raise ValueError("cannot fill the HF model: " + "; ".join(problems))
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=True)


def load_gguf_run(text_gguf: str | Path, mmproj_gguf: str | Path) -> Qwen3_5MoeForConditionalGeneration:
    """The model of an exported text + mmproj pair as an HF ``Qwen3_5MoeForConditionalGeneration``.

    Args:
        text_gguf: the ``qwen35moe`` text GGUF (``export.TEXT_NAME``); its vocabulary must be
            ``training/vocab.json`` (the config's special token ids come from it).
        mmproj_gguf: the vision tower GGUF (``export.MMPROJ_NAME``).

    Returns:
        The model in float32, eval mode, every parameter filled under its HF name; its config is
        :func:`hf_config`.

    Raises:
        engine.errors.ModelFormatError / UnsupportedModelError: a file the engine's readers reject.
        ValueError: a vocabulary other than ``training/vocab.json``, a config that does not round-trip,
            a GGUF tensor missing or left unused, an HF parameter left unfilled (each names the culprit).
    """
    text = open_text(text_gguf)
    f = text.file
    m = load_mmproj(mmproj_gguf)
    if f.meta("tokenizer.ggml.tokens") != data.load_vocab()["tokens"]:
        raise ValueError(f"{f.source}: its tokens differ from training/vocab.json (train.model_config's token ids)")
    cfg = hf_config(text.hparams, m.hparams, tied=not f.has("output.weight"))
    model = Qwen3_5MoeForConditionalGeneration(cfg).float().eval()
    fill(model, text_state(f, cfg.text_config) | vision_state(m))
    return model


def main(argv: list[str] | None = None) -> None:
    """Import the exported GGUF pair back into a run folder (``train.py --init`` reads it)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", type=Path, help=f"folder holding {export.TEXT_NAME} and {export.MMPROJ_NAME}")
    ap.add_argument("--out", type=Path, required=True, help="run folder to write (train.py --init accepts it)")
    ap.add_argument("--samples", type=int, default=0,
                    help="samples of the data stream the model was already trained on, written to log.json: "
                         "train.py --init resumes the stream there. The GGUF files do not record it, so the "
                         "default 0 restarts the stream at sample 0 (repeats the data already seen); take the "
                         "shipped model's count (steps x batch of its stages) from training/MODEL_CARD.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    text, mmproj = args.models / export.TEXT_NAME, args.models / export.MMPROJ_NAME
    model = load_gguf_run(text, mmproj)
    template = train.model_config(data.load_vocab())
    if (export.text_hparams(model.config.text_config), export.vision_hparams(model.config.vision_config)) != \
            (export.text_hparams(template.text_config), export.vision_hparams(template.vision_config)):
        print("note: these files do not have train.model_config's architecture, so train.py --init cannot load them "
              "(export.load_run can)", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(model.config.to_json_string())
    shards = train.save_shards(model, args.out)
    log = {"samples": args.samples, "imported_from": [str(text), str(mmproj)], "steps": 0, "shards": shards}
    (args.out / "log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"{args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters in {len(shards)} shards, "
          f"samples {args.samples}")


if __name__ == "__main__":
    main()
