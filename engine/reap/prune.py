"""Expert pruning of MoE GGUF files: REAP (and frequency) statistics and the choice of kept experts.

REAP (Lasby et al., arXiv 2510.13999): ``S_j = mean_t g_j(t) * ||f_j(t)||_2`` over the tokens routed
to expert j, ``g`` the top-k-renormalised router weight; the same number of lowest-scoring experts goes
in every layer. Statistics come from the CPU model's observer and are saved as JSON.
The streamed rewrite is :mod:`engine.reap.pruned`. Design: docs/design/expert-pruning.md.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelFormatError, UnsupportedModelError
from ..gguf.file import GGUFFile
from ..registry import LoadedText
from .inputs import check_image, read_text

STATS_FORMAT = "deltadesk.expert_stats"
STATS_VERSION = 1
METHODS = ("reap", "frequency")
MAX_LAYERS, MAX_EXPERTS = 1024, 4096      # a statistics file's shape is believed only within these
_MAX_COUNT = 2 ** 53                      # token counts beyond this are not exact in float64
_EPS32 = float(np.finfo(np.float32).eps)

BUILTIN_CALIBRATION: tuple[tuple[str, str], ...] = (
    ("Write a Python function that returns the n-th Fibonacci number iteratively.",
     "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"),
    ("Explain the difference between a list and a tuple in Python.",
     "A list is mutable: you can append, remove or change items. A tuple is immutable, so it can be a "
     "dictionary key and signals a fixed record."),
    ("What is 17 * 23? Show your steps.", "17 * 23 = 17 * 20 + 17 * 3 = 340 + 51 = 391."),
    ("Solve for x: 3x + 7 = 22.", "Subtract 7 from both sides: 3x = 15. Divide by 3: x = 5."),
    ("Summarise the causes of the French Revolution in three sentences.",
     "Royal debt and an unfair tax system strained the state. Enlightenment ideas questioned absolute "
     "monarchy and privilege. Bad harvests and bread prices turned discontent into revolt in 1789."),
    ("Write a haiku about autumn rain.", "Cold rain on maples\nred leaves slide down the window\nthe kettle begins"),
    ("Translate into French: 'The library opens at nine tomorrow.'",
     "La bibliothèque ouvre à neuf heures demain."),
    ("Übersetze ins Englische: 'Ich habe heute keine Zeit, aber morgen gern.'",
     "I have no time today, but gladly tomorrow."),
    ("用一句话解释什么是机器学习。", "机器学习是让计算机从数据中自动学习规律并据此做出预测的方法。"),
    ("How does HTTPS keep a connection private?",
     "The client and server agree on keys with a TLS handshake, the server proves its identity with a "
     "certificate, and the traffic is then encrypted and authenticated with those keys."),
    ("Give me a SQL query that counts orders per customer, largest first.",
     "SELECT customer_id, COUNT(*) AS n FROM orders GROUP BY customer_id ORDER BY n DESC;"),
    ("My bash script fails with 'permission denied'. What should I check?",
     "Check that the file is executable (chmod +x script.sh), that its folder is not mounted noexec, and "
     "that the first line names an interpreter that exists, such as #!/usr/bin/env bash."),
    ("Is a tomato a fruit or a vegetable?",
     "Botanically it is a fruit, a berry grown from the flower's ovary; in cooking it is treated as a vegetable."),
    ("Plan a three-day trip to Kyoto on a budget.",
     "Day 1: Fushimi Inari at dawn and Gion in the evening. Day 2: Arashiyama bamboo grove and a temple "
     "pass. Day 3: Nishiki market and the Philosopher's Path; stay in a guesthouse and use a bus pass."),
    ("Write a short, polite email asking a colleague to review my pull request.",
     "Hi Sam, could you take a look at my pull request on the parser when you have a moment? It is small "
     "and has tests. Thanks a lot!"),
    ("What is the derivative of x^3 * sin(x)?", "By the product rule: 3x^2 sin(x) + x^3 cos(x)."),
    ("Name three sorting algorithms and their average time complexity.",
     "Merge sort O(n log n), quicksort O(n log n), insertion sort O(n^2)."),
    ("Explain recursion to a ten-year-old.",
     "Recursion is when you solve a big puzzle by solving a smaller copy of the same puzzle, until the "
     "copy is so small the answer is obvious."),
    ("Write a JavaScript function that debounces another function.",
     "function debounce(fn, ms) {\n  let t;\n  return (...args) => {\n    clearTimeout(t);\n"
     "    t = setTimeout(() => fn(...args), ms);\n  };\n}"),
    ("What are the health benefits of regular walking?",
     "It strengthens the heart, helps control weight and blood sugar, improves mood and sleep, and keeps "
     "joints and bones healthier."),
    ("If all bloops are razzies and all razzies are lazzies, are all bloops lazzies?",
     "Yes. Every bloop is a razzie, and every razzie is a lazzie, so every bloop is a lazzie."),
    ("Describe the water cycle.",
     "Water evaporates, condenses into clouds, falls as precipitation, and flows back to seas and "
     "groundwater, where the cycle repeats."),
    ("Write a limerick about a cat who codes.",
     "A cat with a laptop named Lou\ncompiled all her code before two;\nshe chased every bug\nacross the "
     "warm rug,\nthen napped while the unit tests grew."),
    ("¿Cuál es la capital de Australia y por qué no es Sídney?",
     "Es Canberra: se construyó como un punto intermedio entre Sídney y Melbourne, que rivalizaban por serlo."),
)
"""The default calibration set: (user, assistant) pairs of varied chat (code, maths, reasoning, writing,
facts, several languages), rendered with the model's chat template."""

