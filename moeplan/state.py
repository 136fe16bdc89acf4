"""PlanState: the frozen state the compiler passes read and extend (docs/architecture.md §4).

Each pass takes a PlanState and returns a new one with its decision filled in (``dataclasses.replace``). The
decisions are plain frozen dataclasses of numbers and names; times are seconds, sizes bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Mapping

from moeplan import actions
from moeplan.ir import LayerKind, ModelGraph
from moeplan.layout import Layout
from moeplan.load_model import LoadModel, ShardLoad
from moeplan.mechanisms import Mechanism, ordered
from moeplan.names import DISPATCHERS, SCHEDULES, Dispatcher, ScheduleKind  # noqa: F401
from moeplan.targets import Target

CommClass = Literal["tp", "ep", "cp", "dp", "pp"]
Recompute = Literal["none", "selective", "full", "mindspeed", "modules", "ilp-no-swap", "ilp"]
OP_MODES: tuple[str, ...] = ("mindspeed", "modules", "ilp-no-swap", "ilp")
"""Recompute modes decided per saved tensor (passes/plan_memory.py) rather than per layer."""
Tier = Literal["intra", "inter"]
COMM_CLASSES: tuple[CommClass, ...] = ("tp", "ep", "cp", "pp", "dp")




GradDtype = Literal["fp32", "bf16"]
MainParamsDtype = Literal["fp32", "bf16", "fp16"]
MomentsDtype = Literal["fp32", "bf16"]


@dataclass(frozen=True)
class Precision:
    """The recipe's model-state precision (cost_models/memory.py), in Megatron-LM's terms:

    - ``grad_dtype``: the gradient buffer the backward accumulates into and DP reduces (Megatron-LM keeps an fp32
      ``main_grad`` unless ``--grad-reduce-in-bf16``; Megatron-Bridge ``ddp.grad_reduce_in_fp32``);
    - ``main_params_dtype``: the optimizer's master copy of the weights (``--main-params-dtype``, with
      ``--use-precision-aware-optimizer``); no copy when the model already trains in fp32;
    - ``moments_dtype``: Adam's first and second moments (``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``);
    - ``distributed_optimizer``: master weights and moments sharded over the data-parallel group (ZeRO-1,
      ``--use-distributed-optimizer``; on by default, as in Megatron-LM's MoE recipes), else held whole by every
      replica;
    - ``fp8_activation_input``: under FP8 training, the SwiGLU keeps its input (the gate/up output) in FP8
      (Megatron-LM ``TransformerConfig.activation_func_fp8_input_store``; DeepSeek-V3 arXiv 2412.19437 §3.3.3
      caches "the inputs of the SwiGLU operator" in FP8).
    """

    grad_dtype: GradDtype = "fp32"
    main_params_dtype: MainParamsDtype = "fp32"
    moments_dtype: MomentsDtype = "fp32"
    distributed_optimizer: bool = True
    fp8_activation_input: bool = False


@dataclass(frozen=True)
class Strategy:
    """How a layout runs, beside its degrees: the pipeline schedule, the EP token dispatcher, the overlap
    mechanisms that are on, the recompute request (``auto``: the cheapest per-rank mode that fits) and the
    model-state precision of the recipe (:class:`Precision`).

    Schedules (docs/step-model.md §4): ``1f1b`` and ``interleaved`` (Megatron-LM), ``zero-bubble`` (torch's
    Interleaved Zero Bubble, I/W split), ``zbv`` and ``dualpipev`` (V-shaped stage placement, two chunks per rank).
    Dispatchers (§3): ``flat`` all-to-all, MindSpeed's ``hierarchical`` all-to-all-v, ``dedup`` (DeepEP-style, one
    copy per destination node). Mechanisms (§2): ``shared-expert`` (shared experts beside the dispatch and combine),
    ``fb`` (the forward of one micro-batch overlapped with the backward of another), ``dp`` (gradient
    reduce-scatter and parameter all-gather beside compute), ``pp`` (p2p beside compute).
    """

    schedule: ScheduleKind = "1f1b"
    dispatcher: Dispatcher = "flat"
    overlap: frozenset[Mechanism] = frozenset()
    recompute: Literal["auto", "none", "selective", "full", "mindspeed", "modules", "ilp-no-swap", "ilp"] = "auto"
    precision: Precision = Precision()
    recompute_modules: tuple[str, ...] = ()
    """Under ``recompute="modules"``: the modules recomputed, in Megatron-LM's names
    (cost_models/saved_tensors.py ``RECOMPUTE_MODULES``)."""

    def short(self) -> str:
        on = ",".join(ordered(self.overlap)) or "none"
        return f"{self.schedule} {self.dispatcher} overlap={on}"


@dataclass(frozen=True)
class CommOp:
    """One collective as costed: ``bytes`` is the per-rank payload (the tensor one rank holds before the op).

    ``tier`` is the slowest link tier it crosses. ``wire_intra_bytes`` / ``wire_inter_bytes``: what one rank sends
    over each tier (ring and pairwise algorithms, cost_models/comm.py); ``busy_intra_s`` / ``busy_inter_s``: how long
    the op occupies each tier's stream of the rank (both at once for an all-to-all that spans nodes, which ends at
    ``time_s``). Defaults (a single-tier op): the whole ``time_s`` on ``tier``.
    """

    comm_class: CommClass
    kind: Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]
    phase: Literal["fwd", "bwd", "step"]
    bytes: int
    group_size: int
    tier: Tier
    time_s: float
    wire_intra_bytes: float = 0.0
    wire_inter_bytes: float = 0.0
    busy_intra_s: float | None = None
    busy_inter_s: float | None = None

    def busy_s(self, tier: Tier) -> float:
        """Seconds this op holds the stream of ``tier``."""
        busy = self.busy_intra_s if tier == "intra" else self.busy_inter_s
        if busy is not None:
            return busy
        return self.time_s if tier == self.tier else 0.0


@dataclass(frozen=True)
class Segment:
    """One step of a layer phase (forward, input-gradient or weight-gradient), in the order it is issued.

    ``kind == "compute"``: ``seconds`` of work on the device's compute stream, issued by the host as ``kernels``
    kernel launches. ``kind == "comm"``: the collective ``comm``, on the stream of each link tier it crosses
    (``seconds == comm.time_s``). ``after``: indices, within the phase, of the segments whose results it needs
    (data dependencies; the compute stream runs compute segments in order anyway). ``async_by``: for a collective,
    the overlap mechanism under which the compute stream does not wait for it right away (``"shared-expert"``,
    ``"native"`` for one the runtime always issues asynchronously); otherwise, and always when the mechanism is
    off, the compute stream waits for it (a blocking NCCL/HCCL call on the compute stream). ``host_sync``: the host
    waits for this segment to finish before it issues anything else (the dispatcher copies the per-expert token
    counts to the host).
    """

    name: str
    kind: Literal["compute", "comm"]
    seconds: float
    after: tuple[int, ...] = ()
    comm: CommOp | None = None
    kernels: int = 0
    async_by: str | None = None
    host_sync: bool = False
    deferrable: bool = False  # a weight-gradient segment: may run any time after what it needs (zero-bubble's W)

    def with_after(self, after: tuple[int, ...]) -> "Segment":
        """This segment waiting for ``after`` instead: ``dataclasses.replace(self, after=after)`` without its
        generic path (re-validating every field), which dominated the layout search's pricing of layer
        sequences."""
        new = object.__new__(Segment)
        new.__dict__.update(self.__dict__)
        new.__dict__["after"] = after
        return new


@dataclass(frozen=True)
class LayerProgram:
    """One layer for one micro-batch on one device as three ordered segment lists (docs/architecture.md §5 "timeline"): the
    forward, the input-gradient pass (dX, "I") and the weight-gradient pass (dW, "W"). Indices in ``after`` refer to
    the same list, except the weight pass's, which point into the input-gradient list (a weight gradient needs
    what its dX received)."""

    fwd: tuple[Segment, ...] = ()
    bwd_input: tuple[Segment, ...] = ()
    bwd_weight: tuple[Segment, ...] = ()

    @property
    def backward(self) -> tuple[Segment, ...]:
        """The full backward B: the dX segments, then the dW segments waiting for theirs."""
        return self.bwd_input + self.bwd_weight

    @property
    def weight_alone(self) -> tuple[Segment, ...]:
        """The dW segments as a separate W action (its I has run: no dependencies left)."""
        return tuple(s.with_after(()) for s in self.bwd_weight)


@dataclass(frozen=True)
class LayerCost:
    """One layer of a kind for ONE micro-batch on ONE device under the layout.

    ``fwd_s`` / ``bwd_input_s`` (dX) / ``bwd_weight_s`` (dW): compute-stream time without communication.
    ``comm``: the in-layer collectives (TP/SP, EP dispatch/combine, CP); ``program``: the same work as ordered
    segments, which the timeline simulates (compute beside collectives). ``params``/``expert_params``: parameter
    counts held by one device. ``saved_*_bytes``: activations kept until backward under each recompute mode;
    ``recompute_*_s``: forward work redone in backward under that mode. ``executed_flops``: the
    FLOPs executed (forward + backward, traced, causal) on this device for this micro-batch, for HFU; recompute is
    added on top by ``simulate``.
    """

    kind: LayerKind
    fwd_s: float
    bwd_input_s: float
    bwd_weight_s: float
    comm: tuple[CommOp, ...]
    program: LayerProgram
    params: int
    expert_params: int
    saved_bytes: int
    saved_selective_bytes: int
    saved_full_bytes: int
    recompute_selective_s: float
    recompute_full_s: float
    executed_flops: float
    recompute_selective_flops: float
    recompute_full_flops: float
    workspace_bytes: int  # largest transient of one op: its output and its gradient alive at once
    shared_params: int = 0  # of ``params``: a copy of another layer's weights (the MTP's embedding, output layer)
    shared_owner: LayerKind | None = None  # the kind of the layer that owns them: on its rank the copy is no tensor

    def comm_s(self, phase: str) -> float:
        return sum(c.time_s for c in self.comm if c.phase == phase)


@dataclass(frozen=True)
class Sharding:
    """Decision of the ``shard`` pass: per-kind layer costs and the PP activation transfer.

    The DP collectives depend on the parameters of each stage and are priced by ``simulate``.
    """

    layer_costs: Mapping[LayerKind, LayerCost]
    p2p: CommOp  # one micro-batch's activations (or gradients) across one pipeline boundary


@dataclass(frozen=True)
class StagePlan:
    """Decision of ``partition-stages``: the layers of each PP rank and VPP chunk.

    ``chunks[r][c]`` holds the layer names of PP rank ``r``, chunk ``c``: pipeline stage ``c·pp + r`` with the
    ``loop`` placement (Megatron-LM's interleaved), stage ``r`` (chunk 0) and ``2·pp − 1 − r`` (chunk 1) with the
    ``v`` placement (ZB-V, DualPipeV). Names: ``embedding``, ``layers.{i}``, ``mtp.{j}``, ``mtp_head.{j}``,
    ``head``, ``empty.{k}``.
    """

    chunks: tuple[tuple[tuple[str, ...], ...], ...]
    chunk_time_s: tuple[tuple[float, ...], ...]  # forward + backward of one micro-batch
    imbalance: float  # max/mean − 1 over chunks
    empty_layers: tuple[str, ...]
    reason: str  # one line: where the MTP pieces and empty layers went and why
    placement: Literal["loop", "v"] = "loop"

    @property
    def pp(self) -> int:
        return len(self.chunks)

    @property
    def vpp(self) -> int:
        return len(self.chunks[0])

    def stage_layers(self, stage: int) -> tuple[str, ...]:
        rank, chunk = self.rank_chunk(stage)
        return self.chunks[rank][chunk]

    def rank_chunk(self, stage: int) -> tuple[int, int]:
        """(PP rank, chunk) of pipeline stage ``stage`` under the placement (:func:`moeplan.actions.rank_chunk`)."""
        return actions.rank_chunk(stage, pp=self.pp, placement=self.placement)

    def stage_of(self, rank: int, chunk: int) -> int:
        """Pipeline stage of PP rank ``rank``'s chunk ``chunk`` (:func:`moeplan.actions.stage_of`)."""
        return actions.stage_of(rank, chunk, pp=self.pp, placement=self.placement)


@dataclass(frozen=True)
class ExpertPlacement:
    """Decision of ``place-experts``: ``shards[i]`` lists the routed experts held by expert shard ``i``.

    Expert shard ``i`` is the ``i``-th rank of the ``ep·tp/etp`` expert group; every MoE layer uses the same
    placement in v1. ``groups_aligned`` says that each MoGE group sits on whole shards (so the group-balanced
    routing of Pangu Pro MoE balances devices by construction).
    """

    shards: tuple[tuple[int, ...], ...]
    groups_aligned: bool
    load: ShardLoad | None = None
    """With a load trace: each traced layer's placement under the pass's policy and its imbalance (these layers'
    placements replace ``shards``); None: balanced routing, no trace."""


@dataclass(frozen=True)
class OpDecision:
    """One op's decision in a :class:`GroupChoice`: ``recompute`` (re-run in backward) or ``swap`` (its saved
    storages to host), the bytes per layer and micro-batch it no longer keeps on the device, and the Megatron-LM /
    MindSpeed-LLM flag that expresses it (None: neither runtime has one)."""

    op: str
    label: str
    decision: Literal["recompute", "swap"]
    saved_bytes: int
    flag: str | None


@dataclass(frozen=True)
class GroupChoice:
    """The decision of one group: the ops re-run in backward and the storages swapped (the rest of the needed ones
    are kept), per layer: bytes kept, bytes swapped, seconds re-run, bytes re-made in backward."""

    chunk: int
    kind: str
    rerun: tuple[str, ...]
    swapped: tuple[str, ...]
    kept_bytes: int
    swapped_bytes: int
    recompute_s: float
    remade_bytes: int
    recompute_flops: float = 0.0
    ops: tuple[OpDecision, ...] = ()


@dataclass(frozen=True)
class StageMemory:
    """Memory on one device of a PP rank at its fullest point, bytes, term by term (cost_models/memory.py, where
    each term's source is given): model states (``params``, ``grads``, ``optimizer``: master weights and
    moments), the saved activations of the micro-batches in flight (``activation``), the backward working set of
    one layer (``working_set``: what it re-makes, swaps back in and prefetches), the largest op's transient
    (``workspace``), FSDP's unsharded copies (``gathered``), communication buffers (``comm_buffer``: NCCL
    communicators, DeepEP's buffers), the CUDA
    context and libraries (``runtime``) and the caching allocator's share (``allocator``). Under a per-tensor mode
    (OP_MODES): ``decisions`` per (VPP chunk, layer kind), the swap seconds per micro-batch the host link does not
    hide per chunk (out, in), and the solver's status, optimality gap and reason (moeplan/memory_ilp.py)."""

    pp_rank: int
    recompute: Recompute
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    workspace_bytes: float
    in_flight_microbatches: int
    decisions: tuple[GroupChoice, ...] = ()
    exposed_swap_s: tuple[tuple[float, float], ...] = ()
    solve_status: str = ""
    solve_gap: float = 0.0
    solve_reason: str = ""
    working_set_bytes: float = 0.0
    comm_buffer_bytes: float = 0.0
    runtime_bytes: float = 0.0
    allocator_bytes: float = 0.0
    gathered_bytes: float = 0.0

    @property
    def model_state_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        return (self.model_state_bytes + self.activation_bytes + self.working_set_bytes + self.workspace_bytes
                + self.gathered_bytes + self.comm_buffer_bytes + self.runtime_bytes + self.allocator_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    """Decision of ``plan-memory``: per PP rank memory and recompute mode, against ``budget_bytes`` per device."""

    stages: tuple[StageMemory, ...]
    budget_bytes: float


@dataclass(frozen=True)
class Schedule:
    """Decision of ``schedule``: per PP rank, actions in torch.distributed.pipelining's notation (``0F1``, …)."""

    kind: ScheduleKind
    actions: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Prediction:
    """What the timeline simulation predicts for one training step.

    MFU = model FLOPs per second / (devices × peak cube FLOP/s), model FLOPs by Megatron-LM's causal count without
    MTP (docs/references.md §4.1); HFU counts the FLOPs actually executed (recompute, MTP, router included).
    """

    step_time_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    bubble: float  # mean over PP ranks of idle / step time on the compute stream
    peak_memory_bytes: tuple[float, ...]  # per PP rank
    exposed_comm_s: Mapping[str, float]  # per comm class: time the compute stream waits on it
    model_flops_per_step: float
    comm: Mapping[str, Mapping[str, float | None]] = field(default_factory=dict)  # per class: passes/simulate.py
    host_wait_s: float = 0.0  # mean over PP ranks: time the compute stream waited for the host to launch
    optimizer_s: float = 0.0  # the slowest rank's Adam update and clipping all-reduce, after the DP collectives


@dataclass(frozen=True)
class PlanState:
    """The graph, target and layout plus the decisions made so far (None until a pass provides it)."""

    graph: ModelGraph
    target: Target
    layout: Layout
    strategy: Strategy = Strategy()
    sharding: Sharding | None = None
    stages: StagePlan | None = None
    experts: ExpertPlacement | None = None
    memory: MemoryPlan | None = None
    schedule: Schedule | None = None
    prediction: Prediction | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    load: LoadModel | None = None
    """The expert-load trace the layout is priced with (an input, like the target); None: balanced routing."""

    def with_(self, **changes) -> "PlanState":
        return replace(self, **changes)
