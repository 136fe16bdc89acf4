"""How a layout shards each layer (the ``shard`` pass's pricing): TP (+SP), EP (expert-TP or TP-extend-EP), CP
and DP, and the collectives each implies.

Per layer kind :func:`layer_cost` scales the traced per-sequence op costs to one micro-batch on one device, prices
them on the target (compute model) and orders them with the collectives the layout implies into the layer's
program (cost_models/layer_program.py: TP with SP, the EP dispatcher the strategy names, expert-TP, CP), which the
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
from dataclasses import dataclass, replace
from typing import Mapping

from moeplan.cost_models.compute import runs_fp8, annotation_time_s
from moeplan.cost_models.layer_program import (forward_steps, fsdp_collectives, layer_collectives, program,
                                               with_fsdp)
from moeplan.ir import LayerGraph, LayerKind, OpAnnotation, OpKind, ShardHint
from moeplan.layout import Layout
from moeplan.spec import ModelSpec
from moeplan.state import Dispatcher, LayerCost, Precision
from moeplan.targets import Target

ACT_BYTES = 2  # bf16 activations
#: ops recomputed under "selective" recompute: cheap to redo, expensive to keep (MindSpeed --recompute-norm,
#: --recompute-activation-function; Megatron-LM selective core-attention recompute, arXiv 2205.05198 §5)
SELECTIVE_KINDS = frozenset({OpKind.ELEMENTWISE, OpKind.NORM, OpKind.ATTENTION})


def op_scale(op: OpAnnotation, layout: Layout) -> float:
    """Factor from the traced per-sequence work (FLOPs, activation bytes) of ``op`` to one micro-batch on one
    device. A routed-expert op (permute, experts, unpermute) on the busiest rank of the expert group: times
    ``layout.expert_load``."""
    scale = layout.micro_batch / layout.cp
    if op.shard in (ShardHint.TP, ShardHint.EXPERT) or (op.shard == ShardHint.SP and layout.sequence_parallel):
        scale /= layout.tp
    return scale * layout.expert_load if op.shard == ShardHint.EXPERT else scale


def weight_scale(op: OpAnnotation, layout: Layout) -> float:
    """Share of the op's weights one device holds: 1/tp (TP), 1/(ep·tp) (routed experts: E/expert_shards experts,
    each split over etp), 1 (replicated or SP)."""
    if op.shard == ShardHint.TP:
        return 1 / layout.tp
    if op.shard == ShardHint.EXPERT:
        return layout.expert_replication / (layout.ep * layout.tp)
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

    if op.shard == ShardHint.EXPERT:  # the busiest rank's tokens per local expert (Layout.expert_load)
        tokens = m * layout.micro_batch * layout.expert_shards * layout.expert_load / (layout.cp * layout.tp)
        return (up(tokens / layout.expert_replication), up(n / layout.etp), k)
    tokens = layout.micro_batch / layout.cp
    if op.shard == ShardHint.TP and op.op_kind in (OpKind.MATMUL, OpKind.GROUPED_MATMUL):
        row = op.module_path.rsplit(".", 1)[-1] in ROW_PARALLEL
        return (up(m * tokens), n if row else up(n / layout.tp), up(k / layout.tp) if row else k)
    return (up(m * op_scale(op, layout)), n, k)


def layer_cost(lg: LayerGraph, *, spec: ModelSpec, layout: Layout, target: Target,
               dispatcher: Dispatcher = "flat", op_times: dict | None = None, precision: Precision = Precision()
               ) -> LayerCost:
    """LayerCost of one layer of ``lg.kind`` for one micro-batch on one device (see the module docstring);
    ``precision``: the recipe's (the SwiGLU's input in FP8, :func:`storage_bytes`; FSDP's gradient bytes).

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
        workspace = max(workspace, int(2 * dtype_scaled(op.output_bytes, op.output_fixed_bytes, target) * s))
        if op.op_kind in SELECTIVE_KINDS:
            sel_s += f
            sel_flops += s * op.fwd_flops
    extra = (0.0, 0.0)
    if eager(target) and lg.ops:
        extra = (lg.grad_fanout_adds * target.launch.backward_kernel_s,
                 lg.param_tensor_count * target.launch.backward_kernel_s)
        dx, dw = dx + extra[0], dw + extra[1]
    saved, saved_sel = _saved_bytes(lg, layout, target, precision.fp8_activation_input)
    dense = lg.param_count - lg.expert_param_count + lg.shared_param_count
    experts = lg.expert_param_count * layout.expert_replication / (layout.ep * layout.tp)  # replicas included
    steps = forward_steps(lg, spec=spec, layout=layout, target=target, dispatcher=dispatcher)
    prog, comm = program(steps, lambda op: times[op.name], bwd_extra_s=extra), layer_collectives(steps)
    from moeplan.cost_models.memory import DTYPE_BYTES, fsdp_reshards

    if layout.dp_shard > 1 and fsdp_reshards(layout):  # under PP, once per step (cost_models/step.py)
        gathers, scatters = fsdp_collectives(dense_params=dense / layout.tp,
                                             expert_params=experts,
                                             layout=layout, target=target,
                                             grad_bytes=DTYPE_BYTES[precision.grad_dtype])
        prog = with_fsdp(prog, gathers, scatters)
        comm += gathers + tuple(replace(g, phase="bwd") for g in gathers) + scatters
    return LayerCost(
        kind=lg.kind, fwd_s=fwd, bwd_input_s=dx, bwd_weight_s=dw, comm=comm, program=prog,
        params=int(dense / layout.tp + experts), expert_params=int(experts),
        saved_bytes=saved, saved_selective_bytes=saved_sel,
        saved_full_bytes=int(dtype_scaled(lg.input_bytes, 0, target) * layout.micro_batch
                             / (layout.cp * _sp(layout))) if lg.ops else 0,
        recompute_selective_s=sel_s, recompute_full_s=fwd, executed_flops=flops,
        recompute_selective_flops=sel_flops, recompute_full_flops=fwd_flops, workspace_bytes=workspace,
        shared_params=int(lg.shared_param_count / layout.tp), shared_owner=_owner(spec, lg))


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


