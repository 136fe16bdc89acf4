"""The plan: a versioned pydantic schema saved as YAML (docs/architecture.md §6). The single source of truth for the runtime,
the TUI and the exporters.

``save_plan`` writes atomically (temp file + rename); ``load_plan`` reads with ``yaml.safe_load``, validates the
schema and the plan's internal consistency (:func:`check_plan`), and raises PlanError with one line otherwise.
Saving then loading gives an equal plan.

Beside it: moeplan/plan_schedule.py, the schedule's one-line-per-rank encoding (``encode_actions``,
``decode_actions``) and the rule of ``p2p: derived`` lines; moeplan/plan_check.py, the consistency rules
(``check_plan``).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, ClassVar, Literal, Sequence

import yaml
from pydantic import (BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PrivateAttr,
                      ValidationError, ValidationInfo, model_serializer, model_validator)

from moeplan.actions import rank_chunk, stage_of, stage_rank
from moeplan.errors import PlanError, validation_message
from moeplan.files import read_yaml, write_atomic
from moeplan.layout import Layout
from moeplan.mechanisms import Mechanism
from moeplan.names import Dispatcher, ScheduleKind
from moeplan.plan_check import check_plan
from moeplan.plan_schedule import ACTIONS_PER_CHUNK_MICROBATCH, _is_p2p, _with_p2p, decode_actions, encode_actions
from moeplan.spec import ModelSpec
from moeplan.targets import Target

SCHEMA_VERSION = 4
MFU_DEFINITION = ("MFU = model FLOPs/s ÷ (devices × peak bf16 FLOP/s); model FLOPs per token by Megatron-LM's causal "
                  "count without MTP (docs/references.md §4.1)")


class _Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # libyaml's C safe dumper when present (~10x faster)
    """Lists of numbers and names in flow style (``[0, 1, 2]``), so that they take one line; lists of mappings,
    of lists or of text (the schedule's lines) in block style."""


_Dumper.add_representer(list, lambda d, data: d.represent_sequence(
    "tag:yaml.org,2002:seq", data, flow_style=all(not isinstance(x, (list, dict)) and " " not in str(x) for x in data)))


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class _Sparse(_Frozen):
    """A plan section whose fields named in ``unwritten`` are left out of the file while they hold the value given
    there (what a plan meant before the field existed), so that plans without the feature stay byte for byte."""

    unwritten: ClassVar[dict[str, object]] = {}

    @model_serializer(mode="wrap")
    def _defaults_unwritten(self, handler):  # noqa: ANN001, ANN202
        doc = handler(self)
        for key, value in self.unwritten.items():
            if key in doc and doc[key] == value:
                del doc[key]
        return doc


class PlanModel(_Frozen):
    """The model the plan trains."""

    name: str
    """Registry name or file the model came from."""
    fingerprint: str
    """Hash of ``spec`` (16 hex digits): a plan whose spec was edited is refused."""
    spec: ModelSpec
    """The model's architecture and training shape."""


class PlanLayout(_Sparse):
    """The parallel layout: how the devices are split (docs/architecture.md §4, "Layout search")."""

    tp: int = Field(ge=1)
    """Tensor-parallel degree (ranks sharing each layer's weights)."""
    pp: int = Field(ge=1)
    """Pipeline-parallel degree (PP ranks)."""
    vpp: int = Field(ge=1)
    """Virtual pipeline chunks per PP rank (1: not interleaved)."""
    ep: int = Field(ge=1)
    """Expert-parallel degree over the data-parallel ranks."""
    etp: int = Field(ge=1)
    """Expert tensor-parallel degree: tp for expert-TP, 1 for TP-extend-EP."""
    cp: int = Field(ge=1)
    """Context-parallel degree (the sequence split over ranks)."""
    dp: int = Field(ge=1)
    """Data-parallel degree (model replicas)."""
    micro_batch: int = Field(ge=1)
    """Sequences per micro-batch per data-parallel replica."""
    global_batch: int = Field(ge=1)
    """Sequences per optimizer step over all replicas."""
    seq_len: int = Field(ge=1)
    """Tokens per sequence."""
    num_devices: int = Field(ge=1)
    """Devices the plan runs on: tp·cp·dp·pp."""
    num_microbatches: int = Field(ge=1)
    """Micro-batches per step per replica: global_batch / (dp·micro_batch)."""
    sequence_parallel: bool
    """Megatron-LM sequence parallelism: activations outside the TP matmuls split over the TP ranks."""
    tp_extend_ep: bool
    """The expert group spans tp·ep ranks with unsplit experts (MindSpeed ``--moe-tp-extend-ep``; etp = 1 < tp)."""
    dp_shard: int = Field(default=1, ge=1)
    """FSDP (ZeRO-3) degree over the data-parallel replicas: parameters, gradients and optimizer states sharded
    over dp_shard·cp ranks (torchtitan ``data_parallel_shard_degree``); 1: ZeRO-1."""
    expert_load: float = Field(default=1.0, ge=1, allow_inf_nan=False)
    """With a load trace: the busiest EP rank's routed tokens over the balanced share, as priced
    (:attr:`moeplan.layout.Layout.expert_load`); written only when not 1 (balanced routing)."""
    expert_replication: float = Field(default=1.0, ge=1, allow_inf_nan=False)
    """With EPLB's replicas: routed-expert parameters per device over the unreplicated share; written only when
    not 1."""

    unwritten: ClassVar[dict[str, object]] = {"expert_load": 1.0, "expert_replication": 1.0}

    def as_layout(self) -> Layout:
        """The compiler's :class:`moeplan.layout.Layout` of these degrees (its derived figures live there)."""
        return Layout(tp=self.tp, pp=self.pp, vpp=self.vpp, ep=self.ep, etp=self.etp, cp=self.cp, dp=self.dp,
                      micro_batch=self.micro_batch, global_batch=self.global_batch, seq_len=self.seq_len,
                      dp_shard=self.dp_shard, expert_load=self.expert_load,
                      expert_replication=self.expert_replication)

    @property
    def expert_shards(self) -> int:
        """Ranks the expert count is split over (:attr:`moeplan.layout.Layout.expert_shards`)."""
        return self.as_layout().expert_shards


class PlanStages(_Frozen):
    """The layers of each PP rank and VPP chunk. Pipeline stage of (r, c): ``c·pp + r`` (``loop``) or, with the
    ``v`` placement of ZB-V and DualPipeV, ``r`` for chunk 0 and ``2·pp − 1 − r`` for chunk 1."""

    placement: Literal["loop", "v"] = "loop"
    """How chunks map to pipeline stages (above)."""
    chunks: list[list[list[str]]]
    """``chunks[pp_rank][vpp_chunk]``: layer names (``embedding``, ``layers.i``, ``mtp.j``, ``mtp_head.j``,
    ``head``, ``empty.k``)."""
    chunk_time_s: list[list[float]]
    """``[pp_rank][vpp_chunk]``: forward + backward seconds of one micro-batch on the chunk."""
    imbalance: float
    """Slowest chunk time over the mean chunk time, minus 1."""
    empty_layers: list[str]
    """Layers without weights added so that PP·VPP divides the layer count (MindSpeed ``--noop-layers``)."""
    reason: str
    """Where the MTP layer and the empty layers went, and why."""

    def stage_of(self, rank: int, chunk: int) -> int:
        """Pipeline stage of PP rank ``rank``'s chunk ``chunk`` (:func:`moeplan.actions.stage_of`)."""
        return stage_of(rank, chunk, pp=len(self.chunks), placement=self.placement)

    def rank_chunk(self, stage: int) -> tuple[int, int]:
        """(PP rank, chunk) of pipeline stage ``stage`` (:func:`moeplan.actions.rank_chunk`)."""
        return rank_chunk(stage, pp=len(self.chunks), placement=self.placement)

    def rank_of(self, stage: int) -> int:
        """PP rank that holds pipeline stage ``stage`` (:func:`moeplan.actions.stage_rank`)."""
        return stage_rank(stage, pp=len(self.chunks), placement=self.placement)

    def by_stage(self) -> list[list[str]]:
        """Layer names of each pipeline stage, indexed by stage id (:meth:`stage_of`); ``chunks`` must hold the same
        number of chunks on every rank (``check_plan`` checks it first)."""
        out: list[list[str]] = [[] for _ in range(sum(map(len, self.chunks)))]
        for r, chunks in enumerate(self.chunks):
            for c, names in enumerate(chunks):
                out[self.stage_of(r, c)] = list(names)
        return out


class PlanCollective(_Frozen):
    """One collective as priced, per rank."""

    comm_class: Literal["tp", "ep", "cp", "dp", "pp"]
    """The parallel group it runs on."""
    kind: Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]
    """The collective."""
    phase: Literal["fwd", "bwd", "step"]
    """Forward, backward, or once per step (the DP gradient and parameter collectives)."""
    bytes: int
    """Payload, bytes: the tensor one rank holds before the op."""
    group_size: int
    """Ranks in the group."""
    tier: Literal["intra", "inter"]
    """The slowest link tier it crosses: within a node or between nodes."""
    time_s: float
    """Seconds the collective takes (alpha-beta model, cost_models/comm.py)."""
    wire_intra_bytes: int = 0
    """Bytes one rank sends over the intra-node link."""
    wire_inter_bytes: int = 0
    """Bytes one rank sends over the inter-node link."""


