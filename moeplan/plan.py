"""The plan: a versioned pydantic schema saved as YAML (docs/architecture.md §6). The single source of truth for the runtime,
the TUI and the exporters.

``save_plan`` writes atomically (temp file + rename); ``load_plan`` reads with ``yaml.safe_load``, validates the
schema and the plan's internal consistency (:func:`check_plan`), and raises PlanError with one line otherwise.
Saving then loading gives an equal plan.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moeplan.cost_models.timeline import compute_parts, parse_action
from moeplan.files import read_yaml, write_atomic
from moeplan.errors import PlanError
from moeplan.ir import kind_of, named_layers
from moeplan.names import Dispatcher, Mechanism, ScheduleKind
from moeplan.spec import ModelSpec
from moeplan.targets import Target

SCHEMA_VERSION = 2
MFU_DEFINITION = ("MFU = model FLOPs/s ÷ (devices × peak bf16 FLOP/s); model FLOPs per token by Megatron-LM's causal "
                  "count without MTP (docs/references.md §4.1)")
# libyaml's C implementations of the *safe* dumper and loader when present (same rules, ~10x faster)
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PlanModel(_Frozen):
    name: str
    fingerprint: str
    spec: ModelSpec


class PlanLayout(_Frozen):
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    vpp: int = Field(ge=1)
    ep: int = Field(ge=1)
    etp: int = Field(ge=1)
    cp: int = Field(ge=1)
    dp: int = Field(ge=1)
    micro_batch: int = Field(ge=1)
    global_batch: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    num_devices: int = Field(ge=1)
    num_microbatches: int = Field(ge=1)
    sequence_parallel: bool
    tp_extend_ep: bool


class PlanStages(_Frozen):
    """``chunks[pp_rank][vpp_chunk]`` = layer names; pipeline stage of (r, c) is ``c·pp + r`` (``loop``) or, with
    the ``v`` placement of ZB-V and DualPipeV, ``r`` for chunk 0 and ``2·pp − 1 − r`` for chunk 1."""

    placement: Literal["loop", "v"] = "loop"
    chunks: list[list[list[str]]]
    chunk_time_s: list[list[float]]
    imbalance: float
    empty_layers: list[str]
    reason: str


class PlanCollective(_Frozen):
    comm_class: Literal["tp", "ep", "cp", "dp", "pp"]
    kind: Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]
    phase: Literal["fwd", "bwd", "step"]
    bytes: int
    group_size: int
    tier: Literal["intra", "inter"]
    time_s: float
    wire_intra_bytes: float = 0.0  # bytes one rank sends over the intra-node link
    wire_inter_bytes: float = 0.0  # ... and over the inter-node link


class PlanLayerCost(_Frozen):
    """One layer of a kind, one micro-batch, one device."""

    fwd_s: float
    bwd_input_s: float
    bwd_weight_s: float
    params: int
    saved_bytes: int
    collectives: list[PlanCollective]


class PlanSharding(_Frozen):
    expert_shards: int
    expert_dp: int
    layers: dict[str, PlanLayerCost]  # by layer kind
    p2p: PlanCollective


class PlanExperts(_Frozen):
    shards: list[list[int]]  # experts held by each rank of the expert group
    groups_aligned: bool


class PlanOpDecision(_Frozen):
    """One op's decision: ``recompute`` or ``swap``, the bytes per layer and micro-batch it frees on the device,
    and the Megatron-LM / MindSpeed-LLM flag that expresses it (null: none does)."""

    op: str
    label: str
    decision: Literal["recompute", "swap"]
    saved_bytes: int
    flag: str | None = None


class PlanLayerDecisions(_Frozen):
    """A per-tensor mode's decision for the layers of one kind in one VPP chunk (bytes per layer and
    micro-batch; seconds per layer and micro-batch): ops re-run in backward, storages swapped to host."""

    chunk: int
    kind: str
    recomputed: list[str]
    swapped: list[str]
    kept_bytes: int
    swapped_bytes: int
    recompute_s: float
    remade_bytes: int
    recompute_flops: float
    ops: list[PlanOpDecision]


class PlanRankMemory(_Frozen):
    pp_rank: int
    recompute: Literal["none", "selective", "full", "mindspeed", "ilp-no-swap", "ilp"]
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    workspace_bytes: float
    total_bytes: float
    in_flight_microbatches: int
    decisions: list[PlanLayerDecisions] = []  # per-tensor modes only
    exposed_swap_s: list[list[float]] = []  # per chunk: (copy out, prefetch) seconds per micro-batch not hidden
    solve_status: str = ""  # optimal | heuristic | infeasible (moeplan/memory_ilp.py); "" for whole-layer modes
    solve_gap: float = 0.0  # relative optimality gap of the solve; -1 when unknown (heuristic)
    solve_reason: str = ""


class PlanMemory(_Frozen):
    budget_bytes: float
    recompute: Literal["auto", "none", "selective", "full", "mindspeed", "ilp-no-swap", "ilp"] = "auto"  # asked
    ranks: list[PlanRankMemory]


class PlanSchedule(_Frozen):
    """Per PP rank, actions in torch.distributed.pipelining notation (``0F1``, ``0I1``, ``0SEND_F1``,
    ``(0F3;7B1)OVERLAP_F_B``, ...)."""

    kind: ScheduleKind
    actions: list[list[str]]


class PlanComm(_Frozen):
    """The EP token dispatcher and the overlap mechanisms that are on (docs/step-model.md §2–3)."""

    dispatcher: Dispatcher = "flat"
    overlap: list[Mechanism] = Field(default_factory=list)


class PlanCommClass(_Frozen):
    """One comm class over the step (averaged over PP ranks): seconds of its collectives, seconds the compute
    stream waited on them, ``overlap_rate = 1 − exposed / total`` (None when it moved nothing), the same in the
    steady state, and bytes one device sends per link tier."""

    total_s: float
    exposed_s: float
    overlap_rate: float | None
    steady_total_s: float
    steady_exposed_s: float
    steady_overlap_rate: float | None
    intra_bytes: float
    inter_bytes: float


class PlanPrediction(_Frozen):
    step_time_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    bubble: float
    peak_memory_bytes: list[float]
    exposed_comm_s: dict[str, float]
    model_flops_per_step: float
    comm: dict[str, PlanCommClass] = Field(default_factory=dict)
    host_wait_s: float = 0.0
    optimizer_s: float = 0.0
    mfu_definition: str = MFU_DEFINITION


class PlanProvenance(_Frozen):
    moeplan_version: str
    pipeline: str
    pass_s: dict[str, float]
    compile_s: float


class Plan(_Frozen):
    schema_version: int
    model: PlanModel
    target: Target
    layout: PlanLayout
    stages: PlanStages
    sharding: PlanSharding
    experts: PlanExperts
    memory: PlanMemory
    schedule: PlanSchedule
    comm: PlanComm
    prediction: PlanPrediction
    provenance: PlanProvenance


def plan_json_schema() -> dict:
    """The plan's JSON Schema (``moeplan schema``)."""
    return Plan.model_json_schema()


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` as YAML atomically: a temp file in the same folder, then rename."""
    write_atomic(path, yaml.dump(plan.model_dump(mode="json"), Dumper=_DUMPER, sort_keys=False, width=120))


def load_plan(path: str | Path) -> Plan:
    """Read, validate and check a plan file. Raises PlanError with one line naming the problem."""
    data = read_yaml(path, field="plan", error=PlanError)
    if not isinstance(data, dict):
        raise PlanError(f"plan={str(path)!r}: a plan must hold a mapping")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PlanError(f"schema_version={version!r}: this moeplan reads schema version {SCHEMA_VERSION}")
    try:
        plan = Plan.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise PlanError(f"{field}={err.get('input')!r}: {err['msg']} (plan {path})") from None
    check_plan(plan)
    return plan


def check_plan(plan: Plan) -> None:
    """Check a plan's internal consistency; raise PlanError naming the first problem.

    Rules: the model hash matches its spec; tp·cp·dp·pp equals the device count; the stages have pp ranks of vpp
    chunks; every layer of the model sits on exactly one chunk (empty layers only as listed); the schedule has one
    action list per PP rank and every action is of the pipelining notation on a stage the rank holds.
    """
    lay, spec = plan.layout, plan.model.spec
    if spec.fingerprint() != plan.model.fingerprint:
        raise PlanError(f"model.fingerprint={plan.model.fingerprint!r}: does not match the spec "
                        f"({spec.fingerprint()}); the spec was edited")
    if lay.tp * lay.cp * lay.dp * lay.pp != lay.num_devices:
        raise PlanError(f"layout.num_devices={lay.num_devices}: must equal tp·cp·dp·pp "
                        f"= {lay.tp * lay.cp * lay.dp * lay.pp}")
    if len(plan.stages.chunks) != lay.pp or any(len(c) != lay.vpp for c in plan.stages.chunks):
        raise PlanError(f"stages.chunks: must hold pp={lay.pp} ranks of vpp={lay.vpp} chunks")
    _check_layers(plan)
    _check_actions(plan)


def _check_layers(plan: Plan) -> None:
    spec, seen = plan.model.spec, {}
    for r, chunks in enumerate(plan.stages.chunks):
        for c, names in enumerate(chunks):
            for n in names:
                if n in seen:
                    raise PlanError(f"stages: layer {n!r} is on pp rank {seen[n]} and pp rank {r}")
                if n.startswith("empty."):
                    if n not in plan.stages.empty_layers:
                        raise PlanError(f"stages: empty layer {n!r} is not listed in stages.empty_layers")
                else:
                    try:
                        kind_of(spec, n)
                    except (KeyError, ValueError):
                        raise PlanError(f"stages: layer {n!r} is not a layer of {plan.model.name}") from None
                seen[n] = r
    missing = [n for n, _ in named_layers(spec) if n not in seen]
    if missing:
        raise PlanError(f"stages: layer {missing[0]!r} is on no pp rank")


def _check_actions(plan: Plan) -> None:
    lay = plan.layout
    if len(plan.schedule.actions) != lay.pp:
        raise PlanError(f"schedule.actions: {len(plan.schedule.actions)} lists for pp={lay.pp} ranks")
    v = plan.stages.placement == "v"
    for r, actions in enumerate(plan.schedule.actions):
        own = {r, 2 * lay.pp - 1 - r} if v else {c * lay.pp + r for c in range(lay.vpp)}
        for a in actions:
            try:
                parsed = parse_action(a)
            except PlanError:
                raise PlanError(f"schedule.actions[{r}]: {a!r} is not an action (e.g. 0F1, 0B1, 0SEND_F1)") from None
            for part in compute_parts(a) or ((parsed,) if parsed.microbatch >= 0 else ()):
                if part.stage not in own:
                    raise PlanError(f"schedule.actions[{r}]: {a!r} runs stage {part.stage}, which pp rank {r} does "
                                    f"not hold")
                if part.microbatch >= lay.num_microbatches:
                    raise PlanError(f"schedule.actions[{r}]: {a!r} names micro-batch {part.microbatch} of "
                                    f"{lay.num_microbatches}")
