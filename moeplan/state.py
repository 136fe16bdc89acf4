"""PlanState: the frozen state the compiler passes read and extend (DESIGN §4).

Each pass takes a PlanState and returns a new one with its decision filled in (``dataclasses.replace``). The
decisions are plain frozen dataclasses of numbers and names; times are seconds, sizes bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Mapping

from moeplan.ir import LayerKind, ModelGraph
from moeplan.layout import Layout
from moeplan.targets import Target

CommClass = Literal["tp", "ep", "cp", "dp", "pp"]
Recompute = Literal["none", "selective", "full"]


@dataclass(frozen=True)
class CommOp:
    """One collective as costed: ``bytes`` is the per-rank payload (the tensor one rank holds before the op)."""

    comm_class: CommClass
    kind: Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]
    phase: Literal["fwd", "bwd", "step"]
    bytes: int
    group_size: int
    tier: Literal["intra", "inter"]
    time_s: float


@dataclass(frozen=True)
class LayerCost:
    """One layer of a kind for ONE micro-batch on ONE device under the layout.

    ``fwd_s`` / ``bwd_input_s`` (dX) / ``bwd_weight_s`` (dW): compute-stream time without communication.
    ``comm``: the in-layer collectives (TP/SP, EP dispatch/combine, CP). ``params``/``expert_params``: parameter
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

    ``chunks[r][c]`` holds the layer names of PP rank ``r``, chunk ``c`` (pipeline stage ``c·pp + r``). Names:
    ``embedding``, ``layers.{i}``, ``mtp.{j}``, ``mtp_head.{j}``, ``head``, ``empty.{k}``.
    """

    chunks: tuple[tuple[tuple[str, ...], ...], ...]
    chunk_time_s: tuple[tuple[float, ...], ...]  # forward + backward of one micro-batch
    imbalance: float  # max/mean − 1 over chunks
    empty_layers: tuple[str, ...]
    reason: str  # one line: where the MTP pieces and empty layers went and why

    @property
    def pp(self) -> int:
        return len(self.chunks)

    @property
    def vpp(self) -> int:
        return len(self.chunks[0])

    def stage_layers(self, stage: int) -> tuple[str, ...]:
        return self.chunks[stage % self.pp][stage // self.pp]


@dataclass(frozen=True)
class ExpertPlacement:
    """Decision of ``place-experts``: ``shards[i]`` lists the routed experts held by expert shard ``i``.

    Expert shard ``i`` is the ``i``-th rank of the ``ep·tp/etp`` expert group; every MoE layer uses the same
    placement in v1. ``groups_aligned`` says that each MoGE group sits on whole shards (so the group-balanced
    routing of Pangu Pro MoE balances devices by construction).
    """

    shards: tuple[tuple[int, ...], ...]
    groups_aligned: bool


@dataclass(frozen=True)
class StageMemory:
    """Memory on one device of a PP rank, bytes, under the chosen recompute mode."""

    pp_rank: int
    recompute: Recompute
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    workspace_bytes: float
    in_flight_microbatches: int

    @property
    def total_bytes(self) -> float:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activation_bytes
                + self.workspace_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    """Decision of ``plan-memory``: per PP rank memory and recompute mode, against ``budget_bytes`` per device."""

    stages: tuple[StageMemory, ...]
    budget_bytes: float


@dataclass(frozen=True)
class Schedule:
    """Decision of ``schedule``: per PP rank, actions in torch.distributed.pipelining's notation (``0F1``, …)."""

    kind: Literal["1f1b", "interleaved-1f1b"]
    actions: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Prediction:
    """What the timeline simulation predicts for one training step.

    MFU = model FLOPs per second / (devices × peak cube FLOP/s), model FLOPs by Megatron-LM's causal count without
    MTP (FACTS §4.1); HFU counts the FLOPs actually executed (recompute, MTP, router included).
    """

    step_time_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    bubble: float  # mean over PP ranks of idle / step time on the compute stream
    peak_memory_bytes: tuple[float, ...]  # per PP rank
    exposed_comm_s: Mapping[str, float]  # per comm class: time the compute stream waits on it
    model_flops_per_step: float


@dataclass(frozen=True)
class PlanState:
    """The graph, target and layout plus the decisions made so far (None until a pass provides it)."""

    graph: ModelGraph
    target: Target
    layout: Layout
    sharding: Sharding | None = None
    stages: StagePlan | None = None
    experts: ExpertPlacement | None = None
    memory: MemoryPlan | None = None
    schedule: Schedule | None = None
    prediction: Prediction | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def with_(self, **changes) -> "PlanState":
        return replace(self, **changes)
