"""A layer as a program: compute segments and the collectives between them, in issue order (docs/step-model.md §1).

The ``shard`` pass prices every traced op; this module groups the ops of one layer into steps, inserts the
collectives the layout implies where the data needs them, and emits three segment lists (forward, input gradient,
weight gradient) that the timeline simulates: a collective waits for the compute that produces its input, and the
compute that consumes its output waits for it; whatever else is ready may run beside it.

Forward order of a decoder layer (dense, MoE, the MTP block's MoE layer), Megatron-LM's under TP + SP:

0. (the embedding layer, and the MTP block's embedding of the shifted tokens) the lookup in the rank's vocabulary
   shard → TP reduce-scatter of the partial embeddings onto the SP slice;
1. the input norm (and, for MLA, the q/kv down projections and their norms, which run on the sequence slice);
2. TP all-gather of the attention input (MLA: of the latents) → the per-head up projections → CP all-gather of K, V
   → core attention and the output projection → TP reduce-scatter;
3. dense FFN: TP all-gather → SwiGLU → TP reduce-scatter;
4. MoE: router and permute → (shared experts' TP all-gather) → (drop-and-pad: the gather of the chosen experts
   over tp×cp) → the count exchange (the host waits for the counts) → EP dispatch → (expert-TP gather of the row
   counts, the host waits for them; expert-TP all-gather of the rows) → grouped experts → (expert-TP
   reduce-scatter) → EP combine → unpermute; the shared experts' first GEMMs (w1, w3, SwiGLU) are
   issued right after the dispatch and the last (w2) after the combine: with the ``shared-expert`` mechanism
   (Megatron-LM ``--moe-shared-expert-overlap``) the dispatch and combine then run beside them.

The input-gradient pass runs the steps backwards: each collective's mirror (an all-gather's is a reduce-scatter, a
dispatch's a combine of gradients) and each compute step's dX; a dependency ``X after Y`` of the forward becomes
``Y' after X'``. Sequence-parallel column linears also all-gather their input again for the weight gradients
(Megatron-LM ``LinearWithGradAccumulationAndAsyncCommunication`` issues it asynchronously beside the dX GEMM:
``async_by="native"``); the weight-gradient pass waits for it. The weight-gradient pass is one compute segment.

Collective sizes (bytes per rank, as cost_models/comm.py counts them) are those the runtime sends
(moeplan/runtime): per TP block an all-gather and a reduce-scatter each way (Korthikanti et al. arXiv 2205.05198
§4.2.2), the embeddings' reduce-scatter, CP's all-gather of K and V (Megatron-LM context parallel, all-gather
variant), the EP dispatcher of cost_models/dispatch.py, expert-TP's gathers of row counts and rows, the
drop-and-pad gather of the chosen experts, the head's cross-entropy statistics gather over TP (:func:`tp_loss`)
and the one-fp32 loss all-reduce over CP.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from moeplan.cost_models.comm import (all_to_all_time_s, collective_time_s, group_tier, local_peer_range,
                                      wire_bytes)
from moeplan.cost_models.dispatch import Routing, dispatch_cost
from moeplan.ir import LayerGraph, LayerKind, OpAnnotation, OpKind, ShardHint
from moeplan.layout import Layout
from moeplan.mechanisms import MECHANISMS
from moeplan.spec import ModelSpec
from moeplan.state import CommOp, Dispatcher, LayerProgram, Segment
from moeplan.targets import Target

COUNT_BYTES = 8  # one int64 token count per expert, exchanged before each dispatch
LOSS_BYTES = 4  # one fp32 loss value
LOSS_STATS_BYTES = 8  # per token: the shard's log-sum-exp and its label logit, fp32
FP8_ROW_BYTES = 1 + 4 / 128  # e4m3 element + one fp32 scale per 1×128 tile (DeepSeek-V3 arXiv 2412.19437 §3.3.2)
_DOWN = frozenset({"q_a", "q_a_norm", "kv_a", "kv_norm", "rope_k"})

Price = Callable[[OpAnnotation], tuple[float, float, float]]


@dataclass(frozen=True)
class Step:
    """One forward step: compute over ``ops``, or the collective ``comm`` with its input-gradient mirror ``bwd``.

    ``bwd_extra``: a collective the input-gradient pass issues before this compute step's dX and the weight pass
    waits for (the SP re-gather). ``after``: names of the forward steps whose outputs this one needs.
    """

    name: str
    ops: tuple[OpAnnotation, ...] = ()
    comm: CommOp | None = None
    bwd: CommOp | None = None
    bwd_extra: CommOp | None = None
    after: tuple[str, ...] = ()
    async_by: str | None = None
    host_sync: bool = False


# ---- collectives -----------------------------------------------------------------------------------------------------
def act_bytes(spec: ModelSpec, layout: Layout, target: Target) -> int:
    """Bytes of one micro-batch's hidden states on one device after the SP and CP splits: ``b·s·h·d/(cp·sp)``, d the
    target's training dtype bytes."""
    sp = layout.tp if layout.sequence_parallel else 1
    return layout.micro_batch * layout.seq_len * spec.hidden_size * target.dtype_bytes // (layout.cp * sp)