class PlanLayerCost(_Frozen):
    """One layer of a kind, for one micro-batch on one device."""

    fwd_s: float
    """Forward seconds on the compute stream, communication excluded."""
    bwd_input_s: float
    """Backward seconds for the input gradient (dX)."""
    bwd_weight_s: float
    """Backward seconds for the weight gradient (dW)."""
    params: int
    """Parameters held by one device (a count)."""
    saved_bytes: int
    """Activation bytes kept for backward without recompute."""
    collectives: list[PlanCollective]
    """The in-layer collectives (TP/SP, EP dispatch/combine, CP), in order."""


class PlanSharding(_Frozen):
    """Per-layer-kind costs under the layout."""

    expert_shards: int
    """Ranks the routed experts are split over: ep·tp/etp."""
    expert_dp: int
    """Data-parallel degree of the expert weights (ranks holding the same experts)."""
    layers: dict[str, PlanLayerCost]
    """By layer kind (embedding, dense, moe, mtp, mtp_head, head)."""
    p2p: PlanCollective
    """One micro-batch's activations (or gradients) across one pipeline boundary."""


class PlanLayerLoad(_Frozen):
    """One MoE layer of a load trace under the placement policy (docs/load-balance.md): means over the window."""

    layer: int = Field(ge=0)
    """Decoder-layer index (the MTP block's MoE layers follow the last decoder layer)."""
    shards: list[list[int]]
    """``shards[i]``: the experts rank i of the expert group holds in this layer (an expert on several: replicas)."""
    imbalance: float = Field(ge=0, allow_inf_nan=False)
    """max/mean − 1 of the routed tokens per rank of the expert group (0: balanced)."""
    balancedness: float = Field(ge=0, le=1, allow_inf_nan=False)
    """mean/max of the routed tokens per rank (vLLM's EPLB balancedness; 1: balanced)."""
    cv: float = Field(ge=0, allow_inf_nan=False)
    """Coefficient of variation std/mean of the routed tokens per rank (MindSpeed's)."""


