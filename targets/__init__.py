"""Hardware targets: schema-validated YAML descriptions of a device and its links (docs/architecture.md §5).

``load_target("ascend-910b")`` reads ``targets/ascend-910b.yaml``. A file may define ``variants`` (e.g. the 376T and
313T bins of the 910B) selected with ``load_target("ascend-910b", variant="313t")`` or the name
``"ascend-910b:313t"``; a variant overrides top-level fields. ``devices_per_node`` may be overridden (the ``cpu``
emulator's node size is settable). Units: FLOP/s, bytes, bytes/s, seconds.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError,
                      field_validator, model_serializer, model_validator)

from moeplan.errors import SubfieldError, TargetError, validation_message
from moeplan.files import read_yaml
from moeplan.mechanisms import MECHANISMS, Mechanism, runtime_mechanisms
from moeplan.names import DISPATCHERS, SCHEDULES, Dispatcher, ScheduleKind
from moeplan.runtimes import RUNTIMES, RuntimeName


# Bounds far outside any device built (docs/inputs.md): they keep every time and byte count of the cost models finite.
MAX_SECONDS = 1.0
"""Largest latency or fixed launch cost, seconds (devices: micro- to milliseconds)."""
MAX_BANDWIDTH = 1e15
"""Largest bandwidth, bytes/s: 1 PB/s (HBM today: 8 TB/s); the least is 1 byte/s."""
MAX_FLOPS = 1e18
"""Largest peak, FLOP/s: 1 EFLOP/s per device (today: about 5 PFLOP/s dense FP8); the least is 1 FLOP/s."""
MAX_MEMORY = 2.0**50
"""Largest device memory, bytes: 1 PiB (today: up to 288 GB)."""
MAX_NODE = 2**16
"""Largest ``devices_per_node``: 65,536 (the largest scale-up domains today: a few hundred)."""
GemmCurve = Annotated[tuple[tuple[Annotated[StrictInt, Field(gt=0, le=2**40)],
                                  Annotated[StrictFloat, Field(gt=0, le=1)]], ...], Field(min_length=1)]
"""``[[M, fraction], ...]``: a GEMM's throughput at M rows per device as a fraction (0–1] of its plateau; at least
one point."""


class Link(BaseModel):
    """One link tier (inside a node or between nodes) in the α–β model of cost_models/comm.py."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)
    bandwidth_bytes_per_s: StrictFloat = Field(ge=1, le=MAX_BANDWIDTH)
    """β⁻¹: per-device unidirectional bandwidth of the tier (all of the device's links of it together), bytes/s."""
    latency_s: StrictFloat = Field(ge=0, le=MAX_SECONDS)
    """α: latency of one message, paid once per step of a collective's algorithm, seconds."""


AttentionCurve = tuple[tuple[StrictInt, StrictFloat], ...]
"""``[[seq_len, fraction], ...]``: a fused attention kernel's fraction (0–1] of the bf16 peak at the sequence
length it runs over; at least one point, seq_len strictly increasing (checked by
:func:`attention_efficiency_value`)."""


def attention_efficiency_value(value: object) -> object:
    """``efficiency.attention_fwd`` / ``attention_bwd`` as a target file gives it, checked: None, a fraction in
    (0, 1] (the same at every sequence length), or a table ``[[seq_len, fraction], ...]`` (returned as a tuple of
    ``(int, float)`` pairs) whose seq_len are integers in [1, 2^40], strictly increasing, and whose fractions are
    in (0, 1]. Raises ValueError: the rule the value breaks, and for a table the point that breaks it
    (``moeplan.errors.validation_message`` adds the field and the value)."""
    def fraction(x: object) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x <= 1  # NaN and inf fail

    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        if not fraction(value):
            raise ValueError("must be a fraction in (0, 1] or a table [[seq_len, fraction], ...]")
        return float(value)
    if not value:
        raise ValueError("a table [[seq_len, fraction], ...] needs at least one point")
    points: list[tuple[int, float]] = []
    for i, point in enumerate(value):
        if not isinstance(point, (list, tuple)) or len(point) != 2:
            raise ValueError(f"point {i} ({point!r:.40}) must be a pair [seq_len, fraction]")
        seq, eff = point
        if isinstance(seq, bool) or not isinstance(seq, int) or not 1 <= seq <= 2**40:
            raise ValueError(f"point {i}: seq_len {seq!r:.40} must be an integer in [1, 2^40]")
        if not fraction(eff):
            raise ValueError(f"point {i}: fraction {eff!r:.40} must be in (0, 1]")
        if points and seq <= points[-1][0]:
            raise ValueError(f"point {i}: seq_len {seq} follows {points[-1][0]}; seq_len must be strictly "
                             "increasing")
        points.append((seq, float(eff)))
    return tuple(points)