IMAGE_QUESTIONS = ("Describe this image.", "What objects are in this picture, and where are they?")
"""Questions asked about each image of ``images_dir`` (:func:`calibration_set`)."""

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")

Message = Mapping[str, Any]


class ExpertStats:
    """Per-layer, per-expert routing statistics of a calibration run; an observer for the model.

    Arrays are (n_layer, n_expert): ``frequency`` int64 tokens routed to each expert; ``reap_sum``,
    ``ean_sum`` and ``gate_sum`` float64 sums over those tokens of ``g * ||f||``, ``||f||`` and ``g``
    (``g`` the renormalised gate, ``f`` the expert's output; see the module doc). ``tokens`` (n_layer,)
    int64 tokens seen per layer.

    Attributes:
        n_layer, n_expert, n_expert_used: the model's shape.
        model: ``{"file", "identity"}`` of the model the statistics are for.
        calibration: free-form description of the calibration set (samples, tokens, source).
    """

    def __init__(self, n_layer: int, n_expert: int, n_expert_used: int, model: Mapping[str, Any] | None = None,
                 calibration: Mapping[str, Any] | None = None) -> None:
        self.n_layer, self.n_expert, self.n_expert_used = n_layer, n_expert, n_expert_used
        self.model = dict(model or {})
        self.calibration = dict(calibration or {})
        self.tokens = np.zeros(n_layer, np.int64)
        self.frequency = np.zeros((n_layer, n_expert), np.int64)
        self.reap_sum = np.zeros((n_layer, n_expert))
        self.ean_sum = np.zeros((n_layer, n_expert))
        self.gate_sum = np.zeros((n_layer, n_expert))

    @classmethod
    def for_model(cls, text: LoadedText, calibration: Mapping[str, Any] | None = None) -> ExpertStats:
        """Empty statistics shaped for the model ``text`` (a MoE file)."""
        hp, gguf = text.hparams, text.file
        return cls(hp.n_layer, hp.n_expert, hp.n_expert_used, {"file": gguf.path.name, "identity": gguf.identity},
                   calibration)

    def routed(self, il: int, logits: np.ndarray, idx: np.ndarray, norms: np.ndarray) -> None:
        """Accumulate one MoE layer of one forward call (:class:`engine.arch.qwen35.model.ExpertObserver`).

        Args: logits (n, n_expert) float32; idx (n, k) int chosen experts; norms (n, k) float64 ``||f||``.
        The gate is ``softmax(logits)`` renormalised over the token's chosen experts, clamped at float32
        eps (``update_pruning_state``); per expert the sums run over the tokens routed to it.
        """
        z = logits.astype(np.float64)
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        top = np.take_along_axis(p, idx, axis=-1)
        g = np.maximum(top / top.sum(axis=-1, keepdims=True), _EPS32)
        flat = idx.reshape(-1)
        self.tokens[il] += idx.shape[0]
        self.frequency[il] += np.bincount(flat, minlength=self.n_expert)
        self.reap_sum[il] += np.bincount(flat, (g * norms).reshape(-1), self.n_expert)
        self.ean_sum[il] += np.bincount(flat, norms.reshape(-1), self.n_expert)
        self.gate_sum[il] += np.bincount(flat, g.reshape(-1), self.n_expert)

    @property
    def reap(self) -> np.ndarray:
        """(n_layer, n_expert) float64 REAP score ``S_j``: mean of ``g * ||f||`` over routed tokens, 0 if never
        routed."""
        return self.reap_sum / np.maximum(self.frequency, 1)

    @property
    def usage(self) -> np.ndarray:
        """(n_layer, n_expert) float64 share of a layer's tokens routed to each expert (rows sum to top-k):
        the chance an expert is needed per token, e.g. for choosing the experts to keep resident in VRAM."""
        return self.frequency / np.maximum(self.tokens, 1)[:, None]

    def scores(self, method: str) -> np.ndarray:
        """(n_layer, n_expert) float64 saliency of ``method`` ("reap" or "frequency"); lower is pruned first.

        Raises: ValueError for another method.
        """
        if method == "reap":
            return self.reap
        if method == "frequency":
            return self.frequency.astype(np.float64)
        raise ValueError(f"unknown pruning method {method!r} (expected one of {', '.join(METHODS)})")

    def kept_experts(self, keep: int, method: str) -> list[list[int]]:
        """The ``keep`` highest-scoring experts of every layer, each list in ascending index order.

        Raises: ValueError: ``keep`` outside ``n_expert_used .. n_expert - 1`` (see :func:`check_keep`),
        or an unknown method.
        """
        check_keep(keep, self.n_expert, self.n_expert_used)
        s = self.scores(method)
        drop = self.n_expert - keep
        return [sorted(int(e) for e in np.argsort(row, kind="stable")[drop:]) for row in s]

    # ---- JSON ------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The statistics as a JSON-able dict (format in ``docs/pruning.md``)."""
        layers = [{"layer": il, "tokens": int(self.tokens[il]), "frequency": self.frequency[il].tolist(),
                   "reap": self.reap[il].tolist(), "reap_sum": self.reap_sum[il].tolist(),
                   "ean_sum": self.ean_sum[il].tolist(), "gate_sum": self.gate_sum[il].tolist()}
                  for il in range(self.n_layer)]
        return {"format": STATS_FORMAT, "version": STATS_VERSION, "model": self.model,
                "n_layer": self.n_layer, "n_expert": self.n_expert, "n_expert_used": self.n_expert_used,
                "calibration": self.calibration, "layers": layers}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_json` to ``path`` (via a new temporary file beside it, then renamed).

        Raises:
            OSError: the folder cannot be written (the temporary file is removed).
        """
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(self.to_json(), indent=1) + "\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ExpertStats:
        """Read statistics written by :meth:`save`.

        The file must be a regular file of at most 256 MiB; its shape (``n_layer`` <= 1024, ``n_expert``
        <= 4096, top-k within it, one layer entry per layer, each row ``n_expert`` long) is checked before
        any array is allocated, and every value must be finite, >= 0, counts integers below 2^53.

        Raises:
            ModelFormatError: unreadable file, not this format, or inconsistent arrays (names the file and field).
        """
        src = str(path)
        try:
            d = json.loads(read_text(path, "expert statistics file"))
        except (ValueError, RecursionError) as exc:
            raise ModelFormatError(f"{src}: cannot read expert statistics: {str(exc)[:200]}") from exc
        if not isinstance(d, dict) or d.get("format") != STATS_FORMAT or d.get("version") != STATS_VERSION:
            raise ModelFormatError(f"{src}: not a {STATS_FORMAT} version {STATS_VERSION} file")
        try:
            n_layer, n_expert, k = _shape(d)
            model, calibration = d.get("model") or {}, d.get("calibration") or {}
            if not isinstance(model, dict) or not isinstance(calibration, dict):
                raise TypeError("model and calibration must be objects")
            st = cls(n_layer, n_expert, k, model, calibration)
            for il, layer in enumerate(d["layers"]):
                st.tokens[il] = _count(layer["tokens"], f"layers[{il}].tokens")
                for name in ("frequency", "reap_sum", "ean_sum", "gate_sum"):
                    values = layer[name]
                    if not isinstance(values, list) or len(values) != n_expert:
                        raise ValueError(f"layers[{il}].{name} must be a list of {n_expert} numbers")
                    row = np.asarray(values, dtype=np.float64)
                    if not np.isfinite(row).all() or (row < 0).any() or (name == "frequency" and (
                            (row >= _MAX_COUNT).any() or (row != np.round(row)).any())):
                        raise ValueError(f"layers[{il}].{name} must be {n_expert} finite numbers >= 0"
                                         + (" (whole counts below 2^53)" if name == "frequency" else ""))
                    getattr(st, name)[il] = row
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ModelFormatError(f"{src}: malformed expert statistics: {str(exc)[:200]}") from exc
        return st

    def check_model(self, gguf: GGUFFile, source: str) -> None:
        """Raise ModelFormatError unless these statistics were gathered on ``gguf`` (same file identity)."""
        if self.model.get("identity") != gguf.identity:
            raise ModelFormatError(
                f"{source}: these expert statistics are for {self.model.get('file', '?')} "
                f"({self.model.get('identity', 'no identity')}), not {gguf.path.name} ({gguf.identity})")


def _shape(d: Mapping[str, Any]) -> tuple[int, int, int]:
    """(n_layer, n_expert, n_expert_used) of a statistics file, checked before anything is allocated.

    Raises: TypeError: not integers. ValueError: out of bounds, or ``layers`` not one entry per layer."""
    values = [d.get(key) for key in ("n_layer", "n_expert", "n_expert_used")]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError("n_layer, n_expert and n_expert_used must be integers")
    n_layer, n_expert, k = values
    if not (1 <= n_layer <= MAX_LAYERS and 2 <= n_expert <= MAX_EXPERTS and 1 <= k <= n_expert):
        raise ValueError(f"shape n_layer={n_layer}, n_expert={n_expert}, n_expert_used={k} is outside "
                         f"1..{MAX_LAYERS} layers, 2..{MAX_EXPERTS} experts, 1..n_expert used")
    layers = d.get("layers")
    if not isinstance(layers, list) or len(layers) != n_layer or not all(isinstance(x, dict) for x in layers):
        raise ValueError(f"layers must be a list of {n_layer} objects (n_layer)")
    return n_layer, n_expert, k


def _count(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _MAX_COUNT:
        raise ValueError(f"{where} must be a whole count below 2^53, got {str(value)[:40]}")
    return value


def check_keep(keep: int, n_expert: int, n_expert_used: int) -> None:
    """Raise ValueError unless ``n_expert_used <= keep < n_expert`` (a prune must remove something, and
    every token still needs its top-k distinct experts)."""
    if keep >= n_expert:
        raise ValueError(f"--keep {keep} is not below the model's {n_expert} experts per layer: nothing to prune")
    if keep < n_expert_used:
        raise ValueError(f"--keep {keep} is below the model's top-{n_expert_used} routing "
                         f"(expert_used_count = {n_expert_used}): keep at least {n_expert_used} experts")


# ---- calibration ---------------------------------------------------------------------------------

def calibration_set(jsonl: str | os.PathLike[str] | None = None,
                    images_dir: str | os.PathLike[str] | None = None) -> list[list[dict]]:
    """The calibration conversations: from ``jsonl``, else :data:`BUILTIN_CALIBRATION`; plus image prompts.

    Args:
        jsonl: one conversation per line: ``{"messages": [...]}`` or a bare message list, messages as
            :meth:`engine.api.Engine.chat` takes them; an image part's relative path is resolved against
            ``images_dir`` (default: the JSONL's folder).
        images_dir: without ``jsonl``, each image file in it (sorted by name) adds one user prompt per
            question of :data:`IMAGE_QUESTIONS`, cycling, to the built-in set.

    Raises:
        ModelFormatError: unreadable file, a line that is not JSON or not a list of role/content messages
            (names file and line), or an image folder that does not exist.
    """
    if jsonl is None:
        convs = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in BUILTIN_CALIBRATION]
        return convs + (_image_prompts(Path(images_dir)) if images_dir is not None else [])
    path = Path(jsonl)
    base = Path(images_dir) if images_dir is not None else path.parent
    lines = read_text(path, "calibration file").splitlines()
    convs = [_conversation(line, base, f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not convs:
        raise ModelFormatError(f"{path}: the calibration file has no conversations")
    return convs


def _image_prompts(folder: Path) -> list[list[dict]]:
    """One user prompt per image file in ``folder`` (sorted by name), the questions of :data:`IMAGE_QUESTIONS`
    cycling. Raises ModelFormatError: not a folder, no image files, or an image that is not a regular file."""
    if not folder.is_dir():
        raise ModelFormatError(f"{folder}: --images must be a folder of images")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ModelFormatError(f"{folder}: no image files ({', '.join(IMAGE_SUFFIXES)})")
    for f in files:
        check_image(f, f"--images {folder}")
    return [[{"role": "user", "content": [{"type": "image", "image": str(f)},
                                          {"type": "text", "text": IMAGE_QUESTIONS[i % len(IMAGE_QUESTIONS)]}]}]
            for i, f in enumerate(files)]


def _conversation(line: str, base: Path, where: str) -> list[dict]:
    """One JSONL line's conversation, its image paths resolved against ``base``.

    Raises: ModelFormatError naming ``where`` (file:line): not JSON, or not a list of role/content messages."""
    try:
        item = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise ModelFormatError(f"{where}: not JSON: {str(exc)[:200]}") from exc
    messages = item.get("messages") if isinstance(item, dict) else item
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages):
        raise ModelFormatError(f"{where}: expected {{\"messages\": [...]}} or a list of "
                               "{\"role\", \"content\"} messages")
    for m in messages:
        _check_content(m["content"], base, where)
    return messages


def _check_content(content: Any, base: Path, where: str) -> None:
    """Check one calibration message's content (a string, or text and image parts) and resolve its image
    paths against ``base`` in place; each image must be a regular file under the size cap.

    Raises: ModelFormatError naming ``where`` (file:line)."""
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ModelFormatError(f"{where}: a message's content must be a string or a list of parts")
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind != "image" or not isinstance(part.get("image"), str) or not part["image"]:
            raise ModelFormatError(f"{where}: a part must be {{\"type\": \"text\", \"text\": ...}} or "
                                   "{\"type\": \"image\", \"image\": \"PATH\"}")
        img = Path(part["image"])
        part["image"] = str(img if img.is_absolute() else base / img)
        check_image(part["image"], where)


def calibrate(engine: Any, conversations: Sequence[Sequence[Message]], max_tokens: int = 1024,
              progress: Callable[[int, int, int], None] | None = None,
              calibration: Mapping[str, Any] | None = None) -> ExpertStats:
    """Run ``conversations`` through ``engine``'s CPU text model (prefill only) and gather :class:`ExpertStats`.

    Each conversation is rendered with the chat template and its images encoded
    (:meth:`engine.api.Engine.prepare`), cut to ``max_tokens`` tokens (before an image that would
    straddle the cut), and run as one forward pass with the statistics observer attached.

    Args:
        engine: an :class:`engine.api.Engine` of a MoE model.
        max_tokens: longest prompt used, tokens (>= 1).
        progress: called as ``progress(done, total, tokens_so_far)`` after each conversation.
        calibration: extra fields for :attr:`ExpertStats.calibration`.

    Raises:
        UnsupportedModelError: a dense model. ValueError: ``max_tokens`` < 1.
        EngineError: from rendering or image encoding (names the file).
    """
    from ..turn.state import SequenceState
    text = engine.text
    hp = text.hparams
    if not hp.is_moe:
        raise UnsupportedModelError(f"{text.source}: {hp.arch} is a dense model: it has no experts to prune")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    stats = ExpertStats.for_model(text)
    model = engine.model
    total = 0
    t0 = time.perf_counter()
    model.observer = stats
    try:
        for i, messages in enumerate(conversations):
            prompt = engine.prepare(messages)
            n = min(len(prompt.tokens), max_tokens)
            for start, emb, _ in prompt.images:
                if start < n < start + len(emb):
                    n = start
            if n == 0:
                continue
            tokens = np.asarray(prompt.tokens[:n], dtype=np.int64)
            rows = model.embed(tokens).copy()
            for start, emb, _ in prompt.images:
                if start + len(emb) <= n:
                    rows[start:start + len(emb)] = emb
            positions = None if prompt.positions is None else np.asarray(prompt.positions)[:, :n]
            model.forward(tokens, SequenceState.new(hp, n), embeddings=rows, positions=positions)
            total += n
            if progress is not None:
                progress(i + 1, len(conversations), total)
    finally:
        model.observer = None
    stats.calibration = {"samples": len(conversations), "tokens": total, "max_tokens": max_tokens,
                         "seconds": round(time.perf_counter() - t0, 1), **(calibration or {})}
    return stats


def default_stats_path(model: str | os.PathLike[str], folder: str | os.PathLike[str] | None = None) -> Path:
    """``MODEL.expert-stats.json`` in ``folder`` (None: beside the model): where ``prune`` keeps a model's
    statistics by default (``folder``: its output file's)."""
    p = Path(model)
    return Path(folder if folder is not None else p.parent) / (p.stem + ".expert-stats.json")


def describe_kept(stats: ExpertStats, kept: Sequence[Sequence[int]], method: str) -> str:
    """One line: the share of routed tokens (frequency) and of REAP mass the kept experts had in calibration."""
    freq = stats.frequency.astype(np.float64)
    reap = stats.reap
    f_share = np.mean([freq[il, k].sum() / max(freq[il].sum(), 1) for il, k in enumerate(kept)])
    r_share = np.mean([reap[il, k].sum() / max(reap[il].sum(), math.ulp(1.0)) for il, k in enumerate(kept)])
    return (f"{method}: kept experts took {100 * f_share:.1f} % of routed tokens and hold {100 * r_share:.1f} % "
            "of the REAP score (mean over layers)")