class PlanRebalance(_Frozen):
    """Rebalancing while training, priced from the trace (``--rebalance-every``; docs/load-balance.md §7): the run
    replayed over the trace, each rebalance's migration priced as its own event between two steps."""

    every: int = Field(ge=1)
    """Steps between rebalances (``moeplan run`` takes it from the plan)."""
    threshold: float = Field(ge=0, allow_inf_nan=False)
    """The imbalance gain (max/mean − 1) a layer's new placement must exceed to be applied."""
    rebalances: int = Field(ge=0)
    """Rebalances replayed that precede a step of the window."""
    moved_experts: float = Field(ge=0, allow_inf_nan=False)
    """Experts moved per rebalance (mean over them), summed over the layers."""
    sent_bytes: float = Field(ge=0, allow_inf_nan=False)
    """Bytes the busiest expert-group rank of the busiest stage sends or receives per rebalance (mean): each moved
    expert's weights, master copy and Adam moments."""
    seconds: float = Field(ge=0, allow_inf_nan=False)
    """Predicted seconds per rebalance (mean): the count all-reduce and the migration all-to-all."""
    migrate_s: float = Field(ge=0, allow_inf_nan=False)
    """Of ``seconds``, the migration all-to-all (``moeplan run`` measures it as ``rebalance.migrate_s``)."""
    per_step_s: float = Field(ge=0, allow_inf_nan=False)
    """The rebalances' seconds spread over the window's steps: what rebalancing adds to each step."""


