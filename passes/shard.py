"""Pass ``shard``: TP (+SP), EP (expert-TP or TP-extend-EP), CP and DP, and the collectives each implies.

Per layer kind it scales the traced per-sequence op costs to one micro-batch on one device and prices them on the
target (compute model), then adds the in-layer collectives (comm model):

- **TP with SP** (Korthikanti et al. arXiv 2205.05198 §4.2.2): per attention or MLP block an all-gather of the
  sequence-split activation before and a reduce-scatter after in forward, the mirror pair in backward, and for the
  column-parallel MLP and output layers one more all-gather in backward of the input they kept as the slice
  (Megatron-LM's sequence-parallel linear); MLA gathers its latents instead of the hidden state (Megatron-LM MLA).
  Without SP (tp > 1 only when sp is off, which moeplan never chooses) it would be one all-reduce each way.
- **EP** (Megatron-LM ``MoEAlltoAllTokenDispatcher``; MindSpeed ``--moe-tp-extend-ep``, FACTS §3): dispatch and
  combine all-to-alls over the ``ep·tp/etp`` expert shards, each moving the device's routed copies
  (tokens · top_k · hidden · 2 bytes), in forward and again in backward, after a small all-to-all of per-expert
  token counts in forward; with expert-TP (etp > 1) the routed tokens
  are also all-gathered / reduce-scattered over the etp group.
- **CP** (Megatron-LM context parallel, all-gather variant): K and V of the local heads are all-gathered over cp in
  forward and their gradients reduce-scattered in backward.
- **PP**: one micro-batch's hidden states, split over SP and CP, cross each stage boundary.

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

from dataclasses import dataclass, replace
from typing import ClassVar

from moeplan.cost_models.comm import all_to_all_time_s, collective_time_s, group_tier
from moeplan.cost_models.compute import annotation_time_s
from moeplan.ir import LayerGraph, LayerKind, OpAnnotation, OpKind, ShardHint
from moeplan.layout import Layout
from moeplan.spec import ModelSpec
from moeplan.state import CommOp, LayerCost, PlanState, Sharding
from moeplan.targets import Target

ACT_BYTES = 2  # bf16 activations
COUNT_BYTES = 8  # one int64 token count per expert, exchanged before each dispatch
LOSS_BYTES = 4  # one fp32 loss value
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


def m_scale(op: OpAnnotation, layout: Layout) -> float:
    """Growth of the GEMM's token dim: for routed experts, tokens per local expert on one device grow by
    micro_batch · expert_shards / (cp · tp) over the trace's balanced s·top_k/E; otherwise as ``op_scale``."""
    if op.shard == ShardHint.EXPERT:
        return layout.micro_batch * layout.expert_shards / (layout.cp * layout.tp)
    return op_scale(op, layout)


@dataclass(frozen=True)
class ShardPass:
    """Price every layer kind under the layout: compute times, collectives, params and saved bytes per device."""

    name: ClassVar[str] = "shard"
    requires: ClassVar[tuple[str, ...]] = ()
    provides: ClassVar[tuple[str, ...]] = ("sharding",)

    def run(self, state: PlanState) -> PlanState:
        g, lay, tgt = state.graph, state.layout, state.target
        costs = {kind: layer_cost(lg, spec=g.spec, layout=lay, target=tgt) for kind, lg in g.layers.items()}
        return state.with_(sharding=Sharding(layer_costs=costs, p2p=p2p_op(g.spec, lay, tgt)))


def layer_cost(lg: LayerGraph, *, spec: ModelSpec, layout: Layout, target: Target) -> LayerCost:
    """LayerCost of one layer of ``lg.kind`` for one micro-batch on one device (see the module docstring)."""
    fwd = dx = dw = sel_s = 0.0
    flops = fwd_flops = sel_flops = 0.0
    workspace = 0
    for op in lg.ops:
        s = op_scale(op, layout)
        f, i, w = annotation_time_s(op, scale=s, target=target, weight_scale=weight_scale(op, layout),
                                    m_scale=m_scale(op, layout))
        fwd, dx, dw = fwd + f, dx + i, dw + w
        flops += s * (op.fwd_flops + op.bwd_input_flops + op.bwd_weight_flops)
        fwd_flops += s * op.fwd_flops
        workspace = max(workspace, int(2 * _dtype_scaled(op.output_bytes, op.output_fixed_bytes, target) * s))
        if op.op_kind in SELECTIVE_KINDS:
            sel_s += f
            sel_flops += s * op.fwd_flops
    if _eager(target) and lg.ops:
        dx += lg.grad_fanout_adds * target.launch.backward_kernel_s
        dw += lg.param_tensor_count * target.launch.backward_kernel_s
    saved, saved_sel = _saved_bytes(lg, layout, target)
    dense = lg.param_count - lg.expert_param_count + lg.shared_param_count
    return LayerCost(
        kind=lg.kind, fwd_s=fwd, bwd_input_s=dx, bwd_weight_s=dw,
        comm=_layer_comm(lg.kind, spec=spec, layout=layout, target=target),
        params=int(dense / layout.tp + lg.expert_param_count / (layout.ep * layout.tp)),
        expert_params=int(lg.expert_param_count / (layout.ep * layout.tp)),
        saved_bytes=saved, saved_selective_bytes=saved_sel,
        saved_full_bytes=int(_dtype_scaled(lg.input_bytes, 0, target) * layout.micro_batch
                             / (layout.cp * _sp(layout))) if lg.ops else 0,
        recompute_selective_s=sel_s, recompute_full_s=fwd, executed_flops=flops,
        recompute_selective_flops=sel_flops, recompute_full_flops=fwd_flops, workspace_bytes=workspace)


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


