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
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moeplan.errors import TargetError
from moeplan.names import DISPATCHERS, MECHANISMS, SCHEDULES, Dispatcher, Mechanism, ScheduleKind


class Link(BaseModel):
    """One link tier: per-device unidirectional bandwidth (bytes/s) and per-message latency (s) — the α–β model."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    bandwidth_bytes_per_s: float = Field(gt=0)
    latency_s: float = Field(ge=0)


class Efficiency(BaseModel):
    """Achievable fraction of peak: compute (cube/vector), HBM and links. Defaults from Ascend/msmodeling.

    ``attention_fwd`` / ``attention_bwd``: the fused attention kernel's forward and backward fraction of the bf16
    peak, when a source gives it (None: ``compute``). ``gemm_m`` / ``fp8_gemm_m``: the grouped expert GEMM's
    throughput at M tokens per local expert as a fraction of its throughput at large M, ``[[M, fraction], ...]``
    ascending, interpolated in log M (None: the padded-tile model of cost_models/compute.py); ``gemm_k0``: a GEMM's
    pipeline fill and epilogue in elements of K (its main loop runs at ``K/(K + K0)``), with ``compute`` then the
    plateau at M ≥ 4096 and long K.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    compute: float = Field(default=0.7, gt=0, le=1)
    memory: float = Field(default=0.6, gt=0, le=1)
    comm: float = Field(default=0.7, gt=0, le=1)
    attention_fwd: float | None = Field(default=None, gt=0, le=1)
    attention_bwd: float | None = Field(default=None, gt=0, le=1)
    gemm_m: tuple[tuple[int, Annotated[float, Field(gt=0, le=1)]], ...] | None = None
    fp8_gemm_m: tuple[tuple[int, Annotated[float, Field(gt=0, le=1)]], ...] | None = None
    gemm_k0: float | None = Field(default=None, gt=0)


CommKind = Literal["p2p", "all_gather", "reduce_scatter", "all_reduce", "all_to_all"]


class LaunchCost(BaseModel):
    """Fixed cost per kernel or collective launch, seconds (Ascend/msmodeling: 5 µs matmul, 2 µs other, 10 µs comm).

    ``granularity`` says what one launch is on this target's runtime:

    - ``"op"`` (default; accelerators with production kernels): one launch per traced IR op — a fused kernel (flash
      attention, RMSNorm, grouped matmul) is one launch however many aten ops its eager reference has; ``matmul_s``
      for matrix-unit ops, ``other_s`` otherwise, in forward and again per backward part (dX, dW).
    - ``"kernel"`` (an eager runtime, the ``cpu`` emulator): every aten op the node dispatches pays a fixed cost, and
      forward and backward kernels differ: ``forward_kernel_s`` includes recording the autograd graph,
      ``backward_kernel_s`` the autograd engine's per-node work (measured by ``moeplan calibrate``). The kernel
      counts come from the trace (``OpAnnotation.fwd_kernels`` etc.).

    ``host_launch_s``: host (CPU) time to issue one kernel on an ``"op"`` target (framework dispatch + driver
    launch); ``host_sync_s``: the host's extra cost at a device-to-host synchronisation (the dropless dispatcher's
    count copy). 0 where unknown: the host then never limits the device (cost_models/timeline.py).

    ``collective_latency_s`` (calibrated targets): the measured fixed cost of one 2-rank collective of each listed
    kind (``p2p``, ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``), link latency and launch
    included; a listed kind costs that, times its α step count at n ranks over that at 2, instead of
    ``steps·α + collective_s`` (cost_models/comm.py). ``moeplan calibrate`` measures it per kind because gloo's
    collectives differ more than the α–β step counts say (its reduce-scatter costs as much as an all-reduce).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    matmul_s: float = Field(default=5e-6, ge=0)
    other_s: float = Field(default=2e-6, ge=0)
    collective_s: float = Field(default=10e-6, ge=0)
    granularity: Literal["op", "kernel"] = "op"
    forward_kernel_s: float = Field(default=0.0, ge=0)
    backward_kernel_s: float = Field(default=0.0, ge=0)
    host_launch_s: float = Field(default=0.0, ge=0)
    host_sync_s: float = Field(default=0.0, ge=0)
    collective_latency_s: dict[CommKind, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)


class RuntimeSupport(BaseModel):
    """What the runtime behind this target executes; the layout search picks only these (an explicit choice
    outside them is refused). Accelerators run plans through Megatron-LM / MindSpeed-LLM, which have all of them;
    the ``cpu`` emulator runs moeplan's own runtime."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    schedules: tuple[ScheduleKind, ...] = SCHEDULES
    dispatchers: tuple[Dispatcher, ...] = DISPATCHERS
    overlap: tuple[Mechanism, ...] = MECHANISMS


