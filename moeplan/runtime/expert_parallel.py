"""Expert parallelism: the MoE block with routed experts spread over the expert group (Megatron-LM
``MoEAlltoAllTokenDispatcher``; DeepSeek-V3 §3.2; MindSpeed ``--moe-tp-extend-ep``).

Per forward, on a rank whose hidden state is its SP slice ``[b, s/(cp·tp), h]``:

1. **Tokens.** With expert-TP (``etp > 1``) the slice is all-gathered over the etp group, so the etp peers hold the
   same tokens; otherwise (``etp = 1``: plain EP or TP-extend-EP) the rank routes its own SP slice — under SP the
   TP ranks already hold different tokens, so the TP group extends the expert group without a gather.
2. **Routing** of the rank's own SP slice with the model family's :class:`moeplan.models.Router` (same scores,
   ``select`` — top-k, group-limited, MoGE — and gates), the gate weight's gradient summed over TP once per step;
   under expert-TP the chosen experts and gates are then all-gathered over etp with the tokens (Megatron-LM routes
   before its dispatcher gathers over TP), so the router keeps only the slice for backward. Drop-and-pad
   (``capacity_factor``) keeps, per expert, the first ``C`` slots of the WHOLE micro-batch in token order exactly
   as moeplan.models.TokenPermute: the chosen experts of all tp×cp ranks are all-gathered to decide it. The
   auxiliary load-balance loss uses micro-batch-wide expert shares (all-reduced), so its gradient is exact too.
3. **Dispatch** (``plan.comm.dispatcher``, docs/step-model.md §3). ``flat``: kept slots are sorted by
   (destination rank, local expert); the ``[ranks, local experts]`` counts are exchanged by ``all_to_all_single``
   first, then the token rows go by ``all_to_all_single`` with uneven splits. ``hierarchical`` (MindSpeed
   ``--moe-hierarchical-alltoallv``) all-gathers the tokens and their routing over the rank's peers on the other
   nodes first, then runs the flat exchange inside the node for that node's experts. ``dedup`` (DeepEP normal
   kernels) sends each token once per node holding one of its experts and forwards it once per target rank there.
4. **Experts.** The rank's experts (``plan.experts.shards[expert_rank]``) as one :class:`LocalExperts`; under
   expert-TP each expert's FFN width is split over etp (``w1``/``w3`` columns, ``w2`` rows: partial sums).
5. **Combine.** The reverse exchange (hierarchical: then a reduce-scatter over the nodes; dedup: summing at
   each hop), the gate-weighted sum per token (moeplan.models.TokenUnpermute, so
   backward keeps the returned rows once, as the model does), then (expert-TP) reduce-scatter over etp
   back to the SP slice. The merged shared experts are a TP SwiGLU on the same input.

Under expert-TP the dispatch carries the etp-gathered tokens, so each token crosses the expert group once per etp
rank (Megatron-LM instead all-to-alls first and gathers over etp after): same results, even-sized collectives.
"""
from __future__ import annotations

import torch
from torch import nn