def _act_bytes(spec: ModelSpec, layout: Layout, target: Target) -> int:
    """Bytes of one micro-batch's hidden states on one device after SP and CP splits: b·s·h·d/(cp·sp), d the
    target's training dtype bytes."""
    return layout.micro_batch * layout.seq_len * spec.hidden_size * target.dtype_bytes // (layout.cp * _sp(layout))


def _tp_pair(nbytes: int, layout: Layout, target: Target, *, gathered: int | None = None,
             regather: bool = True) -> tuple[CommOp, ...]:
    """One SP block (TP group, stride 1): all-gather of its input (``gathered`` bytes per rank, default ``nbytes``)
    and reduce-scatter of its ``nbytes``-per-rank output in forward; backward mirrors them (all-gather of the output
    gradient, reduce-scatter of the input gradient) and, with ``regather``, all-gathers the input again for the
    weight gradients (Megatron-LM's sequence-parallel column linear keeps only the slice; moeplan.runtime
    ``gather_linears``)."""
    if layout.tp == 1:
        return ()
    gathered = nbytes if gathered is None else gathered
    tier = group_tier(stride=1, group_size=layout.tp, devices_per_node=target.devices_per_node)

    def op(kind: str, phase: str, b: int) -> CommOp:
        per_rank = b if kind == "all_gather" else b * layout.tp
        t = collective_time_s(kind=kind, bytes=per_rank, group_size=layout.tp, tier=tier, target=target)
        return CommOp("tp", kind, phase, per_rank, layout.tp, tier, t)

    return (op("all_gather", "fwd", gathered), op("reduce_scatter", "fwd", nbytes),
            op("all_gather", "bwd", nbytes), op("reduce_scatter", "bwd", gathered)) + (
        (op("all_gather", "bwd", gathered),) if regather else ())


def _attention_gathered(spec: ModelSpec, act: int) -> int:
    """Bytes per rank the attention block all-gathers over TP: MLA gathers its latents (moeplan.runtime's
    ParallelMLA, Megatron-LM MLA under SP: ``q_lora_rank + kv_lora_rank + qk_rope_head_dim`` wide, or the hidden
    state plus the kv latent without a q latent); other attention the hidden state."""
    if spec.attention != "mla":
        return act
    width = (spec.q_lora_rank or spec.hidden_size) + spec.kv_lora_rank + spec.qk_rope_head_dim
    return act * width // spec.hidden_size


