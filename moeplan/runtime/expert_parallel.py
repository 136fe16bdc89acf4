"""Expert parallelism: the MoE block with routed experts spread over the expert group (Megatron-LM
``MoEAlltoAllTokenDispatcher``; DeepSeek-V3 §3.2; MindSpeed ``--moe-tp-extend-ep``).

Per forward, on a rank whose hidden state is its SP slice ``[b, s/(cp·tp), h]`` (every step works on the rank's
own tokens; under SP the TP ranks hold different tokens):

1. **Routing** of the rank's own tokens with the model family's :class:`moeplan.models.Router` (same scores,
   ``select`` — top-k, group-limited, MoGE — and gates), the gate weight's gradient summed over TP once per step.
   Drop-and-pad (``capacity_factor``) keeps, per expert, the first ``C`` slots of the WHOLE micro-batch in token
   order exactly as moeplan.models.TokenPermute: the chosen experts of all tp×cp ranks are all-gathered to decide
   it. The auxiliary load-balance loss uses micro-batch-wide expert shares (all-reduced), so its gradient is exact
   too, and it is scaled like the LM loss (:class:`ParallelRouter`).
2. **Dispatch** (``plan.comm.dispatcher``, docs/step-model.md §3). ``flat``: kept slots are sorted by
   (destination rank, local expert); the ``[ranks, local experts]`` counts are exchanged by ``all_to_all_single``
   first, then the token rows go by ``all_to_all_single`` with uneven splits. ``hierarchical`` (MindSpeed
   ``--moe-hierarchical-alltoallv``) all-gathers the tokens and their routing over the rank's peers on the other
   nodes first, then runs the flat exchange inside the node for that node's experts. ``dedup`` (DeepEP normal
   kernels) sends each token once per node holding one of its experts and forwards it once per target rank there.
3. **Shared experts beside the dispatch** (``shared-expert`` in ``plan.comm.overlap``): the token all-to-all (the
   first one of ``dedup``) is posted asynchronously, the merged shared experts (a TP SwiGLU on the block's input)
   run, and the rows are waited for just before the experts use them (Megatron-LM
   ``--moe-shared-expert-overlap``). Without it the shared experts run after the combine. Same numbers either way.
4. **Experts.** The rank's experts (``plan.experts.shards[expert_rank]``) as one :class:`LocalExperts`. Under
   expert-TP (``etp > 1``) each expert's FFN width is split over etp (``w1``/``w3`` columns, ``w2`` rows), and, as
   in Megatron-LM, the rows the all-to-all delivered are all-gathered over etp AFTER it (uneven sizes), so the etp
   peers compute their FFN parts of the same rows; a reduce-scatter over etp sums the parts back to the rows each
   rank received. Each token thus crosses the expert group once, whatever etp is.
5. **Combine.** The reverse exchange (hierarchical: then a reduce-scatter over the nodes; dedup: summing at
   each hop), then the gate-weighted sum per token (moeplan.models.TokenUnpermute, so backward keeps the returned
   rows once, as the model does), plus the shared experts' output.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from moeplan.errors import PlanError
from moeplan.models import GroupedExperts, Router, TokenUnpermute, expert_capacity
from moeplan.models.moe import AttachAuxLoss
from moeplan.runtime.context_parallel import local_positions
from moeplan.names import Dispatcher
from moeplan.runtime.groups import expert_node_ranks, group_ranks
from moeplan.runtime.parallel import (Link, ParamShard, Sharded, TPReplicated, all_gather, all_gather_v, all_to_all,
                                      all_to_all_async, exchange_counts, gather_no_grad, reduce_scatter,
                                      reduce_scatter_v, split_range)
from moeplan.runtime.tensor_parallel import ParallelSwiGLU, ShardEnv
from moeplan.spec import ModelSpec


class LocalExperts(GroupedExperts, Sharded):
    """This rank's routed experts (global indices ``experts``), FFN width split ``etp`` ways (part ``etp_rank``).

    Parameter names and forward are :class:`moeplan.models.GroupedExperts`'s (one matmul per expert).
    """

    def __init__(self, spec: ModelSpec, *, experts: tuple[int, ...], etp: int, etp_rank: int) -> None:
        if spec.moe_ffn_size % etp:
            raise PlanError(f"layout.etp={etp}: must divide moe_ffn_size ({spec.moe_ffn_size})")
        start, size = split_range(spec.moe_ffn_size, etp, etp_rank)
        super().__init__(num_experts=len(experts), hidden=spec.hidden_size, ffn=size, equal_split=False,
                         first_expert=experts[0])
        self.param_shards = {"w1": ParamShard(dim=2, start=start, size=size, experts=experts),
                             "w3": ParamShard(dim=2, start=start, size=size, experts=experts),
                             "w2": ParamShard(dim=1, start=start, size=size, experts=experts)}


class ParallelRouter(Router, TPReplicated):
    """moeplan.models.Router with a micro-batch-wide auxiliary loss; the gate is replicated over TP
    (:class:`TPReplicated`: its gradient is summed over TP once per step). With ``aux_loss_scale = 1/m`` for the
    ``m`` micro-batches a DP rank accumulates, the optimizer's SUM over dp_cp and ``1/dp`` make the gate's
    auxiliary gradient ``aux_loss_coeff`` times the mean over the step's ``dp·m`` micro-batches of each micro-batch's
    loss gradient, scaled exactly like the LM loss (Megatron-LM pipeline_parallel/schedules.py ``forward_step``:
    ``MoEAuxLossAutoScaler.set_loss_scale(cp/num_microbatches)``, then its mean over dp·cp; here CP shares are
    summed, so no ``cp`` factor).

    ``forward(x [T, h] this rank's tokens, num_tokens: tokens in the micro-batch) -> (idx [T, k], gates [T, k])``.

    ``force_balanced`` (``moeplan run --force-balanced-routing``, a benchmarking switch that changes training):
    the gate's logits are replaced by standard-normal ones from the default generator, so each token's experts are
    a uniform random choice (top-k: a uniform k-subset), the balanced routing the plan prices; the gradient passes
    straight through to the gate (Megatron-LM ``--moe-router-force-load-balancing``: ``apply_random_logits`` /
    ``RandomSTE`` in megatron/core/transformer/moe/moe_utils.py, called from router.py).
    """

    force_balanced: bool = False

    class RandomLogits(torch.autograd.Function):
        """Forward: standard-normal logits of the same shape; backward: the gradient unchanged."""

        @staticmethod
        def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
            return torch.randn_like(logits)

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            return grad

    def __init__(self, spec: ModelSpec, env: ShardEnv, *, aux_loss_coeff: float, aux_loss_scale: float = 1.0) -> None:
        super().__init__(spec, aux_loss_coeff=aux_loss_coeff, aux_loss_scale=aux_loss_scale)
        self.env = env
        self.gate.register_forward_hook(
            lambda gate, args, logits: self.RandomLogits.apply(logits) if self.force_balanced else None)

    def forward(self, x: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        scores, idx, gates = self.route(x)
        if self.aux_loss_coeff > 0 and gates.requires_grad:
            aux = self._aux_share(scores, idx, num_tokens)
            gates = AttachAuxLoss.apply(gates, aux, self.aux_loss_coeff * self.aux_loss_scale)
        return idx, gates.to(x.dtype)

    def _aux_share(self, scores: torch.Tensor, idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """This rank's share of moeplan.models.load_balance_loss over the micro-batch: ``E Σ_e f_e · P_e``, with
        ``f_e`` the micro-batch-wide slot share (all-reduced, no gradient) and ``P_e`` summed over own tokens."""
        experts = scores.shape[1]
        counts = torch.zeros(experts, device=scores.device).scatter_add_(
            0, idx.flatten(), torch.ones(idx.numel(), device=scores.device))
        counts = gather_no_grad(counts.unsqueeze(0), self.env.tp_cp_link).sum(0)
        probs = scores / scores.sum(-1, keepdim=True)
        return experts * (counts / (num_tokens * idx.shape[1]) * probs.sum(0) / num_tokens).sum()


def capacity_keep(idx: torch.Tensor, *, num_experts: int, capacity_factor: float) -> torch.Tensor:
    """``idx [T, k]`` of a whole micro-batch in token order -> ``keep [T, k]`` bool: each expert keeps its first
    ``expert_capacity`` slots in slot order ``t·k + j`` (moeplan.models.TokenPermute's drop-and-pad rule)."""
    flat = idx.flatten()
    cap = expert_capacity(num_slots=flat.numel(), num_experts=num_experts, capacity_factor=capacity_factor)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    expert_of_row = flat.index_select(0, order)
    rank = torch.arange(flat.numel(), device=idx.device) - (counts.cumsum(0) - counts).index_select(0, expert_of_row)
    keep = torch.empty_like(flat, dtype=torch.bool)
    keep[order] = rank < cap
    return keep.view_as(idx)


class ParallelMoE(nn.Module):
    """The MoE FFN over the expert group (see the module docstring): ``forward(x [b, s/(cp·tp), h]) -> same``.

    ``dispatcher``: flat, hierarchical or dedup; the last two need ``env.groups.expert_inter`` / ``expert_intra``
    (moeplan.runtime.groups.make_node_groups for nodes of ``devices_per_node`` ranks). Raises PlanError for
    another name or an expert group that is not split evenly over several nodes. ``aux_loss_coeff`` /
    ``aux_loss_scale``: :class:`ParallelRouter`'s. ``overlap_shared`` (``shared-expert`` in ``plan.comm.overlap``):
    the shared experts run while the token all-to-all is in flight (module docstring, step 3).

    Parameters: ``router.gate.weight`` (replicated), ``experts.w1/w3/w2`` (this rank's experts and etp part),
    ``shared.w1/w3/w2`` (TP-sharded), named as in moeplan.models.MoE.
    """

    def __init__(self, env: ShardEnv, *, aux_loss_coeff: float = 0.0, aux_loss_scale: float = 1.0,
                 dispatcher: Dispatcher = "flat", devices_per_node: int = 1, overlap_shared: bool = False) -> None:
        super().__init__()
        spec, lay, coords = env.spec, env.layout, env.coords
        self.env, self.hidden = env, spec.hidden_size
        self.router = ParallelRouter(spec, env, aux_loss_coeff=aux_loss_coeff, aux_loss_scale=aux_loss_scale)
        mine = env.expert_placement[coords.expert_rank]
        self.experts = LocalExperts(spec, experts=mine, etp=lay.etp, etp_rank=coords.etp_rank)
        self.combine = TokenUnpermute()
        self.shared = ParallelSwiGLU(spec.hidden_size, spec.shared_ffn_size, env) if spec.num_shared_experts else None
        self.overlap_shared = overlap_shared and self.shared is not None
        self.dispatcher = dispatcher
        self.slots_per_rank = max(len(s) for s in env.expert_placement)
        owner, local = [0] * spec.num_experts, [0] * spec.num_experts
        for r, shard in enumerate(env.expert_placement):
            for i, e in enumerate(shard):
                owner[e], local[e] = r, i
        self.local_index = tuple(local)
        self.link = env.expert_link
        self.owner = tuple(owner)  # expert -> rank of self.link that computes it (-1: not reached from here)
        if dispatcher in ("hierarchical", "dedup"):
            members = next(m for m in group_ranks(env.layout).expert if coords.rank in m)
            intra = expert_node_ranks(env.layout, devices_per_node, min_per_node=1 if dispatcher == "dedup" else 2)[1]
            node = next(m for m in intra if coords.rank in m)
            nodes = sorted({r // devices_per_node for r in members})
            self.inter_link = Link(env.groups.expert_inter, "ep", env.comm_log)
            self.intra_link = Link(env.groups.expert_intra, "ep", env.comm_log)
            self.node_of = tuple(nodes.index(members[r] // devices_per_node) for r in owner)  # inter-group rank
            self.node_rank_of = tuple(sorted(m for m in members if m // devices_per_node == members[r]
                                             // devices_per_node).index(members[r]) for r in owner)  # intra rank
            # hierarchical: the intra-node all-to-all reaches this node's experts only; dedup: this rank's only
            self.owner = tuple(node.index(members[r]) if members[r] in node else -1 for r in owner)
            self.my_node = nodes.index(coords.rank // devices_per_node)
            if dispatcher == "hierarchical":
                self.link = self.intra_link
            else:
                self.link = Link(None, "ep", env.comm_log)
                self.owner = tuple(0 if r == coords.expert_rank else -1 for r in owner)
        elif dispatcher != "flat":
            raise PlanError(f"comm.dispatcher={dispatcher!r}: must be one of flat, hierarchical, dedup")

    def _keep(self, own_idx: torch.Tensor, batch: int) -> torch.Tensor:
        """Drop-and-pad decision for this rank's tokens from the chosen experts ``own_idx`` of every rank of the
        micro-batch."""
        env, lay = self.env, self.env.layout
        every = gather_no_grad(own_idx, env.tp_cp_link)  # tp_cp order: tp innermost, then cp
        where = torch.cat([
            (torch.arange(batch)[:, None] * lay.seq_len + local_positions(
                lay.seq_len, cp=lay.cp, cp_rank=c, tp=lay.tp, tp_rank=t)[None, :]).flatten()
            for c in range(lay.cp) for t in range(lay.tp)]).to(own_idx.device)
        whole = torch.empty((batch * lay.seq_len, own_idx.shape[1]), dtype=own_idx.dtype, device=own_idx.device)
        whole[where] = every
        keep = capacity_keep(whole, num_experts=env.spec.num_experts, capacity_factor=env.spec.capacity_factor)
        rows = (torch.arange(batch)[:, None] * lay.seq_len + env.positions()[None, :]).flatten()
        return keep.index_select(0, rows.to(own_idx.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        env, batch = self.env, x.shape[0]
        own = x.reshape(-1, self.hidden)
        idx, gates = self.router(own, batch * env.layout.seq_len)
        keep = None if env.spec.capacity_factor is None else self._keep(idx, batch)
        shared: list[torch.Tensor] = []
        beside = (lambda: shared.append(self.shared(x))) if self.overlap_shared else None
        if self.dispatcher == "hierarchical":
            routed = self._hierarchical(own, idx, gates, keep, beside)
        elif self.dispatcher == "dedup":
            routed = self._dedup(own, idx, gates, keep, beside)
        else:
            routed = self._routed(own, idx, gates, keep, beside)
        out = routed.view_as(x)
        if self.shared is not None:
            out = out + (shared[0] if beside else self.shared(x))
        return out

    def _hierarchical(self, flat: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, keep: torch.Tensor | None,
                      beside: Callable[[], None] | None) -> torch.Tensor:
        """MindSpeed's hierarchical all-to-all-v: all-gather the tokens with their routing (gate, expert id and
        keep flag per copy: ``12·k`` bytes in fp32, docs/step-model.md §3) over the rank's peers on the other
        nodes, all-to-all-v of the copies routed to this node's experts inside the node, then the combine: the
        reverse all-to-all-v and a reduce-scatter (sum) over the nodes. ``[T, h]``, as :meth:`_routed`."""
        k = idx.shape[1]
        kept = torch.ones_like(gates) if keep is None else keep.to(gates.dtype)
        every = all_gather(torch.cat((flat, gates, idx.to(gates.dtype), kept), dim=-1), 0, self.inter_link)
        tokens, gates, idx, kept = every.split((self.hidden, k, k, k), dim=-1)
        out = self._routed(tokens, idx.long(), gates, kept > 0, beside)
        return reduce_scatter(out, 0, self.inter_link)

    def _dedup(self, flat: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, keep: torch.Tensor | None,
               beside: Callable[[], None] | None) -> torch.Tensor:
        """DeepEP-style deduplicating dispatch: each token (with its gates, expert ids and keep flags, ``12·k``
        bytes in fp32) goes once to each node holding one of its kept experts, to the rank at this rank's place
        there (all-to-all-v over the inter-node group), that rank forwards it once to each rank of its node that
        computes one of them (all-to-all-v inside the node), which combines its own experts' outputs into one
        gate-weighted row; the combine sends those rows back the same two ways, summing at each hop. ``[T, h]``."""
        k = idx.shape[1]
        kept = torch.ones_like(gates, dtype=torch.bool) if keep is None else keep
        rows = torch.cat((flat, gates, idx.to(gates.dtype), kept.to(gates.dtype)), dim=-1)
        at_node, node_rows = self._send_once(rows, idx, kept, self.node_of, self.inter_link, beside)
        _, idx1, kept1 = at_node.split((self.hidden + k, k, k), dim=-1)
        idx1 = idx1.long()
        here = (kept1 > 0) & (torch.tensor(self.node_of, device=idx1.device).index_select(0, idx1.flatten())
                              .view_as(idx1) == self.my_node)
        at_rank, rank_rows = self._send_once(at_node, idx1, here, self.node_rank_of, self.intra_link)
        tokens, gates2, idx2, kept2 = at_rank.split((self.hidden, k, k, k), dim=-1)
        out = self._routed(tokens, idx2.long(), gates2, kept2 > 0)
        out = self._return(out, rank_rows, at_node.shape[0], self.intra_link)
        return self._return(out, node_rows, flat.shape[0], self.inter_link)

    def _send_once(self, rows: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor, where: tuple[int, ...],
                   link: Link, beside: Callable[[], None] | None = None) -> tuple[torch.Tensor, tuple]:
        """Send row ``m`` once to each rank ``where[e]`` of ``link`` for its kept experts ``e``; (received rows,
        the bookkeeping :meth:`_return` needs)."""
        dest = torch.tensor(where, device=rows.device).index_select(0, idx.flatten()).view_as(idx)
        hit = torch.zeros((rows.shape[0], link.size), dtype=torch.bool, device=rows.device)
        hit[torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(idx)[keep], dest[keep]] = True
        to, row = hit.t().nonzero(as_tuple=True)  # ordered by destination, then row
        send_counts = torch.bincount(to, minlength=link.size).view(-1, 1)
        send, recv = send_counts.flatten().tolist(), exchange_counts(send_counts, link).flatten().tolist()
        return _exchange(rows.index_select(0, row), send, recv, link, beside), (row, send, recv)

    @staticmethod
    def _return(y: torch.Tensor, sent: tuple, num_rows: int, link: Link) -> torch.Tensor:
        """The combine hop of :meth:`_send_once`: send ``y`` back and sum the rows per original row."""
        row, send, recv = sent
        back = all_to_all(y, recv, send, link)
        return back.new_zeros((num_rows, back.shape[1])).index_add(0, row, back)

    def _routed(self, flat: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, keep: torch.Tensor | None,
                beside: Callable[[], None] | None = None) -> torch.Tensor:
        """Dispatch over ``self.link``, local experts (:meth:`_experts`), combine: ``[T, h]`` (a partial sum over
        the nodes under the hierarchical dispatcher, whose copies for other nodes' experts stay behind)."""
        link, k, per = self.link, idx.shape[1], self.slots_per_rank
        ranks = link.size
        owner = torch.tensor(self.owner, device=flat.device)
        slots = torch.arange(idx.numel(), device=flat.device)
        here = owner.index_select(0, idx.flatten()) >= 0
        if keep is not None:
            here &= keep.flatten()
        slots = slots[here]
        experts = idx.flatten().index_select(0, slots)
        key = (owner.index_select(0, experts) * per
               + torch.tensor(self.local_index, device=flat.device).index_select(0, experts))
        order = torch.argsort(key, stable=True)
        slots, key = slots.index_select(0, order), key.index_select(0, order)
        send_counts = torch.bincount(key, minlength=ranks * per).view(ranks, per)
        recv_counts = exchange_counts(send_counts, link)
        send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        received = _exchange(flat.index_select(0, slots // k), send, recv, link, beside)
        back = all_to_all(self._experts(received, recv_counts), recv, send, link)
        row_of_slot = torch.full((idx.numel(),), back.shape[0], dtype=slots.dtype, device=flat.device)
        row_of_slot[slots] = torch.arange(slots.numel(), device=flat.device)
        return self.combine(back, row_of_slot, gates)

    def _experts(self, received: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the rows the dispatch delivered (``recv_counts [ranks, per]``: rows from each rank
        of the link for each local expert, in that order) -> their outputs, same rows. Under expert-TP the rows of
        the etp peers (same experts, other FFN parts) are all-gathered first and each rank's rows come back summed
        over the FFN parts by a reduce-scatter (Megatron-LM ``MoEAlltoAllTokenDispatcher.dispatch_postprocess`` /
        ``combine_preprocess``, uneven over its tp group)."""
        etp, per = self.env.etp_link, self.slots_per_rank
        counts = gather_no_grad(recv_counts.reshape(1, -1), etp)  # [etp, ranks·per]
        sizes = counts.sum(1).tolist()
        rows = all_gather_v(received, sizes, etp)
        local_expert = torch.arange(per, device=rows.device).repeat(counts.numel() // per).repeat_interleave(
            counts.flatten())
        by_expert = torch.argsort(local_expert, stable=True)
        tokens_per_expert = torch.bincount(local_expert, minlength=per)[:self.experts.num_experts]
        computed = self.experts(rows.index_select(0, by_expert), tokens_per_expert)
        return reduce_scatter_v(computed.index_select(0, torch.argsort(by_expert)), sizes, etp)


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], link: Link,
              beside: Callable[[], None] | None) -> torch.Tensor:
    """:func:`all_to_all` of ``x``; with ``beside``, the exchange is posted asynchronously, ``beside()`` runs while
    it is in flight, and the rows are waited for after it, as the experts need them next."""
    if beside is None:
        return all_to_all(x, send, recv, link)
    wait = all_to_all_async(x, send, recv, link)
    beside()
    return wait()
