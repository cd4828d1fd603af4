"""Typed, validated hyper-parameters of the Qwen3.5/3.6 hybrid text models.

One frozen dataclass, built in one place (:func:`from_metadata`) from the GGUF keys listed in
``docs/spec/qwen35.md`` section 1 (llama.cpp ``src/llama-model.cpp``, arch ``qwen35moe`` /
``qwen35``). The Mamba-style key names that llama.cpp borrows (``ssm.state_size``,
``ssm.group_count``, ...) are renamed here to what they mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.turn.state import StateLayout

ARCHITECTURES = ("qwen35moe", "qwen35")

# Upper bounds that no real model reaches; they keep a hostile header from asking for
# multi-GB allocations before any tensor is read.
_LIMITS = {
    "block_count": 1024,
    "embedding_length": 65536,
    "attention.head_count": 1024,
    "attention.head_count_kv": 1024,
    "attention.key_length": 4096,
    "attention.value_length": 4096,
    "expert_count": 65536,
    "expert_used_count": 1024,
    "expert_feed_forward_length": 1 << 20,
    "expert_shared_feed_forward_length": 1 << 20,
    "feed_forward_length": 1 << 20,
    "ssm.conv_kernel": 64,
    "ssm.state_size": 4096,
    "ssm.group_count": 1024,
    "ssm.time_step_rank": 1024,
    "ssm.inner_size": 1 << 20,
    "full_attention_interval": 1024,
    "context_length": 1 << 24,
    "rope.dimension_count": 4096,
}


@dataclass(frozen=True)
class Qwen35HParams:
    """Hyper-parameters of one ``qwen35moe`` (MoE) or ``qwen35`` (dense) text model.

    Attribute names follow the GGUF keys without the arch prefix where the key says what it
    means, and the meaning where it borrows a Mamba name (noted per field).
    """

    arch: str
    n_layer: int                 # trunk layers run in decoding = block_count - nextn_predict_layers
    nextn_predict_layers: int    # MTP blocks stored after the trunk (skipped)
    n_embd: int                  # embedding_length
    n_vocab: int                 # vocab_size, or len(tokenizer.ggml.tokens)
    context_length: int
    rms_eps: float               # attention.layer_norm_rms_epsilon (all RMSNorms and the L2 norm)
    # gated full attention
    n_head: int                  # attention.head_count
    n_head_kv: int               # attention.head_count_kv
    head_dim: int                # attention.key_length (== value_length)
    rope_theta: float            # rope.freq_base
    rope_dims: int               # rope.dimension_count: rotated dims per head
    rope_sections: tuple[int, int, int, int]  # rope.dimension_sections, in rotation pairs
    full_attention_interval: int
    # Gated DeltaNet
    conv_kernel: int             # ssm.conv_kernel
    head_k_dim: int              # ssm.state_size
    num_k_heads: int             # ssm.group_count
    num_v_heads: int             # ssm.time_step_rank
    head_v_dim: int              # ssm.inner_size / ssm.time_step_rank
    # FFN: MoE (n_expert > 0) or dense SwiGLU (n_ff > 0)
    n_expert: int = 0            # expert_count
    n_expert_used: int = 0       # expert_used_count
    n_ff_exp: int = 0            # expert_feed_forward_length
    n_ff_shexp: int = 0          # expert_shared_feed_forward_length
    n_ff: int = 0                # feed_forward_length (dense qwen35)

    @property
    def is_moe(self) -> bool:
        """True for ``qwen35moe`` files (routed experts + shared expert)."""
        return self.n_expert > 0

    @property
    def key_dim(self) -> int:
        """GDN q/k width: num_k_heads * head_k_dim."""
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        """GDN v width (ssm.inner_size): num_v_heads * head_v_dim."""
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: 2 * key_dim + value_dim."""
        return 2 * self.key_dim + self.value_dim

    def is_recurrent(self, il: int) -> bool:
        """Layer ``il`` (0-based, trunk only) is Gated DeltaNet, else gated full attention.

        Rule from llama.cpp: full attention iff ``(il + 1) % full_attention_interval == 0``.
        """
        return (il + 1) % self.full_attention_interval != 0

    def state_layout(self) -> StateLayout:
        """The per-layer sequence state (:class:`engine.turn.state.StateLayout`): a Gated DeltaNet layer keeps
        its last ``conv_kernel - 1`` raw ``attn_qkv`` projections ``(K-1, conv_dim)`` and the delta-rule
        state S ``(num_v_heads, head_k_dim, head_v_dim)``; a full-attention layer one K and one V row
        ``(n_head_kv, head_dim)`` per position."""
        recurrent = [il for il in range(self.n_layer) if self.is_recurrent(il)]
        attention = [il for il in range(self.n_layer) if not self.is_recurrent(il)]
        return StateLayout(conv={il: (self.conv_kernel - 1, self.conv_dim) for il in recurrent},
                           ssm={il: (self.num_v_heads, self.head_k_dim, self.head_v_dim) for il in recurrent},
                           kv={il: (self.n_head_kv, self.head_dim) for il in attention},
                           context_length=self.context_length, n_vocab=self.n_vocab)