class PlanExpertLoad(_Sparse):
    """The load trace a plan is priced with and what it means for the placement (docs/load-balance.md)."""

    trace: str
    """The trace file as given to ``--expert-load``."""
    source: str
    """Where the trace's counts came from, as the trace says."""
    window: list[int] = Field(min_length=2, max_length=2)
    """First and last step of the trace window the prediction uses."""
    policy: Literal["contiguous", "greedy", "eplb"]
    """The ``place-experts`` policy."""
    replicas: int = Field(ge=0)
    """EPLB's extra expert slots per EP rank (replicas of the heaviest experts)."""
    balanced_step_s: float = Field(ge=0, allow_inf_nan=False)
    """The step this plan would take under balanced routing (same layout and decisions), seconds."""
    layers: list[PlanLayerLoad]
    """Each traced MoE layer; the step model prices their mean ``1 + imbalance`` (layout.expert_load). With
    ``rebalance``, ``shards`` is where a run starts and the imbalance is the replayed run's."""
    rebalance: PlanRebalance | None = None
    """Rebalancing while training; absent: the placement stays for the whole run."""
    unwritten: ClassVar[dict[str, object]] = {"rebalance": None}


class PlanExperts(_Sparse):
    """Placement of the routed experts."""

    shards: list[list[int]]
    """``shards[i]``: the experts held by rank i of the expert group (in every MoE layer without a load trace; with
    one, the traced layers take ``load.layers[j].shards``)."""
    groups_aligned: bool
    """Each expert group (MoGE) sits on whole shards, so group-balanced routing balances devices."""
    load: PlanExpertLoad | None = None
    """The load trace and each layer's placement; absent: the plan assumes balanced routing (every expert gets
    ``T·top_k/E`` tokens), as without ``--expert-load``."""
    unwritten: ClassVar[dict[str, object]] = {"load": None}

    def layer_shards(self, layer: int) -> list[list[int]]:
        """The placement of the MoE layer at decoder-layer index ``layer`` (the MTP block's ``j``-th layer is
        ``num_layers + j``): its own under a load trace, else ``shards``."""
        own = [x.shards for x in self.load.layers if x.layer == layer] if self.load is not None else []
        return own[0] if own else self.shards


class PlanOpDecision(_Frozen):
    """One op's decision under a per-tensor recompute mode."""

    op: str
    """The traced op (fx node name)."""
    label: str
    """The op in the field's terms (``kv up-projection``, ``core attention``, ``SwiGLU activation``, ...)."""
    decision: Literal["recompute", "swap"]
    """Re-run in backward, or its output copied to host memory and fetched back before backward."""
    saved_bytes: int
    """Device bytes the decision frees, per layer and micro-batch."""
    flag: str | None = None
    """The Megatron-LM / MindSpeed-LLM flag that expresses it; null: neither has one."""