class Target(BaseModel):
    """A device type and its cluster links.

    ``fp8_flops``: dense FP8 peak of the matrix unit (None: no FP8). ``training_dtype`` ``fp8`` runs the decoder
    layers' GEMMs in FP8 at that peak and keeps the rest in bf16 (DeepSeek-V3 arXiv 2412.19437 §3.3).
    ``comm_compute_slowdown``: how much slower compute runs while a collective of the device is in flight (a
    fraction; 0 where unknown).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    backend: Literal["cpu", "cuda", "npu"]
    devices_per_node: int = Field(gt=0)
    memory_bytes: float = Field(gt=0)  # device memory (HBM) per device
    usable_memory_fraction: float = Field(default=0.9, gt=0, le=1)  # the rest: framework, fragmentation
    hbm_bandwidth_bytes_per_s: float = Field(gt=0)
    cube_flops: float = Field(gt=0)  # dense bf16 peak of the matrix unit (tensor cores / Ascend cube)
    fp8_flops: float | None = Field(default=None, gt=0)
    vector_flops: float = Field(gt=0)  # peak of the vector unit
    matmul_alignment: int = Field(default=16, gt=0)  # GEMM dims off a multiple of this lose efficiency
    host_bandwidth_bytes_per_s: float = Field(gt=0)  # device<->host copies (swap)
    intra_node: Link
    inter_node: Link
    efficiency: Efficiency = Efficiency()
    launch: LaunchCost = LaunchCost()
    training_dtype: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"  # as the runtime trains (fp8: GEMMs only)
    comm_compute_slowdown: float = Field(default=0.0, ge=0)
    runtime: RuntimeSupport = RuntimeSupport()
    variant: str | None = None

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

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
                training_dtype: str | None = None) -> Target:
    """Load a shipped target by name (or a path to a target YAML file).

    Raises TargetError: unknown name or variant, malformed YAML, or a field that breaks the schema.
    """
    if ":" in name and variant is None:
        name, variant = name.split(":", 1)
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.exists():
        text, label = path.read_text(), str(path)
    elif name in target_names():
        text, label = (_DIR / f"{name}.yaml").read_text(), name
    else:
        raise TargetError(f"target={name!r}: unknown; choose one of {', '.join(target_names())} or a target .yaml")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TargetError(f"target={label!r}: malformed YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise TargetError(f"target={label!r}: a target file must hold a mapping")
    variants = data.pop("variants", {}) or {}
    default_variant = data.pop("default_variant", None)
    variant = variant or default_variant
    if not isinstance(variants, dict) or not all(isinstance(v, dict) for v in variants.values()):
        raise TargetError(f"variants={variants!r}: must map each variant name to a mapping of fields (target {label})")
    if variant is not None:
        if variant not in variants:
            raise TargetError(f"variant={variant!r}: target {label} has variants {sorted(variants) or 'none'}")
        data.update(variants[variant])
        data["variant"] = variant
    if devices_per_node is not None:
        data["devices_per_node"] = devices_per_node
    if training_dtype is not None:
        data["training_dtype"] = training_dtype
    try:
        target = Target.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        if err["type"] == "missing":
            raise TargetError(f"{field}: required field missing (target {label})") from None
        raise TargetError(f"{field}={err.get('input')!r}: {err['msg']} (target {label})") from None
    if target.training_dtype == "fp8" and target.fp8_flops is None:
        raise TargetError(f"training_dtype='fp8': target {label} has no FP8 matrix unit (fp8_flops is not set)")
    return target
