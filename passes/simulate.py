"""Pass ``simulate``: predict the step from the schedule with the timeline simulator (DESIGN §5 "timeline").

Per pipeline stage it sums its layers' forward and backward times, in-layer communication (serialised on the
compute stream in v1: no overlap yet) and the recompute the memory plan chose, then simulates one PP group's action
lists. After the pipeline drains, the distributed optimizer's gradient reduce-scatter and parameter all-gather
(dense over dp·cp with stride tp, experts over expert-DP) and the Adam update run exposed — overlap with backward is
a later issue. The optimizer update is memory-bound: about 30 bytes moved per locally owned parameter (fp32 grad,
main weight, m, v read; main, m, v, bf16 weight written; twice that when the target trains in fp32). The global
gradient norm for clipping is one small all-reduce over every rank of the step (Megatron-LM
``clip_grad_norm_fp32``; moeplan's runtime likewise) whenever there is more than one device.

On an eager runtime (``target.launch.granularity == "kernel"``, the cpu emulator) the optimizer is a few hundred
small kernels, which dominate at tiny-model sizes: moeplan's runtime (moeplan/runtime/optimizer.py,
``DistributedAdamW``) flattens each local parameter's gradient into a flat buffer and copies each updated shard back
(``OPTIMIZER_KERNELS_PER_TENSOR`` aten ops per parameter tensor: reshape, slice, view, copy_), and per flat buffer
(dense/expert × decay/no-decay, each its own reduce-scatter and all-gather) runs the concatenation, scaling, the squared-norm terms and single-tensor AdamW
(``OPTIMIZER_KERNELS_PER_BUFFER``, counted from that code), each at ``launch.forward_kernel_s``.

MFU uses Megatron-LM's causal model FLOPs without MTP (FACTS §4.1): flops_per_token · tokens / (step · devices ·
peak). HFU counts what the devices execute: traced forward + backward FLOPs of every layer (MTP and router included)
plus recompute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moeplan.cost_models.comm import collective_time_s, group_tier
from moeplan.cost_models.memory import GRAD_BYTES, PARAM_BYTES
from moeplan.cost_models.timeline import StageCost, simulate
from moeplan.flops import flops_per_token
from moeplan.ir import kind_of
from moeplan.passes.plan_memory import saved_bytes
from moeplan.state import LayerCost, PlanState, Prediction, Recompute
from moeplan.targets import Target

ADAM_BYTES_PER_PARAM = 30
OPTIMIZER_KERNELS_PER_TENSOR = 4
OPTIMIZER_BUFFERS = 4
OPTIMIZER_KERNELS_PER_BUFFER = 25
NORM_BYTES = 8  # the float64 squared norm all-reduced for clipping


def _recompute(cost: LayerCost, mode: Recompute) -> tuple[float, float]:
    """(seconds, FLOPs) of forward work redone in backward under ``mode``."""
    if mode == "selective":
        return cost.recompute_selective_s, cost.recompute_selective_flops
    if mode == "full":
        return cost.recompute_full_s, cost.recompute_full_flops
    return 0.0, 0.0


def stage_cost(layer_costs: list[LayerCost], mode: Recompute, activation_bytes: float) -> tuple[StageCost, float]:
    """StageCost of one pipeline stage for one micro-batch, and the FLOPs it executes (with recompute)."""
    fwd = sum(c.fwd_s + c.comm_s("fwd") for c in layer_costs)
    rec = [_recompute(c, mode) for c in layer_costs]
    bwd_in = sum(c.bwd_input_s + c.comm_s("bwd") for c in layer_costs) + sum(s for s, _ in rec)
    bwd_w = sum(c.bwd_weight_s for c in layer_costs)
    fwd_comm: dict[str, float] = {}
    bwd_comm: dict[str, float] = {}
    for c in layer_costs:
        for op in c.comm:
            d = fwd_comm if op.phase == "fwd" else bwd_comm
            d[op.comm_class] = d.get(op.comm_class, 0.0) + op.time_s
    flops = sum(c.executed_flops for c in layer_costs) + sum(f for _, f in rec)
    return StageCost(forward_s=fwd, backward_s=bwd_in + bwd_w, backward_input_s=bwd_in, backward_weight_s=bwd_w,
                     activation_bytes=activation_bytes, fwd_comm_s=fwd_comm, bwd_comm_s=bwd_comm), flops


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


@dataclass(frozen=True)
class SimulatePass:
    """Simulate one PP group's step and fill ``prediction``."""

    name: ClassVar[str] = "simulate"
    requires: ClassVar[tuple[str, ...]] = ("sharding", "stages", "memory", "schedule")
    provides: ClassVar[tuple[str, ...]] = ("prediction",)

    def run(self, state: PlanState) -> PlanState:
        assert state.sharding and state.stages and state.memory and state.schedule
        lay, spec, tgt = state.layout, state.graph.spec, state.target
        costs = state.sharding.layer_costs
        stage_costs: list[StageCost] = [None] * (lay.pp * lay.vpp)  # type: ignore[list-item]
        flops_per_mb = [0.0] * lay.pp
        for r in range(lay.pp):
            mode = state.memory.stages[r].recompute
            for c, names in enumerate(state.stages.chunks[r]):
                lcs = [costs[kind_of(spec, n)] for n in names]
                sc, fl = stage_cost(lcs, mode, sum(saved_bytes(x, mode) for x in lcs))
                stage_costs[c * lay.pp + r] = sc
                flops_per_mb[r] += fl
        tl = simulate(actions=state.schedule.actions, stage_costs=stage_costs, p2p_s=state.sharding.p2p.time_s)
        dp_s = [self._dp_tail_s(state, r) for r in range(lay.pp)]
        step = max(tl.step_time_s, max(t + tail for t, tail in zip(tl.rank_end_s, dp_s)))
        tokens = lay.global_batch * lay.seq_len
        peak = tgt.cube_flops
        model_flops = flops_per_token(spec, seq_len=lay.seq_len) * tokens
        executed = sum(flops_per_mb) * lay.num_microbatches * lay.tp * lay.cp * lay.dp
        exposed = dict(tl.exposed_comm_s)
        exposed["dp"] = max(dp_s)
        exposed["pp"] = exposed.get("pp", 0.0)
        pred = Prediction(
            step_time_s=step, tokens_per_s=tokens / step, mfu=model_flops / (step * lay.world_size * peak),
            hfu=executed / (step * lay.world_size * peak), bubble=tl.bubble,
            peak_memory_bytes=tuple(m.total_bytes for m in state.memory.stages), exposed_comm_s=exposed,
            model_flops_per_step=model_flops)
        return state.with_(prediction=pred)

    @staticmethod
    def _dp_tail_s(state: PlanState, rank: int) -> float:
        """Gradient reduce-scatter + parameter all-gather + Adam update after the last backward of ``rank``."""
        lay, tgt, spec = state.layout, state.target, state.graph.spec
        costs = state.sharding.layer_costs  # type: ignore[union-attr]
        names = [n for chunk in state.stages.chunks[rank] for n in chunk]  # type: ignore[union-attr]
        layer_costs = [costs[kind_of(spec, n)] for n in names]
        dense = sum(c.params - c.expert_params for c in layer_costs)
        expert = sum(c.expert_params for c in layer_costs)
        t = 0.0
        for params, group, stride in ((dense, lay.dp * lay.cp, lay.tp), (expert, lay.expert_dp, lay.tp * lay.ep)):
            if params == 0 or group == 1:
                continue
            tier = group_tier(stride=stride, group_size=group, devices_per_node=tgt.devices_per_node)
            n = _buffers_per_class(tgt)
            param_bytes = PARAM_BYTES * tgt.dtype_bytes / 2
            t += n * collective_time_s(kind="reduce_scatter", bytes=int(params * GRAD_BYTES / n), group_size=group,
                                       tier=tier, target=tgt)
            t += n * collective_time_s(kind="all_gather", bytes=int(params * param_bytes / (group * n)),
                                       group_size=group, tier=tier, target=tgt)
        if lay.world_size > 1:
            tier = group_tier(stride=1, group_size=lay.world_size, devices_per_node=tgt.devices_per_node)
            t += collective_time_s(kind="all_reduce", bytes=NORM_BYTES, group_size=lay.world_size, tier=tier,
                                   target=tgt)
        owned = dense / (lay.dp * lay.cp) + expert / lay.expert_dp
        adam_bytes = owned * ADAM_BYTES_PER_PARAM * tgt.dtype_bytes / 2
        return t + adam_bytes / (tgt.hbm_bandwidth_bytes_per_s * tgt.efficiency.memory) + _optimizer_launch_s(
            state, names)