def dtype_scaled(nbytes: float, fixed_bytes: float, target: Target) -> float:
    """IR (bf16) bytes in the target's training dtype: the bf16 part times ``dtype_bytes / 2``, the fixed part
    (``fixed_bytes``: indices, fp32 upcasts) as is."""
    return (nbytes - fixed_bytes) * target.dtype_bytes / ACT_BYTES + fixed_bytes


def kept_scale(op: OpAnnotation, layout: Layout) -> float:
    """:func:`op_scale` for the bytes of ``op``'s output kept for backward. Under expert-TP (etp > 1) the dispatched
    rows (full hidden width) of every token of the etp group reach each of its ranks — Megatron-LM's
    ``MoEAlltoAllTokenDispatcher`` all-gathers them over TP after the all-to-all, moeplan's runtime before it — so
    the experts keep ``etp`` times the 1/tp share; only the FFN width inside the experts splits over etp."""
    scale = op_scale(op, layout)
    return scale * layout.etp if op.op_kind == OpKind.DISPATCH else scale


def eager(target: Target) -> bool:
    return target.launch.granularity == "kernel"


def _owner(spec: ModelSpec, lg: LayerGraph) -> LayerKind | None:
    """The kind of the layer whose weights ``lg`` copies (moeplan/models/model.py ``shared_sources``), if any."""
    from moeplan.models.model import shared_sources
    from moeplan.trace import representative_layer

    owners = set(shared_sources(spec, representative_layer(spec, lg.kind)).values()) if lg.shared_param_count else set()
    return next((LayerKind.EMBEDDING if o.startswith("embedding.") else LayerKind.HEAD for o in owners), None)


def _label(op: OpAnnotation) -> str:
    from moeplan.cost_models.saved_tensors import label

    return label(op)


def _internal_saved(op: OpAnnotation, target: Target) -> float:
    """Bytes the op keeps internally, in the target's dtype; the eager code's set on an eager (kernel) target. Under
    FP8 training the part a GEMM keeps as its input is kept in FP8 (:func:`storage_bytes`)."""
    if eager(target) and op.eager_saved_bytes is not None:
        return dtype_scaled(op.eager_saved_bytes, op.eager_saved_fixed_bytes, target)
    nbytes = dtype_scaled(op.saved_bytes, op.saved_fixed_bytes, target)
    return nbytes - op.saved_gemm_input_bytes / 2 if runs_fp8(op, target) else nbytes


def saved_inputs(op: OpAnnotation, target: Target) -> tuple[str, ...]:
    """Producers whose outputs the op keeps; the eager code's on an eager (kernel) target."""
    if eager(target) and op.eager_saved_inputs is not None:
        return op.eager_saved_inputs
    return op.saved_inputs


