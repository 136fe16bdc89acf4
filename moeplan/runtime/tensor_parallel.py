"""Tensor parallelism with sequence parallelism (Megatron-LM, Korthikanti et al. arXiv 2205.05198 §4.2.2).

Between layers a rank's hidden state is its SP slice ``[b, s/(cp·tp), h]`` (positions: moeplan.runtime.
context_parallel). A TP block all-gathers it over TP to the CP rank's ``[b, s/cp, h]``, runs column-parallel
projections (output features split, heads split for attention), a row-parallel projection (input features split,
partial sums) and reduce-scatters the partial sums back to the SP slice. Norms and residual adds run on the SP slice.

Parameters replicated over TP (norm gains, the MLA down projections and their norms, the router, the MTP
projection) see different tokens or feed different head shards on each TP rank; their modules are marked
:class:`~moeplan.runtime.parallel.TPReplicated` and their gradients summed over TP once per step, after the last
backward (:func:`~moeplan.runtime.parallel.all_reduce_grads`, Megatron-LM ``finalize_model_grads``).

Embedding and output layer are vocab-parallel (rows ``[t·V/tp, (t+1)·V/tp)`` on TP rank t); the cross-entropy is
vocab-parallel (Megatron-LM ``_VocabParallelCrossEntropy``): max, sum of exponentials and the target logit are
combined over TP, so logits are never gathered: one all-gather of per-shard ``[log-sum-exp, target logit]``
per micro-batch instead of Megatron's three all-reduces. Every block keeps the parameter names of its single-process
counterpart in moeplan.models, with the shard each rank holds recorded as a :class:`ParamShard`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeplan.errors import PlanError
from moeplan.models import IGNORE_INDEX, RMSNorm
from moeplan.plan import PlanLayout
from moeplan.runtime.context_parallel import (cp_attention, cp_positions, gathered_key_positions, local_positions,
                                              rotary_at)
from moeplan.runtime.groups import ParallelGroups, RankCoords
from moeplan.runtime.parallel import (CommLog, Link, ParamShard, Sharded, TPReplicated, all_gather, gather_linears,
                                      gather_no_grad, reduce_scatter, split_range, value_all_reduce)
from moeplan.spec import ModelSpec


@dataclass(frozen=True)
class ShardEnv:
    """What a parallel block needs to know about its rank: model, layout, coordinates, groups, expert placement,
    and the optional CommLog its collectives tally bytes in."""

    spec: ModelSpec
    layout: PlanLayout
    coords: RankCoords
    groups: ParallelGroups
    expert_placement: tuple[tuple[int, ...], ...]
    comm_log: CommLog | None = None

    @property
    def tp_link(self) -> Link:
        return Link(self.groups.tp, "tp", self.comm_log)

    @property
    def cp_link(self) -> Link:
        return Link(self.groups.cp, "cp", self.comm_log)

    @property
    def etp_link(self) -> Link:
        """Expert-TP gathers and reduce-scatters: counted as EP traffic, as the shard pass prices them."""
        return Link(self.groups.etp, "ep", self.comm_log)

    @property
    def expert_link(self) -> Link:
        return Link(self.groups.expert, "ep", self.comm_log)

    @property
    def tp_cp_link(self) -> Link:
        """Micro-batch-wide routing statistics (capacity, auxiliary loss): EP traffic."""
        return Link(self.groups.tp_cp, "ep", self.comm_log)

    @property
    def dp_link(self) -> Link:
        """Routing statistics over the DP ranks (the dp-group and global-batch auxiliary losses): EP traffic."""
        return Link(self.groups.dp, "ep", self.comm_log)

    @property
    def tp(self) -> int:
        return self.layout.tp

    def cp_positions(self) -> torch.Tensor:
        """Positions ``[s/cp]`` of this CP rank (the sequence a TP block works on after its all-gather)."""
        return cp_positions(self.layout.seq_len, cp=self.layout.cp, cp_rank=self.coords.cp_rank)

    def positions(self, tp_rank: int | None = None) -> torch.Tensor:
        """Positions ``[s/(cp·tp)]`` of the SP slice of ``tp_rank`` (default: this rank) in this CP rank."""
        return local_positions(self.layout.seq_len, cp=self.layout.cp, cp_rank=self.coords.cp_rank,
                               tp=self.layout.tp, tp_rank=self.coords.tp_rank if tp_rank is None else tp_rank)

    def key_positions(self) -> torch.Tensor:
        return gathered_key_positions(self.layout.seq_len, self.layout.cp)


def _require_divisible(total: int, parts: int, what: str) -> None:
    if total % parts:
        raise PlanError(f"layout.tp={parts}: must divide {what} ({total})")


# ---- building blocks -----------------------------------------------------------------------------------------------
class ColumnLinear(nn.Linear, Sharded):
    """Column-parallel linear: output features ``[t·out/tp, (t+1)·out/tp)`` of the full ``out × in`` weight."""

    def __init__(self, in_features: int, out_features: int, env: ShardEnv) -> None:
        start, size = split_range(out_features, env.tp, env.coords.tp_rank)
        super().__init__(in_features, size, bias=False)
        self.param_shards = {"weight": ParamShard(dim=0, start=start, size=size)}


class RowLinear(nn.Linear, Sharded):
    """Row-parallel linear: input features ``[t·in/tp, (t+1)·in/tp)``; its output is a partial sum over TP."""

    def __init__(self, in_features: int, out_features: int, env: ShardEnv) -> None:
        start, size = split_range(in_features, env.tp, env.coords.tp_rank)
        super().__init__(size, out_features, bias=False)
        self.param_shards = {"weight": ParamShard(dim=1, start=start, size=size)}


class ReplicatedLinear(nn.Linear, TPReplicated):
    """A linear replicated over TP; its gradient is a per-rank partial sum until the step's TP all-reduce."""


