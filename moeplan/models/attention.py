"""Attention blocks: Multi-head Latent Attention (DeepSeek-V2 §2.1, DeepSeek-V3 §2.1) and grouped-query attention.

Both take and return hidden states ``[b, s, h]`` and use rotary position embeddings on positions ``0..s-1``. The
softmax scale is ``qk_head_dim^-0.5`` (MLA: nope + rope width, 192^-0.5 for DeepSeek-V3 / Pangu Ultra MoE,
docs/references.md §1.1, §1.3).
Every class declares ``SHARD``: how each child's work divides over tensor parallelism (read by the tracer;
key ``""`` is the hint for the module's own elementwise ops), following Megatron-LM's MLA/GQA layers: the MLA down
projections and their norms are replicated on every TP rank, everything per-head is split by heads.
"""
from __future__ import annotations

from typing import ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from moeplan.ir import ShardHint
from moeplan.models.layers import RMSNorm, Rotary
from moeplan.spec import ModelSpec


class CoreAttention(nn.Module):
    """Causal softmax attention: ``softmax(q kᵀ · scale + causal mask) v``.

    ``forward(q [b, n, s, dqk], k [b, n_kv, s, dqk], v [b, n_kv, s, dv]) -> [b, n, s, dv]``; ``n`` a multiple of
    ``n_kv`` (grouped-query attention). Runs ``F.scaled_dot_product_attention`` (a fused kernel where the backend
    has one; on meta it decomposes into two batched matmuls, which is how the tracer counts model FLOPs).
    :meth:`fused_kernel` is the memory-efficient kernel whose saved-for-backward set (q, k, v, output, logsumexp)
    the tracer records, as production training keeps; it has a meta implementation but no CPU kernel.
    """

    causal: ClassVar[bool] = True

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def extra_repr(self) -> str:
        return f"scale={self.scale:.6g}, causal={self.causal}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale,
                                              enable_gqa=q.shape[1] != k.shape[1])

    def fused_kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The same attention through ``aten._scaled_dot_product_efficient_attention`` (meta/CUDA only)."""
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, self.causal,
                                                                      scale=self.scale)
        return out[0]


class MLAttention(nn.Module):
    """Multi-head Latent Attention (DeepSeek-V2 §2.1.2–2.1.3; DeepSeek-V3 §2.1.1).

    Queries: ``q_b(norm(q_a(x)))`` when ``q_lora_rank > 0``, else ``q_proj(x)``, split per head into a no-position
    part (``qk_nope_head_dim``) and a RoPE part (``qk_rope_head_dim``). Keys/values: ``kv_a(x)`` gives the latent
    ``c_kv`` (``kv_lora_rank``) and ONE rope key shared by all heads; ``kv_b(norm(c_kv))`` gives per-head nope keys
    and values (``v_head_dim``). ``forward(x [b, s, h]) -> [b, s, h]``.
    """

    SHARD: ClassVar[Mapping[str, ShardHint]] = {
        "": ShardHint.TP, "q_a": ShardHint.REPLICATED, "q_a_norm": ShardHint.REPLICATED, "q_b": ShardHint.TP,
        "q_proj": ShardHint.TP, "kv_a": ShardHint.REPLICATED, "kv_norm": ShardHint.REPLICATED,
        "kv_b": ShardHint.TP, "rope_q": ShardHint.TP, "rope_k": ShardHint.REPLICATED, "core": ShardHint.TP,
        "o_proj": ShardHint.TP}

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, n = spec.hidden_size, spec.num_heads
        self.num_heads, self.nope, self.rope_dim = n, spec.qk_nope_head_dim, spec.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank, self.q_lora_rank = spec.v_head_dim, spec.kv_lora_rank, spec.q_lora_rank
        if spec.q_lora_rank:
            self.q_a = nn.Linear(h, spec.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(spec.q_lora_rank, eps=spec.norm_eps)
            self.q_b = nn.Linear(spec.q_lora_rank, n * spec.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, n * spec.qk_head_dim, bias=False)
        self.kv_a = nn.Linear(h, spec.kv_lora_rank + spec.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(spec.kv_lora_rank, eps=spec.norm_eps)
        self.kv_b = nn.Linear(spec.kv_lora_rank, n * (spec.qk_nope_head_dim + spec.v_head_dim), bias=False)
        self.rope_q = Rotary(spec.qk_rope_head_dim, spec.rope_theta)
        self.rope_k = Rotary(spec.qk_rope_head_dim, spec.rope_theta)
        self.core = CoreAttention(scale=spec.qk_head_dim ** -0.5)
        self.o_proj = nn.Linear(n * spec.v_head_dim, h, bias=False)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, s, h] -> [b, s, n, nope + rope]`` with RoPE applied to the rope part."""
        q = self.q_b(self.q_a_norm(self.q_a(x))) if self.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.unflatten(-1, (self.num_heads, self.nope + self.rope_dim)).split(
            [self.nope, self.rope_dim], dim=-1)
        return torch.cat((q_nope, self.rope_q(q_pe)), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self._queries(x)
        c_kv, k_pe = self.kv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b(self.kv_norm(c_kv)).unflatten(-1, (self.num_heads, self.nope + self.v_dim))
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = self.rope_k(k_pe.unsqueeze(2)).expand(-1, -1, self.num_heads, -1)  # one rope key for all heads
        k = torch.cat((k_nope, k_pe), dim=-1)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # [b, n, s, v]
        return self.o_proj(out.transpose(1, 2).flatten(2))


class GQAttention(nn.Module):
    """Grouped-query attention with RoPE (Ainslie et al., arXiv 2305.13245; Llama-3 / Pangu Pro MoE).

    ``num_heads`` query heads share ``num_kv_heads`` key/value heads of width ``head_dim``.
    ``forward(x [b, s, h]) -> [b, s, h]``.
    """

    SHARD: ClassVar[Mapping[str, ShardHint]] = {"": ShardHint.TP}

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_proj = nn.Linear(h, spec.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * d, bias=False)
        self.rope = Rotary(d, spec.rope_theta)
        self.core = CoreAttention(scale=d ** -0.5)
        self.o_proj = nn.Linear(spec.num_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.rope(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))
        k = self.rope(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # [b, n, s, d]
        return self.o_proj(out.transpose(1, 2).flatten(2))


def build_attention(spec: ModelSpec) -> nn.Module:
    """The attention block ``spec.attention`` names (``mla`` or ``gqa``)."""
    return MLAttention(spec) if spec.attention == "mla" else GQAttention(spec)