class PlanLayerDecisions(_Frozen):
    """A per-tensor mode's decision for the layers of one kind in one VPP chunk."""

    chunk: int
    """VPP chunk of the PP rank."""
    kind: str
    """Layer kind."""
    recomputed: list[str]
    """Ops re-run in backward."""
    swapped: list[str]
    """Saved storages copied to host."""
    kept_bytes: int
    """Bytes kept on the device per layer and micro-batch."""
    swapped_bytes: int
    """Bytes copied to host per layer and micro-batch."""
    recompute_s: float
    """Seconds re-run per layer and micro-batch."""
    remade_bytes: int
    """Saved bytes the backward re-makes per layer (part of the backward working set)."""
    recompute_flops: float
    """FLOPs re-run per layer and micro-batch (for HFU)."""
    ops: list[PlanOpDecision]
    """Per op: its decision, the bytes it frees and its flag."""


class PlanRankMemory(_Frozen):
    """Memory of one device of a PP rank, at its fullest point of the step (docs/memory.md)."""

    pp_rank: int
    """The PP rank."""
    recompute: Literal["none", "selective", "full", "mindspeed", "modules", "ilp-no-swap", "ilp"]
    """Recompute mode of the rank's layers."""
    params_bytes: int
    """Parameter bytes (the training dtype's weights)."""
    grads_bytes: int
    """Gradient bytes (``memory.precision.grad_dtype``)."""
    optimizer_bytes: int
    """Optimizer-state bytes: master weights and Adam moments (``memory.precision``), sharded over DP when the
    distributed optimizer is on."""
    activation_bytes: int
    """Saved-activation bytes of the micro-batches in flight at the fullest point."""
    workspace_bytes: int
    """Largest transient of one op: its output and its gradient alive at once."""
    working_set_bytes: int = 0
    """One layer's backward working set: what its recompute re-makes, its swapped tensors back on the device and
    the next layer's prefetch."""
    comm_buffer_bytes: int = 0
    """Communication libraries' buffers: one per communicator the device belongs to, DeepEP's under ``dedup``."""
    runtime_bytes: int = 0
    """What the process holds before its first tensor: driver context, kernel modules, library workspaces."""
    allocator_bytes: int = 0
    """The caching allocator's reserved-but-unallocated share (fragmentation)."""
    gathered_bytes: int = 0
    """FSDP: the unsharded weights in use (the running layer and the prefetched one, or every layer of the rank
    under pipeline parallelism) and one layer's unsharded gradients."""
    total_bytes: int
    """The sum of the above."""
    in_flight_microbatches: int
    """Micro-batches whose activations are held at the fullest point."""
    decisions: list[PlanLayerDecisions] = []
    """Per (VPP chunk, layer kind) decisions; per-tensor modes only."""
    exposed_swap_s: list[list[float]] = []
    """Per chunk: (copy out, prefetch) seconds per micro-batch the host link does not hide."""
    solve_status: str = ""
    """optimal, heuristic or infeasible (the ILP, moeplan/memory_ilp.py); empty for the other modes."""
    solve_gap: float = 0.0
    """Relative optimality gap of the solve; −1 when unknown."""
    solve_reason: str = ""
    """Why the solve is not optimal, when it is not."""


MEMORY_TERMS: tuple[tuple[str, str], ...] = (
    ("params", "params_bytes"), ("grads", "grads_bytes"), ("optimizer", "optimizer_bytes"),
    ("activations", "activation_bytes"), ("working set", "working_set_bytes"), ("workspace", "workspace_bytes"),
    ("gathered", "gathered_bytes"), ("comm buffers", "comm_buffer_bytes"), ("runtime", "runtime_bytes"),
    ("allocator", "allocator_bytes"))