class ReplicatedNorm(RMSNorm, TPReplicated):
    """moeplan.models.RMSNorm replicated over TP (sequence-parallel norm); the gain's gradient is summed over TP once
    per step. The model's norm, so it saves for backward what the planner's trace priced (input and ``rstd``)."""


def sp_norm(env: ShardEnv) -> ReplicatedNorm:
    return ReplicatedNorm(env.spec.hidden_size, eps=env.spec.norm_eps)


class ParallelSwiGLU(nn.Module):
    """TP SwiGLU (dense FFN, merged shared experts): ``forward(x [b, s/(cp·tp), h]) -> same``.

    All-gather over TP into ``w1``/``w3`` (column-parallel; :func:`gather_linears`: backward keeps the slice and
    gathers it again), ``w2`` row-parallel, reduce-scatter over TP.
    """

    def __init__(self, hidden: int, ffn: int, env: ShardEnv) -> None:
        super().__init__()
        _require_divisible(ffn, env.tp, "the FFN width")
        self.link = env.tp_link
        self.w1 = ColumnLinear(hidden, ffn, env)
        self.w3 = ColumnLinear(hidden, ffn, env)
        self.w2 = RowLinear(ffn, hidden, env)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1, h3 = gather_linears(x, 1, self.link, self.w1.weight, self.w3.weight)
        return reduce_scatter(self.w2(F.silu(h1) * h3), 1, self.link)


# ---- attention -----------------------------------------------------------------------------------------------------
class ParallelMLA(nn.Module):
    """MLA (DeepSeek-V2 §2.1) with heads split over TP and K/V all-gathered over CP.

    The down projections ``q_a``/``kv_a`` and their norms are replicated (Megatron-LM MLA "duplicated" mode) and run
    on the rank's sequence slice; their outputs (the latents, ``q_lora_rank + kv_lora_rank + qk_rope_head_dim`` wide)
    are all-gathered over TP in one collective (Megatron-LM gathers the compressed q and kv, not the hidden state),
    so backward keeps the slice and the latents instead of the gathered hidden state.
    ``q_b``/``q_proj``/``kv_b`` are column-parallel by heads, ``o_proj`` row-parallel.
    ``forward(x [b, s/(cp·tp), h]) -> [b, s/(cp·tp), h]``.
    """

    def __init__(self, env: ShardEnv) -> None:
        super().__init__()
        spec = env.spec
        h, n = spec.hidden_size, spec.num_heads
        _require_divisible(n, env.tp, "the attention heads")
        self.env, self.heads = env, n // env.tp
        self.nope, self.rope_dim, self.v_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = spec.kv_lora_rank, spec.q_lora_rank
        if spec.q_lora_rank:
            self.q_a = ReplicatedLinear(h, spec.q_lora_rank, bias=False)
            self.q_a_norm = ReplicatedNorm(spec.q_lora_rank, eps=spec.norm_eps)
            self.q_b = ColumnLinear(spec.q_lora_rank, n * spec.qk_head_dim, env)
        else:
            self.q_proj = ColumnLinear(h, n * spec.qk_head_dim, env)
        self.kv_a = ReplicatedLinear(h, spec.kv_lora_rank + spec.qk_rope_head_dim, bias=False)
        self.kv_norm = ReplicatedNorm(spec.kv_lora_rank, eps=spec.norm_eps)
        self.kv_b = ColumnLinear(spec.kv_lora_rank, n * (spec.qk_nope_head_dim + spec.v_head_dim), env)
        self.o_proj = RowLinear(n * spec.v_head_dim, h, env)
        self.scale, self.theta = spec.qk_head_dim ** -0.5, spec.rope_theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        env, pos = self.env, self.env.cp_positions()
        c_kv, k_pe = self.kv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.q_lora_rank:  # down projections and their norms on the SP slice, ONE all-gather of the latents
            latents = all_gather(torch.cat((self.q_a_norm(self.q_a(x)), self.kv_norm(c_kv), k_pe), dim=-1), 1,
                                 env.tp_link)
            c_q, c_kv, k_pe = latents.split([self.q_lora_rank, self.kv_lora_rank, self.rope_dim], dim=-1)
            q = self.q_b(c_q)
        else:
            full = all_gather(torch.cat((x, self.kv_norm(c_kv), k_pe), dim=-1), 1, env.tp_link)
            full, c_kv, k_pe = full.split([x.shape[-1], self.kv_lora_rank, self.rope_dim], dim=-1)
            q = self.q_proj(full)
        q_nope, q_pe = q.unflatten(-1, (self.heads, self.nope + self.rope_dim)).split([self.nope, self.rope_dim], -1)
        q = torch.cat((q_nope, rotary_at(q_pe, pos, dim=self.rope_dim, theta=self.theta)), dim=-1)
        kv = self.kv_b(c_kv).unflatten(-1, (self.heads, self.nope + self.v_dim))
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = rotary_at(k_pe.unsqueeze(2), pos, dim=self.rope_dim, theta=self.theta).expand(-1, -1, self.heads, -1)
        k = torch.cat((k_nope, k_pe), dim=-1)
        out = cp_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions=pos,
                           key_positions=env.key_positions(), scale=self.scale, cp=env.cp_link)
        return reduce_scatter(self.o_proj(out.transpose(1, 2).flatten(2)), 1, env.tp_link)


