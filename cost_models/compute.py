"""Compute cost model: seconds per operator on one device of a target (docs/architecture.md §5, "compute").

An operator runs on the matrix unit (``cube``: Ascend cube / NVIDIA tensor cores) or on the ``vector`` unit. Its
time is a roofline plus a fixed launch cost::

    t = max(flops / (peak(unit) · efficiency.compute · matmul_efficiency(mnk)),
            bytes / (hbm_bandwidth · efficiency.memory)) + launch(unit)

``peak(cube)`` is ``target.cube_flops`` (dense bf16), ``peak(vector)`` is ``target.vector_flops``; the efficiencies
and the launch costs (``launch.matmul_s`` for cube ops, ``launch.other_s`` otherwise) are the target's (defaults from
Huawei's Ascend/msmodeling: compute 0.7, memory 0.6, 5 µs matmul, 2 µs other; docs/references.md §2). An op with no FLOPs and no
bytes (a view, a reshape) costs nothing and launches no kernel.

Launch granularity is a property of the target's runtime (``Target.launch.granularity``, targets/__init__.py): on
accelerators (``"op"``) one traced op is one production kernel (fused attention, norm, grouped GEMM), so the launch
above is paid once per op and pass. An eager runtime (``"kernel"``: the ``cpu`` emulator) dispatches every aten op
of the op's eager code — measured at trace time as ``OpAnnotation.fwd_kernels`` / ``bwd_input_kernels`` /
``bwd_weight_kernels`` (tiny-pangu: ≈11 aten ops per traced op) — and pays ``launch.forward_kernel_s`` per forward
kernel (dispatch + autograd recording) and ``launch.backward_kernel_s`` per backward kernel (autograd engine), views
included; those costs are measured by ``moeplan calibrate``.

Bytes: the IR counts bf16 (2 bytes per element, moeplan/ir.py); a target training in another dtype
(``Target.training_dtype``, e.g. the fp32 cpu emulator) moves ``target.dtype_bytes / 2`` times as many bytes.

MoE and precision (docs/step-model.md §5):

- The router's FLOPs are its gating GEMM (``h × E``), priced on the matrix unit like any GEMM.
- On a target with measured GEMM shapes (``efficiency.gemm_m``, a sweep over M; ``gemm_k0``), a GEMM of
  per-device shape (M, N, K) runs at ``efficiency.compute · curve(M) · K/(K + K0)`` (:func:`gemm_shape_efficiency`):
  for the grouped expert GEMM M is the tokens per local expert; its w2 reduces over the expert width. Targets
  without them keep the padded-tile model below.
- Fused attention runs at ``efficiency.attention_fwd`` / ``attention_bwd`` of the bf16 peak where the target
  gives them (FlashAttention measurements), else at ``efficiency.compute``; a table over sequence length is read
  at the length the kernel runs over (:func:`attention_seq_len`).
- ``training_dtype == "fp8"``: the decoder layers' GEMMs (matmul and grouped matmul; not the output layer, the
  embedding, the router or attention, which stay bf16 — DeepSeek-V3 arXiv 2412.19437 §3.3.1) run at
  ``target.fp8_flops`` with ``efficiency.fp8_gemm_m`` for the grouped GEMM, and each such GEMM pass first
  quantizes its activation operand online (1×128 tiles, §3.3.2): a memory-bound pass that reads it in bf16 and
  writes FP8, 1.5 bytes per bf16 byte, plus one launch.

Sources: the roofline is Williams, Waterman & Patterson, "Roofline: an insightful visual performance model for
multicore architectures", CACM 52(4), 2009; the fixed launch costs and efficiencies are msmodeling's defaults.
"""
from __future__ import annotations

import math
from typing import Literal

from moeplan.ir import LayerKind, OpAnnotation, OpKind
from moeplan.targets import Target