"""The terms of a device's memory (:class:`PlanRankMemory`), as (label, field), in the order the views show them;
``total_bytes`` is their sum."""


class PlanPrecision(_Frozen):
    """The recipe's model-state precision (moeplan.state.Precision)."""

    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    """Gradient buffer and DP reduction dtype (Megatron-LM ``--grad-reduce-in-bf16`` for bf16)."""
    main_params_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """The optimizer's master weights (``--main-params-dtype``); none when the model trains in fp32."""
    moments_dtype: Literal["fp32", "bf16"] = "fp32"
    """Adam's moments (``--exp-avg-dtype``, ``--exp-avg-sq-dtype``)."""
    distributed_optimizer: bool = True
    """Master weights and moments sharded over data parallelism (``--use-distributed-optimizer``)."""
    fp8_activation_input: bool = False
    """Under FP8 training the SwiGLU keeps its input in FP8 (Megatron-LM ``activation_func_fp8_input_store``)."""

    def short(self) -> str:
        return (f"grads {self.grad_dtype}, master weights {self.main_params_dtype}, moments {self.moments_dtype}, "
                f"distributed optimizer {'on' if self.distributed_optimizer else 'off'}"
                + (", SwiGLU input in FP8" if self.fp8_activation_input else ""))


class PlanMemory(_Frozen):
    """The memory decision of every PP rank."""

    budget_bytes: int
    """Device bytes the plan may use (``--memory-budget``, else the device's memory)."""
    precision: PlanPrecision = PlanPrecision()
    """The model-state precision the memory is priced with."""
    recompute: Literal["auto", "none", "selective", "full", "mindspeed", "modules", "ilp-no-swap", "ilp"] = "auto"
    """The recompute mode asked for (auto: the cheapest whole-layer mode that fits, per rank)."""
    recompute_modules: list[str] = []
    """Under ``modules``: the modules recomputed, in Megatron-LM's names (``--recompute-modules``)."""
    ranks: list[PlanRankMemory]
    """Per PP rank."""


