"""Dynamic expert placement while training (``moeplan run --rebalance-every N``): the executor of the Pangu Ultra MoE
report's planner/executor design (arXiv 2505.04519; the MindSpeed form of it is summarised in docs/references.md
§3.7, its claimed effect is listed unconfirmed in §1.1).

Every ``N`` steps, after the step's optimizer update and ``zero_grad`` and before the next forward, on every rank:

1. **Counts.** This rank's routed token copies per logical expert of each of its MoE layers, accumulated over the
   steps since the previous rebalance (the window; :meth:`Rebalancer.observe` adds each step's
   ``ParallelMoE.take_counts``: the step's own forwards, no recompute), are all-reduced (SUM) over the world
   into ``[MoE layers of the model, experts]``. Every rank then holds the same counts and plans the same
   placements: the ranks of an expert group, the etp parts of one expert, every expert-DP replica and every PP
   stage, with no further agreement.
2. **Plan.** Per layer, moeplan.placement.rebalance_layer: greedy (heaviest expert first to the least-loaded
   expert rank with a free slot, ``E/n`` slots per rank) on the window's counts, the predicted load of the next
   window (MindSpeed predicts with an exponential moving average, docs/references.md §3.7; here the last window).
   A layer's new placement is applied only when the predicted device imbalance (max/mean − 1 of the tokens per
   expert rank, moeplan.expert_load.imbalance) falls by more than ``threshold`` (absolute). Experts that stay on a
   rank keep their local slot; the arrivals fill the vacated slots in ascending expert order. moeplan.load_model
   replays the same decisions over a load trace to price them.
3. **Migrate** (:func:`migrate`). Each moved expert's ``w1``/``w3``/``w2`` slices (this rank's etp part) and their
   optimizer state — the fp32 master copy and AdamW's ``exp_avg``/``exp_avg_sq`` — go to the new owner in ONE
   ``all_to_all_single`` over the expert group with uneven splits (moeplan.runtime.parallel.all_to_all, the token
   dispatch's primitive; gloo, nccl and hccl have it), a row of 12 tensors per moved expert. The ZeRO-1 shards of
   the expert buckets are all-gathered over expert-DP first and re-sliced after
   (moeplan.runtime.optimizer.DistributedAdamW.unsharded_states), so every expert-DP replica sends the same rows
   and keeps its own shard of the result. No gradient moves: between steps every ``.grad`` is None (``zero_grad``)
   and the flat gradient shards are overwritten by the next step's reduce-scatter; AdamW's step counts are per
   bucket and equal on every rank. Then the layer routes by the new placement (ParallelMoE.set_placement).

An expert computes the same rows in the same order wherever it sits, so training is unchanged: the losses match a
run without rebalancing up to the summation order of the gradient norm. Replicas (an expert on several ranks) are
not supported: every placement holds each expert once, with the plan's number of experts on every rank.

Checkpoints (moeplan.runtime.checkpoint) record every layer's placement and the window in the manifest
(:meth:`Rebalancer.checkpoint_section`); a resume restores both (:meth:`Rebalancer.restore`), so it rebalances as
the uninterrupted run would.
"""
from __future__ import annotations

import time
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from moeplan.errors import PlanError
from moeplan.ir import LayerKind
from moeplan.models import layer_names, parse_layer_name
from moeplan.placement import rebalance_layer
from moeplan.plan import Plan
from moeplan.runtime.build import layer_placement
from moeplan.runtime.expert_parallel import ParallelMoE, take_expert_counts
from moeplan.runtime.metrics import RebalanceRecord
from moeplan.runtime.optimizer import DistributedAdamW
from moeplan.runtime.parallel import Link, all_to_all, group_rank

Placement = tuple[tuple[int, ...], ...]
"""Expert-group rank -> the logical experts it holds, by local slot."""


def moe_layer_names(plan: Plan) -> tuple[str, ...]:
    """The model's layers that hold a routed-expert block (``layers.i`` of the MoE layers, ``mtp.j``), in pipeline
    order; empty for a dense model."""
    spec = plan.model.spec
    if not spec.is_moe:
        return ()
    return tuple(n for n in layer_names(spec) if parse_layer_name(spec, n)[0] in (LayerKind.MOE, LayerKind.MTP))