Unit = Literal["cube", "vector"]
FUSED_ATTENTION_BWD_RECOMPUTE = 1.25
"""A fused attention backward recomputes the score matrix: 2.5× the forward's FLOPs where autograd's math path does
2× (Dao, FlashAttention-2, arXiv 2307.08691 §4: the benchmarks count the backward as 2.5× the forward). The
targets' ``attention_bwd`` efficiencies are measured on that count, so the dX time prices 1.25× the traced dX."""
FP8_CAST_BYTES_PER_BF16_BYTE = 1.5  # read 2 bytes (bf16), write 1 (e4m3) per element; scales are 1/128 of that
_BF16_LAYERS = frozenset({LayerKind.HEAD, LayerKind.MTP_HEAD, LayerKind.EMBEDDING})

MIN_TILE_ALIGNMENTS = 8
"""A GEMM dim shorter than ``MIN_TILE_ALIGNMENTS · alignment`` elements still occupies one full macro tile.

Rationale: matrix-unit kernels work on macro tiles much larger than one instruction. Ascend C's Matmul API splits
a GEMM into ``baseM × baseN × baseK`` blocks per AI core (``TCubeTiling``, hiascend Matmul Tiling docs), and
cuBLAS/CUTLASS kernels on tensor cores use threadblock tiles of 64–256 elements per side; a dim shorter than the
block still pays for a whole block. 8 alignments (128 on a 16-aligned target, 64 on an 8-aligned one) is taken as the
smallest block such a library uses for a large GEMM [U: a modelling choice, not a measured figure];
``moeplan calibrate`` should replace it with a measured efficiency table.
"""


def _padded_dim(dim: int, *, alignment: int) -> int:
    """``dim`` rounded up to a multiple of ``alignment``, and to at least one macro tile (see MIN_TILE_ALIGNMENTS)."""
    return max(math.ceil(dim / alignment) * alignment, MIN_TILE_ALIGNMENTS * alignment)


def matmul_efficiency(mnk: tuple[int, int, int] | None, *, alignment: int) -> float:
    """Fraction of the matrix unit's work that is useful for a GEMM of shape (M, N, K), in (0, 1].

    Padded-tile model: the unit computes whole ``alignment``-sized tiles (16×16×16 on Ascend's cube, docs/references.md §2), so
    a dim ``d`` costs as much as ``ceil(d / a) · a``; and each dim occupies at least one macro tile of
    ``MIN_TILE_ALIGNMENTS · a`` elements (small GEMMs under-fill the unit)::

        eff = Π_d d / Π_d max(ceil(d / a) · a, MIN_TILE_ALIGNMENTS · a)

    The product is symmetric in M, N, K, so the backward GEMMs (dX: M×K×N, dW: K×N×M) get the forward's factor.
    ``None`` (no dominant GEMM) gives 1.0. Example on a 16-aligned target: 7680 and 8192 are multiples of 16 (1.0);
    a 7681 dim pads to 7696 (7681/7696 ≈ 0.998 per such dim).

    Raises ValueError: a dim < 1 or alignment < 1.
    """
    if alignment < 1:
        raise ValueError(f"alignment={alignment!r}: must be a positive integer")
    if mnk is None:
        return 1.0
    if any(d < 1 for d in mnk):
        raise ValueError(f"mnk={mnk!r}: every GEMM dim must be >= 1")
    useful = math.prod(mnk)
    padded = math.prod(_padded_dim(d, alignment=alignment) for d in mnk)
    return useful / padded


def curve_factor(curve: tuple[tuple[int, float], ...], m: float) -> float:
    """Piecewise-linear interpolation of ``curve`` (``[[M, fraction], ...]``, ascending M) in log M, clamped at
    both ends."""
    if m <= curve[0][0]:
        return curve[0][1]
    for (m0, f0), (m1, f1) in zip(curve, curve[1:]):
        if m <= m1:
            x = (math.log(m) - math.log(m0)) / (math.log(m1) - math.log(m0))
            return f0 + x * (f1 - f0)
    return curve[-1][1]


