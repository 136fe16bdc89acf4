"""Closed-form model FLOPs (docs/references.md §4.1) and exact parameter counts from a :class:`ModelSpec`.

FLOPs follow Megatron-LM ``num_floating_point_operations`` (megatron/training/training.py, the MLA and GQA
branches), per token, forward + backward (3× a GEMM's forward: forward, dX, dW), causal attention (half the score
matrix), SwiGLU (3 matrices), logits ``6·h·V``. Not counted, as in Megatron: router, norms, softmax, rotary,
elementwise, recompute, communication. :func:`flops_per_token` is the model-FLOPs count behind MFU (no MTP, as
DeepSeek-V3's 249.8 GFLOP/token at seq 4096 and its 38.94 % MFU); :func:`flops_per_token_with_mtp` adds the MTP
modules (work the hardware does, for HFU).

Parameter counts mirror :mod:`moeplan.models` exactly (tests compare them with the built model's ``numel``):
``total`` and ``activated`` exclude MTP; ``activated`` is every non-routed-expert parameter (the embedding AND the
output matrix included) plus ``top_k`` routed experts per MoE layer. docs/references.md §1.1 quotes Pangu Ultra MoE at 39.2B
activated "counting one vocab matrix"; this module counts both (≈40.4B) — :attr:`ParamCounts.output` is the
difference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moeplan.errors import SpecError

if TYPE_CHECKING:  # moeplan.spec counts parameters with this module; it is imported here for annotations only
    from moeplan.spec import ModelSpec

SWIGLU_MATRICES = 3


# ---- parameters ----------------------------------------------------------------------------------------------------
def attention_params(spec: ModelSpec) -> int:
    """Parameters of one attention block (projections and, for MLA, the q/kv latent norms)."""
    h, n = spec.hidden_size, spec.num_heads
    if spec.attention == "gqa":
        d = spec.head_dim
        return h * n * d + 2 * h * spec.num_kv_heads * d + n * d * h
    q_lora, kv_lora = spec.q_lora_rank, spec.kv_lora_rank
    q = q_lora * (h + 1 + n * spec.qk_head_dim) if q_lora else h * n * spec.qk_head_dim
    kv = h * (kv_lora + spec.qk_rope_head_dim) + kv_lora + kv_lora * n * (spec.qk_nope_head_dim + spec.v_head_dim)
    return q + kv + n * spec.v_head_dim * h


def _layer_norm_params(spec: ModelSpec) -> int:
    return spec.hidden_size * (4 if spec.sandwich_norm else 2)


def routed_expert_params(spec: ModelSpec) -> int:
    """One routed expert: a SwiGLU of width ``moe_ffn_size``."""
    return SWIGLU_MATRICES * spec.hidden_size * spec.moe_ffn_size


def dense_layer_params(spec: ModelSpec) -> int:
    """One dense decoder layer: norms, attention, SwiGLU of width ``dense_ffn_size``."""
    return _layer_norm_params(spec) + attention_params(spec) + SWIGLU_MATRICES * spec.hidden_size * spec.dense_ffn_size


def moe_layer_params(spec: ModelSpec, *, activated: bool = False) -> int:
    """One MoE decoder layer: norms, attention, router, shared experts and all (or, ``activated``, top_k) routed
    experts."""
    h = spec.hidden_size
    routed = (spec.top_k if activated else spec.num_experts) * routed_expert_params(spec)
    return (_layer_norm_params(spec) + attention_params(spec) + spec.num_experts * h
            + SWIGLU_MATRICES * h * spec.shared_ffn_size + routed)


def mtp_module_params(spec: ModelSpec, *, activated: bool = False) -> int:
    """One MTP module without its embedding / output-layer copies: 3 norms (hidden, embedding, final), the
    ``2h → h`` projection and an MoE decoder layer (DeepSeek-V3 §2.2)."""
    h = spec.hidden_size
    return 3 * h + 2 * h * h + moe_layer_params(spec, activated=activated)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts (elements). ``total``/``activated`` exclude MTP; ``mtp`` is the MTP modules' own
    parameters; ``mtp_copies`` the embedding and output-layer copies MTP holds (DeepSeek-V3's 685B = total + mtp +
    mtp_copies, approximately). ``output`` is 0 with tied embeddings."""

    total: int
    activated: int
    mtp: int
    mtp_activated: int
    mtp_copies: int
    embedding: int
    output: int


