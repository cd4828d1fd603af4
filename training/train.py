"""Train the bundled DeltaDesk demo model: a small HF ``Qwen3_5MoeForConditionalGeneration``
(Gated DeltaNet + gated attention 3:1, MoE 8 experts top-2 + shared expert, Qwen3.5 vision tower and
merger) on the synthetic shape scenes of :mod:`training.data`.

    python training/train.py --out runs/demo                  # CUDA if present, else CPU; fills --minutes
    python training/train.py --out runs/demo --steps 3000     # exactly 3000 steps
    python training/train.py --out runs/probe --probe 64,256,512   # ms/step per batch size, no training

Writes ``config.json``, ``weights-<k>.safetensors`` (float16 shards) and ``log.json`` into ``--out``; a
run with the same ``--steps`` reproduces the weights up to the device kernels' non-determinism.
The shipped model's stages, the seeds and the held-out metric: docs/design/training.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_qwen35moe

sys.path.insert(0, str(Path(__file__).resolve().parent))

import data  # noqa: E402
import second_scenes  # noqa: E402

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
    """Sample ``i`` = :func:`data.training_sample` ``(i, kind_weights)``."""

    def __init__(self, vocab: dict, kind_weights: dict[str, float] | None = None):
        self.vocab = vocab
        self.kind_weights = kind_weights
        self.enc: data.Encoder | None = None

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, i: int) -> data.Sample:
        if self.enc is None:
            self.enc = data.Encoder(self.vocab)
        return data.training_sample(self.enc, i, self.kind_weights)


def collate(samples: list[data.Sample], pad_id: int, image_pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch (padding only follows real tokens, so causal layers never see it) with the
    M-RoPE ``position_ids`` (3, B, n) precomputed (padding continues the text positions), so transformers
    does not run its per-sample ``get_rope_index`` loop on the GPU."""
    n = max(len(s.ids) for s in samples)
    ids = torch.full((len(samples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), n), -100, dtype=torch.long)
    positions = torch.empty((3, len(samples), n), dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, :len(s.ids)] = torch.from_numpy(s.ids)
        labels[b, :len(s.labels)] = torch.from_numpy(s.labels)
        positions[:, b, :len(s.ids)] = torch.from_numpy(s.positions)
        positions[:, b, len(s.ids):] = int(s.positions.max()) + 1 + torch.arange(n - len(s.ids))
    batch = {"input_ids": ids, "labels": labels, "mm_token_type_ids": (ids == image_pad_id).int(),
             "position_ids": positions}
    images = [s for s in samples if s.pixel_values is not None]
    if images:
        batch["pixel_values"] = torch.from_numpy(np.concatenate([s.pixel_values for s in images]))
        batch["image_grid_thw"] = torch.tensor([[1, *s.grid] for s in images], dtype=torch.long)
        if all(s.token_labels is not None for s in images):
            batch["token_labels"] = torch.from_numpy(np.concatenate([s.token_labels for s in images]))
    return batch


def grouped_vision_attention(self: hf_qwen35moe.Qwen3_5MoeVisionAttention, hidden_states: torch.Tensor,
                             cu_seqlens: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                             **kwargs) -> torch.Tensor:
    """``Qwen3_5MoeVisionAttention.forward`` with the same math (each image attends to itself only), but one
    ``scaled_dot_product_attention`` call per distinct image length instead of one per image: the stock
    non-flash path loops over the ~500 images of a batch, which dominated the step time on the GPU.

    hidden_states: (S, D) patches of all images; cu_seqlens: (n_images + 1,) int32 patch offsets;
    position_embeddings: (cos, sin), each (S, head_dim). Returns (S, D).
    """
    n = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = hf_qwen35moe.apply_rotary_pos_emb_vision(q, k, *position_embeddings)
    bounds = cu_seqlens.tolist()
    groups: dict[int, list[int]] = defaultdict(list)
    for a, b in zip(bounds[:-1], bounds[1:]):
        groups[b - a].append(a)
    pieces, order = [], []
    for length, starts in groups.items():
        idx = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).reshape(-1)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t[idx].reshape(len(starts), length, self.num_heads, -1).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v).to(q.dtype), scale=self.scaling)
        pieces.append(o.transpose(1, 2).reshape(len(starts) * length, -1))
        order.append(idx)
    perm = torch.cat(order)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(n, device=perm.device)
    return self.proj(torch.cat(pieces)[inverse].to(hidden_states.dtype))