class ParallelGQA(nn.Module):
    """Grouped-query attention with query heads split over TP and K/V all-gathered over CP.

    K/V heads are split over TP when tp divides them; otherwise (tp a multiple of the KV heads) ``k_proj``/``v_proj``
    are replicated and each rank takes the one KV head its query heads share.
    ``forward(x [b, s/(cp·tp), h]) -> [b, s/(cp·tp), h]``.
    """

    def __init__(self, env: ShardEnv) -> None:
        super().__init__()
        spec, tp = env.spec, env.tp
        h, d, n, n_kv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
        _require_divisible(n, tp, "the attention heads")
        self.env, self.heads, self.head_dim = env, n // tp, d
        self.split_kv = n_kv % tp == 0
        self.kv_heads = n_kv // tp if self.split_kv else 1
        self.kv_index = 0 if self.split_kv else (env.coords.tp_rank * self.heads) // (n // n_kv)
        self.q_proj = ColumnLinear(h, n * d, env)
        if self.split_kv:
            self.k_proj, self.v_proj = ColumnLinear(h, n_kv * d, env), ColumnLinear(h, n_kv * d, env)
        else:
            self.k_proj = ReplicatedLinear(h, n_kv * d, bias=False)
            self.v_proj = ReplicatedLinear(h, n_kv * d, bias=False)
        self.o_proj = RowLinear(n * d, h, env)
        self.scale, self.theta = d ** -0.5, spec.rope_theta

    def _kv(self, proj: nn.Module, full: torch.Tensor) -> torch.Tensor:
        heads = proj(full).unflatten(-1, (-1, self.head_dim))
        return heads if self.split_kv else heads[:, :, self.kv_index:self.kv_index + 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        env = self.env
        full, pos = all_gather(x, 1, env.tp_link), env.cp_positions()
        q = rotary_at(self.q_proj(full).unflatten(-1, (self.heads, self.head_dim)), pos, dim=self.head_dim,
                      theta=self.theta)
        k = rotary_at(self._kv(self.k_proj, full), pos, dim=self.head_dim, theta=self.theta)
        v = self._kv(self.v_proj, full)
        out = cp_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions=pos,
                           key_positions=env.key_positions(), scale=self.scale, cp=env.cp_link)
        return reduce_scatter(self.o_proj(out.transpose(1, 2).flatten(2)), 1, env.tp_link)


def parallel_attention(env: ShardEnv) -> nn.Module:
    return ParallelMLA(env) if env.spec.attention == "mla" else ParallelGQA(env)


# ---- embedding and head --------------------------------------------------------------------------------------------
class _VocabRows(nn.Embedding, Sharded):
    def __init__(self, env: ShardEnv) -> None:
        vocab = env.spec.vocab_size
        _require_divisible(vocab, env.tp, "the vocabulary")
        start, size = split_range(vocab, env.tp, env.coords.tp_rank)
        super().__init__(size, env.spec.hidden_size)
        self.start = start
        self.param_shards = {"weight": ParamShard(dim=0, start=self.start, size=size)}