def k_pipeline(k: int, k0: float | None) -> float:
    """``K / (K + K0)``: a GEMM's main loop over K is preceded by filling the pipeline and followed by the epilogue,
    worth ``K0`` elements of K (1 without a ``K0``)."""
    return k / (k + k0) if k0 else 1.0


def attention_seq_len(mnk: tuple[int, int, int] | None) -> int | None:
    """The sequence length a fused attention kernel runs over, for reading a target's attention efficiency table:
    the key length, N of the op's per-device score GEMM ``(queries, keys, head dim)`` (the trace's
    ``matmul_mnk``; cost_models/sharding.py ``gemm_shape`` scales only M, the queries); None without a shape.

    Why the keys and not the queries, which CP splits: moeplan prices context parallelism as an all-gather of K
    and V (docs/step-model.md §1; Megatron-LM ``--cp-comm-type all_gather``, as moeplan/runtime/context_parallel.py
    runs it), so each rank's kernel runs its ``s/cp`` queries (two load-balanced chunks) against every key before
    them, up to the whole sequence ``s``. A FlashAttention kernel's efficiency grows with the keys each query
    tile loops over (the loop's fill and epilogue, and the masked diagonal block, are paid once per tile), and
    those are the same, ``s/2`` on average, as in an unsplit causal kernel over ``s``, which is what
    FlashAttention-3's figures measure at length ``s`` (``s`` queries over ``s`` keys, causal). So the table is
    read at ``s`` whatever ``cp`` is. Ring attention (Megatron-LM / Transformer Engine's ``p2p`` CP) would
    instead run, at each of its ``cp`` steps, a block of ``s/cp`` queries over ``s/cp`` keys and read the table
    at ``s/cp``; moeplan models neither its communication nor that length."""
    return None if mnk is None else mnk[1]


def attention_efficiency(value: float | tuple[tuple[int, float], ...] | None, *, seq_len: int | None
                         ) -> float | None:
    """A target's ``efficiency.attention_fwd`` / ``attention_bwd`` at ``seq_len``: a number is the same at every
    length; a table ``[[seq_len, fraction], ...]`` is read like a GEMM curve (:func:`curve_factor`: linear in
    log seq_len, clamped at both ends); None stays None (the op then runs at ``efficiency.compute``).

    Raises ValueError: a table and no ``seq_len``."""
    if value is None or isinstance(value, float):
        return value
    if seq_len is None:
        raise ValueError("the attention efficiency is a table over sequence length, but the op has no score GEMM "
                         "shape (matmul_mnk) to read its length from")
    return curve_factor(value, seq_len)


def gemm_shape_efficiency(mnk: tuple[int, int, int], *, grouped: bool, alignment: int,
                          curve: tuple[tuple[int, float], ...], k0: float | None) -> float:
    """Fraction of the plateau throughput (M ≥ 4096, long K) of a GEMM of per-device shape (M, N, K) on a target
    with a measured M curve: ``curve(M) · K/(K + K0)`` times the alignment padding of N and K. A grouped op is the
    SwiGLU experts: w1 and w3 reduce over K (the hidden size), w2 over N (the expert width), so its K factor is the
    FLOP-weighted harmonic mean of those three GEMMs'."""
    m, n, k = mnk
    pad = math.prod(d / (math.ceil(d / alignment) * alignment) for d in (n, k))
    kfac = 3 / (2 / k_pipeline(k, k0) + 1 / k_pipeline(n, k0)) if grouped else k_pipeline(k, k0)
    return curve_factor(curve, m) * kfac * pad


