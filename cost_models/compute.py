"""Compute cost model: seconds per operator on one device of a target (DESIGN §5, "compute").

An operator runs on the matrix unit (``cube``: Ascend cube / NVIDIA tensor cores) or on the ``vector`` unit. Its
time is a roofline plus a fixed launch cost::

    t = max(flops / (peak(unit) · efficiency.compute · matmul_efficiency(mnk)),
            bytes / (hbm_bandwidth · efficiency.memory)) + launch(unit)

``peak(cube)`` is ``target.cube_flops`` (dense bf16), ``peak(vector)`` is ``target.vector_flops``; the efficiencies
and the launch costs (``launch.matmul_s`` for cube ops, ``launch.other_s`` otherwise) are the target's (defaults from
Huawei's Ascend/msmodeling: compute 0.7, memory 0.6, 5 µs matmul, 2 µs other; FACTS §2). An op with no FLOPs and no
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

Sources: the roofline is Williams, Waterman & Patterson, "Roofline: an insightful visual performance model for
multicore architectures", CACM 52(4), 2009; the fixed launch costs and efficiencies are msmodeling's defaults.
"""
from __future__ import annotations

import math
from typing import Literal

from moeplan.ir import OpAnnotation, OpKind
from moeplan.targets import Target

Unit = Literal["cube", "vector"]

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

    Padded-tile model: the unit computes whole ``alignment``-sized tiles (16×16×16 on Ascend's cube, FACTS §2), so
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


def op_time_s(*, flops: float, bytes_moved: float, unit: Unit, mnk: tuple[int, int, int] | None,
              target: Target, launch_s: float | None = None) -> float:
    """Seconds one device of ``target`` spends on an op of ``flops`` FLOPs that moves ``bytes_moved`` HBM bytes.

    ``max(flops / (peak(unit) · efficiency.compute · matmul_efficiency(mnk)), bytes / (hbm_bw · efficiency.memory))
    + launch`` (DESIGN §5; roofline, Williams et al. 2009). The alignment factor applies to ``cube`` ops only; the
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
        peak = target.cube_flops * matmul_efficiency(mnk, alignment=target.matmul_alignment)
        default_launch_s = target.launch.matmul_s
    else:
        peak = target.vector_flops
        default_launch_s = target.launch.other_s
    launch_s = default_launch_s if launch_s is None else launch_s
    compute_s = flops / (peak * target.efficiency.compute)
    memory_s = bytes_moved / (target.hbm_bandwidth_bytes_per_s * target.efficiency.memory)
    return max(compute_s, memory_s) + launch_s


def scaled_mnk(mnk: tuple[int, int, int] | None, *, scale: float) -> tuple[int, int, int] | None:
    """(M, N, K) with the token dim M multiplied by ``scale`` (rounded up, at least 1); N and K unchanged."""
    if mnk is None:
        return None
    m, n, k = mnk
    return (max(1, math.ceil(m * scale - 1e-9)), n, k)


def annotation_time_s(op: OpAnnotation, *, scale: float, target: Target, weight_scale: float = 1.0,
                      m_scale: float | None = None) -> tuple[float, float, float]:
    """(forward, input-gradient dX, weight-gradient dW) seconds of one IR op on one device.

    The IR costs one unsharded sequence (moeplan/ir.py). ``scale`` multiplies the op's FLOPs and its activation
    bytes (the ``shard`` pass passes e.g. ``micro_batch / (tp · cp)``); ``weight_scale`` multiplies its weight bytes
    (``2 · param_count``, bf16, part of ``bytes_read``), which follow how the weights are sharded, not the tokens
    (1/tp for TP ops, 1/(ep·tp) for routed experts, 1 when replicated). ``m_scale`` (default ``scale``) multiplies
    the GEMM's M (token) dim for the alignment factor: for a grouped expert GEMM it is the growth of tokens per
    local expert, not of tokens per device. Under TP the real GEMM splits N (column-parallel) or K (row-parallel);
    applying the split to M instead changes only the padding/small-tile factor, a second-order effect accepted here.

    Backward assumptions (stated, not measured):
    - dX costs ``bwd_input_flops`` and moves the forward's bytes (a GEMM's dX reads dY and W and writes dX: the same
      sizes as the forward's X, W, Y; an elementwise op's backward reads dY and the saved input, writes dX). Every op
      has a dX except EMBEDDING, whose input is token ids.
    - dW exists only for ops that own parameters (``param_count > 0``): ``bwd_weight_flops`` and the forward's bytes
      (a GEMM's dW reads X and dY and writes dW). The embedding's dW is a scatter-add: bytes, no FLOPs.
    - COLLECTIVE nodes cost 0 here: communication is costed by ``cost_models.comm``.
    - Bytes are scaled to the target's training dtype (``target.dtype_bytes / 2``); on a ``"kernel"``-granularity
      target each pass pays its kernel count times the forward / backward per-kernel launch (module docstring).

    Raises ValueError: ``scale``, ``weight_scale`` or ``m_scale`` <= 0.
    """
    for name, v in (("scale", scale), ("weight_scale", weight_scale), ("m_scale", m_scale)):
        if v is not None and v <= 0:
            raise ValueError(f"{name}={v!r}: must be > 0")
    if op.op_kind == OpKind.COLLECTIVE:
        return (0.0, 0.0, 0.0)
    unit: Unit = "cube" if op.unit == "cube" else "vector"
    mnk = scaled_mnk(op.matmul_mnk, scale=scale if m_scale is None else m_scale)
    weight_bytes = min(2 * op.param_count, op.bytes_read)
    bytes_moved = ((op.bytes_read + op.bytes_written - weight_bytes) * scale + weight_bytes * weight_scale) \
        * target.dtype_bytes / 2
    launches = _launches(op, target)
    fwd = op_time_s(flops=op.fwd_flops * scale, bytes_moved=bytes_moved, unit=unit, mnk=mnk, target=target,
                    launch_s=launches[0])
    has_dx = op.op_kind != OpKind.EMBEDDING
    dx = op_time_s(flops=op.bwd_input_flops * scale, bytes_moved=bytes_moved, unit=unit, mnk=mnk,
                   target=target, launch_s=launches[1]) if has_dx else 0.0
    dw = op_time_s(flops=op.bwd_weight_flops * scale, bytes_moved=bytes_moved, unit=unit, mnk=mnk,
                   target=target, launch_s=launches[2]) if op.param_count > 0 else 0.0
    return (fwd, dx, dw)


def _launches(op: OpAnnotation, target: Target) -> tuple[float | None, float | None, float | None]:
    """Launch seconds of (forward, dX, dW): None (the per-op default of ``op_time_s``) on an ``"op"`` target,
    kernels × per-kernel cost on a ``"kernel"`` target."""
    launch = target.launch
    if launch.granularity == "op":
        return (None, None, None)
    return (op.fwd_kernels * launch.forward_kernel_s, op.bwd_input_kernels * launch.backward_kernel_s,
            op.bwd_weight_kernels * launch.backward_kernel_s)