class ParallelEmbedding(nn.Module):
    """Vocab-parallel embedding: ``forward(tokens [b, s] int64, the whole micro-batch) -> [b, s/(cp·tp), h]``.

    Looks up this CP rank's positions in the rank's vocabulary rows (zero for tokens outside them) and
    reduce-scatters the partial embeddings over TP (Megatron-LM ``VocabParallelEmbedding`` with SP).
    """

    def __init__(self, env: ShardEnv) -> None:
        super().__init__()
        self.env = env
        self.word = _VocabRows(env)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        env = self.env
        mine = tokens.index_select(1, env.cp_positions().to(tokens.device)) - self.word.start
        outside = (mine < 0) | (mine >= self.word.num_embeddings)
        emb = self.word(mine.masked_fill(outside, 0))
        if env.tp > 1:
            emb = emb.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter(emb, 1, env.tp_link)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """See :func:`vocab_parallel_cross_entropy`. Saves only the softmax of the shard (fp32 ``[N, V/tp]``), the
    label's column in it and the rows whose label it holds, as Megatron-LM's ``_VocabParallelCrossEntropy``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, link: Link) -> torch.Tensor:
        shift = logits.max(dim=-1).values
        softmax = (logits - shift.unsqueeze(-1)).exp()
        local = labels - vocab_start
        column = local.clamp(0, logits.shape[-1] - 1)
        hit = (local >= 0) & (local < logits.shape[-1])
        picked = logits.gather(1, column.unsqueeze(-1)).squeeze(-1) * hit
        stats = gather_no_grad(torch.stack((softmax.sum(-1).log() + shift, picked), dim=-1).unsqueeze(0), link)
        lse = stats[..., 0].logsumexp(0)  # [N], the same on every rank
        softmax.mul_((shift - lse).exp().unsqueeze(-1))  # exp(z − shift) · exp(shift − lse) = exp(z − lse)
        valid = labels != IGNORE_INDEX
        ctx.save_for_backward(softmax, column, hit & valid, valid)
        return (lse - stats[..., 1].sum(0)) * valid

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, column, hit, valid = ctx.saved_tensors
        g = grad * valid
        dlogits = softmax * g.unsqueeze(-1)  # out of place: an I+W split runs this backward twice
        dlogits.scatter_add_(1, column.unsqueeze(-1), (-g * hit).unsqueeze(-1))
        return dlogits, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, vocab_start: int,
                                 link: Link) -> torch.Tensor:
    """Per-token cross-entropy ``[N]`` (0 where ``labels == IGNORE_INDEX``) from vocab-sharded fp32
    ``logits [N, V/tp]``; ``labels [N]`` global vocabulary ids.

    ``log Σ_v exp(z_v) − z_label`` (Megatron-LM ``_VocabParallelCrossEntropy``) with ONE collective: each TP rank
    stacks its shard's ``m_r + log Σ_{v∈r} exp(z_v − m_r)`` (``m_r`` the shard max) and its label logit (0 when the
    label is elsewhere), the stats are all-gathered over TP and every rank forms ``logsumexp_r(·) − Σ_r z_label,r``,
    the same value everywhere. Backward needs no collective: the gradient of the shard's logits is
    ``softmax − onehot(label)`` times the incoming gradient, from the softmax saved in forward.
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, vocab_start, link)


class ParallelHead(nn.Module):
    """Final norm, vocab-parallel output layer and loss: ``forward(hidden [b, s/(cp·tp), h], labels [b, s]) -> loss``.

    ``labels`` is the whole micro-batch's; ``depth`` shifts them left as moeplan.models.Head does. The returned
    scalar's VALUE is the micro-batch mean loss over all its tokens (equal on every rank of the tp×cp group); its
    BACKWARD gives this rank's share: the gradient of ``(Σ over this CP rank's tokens) / (valid tokens of the
    micro-batch)``. Gradients of parameters replicated over CP and DP are therefore partial sums: the optimizer must
    SUM them over dp_cp (dense) or expert_dp (experts) and divide by dp.
    """

    def __init__(self, env: ShardEnv, *, depth: int = 0) -> None:
        super().__init__()
        self.env, self.depth = env, depth
        self.norm = sp_norm(env)
        self.output = ColumnLinear(env.spec.hidden_size, env.spec.vocab_size, env)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        env = self.env
        if self.depth:
            pad = torch.full_like(labels[:, :self.depth], IGNORE_INDEX)
            labels = torch.cat((labels[:, self.depth:], pad), dim=1)
        mine = labels.index_select(1, env.cp_positions().to(labels.device))
        logits = gather_linears(self.norm(hidden), 1, env.tp_link, self.output.weight)[0].float()
        start = self.output.param_shards["weight"].start
        per_token = vocab_parallel_cross_entropy(logits.flatten(0, 1), mine.flatten(), vocab_start=start,
                                                 link=env.tp_link)
        local = per_token.sum() / (labels != IGNORE_INDEX).sum()
        total = value_all_reduce(local.detach(), env.cp_link)
        return local + (total - local).detach()
