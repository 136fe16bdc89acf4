"""Pass ``shard``: TP (+SP), EP (expert-TP or TP-extend-EP), CP and DP, and the collectives each implies.

Per layer kind it scales the traced per-sequence op costs to one micro-batch on one device, prices them on the
target (compute model) and orders them with the collectives the layout implies into the layer's program
(cost_models/layer_program.py: TP with SP, the EP dispatcher the strategy names, expert-TP, CP), which the
timeline simulates. PP: one micro-batch's hidden states, split over SP and CP, cross each stage boundary.

Work scaling per ShardHint (moeplan/ir.py): every op scales by micro_batch / cp; TP and EXPERT ops also by 1/tp
(balanced routing spreads expert work evenly over the tp·cp ranks of a DP replica); SP ops by 1/tp.

Training dtype: the IR counts bf16; activation, saved and message bytes are scaled to ``target.dtype_bytes`` (the
cpu emulator trains in fp32), bytes the trace saw outside bf16 excepted (indices; fp32 upcasts such as the loss's
log-probabilities and a norm's rstd). Eager runtime (``target.launch.granularity ==
"kernel"``): backward also pays one kernel per gradient fan-out addition (``LayerGraph.grad_fanout_adds``, in dX)
and one AccumulateGrad kernel per parameter tensor (``param_tensor_count``, in dW), each at
``launch.backward_kernel_s``; and saved bytes are the eager code's (``OpAnnotation.eager_saved_bytes``: CPU
attention keeps its probabilities), as the runtime's autograd keeps them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from moeplan.cost_models.compute import annotation_time_s
from moeplan.cost_models.layer_program import forward_steps, layer_collectives, p2p_op, program
from moeplan.ir import LayerGraph, OpAnnotation, OpKind, ShardHint
from moeplan.layout import Layout
from moeplan.spec import ModelSpec
from moeplan.state import Dispatcher, LayerCost, PlanState, Sharding
from moeplan.targets import Target

ACT_BYTES = 2  # bf16 activations
#: ops recomputed under "selective" recompute: cheap to redo, expensive to keep (MindSpeed --recompute-norm,
#: --recompute-activation-function; Megatron-LM selective core-attention recompute, arXiv 2205.05198 §5)
SELECTIVE_KINDS = frozenset({OpKind.ELEMENTWISE, OpKind.NORM, OpKind.ATTENTION})


def op_scale(op: OpAnnotation, layout: Layout) -> float:
    """Factor from the traced per-sequence work (FLOPs, activation bytes) of ``op`` to one micro-batch on one
    device."""
    scale = layout.micro_batch / layout.cp
    if op.shard in (ShardHint.TP, ShardHint.EXPERT) or (op.shard == ShardHint.SP and layout.sequence_parallel):
        scale /= layout.tp
    return scale


def weight_scale(op: OpAnnotation, layout: Layout) -> float:
    """Share of the op's weights one device holds: 1/tp (TP), 1/(ep·tp) (routed experts: E/expert_shards experts,
    each split over etp), 1 (replicated or SP)."""
    if op.shard == ShardHint.TP:
        return 1 / layout.tp
    if op.shard == ShardHint.EXPERT:
        return 1 / (layout.ep * layout.tp)
    return 1.0


ROW_PARALLEL = frozenset({"o_proj", "w2"})
"""Linear layers whose input dim splits over TP (Megatron-LM's RowParallelLinear); other TP linears split their
output dim (ColumnParallelLinear)."""


def gemm_shape(op: OpAnnotation, layout: Layout) -> tuple[int, int, int] | None:
    """(M, N, K) of the op's dominant GEMM on one device under the layout, from the trace's per-sequence shape.

    M is the token dim: a micro-batch's tokens over cp (TP GEMMs see the whole sequence slice after SP's
    all-gather; SP and replicated ops their share), or for routed experts the tokens per local expert, which grow
    by ``micro_batch · expert_shards / (cp · tp)`` over the trace's balanced ``s·top_k/E``. TP splits N of a
    column-parallel linear and K of a row-parallel one (ROW_PARALLEL); expert-TP splits the experts' width N.
    """
    if op.matmul_mnk is None:
        return None
    m, n, k = op.matmul_mnk

    def up(x: float) -> int:
        return max(1, math.ceil(x - 1e-9))

    if op.shard == ShardHint.EXPERT:
        return (up(m * layout.micro_batch * layout.expert_shards / (layout.cp * layout.tp)), up(n / layout.etp), k)
    tokens = layout.micro_batch / layout.cp
    if op.shard == ShardHint.TP and op.op_kind in (OpKind.MATMUL, OpKind.GROUPED_MATMUL):
        row = op.module_path.rsplit(".", 1)[-1] in ROW_PARALLEL
        return (up(m * tokens), n if row else up(n / layout.tp), up(k / layout.tp) if row else k)
    return (up(m * op_scale(op, layout)), n, k)


@dataclass(frozen=True)
class ShardPass:
    """Price every layer kind under the layout: compute times, collectives, params and saved bytes per device."""

    name: ClassVar[str] = "shard"
    requires: ClassVar[tuple[str, ...]] = ()
    provides: ClassVar[tuple[str, ...]] = ("sharding",)

    def run(self, state: PlanState) -> PlanState:
        g, lay, tgt = state.graph, state.layout, state.target
        costs = {kind: layer_cost(lg, spec=g.spec, layout=lay, target=tgt, dispatcher=state.strategy.dispatcher)
                 for kind, lg in g.layers.items()}
        return state.with_(sharding=Sharding(layer_costs=costs, p2p=p2p_op(g.spec, lay, tgt)))


def layer_cost(lg: LayerGraph, *, spec: ModelSpec, layout: Layout, target: Target,
               dispatcher: Dispatcher = "flat", op_times: dict | None = None) -> LayerCost:
    """LayerCost of one layer of ``lg.kind`` for one micro-batch on one device (see the module docstring).

    ``op_times``: a memo of op prices the caller keeps across layouts of one traced graph and one target (the
    layout search: an attention op's price depends on tp, cp and the micro-batch only, not on ep or etp)."""
    fwd = dx = dw = sel_s = 0.0
    flops = fwd_flops = sel_flops = 0.0
    workspace = 0
    times = op_times_s(lg, layout=layout, target=target, memo=op_times)
    for op in lg.ops:
        s = op_scale(op, layout)
        f, i, w = times[op.name]
        fwd, dx, dw = fwd + f, dx + i, dw + w
        flops += s * (op.fwd_flops + op.bwd_input_flops + op.bwd_weight_flops)
        fwd_flops += s * op.fwd_flops
        workspace = max(workspace, int(2 * _dtype_scaled(op.output_bytes, op.output_fixed_bytes, target) * s))
        if op.op_kind in SELECTIVE_KINDS:
            sel_s += f
            sel_flops += s * op.fwd_flops
    extra = (0.0, 0.0)
    if _eager(target) and lg.ops:
        extra = (lg.grad_fanout_adds * target.launch.backward_kernel_s,
                 lg.param_tensor_count * target.launch.backward_kernel_s)
        dx, dw = dx + extra[0], dw + extra[1]
    saved, saved_sel = _saved_bytes(lg, layout, target)
    dense = lg.param_count - lg.expert_param_count + lg.shared_param_count
    steps = forward_steps(lg, spec=spec, layout=layout, target=target, dispatcher=dispatcher)
    return LayerCost(
        kind=lg.kind, fwd_s=fwd, bwd_input_s=dx, bwd_weight_s=dw, comm=layer_collectives(steps),
        program=program(steps, lambda op: times[op.name], bwd_extra_s=extra),
        params=int(dense / layout.tp + lg.expert_param_count / (layout.ep * layout.tp)),
        expert_params=int(lg.expert_param_count / (layout.ep * layout.tp)),
        saved_bytes=saved, saved_selective_bytes=saved_sel,
        saved_full_bytes=int(_dtype_scaled(lg.input_bytes, 0, target) * layout.micro_batch
                             / (layout.cp * _sp(layout))) if lg.ops else 0,
        recompute_selective_s=sel_s, recompute_full_s=fwd, executed_flops=flops,
        recompute_selective_flops=sel_flops, recompute_full_flops=fwd_flops, workspace_bytes=workspace)


def op_times_s(lg: LayerGraph, *, layout: Layout, target: Target, memo: dict | None = None
               ) -> dict[str, tuple[float, float, float]]:
    """Each op's (forward, dX, dW) seconds for one micro-batch on one device (cost_models/compute.py);
    ``memo`` as in :func:`layer_cost`."""
    memo = {} if memo is None else memo
    times = {}
    for op in lg.ops:
        s = op_scale(op, layout)
        ws, mnk = weight_scale(op, layout), gemm_shape(op, layout)
        key = (lg.kind, op.name, s, ws, mnk)
        if key not in memo:
            memo[key] = annotation_time_s(op, scale=s, target=target, weight_scale=ws, mnk=mnk)
        times[op.name] = memo[key]
    return times


def _sp(layout: Layout) -> int:
    return layout.tp if layout.sequence_parallel else 1


def _dtype_scaled(nbytes: float, fixed_bytes: float, target: Target) -> float:
    """IR (bf16) bytes in the target's training dtype: the bf16 part times ``dtype_bytes / 2``, the fixed part
    (``fixed_bytes``: indices, fp32 upcasts) as is."""
    return (nbytes - fixed_bytes) * target.dtype_bytes / ACT_BYTES + fixed_bytes


def _kept_scale(op: OpAnnotation, layout: Layout) -> float:
    """:func:`op_scale` for the bytes of ``op``'s output kept for backward. Under expert-TP (etp > 1) the dispatched
    rows (full hidden width) of every token of the etp group reach each of its ranks — Megatron-LM's
    ``MoEAlltoAllTokenDispatcher`` all-gathers them over TP after the all-to-all, moeplan's runtime before it — so
    the experts keep ``etp`` times the 1/tp share; only the FFN width inside the experts splits over etp."""
    scale = op_scale(op, layout)
    return scale * layout.etp if op.op_kind == OpKind.DISPATCH else scale


def _eager(target: Target) -> bool:
    return target.launch.granularity == "kernel"


def _internal_saved(op: OpAnnotation, target: Target) -> float:
    """Bytes the op keeps internally, in the target's dtype; the eager code's set on an eager (kernel) target."""
    if _eager(target) and op.eager_saved_bytes is not None:
        return _dtype_scaled(op.eager_saved_bytes, op.eager_saved_fixed_bytes, target)
    return _dtype_scaled(op.saved_bytes, op.saved_fixed_bytes, target)


def _saved_inputs(op: OpAnnotation, target: Target) -> tuple[str, ...]:
    """Producers whose outputs the op keeps; the eager code's on an eager (kernel) target."""
    if _eager(target) and op.eager_saved_inputs is not None:
        return op.eager_saved_inputs
    return op.saved_inputs


def _saved_bytes(lg: LayerGraph, layout: Layout, target: Target) -> tuple[int, int]:
    """(no recompute, selective) saved bytes per micro-batch in the target's dtype; each storage once.

    A kept output is charged to the producer that owns its storage (a saved view keeps its base alive:
    ``OpAnnotation.view_of`` followed to the first non-view). Under selective recompute the ops in SELECTIVE_KINDS
    drop what they save internally and their outputs are not kept; the inputs they need to be recomputed stay
    (those are outputs of kept ops or the layer input).
    """
    by_name = {o.name: o for o in lg.ops}

    def base(name: str) -> str:
        while name in by_name and by_name[name].view_of is not None:
            name = by_name[name].view_of
        return name

    input_scale = layout.micro_batch / (layout.cp * _sp(layout))
    internal = sel_internal = 0.0
    kept: set[str] = set()
    kept_sel: set[str] = set()
    for op in lg.ops:
        s = op_scale(op, layout)
        recomputed = op.op_kind in SELECTIVE_KINDS
        internal += _internal_saved(op, target) * s
        sel_internal += 0.0 if recomputed else _internal_saved(op, target) * s
        for name in map(base, _saved_inputs(op, target)):
            kept.add(name)
            if name not in by_name or by_name[name].op_kind not in SELECTIVE_KINDS:
                kept_sel.add(name)

    def outputs(names: set[str]) -> float:
        return sum(_dtype_scaled(by_name[n].output_bytes, by_name[n].output_fixed_bytes, target)
                   * _kept_scale(by_name[n], layout) if n in by_name
                   else _dtype_scaled(lg.input_bytes, 0, target) * input_scale for n in names)

    return int(internal + outputs(kept)), int(sel_internal + outputs(kept_sel))