_GRID_POSITIONS: dict[tuple, torch.Tensor] = {}
_stock_vision_position_ids = hf_qwen35moe.get_vision_position_ids


def cached_vision_position_ids(grid_thw: torch.Tensor, spatial_merge_size: int, *args, **kwargs) -> torch.Tensor:
    """transformers' ``get_vision_position_ids`` (rotary (row, col) per patch, merge-window order), computed
    once per distinct grid and concatenated: the stock function builds them image by image on the GPU."""
    if kwargs.get("kwargs") and "position_ids" in kwargs["kwargs"]:
        return _stock_vision_position_ids(grid_thw, spatial_merge_size, *args, **kwargs)
    parts = []
    for thw in grid_thw.tolist():
        key = (*thw, spatial_merge_size, grid_thw.device)
        if key not in _GRID_POSITIONS:
            _GRID_POSITIONS[key] = _stock_vision_position_ids(grid_thw.new_tensor([thw]), spatial_merge_size)
        parts.append(_GRID_POSITIONS[key])
    return torch.cat(parts)


def use_fast_paths(model: torch.nn.Module, fast: bool = True) -> None:
    """Route every vision attention module of ``model`` through :func:`grouped_vision_attention` and the
    vision rotary positions through :func:`cached_vision_position_ids` (same values, fewer GPU launches);
    ``fast=False`` restores transformers' own code."""
    hf_qwen35moe.get_vision_position_ids = cached_vision_position_ids if fast else _stock_vision_position_ids
    for mod in model.modules():
        if isinstance(mod, hf_qwen35moe.Qwen3_5MoeVisionAttention):
            if fast:
                mod.forward = grouped_vision_attention.__get__(mod)
            else:
                mod.__dict__.pop("forward", None)


def worker_init(_: int) -> None:
    """One torch thread per data worker (they only run numpy and Pillow)."""
    torch.set_num_threads(1)


def make_loader(vocab: dict, cfg: Qwen3_5MoeConfig, first: int, batch: int, workers: int,
                kind_weights: dict[str, float] | None = None) -> torch.utils.data.DataLoader:
    """Consecutive batches of the sample stream (question types weighted by ``kind_weights``, see
    :func:`data.training_sample`) from sample index ``first``."""
    return torch.utils.data.DataLoader(
        torch.utils.data.Subset(Stream(vocab, kind_weights), range(first, 1 << 40)), batch_size=batch, shuffle=False,
        num_workers=workers, worker_init_fn=worker_init if workers else None,
        collate_fn=functools.partial(collate, pad_id=vocab["pad_id"], image_pad_id=cfg.image_token_id),
        prefetch_factor=4 if workers else None, persistent_workers=bool(workers), pin_memory=torch.cuda.is_available())


HELDOUT_SEED = data.EVAL_SEED_BASE + 5_000_000


HELDOUT = {"heldout_exact": (data.scene, data.render, HELDOUT_SEED),
           "heldout_second": (second_scenes.scene, second_scenes.render, 5_000_000)}
"""Held-out curves: log key -> (scene of a seed, its drawing, first seed). ``heldout_second`` is the second
generator (``second_scenes``), which training never draws from; its seeds are far from those
``evaluate.py`` and the tests use."""


def heldout_batches(vocab: dict, cfg: Qwen3_5MoeConfig, n_scenes: int, batch: int = 128,
                    key: str = "heldout_exact") -> list[tuple[list[str], dict]]:
    """Every question of ``n_scenes`` held-out scenes of ``HELDOUT[key]`` as collated batches, with each
    sample's question type."""
    make, draw, first = HELDOUT[key]
    enc = data.Encoder(vocab)
    items = []
    for i in range(n_scenes):
        sc = make(first + i)
        image = draw(sc)
        items += [(kind, enc.sample(q, a, image)) for kind, (q, a) in data.questions(sc).items()]
    out = []
    for j in range(0, len(items), batch):
        part = items[j:j + batch]
        out.append(([k for k, _ in part], collate([smp for _, smp in part], vocab["pad_id"], cfg.image_token_id)))
    return out