def _single(comm_class: str, kind: str, phase: str, per_rank: float, group: int, tier: str,
            target: Target) -> CommOp:
    """A collective on one tier, its wire bytes by the ring / pairwise algorithms of cost_models/comm.py."""
    t = collective_time_s(kind=kind, bytes=per_rank, group_size=group, tier=tier, target=target)
    wire = wire_bytes(kind=kind, bytes=per_rank, group_size=group)  # type: ignore[arg-type]
    return CommOp(comm_class, kind, phase, int(per_rank), group, tier, t,  # type: ignore[arg-type]
                  wire_intra_bytes=wire if tier == "intra" else 0.0,
                  wire_inter_bytes=wire if tier == "inter" else 0.0)


@dataclass(frozen=True)
class TpPair:
    """One SP block's TP collectives: forward all-gather of the input and reduce-scatter of the output, their
    backward mirrors, and the backward re-gather of the input for the weight gradients (or None)."""

    gather: CommOp
    scatter: CommOp
    gather_grad: CommOp
    scatter_grad: CommOp
    regather: CommOp | None


def tp_pair(nbytes: int, layout: Layout, target: Target, *, gathered: int | None = None,
            regather: bool = True) -> TpPair | None:
    """TP collectives of one SP block (stride 1, ``nbytes`` per rank out, ``gathered`` per rank in); None at tp 1."""
    if layout.tp == 1:
        return None
    gathered = nbytes if gathered is None else gathered
    tier = group_tier(stride=1, group_size=layout.tp, devices_per_node=target.devices_per_node)

    def op(kind: str, phase: str, b: int) -> CommOp:
        return _single("tp", kind, phase, b if kind == "all_gather" else b * layout.tp, layout.tp, tier, target)

    return TpPair(op("all_gather", "fwd", gathered), op("reduce_scatter", "fwd", nbytes),
                  op("all_gather", "bwd", nbytes), op("reduce_scatter", "bwd", gathered),
                  op("all_gather", "bwd", gathered) if regather else None)


def attention_gathered(spec: ModelSpec, act: int) -> int:
    """Bytes per rank the attention block all-gathers over TP: MLA gathers its latents (Megatron-LM MLA under SP:
    ``q_lora_rank + kv_lora_rank + qk_rope_head_dim`` wide, or the hidden state plus the kv latent without a q
    latent); other attention the hidden state."""
    if spec.attention != "mla":
        return act
    width = (spec.q_lora_rank or spec.hidden_size) + spec.kv_lora_rank + spec.qk_rope_head_dim
    return act * width // spec.hidden_size


