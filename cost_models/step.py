"""The pieces of a step beside the layers' programs (the ``simulate`` pass's pricing): each pipeline stage's
:class:`~moeplan.cost_models.timeline_types.StageProgram` with its recompute, the overlap settings, the DP collectives
and their exposure, and the optimizer step.

Per pipeline stage it concatenates its layers' programs (cost_models/layer_program.py) into a
:class:`~moeplan.cost_models.timeline_types.StageProgram`, with the recompute the memory plan chose: under ``full``
recompute each layer's forward (its collectives included) runs again right before its backward; under
``selective`` its norms, activation functions and core attention do (one compute segment). The timeline
simulates these programs with the strategy's overlap mechanisms, the target's compute slow-down under
communication and its host launch costs (:func:`run_settings`).

Data parallelism (the distributed optimizer, ZeRO-1): per PP rank and chunk, a reduce-scatter of the gradients (in
the recipe's gradient dtype, ``Precision.grad_dtype``) and an all-gather of the parameters (the training dtype),
dense parameters over dp·cp ranks (stride tp) and routed experts over expert-DP (stride tp·ep); under FSDP with PP
the same once per step over the FSDP groups, without PP each layer reduces its own gradients in every micro-batch
(cost_models/layer_program.py ``with_fsdp``); HSDP's replicas all-reduce their shards here. Without mechanism ``dp``
they run after the rank's last backward, exposed. With ``dp`` (Megatron-LM ``--overlap-grad-reduce
--overlap-param-gather``) a chunk's reduce-scatter starts when its last backward ends and the all-gathers start with
the step (gathering the next step's parameters while forwards run); both use only the time their link tier is idle
(the in-layer and p2p transfers go first), so what does not fit runs after the rank's last backward; a chunk's first
forward also waits for the all-gather of its first bucket (``BUCKET_PARAMS``). Then the Adam update, memory-bound:
about 30 bytes moved per locally owned parameter (fp32 grad, main weight, m, v read; main, m, v, bf16 weight
written; twice that when the target trains in fp32), and the global gradient norm for clipping, one small all-reduce
over every rank of the step (Megatron-LM ``clip_grad_norm_fp32``; moeplan's runtime likewise).

On an eager runtime (``target.launch.granularity == "kernel"``, the cpu emulator) the optimizer is a few hundred
small kernels, which dominate at tiny-model sizes: moeplan's runtime (moeplan/runtime/optimizer.py,
``DistributedAdamW``) flattens each local parameter's gradient into a flat buffer and copies each updated shard back
(``OPTIMIZER_KERNELS_PER_TENSOR`` aten ops per parameter tensor: reshape, slice, view, copy_), and per flat buffer
(dense/expert × decay/no-decay, each its own reduce-scatter and all-gather) runs the concatenation, scaling, the
squared-norm terms and single-tensor AdamW (``OPTIMIZER_KERNELS_PER_BUFFER``, counted from that code), each at
``launch.forward_kernel_s``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

import numpy as np

from moeplan.cost_models import timeline_core
from moeplan.cost_models.comm import collective_time_s, group_tier
from moeplan.cost_models.memory import fsdp_reshards, saved_bytes, state_bytes_per_param
from moeplan.cost_models.timeline_types import (RunSettings, StageProgram, Timeline, compact, concat_segments)
from moeplan.ir import LayerKind, kind_of
from moeplan.layout import Layout
from moeplan.state import OP_MODES, LayerCost, PlanState, Recompute, Segment
from moeplan.targets import Target

ADAM_BYTES_PER_PARAM = 30
OPTIMIZER_KERNELS_PER_TENSOR = 4
OPTIMIZER_BUFFERS = 4
OPTIMIZER_KERNELS_PER_BUFFER = 25
NORM_BYTES = 8  # the float64 squared norm all-reduced for clipping
BUCKET_PARAMS = 40_000_000  # Megatron-LM DDP bucket: max(40M, 1M·dp) parameters (distributed_data_parallel_config)


def recompute_work(cost: LayerCost, mode: Recompute) -> tuple[float, float]:
    """(seconds, FLOPs) of forward work redone in backward under ``mode``."""
    if mode == "selective":
        return cost.recompute_selective_s, cost.recompute_selective_flops
    if mode == "full":
        return cost.recompute_full_s, cost.recompute_full_flops
    return 0.0, 0.0


def recompute_segments(cost: LayerCost, mode: Recompute, redo_s: float | None = None) -> tuple[Segment, ...]:
    """What ``mode`` recomputes of a layer before its backward; under a per-tensor mode ``redo_s``, the seconds
    of the ops its decision re-runs, as one compute segment (their collectives included, blocking)."""
    if redo_s is not None:
        return (Segment("recompute", "compute", redo_s, kernels=1),) if redo_s > 0 else ()
    if mode == "full":
        return cost.program.fwd
    if mode == "selective" and cost.recompute_selective_s > 0:
        return (Segment("recompute", "compute", cost.recompute_selective_s, kernels=1),)
    return ()


def layer_backward(cost: LayerCost, mode: Recompute, *, weight: bool, redo_s: float | None = None
                    ) -> tuple[Segment, ...]:
    """A layer's dX segments, preceded by its recompute, and (``weight``) each dW segment right after the last dX
    segment it needs (autograd computes a weight's gradient where it meets the op)."""
    redo = recompute_segments(cost, mode, redo_s)
    dx = concat_segments([redo, cost.program.bwd_input]) if redo else cost.program.bwd_input
    if not weight:
        return dx
    shift = len(dx) - len(cost.program.bwd_input)
    weights = [s.with_after(tuple(i + shift for i in s.after)) for s in cost.program.bwd_weight]
    at: dict[int, list[Segment]] = {}
    for w in weights:
        at.setdefault(max(w.after, default=len(dx) - 1), []).append(w)
    new_index, out = {}, list(at.get(-1, []))  # a layer without dX (the embedding) still has its dW
    for i, s in enumerate(dx):
        new_index[i] = len(out)
        out.append(s)
        out += at.get(i, [])
    return tuple(s.with_after(tuple(new_index[j] for j in s.after)) for s in out)


def _one_segment(segs: Sequence[Segment]) -> tuple[Segment, ...]:
    """A separate W action's weight gradients as one compute segment (they need nothing but their I)."""
    if not segs:
        return ()
    return (Segment("weight_grad", "compute", sum(s.seconds for s in segs), kernels=sum(s.kernels for s in segs)),)


def stage_program(layer_costs: Sequence[LayerCost], mode: Recompute, activation_bytes: float, *,
                  redo_s: Mapping[LayerKind, float] | None = None, swap_s: tuple[float, float] = (0.0, 0.0),
                  weight_pass: str = "weight-only") -> StageProgram:
    """One stage's program: forward in layer order, the backward passes in reverse layer order (module
    docstring). Per-tensor modes: ``redo_s`` per layer kind (seconds re-run per layer) and ``swap_s`` (the copy
    out and the prefetch the host link does not hide, per micro-batch), which hold the compute stream at the end
    of the forward and the start of the backward. ``weight_pass`` (the target's ``runtime.weight_pass``): a W
    action runs the dW kernels alone (``weight-only``) or every layer's dX and dW kernels again
    (``whole-backward``, no recompute: I has recomputed what the backward needs)."""
    redo = redo_s or {}
    back = list(reversed(layer_costs))
    out = (Segment("swap_out", "compute", swap_s[0]),) if swap_s[0] > 0 else ()
    fetch = (Segment("prefetch", "compute", swap_s[1]),) if swap_s[1] > 0 else ()

    def backward(weight: bool) -> tuple[Segment, ...]:
        return compact(concat_segments([fetch] + [layer_backward(c, mode, weight=weight, redo_s=redo.get(c.kind))
                                                  for c in back]))

    return StageProgram(fwd=compact(concat_segments([c.program.fwd for c in layer_costs] + [out])),
                        bwd_input=backward(False),
                        bwd_weight=_one_segment(concat_segments(
                            [c.program.weight_alone for c in back] if weight_pass == "weight-only"
                            else [layer_backward(c, "none", weight=True) for c in back])),
                        backward=backward(True), activation_bytes=activation_bytes)


def beside_compute(target: Target, overlap: Iterable[str]) -> RunSettings:
    """What runs beside compute on ``target`` with the mechanisms ``overlap`` on: the compute slow-down while a
    collective is in flight (per collective kind where the target lists it), and the host's launch and sync costs
    on a target priced per op (on a ``"kernel"`` target they are inside the kernel costs). No PP link
    (:func:`run_settings` adds it)."""
    host = target.launch.granularity == "op"
    return RunSettings(mechanisms=frozenset(overlap), compute_slowdown=target.comm_compute_slowdown,
                       slowdown_by_kind=dict(target.comm_compute_slowdown_by_kind),
                       host_launch_s=target.launch.host_launch_s if host else 0.0,
                       host_sync_s=target.launch.host_sync_s if host else 0.0)


def run_settings(state: PlanState) -> RunSettings:
    """The PP link and what runs beside compute, from the sharding, the strategy and the target."""
    assert state.sharding is not None
    p2p = state.sharding.p2p
    return replace(beside_compute(state.target, state.strategy.overlap), p2p_s=p2p.time_s, p2p_tier=p2p.tier,
                   p2p_bytes=p2p.bytes if p2p.time_s else 0.0,
                   p2p_host_s=state.target.launch.p2p_host_s)


@dataclass(frozen=True)
class DpCollective:
    """One DP collective of one chunk of one rank: seconds, link tier, bytes sent on it, and the seconds of the
    all-gather of its first bucket (the part a forward cannot start without)."""

    kind: str
    stage: int
    time_s: float
    tier: str
    wire_bytes: float
    first_bucket_s: float = 0.0


def dp_collectives(state: PlanState, rank: int) -> list[DpCollective]:
    """Reduce-scatters and all-gathers of one PP rank's chunks (module docstring)."""
    lay, tgt, spec = state.layout, state.target, state.graph.spec
    assert state.sharding is not None and state.stages is not None
    costs, out = state.sharding.layer_costs, []
    grad_bytes = state_bytes_per_param(tgt.dtype_bytes, state.strategy.precision)[1]
    for c, names in enumerate(state.stages.chunks[rank]):
        lcs = [costs[kind_of(spec, x)] for x in names]
        out += stage_dp_collectives(lay, tgt, state.stages.stage_of(rank, c),
                                    dense=sum(x.params - x.expert_params for x in lcs),
                                    expert=sum(x.expert_params for x in lcs), grad_bytes=grad_bytes)
    return out


def stage_dp_collectives(lay: Layout, tgt: Target, stage: int, *, dense: float, expert: float, grad_bytes: int
                         ) -> list[DpCollective]:
    """The DP collectives of one stage holding ``dense`` and ``expert`` parameters per device (module docstring):
    a reduce-scatter and an all-gather per parameter class, and HSDP's replica all-reduces."""
    out = []
    for params, (group, stride) in zip((dense, expert), step_sync_groups(lay)):
        if params == 0 or group == 1:
            continue
        rs, ag, tier = dp_sync_s(params, group=group, stride=stride, target=tgt, grad_bytes=grad_bytes)
        bucket = min(params, BUCKET_PARAMS)
        first = collective_time_s(kind="all_gather", bytes=int(bucket * tgt.dtype_bytes / group), group_size=group,
                                  tier=tier, target=tgt)
        out.append(DpCollective("reduce_scatter", stage, rs, tier, params * grad_bytes * (group - 1) / group))
        out.append(DpCollective("all_gather", stage, ag, tier, params * tgt.dtype_bytes * (group - 1) / group, first))
    if lay.dp_shard > 1:  # HSDP's replicas all-reduce their shards' gradients
        out += replica_reductions(lay, tgt, stage, dense, expert, grad_bytes)
    return out


def step_sync_groups(lay: Layout) -> tuple[tuple[int, int], tuple[int, int]]:
    """(group, stride) of the once-per-step gradient reduce-scatter and parameter all-gather, for the dense and
    the routed-expert parameters: ZeRO-1 (the distributed optimizer) over dp·cp ranks ``tp`` apart and expert-DP
    ranks ``tp·ep`` apart; FSDP under PP over its groups (cost_models/memory.py ``fsdp_reshards``: torch's pipeline
    stages skip the per-micro-batch sync); FSDP without PP: groups of 1, each layer's collectives being in its
    program (cost_models/layer_program.py ``with_fsdp``)."""
    if lay.dp_shard == 1:
        return (lay.dp * lay.cp, lay.tp), (lay.expert_dp, lay.tp * lay.ep)
    if fsdp_reshards(lay):
        return (1, lay.tp), (1, lay.tp * lay.ep)
    return (lay.fsdp_group, lay.tp), (lay.expert_fsdp_group, lay.tp * lay.ep)


def replica_reductions(lay: Layout, tgt: Target, stage: int, dense: float, expert: float,
                        grad_bytes: int) -> list[DpCollective]:
    """Under HSDP (``dp_shard < dp``): the all-reduce of each FSDP shard's gradients over the ``dp / dp_shard``
    replicas (PyTorch FSDP2 with a 2-D mesh: reduce-scatter inside the shard group, all-reduce across replicas)."""
    replicas = lay.dp // lay.dp_shard
    out = []
    for params, group, stride in ((dense, lay.fsdp_group, lay.tp), (expert, lay.expert_fsdp_group, lay.tp * lay.ep)):
        if params == 0 or replicas == 1:
            continue
        shard = params / group
        tier = group_tier(stride=stride * group, group_size=replicas, devices_per_node=tgt.devices_per_node)
        t = collective_time_s(kind="all_reduce", bytes=int(shard * grad_bytes), group_size=replicas, tier=tier,
                              target=tgt)
        out.append(DpCollective("all_reduce", stage, t, tier, 2 * shard * grad_bytes * (replicas - 1) / replicas))
    return out


def dp_sync_s(params: float, *, group: int, stride: int, target: Target, grad_bytes: int = 4
              ) -> tuple[float, float, str]:
    """(reduce-scatter seconds, all-gather seconds, link tier) of ``params`` parameters over a DP group of
    ``group`` ranks ``stride`` apart: the gradients (``grad_bytes`` each: the recipe's gradient dtype,
    cost_models/memory.py) reduce-scattered, the updated weights (the training dtype) all-gathered, in
    :func:`_buffers_per_class` buffers each (module docstring)."""
    n = _buffers_per_class(target)
    tier = group_tier(stride=stride, group_size=group, devices_per_node=target.devices_per_node)
    rs = n * collective_time_s(kind="reduce_scatter", bytes=int(params * grad_bytes / n), group_size=group,
                               tier=tier, target=target)
    ag = n * collective_time_s(kind="all_gather", bytes=int(params * target.dtype_bytes / (group * n)),
                               group_size=group, tier=tier, target=target)
    return rs, ag, tier


def adam_s(owned_params: float, target: Target) -> float:
    """Seconds of the memory-bound Adam update of ``owned_params`` parameters (module docstring)."""
    return owned_params * ADAM_BYTES_PER_PARAM * target.dtype_bytes / 2 / (target.hbm_bandwidth_bytes_per_s
                                                                            * target.efficiency.memory)


def _fill(start: float, need: float, busy: tuple[np.ndarray, np.ndarray]) -> float:
    """End time of ``need`` seconds of work that starts at ``start`` and uses only the gaps between ``busy``
    intervals (their starts and ends, sorted by start)."""
    return float(timeline_core.fill(start, need, *busy))


def dp_exposure(ops: Sequence[DpCollective], *, tl: Timeline, rank: int, overlap: bool) -> tuple[float, float]:
    """(seconds the DP collectives add after the rank's last backward, seconds its first forward waits for
    parameters) for one rank (module docstring)."""
    end = tl.rank_end_s[rank]
    if not overlap:
        return sum(o.time_s for o in ops), 0.0
    busy = {}
    for t, v in tl.tier_busy[rank].items():  # by start, then end
        v = v[np.lexsort((v[:, 1], v[:, 0]))]
        busy[t] = (np.ascontiguousarray(v[:, 0]), np.ascontiguousarray(v[:, 1]))
    free = {t: 0.0 for t in busy}
    wait = 0.0
    for o in sorted((o for o in ops if o.kind == "all_gather"), key=lambda o: tl.first_forward_s[rank].get(o.stage,
                                                                                                           0.0)):
        first_f = tl.first_forward_s[rank].get(o.stage, 0.0)
        wait = max(wait, _fill(free[o.tier], o.first_bucket_s, busy[o.tier]) - first_f)
        free[o.tier] = _fill(free[o.tier], o.time_s, busy[o.tier])
    for o in sorted((o for o in ops if o.kind != "all_gather"),
                    key=lambda o: tl.last_backward_end_s[rank].get(o.stage, end)):
        ready = max(free[o.tier], tl.last_backward_end_s[rank].get(o.stage, end))
        free[o.tier] = _fill(ready, o.time_s, busy[o.tier])
    return max([0.0] + [f - end for f in free.values()]), max(0.0, wait)


def _buffers_per_class(target: Target) -> int:
    """Flat gradient buffers (one reduce-scatter and one all-gather each) per parameter class: 1 (one bucket per
    class) except on the eager cpu emulator, whose runtime (moeplan's ``DistributedAdamW``) keeps decay and
    no-decay parameters in separate buffers: 2."""
    return OPTIMIZER_BUFFERS // 2 if target.launch.granularity == "kernel" else 1


def _optimizer_launch_s(state: PlanState, names: list[str]) -> float:
    """Eager per-kernel cost of the optimizer step on a ``"kernel"`` target (module docstring); 0 otherwise."""
    tgt, spec = state.target, state.graph.spec
    if tgt.launch.granularity != "kernel":
        return 0.0
    tensors = sum(state.graph.layer(kind_of(spec, n)).param_tensor_count for n in names)
    kernels = tensors * OPTIMIZER_KERNELS_PER_TENSOR + OPTIMIZER_BUFFERS * OPTIMIZER_KERNELS_PER_BUFFER
    return kernels * tgt.launch.forward_kernel_s


def norm_s(world: int, target: Target) -> float:
    """Seconds of the clipping norm's all-reduce (``NORM_BYTES``) over all ``world`` ranks of the step, part of
    every rank's optimizer step (module docstring); 0 on one rank."""
    if world <= 1:
        return 0.0
    tier = group_tier(stride=1, group_size=world, devices_per_node=target.devices_per_node)
    return collective_time_s(kind="all_reduce", bytes=NORM_BYTES, group_size=world, tier=tier, target=target)


def optimizer_s(state: PlanState, rank: int) -> float:
    """Adam update and the clipping norm's all-reduce on one device of PP rank ``rank`` (module docstring)."""
    lay, tgt, spec = state.layout, state.target, state.graph.spec
    assert state.sharding is not None and state.stages is not None
    names = [n for chunk in state.stages.chunks[rank] for n in chunk]
    lcs = [state.sharding.layer_costs[kind_of(spec, n)] for n in names]
    dense = sum(c.params - c.expert_params for c in lcs)
    expert = sum(c.expert_params for c in lcs)
    return (norm_s(lay.world_size, tgt) + adam_s(owned_params(lay, dense, expert), tgt)
            + _optimizer_launch_s(state, names))


def owned_params(layout: Layout, dense: float, expert: float) -> float:
    """Parameters whose optimizer update one device runs: its shard of the ``dense`` and ``expert`` parameters it
    holds under TP/EP, over dp·cp and expert-DP (ZeRO-1), or over the FSDP groups."""
    if layout.dp_shard > 1:
        return dense / layout.fsdp_group + expert / layout.expert_fsdp_group
    return dense / (layout.dp * layout.cp) + expert / layout.expert_dp


def stage_programs(state: PlanState) -> tuple[list[StageProgram], list[float]]:
    """Per pipeline stage, the :class:`StageProgram` of one micro-batch under the plan's recompute decisions, and per
    PP rank the FLOPs one micro-batch executes on one device (recompute included)."""
    assert state.sharding and state.stages and state.memory
    lay, spec = state.layout, state.graph.spec
    costs = state.sharding.layer_costs
    weight_pass = state.target.runtime.weight_pass
    programs: list[StageProgram] = [None] * (lay.pp * lay.vpp)  # type: ignore[list-item]
    flops_per_mb = [0.0] * lay.pp
    for r in range(lay.pp):
        mem = state.memory.stages[r]
        mode = mem.recompute
        for c, names in enumerate(state.stages.chunks[r]):
            lcs = [costs[kind_of(spec, n)] for n in names]
            if mode in OP_MODES:
                ours = {LayerKind(d.kind): d for d in mem.decisions if d.chunk == c}
                programs[state.stages.stage_of(r, c)] = stage_program(
                    lcs, mode, sum(ours[x.kind].kept_bytes for x in lcs if x.kind in ours),
                    redo_s={k: d.recompute_s for k, d in ours.items()}, swap_s=mem.exposed_swap_s[c],
                    weight_pass=weight_pass)
                flops_per_mb[r] += sum(x.executed_flops + (ours[x.kind].recompute_flops if x.kind in ours else 0)
                                       for x in lcs)
                continue
            programs[state.stages.stage_of(r, c)] = stage_program(lcs, mode, sum(saved_bytes(x, mode) for x in lcs),
                                                                  weight_pass=weight_pass)
            flops_per_mb[r] += sum(x.executed_flops + recompute_work(x, mode)[1] for x in lcs)
    return programs, flops_per_mb