@torch.no_grad()
def heldout_accuracy(model: torch.nn.Module, batches: list[tuple[list[str], dict]],
                     device: torch.device) -> dict[str, float]:
    """Teacher-forced exact match per question type (see the module docstring), in [0, 1]."""
    model.eval()
    right: dict[str, int] = {}
    total: dict[str, int] = {}
    for kinds, batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(**{k: v for k, v in batch.items() if k not in ("labels", "token_labels")}).logits
        tgt = batch["labels"][:, 1:]
        ok = ((logits[:, :-1].argmax(-1) == tgt) | (tgt == -100)).all(-1).tolist()
        for kind, good in zip(kinds, ok):
            right[kind] = right.get(kind, 0) + good
            total[kind] = total.get(kind, 0) + 1
    model.train()
    return {k: round(right[k] / total[k], 3) for k in data.QUESTION_TYPES if k in total}


class TokenProbe(torch.nn.Module):
    """Auxiliary linear heads on the merger's output (the image embeddings the LLM reads) that predict each
    image token's shape kind, colour and 3x3 cell (:func:`data.token_labels`). A training aid only: it is
    not part of the exported model. It gives the vision tower a dense signal per token, where the
    answer tokens give one sparse signal per image."""

    SIZES = (len(data.SHAPES) + 1, len(data.COLOURS) + 1, 9)

    def __init__(self, model: torch.nn.Module, width: int):
        super().__init__()
        self.head = torch.nn.Linear(width, sum(self.SIZES))
        self.features: torch.Tensor | None = None
        model.model.visual.register_forward_hook(self._keep)

    def _keep(self, module: torch.nn.Module, args: tuple, output) -> None:
        self.features = output.pooler_output

    def loss(self, labels: torch.Tensor) -> torch.Tensor:
        """Mean of the three cross-entropies over the tokens of the last vision forward; labels (n, 3) int64."""
        logits = self.head(self.features.float()).split(self.SIZES, dim=-1)
        self.features = None
        return sum(F.cross_entropy(lg, labels[:, i]) for i, lg in enumerate(logits)) / 3


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict, device: torch.device,
               probe_heads: TokenProbe | None = None, probe_weight: float = 0.0) -> tuple[float, float, float]:
    """One optimiser step; returns (loss, answer-token accuracy, router auxiliary loss). With
    ``probe_heads``, ``probe_weight`` x its loss on the batch's token labels is added to the LM loss."""
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    labels = batch.pop("token_labels", None)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = model(**batch)
    loss = out.loss
    if probe_heads is not None and labels is not None and probe_weight:
        loss = loss + probe_weight * probe_heads.loss(labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for group in opt.param_groups for p in group["params"]], 1.0)
    opt.step()
    with torch.no_grad():
        pred = out.logits[:, :-1].argmax(-1)
        tgt = batch["labels"][:, 1:]
        mask = tgt != -100
        acc = float(((pred == tgt) & mask).sum() / mask.sum())
    return out.loss.item(), acc, out.aux_loss.item()