from moeplan.errors import PlanError
from moeplan.models import GroupedExperts, Router, TokenUnpermute, expert_capacity
from moeplan.models.moe import AttachAuxLoss
from moeplan.runtime.context_parallel import local_positions
from moeplan.names import Dispatcher
from moeplan.runtime.groups import expert_node_ranks, group_ranks
from moeplan.runtime.parallel import (Link, ParamShard, Sharded, TPReplicated, all_gather, all_to_all,
                                      exchange_counts, gather_no_grad, reduce_scatter, split_range)
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
    (:class:`TPReplicated`: its gradient is summed over TP once per step).

    ``forward(x [T, h] this rank's tokens, num_tokens: tokens in the micro-batch) -> (idx [T, k], gates [T, k])``.
    """

    def __init__(self, spec: ModelSpec, env: ShardEnv, *, aux_loss_coeff: float) -> None:
        super().__init__(spec, aux_loss_coeff=aux_loss_coeff)
        self.env = env

    def forward(self, x: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        scores, idx, gates = self.route(x)
        if self.aux_loss_coeff > 0 and gates.requires_grad:
            aux = self._aux_share(scores, idx, num_tokens)
            gates = AttachAuxLoss.apply(gates, aux, self.aux_loss_coeff)
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
    another name or an expert group that is not split evenly over several nodes.

    Parameters: ``router.gate.weight`` (replicated), ``experts.w1/w3/w2`` (this rank's experts and etp part),
    ``shared.w1/w3/w2`` (TP-sharded), named as in moeplan.models.MoE.
    """

    def __init__(self, env: ShardEnv, *, aux_loss_coeff: float = 0.0, dispatcher: Dispatcher = "flat",
                 devices_per_node: int = 1) -> None:
        super().__init__()
        spec, lay, coords = env.spec, env.layout, env.coords
        self.env, self.hidden = env, spec.hidden_size
        self.router = ParallelRouter(spec, env, aux_loss_coeff=aux_loss_coeff)
        mine = env.expert_placement[coords.expert_rank]
        self.experts = LocalExperts(spec, experts=mine, etp=lay.etp, etp_rank=coords.etp_rank)
        self.combine = TokenUnpermute()
        self.shared = ParallelSwiGLU(spec.hidden_size, spec.shared_ffn_size, env) if spec.num_shared_experts else None
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

    def _token_rows(self, batch: int, device: torch.device) -> torch.Tensor:
        """Flat micro-batch index ``b·s + position`` of each row of the etp-gathered tokens."""
        env, lay = self.env, self.env.layout
        base = env.coords.tp_rank - env.coords.etp_rank
        pos = torch.cat([env.positions(base + r) for r in range(lay.etp)]).to(device)
        return (torch.arange(batch, device=device)[:, None] * lay.seq_len + pos[None, :]).flatten()

    def _keep(self, own_idx: torch.Tensor, rows: torch.Tensor, batch: int) -> torch.Tensor:
        """Drop-and-pad decision for ``rows`` from the chosen experts ``own_idx`` of every rank of the micro-batch."""
        env, lay = self.env, self.env.layout
        every = gather_no_grad(own_idx, env.tp_cp_link)  # tp_cp order: tp innermost, then cp
        where = torch.cat([
            (torch.arange(batch)[:, None] * lay.seq_len + local_positions(
                lay.seq_len, cp=lay.cp, cp_rank=c, tp=lay.tp, tp_rank=t)[None, :]).flatten()
            for c in range(lay.cp) for t in range(lay.tp)]).to(own_idx.device)
        whole = torch.empty((batch * lay.seq_len, own_idx.shape[1]), dtype=own_idx.dtype, device=own_idx.device)
        whole[where] = every
        keep = capacity_keep(whole, num_experts=env.spec.num_experts, capacity_factor=env.spec.capacity_factor)
        return keep.index_select(0, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        env, batch = self.env, x.shape[0]
        own = x.reshape(-1, self.hidden)
        own_idx, own_gates = self.router(own, batch * env.layout.seq_len)
        k = own_idx.shape[1]
        # expert-TP: the etp group's tokens and their routing (gates and expert ids in one message; ids are exact in
        # floating point), gathered along the sequence (dim 1)
        flat = all_gather(x, 1, env.etp_link).reshape(-1, self.hidden)
        routing = torch.cat((own_gates, own_idx.to(own_gates.dtype)), dim=-1).view(batch, -1, 2 * k)
        gates, idx = all_gather(routing, 1, env.etp_link).reshape(-1, 2 * k).split(k, dim=-1)
        idx = idx.long()
        rows = self._token_rows(batch, x.device)
        keep = None if env.spec.capacity_factor is None else self._keep(own_idx, rows, batch)
        if self.dispatcher == "hierarchical":
            routed = self._hierarchical(flat, idx, gates, keep)
        elif self.dispatcher == "dedup":
            routed = self._dedup(flat, idx, gates, keep)
        else:
            routed = self._routed(flat, idx, gates, keep)
        routed = routed.view(batch, -1, self.hidden)
        out = reduce_scatter(routed, 1, env.etp_link)
        if self.shared is not None:
            out = out + self.shared(x)
        return out

    def _hierarchical(self, flat: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor,
                      keep: torch.Tensor | None) -> torch.Tensor:
        """MindSpeed's hierarchical all-to-all-v: all-gather the tokens with their routing (gate, expert id and
        keep flag per copy: ``12·k`` bytes in fp32, docs/step-model.md §3) over the rank's peers on the other
        nodes, all-to-all-v of the copies routed to this node's experts inside the node, then the combine: the
        reverse all-to-all-v and a reduce-scatter (sum) over the nodes. ``[T, h]``, as :meth:`_routed`."""
        k = idx.shape[1]
        kept = torch.ones_like(gates) if keep is None else keep.to(gates.dtype)
        every = all_gather(torch.cat((flat, gates, idx.to(gates.dtype), kept), dim=-1), 0, self.inter_link)
        tokens, gates, idx, kept = every.split((self.hidden, k, k, k), dim=-1)
        out = self._routed(tokens, idx.long(), gates, kept > 0)
        return reduce_scatter(out, 0, self.inter_link)

    def _dedup(self, flat: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor,
               keep: torch.Tensor | None) -> torch.Tensor:
        """DeepEP-style deduplicating dispatch: each token (with its gates, expert ids and keep flags, ``12·k``
        bytes in fp32) goes once to each node holding one of its kept experts, to the rank at this rank's place
        there (all-to-all-v over the inter-node group), that rank forwards it once to each rank of its node that
        computes one of them (all-to-all-v inside the node), which combines its own experts' outputs into one
        gate-weighted row; the combine sends those rows back the same two ways, summing at each hop. ``[T, h]``."""
        k = idx.shape[1]
        kept = torch.ones_like(gates, dtype=torch.bool) if keep is None else keep
        rows = torch.cat((flat, gates, idx.to(gates.dtype), kept.to(gates.dtype)), dim=-1)
        at_node, node_rows = self._send_once(rows, idx, kept, self.node_of, self.inter_link)
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
                   link: Link) -> tuple[torch.Tensor, tuple]:
        """Send row ``m`` once to each rank ``where[e]`` of ``link`` for its kept experts ``e``; (received rows,
        the bookkeeping :meth:`_return` needs)."""
        dest = torch.tensor(where, device=rows.device).index_select(0, idx.flatten()).view_as(idx)
        hit = torch.zeros((rows.shape[0], link.size), dtype=torch.bool, device=rows.device)
        hit[torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(idx)[keep], dest[keep]] = True
        to, row = hit.t().nonzero(as_tuple=True)  # ordered by destination, then row
        send_counts = torch.bincount(to, minlength=link.size).view(-1, 1)
        send, recv = send_counts.flatten().tolist(), exchange_counts(send_counts, link).flatten().tolist()
        return all_to_all(rows.index_select(0, row), send, recv, link), (row, send, recv)

    @staticmethod
    def _return(y: torch.Tensor, sent: tuple, num_rows: int, link: Link) -> torch.Tensor:
        """The combine hop of :meth:`_send_once`: send ``y`` back and sum the rows per original row."""
        row, send, recv = sent
        back = all_to_all(y, recv, send, link)
        return back.new_zeros((num_rows, back.shape[1])).index_add(0, row, back)

    def _routed(self, flat: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor,
                keep: torch.Tensor | None) -> torch.Tensor:
        """Dispatch over ``self.link``, local experts, combine: ``[T, h]`` (a partial sum over etp under expert-TP,
        over the nodes under the hierarchical dispatcher, whose copies for other nodes' experts stay behind)."""
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
        received = all_to_all(flat.index_select(0, slots // k), send, recv, link)
        local_expert = torch.arange(per, device=flat.device).repeat(ranks).repeat_interleave(recv_counts.flatten())
        by_expert = torch.argsort(local_expert, stable=True)
        tokens_per_expert = torch.bincount(local_expert, minlength=per)[:self.experts.num_experts]
        computed = self.experts(received.index_select(0, by_expert), tokens_per_expert)
        back = all_to_all(computed.index_select(0, torch.argsort(by_expert)), recv, send, link)
        row_of_slot = torch.full((idx.numel(),), back.shape[0], dtype=slots.dtype, device=flat.device)
        row_of_slot[slots] = torch.arange(slots.numel(), device=flat.device)
        return self.combine(back, row_of_slot, gates)