class Efficiency(BaseModel):
    """Achievable fractions of peak: compute (cube/vector), HBM and links. Defaults from Ascend/msmodeling."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)
    compute: StrictFloat = Field(default=0.7, gt=0, le=1)
    """Fraction (0–1) of its unit's peak (``cube_flops``, ``fp8_flops``, ``vector_flops``) an op reaches; with a
    ``gemm_m`` curve, a GEMM's plateau at M ≥ 4096 and long K."""
    memory: StrictFloat = Field(default=0.6, gt=0, le=1)
    """Fraction (0–1) of ``hbm_bandwidth_bytes_per_s`` a memory-bound pass reaches (ops, FP8 casts, the Adam
    update)."""
    comm: StrictFloat = Field(default=0.7, gt=0, le=1)
    """Fraction (0–1) of a link's ``bandwidth_bytes_per_s`` a collective reaches, on both tiers."""
    attention_fwd: StrictFloat | AttentionCurve | None = None
    """Fraction (0–1) of the bf16 peak ``cube_flops`` the fused attention kernel's forward reaches, when a source
    gives it: one number (the same at every sequence length) or a table ``[[seq_len, fraction], ...]`` over the
    sequence length the kernel runs over (cost_models/compute.py ``attention_seq_len``), seq_len strictly
    increasing, interpolated in log seq_len and clamped at both ends; None: ``compute``."""
    attention_bwd: StrictFloat | AttentionCurve | None = None
    """Fraction (0–1) of the bf16 peak the fused attention backward (dX) reaches, on FlashAttention's count of 2.5×
    the forward's FLOPs (cost_models/compute.py): one number or a table, as ``attention_fwd``; None: ``compute``
    on the traced FLOPs."""
    gemm_m: GemmCurve | None = None
    """A GEMM's throughput at M rows per device (the tokens per local expert for the grouped expert GEMM) as a
    fraction (0–1) of its plateau, ``[[M, fraction], ...]`` ascending M, interpolated in log M and clamped; applies
    to every matrix-unit GEMM but attention. None: the padded-tile model of cost_models/compute.py."""
    fp8_gemm_m: GemmCurve | None = None
    """As ``gemm_m``, for the GEMMs that run in FP8 (``training_dtype`` fp8; a fraction of ``fp8_flops``'s
    plateau). None: the padded-tile model for them."""
    gemm_k0: StrictFloat | None = Field(default=None, gt=0, le=2**20)
    """A GEMM's pipeline fill and epilogue, elements of K: its main loop runs at ``K/(K + K0)``; used only with a
    ``gemm_m`` / ``fp8_gemm_m`` curve. None: no K factor."""

    @field_validator("attention_fwd", "attention_bwd", mode="before")
    @classmethod
    def _attention_efficiency(cls, value: object) -> object:
        return attention_efficiency_value(value)


CommKind = Literal["p2p", "all_gather", "reduce_scatter", "all_reduce", "all_to_all"]