def probe(model: torch.nn.Module, opt: torch.optim.Optimizer, vocab: dict, cfg: Qwen3_5MoeConfig,
          batches: list[int], workers: int, device: torch.device) -> None:
    """Print, for each batch size, the ms per step of steps 5-15 split into waiting for data and the GPU
    step, with transformers' own vision loops and with :func:`use_fast_paths`, then a profile of one step (the weights
    are trained on, then discarded)."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for b in batches:
        loader = iter(make_loader(vocab, cfg, 0, b, workers))
        for fast in (False, True):
            use_fast_paths(model, fast)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            wait = work = 0.0
            for step in range(15):
                t = time.time()
                batch = next(loader)
                t1 = time.time()
                train_step(model, opt, batch, device)
                sync()
                if step >= 5:
                    wait += t1 - t
                    work += time.time() - t1
            print(json.dumps({"batch": b, "fast_paths": fast, "data_wait_ms": round(wait * 100),
                              "step_ms": round(work * 100), "samples_per_s": round(b * 10 / (wait + work)),
                              "max_gpu_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30
                                                   if device.type == "cuda" else 0, 1)}),
                  flush=True)
    batch = next(loader)
    with torch.profiler.profile() as prof:
        train_step(model, opt, batch, device)
        sync()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=15), flush=True)


def parse_kind_weights(text: str | None) -> dict[str, float] | None:
    """``"shape=3,colour=1.5"`` -> ``{"shape": 3.0, "colour": 1.5}``; ``None`` or ``""`` -> ``None``.

    Raises:
        SystemExit: an item is not ``TYPE=NUMBER``, the type is not one of ``data.QUESTION_TYPES``, or the
            weight is not a positive finite number.
    """
    if not text:
        return None
    out: dict[str, float] = {}
    for item in text.split(","):
        kind, _, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if kind.strip() not in data.QUESTION_TYPES or not (0 < weight < math.inf):
            raise SystemExit(f"--question-weights: {item!r} is not TYPE=WEIGHT with TYPE one of "
                             f"{', '.join(data.QUESTION_TYPES)} and WEIGHT a positive number")
        out[kind.strip()] = weight
    return out


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """The learning rate at ``step``: linear warm-up, then cosine decay to 5 % of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def save_shards(model: torch.nn.Module, out: Path) -> list[str]:
    """float16 state dict in safetensors shards of at most :data:`SHARD_BYTES`; returns the file names.
    Each shard is written to a temporary name and renamed, so a kill leaves whole files."""
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
        tmp = out / (names[-1] + ".tmp")
        save_file(shard, str(tmp))
        os.replace(tmp, out / names[-1])
    return names