def _ep_ops(spec: ModelSpec, layout: Layout, target: Target) -> tuple[CommOp, ...]:
    """Dispatch + combine all-to-alls (fwd and bwd), the forward exchange of per-expert token counts that sizes the
    uneven dispatch (int64 per expert: Megatron-LM ``MoEAlltoAllTokenDispatcher.preprocess``; moeplan's runtime
    ``exchange_counts``) and, with expert-TP, the etp all-gather / reduce-scatter."""
    n = layout.expert_shards
    routed = _act_bytes(spec, layout, target) * spec.top_k
    ops: list[CommOp] = []
    if n > 1:
        stride = 1 if layout.tp_extend_ep else layout.tp
        t = all_to_all_time_s(bytes=routed, group_size=n, stride=stride, target=target)
        span_tier = group_tier(stride=stride, group_size=n, devices_per_node=target.devices_per_node)
        ops += [CommOp("ep", "all_to_all", ph, routed, n, span_tier, t) for ph in ("fwd", "bwd") for _ in range(2)]
        counts = COUNT_BYTES * spec.num_experts
        ops.append(CommOp("ep", "all_to_all", "fwd", counts, n, span_tier,
                          all_to_all_time_s(bytes=counts, group_size=n, stride=stride, target=target)))
    if layout.etp > 1:
        tier = group_tier(stride=1, group_size=layout.etp, devices_per_node=target.devices_per_node)

        def pair(nbytes: int) -> list[CommOp]:
            ag = collective_time_s(kind="all_gather", bytes=nbytes, group_size=layout.etp, tier=tier, target=target)
            rs = collective_time_s(kind="reduce_scatter", bytes=nbytes * layout.etp, group_size=layout.etp,
                                   tier=tier, target=target)
            return [CommOp("ep", "all_gather", "fwd", nbytes, layout.etp, tier, ag),
                    CommOp("ep", "reduce_scatter", "bwd", nbytes * layout.etp, layout.etp, tier, rs)]

        # the routed rows (and their mirror, the combined outputs), and the routing itself: gates and expert ids
        # of the rank's tokens (Megatron-LM gathers probs and the routing map over TP)
        ops += pair(routed) + [replace(o, phase="bwd" if o.phase == "fwd" else "fwd")
                               for o in pair(routed)]
        ops += pair(_act_bytes(spec, layout, target) // spec.hidden_size * 2 * spec.top_k)
    return tuple(ops)


def _cp_ops(spec: ModelSpec, layout: Layout, target: Target) -> tuple[CommOp, ...]:
    """K/V all-gather over cp in forward, gradient reduce-scatter in backward (stride tp)."""
    if layout.cp == 1:
        return ()
    heads = max(1, (spec.num_heads if spec.attention == "mla" else spec.num_kv_heads) // layout.tp)
    v_dim = spec.v_head_dim if spec.attention == "mla" else spec.head_dim
    kv = layout.micro_batch * layout.seq_len // layout.cp * heads * (spec.qk_head_dim + v_dim) * target.dtype_bytes
    tier = group_tier(stride=layout.tp, group_size=layout.cp, devices_per_node=target.devices_per_node)
    ag = collective_time_s(kind="all_gather", bytes=kv, group_size=layout.cp, tier=tier, target=target)
    rs = collective_time_s(kind="reduce_scatter", bytes=kv * layout.cp, group_size=layout.cp, tier=tier,
                           target=target)
    return (CommOp("cp", "all_gather", "fwd", kv, layout.cp, tier, ag),
            CommOp("cp", "reduce_scatter", "bwd", kv * layout.cp, layout.cp, tier, rs))


def _cp_loss_op(layout: Layout, target: Target) -> tuple[CommOp, ...]:
    """Under CP a head's micro-batch loss VALUE is summed over the CP group (one fp32 scalar all-reduce in forward,
    moeplan.runtime's ParallelHead) so every rank reports the same loss."""
    if layout.cp == 1:
        return ()
    tier = group_tier(stride=layout.tp, group_size=layout.cp, devices_per_node=target.devices_per_node)
    t = collective_time_s(kind="all_reduce", bytes=LOSS_BYTES, group_size=layout.cp, tier=tier, target=target)
    return (CommOp("cp", "all_reduce", "fwd", LOSS_BYTES, layout.cp, tier, t),)


def _layer_comm(kind: LayerKind, *, spec: ModelSpec, layout: Layout, target: Target) -> tuple[CommOp, ...]:
    act = _act_bytes(spec, layout, target)
    if kind in (LayerKind.EMBEDDING, LayerKind.EMPTY):
        return ()
    if kind in (LayerKind.HEAD, LayerKind.MTP_HEAD):
        # gather before the vocab-parallel output layer; in bwd its mirror and the re-gather
        ops = _tp_pair(act, layout, target)
        return ((ops[0], ops[3], ops[4]) if ops else ()) + _cp_loss_op(layout, target)
    attn = (_tp_pair(act, layout, target, gathered=_attention_gathered(spec, act), regather=False)
            + _cp_ops(spec, layout, target))
    if kind == LayerKind.DENSE:
        return attn + _tp_pair(act, layout, target)
    moe = _ep_ops(spec, layout, target)
    if spec.num_shared_experts or not layout.tp_extend_ep:
        moe += _tp_pair(act, layout, target, regather=bool(spec.num_shared_experts))
    return attn + moe


def p2p_op(spec: ModelSpec, layout: Layout, target: Target) -> CommOp:
    """One micro-batch's activations across a PP boundary; the pipeline's slowest hop sets the tier (stride
    tp·cp·dp over pp ranks: intra-node only when the whole pipeline sits in one node)."""
    nbytes = _act_bytes(spec, layout, target)
    tier = group_tier(stride=layout.tp * layout.cp * layout.dp, group_size=layout.pp,
                      devices_per_node=target.devices_per_node) if layout.pp > 1 else "intra"
    t = collective_time_s(kind="p2p", bytes=nbytes, group_size=2, tier=tier, target=target) if layout.pp > 1 else 0.0
    return CommOp("pp", "p2p", "fwd", nbytes, 2, tier, t)