class PlanSchedule(_Frozen):
    """The pipeline schedule: per PP rank, its actions in torch.distributed.pipelining notation (``0F1``, ``0I1``,
    ``0W1``, ``0SEND_F1``, ``(0F3;7B1)OVERLAP_F_B``, ...), stored one line per rank (:func:`encode_actions`)."""

    kind: ScheduleKind
    """Schedule family: 1f1b, interleaved, zero-bubble, zbv or dualpipev (docs/step-model.md §4)."""
    p2p: Literal["derived", "listed"]
    """``derived``: the lines hold the compute actions only, and every compute action whose neighbour stage is on
    another rank gets its RECV right before it and its SEND right after (torch's ``_add_send_recv``);
    ``listed``: the lines hold every action, p2p included."""
    ranks: list[str]
    """Per PP rank, its action list on one line: actions separated by spaces; ``A*N`` is action A then N − 1 more,
    each with every micro-batch number one higher; ``<A B C>*N`` is the same for a block of actions."""
    _actions: tuple[tuple[str, ...], ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _decode(self, info: ValidationInfo) -> "PlanSchedule":
        """The lines decoded, each at most ``max_actions`` actions when the validation context gives it
        (:func:`load_plan`: from the plan's layout)."""
        limit = (info.context or {}).get("max_actions")
        actions = [tuple(decode_actions(line, where=f"schedule.ranks[{r}]", limit=limit))
                   for r, line in enumerate(self.ranks)]
        if self.p2p == "derived":
            actions = _with_p2p(self.kind, actions)
        self._actions = tuple(actions)
        return self

    @property
    def actions(self) -> tuple[tuple[str, ...], ...]:
        """Per PP rank, every action in order (compute and p2p)."""
        return self._actions

    @classmethod
    def of(cls, kind: ScheduleKind, actions: Sequence[Sequence[str]]) -> "PlanSchedule":
        """The schedule of per-rank ``actions``; ``derived`` when the p2p rule (see ``p2p``) reproduces them."""
        compute = [tuple(a for a in acts if not _is_p2p(a)) for acts in actions]
        derived = _with_p2p(kind, compute) == [tuple(a) for a in actions]
        return cls(kind=kind, p2p="derived" if derived else "listed",
                   ranks=[encode_actions(c if derived else a) for c, a in zip(compute, actions)])


class PlanComm(_Frozen):
    """The EP token dispatcher and the overlap mechanisms that are on (docs/step-model.md §2–3)."""

    dispatcher: Dispatcher = "flat"
    """EP token dispatcher: flat all-to-all, hierarchical (inter-node all-gather, intra-node all-to-all) or dedup
    (one copy of a token per node)."""
    overlap: list[Mechanism] = Field(default_factory=list)
    """Overlap mechanisms on: shared-expert (beside the dispatch), fb (one micro-batch's forward with another's
    backward), dp (gradient reduce-scatter during backward), pp (p2p beside compute)."""


class PlanCommClass(_Frozen):
    """One comm class over the step, averaged over PP ranks."""

    total_s: float
    """Seconds of its collectives."""
    exposed_s: float
    """Seconds the compute stream waited on them."""
    overlap_rate: float | None
    """1 − exposed / total; null when the class moved nothing."""
    steady_total_s: float
    """total_s in the steady state (between the pipeline's warm-up and cool-down)."""
    steady_exposed_s: float
    """exposed_s in the steady state."""
    steady_overlap_rate: float | None
    """overlap_rate in the steady state."""
    intra_bytes: int
    """Bytes one device sends over the intra-node link per step."""
    inter_bytes: int
    """Bytes one device sends over the inter-node link per step."""


class PlanPrediction(_Frozen):
    """What the simulation predicts for one training step (docs/step-model.md)."""

    step_time_s: PositiveFloat
    """Seconds per optimizer step."""
    tokens_per_s: PositiveFloat
    """Tokens trained per second over all devices: global_batch·seq_len / step_time_s."""
    mfu: NonNegativeFloat
    """Model FLOPs utilization, a fraction (see mfu_definition)."""
    hfu: NonNegativeFloat
    """Hardware FLOPs utilization: the FLOPs executed (recompute, MTP, router included) per second over peak."""
    bubble: NonNegativeFloat
    """Mean over PP ranks of the compute stream's idle time over the step, a fraction."""
    peak_memory_bytes: list[NonNegativeInt]
    """Per PP rank, the device bytes at the fullest point (memory.ranks[r].total_bytes)."""
    exposed_comm_s: dict[str, NonNegativeFloat]
    """Per comm class, seconds the compute stream waits on it (averaged over PP ranks)."""
    model_flops_per_step: NonNegativeFloat
    """Model FLOPs of one step (the MFU numerator times the step time)."""
    comm: dict[str, PlanCommClass] = Field(default_factory=dict)
    """Per comm class (tp, ep, cp, dp, pp): time, exposure, overlap and bytes."""
    host_wait_s: NonNegativeFloat = 0.0
    """Mean over PP ranks, seconds the compute stream waited for the host to launch work."""
    optimizer_s: NonNegativeFloat = 0.0
    """Seconds of the slowest rank's optimizer update (and the clipping all-reduce), after the DP collectives."""
    mfu_definition: str = MFU_DEFINITION
    """How MFU is counted."""


class PlanProvenance(_Frozen):
    """How the plan was made."""

    moeplan_version: str
    """moeplan's version."""
    pipeline: str
    """The pass pipeline that ran, with its options."""
    pass_s: dict[str, float]
    """Seconds spent in each pass (and the trace)."""
    compile_s: float
    """Seconds the whole compile took."""


class Plan(_Frozen):
    """An execution plan: everything the runtime, the TUI and the exporters read (docs/architecture.md §6)."""

    schema_version: int
    """Version of this schema; a plan of another version is refused."""
    model: PlanModel
    """The model."""
    target: Target
    """The device type and its cluster links."""
    layout: PlanLayout
    """The parallel layout."""
    stages: PlanStages
    """Layers per PP rank and VPP chunk."""
    sharding: PlanSharding
    """Per-layer-kind costs under the layout."""
    experts: PlanExperts
    """Routed-expert placement."""
    memory: PlanMemory
    """Memory and recompute / swap decisions per PP rank."""
    schedule: PlanSchedule
    """The pipeline schedule."""
    comm: PlanComm
    """Dispatcher and overlap mechanisms."""
    prediction: PlanPrediction
    """The predicted step."""
    provenance: PlanProvenance
    """How the plan was made."""


def plan_json_schema() -> dict:
    """The plan's JSON Schema (``moeplan schema``)."""
    return Plan.model_json_schema()


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` as YAML atomically: a temp file in the same folder, then rename."""
    write_atomic(path, yaml.dump(plan.model_dump(mode="json"), Dumper=_Dumper, sort_keys=False, width=2**20,
                                 allow_unicode=True))


def load_plan(path: str | Path) -> Plan:
    """Read, validate and check a plan file. Raises PlanError with one line naming the problem."""
    data = read_yaml(path, field="plan", error=PlanError)
    if not isinstance(data, dict):
        raise PlanError(f"plan={str(path)!r}: a plan must hold a mapping")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PlanError(f"schema_version={version!r}: this moeplan reads schema version {SCHEMA_VERSION}")
    for bad, rule in ((_non_finite, "must be a finite number"),
                      (_multi_line, "a plan's text is one line of printable characters (no line breaks or control "
                                    "characters)")):
        found = _first_leaf(data, bad)
        if found is not None:
            field = found[0] if found[0].isprintable() else repr(found[0])
            raise PlanError(f"{field}={found[1]!r}: {rule} (plan {path})")
    try:
        plan = Plan.model_validate(data, context={"max_actions": _max_actions(data.get("layout"))})
    except ValidationError as e:
        raise PlanError(validation_message(e.errors()[0], where=f"plan {path}")) from None
    check_plan(plan)
    return plan


def _max_actions(layout: object) -> int:
    """The most actions a rank's schedule line may expand to: ``ACTIONS_PER_CHUNK_MICROBATCH`` per chunk and
    micro-batch of the plan's layout, read before the layout is validated. Where ``vpp`` or ``num_microbatches`` is
    not an integer from 1 to 64 or 2**20, the limit is that of 64 chunks and 4096 micro-batches (a line cannot make
    the reader expand without bound; the layout's own error follows when the lines fit)."""
    vpp, m = (layout.get(k) if isinstance(layout, dict) else None for k in ("vpp", "num_microbatches"))
    if type(vpp) is int and type(m) is int and 1 <= vpp <= 64 and 1 <= m <= 2**20:
        return ACTIONS_PER_CHUNK_MICROBATCH * vpp * m
    return ACTIONS_PER_CHUNK_MICROBATCH * 64 * 4096


def _non_finite(value: object) -> bool:
    """A NaN or infinity: a compiled plan holds only finite numbers (an unbounded solver gap is stored as -1)."""
    return isinstance(value, float) and not math.isfinite(value)


def _multi_line(value: object) -> bool:
    """Text holding a line break or another control character. Exporters write plan text into scripts and comments
    (moeplan/export), where a line break would end a comment and start a command."""
    return isinstance(value, str) and not value.isprintable()


def _first_leaf(data: object, bad: Callable[[object], bool], path: str = "") -> tuple[str, object] | None:
    """The dotted path and value of the first leaf of a loaded document for which ``bad`` holds, or None."""
    if bad(data):
        return path or "plan", data
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        found = _first_leaf(v, bad, f"{path}.{k}" if path else str(k))
        if found is not None:
            return found
    return None