def read_shards(run: Path) -> dict[str, torch.Tensor]:
    """The float16 state dict of ``run``: the shards its ``log.json`` lists (every ``weights-*.safetensors``
    when it has no log, as in a run folder written by hand).

    Raises:
        FileNotFoundError: a listed shard is missing.
    """
    log = run / "log.json"
    if log.exists():
        names = json.loads(log.read_text())["shards"]
    else:
        names = sorted(p.name for p in run.glob("weights-*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for name in names:
        state |= load_file(str(run / name))
    return state


def _done(step: int, steps: int | None, args: argparse.Namespace, seconds: float) -> bool:
    """Whether training stops before ``step``: ``steps`` reached, ``--stop-after``, or ``--max-seconds`` passed."""
    return ((steps is not None and step >= steps) or step == args.stop_after
            or (args.max_seconds is not None and seconds > args.max_seconds))


def _heldout_sets(vocab: dict, cfg, args: argparse.Namespace) -> dict:
    """The held-out batches of each set in ``HELDOUT`` (none with ``--eval-every 0``)."""
    if not args.eval_every:
        return {}
    return {key: heldout_batches(vocab, cfg, args.eval_scenes, key=key) for key in HELDOUT}


def _model_and_optimizer(args: argparse.Namespace, cfg, device: torch.device):
    """The model (from ``--init``'s weights when given) on ``device`` in training mode, the token probe's heads
    (None with ``--token-probe 0``), the AdamW optimizer over both, and the number of samples already seen."""
    model = Qwen3_5MoeForConditionalGeneration(cfg)
    first = 0
    if args.init is not None:
        model.load_state_dict({k: v.float() for k, v in read_shards(args.init).items()})
        first = json.loads((args.init / "log.json").read_text())["samples"]
    model = model.to(device).train()
    use_fast_paths(model, not args.stock_hf_paths)
    probe_heads = TokenProbe(model, cfg.vision_config.out_hidden_size).to(device) if args.token_probe else None
    params = list(model.named_parameters()) + (list(probe_heads.named_parameters()) if probe_heads else [])
    decay = [p for n, p in params if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in params if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    return model, probe_heads, opt, first


def main() -> None:  # noqa: C901
    """Train the demo model with the flags given (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=None, help="total steps (default: fill --minutes)")
    ap.add_argument("--minutes", type=float, default=7.0)
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop (and save) after this many steps, keeping the learning-rate schedule of --steps")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="wall-clock limit of the training loop: stop (and save) at the first step past it")
    ap.add_argument("--question-weights", default=None,
                    help="relative frequency of question types in the image samples, e.g. shape=3,colour=1.5 "
                         "(others 1; default: uniform, as stages 1-6)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    ap.add_argument("--eval-every", type=int, default=250, help="steps between held-out accuracy checks (0: off)")
    ap.add_argument("--eval-scenes", type=int, default=100)
    ap.add_argument("--save-minutes", type=float, default=2.0, help="minutes between saves of weights and log")
    ap.add_argument("--token-probe", type=float, default=0.5,
                    help="weight of the auxiliary per-image-token shape/colour/cell loss (0: off; see TokenProbe)")
    ap.add_argument("--stock-hf-paths", action="store_true",
                    help="keep transformers' per-image vision loops (same math, slower; see use_fast_paths)")
    ap.add_argument("--probe", default=None, help="comma-separated batch sizes: print ms/step for each and exit")
    ap.add_argument("--init", type=Path, default=None,
                    help="continue from this run's weights; its log.json's samples are skipped in the data stream")
    args = ap.parse_args()
    kind_weights = parse_kind_weights(args.question_weights)

    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vocab = data.load_vocab()
    cfg = model_config(vocab)
    model, probe_heads, opt, first = _model_and_optimizer(args, cfg, device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"device {device}, {n_params / 1e6:.2f} M parameters", flush=True)
    if args.probe:
        probe(model, opt, vocab, cfg, [int(b) for b in args.probe.split(",")], args.workers, device)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(cfg.to_json_string())
    heldout = _heldout_sets(vocab, cfg, args)
    loader = make_loader(vocab, cfg, first, args.batch, args.workers, kind_weights)
    steps = args.steps
    curve: list[dict] = []
    t0 = last_save = time.time()
    t40 = None
    run_loss = run_acc = 0.0
    step = 0

    def save() -> None:
        log = {"seed": SEED, "init": str(args.init) if args.init else None, "first_sample": first, "steps": step,
               "batch": args.batch, "lr": args.lr, "token_probe": args.token_probe,
               "question_weights": kind_weights, "samples": first + step * args.batch,
               "seconds": round(time.time() - t0, 1),
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": sys.modules["transformers"].__version__,
               "n_params": n_params, "final_loss": curve[-1]["loss"] if curve else None, "curve": curve,
               "shards": save_shards(model, args.out)}
        tmp = args.out / "log.json.tmp"
        tmp.write_text(json.dumps(log, indent=1) + "\n")
        os.replace(tmp, args.out / "log.json")

    def record(evaluate: bool) -> None:
        rec = {"step": step, "seconds": round(time.time() - t0, 1), "loss": round(run_loss, 4),
               "answer_token_acc": round(run_acc, 4), "aux_loss": round(aux, 4), "lr": opt.param_groups[0]["lr"]}
        if evaluate:
            rec |= {key: heldout_accuracy(model, batches, device) for key, batches in heldout.items()}
        curve.append(rec)
        print(json.dumps(rec), flush=True)

    aux = 0.0
    for batch in loader:
        if _done(step, steps, args, time.time() - t0):
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps or 10 ** 9, args.lr, args.warmup)
        loss, acc, aux = train_step(model, opt, batch, device, probe_heads, args.token_probe)
        run_loss = 0.98 * run_loss + 0.02 * loss if step else loss
        run_acc = 0.98 * run_acc + 0.02 * acc if step else acc
        step += 1
        if step == 40:
            t40 = time.time()
        if steps is None and step == 60:
            per_step = (time.time() - t40) / 20
            steps = int(args.minutes * 60 / per_step)
            print(f"{per_step * 1000:.0f} ms/step -> {steps} steps", flush=True)
        evaluate = args.eval_every and (step % args.eval_every == 0 or step == steps)
        if step % 100 == 0 or step == steps or evaluate:
            record(bool(evaluate))
        if steps is not None and time.time() - last_save > args.save_minutes * 60:
            save()
            last_save = time.time()
    seconds = time.time() - t0
    if step and (not curve or curve[-1]["step"] != step):
        record(bool(heldout))
    save()
    print(f"done: {step} steps in {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
