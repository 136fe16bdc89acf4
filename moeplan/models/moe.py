"""Feed-forward blocks: the SwiGLU FFN and the Mixture-of-Experts block (router, dispatch, experts, combine).

The MoE block follows DeepSeekMoE (DeepSeek-V3 §2.1.2): a router picks ``top_k`` of ``num_experts`` routed experts
per token, the routed outputs are summed weighted by the gates, and the shared experts (merged into one SwiGLU of
width ``shared_ffn_size``) see every token. Routing modes: ``topk`` (plain), ``group_limited`` (DeepSeek-V3
node-limited routing: keep the ``topk_groups`` groups whose top-2 scores sum highest) and ``moge`` (Pangu Pro MoE
§3.1, arXiv 2505.21411: a global softmax, then top-``top_k/num_expert_groups`` inside every group).

The data-dependent part sits in three leaf modules of the tracer: :class:`TokenPermute` (dispatch),
:class:`GroupedExperts` (the grouped matmul, with a static balanced path on the meta device because ``nonzero`` and
``tolist`` do not work there) and :class:`TokenUnpermute` (combine). Routed experts are stacked tensors
``[num_experts, ...]`` so a 256-expert layer builds on meta at once and a rank can hold a slice of experts.
"""
from __future__ import annotations

import math
from typing import ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from moeplan.ir import ShardHint
from moeplan.models.layers import SwiGLU
from moeplan.spec import ModelSpec