class LaunchCost(BaseModel):
    """Fixed costs per kernel or collective launch, seconds (Ascend/msmodeling: 5 µs matmul, 2 µs other, 10 µs comm).

    ``moeplan calibrate`` measures the ``cpu`` emulator's: its kernel costs, and a 2-rank latency per collective
    kind because gloo's collectives differ more than the α–β step counts say (its reduce-scatter costs as much as an
    all-reduce).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)
    matmul_s: StrictFloat = Field(default=5e-6, ge=0, le=MAX_SECONDS)
    """Device time per launch of a matrix-unit op on an ``"op"`` target, paid in the forward and again in each
    backward part (dX, dW), seconds."""
    other_s: StrictFloat = Field(default=2e-6, ge=0, le=MAX_SECONDS)
    """Device time per launch of a vector-unit op on an ``"op"`` target (and of an FP8 cast pass), as
    ``matmul_s``, seconds."""
    collective_s: StrictFloat = Field(default=10e-6, ge=0, le=MAX_SECONDS)
    """Fixed cost of one collective or p2p transfer beside its α–β time (cost_models/comm.py), unless
    ``collective_latency_s`` lists its kind, seconds."""
    granularity: Literal["op", "kernel"] = "op"
    """What one launch is on this target's runtime.

    ``"op"`` (accelerators with production kernels): one launch per traced IR op — a fused kernel (flash attention,
    RMSNorm, grouped matmul) is one launch however many aten ops its eager reference has — at ``matmul_s`` or
    ``other_s``. ``"kernel"`` (an eager runtime, the ``cpu`` emulator): every aten op the node dispatches pays
    ``forward_kernel_s`` or ``backward_kernel_s``, the kernel counts coming from the trace
    (``OpAnnotation.fwd_kernels`` etc.).
    """
    forward_kernel_s: StrictFloat = Field(default=0.0, ge=0, le=MAX_SECONDS)
    """Cost per forward aten kernel on a ``"kernel"`` target, recording the autograd graph included (also each
    kernel of the eager optimizer step), seconds."""
    backward_kernel_s: StrictFloat = Field(default=0.0, ge=0, le=MAX_SECONDS)
    """Cost per backward kernel on a ``"kernel"`` target: the autograd engine's per-node work included (also each
    gradient fan-out add and AccumulateGrad), seconds."""
    host_launch_s: StrictFloat = Field(default=0.0, ge=0, le=MAX_SECONDS)
    """Host (CPU) time to issue one kernel or collective on an ``"op"`` target (framework dispatch + driver
    launch), seconds; 0 where unknown: the host then never limits the device (cost_models/timeline.py)."""
    host_sync_s: StrictFloat = Field(default=0.0, ge=0, le=MAX_SECONDS)
    """The host's extra time at a device-to-host synchronisation (the dropless dispatcher's token-count copy) on an
    ``"op"`` target, seconds; 0 where unknown."""
    p2p_host_s: StrictFloat = Field(default=0.0, ge=0, le=MAX_SECONDS)
    """Compute-stream time one pipeline p2p message costs each side on a runtime whose host thread is the
    compute stream (the ``cpu`` emulator's eager gloo: posting the send or receive, and the transport thread's CPU
    time taken from the rank's compute), paid at every SEND and RECV (cost_models/timeline.py), seconds; 0 on
    accelerators, whose host posts a p2p beside the device's stream."""
    collective_latency_s: dict[CommKind, Annotated[StrictFloat, Field(ge=0, le=MAX_SECONDS)]] = Field(
        default_factory=dict)
    """Measured fixed cost of one 2-rank collective per kind (calibrated targets), link latency and launch included,
    seconds; a listed kind costs that times its α step count at n ranks over that at 2, instead of
    ``steps·α + collective_s`` (cost_models/comm.py)."""


class RuntimeSupport(BaseModel):
    """What the runtime behind this target executes; the layout search picks only these (an explicit choice
    outside them is refused). Accelerators run plans through Megatron-LM / MindSpeed-LLM, which have all of them;
    the ``cpu`` emulator runs moeplan's own runtime."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)
    schedules: tuple[ScheduleKind, ...] = Field(default=SCHEDULES, min_length=1)
    """Pipeline schedules the runtime executes (1f1b, interleaved, zero-bubble, zbv, dualpipev); at least one."""
    dispatchers: tuple[Dispatcher, ...] = Field(default=DISPATCHERS, min_length=1)
    """EP token dispatchers the runtime executes: ``flat`` all-to-all, MindSpeed's ``hierarchical`` all-to-all-v,
    ``dedup`` (DeepEP-style, one copy per destination node); at least one."""
    overlap: tuple[Mechanism, ...] = Field(default_factory=lambda: tuple(MECHANISMS))
    """Overlap mechanisms the runtime executes (moeplan/mechanisms.py: ``shared-expert``, ``fb``, ``dp``, ``pp``):
    a list, or in a target file ``all`` (every registered one, the default) or ``moeplan-runtime`` (those moeplan's
    own runtime runs), resolved to the list when the target is read."""
    weight_pass: Literal["weight-only", "whole-backward"] = "weight-only"
    """What a separate W action (zero-bubble, ZB-V, DualPipeV) runs: ``weight-only``, the dW kernels alone
    (Megatron-LM's and MindSpeed's zero-bubble split); ``whole-backward``, the stage's backward traversed again
    w.r.t. the parameters, dX kernels included (moeplan's executor: eager autograd cannot run the dW half alone
    without its graph walk, docs/runtime.md), so W costs about a B."""
    fsdp: StrictBool = True
    """Whether the runtime shards parameters with FSDP (ZeRO-3): torchtitan's FSDP2 and Megatron-LM's Megatron-FSDP
    do; moeplan's own runtime does not (ZeRO-1 only)."""
    grad_shard_copy: StrictBool = False
    """Whether the optimizer keeps an fp32 copy of its gradient shard beside the gradients (moeplan's
    ``DistributedAdamW``: ``FlatParams.grad``, 4 bytes per parameter of the shard; Megatron-LM's shard is a view of
    its gradient buffer)."""
    norm_weight_shard: StrictBool = False
    """Whether the optimizer keeps a per-element fp32 weight for the global gradient norm (moeplan's
    ``DistributedAdamW``: ``FlatParams.norm_weight``, 4 bytes per parameter of the shard)."""
    master_copy: Literal["narrower", "always"] = "narrower"
    """When the optimizer keeps its own copy of the weights (its master weights): ``narrower``, only when the
    model's weights are narrower than ``--main-params-dtype`` (Megatron-LM: an fp32 model's shard is a view);
    ``always`` (moeplan's ``DistributedAdamW`` clones its fp32 shard whatever the model's dtype,
    moeplan/runtime/optimizer.py)."""

    name: RuntimeName | None = None
    """The runtime that runs plans for this target (moeplan/runtimes.py: ``megatron-lm``, ``mindspeed-llm``): the
    lists above default to what it runs, may name nothing else, and the search drops the overlap combinations it
    refuses. None: the lists alone say what runs (moeplan's own runtime, or one that runs them all)."""

    @model_validator(mode="before")
    @classmethod
    def _runtime_lists(cls, data: object) -> object:
        """With a ``name``: the lists it leaves out become its runtime's; a list naming more is an error."""
        if not isinstance(data, dict) or data.get("name") not in RUNTIMES:
            return data
        rt = RUNTIMES[data["name"]]
        data = dict(data)
        for field, allowed in (("schedules", rt.schedules), ("dispatchers", rt.dispatchers), ("overlap", rt.overlap)):
            given = cls._named_set(data[field]) if field == "overlap" and field in data else data.get(field)
            if given is None:
                data[field] = allowed
            elif isinstance(given, (list, tuple)) and (extra := [v for v in given if v not in allowed]):
                raise SubfieldError(field, list(given), f"names {', '.join(map(str, extra))}, which {rt.title} does "
                                                        f"not run (it runs {', '.join(allowed)})")
        if data.get("fsdp") is True and not rt.fsdp:
            raise SubfieldError("fsdp", True, f"{rt.title} does not shard parameters (ZeRO-1 only)")
        data.setdefault("fsdp", rt.fsdp)
        return data

    @model_serializer(mode="wrap")
    def _without_no_name(self, handler):
        """A runtime without a name writes no ``name`` key (the plans of earlier versions, byte for byte)."""
        out = handler(self)
        if isinstance(out, dict) and out.get("name") is None:
            out.pop("name", None)
        return out

    @field_validator("overlap", mode="before")
    @classmethod
    def _named_set(cls, value: object) -> object:
        """``all`` and ``moeplan-runtime`` name a set of registered mechanisms, resolved here."""
        if value == "all":
            return tuple(MECHANISMS)
        if value == "moeplan-runtime":
            return runtime_mechanisms()
        return value


class MemoryOverheads(BaseModel):
    """Device memory a training process holds beside its tensors (cost_models/memory.py): each figure with its
    source in the target's file and in docs/targets.md."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)
    runtime_bytes: StrictFloat = Field(default=0.0, ge=0, le=MAX_MEMORY)
    """Bytes a process holds on the device before its first tensor: the driver context, the kernels' modules
    loaded, the math libraries' workspaces."""
    communicator_bytes: StrictFloat = Field(default=0.0, ge=0, le=MAX_MEMORY)
    """Device bytes one communicator (one process group the rank runs collectives on) holds for its buffers."""
    all_to_all_peer_bytes: StrictFloat = Field(default=0.0, ge=0, le=MAX_MEMORY)
    """Device bytes an all-to-all communicator holds per peer it reaches inside the node (NCCL connects every
    channel to every peer; 0 where the communicator's own buffer serves all peers, as HCCL's)."""
    allocator_fraction: StrictFloat = Field(default=0.0, ge=0, le=1)
    """The caching allocator's memory reserved but not allocated, as a fraction (0–1) of the bytes allocated
    (fragmentation)."""


class Target(BaseModel):
    """A device type and its cluster links."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)
    name: str
    """The target's name, e.g. ``ascend-910b`` (a shipped target's file stem)."""
    backend: Literal["cpu", "cuda", "npu"]
    """The torch device type the runtime uses: ``cpu`` (gloo), ``cuda`` (NCCL) or ``npu`` (HCCL)."""
    devices_per_node: StrictInt = Field(gt=0, le=MAX_NODE)
    """Devices per node, a count: a group within one node uses the ``intra_node`` link, else ``inter_node``."""
    memory_bytes: StrictFloat = Field(gt=0, le=MAX_MEMORY)
    """Device memory (HBM) per device, bytes."""
    memory_overheads: MemoryOverheads = MemoryOverheads()
    """What the runtime, the communication libraries and the allocator take of ``memory_bytes`` beside the
    plan's tensors."""
    hbm_bandwidth_bytes_per_s: StrictFloat = Field(ge=1, le=MAX_BANDWIDTH)
    """Device memory (HBM) bandwidth per device, bytes/s."""
    cube_flops: StrictFloat = Field(ge=1, le=MAX_FLOPS)
    """Dense bf16 peak of the matrix unit (tensor cores / Ascend cube) per device, FLOP/s; also MFU's peak."""
    fp8_flops: StrictFloat | None = Field(default=None, ge=1, le=MAX_FLOPS)
    """Dense FP8 peak of the matrix unit per device, FLOP/s; None: no FP8."""
    vector_flops: StrictFloat = Field(ge=1, le=MAX_FLOPS)
    """Peak of the vector unit per device, FLOP/s."""
    matmul_alignment: StrictInt = Field(default=16, gt=0, le=2**12)
    """GEMM tile edge, elements: GEMM dims off a multiple of this lose efficiency."""
    host_bandwidth_bytes_per_s: StrictFloat = Field(ge=1, le=MAX_BANDWIDTH)
    """Device↔host copy bandwidth per device (activation swap), bytes/s."""
    intra_node: Link
    """The link between devices of one node."""
    inter_node: Link
    """The link between nodes, per device."""
    efficiency: Efficiency = Efficiency()
    """Achievable fractions of the compute, HBM and link peaks."""
    launch: LaunchCost = LaunchCost()
    """Fixed per-launch costs and their granularity."""
    training_dtype: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"
    """The dtype the runtime trains in; ``fp8`` runs the decoder layers' GEMMs in FP8 at ``fp8_flops`` and keeps
    the rest in bf16 (DeepSeek-V3 arXiv 2412.19437 §3.3)."""
    comm_compute_slowdown: StrictFloat = Field(default=0.0, ge=0, le=10)
    """How much slower compute runs while a collective of the device is in flight, a fraction (0.33: 33% longer
    for the overlapping time); 0 where unknown."""
    comm_compute_slowdown_by_kind: dict[CommKind, Annotated[StrictFloat, Field(ge=0, le=10)]] = Field(
        default_factory=dict)
    """Per collective kind, ``comm_compute_slowdown`` where the kind has its own (the ``cpu`` emulator, measured by
    ``moeplan calibrate``: beside compute, gloo's all-gather, reduce-scatter and all-reduce hide far less of their
    cost than its all-to-all); a kind not listed uses ``comm_compute_slowdown``."""
    runtime: RuntimeSupport = RuntimeSupport()
    """The schedules, dispatchers and overlap mechanisms the target's runtime executes."""
    variant: str | None = None
    """The variant of the target file chosen (e.g. ``313t``), None for none."""

    @property
    def dtype_bytes(self) -> int:
        """Bytes per activation (and weight) element in ``training_dtype``: 2 for bf16/fp16 (and fp8, whose
        activations stay bf16), 4 for fp32."""
        return 4 if self.training_dtype == "fp32" else 2