def op_time_s(*, flops: float, bytes_moved: float, unit: Unit, mnk: tuple[int, int, int] | None,
              target: Target, launch_s: float | None = None, peak_flops: float | None = None,
              efficiency: float | None = None, shape_factor: float | None = None) -> float:
    """Seconds one device of ``target`` spends on an op of ``flops`` FLOPs that moves ``bytes_moved`` HBM bytes.

    ``max(flops / (peak(unit) · efficiency.compute · matmul_efficiency(mnk)), bytes / (hbm_bw · efficiency.memory))
    + launch`` (docs/architecture.md §5; roofline, Williams et al. 2009). The alignment factor applies to ``cube`` ops only; the
    launch is ``launch.matmul_s`` for cube ops and ``launch.other_s`` for vector ops, unless ``launch_s`` gives it
    (the per-kernel launch of an eager target). 0 FLOPs and 0 bytes cost 0 plus an explicit ``launch_s``.

    Raises ValueError: negative flops or bytes, or an unknown unit.
    """
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops={flops!r}, bytes_moved={bytes_moved!r}: must be >= 0")
    if unit not in ("cube", "vector"):
        raise ValueError(f"unit={unit!r}: must be 'cube' or 'vector'")
    if flops == 0 and bytes_moved == 0:
        return launch_s or 0.0
    if unit == "cube":
        shape = matmul_efficiency(mnk, alignment=target.matmul_alignment) if shape_factor is None else shape_factor
        peak = (peak_flops or target.cube_flops) * shape
        default_launch_s = target.launch.matmul_s
    else:
        peak = target.vector_flops
        default_launch_s = target.launch.other_s
    launch_s = default_launch_s if launch_s is None else launch_s
    compute_s = flops / (peak * (efficiency or target.efficiency.compute))
    memory_s = bytes_moved / (target.hbm_bandwidth_bytes_per_s * target.efficiency.memory)
    return max(compute_s, memory_s) + launch_s


def scaled_mnk(mnk: tuple[int, int, int] | None, *, scale: float) -> tuple[int, int, int] | None:
    """(M, N, K) with the token dim M multiplied by ``scale`` (rounded up, at least 1); N and K unchanged."""
    if mnk is None:
        return None
    m, n, k = mnk
    return (max(1, math.ceil(m * scale - 1e-9)), n, k)