def initial_placements(plan: Plan) -> dict[str, Placement]:
    """Every MoE layer's placement at the start of a run: the plan's (moeplan.runtime.build.layer_placement)."""
    return {name: layer_placement(plan, name) for name in moe_layer_names(plan)}


def check_rebalance(plan: Plan, every: int) -> None:
    """Raise PlanError (one line) unless ``plan`` can rebalance every ``every`` steps: routed experts spread over
    more than one expert rank (``ep·tp/etp``), the same number on each (a rank's expert tensors keep their shape)."""
    shards = plan.experts.shards
    if not plan.model.spec.is_moe or plan.layout.expert_shards < 2:
        raise PlanError(f"rebalance_every={every}: needs routed experts over more than one expert rank (the plan has "
                        f"{plan.layout.expert_shards if plan.model.spec.is_moe else 0}: ep·tp/etp)")
    if len({len(s) for s in shards}) > 1:
        raise PlanError(f"rebalance_every={every}: needs the same number of experts on every expert rank (the plan's "
                        f"experts.shards hold {[len(s) for s in shards]})")


def local_moes(modules: Mapping[int, nn.ModuleDict]) -> dict[str, ParallelMoE]:
    """This rank's MoE blocks by the name of the layer holding each (one per layer)."""
    out: dict[str, ParallelMoE] = {}
    for layers in modules.values():
        for name, layer in layers.items():
            for m in layer.modules():
                if isinstance(m, ParallelMoE):
                    assert name not in out, f"{name}: two MoE blocks in one layer"
                    out[name] = m
    return out


def migrate(moes: Mapping[str, ParallelMoE], new: Mapping[str, Placement], optimizer: DistributedAdamW,
            link: Link) -> int:
    """Move the experts of this rank's layers ``moes`` to the placements ``new`` (layer name -> placement; only the
    layers that change) over the expert group ``link``, then switch the layers' routing to them; returns the bytes
    this rank sent to other ranks. Collective over the expert group and, for the optimizer shards, over expert-DP:
    every rank of them must pass the same layers (they do, from the same plan).

    Per moved expert one row ``[12·h·f/etp]`` fp32: ``w1``, ``w3``, ``w2`` and each one's master copy, ``exp_avg``
    and ``exp_avg_sq``; the rows to each rank are ordered by layer (pipeline order) and then by the expert's slot
    there, so each receiver knows which row is which from the plan alone."""
    layers = [n for n in moes if n in new]
    if not layers:
        return 0
    me, ranks = group_rank(link.group), link.size
    assert all(m.env.coords.expert_rank == me for m in moes.values()), "expert group ranks are expert ranks"
    params = {n: (moes[n].experts.w1, moes[n].experts.w3, moes[n].experts.w2) for n in layers}
    assert all(p.grad is None for ps in params.values() for p in ps), "experts move between steps, without grads"
    with optimizer.unsharded_states([p for ps in params.values() for p in ps]) as states:
        stacks = {n: [t for p in params[n] for t in (p.data, *states[id(p)])] for n in layers}  # each [E_local, ...]

        def row(name: str, slot: int) -> torch.Tensor:
            return torch.cat([t[slot].reshape(-1).float() for t in stacks[name]])

        out: list[torch.Tensor] = []
        send, recv = [0] * ranks, [0] * ranks
        incoming: list[tuple[str, int]] = []  # (layer, slot here) of each received row, in arrival order
        for r in range(ranks):
            for n in layers:
                old, placed = moes[n].placement, new[n]
                for e in placed[r]:
                    if r != me and e in old[me]:
                        out.append(row(n, old[me].index(e)))
                        send[r] += 1
            for n in layers:
                old, placed = moes[n].placement, new[n]
                for slot, e in enumerate(placed[me]):
                    if r != me and e in old[r]:
                        incoming.append((n, slot))
                        recv[r] += 1
        width = sum(t[0].numel() for t in stacks[layers[0]])
        sent = torch.stack(out) if out else params[layers[0]][0].new_empty((0, width), dtype=torch.float32)
        with torch.no_grad():
            received = all_to_all(sent, send, recv, link)
            for (n, slot), values in zip(incoming, received):
                for t, part in zip(stacks[n], values.split([x[0].numel() for x in stacks[n]])):
                    t[slot].copy_(part.view_as(t[slot]))
    for n in layers:
        moes[n].set_placement(new[n])
    return sent.numel() * sent.element_size()