# ---- routing -------------------------------------------------------------------------------------------------------
def group_limited_experts(scores: torch.Tensor, *, top_k: int, num_groups: int, topk_groups: int) -> torch.Tensor:
    """DeepSeek-V3 node-limited routing (§2.1.2, ``noaux_tc`` without the bias): ``scores [T, E] -> idx [T, top_k]``.

    A group's score is the sum of its two highest expert scores; experts outside the ``topk_groups`` best groups
    are masked before the top-k.
    """
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(min(2, experts // num_groups), dim=-1).values.sum(-1)  # [T, G]
    best = group_scores.topk(topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)
    return masked.topk(top_k, dim=-1).indices


def moge_experts(scores: torch.Tensor, *, top_k: int, num_groups: int) -> torch.Tensor:
    """Mixture of Grouped Experts (Pangu Pro MoE §3.1): ``scores [T, E] -> idx [T, top_k]``, exactly
    ``top_k / num_groups`` experts from each of the ``num_groups`` equal groups (so every device gets the same load).
    """
    tokens, experts = scores.shape
    per_group, k_group = experts // num_groups, top_k // num_groups
    local = scores.view(tokens, num_groups, per_group).topk(k_group, dim=-1).indices  # [T, G, k']
    offsets = torch.arange(num_groups, device=scores.device) * per_group
    return (local + offsets[None, :, None]).reshape(tokens, top_k)


def load_balance_loss(scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Switch-style auxiliary loss ``E · Σ_e f_e · P_e`` (Fedus et al., arXiv 2101.03961 eq. 4; Megatron-LM
    ``switch_load_balancing_loss_func``): ``f_e`` the share of the ``T·k`` routed slots sent to expert e (no
    gradient), ``P_e`` the mean normalised score of e. 1.0 under perfectly uniform routing. ``scores [T, E]``.
    """
    experts = scores.shape[1]
    probs = scores / scores.sum(-1, keepdim=True)
    flat = idx.flatten()
    share = torch.zeros(experts, device=scores.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float))
    return experts * (share / flat.numel() * probs.mean(0)).sum()


class AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also feeds gradient ``coeff`` into ``aux`` (Megatron MoEAuxLossAutoScaler):
    the auxiliary loss trains the router without travelling through the pipeline as a second output."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, coeff: float) -> torch.Tensor:
        ctx.coeff = coeff
        ctx.save_for_backward(aux)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.coeff), None


class Router(nn.Module):
    """Scores, expert choice and gates. ``forward(x [T, h]) -> (idx [T, top_k] int64, gates [T, top_k])``.

    Scores are ``sigmoid`` or ``softmax`` of ``gate(x)`` in fp32; gates are the chosen scores, renormalised to sum
    1 when ``norm_topk_prob``, times ``router_scale``. With ``aux_loss_coeff > 0`` the load-balance loss of the
    forward's tokens is attached to the gates' backward with gradient ``aux_loss_coeff · aux_loss_scale``.
    ``aux_loss_scale`` is the weight the caller gives this forward's loss in the loss it back-propagates:
    ``1/n`` when it accumulates ``n`` micro-batch losses as ``Σ loss/n``, so the auxiliary loss is, like the LM loss,
    the mean over micro-batches of per-micro-batch losses (Megatron-LM ``MoEAuxLossAutoScaler.set_loss_scale``,
    called with ``1/num_microbatches`` by ``pipeline_parallel/schedules.py`` ``forward_step``). A leaf of the tracer
    (topk and masks are cheap; the gate matmul is counted).
    """

    def __init__(self, spec: ModelSpec, *, aux_loss_coeff: float = 0.0, aux_loss_scale: float = 1.0) -> None:
        super().__init__()
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.score, self.routing, self.top_k = spec.router, spec.routing, spec.top_k
        self.num_groups, self.topk_groups = spec.num_expert_groups, spec.topk_groups
        self.scale, self.norm_topk_prob, self.aux_loss_coeff = spec.router_scale, spec.norm_topk_prob, aux_loss_coeff
        self.aux_loss_scale = aux_loss_scale

    def extra_repr(self) -> str:
        return f"score={self.score}, routing={self.routing}, top_k={self.top_k}, groups={self.num_groups}"

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores [T, E] -> idx [T, top_k]`` under the configured routing mode."""
        if self.routing == "moge":
            return moge_experts(scores, top_k=self.top_k, num_groups=self.num_groups)
        if self.routing == "group_limited":
            return group_limited_experts(scores, top_k=self.top_k, num_groups=self.num_groups,
                                         topk_groups=self.topk_groups)
        return scores.topk(self.top_k, dim=-1).indices

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, h] -> (scores [T, E], idx [T, top_k], gates [T, top_k])``, fp32, before any auxiliary loss."""
        logits = self.gate(x).float()
        scores = logits.sigmoid() if self.score == "sigmoid" else logits.softmax(dim=-1)
        idx = self.select(scores)
        gates = scores.gather(1, idx)
        if self.norm_topk_prob:
            gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
        return scores, idx, gates * self.scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores, idx, gates = self.route(x)
        if self.aux_loss_coeff > 0 and gates.requires_grad:
            aux = load_balance_loss(scores, idx)
            gates = AttachAuxLoss.apply(gates, aux, self.aux_loss_coeff * self.aux_loss_scale)
        return idx, gates.to(x.dtype)


# ---- dispatch, experts, combine ------------------------------------------------------------------------------------
def expert_capacity(*, num_slots: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert under drop-and-pad: ``ceil(capacity_factor · T·top_k / E)`` (GShard §2.2; Megatron-LM
    ``moe_expert_capacity_factor``). ``num_slots`` is ``T·top_k``."""
    return math.ceil(capacity_factor * num_slots / num_experts)


class TokenPermute(nn.Module):
    """Dispatch: ``forward(x [T, h], idx [T, k]) -> (rows [R, h], tokens_per_expert [E] int64,
    row_of_slot [T·k] int64)``.

    Dropless (``capacity_factor None``): ``R = T·k`` rows sorted by expert (stable, so token order within an
    expert). Drop-and-pad: ``R = E·C`` rows, ``C`` from :func:`expert_capacity`; each expert keeps its first C
    slots in token order (Megatron's "position" drop policy), the rest are dropped; unused rows are zero;
    ``tokens_per_expert`` counts the kept slots. ``row_of_slot[t·k + j]`` is the row holding slot j of token t, or
    ``R`` when it was dropped. Gathers only (``index_select``), so backward keeps indices, not activations; static
    output shapes, so it runs on meta.
    """

    def __init__(self, *, num_experts: int, capacity_factor: float | None) -> None:
        super().__init__()
        self.num_experts, self.capacity_factor = num_experts, capacity_factor

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, capacity_factor={self.capacity_factor}"

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_slots, k = idx.numel(), idx.shape[1]
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)  # row r of the sorted list holds slot order[r]
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        if self.capacity_factor is None:
            row_of_slot = torch.empty_like(order).scatter_(0, order, torch.arange(num_slots, device=x.device))
            return x.index_select(0, order // k), counts, row_of_slot
        cap = expert_capacity(num_slots=num_slots, num_experts=self.num_experts,
                              capacity_factor=self.capacity_factor)
        expert_of_row = flat.index_select(0, order)
        rank = torch.arange(num_slots, device=x.device) - (counts.cumsum(0) - counts).index_select(0, expert_of_row)
        num_rows = self.num_experts * cap
        dest = torch.where(rank < cap, expert_of_row * cap + rank, num_rows)  # buffer row, or num_rows: dropped
        slot_of_row = torch.full((num_rows + 1,), num_slots, dtype=torch.long, device=x.device).scatter(
            0, dest, order)[:num_rows]
        x_ext = torch.cat((x, x.new_zeros(1, x.shape[1])))  # row T is zero: padding
        row_of_slot = torch.empty_like(order).scatter_(0, order, dest)
        return x_ext.index_select(0, slot_of_row // k), counts.clamp(max=cap), row_of_slot


class FusedSwiGLU(torch.autograd.Function):
    """``silu(gate) · up`` of ``gate_up [..., 2f] -> [..., f]`` that keeps only its input for backward, as the
    fused kernels of production runtimes do (Megatron-LM ``bias_swiglu_impl`` / ``weighted_bias_swiglu_impl``,
    megatron/core/fusions/fused_bias_swiglu.py): what the planner counts for them (moeplan/trace.py). moeplan's
    own runtime runs the eager form, which keeps ``silu(gate)`` too."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        return torch.cat((grad * up * sig * (1 + gate * (1 - sig)), grad * gate * sig), dim=-1)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as stacked weights ``w1, w3 [E, h, f]``, ``w2 [E, f, h]``.

    ``forward(rows [R, h], tokens_per_expert [E]) -> [R, h]``, rows grouped by expert. ``equal_split`` (drop-and-pad)
    or the meta device: ``bmm`` over ``[E, R/E, h]`` (on meta this is balanced routing, ``T·k/E`` tokens per
    expert, which is how the tracer counts FLOPs; ``tolist`` and data-dependent splits do not work on meta).
    Otherwise one matmul per expert over its rows.
    ``first_expert`` is the global index of expert 0 here (a rank holding a slice); weight init seeds use it.
    """

    def __init__(self, *, num_experts: int, hidden: int, ffn: int, equal_split: bool, first_expert: int = 0) -> None:
        super().__init__()
        self.num_experts, self.equal_split, self.first_expert = num_experts, equal_split, first_expert
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn, hidden))

    def extra_repr(self) -> str:
        e, h, f = self.w1.shape
        return f"num_experts={e}, hidden={h}, ffn={f}, equal_split={self.equal_split}, first={self.first_expert}"

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if self.equal_split or rows.is_meta:
            return self._batched(rows)
        parts = rows.split(tokens_per_expert.tolist())
        return torch.cat([self._expert(e, part) for e, part in enumerate(parts)])

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.w1[e]) * (x @ self.w3[e])) @ self.w2[e]

    def fused_kernel(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The balanced path with the SwiGLU fused (:class:`FusedSwiGLU`): what a production grouped-GEMM MLP
        keeps for backward — its input rows, the gate/up output and the activation output (Megatron-LM
        ``TEGroupedMLP``) — for the tracer to measure (meta only)."""
        return self._batched(rows, fused=True)

    def _batched(self, rows: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """Balanced split: ``R // E`` rows per expert in one bmm, the ``R mod E`` remaining rows one each to the
        first experts (a second, small bmm), so exactly R rows of work are done."""
        num, hidden = rows.shape
        base, extra = divmod(num, self.num_experts)
        parts = []
        if base:
            parts.append(self._bmm(rows[:base * self.num_experts].view(self.num_experts, base, hidden),
                                   self.num_experts, fused))
        if extra:
            parts.append(self._bmm(rows[base * self.num_experts:].view(extra, 1, hidden), extra, fused))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _bmm(self, x: torch.Tensor, experts: int, fused: bool = False) -> torch.Tensor:
        """``x [e, n, h]`` through the first ``e`` experts -> ``[e·n, h]``."""
        w1, w3, w2 = self.w1[:experts], self.w3[:experts], self.w2[:experts]
        if fused:
            act = FusedSwiGLU.apply(torch.cat((torch.bmm(x, w1), torch.bmm(x, w3)), dim=-1))
        else:
            act = F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3)
        return torch.bmm(act, w2).flatten(0, 1)


class TokenUnpermute(nn.Module):
    """Combine: ``forward(y [R, h], row_of_slot [T·k], gates [T, k]) -> [T, h]``,
    ``out[t] = Σ_j gates[t, j] · y[row_of_slot[t·k + j]]``; a dropped slot (row ``R``) contributes zero."""

    def forward(self, y: torch.Tensor, row_of_slot: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        tokens, k = gates.shape
        y_ext = torch.cat((y, y.new_zeros(1, y.shape[1])))
        slots = y_ext.index_select(0, row_of_slot).view(tokens, k, y.shape[1])
        return (slots * gates.unsqueeze(-1)).sum(1)


class MoE(nn.Module):
    """The MoE FFN block. ``forward(x [b, s, h]) -> [b, s, h]``: routed experts (dropless or drop-and-pad) plus the
    merged shared experts. Parameters: ``router.gate.weight [E, h]``, ``experts.w1/w3 [E, h, f]``,
    ``experts.w2 [E, f, h]``, ``shared.w1/w3/w2`` (when ``num_shared_experts > 0``).
    """

    SHARD: ClassVar[Mapping[str, ShardHint]] = {
        "": ShardHint.SP, "router": ShardHint.SP, "dispatch": ShardHint.EXPERT, "experts": ShardHint.EXPERT,
        "combine": ShardHint.EXPERT, "shared": ShardHint.TP}

    def __init__(self, spec: ModelSpec, *, aux_loss_coeff: float = 0.0) -> None:
        super().__init__()
        self.hidden = spec.hidden_size
        self.router = Router(spec, aux_loss_coeff=aux_loss_coeff)
        self.dispatch = TokenPermute(num_experts=spec.num_experts, capacity_factor=spec.capacity_factor)
        self.experts = GroupedExperts(num_experts=spec.num_experts, hidden=spec.hidden_size, ffn=spec.moe_ffn_size,
                                      equal_split=spec.capacity_factor is not None)
        self.combine = TokenUnpermute()
        self.shared = SwiGLU(spec.hidden_size, spec.shared_ffn_size) if spec.num_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.hidden)
        idx, gates = self.router(flat)
        rows, tokens_per_expert, row_of_slot = self.dispatch(flat, idx)
        y = self.combine(self.experts(rows, tokens_per_expert), row_of_slot, gates)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.view_as(x)
