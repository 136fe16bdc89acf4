"""Expert parallelism: the MoE block with routed experts spread over the expert group (Megatron-LM
``MoEAlltoAllTokenDispatcher``; DeepSeek-V3 §3.2; MindSpeed ``--moe-tp-extend-ep``).

Per forward, on a rank whose hidden state is its SP slice ``[b, s/(cp·tp), h]`` (every step works on the rank's
own tokens; under SP the TP ranks hold different tokens):

1. **Routing** of the rank's own tokens with the model family's :class:`moeplan.models.Router` (same scores,
   ``select`` — top-k, group-limited, MoGE — and gates), the gate weight's gradient summed over TP once per step.
   Drop-and-pad (``capacity_factor``) keeps, per expert, the first ``C`` slots of the WHOLE micro-batch in token
   order exactly as moeplan.models.TokenPermute: the chosen experts of all tp×cp ranks are all-gathered to decide
   it. The auxiliary load-balance loss takes its expert shares over the tokens of its scope (a sequence, the
   micro-batch, the expert group, the DP group, the step: all-reduced), so its gradient is exact too, and it is
   scaled like the LM loss (:class:`ParallelRouter`). Each MoE block counts the (token, expert) copies its rank's
   own tokens route to each expert (``ParallelMoE.take_counts``, read by :func:`take_expert_counts`).
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
4. **Experts.** The rank's experts (``plan.experts.shards[expert_rank]``; each layer's own placement once
   ``--rebalance-every`` moved experts, :meth:`ParallelMoE.set_placement`) as one :class:`LocalExperts`. Under
   expert-TP (``etp > 1``) each expert's FFN width is split over etp (``w1``/``w3`` columns, ``w2`` rows), and, as
   in Megatron-LM, the rows the all-to-all delivered are all-gathered over etp AFTER it (uneven sizes), so the etp
   peers compute their FFN parts of the same rows; a reduce-scatter over etp sums the parts back to the rows each
   rank received. Each token thus crosses the expert group once, whatever etp is.
5. **Combine.** The reverse exchange (hierarchical: then a reduce-scatter over the nodes; dedup: summing at
   each hop), then the gate-weighted sum per token (moeplan.models.TokenUnpermute, so backward keeps the returned
   rows once, as the model does), plus the shared experts' output.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import replace
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from moeplan.errors import PlanError
from moeplan.models import GroupedExperts, Router, TokenUnpermute, expert_capacity
from moeplan.models.moe import AttachAuxLoss
from moeplan.runtime.context_parallel import local_positions
from moeplan.names import Dispatcher
from moeplan.runtime.groups import expert_node_ranks, group_ranks
from moeplan.runtime.request import AUX_LOSS_SCOPES, AuxLossScope
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

    def hold(self, experts: tuple[int, ...]) -> None:
        """Record that local slot ``i`` now holds logical expert ``experts[i]`` (after a migration, or a resume from
        a checkpoint written after one): the ParamShards name them; the weights are not touched."""
        self.param_shards = {k: replace(v, experts=experts) for k, v in self.param_shards.items()}


class ParallelRouter(Router, TPReplicated):
    """moeplan.models.Router with an auxiliary load-balance loss over the tokens of ``aux_loss_scope``; the gate is
    replicated over TP (:class:`TPReplicated`: its gradient is summed over TP once per step).

    ``forward(x [T, h] this rank's tokens, num_tokens: tokens in the micro-batch) -> (idx [T, k], gates [T, k])``.

    **Auxiliary loss** (``aux_loss_coeff > 0``). A scope splits the step's tokens into units ``u`` (below). With
    ``c[u, e]`` the (token, expert) copies the tokens of ``u`` route to expert ``e`` (after top-k, before any drop),
    ``T_u`` its tokens, ``k`` = top_k, ``E`` the experts and ``p[t, e]`` token t's scores normalised to sum 1::

        f[u, e] = c[u, e] / (k · T_u)   (no gradient)      P[u, e] = Σ_{t∈u} p[t, e] / T_u
        L_u = E · Σ_e f[u, e] · P[u, e]                   (1.0 under uniform routing)

    (Switch Transformer, Fedus et al. arXiv 2101.03961 eq. 4; Megatron-LM
    ``moe_utils.switch_load_balancing_loss_func``). This rank attaches, per micro-batch, its share
    ``E · Σ_{own t} Σ_e f[u(t), e] · p[t, e] / T_mb`` (``T_mb = num_tokens``) to the gates' backward, with gradient
    ``aux_loss_coeff · aux_loss_scale``. A unit's slices on its ranks sum to ``(T_u / T_mb) · L_u``; with
    ``aux_loss_scale = 1/m`` for the ``m`` micro-batches a DP rank accumulates, the optimizer's SUM over dp_cp and
    ``1/dp`` take ``1/(dp·m)`` of the sum over a stage's ranks and micro-batches, so the gate gets ``aux_loss_coeff``
    times the gradient of the MEAN of ``L_u`` over the step's units, at every scope, scaled exactly like the LM loss
    (Megatron-LM pipeline_parallel/schedules.py ``forward_step``: ``MoEAuxLossAutoScaler.set_loss_scale(
    cp/num_microbatches)``, then its mean over dp·cp; here CP shares are summed, so no ``cp`` factor). The counts
    are all-gathered (no gradient) over the scope's ranks and summed in rank order, so every rank of a unit uses the
    same ``f``; ``P`` keeps its gradient from this rank's own tokens only, so the gradient is exact. Scopes (with
    Megatron-LM's ``--moe-router-load-balancing-type`` where it has one: megatron/core/transformer/moe/router.py at
    commit d98e8a6):

    - ``sequence``: ``u`` = one sequence of the micro-batch (``T_u`` = seq_len); its counts summed over tp×cp, whose
      ranks hold parts of every sequence under SP/CP. DeepSeek-V3's complementary sequence-wise balance loss (arXiv
      2412.19437 §2.1.2 eqs. 17–20, ``α`` = the coefficient); Megatron-LM ``seq_aux_loss`` (``_apply_seq_aux_loss``:
      the per-sequence Switch loss, ÷ batch size).
    - ``micro-batch`` (the default): ``u`` = the micro-batch; counts summed over tp×cp. Megatron-LM ``aux_loss``
      (``_apply_aux_loss``, reduced over ``tp_cp_group``).
    - ``ep-group``: ``u`` = the tokens of this rank's expert group (``groups.expert``, ``ep·tp/etp`` ranks: the
      tokens its dispatch all-to-all exchanges) in one micro-batch, ``T_u`` = its ranks' own tokens; counts summed
      over that group. The EP-group load-balancing loss named by Pangu Ultra MoE (arXiv 2505.04519; its formula
      was not checked here: this is the Switch loss over that token set): balance where the all-to-all and the
      devices' work are, looser than per micro-batch when the group spans DP ranks. Megatron-LM has no such type.
    - ``dp-group``: ``u`` = micro-batch i of every DP rank (``T_u = dp · T_mb``); counts summed over tp×cp, then
      over DP (``groups.dp``). Qwen's global-batch balance (Qiu et al. arXiv 2501.11873: ``f`` synchronised over the
      data-parallel group), per micro-batch.
    - ``global-batch``: Megatron-LM ``global_aux_loss`` (``_apply_global_aux_loss``): micro-batch i's ``f`` is taken
      from the counts summed over tp×cp and DP of the step's micro-batches 0..i (a running mean; :func:`start_step`
      resets it, as Megatron-LM's ``reset_model_temporary_tensors`` does after each step), ``f = Σ c / (k · (i+1) ·
      dp · T_mb)``. The whole step's counts cannot be used: under 1F1B a micro-batch's backward runs before later
      micro-batches' forwards. Megatron-LM normalises ``P`` by the tp·dp·cp tokens, which makes its gradient 1/dp of
      this one at the same coefficient. Not with recompute (:func:`check_aux_loss`): a recomputed forward would add
      its counts again and see a later running mean than the forward whose gradient it serves.

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

    def __init__(self, spec: ModelSpec, env: ShardEnv, *, aux_loss_coeff: float, aux_loss_scale: float = 1.0,
                 aux_loss_scope: AuxLossScope = "micro-batch") -> None:
        super().__init__(spec, aux_loss_coeff=aux_loss_coeff, aux_loss_scale=aux_loss_scale)
        if aux_loss_scope not in AUX_LOSS_SCOPES:
            raise PlanError(f"aux_loss_scope={aux_loss_scope!r}: must be one of {', '.join(AUX_LOSS_SCOPES)}")
        self.env, self.aux_loss_scope = env, aux_loss_scope
        self.step_counts: torch.Tensor | None = None  # global-batch: [E] counts of the step so far, over tp·dp·cp
        self.step_micro_batches = 0
        self.gate.register_forward_hook(
            lambda gate, args, logits: self.RandomLogits.apply(logits) if self.force_balanced else None)

    def forward(self, x: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        scores, idx, gates = self.route(x)
        if self.aux_loss_coeff > 0 and gates.requires_grad:
            aux = self._aux_share(scores, idx, num_tokens)
            gates = AttachAuxLoss.apply(gates, aux, self.aux_loss_coeff * self.aux_loss_scale)
        return idx, gates.to(x.dtype)

    def _aux_share(self, scores: torch.Tensor, idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """This rank's share of the auxiliary loss (class docstring): ``E Σ_{own t} Σ_e f[u(t), e] p[t, e] / T_mb``
        from ``scores [T, E]`` and ``idx [T, k]`` of its own tokens; a scalar with the gradient of ``p`` only."""
        env, experts, k = self.env, scores.shape[1], idx.shape[1]
        probs = scores / scores.sum(-1, keepdim=True)
        if self.aux_loss_scope == "sequence":  # own tokens are [b, s/(cp·tp)] flattened: sequence-major
            batch = num_tokens // env.layout.seq_len
            rows = idx.reshape(batch, -1)
            counts = scores.new_zeros((batch, experts)).scatter_add_(1, rows, scores.new_ones(rows.shape))
            share = _summed(counts, env.tp_cp_link) / (env.layout.seq_len * k)
            return experts * (share * probs.view(batch, -1, experts).sum(1)).sum() / num_tokens
        counts = scores.new_zeros(experts).scatter_add_(0, idx.flatten(), scores.new_ones(idx.numel()))
        return experts * (self._share(counts, own_tokens=idx.shape[0], num_tokens=num_tokens)
                          * probs.sum(0)).sum() / num_tokens

    def _share(self, counts: torch.Tensor, *, own_tokens: int, num_tokens: int) -> torch.Tensor:
        """``f [E]`` of the unit of this rank's tokens under a scope other than ``sequence``, from this rank's copies
        per expert ``counts [E]`` (float)."""
        env, k, scope = self.env, self.top_k, self.aux_loss_scope
        if scope == "ep-group":
            return _summed(counts, env.expert_link) / (k * own_tokens * env.expert_link.size)
        counts = _summed(counts, env.tp_cp_link)
        if scope == "micro-batch":
            return counts / (k * num_tokens)
        dp = env.dp_link
        counts = _summed(counts, dp)
        if scope == "dp-group":
            return counts / (k * num_tokens * dp.size)
        self.step_counts = counts if self.step_counts is None else self.step_counts + counts
        self.step_micro_batches += 1
        return self.step_counts / (k * self.step_micro_batches * num_tokens * dp.size)


def _summed(x: torch.Tensor, link: Link) -> torch.Tensor:
    """``x`` summed over ``link``'s ranks, without gradient: all-gathered, then added in rank order (the same
    floats on every rank)."""
    return gather_no_grad(x.unsqueeze(0), link).sum(0)


_UNCOUNTED = threading.local()


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Forwards run inside, in this thread, are not counted by ``ParallelMoE.take_counts``: an extra run of a
    layer outside the step's schedule (moeplan.runtime.activations' probe)."""
    _UNCOUNTED.depth = getattr(_UNCOUNTED, "depth", 0) + 1
    try:
        yield
    finally:
        _UNCOUNTED.depth -= 1


def counting() -> bool:
    """Whether a forward now is one of the step's own: not inside :func:`uncounted`, and not a recompute (run by
    ``torch.utils.checkpoint`` inside the backward pass, where this thread has a current autograd graph task)."""
    return not getattr(_UNCOUNTED, "depth", 0) and torch._C._current_graph_task_id() == -1


def take_expert_counts(modules: Mapping[int, nn.ModuleDict], *, reset: bool = True) -> dict[str, torch.Tensor]:
    """Layer name (``layers.3``, ``mtp.0``) -> ``[E]`` int64 counts of :meth:`ParallelMoE.take_counts` for every MoE
    layer of this rank's stages ``modules`` (stage -> moeplan.runtime.build.LayerDict), each counter then reset to
    zero (``reset``). A second taker after a reset sees only what was counted since: with two consumers (the load
    recorder, the rebalancer), the first reads with ``reset=False``."""
    out: dict[str, torch.Tensor] = {}
    for layers in modules.values():
        for name, layer in layers.items():
            for m in layer.modules():
                if isinstance(m, ParallelMoE):
                    out[name] = m.take_counts(reset=reset)
    return out


def start_step(modules: Mapping[int, nn.ModuleDict]) -> None:
    """Start a step's running counts of the ``global-batch`` auxiliary loss anew on every router of ``modules``
    (:class:`ParallelRouter`)."""
    for layers in modules.values():
        for m in layers.modules():
            if isinstance(m, ParallelRouter):
                m.step_counts, m.step_micro_batches = None, 0


def check_aux_loss(plan, coeff: float, scope: AuxLossScope) -> None:  # noqa: ANN001 (moeplan.plan.Plan)
    """Raise PlanError (one line) unless ``plan`` can train with the auxiliary loss ``coeff`` (> 0) at ``scope``:
    the model has routed experts; ``global-batch`` runs no recompute (its running counts would be added again by a
    recomputed forward, which would also see a later running mean); ``dp-group`` runs no recompute inside
    OVERLAP_F_B pairs (the pair's backward half re-issues collectives on a second set of groups, which has no DP
    group: moeplan.runtime.groups.StreamGroups)."""
    from moeplan.runtime.executor import has_pairs

    if not plan.model.spec.is_moe:
        raise PlanError(f"aux_loss_coeff={coeff}: the model has no routed experts")
    recompute = sorted({r.recompute for r in plan.memory.ranks} - {"none"})
    if scope == "global-batch" and recompute:
        raise PlanError(f"aux_loss_scope={scope}: needs a plan without recompute (this one: {', '.join(recompute)}); "
                        f"a recomputed forward would add its counts to the step's running counts again")
    if scope == "dp-group" and recompute and has_pairs(plan):
        raise PlanError(f"aux_loss_scope={scope}: needs a plan without recompute or without OVERLAP_F_B pairs; a "
                        f"recompute in a pair's backward half has no second DP group to all-reduce on")


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
    ``aux_loss_scale`` / ``aux_loss_scope``: :class:`ParallelRouter`'s. ``overlap_shared`` (``shared-expert`` in
    ``plan.comm.overlap``): the shared experts run while the token all-to-all is in flight (module docstring, step
    3).

    Parameters: ``router.gate.weight`` (replicated), ``experts.w1/w3/w2`` (this rank's experts and etp part),
    ``shared.w1/w3/w2`` (TP-sharded), named as in moeplan.models.MoE.
    """

    def __init__(self, env: ShardEnv, *, aux_loss_coeff: float = 0.0, aux_loss_scale: float = 1.0,
                 aux_loss_scope: AuxLossScope = "micro-batch", dispatcher: Dispatcher = "flat",
                 devices_per_node: int = 1, overlap_shared: bool = False) -> None:
        super().__init__()
        spec, lay, coords = env.spec, env.layout, env.coords
        self.env, self.hidden = env, spec.hidden_size
        self.router = ParallelRouter(spec, env, aux_loss_coeff=aux_loss_coeff, aux_loss_scale=aux_loss_scale,
                                     aux_loss_scope=aux_loss_scope)
        mine = env.expert_placement[coords.expert_rank]
        self.experts = LocalExperts(spec, experts=mine, etp=lay.etp, etp_rank=coords.etp_rank)
        self.combine = TokenUnpermute()
        #: each counted forward's routed token copies per logical expert since the last reset ([E] int64): this
        #: rank's own tokens' top-k choices, before any drop-and-pad drop (:meth:`take_counts`)
        self._counted: list[torch.Tensor] = []
        self.shared = ParallelSwiGLU(spec.hidden_size, spec.shared_ffn_size, env) if spec.num_shared_experts else None
        self.overlap_shared = overlap_shared and self.shared is not None
        self.dispatcher = dispatcher
        self.link = env.expert_link
        if dispatcher in ("hierarchical", "dedup"):
            members = next(m for m in group_ranks(env.layout).expert if coords.rank in m)
            intra = expert_node_ranks(env.layout, devices_per_node, min_per_node=1 if dispatcher == "dedup" else 2)[1]
            self._nodes = (members, next(m for m in intra if coords.rank in m), devices_per_node)
            self.inter_link = Link(env.groups.expert_inter, "ep", env.comm_log)
            self.intra_link = Link(env.groups.expert_intra, "ep", env.comm_log)
            self.my_node = sorted({r // devices_per_node for r in members}).index(coords.rank // devices_per_node)
            self.link = self.intra_link if dispatcher == "hierarchical" else Link(None, "ep", env.comm_log)
        elif dispatcher != "flat":
            raise PlanError(f"comm.dispatcher={dispatcher!r}: must be one of flat, hierarchical, dedup")
        self.set_placement(env.expert_placement)

    def set_placement(self, placement: tuple[tuple[int, ...], ...]) -> None:
        """Route by ``placement`` from now on: expert-group rank ``r`` computes the logical experts
        ``placement[r]``, the one at position ``i`` in local slot ``i`` of its :class:`LocalExperts`. Rebuilds the
        routing tables (``owner``, ``local_index``; the node tables of the hierarchical and dedup dispatchers) and
        the experts' ParamShards; moves no weights (moeplan.runtime.rebalance does, before calling this). Raises
        PlanError unless ``placement`` holds every expert once and this rank's slot count is unchanged."""
        spec, rank = self.env.spec, self.env.coords.expert_rank
        if (sorted(e for s in placement for e in s) != list(range(spec.num_experts))
                or len(placement[rank]) != self.experts.num_experts):
            raise PlanError(f"placement={[list(s) for s in placement]}: must hold each of the {spec.num_experts} "
                            f"experts once, {self.experts.num_experts} on expert rank {rank}")
        owner, local = [0] * spec.num_experts, [0] * spec.num_experts
        for r, shard in enumerate(placement):
            for i, e in enumerate(shard):
                owner[e], local[e] = r, i
        self.placement = tuple(tuple(s) for s in placement)
        self.slots_per_rank = max(len(s) for s in placement)
        self.local_index = tuple(local)
        self.owner = tuple(owner)  # expert -> rank of self.link that computes it (-1: not reached from here)
        self.experts.hold(self.placement[rank])
        if self.dispatcher in ("hierarchical", "dedup"):
            members, node, per = self._nodes
            nodes = sorted({r // per for r in members})
            self.node_of = tuple(nodes.index(members[r] // per) for r in owner)  # inter-group rank
            self.node_rank_of = tuple(sorted(m for m in members if m // per == members[r] // per).index(members[r])
                                      for r in owner)  # intra rank
            # hierarchical: the intra-node all-to-all reaches this node's experts only; dedup: this rank's only
            self.owner = (tuple(node.index(members[r]) if members[r] in node else -1 for r in owner)
                          if self.dispatcher == "hierarchical" else tuple(0 if r == rank else -1 for r in owner))

    def take_counts(self, *, reset: bool = True) -> torch.Tensor:
        """The routed (token, expert) copies this rank's own tokens sent to each logical expert in the forwards
        counted since the last reset: ``[E]`` int64 on the CPU; the count starts again from zero (``reset``)."""
        total = torch.zeros(self.env.spec.num_experts, dtype=torch.long)
        for c in self._counted:
            total += c.cpu()
        if reset:
            self._counted.clear()
        return total

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
        # every forward counts, a recompute in backward too: a selective-checkpoint recompute must replay the
        # forward's ops one for one; only the step's own forwards keep theirs (:func:`counting`), by a list append
        counts = torch.bincount(idx.flatten(), minlength=env.spec.num_experts)
        if counting():
            self._counted.append(counts)
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