_DIR = resources.files("moeplan.targets")


def target_names() -> list[str]:
    """Names of the shipped targets, sorted."""
    return sorted(p.name[:-5] for p in _DIR.iterdir() if p.name.endswith(".yaml"))


def load_target(name: str, *, variant: str | None = None, devices_per_node: int | None = None,
                training_dtype: str | None = None, runtime: str | None = None) -> Target:
    """Load a shipped target by name (or a path to a target YAML file).

    ``runtime`` names the runtime that runs its plans (moeplan/runtimes.py), as ``runtime.name`` in the file would.
    Raises TargetError: unknown name or variant, unreadable or malformed YAML, or a field that breaks the schema
    (types and the bounds of docs/inputs.md).
    """
    if ":" in name and variant is None and not Path(name).exists():
        name, variant = name.split(":", 1)
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.exists():
        data, label = read_yaml(path, field="target", error=TargetError), str(path)
    elif name in target_names():
        data, label = yaml.safe_load((_DIR / f"{name}.yaml").read_text()), name
    else:
        raise TargetError(f"target={name!r}: unknown; choose one of {', '.join(target_names())} or a target .yaml")
    if not isinstance(data, dict):
        raise TargetError(f"target={label!r}: a target file must hold a mapping, got {type(data).__name__}")
    variants = data.pop("variants", {}) or {}
    default_variant = data.pop("default_variant", None)
    if not isinstance(variants, dict) or not all(isinstance(k, str) and isinstance(v, dict)
                                                 for k, v in variants.items()):
        raise TargetError(f"variants={variants!r:.60}: must map each variant name to a mapping of fields "
                          f"(target {label})")
    if default_variant is not None and (not isinstance(default_variant, str) or default_variant not in variants):
        raise TargetError(f"default_variant={default_variant!r:.60}: must be one of the variants "
                          f"({', '.join(sorted(variants)) or 'none'}) (target {label})")
    variant = variant or default_variant
    if variant is not None:
        if not variants:
            raise TargetError(f"variant={variant!r}: target {label} has no variants; name it without ':{variant}'")
        if variant not in variants:
            raise TargetError(f"variant={variant!r}: target {label} has variants {', '.join(sorted(variants))}")
        data.update(variants[variant])
        data["variant"] = variant
    if devices_per_node is not None:
        data["devices_per_node"] = devices_per_node
    if training_dtype is not None:
        data["training_dtype"] = training_dtype
    if runtime is not None:  # the file's lists stay, and must be within what that runtime runs
        data["runtime"] = {**(data.get("runtime") or {}), "name": runtime}
    try:
        target = Target.model_validate(data)
    except ValidationError as e:
        raise TargetError(validation_message(e.errors()[0], where=f"target {label}")) from None
    if target.training_dtype == "fp8" and target.fp8_flops is None:
        raise TargetError(f"training_dtype='fp8': target {label} has no FP8 matrix unit (fp8_flops is not set)")
    return target