@dataclass(frozen=True)
class StorageBytes:
    """Per micro-batch on one device, in the target's dtype: the bytes of each op output some op keeps for backward
    (``outputs``, by its producer's name; the layer input by its placeholder's name), of what each op keeps
    internally (``internal``, by op), and which ops keep each output (``savers``)."""

    outputs: Mapping[str, float]
    internal: Mapping[str, float]
    savers: Mapping[str, tuple[str, ...]]


def storage_bytes(lg: LayerGraph, layout: Layout, target: Target, fp8_act_input: bool = False) -> StorageBytes:
    """What each storage a layer may keep weighs (one home for the shard pass and cost_models/saved_tensors.py).

    A kept output is charged to the producer that owns its storage (a saved view keeps its base alive:
    ``OpAnnotation.view_of`` followed to the first non-view). Under FP8 training (GEMMs of the decoder layers in
    FP8, cost_models/compute.py) a GEMM keeps an FP8 copy of its input, not the input itself (Transformer Engine
    ``Linear``/``GroupedLinear`` save only the quantized input, module/linear.py @ v2.8): a storage only FP8 GEMMs
    keep weighs half, one kept by another op too weighs the original plus the FP8 copy. With ``fp8_act_input``
    the SwiGLU keeps its input in FP8 too (the dense one's gate and up outputs, the routed experts' gate/up part
    of what they keep internally)."""
    by_name = {o.name: o for o in lg.ops}

    def base(name: str) -> str:
        while name in by_name and by_name[name].view_of is not None:
            name = by_name[name].view_of  # type: ignore[assignment]
        return name

    input_scale = layout.micro_batch / (layout.cp * _sp(layout))

    def nbytes(name: str) -> float:
        return (dtype_scaled(by_name[name].output_bytes, by_name[name].output_fixed_bytes, target)
                * kept_scale(by_name[name], layout) if name in by_name
                else dtype_scaled(lg.input_bytes, 0, target) * input_scale)

    savers: dict[str, list[tuple[str, str]]] = {}  # storage -> (saver, the view of it the saver keeps)
    internal = {}
    act_fp8 = fp8_act_input and target.training_dtype == "fp8" and not eager(target)

    def fp8_keeper(op: OpAnnotation) -> bool:
        return runs_fp8(op, target) or (act_fp8 and "SwiGLU" in _label(op))

    for op in lg.ops:
        internal[op.name] = (_internal_saved(op, target)
                             - (op.saved_act_input_bytes / 2 if act_fp8 and runs_fp8(op, target) else 0.0)
                             ) * op_scale(op, layout)
        for view in saved_inputs(op, target):
            savers.setdefault(base(view), []).append((op.name, view))
    outputs = {}
    for name, who in savers.items():
        b = nbytes(name)
        fp8 = {view for w, view in who if fp8_keeper(by_name[w])}
        if not fp8:
            outputs[name] = b
            continue
        # a node's views (its tuple's items) are storages of their own in the production kernels: each saver
        # keeps the part it views, an FP8 keeper an FP8 copy of it
        rest = {view for w, view in who if not fp8_keeper(by_name[w])}
        outputs[name] = min(b, sum(map(nbytes, rest))) + min(b, sum(map(nbytes, fp8))) / 2
    return StorageBytes(outputs, internal, {k: tuple(w for w, _ in v) for k, v in savers.items()})


def _saved_bytes(lg: LayerGraph, layout: Layout, target: Target, fp8_act_input: bool = False) -> tuple[int, int]:
    """(no recompute, selective) saved bytes per micro-batch in the target's dtype; each storage once
    (:func:`storage_bytes`). Under selective recompute the ops in SELECTIVE_KINDS drop what they save internally
    and their outputs are not kept; the inputs they need to be recomputed stay (those are outputs of kept ops or
    the layer input)."""
    sb = storage_bytes(lg, layout, target, fp8_act_input)
    kinds = {o.name: o.op_kind for o in lg.ops}
    sel_internal = sum(b for n, b in sb.internal.items() if kinds[n] not in SELECTIVE_KINDS)
    kept_sel = sum(b for n, b in sb.outputs.items() if kinds.get(n) not in SELECTIVE_KINDS)
    return int(sum(sb.internal.values()) + sum(sb.outputs.values())), int(sel_internal + kept_sel)
