"""Train the bundled DeltaDesk demo model: a small HF ``Qwen3_5MoeForConditionalGeneration``
(Gated DeltaNet + gated attention 3:1, MoE 8 experts top-2 + shared expert, Qwen3.5 vision tower and
merger) on the synthetic shape scenes of :mod:`training.data`.

    python training/train.py --out runs/demo                  # CUDA if present, else CPU
    python training/train.py --out runs/demo --steps 3000     # exactly 3000 steps

Fixed seeds: sample ``i`` of the data stream is a pure function of ``i``, batches are consecutive
indices, and torch is seeded, so a run with the same ``--steps`` reproduces the weights up to the
non-determinism of the device's kernels. Without ``--steps`` the step count is chosen once, from the
time of steps 10-30, to fill ``--minutes``; it is logged, and passing it as ``--steps`` repeats the run.

Writes into ``--out``: ``config.json`` (the HF config), ``weights-<k>.safetensors`` (float16 shards of at
most 15 MB, HF parameter names) and ``log.json`` (steps, time, loss and answer-token accuracy curve).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parent))

import data  # noqa: E402

SEED = 20261129
SHARD_BYTES = 15 << 20


def model_config(vocab: dict) -> Qwen3_5MoeConfig:
    """The demo model's architecture (see MODEL_CARD.md); token ids from ``vocab``."""
    tok = data.engine_tokenizer(vocab)
    n_vocab = len(vocab["tokens"])
    return Qwen3_5MoeConfig(
        text_config=dict(
            vocab_size=n_vocab, hidden_size=256, num_hidden_layers=8, full_attention_interval=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
            shared_expert_intermediate_size=256, max_position_embeddings=4096, rms_norm_eps=1e-6,
            output_router_logits=True, router_aux_loss_coef=0.01, tie_word_embeddings=False,
            eos_token_id=vocab["eos_id"], bos_token_id=vocab["bos_id"], pad_token_id=vocab["pad_id"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                 mrope_section=[3, 3, 2], mrope_interleaved=True)),
        vision_config=dict(depth=4, hidden_size=192, num_heads=4, intermediate_size=768, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=256,
                           out_hidden_size=256),
        image_token_id=tok.token_id("<|image_pad|>"), video_token_id=tok.token_id("<|video_pad|>"),
        vision_start_token_id=tok.token_id("<|vision_start|>"), vision_end_token_id=tok.token_id("<|vision_end|>"),
        tie_word_embeddings=False)


class Stream(torch.utils.data.Dataset):
    """Sample ``i`` = :func:`data.training_sample` ``(i)``."""

    def __init__(self, vocab: dict):
        self.vocab = vocab
        self.enc: data.Encoder | None = None

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, i: int) -> data.Sample:
        if self.enc is None:
            self.enc = data.Encoder(self.vocab)
        return data.training_sample(self.enc, i)


def collate(samples: list[data.Sample], pad_id: int, image_pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch (padding only follows real tokens, so causal layers never see it)."""
    n = max(len(s.ids) for s in samples)
    ids = torch.full((len(samples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), n), -100, dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, :len(s.ids)] = torch.from_numpy(s.ids)
        labels[b, :len(s.labels)] = torch.from_numpy(s.labels)
    batch = {"input_ids": ids, "labels": labels, "mm_token_type_ids": (ids == image_pad_id).int()}
    images = [s for s in samples if s.pixel_values is not None]
    if images:
        batch["pixel_values"] = torch.from_numpy(np.concatenate([s.pixel_values for s in images]))
        batch["image_grid_thw"] = torch.tensor([[1, *s.grid] for s in images], dtype=torch.long)
    return batch


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def save_shards(model: torch.nn.Module, out: Path) -> list[str]:
    """float16 state dict in safetensors shards of at most :data:`SHARD_BYTES`."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, p in model.state_dict().items():
        t = p.detach().to("cpu", torch.float16).contiguous()
        if size and size + t.numel() * 2 > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * 2
    names = []
    for k, shard in enumerate(shards):
        names.append(f"weights-{k}.safetensors")
        save_file(shard, str(out / names[-1]))
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=None, help="total steps (default: fill --minutes)")
    ap.add_argument("--minutes", type=float, default=7.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--init", type=Path, default=None,
                    help="continue from this run's weights; its log.json's samples are skipped in the data stream")
    args = ap.parse_args()

    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vocab = data.load_vocab()
    cfg = model_config(vocab)
    model = Qwen3_5MoeForConditionalGeneration(cfg)
    first = 0
    if args.init is not None:
        state = {}
        for shard in sorted(args.init.glob("weights-*.safetensors")):
            state |= load_file(str(shard))
        model.load_state_dict({k: v.float() for k, v in state.items()})
        first = json.loads((args.init / "log.json").read_text())["samples"]
    model = model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"device {device}, {n_params / 1e6:.2f} M parameters", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(cfg.to_json_string())

    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(Stream(vocab), range(first, 1 << 40)), batch_size=args.batch, shuffle=False, num_workers=args.workers,
        collate_fn=functools.partial(collate, pad_id=vocab["pad_id"], image_pad_id=cfg.image_token_id),
        prefetch_factor=4 if args.workers else None,
        persistent_workers=bool(args.workers))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    steps, warmup = args.steps, 150
    curve: list[dict] = []
    t0 = time.time()
    t10 = None
    run_loss = run_acc = 0.0
    step = 0
    for batch in loader:
        if steps is not None and step >= steps:
            break
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps or 10 ** 9, args.lr, warmup)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(**batch)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            pred = out.logits[:, :-1].argmax(-1)
            tgt = batch["labels"][:, 1:]
            mask = tgt != -100
            acc = float(((pred == tgt) & mask).sum() / mask.sum())
        loss = out.loss.item()
        run_loss = 0.98 * run_loss + 0.02 * loss if step else loss
        run_acc = 0.98 * run_acc + 0.02 * acc if step else acc
        step += 1
        if step == 10:
            t10 = time.time()
        if steps is None and step == 30:
            per_step = (time.time() - t10) / 20
            steps = int(args.minutes * 60 / per_step)
            print(f"{per_step * 1000:.0f} ms/step -> {steps} steps", flush=True)
        if step % 100 == 0 or step == steps:
            rec = {"step": step, "seconds": round(time.time() - t0, 1), "loss": round(run_loss, 4),
                   "answer_token_acc": round(run_acc, 4), "aux_loss": round(out.aux_loss.item(), 4),
                   "lr": opt.param_groups[0]["lr"]}
            curve.append(rec)
            print(json.dumps(rec), flush=True)
    seconds = time.time() - t0
    shards = save_shards(model, args.out)
    log = {"seed": SEED, "init": str(args.init) if args.init else None, "first_sample": first, "steps": step, "batch": args.batch, "samples": first + step * args.batch, "seconds": round(seconds, 1),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "transformers": sys.modules["transformers"].__version__,
           "n_params": n_params, "final_loss": curve[-1]["loss"] if curve else None, "curve": curve, "shards": shards}
    (args.out / "log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"done: {step} steps in {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
