"""Context parallelism: which sequence positions a rank holds, RoPE at those positions, attention over CP.

Sequence layout (load-balanced, Megatron-LM ``get_batch_on_this_cp_rank``): the sequence of ``s`` positions is cut
into ``2·cp`` equal chunks and CP rank ``r`` holds chunks ``r`` and ``2·cp − 1 − r``, so every rank gets the same
share of causal-attention work. With sequence parallelism on top, the rank's ``s/cp`` positions are cut into ``tp``
contiguous pieces and TP rank ``t`` holds piece ``t``: a rank's hidden state is ``[b, s/(cp·tp), h]``.

Attention (all-gather variant, Megatron-LM ``--cp-comm-type all_gather``): each CP rank computes queries, keys and
values of its own ``s/cp`` positions, all-gathers K and V over the CP group in one collective (backward: one
reduce-scatter of their gradients) and attends with a causal mask built from the global positions of queries and keys.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeplan.runtime.parallel import Link, all_gather


def cp_positions(seq_len: int, *, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions ``[s/cp]`` int64 of CP rank ``cp_rank``: chunks ``cp_rank`` and ``2·cp − 1 − cp_rank``."""
    if cp == 1:
        return torch.arange(seq_len)
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return torch.cat((first, second))


def local_positions(seq_len: int, *, cp: int, cp_rank: int, tp: int, tp_rank: int) -> torch.Tensor:
    """Global positions ``[s/(cp·tp)]`` of the hidden state held by (cp_rank, tp_rank) under SP."""
    pos = cp_positions(seq_len, cp=cp, cp_rank=cp_rank)
    size = pos.numel() // tp
    return pos[tp_rank * size:(tp_rank + 1) * size]


def rotary_at(x: torch.Tensor, positions: torch.Tensor, *, dim: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of ``x [b, s, n, dim]`` at global ``positions [s]`` (RoFormer arXiv 2104.09864 §3.4).

    The same fp32 tables as moeplan.models.attention.Rotary, whose positions are ``0..s-1``.
    """
    half = dim // 2
    exponent = torch.arange(half, device=x.device, dtype=torch.float32) * (2.0 / dim)
    inv_freq = theta ** -exponent
    angles = torch.outer(positions.to(device=x.device, dtype=torch.float32), inv_freq)  # [s, d/2]
    cos = angles.cos().repeat(1, 2)[:, None, :].to(x.dtype)
    sin = angles.sin().repeat(1, 2)[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, positions: torch.Tensor, key_positions:
                 torch.Tensor, scale: float, cp: Link) -> torch.Tensor:
    """Causal attention of this rank's queries over the keys of the whole sequence.

    ``q [b, n, sq, dqk]``, ``k [b, n_kv, sq, dqk]``, ``v [b, n_kv, sq, dv]`` for this CP rank's ``sq = s/cp``
    positions ``positions [sq]``; ``key_positions [s]`` are the positions of the CP-gathered keys (every CP rank's
    :func:`cp_positions` in group-rank order). Returns ``[b, n, sq, dv]``. Without CP: plain causal SDPA.
    """
    gqa = q.shape[1] != k.shape[1]
    if cp.size == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    kv = all_gather(torch.cat((k, v), dim=-1), 2, cp)  # one collective for K and V
    # separate storages, so what attention saves of V does not keep the gathered K alive
    k_all, v_all = (t.contiguous() for t in kv.split([k.shape[-1], v.shape[-1]], dim=-1))
    mask = key_positions.to(q.device)[None, :] <= positions.to(q.device)[:, None]  # [sq, s], True = attend
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=gqa)


def gathered_key_positions(seq_len: int, cp: int) -> torch.Tensor:
    """Positions ``[s]`` of keys all-gathered over CP: ``cp_positions`` of CP ranks 0..cp-1 concatenated."""
    return torch.cat([cp_positions(seq_len, cp=cp, cp_rank=r) for r in range(cp)])