class Rebalancer:
    """Tracks every MoE layer's placement on this rank (all layers of the model, not only this rank's: every rank
    plans them all from the same counts) and, with ``every > 0``, rebalances every ``every`` steps (module
    docstring). ``modules``: this rank's stages; ``expert_group``: its expert group (None: one rank);
    ``threshold``: the imbalance gain a layer's new placement must exceed; ``device``: where the backend's
    collectives take their tensors (the counts are kept on the CPU)."""

    def __init__(self, plan: Plan, modules: Mapping[int, nn.ModuleDict], optimizer: DistributedAdamW,
                 expert_group: dist.ProcessGroup | None, *, every: int = 0, threshold: float = 0.0,
                 device: torch.device = torch.device("cpu")) -> None:
        self.every, self.threshold, self.optimizer, self.device = every, threshold, optimizer, device
        self.placements = initial_placements(plan)
        self.names = tuple(self.placements)
        self.modules, self.moes = modules, local_moes(modules)
        self.link = Link(expert_group, "ep")
        self.window = torch.zeros((len(self.names), plan.model.spec.num_experts), dtype=torch.int64)

    def observe(self) -> None:
        """Add the token copies this rank's layers routed since the previous call to the window, and reset their
        counters (moeplan.runtime.expert_parallel.take_expert_counts)."""
        for name, counts in take_expert_counts(self.modules).items():
            self.window[self.names.index(name)] += counts

    def due(self, step: int) -> bool:
        """Whether a rebalance follows step ``step`` (1-based count of finished steps)."""
        return self.every > 0 and step % self.every == 0

    def rebalance(self) -> RebalanceRecord:
        """Collective over the world: plan every layer from the window, migrate this rank's changed layers, start a
        new window. The record's seconds are the slowest rank's, its bytes the sum over ranks."""
        t0 = time.perf_counter()
        window = self._reduced(self.window)
        self.window.zero_()
        decisions = {n: rebalance_layer(window[i].double().numpy(), self.placements[n], self.threshold)
                     for i, n in enumerate(self.names)}
        changed = {n: d.placement for n, d in decisions.items() if d.applied}
        t1 = time.perf_counter()
        sent = migrate(self.moes, changed, self.optimizer, self.link)
        t2 = time.perf_counter()
        self.placements.update(changed)
        times = self._reduced(torch.tensor([t2 - t0, t2 - t1], dtype=torch.float64), dist.ReduceOp.MAX)
        moved = self._reduced(torch.tensor([sent], dtype=torch.int64))
        return RebalanceRecord(seconds=float(times[0]), migrate_s=float(times[1]), moved_bytes=int(moved[0]),
                               layers=decisions)

    def checkpoint_section(self) -> dict | None:
        """Collective over the world (with ``every > 0``): the manifest's ``experts`` section
        (moeplan.runtime.checkpoint): every layer's placement and the window summed over ranks; None for a dense
        model."""
        if not self.names:
            return None
        section: dict = {"placement": {n: [list(s) for s in p] for n, p in self.placements.items()}}
        if self.every > 0:
            window = self._reduced(self.window)
            section["window"] = {n: window[i].tolist() for i, n in enumerate(self.names)}
        return section

    def _reduced(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """``t`` all-reduced over the world with ``op`` (on ``device``), back on the CPU; a copy."""
        out = t.to(self.device, copy=True)
        if dist.get_world_size() > 1:
            dist.all_reduce(out, op=op)
        return out.cpu()

    def restore(self, section: Mapping | None) -> None:
        """Take a checkpoint's ``experts`` section (already checked, moeplan.runtime.checkpoint.check_experts; None:
        the run's start): the placements, applied to this rank's layers, and the window, kept on global rank 0 only
        so that the next all-reduce sums to it."""
        if section is None:
            return
        self.placements = {n: tuple(tuple(s) for s in p) for n, p in section["placement"].items()}
        for name, m in self.moes.items():
            m.set_placement(self.placements[name])
        self.window.zero_()
        if dist.get_rank() == 0:
            for name, counts in section.get("window", {}).items():
                self.window[self.names.index(name)] = torch.tensor(counts, dtype=torch.int64)