def count_params(spec: ModelSpec) -> ParamCounts:
    """Exact parameter counts of the model :mod:`moeplan.models` builds for ``spec``."""
    h, vocab = spec.hidden_size, spec.vocab_size
    embedding = vocab * h
    output = 0 if spec.tie_embeddings else vocab * h
    outer = embedding + output + h  # + final norm
    dense = spec.num_dense_layers * dense_layer_params(spec)
    moe_layers = spec.num_moe_layers
    return ParamCounts(
        total=outer + dense + moe_layers * moe_layer_params(spec),
        activated=outer + dense + moe_layers * moe_layer_params(spec, activated=True),
        mtp=spec.num_mtp_layers * mtp_module_params(spec) if spec.num_mtp_layers else 0,
        mtp_activated=spec.num_mtp_layers * mtp_module_params(spec, activated=True) if spec.num_mtp_layers else 0,
        mtp_copies=spec.num_mtp_layers * 2 * vocab * h, embedding=embedding, output=output)


# ---- FLOPs ---------------------------------------------------------------------------------------------------------
def attention_flops_per_token(spec: ModelSpec, *, seq_len: int) -> float:
    """One attention layer, forward + backward, per token, causal (docs/references.md §4.1; Megatron MLA / GQA terms)."""
    h, n, s = spec.hidden_size, spec.num_heads, seq_len
    if spec.attention == "gqa":
        q, kv = n * spec.head_dim, spec.num_kv_heads * spec.head_dim
        return 12 * h * q + 12 * h * kv + 6 * q * s
    nope, rope, v = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
    q_lora, kv_lora = spec.q_lora_rank, spec.kv_lora_rank
    q_term = q_lora * (h + n * (nope + rope) + 1) if q_lora else h * n * (nope + rope)
    proj = q_term + kv_lora * (h + n * (nope + v) + 1) + h * rope + n * v * h
    core = s * n * (nope + rope) / 2 + s * n * v / 2
    return 6 * (proj + core)


@dataclass(frozen=True)
class FlopBreakdown:
    """Forward + backward FLOPs per token, by part (Megatron-LM terms)."""

    attention: float
    mlp: float
    logits: float
    mtp_extra: float  # MTP norms and 2h→h projections

    @property
    def total(self) -> float:
        return self.attention + self.mlp + self.logits + self.mtp_extra


def flop_breakdown(spec: ModelSpec, *, seq_len: int, include_mtp: bool = False) -> FlopBreakdown:
    """Megatron-LM ``num_floating_point_operations`` / tokens. With ``include_mtp`` each MTP module counts as one
    more layer of the last layer's kind plus its norms, projection and logits (Megatron's MTP terms).
    Raises SpecError when ``seq_len`` is not positive."""
    if seq_len <= 0:
        raise SpecError(f"seq_len={seq_len!r}: must be > 0")
    h = spec.hidden_size
    mtp = spec.num_mtp_layers if include_mtp else 0
    moe = spec.num_moe_layers + (mtp if spec.num_moe_layers else 0)
    dense = spec.num_dense_layers + (0 if spec.num_moe_layers else mtp)
    mlp_width = spec.dense_ffn_size * dense + (spec.moe_ffn_size * spec.top_k + spec.shared_ffn_size) * moe
    return FlopBreakdown(
        attention=(spec.num_layers + mtp) * attention_flops_per_token(spec, seq_len=seq_len),
        mlp=6 * SWIGLU_MATRICES * h * mlp_width,
        logits=6 * h * spec.vocab_size * (mtp + 1),
        mtp_extra=6 * mtp * (3 * h + 2 * h * h))


def flops_per_token(spec: ModelSpec, *, seq_len: int) -> float:
    """Model FLOPs per token (forward + backward, causal, no MTP): the MFU numerator (docs/references.md §4.1)."""
    return flop_breakdown(spec, seq_len=seq_len).total


def flops_per_token_with_mtp(spec: ModelSpec, *, seq_len: int) -> float:
    """FLOPs per token including the MTP modules (Megatron's count with ``--mtp-num-layers``), for HFU."""
    return flop_breakdown(spec, seq_len=seq_len, include_mtp=True).total