class _Keys:
    """Typed reads of ``{arch}.*`` keys; every failure is a ModelFormatError naming the file and the key.

    ``key(name, kind, default, required)``: the value of ``{arch}.{name}`` as ``kind`` (int: a non-negative
    integer within :data:`_LIMITS`; float: a number), ``default`` when absent (a missing key without a
    default is an error unless ``required`` is False).
    """

    def __init__(self, get: Callable[[str], Any], arch: str, source: str) -> None:
        self.get, self.arch, self.source = get, arch, source

    def __call__(self, name: str, kind: type = int, default: Any = None, required: bool = True) -> Any:
        full, source = f"{self.arch}.{name}", self.source
        value = self.get(full)
        if value is None:
            if required and default is None:
                raise ModelFormatError(f"{source}: required key {full} is missing")
            return default
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ModelFormatError(f"{source}: key {full} should be a number, got {value!r}")
            return float(value)
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ModelFormatError(f"{source}: key {full} should be an integer, got {value!r}")
            limit = _LIMITS.get(name)
            if value < 0 or (limit is not None and value > limit):
                raise ModelFormatError(
                    f"{source}: key {full} = {value} is out of range (expected 0..{limit})")
            return int(value)
        return value


def _architecture(get: Callable[[str], Any], source: str) -> str:
    """``general.architecture``, one of :data:`ARCHITECTURES`."""
    arch = get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFormatError(f"{source}: key general.architecture is missing or not a string")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: architecture {arch!r} is not supported (expected one of {', '.join(ARCHITECTURES)})")
    return arch


def _trunk(key: _Keys, n_tokens: int | None) -> tuple[int, int, int]:
    """(n_layer, nextn_predict_layers, n_vocab): the trunk layers run (MTP blocks excluded) and the vocabulary."""
    arch, source = key.arch, key.source
    block_count = key("block_count")
    nextn = key("nextn_predict_layers", default=0)
    n_layer = block_count - nextn
    if n_layer <= 0:
        raise ModelFormatError(
            f"{source}: {arch}.block_count = {block_count} leaves no trunk layer after "
            f"{arch}.nextn_predict_layers = {nextn}")
    n_vocab = key("vocab_size", default=0, required=False) or (n_tokens or 0)
    if n_vocab <= 0:
        raise ModelFormatError(f"{source}: neither {arch}.vocab_size nor tokenizer.ggml.tokens gives a vocabulary size")
    return n_layer, nextn, n_vocab


def _rope_sections(key: _Keys) -> tuple[int, int, int, int]:
    """``rope.dimension_sections``: an integer array, cut or zero-padded to 4 entries."""
    full, source = f"{key.arch}.rope.dimension_sections", key.source
    sections = key.get(full)
    if sections is None:
        raise ModelFormatError(f"{source}: required key {full} is missing")
    if not isinstance(sections, (list, tuple)) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in sections):
        raise ModelFormatError(
            f"{source}: key {full} should be an integer array, got {type(sections).__name__}")
    out = tuple(int(s) for s in list(sections)[:4])
    return out + (0,) * (4 - len(out))  # type: ignore[return-value]


def _head_widths(key: _Keys) -> tuple[int, int, int]:
    """(attention head_dim, GDN num_v_heads, GDN head_v_dim), with their consistency rules."""
    arch, source = key.arch, key.source
    head_dim = key("attention.key_length")
    v_len = key("attention.value_length", default=head_dim)
    if v_len != head_dim:
        raise ModelFormatError(f"{source}: {arch}.attention.value_length = {v_len} differs from "
                               f"key_length = {head_dim}")
    num_v_heads = key("ssm.time_step_rank")
    inner = key("ssm.inner_size")
    if num_v_heads == 0 or inner % num_v_heads:
        raise ModelFormatError(
            f"{source}: {arch}.ssm.inner_size = {inner} is not a multiple of ssm.time_step_rank = {num_v_heads}")
    return head_dim, num_v_heads, inner // num_v_heads


def _ffn(get: Callable[[str], Any], key: _Keys) -> dict[str, int]:
    """The FFN fields: routed + shared experts for ``qwen35moe``, the dense SwiGLU width for ``qwen35``."""
    if key.arch != "qwen35moe":
        return dict(n_ff=key("feed_forward_length"))
    return dict(n_expert=_expert_count(get, key, key.arch, key.source), n_expert_used=key("expert_used_count"),
                n_ff_exp=key("expert_feed_forward_length"),
                n_ff_shexp=key("expert_shared_feed_forward_length", default=0, required=False))