def annotation_time_s(op: OpAnnotation, *, scale: float, target: Target, weight_scale: float = 1.0,
                      mnk: tuple[int, int, int] | None = None) -> tuple[float, float, float]:
    """(forward, input-gradient dX, weight-gradient dW) seconds of one IR op on one device.

    The IR costs one unsharded sequence (moeplan/ir.py). ``scale`` multiplies the op's FLOPs and its activation
    bytes (the ``shard`` pass passes e.g. ``micro_batch / (tp · cp)``); ``weight_scale`` multiplies its weight bytes
    (``2 · param_count``, bf16, part of ``bytes_read``), which follow how the weights are sharded, not the tokens
    (1/tp for TP ops, 1/(ep·tp) for routed experts, 1 when replicated). ``mnk`` is the dominant GEMM's shape on
    the device (cost_models/sharding.py ``gemm_shape``: tokens per local expert for the grouped GEMM, TP splitting N or K);
    None: the traced shape with M scaled by ``scale``.

    Backward assumptions (stated, not measured):
    - dX costs ``bwd_input_flops`` and moves the forward's bytes (a GEMM's dX reads dY and W and writes dX: the same
      sizes as the forward's X, W, Y; an elementwise op's backward reads dY and the saved input, writes dX). Every op
      has a dX except EMBEDDING, whose input is token ids.
    - dW exists only for ops that own parameters (``param_count > 0``): ``bwd_weight_flops`` and the forward's bytes
      (a GEMM's dW reads X and dY and writes dW). The embedding's dW is a scatter-add: bytes, no FLOPs.
    - COLLECTIVE nodes cost 0 here: communication is costed by ``cost_models.comm``.
    - Bytes are scaled to the target's training dtype (``target.dtype_bytes / 2``); on a ``"kernel"``-granularity
      target each pass pays its kernel count times the forward / backward per-kernel launch (module docstring).

    Raises ValueError: ``scale`` or ``weight_scale`` <= 0.
    """
    for name, v in (("scale", scale), ("weight_scale", weight_scale)):
        if v <= 0:
            raise ValueError(f"{name}={v!r}: must be > 0")
    if op.op_kind == OpKind.COLLECTIVE:
        return (0.0, 0.0, 0.0)
    unit: Unit = "cube" if op.unit == "cube" or op.op_kind == OpKind.ROUTER else "vector"
    mnk = mnk if mnk is not None else scaled_mnk(op.matmul_mnk, scale=scale)
    weight_bytes = min(2 * op.param_count, op.bytes_read)
    act_in = max(0, op.bytes_read - weight_bytes) * scale
    bytes_moved = ((op.bytes_read + op.bytes_written - weight_bytes) * scale + weight_bytes * weight_scale) \
        * target.dtype_bytes / 2
    launches = _launches(op, target)
    fp8 = runs_fp8(op, target)
    peak = target.fp8_flops if fp8 else None
    curve = target.efficiency.fp8_gemm_m if fp8 else target.efficiency.gemm_m
    eff = target.efficiency
    attn = op.op_kind == OpKind.ATTENTION
    shape = None
    if curve and mnk is not None:  # a target with measured GEMM shapes; attention's efficiencies are its own
        shape = 1.0 if attn else gemm_shape_efficiency(mnk, grouped=op.op_kind == OpKind.GROUPED_MATMUL,
                                                       alignment=target.matmul_alignment, curve=curve,
                                                       k0=eff.gemm_k0)
    cast = _fp8_cast_s(act_in, target) if fp8 else 0.0

    def one(flops: float, launch: float | None, efficiency: float | None) -> float:
        return op_time_s(flops=flops * scale, bytes_moved=bytes_moved, unit=unit, mnk=mnk, target=target,
                         launch_s=launch, peak_flops=peak, efficiency=efficiency, shape_factor=shape) + cast

    attn_len = attention_seq_len(mnk) if attn else None
    attn_fwd = attention_efficiency(eff.attention_fwd, seq_len=attn_len) if attn else None
    attn_bwd = attention_efficiency(eff.attention_bwd, seq_len=attn_len) if attn else None
    fwd = one(op.fwd_flops, launches[0], attn_fwd)
    has_dx = op.op_kind != OpKind.EMBEDDING
    dx_flops = op.bwd_input_flops * (FUSED_ATTENTION_BWD_RECOMPUTE if attn_bwd else 1.0)
    dx = one(dx_flops, launches[1], attn_bwd) if has_dx else 0.0
    dw = one(op.bwd_weight_flops, launches[2], None) if op.param_count > 0 else 0.0
    return (fwd, dx, dw)


def runs_fp8(op: OpAnnotation, target: Target) -> bool:
    """Whether ``op`` is a GEMM that runs in FP8 under the target's training dtype (module docstring)."""
    return (target.training_dtype == "fp8" and target.fp8_flops is not None
            and op.op_kind in (OpKind.MATMUL, OpKind.GROUPED_MATMUL) and op.layer_kind not in _BF16_LAYERS)


def _fp8_cast_s(act_bytes: float, target: Target) -> float:
    """Seconds to quantize ``act_bytes`` of bf16 activations to FP8 before a GEMM pass (memory-bound)."""
    if act_bytes <= 0:
        return 0.0
    return (act_bytes * FP8_CAST_BYTES_PER_BF16_BYTE / (target.hbm_bandwidth_bytes_per_s * target.efficiency.memory)
            + target.launch.other_s)


def _launches(op: OpAnnotation, target: Target) -> tuple[float | None, float | None, float | None]:
    """Launch seconds of (forward, dX, dW): None (the per-op default of ``op_time_s``) on an ``"op"`` target,
    kernels × per-kernel cost on a ``"kernel"`` target."""
    launch = target.launch
    if launch.granularity == "op":
        return (None, None, None)
    return (op.fwd_kernels * launch.forward_kernel_s, op.bwd_input_kernels * launch.backward_kernel_s,
            op.bwd_weight_kernels * launch.backward_kernel_s)