def cp_pair(spec: ModelSpec, layout: Layout, target: Target) -> tuple[CommOp, CommOp] | None:
    """K/V all-gather over cp in forward and the gradient reduce-scatter in backward (stride tp)."""
    if layout.cp == 1:
        return None
    heads = max(1, (spec.num_heads if spec.attention == "mla" else spec.num_kv_heads) // layout.tp)
    v_dim = spec.v_head_dim if spec.attention == "mla" else spec.head_dim
    kv = layout.micro_batch * layout.seq_len // layout.cp * heads * (spec.qk_head_dim + v_dim) * target.dtype_bytes
    tier = group_tier(stride=layout.tp, group_size=layout.cp, devices_per_node=target.devices_per_node)
    return (_single("cp", "all_gather", "fwd", kv, layout.cp, tier, target),
            _single("cp", "reduce_scatter", "bwd", kv * layout.cp, layout.cp, tier, target))


def cp_loss(layout: Layout, target: Target) -> CommOp | None:
    """Under CP the head's loss value is summed over the CP group (one fp32 all-reduce in forward)."""
    if layout.cp == 1:
        return None
    tier = group_tier(stride=layout.tp, group_size=layout.cp, devices_per_node=target.devices_per_node)
    return _single("cp", "all_reduce", "fwd", LOSS_BYTES, layout.cp, tier, target)


def tp_loss(layout: Layout, target: Target) -> CommOp | None:
    """Under TP the vocab-parallel cross-entropy all-gathers, per token of the micro-batch's CP slice, each shard's
    log-sum-exp and label logit (fp32, :data:`LOSS_STATS_BYTES`) in forward; its backward needs no collective
    (moeplan.runtime.tensor_parallel.vocab_parallel_cross_entropy). Megatron-LM's ``_VocabParallelCrossEntropy``
    moves the same values in three all-reduces of one fp32 per token."""
    if layout.tp == 1:
        return None
    tier = group_tier(stride=1, group_size=layout.tp, devices_per_node=target.devices_per_node)
    tokens = layout.micro_batch * layout.seq_len // layout.cp
    return _single("tp", "all_gather", "fwd", tokens * LOSS_STATS_BYTES, layout.tp, tier, target)


def routing_of(spec: ModelSpec) -> Routing:
    return Routing(num_experts=spec.num_experts, top_k=spec.top_k, routing=spec.routing,
                   num_groups=spec.num_expert_groups, topk_groups=spec.topk_groups)


def expert_group(layout: Layout) -> tuple[int, int]:
    """(size, stride) of the expert group: ``ep·tp/etp`` ranks, stride 1 with TP-extend-EP, else ``tp``."""
    return layout.expert_shards, 1 if layout.tp_extend_ep else layout.tp


def ep_transfer(spec: ModelSpec, layout: Layout, target: Target, dispatcher: Dispatcher, phase: str, *,
                dispatch_direction: bool, metadata: bool = True) -> CommOp | None:
    """One EP dispatch (``dispatch_direction``) or combine of the rank's routed tokens; None without EP.

    FP8 training sends the dispatch direction (forward dispatch, backward combine-gradient) in FP8 with 1×128
    scales and the combine direction in bf16 (DeepSeek-V3 §3.3.3 "Low-Precision Communication"). ``metadata``:
    the routing metadata travel with the rows (the forward dispatch and its backward mirror only,
    moeplan.cost_models.dispatch).

    Imbalanced routing (``layout.expert_load`` > 1): every rank sends its own ``T·top_k`` copies, but the busiest
    rank of the group receives ``expert_load`` times the balanced share (and sends that many back in the combine);
    an all-to-all ends when its busiest endpoint has moved its bytes, so the transfer is priced as a dispatch of
    ``expert_load·T`` tokens (docs/load-balance.md)."""
    n, stride = expert_group(layout)
    if n == 1:
        return None
    tokens = act_bytes(spec, layout, target) / (spec.hidden_size * target.dtype_bytes) * layout.expert_load
    payload = FP8_ROW_BYTES if dispatch_direction and target.training_dtype == "fp8" else target.dtype_bytes
    cost = dispatch_cost(dispatcher, tokens=tokens, hidden=spec.hidden_size, payload_bytes=payload,
                         routing=routing_of(spec), group_size=n, stride=stride, target=target, metadata=metadata)
    tier = "inter" if cost.wire_inter_bytes > 0 else "intra"
    routed = int(tokens * spec.top_k * spec.hidden_size * payload)
    return CommOp("ep", "all_to_all", phase, routed, n, tier, cost.time_s,  # type: ignore[arg-type]
                  wire_intra_bytes=cost.wire_intra_bytes, wire_inter_bytes=cost.wire_inter_bytes,
                  busy_intra_s=cost.busy_intra_s, busy_inter_s=cost.busy_inter_s)


def count_exchange(spec: ModelSpec, layout: Layout, target: Target, dispatcher: Dispatcher = "flat") -> CommOp | None:
    """The all-to-all of token counts that sizes the dispatch, dropless or not (int64s: Megatron-LM
    ``MoEAlltoAllTokenDispatcher.preprocess``; moeplan's runtime ``exchange_counts``), as the runtime sends it:

    - ``flat`` (and ``dedup`` within one node): ``E/n`` counts (one per expert of the receiving rank) to each of the
      ``n − 1`` other ranks: ``(g − 1)/n · 8E`` bytes over the intra-node link and ``(n − g)/n · 8E`` inter-node;
    - ``hierarchical``: the same over the node's ``g`` ranks only: ``(g − 1) · 8E/n`` intra-node;
    - ``dedup``: one count per peer before each hop: ``8 · (nodes − 1)`` inter-node, ``8 · (g − 1)`` intra-node.

    ``g``: the expert group's ranks on a node (:func:`moeplan.cost_models.comm.local_peer_range`); the two hops
    of dedup run one after the other."""
    n, stride = expert_group(layout)
    if n == 1:
        return None
    g_min, g_max = local_peer_range(stride=stride, group_size=n, devices_per_node=target.devices_per_node)
    counts = COUNT_BYTES * spec.num_experts
    if dispatcher == "flat" or g_min == n:
        intra, inter = counts * (g_max - 1) / n, counts * (n - g_min) / n
        t = all_to_all_time_s(bytes=counts, group_size=n, stride=stride, target=target)
    elif dispatcher == "hierarchical":
        intra, inter = counts / n * (g_min - 1), 0.0
        t = collective_time_s(kind="all_to_all", bytes=counts / n * g_min, group_size=g_min, tier="intra",
                              target=target)
    else:
        nodes = n // g_min
        intra, inter = COUNT_BYTES * (g_min - 1), COUNT_BYTES * (nodes - 1)
        t = (collective_time_s(kind="all_to_all", bytes=COUNT_BYTES * nodes, group_size=nodes, tier="inter",
                               target=target)
             + collective_time_s(kind="all_to_all", bytes=COUNT_BYTES * g_min, group_size=g_min, tier="intra",
                                 target=target))
    return CommOp("ep", "all_to_all", "fwd", counts, n, "inter" if inter > 0 else "intra", t,
                  wire_intra_bytes=intra, wire_inter_bytes=inter)


def capacity_gather(spec: ModelSpec, layout: Layout, target: Target) -> CommOp | None:
    """Drop-and-pad (``capacity_factor``) under TP or CP: the all-gather over the tp×cp group (stride 1) of each
    rank's chosen experts (int64 ``[own tokens, k]``), so that every rank drops the same slots as the whole
    micro-batch would (moeplan's runtime ``ParallelMoE._keep``). None when dropless or tp·cp = 1."""
    n = layout.tp * layout.cp
    if spec.capacity_factor is None or n == 1:
        return None
    tokens = layout.micro_batch * layout.seq_len // n
    tier = group_tier(stride=1, group_size=n, devices_per_node=target.devices_per_node)
    return _single("ep", "all_gather", "fwd", tokens * spec.top_k * COUNT_BYTES, n, tier, target)


def etp_counts(spec: ModelSpec, layout: Layout, target: Target) -> CommOp | None:
    """Expert-TP: before the uneven all-gather of the dispatched rows, the all-gather over etp of how many rows
    each peer received for each of its local experts (int64 ``[expert group, local experts]``, ``8E`` bytes per rank
    with an even placement); the host waits for them to size the gather (Megatron-LM
    ``MoEAlltoAllTokenDispatcher.dispatch_postprocess``; moeplan's runtime ``ParallelMoE._experts``)."""
    if layout.etp == 1:
        return None
    tier = group_tier(stride=1, group_size=layout.etp, devices_per_node=target.devices_per_node)
    return _single("ep", "all_gather", "fwd", COUNT_BYTES * spec.num_experts, layout.etp, tier, target)


def etp_pair(nbytes: float, layout: Layout, target: Target) -> tuple[CommOp, CommOp] | None:
    """Expert-TP: all-gather of ``nbytes`` per rank over etp in forward, reduce-scatter of the gradient in
    backward."""
    if layout.etp == 1:
        return None
    tier = group_tier(stride=1, group_size=layout.etp, devices_per_node=target.devices_per_node)
    return (_single("ep", "all_gather", "fwd", nbytes, layout.etp, tier, target),
            _single("ep", "reduce_scatter", "bwd", nbytes * layout.etp, layout.etp, tier, target))


def p2p_op(spec: ModelSpec, layout: Layout, target: Target) -> CommOp:
    """One micro-batch's activations across a PP boundary; the pipeline's slowest hop sets the tier (stride
    tp·cp·dp over pp ranks: intra-node only when the whole pipeline sits in one node)."""
    nbytes = act_bytes(spec, layout, target)
    if layout.pp == 1:
        return CommOp("pp", "p2p", "fwd", nbytes, 2, "intra", 0.0)
    tier = group_tier(stride=layout.tp * layout.cp * layout.dp, group_size=layout.pp,
                      devices_per_node=target.devices_per_node)
    return _single("pp", "p2p", "fwd", nbytes, 2, tier, target)


# ---- steps of a layer --------------------------------------------------------------------------------------------------
def _parts(op: OpAnnotation) -> list[str]:
    return op.module_path.split(".") if op.module_path else []


def _role(op: OpAnnotation) -> str:
    parts = _parts(op)
    if "attn" in parts:
        return "attn"
    if "shared" in parts:
        return "shared_fc2" if parts[-1] == "w2" else "shared_fc1"
    if "mlp" in parts:
        return "mlp"
    return "glue"


def _comm_step(name: str, comm: CommOp | None, bwd: CommOp | None, after: str, **kw) -> list[Step]:
    return [Step(name, comm=comm, bwd=bwd, after=(after,), **kw)] if comm is not None or bwd is not None else []


def _attention_steps(ops: Sequence[OpAnnotation], prev: str, *, pair: TpPair | None,
                     cp: tuple[CommOp, CommOp] | None) -> list[Step]:
    """pre/down → TP gather → up projections → CP gather → core + output projection → TP scatter."""
    core_at = next(i for i, o in enumerate(ops) if o.op_kind == OpKind.ATTENTION)
    down = tuple(o for o in ops[:core_at] if o.shard != ShardHint.TP or (_parts(o) and _parts(o)[-1] in _DOWN))
    up = tuple(o for o in ops[:core_at] if o not in down)
    steps = [Step("attn_down", ops=down, after=(prev,))]
    steps += _comm_step("attn_gather", pair and pair.gather, pair and pair.scatter_grad, "attn_down")
    steps.append(Step("attn_up", ops=up, after=(steps[-1].name,)))
    steps += _comm_step("cp_gather", cp and cp[0], cp and cp[1], "attn_up")
    steps.append(Step("attn_core", ops=tuple(ops[core_at:]), after=(steps[-1].name,)))
    steps += _comm_step("attn_scatter", pair and pair.scatter, pair and pair.gather_grad, "attn_core")
    return steps


def _ffn_steps(ops: Sequence[OpAnnotation], prev: str, pair: TpPair | None) -> list[Step]:
    steps = _comm_step("ffn_gather", pair and pair.gather, pair and pair.scatter_grad, prev)
    steps.append(Step("ffn", ops=tuple(ops), after=(steps[-1].name if steps else prev,),
                      bwd_extra=pair.regather if pair else None))
    steps += _comm_step("ffn_scatter", pair and pair.scatter, pair and pair.gather_grad, "ffn")
    return steps


@dataclass(frozen=True)
class MoeComm:
    """The collectives of one MoE block under a layout and dispatcher (None where the layout needs none)."""

    shared_pair: TpPair | None  # the shared experts' TP block (or, without them under expert-TP, the MoE block's)
    counts: CommOp | None
    dispatch: CommOp | None
    dispatch_grad: CommOp | None  # the backward mirror of the dispatch: a combine of gradients
    combine: CommOp | None
    combine_grad: CommOp | None  # the backward mirror of the combine: a dispatch of gradients
    etp_counts: CommOp | None
    etp_rows: tuple[CommOp, CommOp] | None
    etp_rows_back: tuple[CommOp, CommOp] | None  # reduce-scatter in forward, all-gather in backward
    capacity: CommOp | None  # drop-and-pad: the chosen experts gathered over tp×cp


def moe_comm(spec: ModelSpec, layout: Layout, target: Target, dispatcher: Dispatcher) -> MoeComm:
    act = act_bytes(spec, layout, target)
    routed = act * spec.top_k
    rows = etp_pair(routed, layout, target)
    back = None if rows is None else (replace(rows[1], phase="fwd"), replace(rows[0], phase="bwd"))
    shared = spec.num_shared_experts > 0
    return MoeComm(
        shared_pair=tp_pair(act, layout, target, regather=shared) if shared or not layout.tp_extend_ep else None,
        counts=count_exchange(spec, layout, target, dispatcher),
        dispatch=ep_transfer(spec, layout, target, dispatcher, "fwd", dispatch_direction=True),
        dispatch_grad=ep_transfer(spec, layout, target, dispatcher, "bwd", dispatch_direction=False),
        combine=ep_transfer(spec, layout, target, dispatcher, "fwd", dispatch_direction=False, metadata=False),
        combine_grad=ep_transfer(spec, layout, target, dispatcher, "bwd", dispatch_direction=True, metadata=False),
        etp_counts=etp_counts(spec, layout, target), etp_rows=rows, etp_rows_back=back,
        capacity=capacity_gather(spec, layout, target))


def _moe_steps(ops: Sequence[OpAnnotation], prev: str, c: MoeComm, has_shared: bool) -> list[Step]:
    """router + permute → … → unpermute (module docstring, step 4)."""
    route = tuple(o for o in ops if _role(o) == "mlp" and o.op_kind not in (OpKind.GROUPED_MATMUL, OpKind.COMBINE)
                  and ops.index(o) < next(i for i, x in enumerate(ops) if x.op_kind == OpKind.GROUPED_MATMUL))
    experts = tuple(o for o in ops if o.op_kind == OpKind.GROUPED_MATMUL)
    combine_at = next(i for i, x in enumerate(ops) if x.op_kind == OpKind.COMBINE)
    unpermute = (ops[combine_at],)
    tail = tuple(o for o in ops[combine_at + 1:] if _role(o) == "mlp")
    fc1 = tuple(o for o in ops if _role(o) == "shared_fc1")
    fc2 = tuple(o for o in ops if _role(o) == "shared_fc2")
    pair = c.shared_pair
    steps = [Step("route", ops=route, after=(prev,))]
    if has_shared:
        steps += _comm_step("shared_gather", pair and pair.gather, pair and pair.scatter_grad, prev)
    else:  # expert-TP without shared experts: the block's TP gather before routing (moeplan's runtime)
        steps = _comm_step("moe_gather", pair and pair.gather, pair and pair.scatter_grad, prev) + [
            Step("route", ops=route, after=("moe_gather" if pair else prev,))]
    steps += _comm_step("capacity_gather", c.capacity, None, "route")
    steps += _comm_step("ep_counts", c.counts, None, "capacity_gather" if c.capacity else "route", host_sync=True)
    last = steps[-1].name
    steps += _comm_step("dispatch", c.dispatch, c.dispatch_grad, steps[-1].name)
    shared_in = "shared_gather" if has_shared and pair else prev
    if has_shared:
        steps.append(Step("shared_fc1", ops=fc1, after=(shared_in,), bwd_extra=pair.regather if pair else None))
    steps += _comm_step("etp_counts", c.etp_counts, None, "dispatch" if c.dispatch or c.dispatch_grad else last,
                        host_sync=True)
    steps += _comm_step("etp_gather", c.etp_rows and c.etp_rows[0], c.etp_rows and c.etp_rows[1], steps[-1].name)
    feed = [s.name for s in steps if s.name in ("dispatch", "etp_gather")] or ["route"]
    steps.append(Step("experts", ops=experts, after=tuple(feed)))
    steps += _comm_step("etp_scatter", c.etp_rows_back and c.etp_rows_back[0],
                        c.etp_rows_back and c.etp_rows_back[1], "experts")
    steps += _comm_step("combine", c.combine, c.combine_grad, steps[-1].name)
    if has_shared:
        steps.append(Step("shared_fc2", ops=fc2, after=("shared_fc1",)))
    steps.append(Step("unpermute", ops=unpermute, after=(steps[-2].name if has_shared else steps[-1].name,)))
    if has_shared:
        steps += _comm_step("shared_scatter", pair and pair.scatter, pair and pair.gather_grad, "shared_fc2")
        ends = ["unpermute", "shared_scatter" if pair else "shared_fc2"]
    else:
        steps += _comm_step("moe_scatter", pair and pair.scatter, pair and pair.gather_grad, "unpermute")
        ends = [steps[-1].name]
    steps.append(Step("moe_tail", ops=tail, after=tuple(ends)))
    return steps


def _embedding_steps(ops: Sequence[OpAnnotation], pair: TpPair | None, rest: str) -> list[Step]:
    """The ops up to a vocab-parallel embedding lookup (``embed``), the TP reduce-scatter of its output (each rank
    holds the rows of its vocabulary shard; Megatron-LM ``VocabParallelEmbedding`` under SP) with the all-gather of
    the gradient as its mirror, then the remaining ops (``rest``). Without an embedding op or TP: all one step."""
    at = next((i for i, o in enumerate(ops) if o.op_kind == OpKind.EMBEDDING), None)
    if at is None or pair is None:
        return [Step(rest, ops=tuple(ops))] if ops else []
    steps = [Step("embed", ops=tuple(ops[:at + 1])),
             Step("embed_scatter", comm=pair.scatter, bwd=pair.gather_grad, after=("embed",))]
    if at + 1 < len(ops):
        steps.append(Step(rest, ops=tuple(ops[at + 1:]), after=("embed_scatter",)))
    return steps


def forward_steps(lg: LayerGraph, *, spec: ModelSpec, layout: Layout, target: Target,
                  dispatcher: Dispatcher) -> list[Step]:
    """The forward steps of one layer of ``lg.kind`` (module docstring), each collective an overlap mechanism hides
    tagged with its name (:func:`_tag_hidden`)."""
    return _tag_hidden(_layer_steps(lg, spec=spec, layout=layout, target=target, dispatcher=dispatcher))


def _tag_hidden(steps: list[Step]) -> list[Step]:
    """``steps`` with ``async_by`` set on each collective step that a registered overlap mechanism ``hides``
    (moeplan/mechanisms.py) in a layer that has the step it hides behind: the timeline runs it beside compute when
    that mechanism is on."""
    names = {s.name for s in steps}
    tags = {hidden: m.name for m in MECHANISMS.values() if m.behind is None or m.behind in names for hidden in m.hides}
    return [replace(s, async_by=tags[s.name]) if s.name in tags and s.async_by is None and (s.comm or s.bwd) else s
            for s in steps]


def _layer_steps(lg: LayerGraph, *, spec: ModelSpec, layout: Layout, target: Target,
                 dispatcher: Dispatcher) -> list[Step]:
    ops = lg.ops
    if not ops:
        return []
    act = act_bytes(spec, layout, target)
    if lg.kind in (LayerKind.EMBEDDING, LayerKind.EMPTY):
        return _embedding_steps(ops, tp_pair(act, layout, target), "compute")
    if lg.kind in (LayerKind.HEAD, LayerKind.MTP_HEAD):
        pair = tp_pair(act, layout, target)
        first_tp = next((i for i, o in enumerate(ops) if o.shard == ShardHint.TP and o.op_kind != OpKind.ELEMENTWISE),
                        len(ops))
        steps = [Step("head_norm", ops=tuple(ops[:first_tp]))]
        steps += _comm_step("head_gather", pair and pair.gather, pair and pair.scatter_grad, "head_norm")
        steps.append(Step("logits_loss", ops=tuple(ops[first_tp:]), after=(steps[-1].name,),
                          bwd_extra=pair.regather if pair else None))
        steps += _comm_step("tp_loss", tp_loss(layout, target), None, "logits_loss")
        steps += _comm_step("cp_loss", cp_loss(layout, target), None, steps[-1].name)
        return steps
    first_attn = next(i for i, o in enumerate(ops) if _role(o) == "attn")
    last_attn = max(i for i, o in enumerate(ops) if _role(o) == "attn")
    first_mlp = next(i for i, o in enumerate(ops) if _role(o) != "attn" and _role(o) != "glue" and i > last_attn)
    pre = ops[:first_attn]
    attn_ops = [o for o in ops[first_attn:last_attn + 1]]
    mid = tuple(o for o in ops[last_attn + 1:first_mlp] if _role(o) == "glue")
    mlp_ops = [o for o in ops[first_mlp:] if _role(o) != "glue"]
    end = tuple(o for o in ops[first_mlp:] if _role(o) == "glue")
    pair = tp_pair(act, layout, target, gathered=attention_gathered(spec, act), regather=False)
    steps = _embedding_steps(pre, tp_pair(act, layout, target), "pre") or [Step("pre")]
    steps += _attention_steps(attn_ops, steps[-1].name, pair=pair, cp=cp_pair(spec, layout, target))
    steps.append(Step("mid", ops=mid, after=(steps[-1].name,)))
    if lg.kind == LayerKind.DENSE:
        steps += _ffn_steps(mlp_ops, "mid", tp_pair(act, layout, target))
    else:
        steps += _moe_steps(mlp_ops, "mid", moe_comm(spec, layout, target, dispatcher),
                            has_shared=spec.num_shared_experts > 0)
    steps.append(Step("post", ops=end, after=(steps[-1].name,)))
    return steps


# ---- segments ----------------------------------------------------------------------------------------------------------
def _active(ops: Sequence[OpAnnotation], price: Price, part: int) -> tuple[float, int]:
    times = [price(o)[part] for o in ops]
    return sum(times), sum(1 for t in times if t > 0)


def program(steps: Sequence[Step], price: Price, *, bwd_extra_s: tuple[float, float] = (0.0, 0.0),
            bwd_extra_kernels: tuple[int, int] = (0, 0)) -> LayerProgram:
    """Segments of the forward, input-gradient and weight-gradient passes of ``steps``.

    ``price(op)`` gives an op's (forward, dX, dW) seconds; a compute segment launches one kernel per op with work
    in that pass. ``bwd_extra_s`` / ``bwd_extra_kernels``: per-layer extra seconds and kernels of the dX and dW
    passes (an eager runtime's gradient additions and per-parameter accumulation), added to their last segment.
    Steps with no work are dropped and the dependencies through them kept. The weight pass has one segment per
    step with weights, in backward order; its ``after`` indices point into the input-gradient list (the step's dX
    and its ``native`` re-gather): a weight gradient needs the gradient its dX received (LayerProgram).
    """
    fwd, _, _ = _pass(steps, price, part=0, reverse=False)
    bwd, through, regather = _pass(steps, price, part=1, reverse=True)
    bwd = _add_last(bwd, bwd_extra_s[0], bwd_extra_kernels[0])
    weight: list[Segment] = []
    for s in reversed(steps):
        t, k = _active(s.ops, price, 2)
        if t > 0 or k:
            after = through.get(s.name, ()) + ((regather[s.name],) if s.name in regather else ())
            weight.append(Segment(f"{s.name}_dw", "compute", t, after=after, kernels=k, deferrable=True))
    if bwd_extra_s[1] or bwd_extra_kernels[1]:
        weight = _add_last(weight, bwd_extra_s[1], bwd_extra_kernels[1])
    return LayerProgram(fwd=tuple(fwd), bwd_input=tuple(bwd), bwd_weight=tuple(weight))


def fsdp_collectives(*, dense_params: float, expert_params: float, layout: Layout, target: Target,
                     grad_bytes: int) -> tuple[tuple[CommOp, ...], tuple[CommOp, ...]]:
    """(all-gathers, reduce-scatters) of one layer's weights under FSDP (``layout.dp_shard > 1``): the dense weights
    the rank holds under TP (``dense_params``) over ``layout.fsdp_group`` ranks ``tp`` apart, the routed experts'
    (``expert_params``) over ``layout.expert_fsdp_group`` ranks ``tp·ep`` apart; the gathers of the weights in the
    training dtype, the reduce-scatters of their gradients at ``grad_bytes`` (PyTorch FSDP2 ``fully_shard``, one
    all-gather and one reduce-scatter per module; Zhao et al. arXiv 2304.11277 §3)."""
    gathers, scatters = [], []
    for params, group, stride in ((dense_params, layout.fsdp_group, layout.tp),
                                  (expert_params, layout.expert_fsdp_group, layout.tp * layout.ep)):
        if params <= 0 or group <= 1:
            continue
        tier = group_tier(stride=stride, group_size=group, devices_per_node=target.devices_per_node)
        gathers.append(_single("dp", "all_gather", "fwd", params * target.dtype_bytes / group, group, tier, target))
        scatters.append(_single("dp", "reduce_scatter", "bwd", params * grad_bytes, group, tier, target))
    return tuple(gathers), tuple(scatters)


def with_fsdp(prog: LayerProgram, gathers: Sequence[CommOp], scatters: Sequence[CommOp]) -> LayerProgram:
    """``prog`` with FSDP's per-micro-batch collectives (memory.py ``fsdp_reshards``): the weights' all-gathers
    issued before the forward and again before the input-gradient pass (the weights were freed after the forward),
    the gradients' reduce-scatters after the backward. FSDP2 runs them on their own streams and prefetches the next
    layer's gather while this one computes (``async_by="native"``: the compute stream does not wait for them, they
    hold their link tier)."""
    if not gathers and not scatters:
        return prog

    def prepend(segs: tuple[Segment, ...], phase: str) -> tuple[Segment, ...]:
        head = tuple(Segment(f"fsdp_gather_{i}", "comm", c.time_s, comm=replace(c, phase=phase), kernels=1,
                             async_by="native") for i, c in enumerate(gathers))
        return head + tuple(s.with_after(tuple(a + len(head) for a in s.after)) for s in segs)

    fwd, bwd = prepend(prog.fwd, "fwd"), prepend(prog.bwd_input, "bwd")
    shift = len(bwd) - len(prog.bwd_input)
    weight = tuple(s.with_after(tuple(a + shift for a in s.after)) for s in prog.bwd_weight)
    last = (len(bwd) - 1,) if bwd else ()
    bwd += tuple(Segment(f"fsdp_scatter_{i}", "comm", c.time_s, after=last, comm=c, kernels=1, async_by="native")
                 for i, c in enumerate(scatters))
    return LayerProgram(fwd=fwd, bwd_input=bwd, bwd_weight=weight)


def _add_last(segs: list[Segment], seconds: float, kernels: int) -> list[Segment]:
    if not seconds and not kernels:
        return segs
    at = max((i for i, s in enumerate(segs) if s.kind == "compute"), default=None)
    if at is None:
        return segs + [Segment("grad_accumulate", "compute", seconds, kernels=kernels)]
    segs[at] = replace(segs[at], seconds=segs[at].seconds + seconds, kernels=segs[at].kernels + kernels)
    return segs


def _pass(steps: Sequence[Step], price: Price, *, part: int,
          reverse: bool) -> tuple[list[Segment], dict[str, tuple[int, ...]], dict[str, int]]:
    """One pass's segments, and per step the segment indices that stand for its completion and the index of its
    re-gather. Forward: steps in order, deps as declared. Backward: steps reversed, mirrors of the collectives,
    each dependency reversed; a compute step's ``bwd_extra`` collective is issued before its dX."""
    order = list(reversed(steps)) if reverse else list(steps)
    needs: dict[str, set[str]] = {s.name: set() for s in steps}
    for s in steps:
        for a in s.after:
            if a in needs:
                (needs[a] if reverse else needs[s.name]).add(s.name if reverse else a)
    out: list[Segment] = []
    index: dict[str, int] = {}  # step name -> segment index
    through: dict[str, tuple[int, ...]] = {}  # step name -> its segment, or what it forwards to when dropped
    regather: dict[str, int] = {}
    for s in order:
        deps = tuple(sorted({i for n in needs[s.name] for i in through.get(n, ())}))
        comm = (s.bwd if reverse else s.comm) if (s.comm or s.bwd) else None
        if s.comm is not None or s.bwd is not None:
            if comm is None:
                through[s.name] = deps
                continue
            index[s.name] = len(out)
            out.append(Segment(s.name, "comm", comm.time_s, after=deps, comm=comm, kernels=1, async_by=s.async_by,
                               host_sync=s.host_sync and not reverse))
            through[s.name] = (index[s.name],)
            continue
        seconds, kernels = _active(s.ops, price, part)
        if reverse and s.bwd_extra is not None:
            regather[s.name] = len(out)
            out.append(Segment(f"{s.name}_regather", "comm", s.bwd_extra.time_s, after=deps, comm=s.bwd_extra,
                               kernels=1, async_by="native"))
        if seconds <= 0 and kernels == 0:
            through[s.name] = deps
            continue
        index[s.name] = len(out)
        out.append(Segment(s.name, "compute", seconds, after=deps, kernels=kernels))
        through[s.name] = (index[s.name],)
    return out, through, regather


def layer_collectives(steps: Sequence[Step]) -> tuple[CommOp, ...]:
    """Every collective of the layer, forward and backward (the plan's per-layer list)."""
    out: list[CommOp] = []
    for s in steps:
        out += [c for c in (s.comm, s.bwd, s.bwd_extra) if c is not None]
    return tuple(out)