def from_metadata(get: Callable[[str], Any], n_tokens: int | None, source: str) -> Qwen35HParams:
    """Build and validate :class:`Qwen35HParams` from GGUF metadata.

    Args:
        get: returns the value of a full GGUF key (``general.architecture``,
            ``qwen35moe.block_count``, ...) or ``None`` when the key is absent.
        n_tokens: length of ``tokenizer.ggml.tokens`` (used when ``vocab_size`` is absent), or None.
        source: file name used in error messages.

    Raises:
        UnsupportedModelError: the architecture is not ``qwen35moe`` / ``qwen35``.
        ModelFormatError: a required key is missing, has the wrong type or an absurd value.
    """
    arch = _architecture(get, source)
    key = _Keys(get, arch, source)
    n_layer, nextn, n_vocab = _trunk(key, n_tokens)
    sections = _rope_sections(key)
    head_dim, num_v_heads, head_v_dim = _head_widths(key)
    hp = Qwen35HParams(
        arch=arch,
        n_layer=n_layer,
        nextn_predict_layers=nextn,
        n_embd=key("embedding_length"),
        n_vocab=n_vocab,
        context_length=key("context_length"),
        rms_eps=key("attention.layer_norm_rms_epsilon", float),
        n_head=key("attention.head_count"),
        n_head_kv=key("attention.head_count_kv"),
        head_dim=head_dim,
        rope_theta=key("rope.freq_base", float),
        rope_dims=key("rope.dimension_count"),
        rope_sections=sections,
        full_attention_interval=key("full_attention_interval", default=4),
        conv_kernel=key("ssm.conv_kernel"),
        head_k_dim=key("ssm.state_size"),
        num_k_heads=key("ssm.group_count"),
        num_v_heads=num_v_heads,
        head_v_dim=head_v_dim,
        **_ffn(get, key),
    )
    _check(hp, source)
    return hp


def _expert_count(get: Callable[[str], Any], key: Callable[..., Any], arch: str, source: str) -> int:
    """``{arch}.expert_count``: an integer, or a per-layer array whose entries are all equal.

    Pruned files (``engine.reap.prune``, REAP GGUFs) keep one count for every layer; a file whose layers
    have different counts cannot run here (every MoE layer is built for one expert count).

    Raises:
        UnsupportedModelError: a per-layer array with different counts.
        ModelFormatError: missing, or not an integer (array) in range.
    """
    full = f"{arch}.expert_count"
    counts = get(full)
    if not isinstance(counts, (list, tuple)):
        return key("expert_count")
    if not counts or not all(isinstance(c, int) and not isinstance(c, bool) and 0 < c <= _LIMITS["expert_count"]
                             for c in counts):
        raise ModelFormatError(f"{source}: key {full} should be a positive integer or an array of them, got {counts!r}")
    if len(set(counts)) > 1:
        raise UnsupportedModelError(
            f"{source}: key {full} gives per-layer expert counts {sorted(set(counts))}; only one expert count "
            "for every layer is supported (prune every layer to the same count)")
    return int(counts[0])


def _check(hp: Qwen35HParams, source: str) -> None:
    """Cross-field rules; raises ModelFormatError naming the keys involved."""
    a = hp.arch
    rules = [
        (hp.n_embd > 0, "embedding_length must be > 0"),
        (hp.n_head > 0 and hp.n_head_kv > 0 and hp.n_head % hp.n_head_kv == 0,
         "attention.head_count must be a positive multiple of attention.head_count_kv"),
        (hp.head_dim > 0 and hp.head_dim % 2 == 0, "attention.key_length must be even and > 0"),
        (0 < hp.rope_dims <= hp.head_dim and hp.rope_dims % 2 == 0,
         "rope.dimension_count must be even and <= attention.key_length"),
        (hp.num_k_heads > 0 and hp.num_v_heads % hp.num_k_heads == 0,
         "ssm.time_step_rank must be a multiple of ssm.group_count"),
        (hp.head_k_dim > 0 and hp.head_v_dim > 0, "ssm.state_size and ssm.inner_size must be > 0"),
        (hp.conv_kernel >= 1, "ssm.conv_kernel must be >= 1"),
        (hp.full_attention_interval >= 1, "full_attention_interval must be >= 1"),
        (hp.rms_eps > 0, "attention.layer_norm_rms_epsilon must be > 0"),
        (hp.rope_theta > 0, "rope.freq_base must be > 0"),
    ]
    if hp.is_moe:
        rules += [
            (hp.n_expert > 0 and 0 < hp.n_expert_used <= hp.n_expert,
             "expert_used_count must be in 1..expert_count"),
            (hp.n_ff_exp > 0, "expert_feed_forward_length must be > 0"),
        ]
    else:
        rules.append((hp.n_ff > 0, "feed_forward_length must be > 0"))
    for ok, what in rules:
        if not ok:
            raise ModelFormatError(f"{source}: {a} hyper-parameters are inconsistent: {what}")
