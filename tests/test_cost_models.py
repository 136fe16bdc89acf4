"""Compute (roofline + alignment) and communication (α–β) cost models against hand-derived numbers."""
from __future__ import annotations

import math

import pytest

from moeplan.cost_models.comm import all_to_all_time_s, collective_time_s, group_tier, local_peer_range
from moeplan.cost_models.compute import (annotation_time_s, curve_factor, gemm_shape_efficiency, k_pipeline,
                                         matmul_efficiency, op_time_s)
from moeplan.ir import LayerKind, OpAnnotation, OpKind, ShardHint
from moeplan.targets import load_target

NPU = load_target("ascend-910b")
NPU_313 = load_target("ascend-910b:313t")
H100 = load_target("h100")
MATMUL_LAUNCH = 5e-6  # msmodeling default, docs/references.md §2
OTHER_LAUNCH = 2e-6
COLL_LAUNCH = 10e-6


def test_ascend_910b_peak() -> None:
    assert NPU.cube_flops == 353.9e12


# ---------------------------------------------------------------- compute: alignment


def test_alignment_penalty_7680_8192_7681() -> None:
    assert matmul_efficiency((7680, 7680, 7680), alignment=16) == 1.0
    assert matmul_efficiency((8192, 8192, 8192), alignment=16) == 1.0
    # 7681 pads to 481 tiles of 16 = 7696
    assert matmul_efficiency((7681, 7680, 7680), alignment=16) == pytest.approx(7681 / 7696)
    assert matmul_efficiency((7681, 7681, 7681), alignment=16) == pytest.approx((7681 / 7696) ** 3)
    # an 8-aligned unit pads 7681 only to 7688
    assert matmul_efficiency((7681, 7680, 7680), alignment=8) == pytest.approx(7681 / 7688)
    assert matmul_efficiency((7680, 7680, 7688), alignment=16) == pytest.approx(7688 / 7696)


def test_small_gemm_penalty_and_symmetry() -> None:
    # dims below one macro tile (8 alignments = 128 on a 16-aligned unit) pay for the whole tile
    assert matmul_efficiency((16, 8192, 8192), alignment=16) == pytest.approx(16 / 128)
    assert matmul_efficiency((64, 8192, 8192), alignment=16) == pytest.approx(0.5)
    assert matmul_efficiency((128, 8192, 8192), alignment=16) == 1.0
    effs = [matmul_efficiency((m, 4096, 4096), alignment=16) for m in (1, 8, 16, 32, 100, 128, 129)]
    assert effs[:-2] == sorted(effs[:-2]) and effs[5] == 1.0 and effs[6] < 1.0
    assert matmul_efficiency((100, 7681, 48), alignment=16) == pytest.approx(
        matmul_efficiency((48, 100, 7681), alignment=16))
    assert matmul_efficiency(None, alignment=16) == 1.0
    with pytest.raises(ValueError):
        matmul_efficiency((0, 16, 16), alignment=16)
    with pytest.raises(ValueError):
        matmul_efficiency((16, 16, 16), alignment=0)


# ---------------------------------------------------------------- compute: roofline


def test_compute_bound_cube_op_hand_computed() -> None:
    # flops = peak · efficiency.compute → exactly 1 s, plus the 5 µs matmul launch
    flops = 353.9e12 * 0.7
    t = op_time_s(flops=flops, bytes_moved=1e6, unit="cube", mnk=(8192, 8192, 8192), target=NPU)
    assert t == pytest.approx(1.0 + MATMUL_LAUNCH, rel=1e-12)
    t313 = op_time_s(flops=flops, bytes_moved=1e6, unit="cube", mnk=(8192, 8192, 8192), target=NPU_313)
    assert t313 - MATMUL_LAUNCH == pytest.approx(353.9 / 294.9)
    t2 = op_time_s(flops=2 * flops, bytes_moved=1e6, unit="cube", mnk=(8192, 8192, 8192), target=NPU)
    assert t2 - MATMUL_LAUNCH == pytest.approx(2.0)
    misaligned = op_time_s(flops=flops, bytes_moved=1e6, unit="cube", mnk=(7681, 7681, 7681), target=NPU)
    assert misaligned - MATMUL_LAUNCH == pytest.approx((7696 / 7681) ** 3)


def test_memory_bound_vector_op_hand_computed() -> None:
    hbm = 1.6 * 2**40 * 0.6  # docs/references.md §2 1.6 TiB/s × msmodeling memory efficiency 0.6
    t = op_time_s(flops=1e9, bytes_moved=hbm, unit="vector", mnk=None, target=NPU)
    assert t == pytest.approx(1.0 + OTHER_LAUNCH, rel=1e-12)
    # the vector unit's peak: 22e12 · 0.7 FLOP/s → 1 s compute-bound when bytes are few
    t_vec = op_time_s(flops=22e12 * 0.7, bytes_moved=1.0, unit="vector", mnk=(7681, 1, 1), target=NPU)
    assert t_vec == pytest.approx(1.0 + OTHER_LAUNCH)  # alignment does not apply to the vector unit


def test_roofline_is_max_not_sum() -> None:
    flops, nbytes = 353.9e12 * 0.7, 1.6 * 2**40 * 0.6 * 0.5  # compute 1 s, memory 0.5 s
    assert op_time_s(flops=flops, bytes_moved=nbytes, unit="cube", mnk=None, target=NPU) == pytest.approx(
        1.0 + MATMUL_LAUNCH)
    assert op_time_s(flops=flops / 4, bytes_moved=nbytes, unit="cube", mnk=None, target=NPU) == pytest.approx(
        0.5 + MATMUL_LAUNCH)


def test_zero_op_costs_nothing_and_bad_input_raises() -> None:
    assert op_time_s(flops=0, bytes_moved=0, unit="vector", mnk=None, target=NPU) == 0.0
    assert op_time_s(flops=0, bytes_moved=0, unit="cube", mnk=(1, 1, 1), target=NPU) == 0.0
    with pytest.raises(ValueError):
        op_time_s(flops=-1, bytes_moved=0, unit="cube", mnk=None, target=NPU)
    with pytest.raises(ValueError):
        op_time_s(flops=1, bytes_moved=0, unit="tensor", mnk=None, target=NPU)  # type: ignore[arg-type]


def _op(kind: OpKind, *, m: int, n: int, k: int, params: int) -> OpAnnotation:
    gemm = 2.0 * m * n * k
    return OpAnnotation(
        name="proj", op_kind=kind, module_path="layers.0.mlp.proj", layer_kind=LayerKind.DENSE,
        fwd_flops=gemm, bwd_input_flops=gemm, bwd_weight_flops=gemm if params else 0.0,
        bytes_read=2 * (m * k + k * n), bytes_written=2 * m * n, output_bytes=2 * m * n, saved_bytes=0,
        saved_inputs=(), param_count=params, shard=ShardHint.TP,
        matmul_mnk=(m, n, k) if kind in (OpKind.MATMUL, OpKind.GROUPED_MATMUL) else None,
    )


def test_annotation_time_matmul_scales_and_splits() -> None:
    op = _op(OpKind.MATMUL, m=4096, n=7680, k=7680, params=7680 * 7680)
    fwd, dx, dw = annotation_time_s(op, scale=1.0, target=NPU)
    ideal = 2.0 * 4096 * 7680 * 7680 / (353.9e12 * 0.7)  # compute-bound: intensity ≫ the ridge point
    assert fwd - MATMUL_LAUNCH == pytest.approx(ideal)
    assert dx == pytest.approx(fwd) and dw == pytest.approx(fwd)  # same FLOPs and bytes, same padded tiles
    half = annotation_time_s(op, scale=0.5, target=NPU)
    assert half[0] - MATMUL_LAUNCH == pytest.approx(ideal / 2)
    # scale also shrinks M: 256 tokens × 0.25 = 64 < one 128-row tile → half the cube wasted, twice the time
    small = _op(OpKind.MATMUL, m=256, n=7680, k=7680, params=7680 * 7680)
    full = annotation_time_s(small, scale=1.0, target=NPU)[0] - MATMUL_LAUNCH
    # weights sharded alike (e.g. a TP split), so the GEMM stays compute-bound
    quarter = annotation_time_s(small, scale=0.25, target=NPU, weight_scale=0.25)[0] - MATMUL_LAUNCH
    assert quarter == pytest.approx(full * 0.25 / 0.5)
    with pytest.raises(ValueError):
        annotation_time_s(op, scale=0.0, target=NPU)


def test_annotation_time_weight_bytes_follow_weight_sharding() -> None:
    # a memory-bound op with weights (2 tokens): its time is nearly all weight traffic
    op = _op(OpKind.ELEMENTWISE, m=2, n=7680, k=7680, params=7680 * 7680)
    act = 2 * (2 * 7680) * 2
    hbm = 1.6 * 2**40 * 0.6
    fwd = annotation_time_s(op, scale=0.5, target=NPU, weight_scale=0.125)[0] - OTHER_LAUNCH
    assert fwd == pytest.approx((act * 0.5 + 2 * 7680 * 7680 * 0.125) / hbm)
    assert annotation_time_s(op, scale=0.5, target=NPU)[0] - OTHER_LAUNCH == pytest.approx(
        (act * 0.5 + 2 * 7680 * 7680) / hbm)
    # the device GEMM shape, not scale, sets the padded tiles: 256 tokens grown 4x fill the tiles again
    small = _op(OpKind.GROUPED_MATMUL, m=256, n=7680, k=7680, params=7680 * 7680)
    grown = annotation_time_s(small, scale=0.25, target=NPU, weight_scale=0.01, mnk=(1024, 7680, 7680))[0] \
        - MATMUL_LAUNCH
    assert grown == pytest.approx(2.0 * 256 * 7680 * 7680 * 0.25 / (353.9e12 * 0.7))
    with pytest.raises(ValueError, match="weight_scale=0"):
        annotation_time_s(op, scale=1.0, target=NPU, weight_scale=0)


def test_annotation_time_backward_rules() -> None:
    weightless = _op(OpKind.ELEMENTWISE, m=4096, n=7680, k=1, params=0)
    fwd, dx, dw = annotation_time_s(weightless, scale=1.0, target=NPU)
    assert fwd > OTHER_LAUNCH and dx > OTHER_LAUNCH and dw == 0.0
    emb = _op(OpKind.EMBEDDING, m=4096, n=7680, k=1, params=153600 * 7680)
    fwd, dx, dw = annotation_time_s(emb, scale=1.0, target=NPU)
    assert dx == 0.0 and dw > 0.0  # token ids have no gradient; the table gets a scatter-add
    coll = _op(OpKind.COLLECTIVE, m=4096, n=7680, k=1, params=0)
    assert annotation_time_s(coll, scale=1.0, target=NPU) == (0.0, 0.0, 0.0)


# ---------------------------------------------------------------- comm: α–β formulas


def test_single_rank_and_empty_payload_cost_nothing() -> None:
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
        assert collective_time_s(kind=kind, bytes=1e9, group_size=1, tier="inter", target=NPU) == 0.0
        assert collective_time_s(kind=kind, bytes=0, group_size=8, tier="inter", target=NPU) == 0.0
    assert all_to_all_time_s(bytes=1e9, group_size=1, stride=8, target=NPU) == 0.0


def test_ring_all_reduce_hand_computed() -> None:
    s = 196e9 * 0.7  # one second of HCCS at msmodeling's comm efficiency
    # 2·7/8 · 1 s + 14 steps · 0.5 µs + 10 µs launch
    t = collective_time_s(kind="all_reduce", bytes=s, group_size=8, tier="intra", target=NPU)
    assert t == pytest.approx(1.75 + 14 * 0.5e-6 + COLL_LAUNCH, rel=1e-12)
    # RoCE, 4 ranks: 2·3/4 · S / (25e9·0.7) + 6 · 1.5 µs + 10 µs
    t = collective_time_s(kind="all_reduce", bytes=25e9 * 0.7, group_size=4, tier="inter", target=NPU)
    assert t == pytest.approx(1.5 + 6 * 1.5e-6 + COLL_LAUNCH, rel=1e-12)


def test_reduce_scatter_all_gather_all_to_all_p2p_hand_computed() -> None:
    b = 25e9 * 0.7
    assert collective_time_s(kind="reduce_scatter", bytes=b, group_size=5, tier="inter", target=NPU) == \
        pytest.approx(4 / 5 + 4 * 1.5e-6 + COLL_LAUNCH)
    assert collective_time_s(kind="all_gather", bytes=b, group_size=5, tier="inter", target=NPU) == \
        pytest.approx(4.0 + 4 * 1.5e-6 + COLL_LAUNCH)
    assert collective_time_s(kind="all_to_all", bytes=b, group_size=5, tier="inter", target=NPU) == \
        pytest.approx(4 / 5 + 4 * 1.5e-6 + COLL_LAUNCH)
    assert collective_time_s(kind="p2p", bytes=b, group_size=2, tier="inter", target=NPU) == \
        pytest.approx(1.0 + 1.5e-6 + COLL_LAUNCH)


def test_measured_collective_latency_replaces_alpha_steps() -> None:
    # a calibrated target lists its 2-rank latency per kind; n ranks scale it by the kind's α steps (n-1 or 2(n-1))
    launch = H100.launch.model_copy(update=dict(collective_latency_s={"reduce_scatter": 2e-3, "all_gather": 1e-3}))
    target = H100.model_copy(update=dict(launch=launch))
    bw = H100.intra_node.bandwidth_bytes_per_s * H100.efficiency.comm
    assert collective_time_s(kind="reduce_scatter", bytes=1e6, group_size=2, tier="intra", target=target) == \
        pytest.approx(0.5 * 1e6 / bw + 2e-3)
    assert collective_time_s(kind="all_gather", bytes=1e6, group_size=4, tier="intra", target=target) == \
        pytest.approx(3 * 1e6 / bw + 3 * 1e-3)
    # kinds it does not list keep the α–β formula
    assert collective_time_s(kind="all_reduce", bytes=1e6, group_size=2, tier="intra", target=target) == \
        collective_time_s(kind="all_reduce", bytes=1e6, group_size=2, tier="intra", target=H100)


def test_collective_scaling_laws() -> None:
    def bw_part(kind: str, nbytes: float, n: int, tier: str = "intra") -> float:
        fixed = collective_time_s(kind=kind, bytes=1e-30, group_size=n, tier=tier, target=H100)
        return collective_time_s(kind=kind, bytes=nbytes, group_size=n, tier=tier, target=H100) - fixed

    s = 1 << 30
    assert bw_part("all_reduce", 2 * s, 8) == pytest.approx(2 * bw_part("all_reduce", s, 8))
    assert bw_part("all_reduce", s, 8) == pytest.approx(2 * bw_part("reduce_scatter", s, 8))
    # an all-gather of the shard moves what a reduce-scatter of the full tensor moves
    assert bw_part("all_gather", s / 8, 8) == pytest.approx(bw_part("reduce_scatter", s, 8))
    # the ring all-reduce's volume tends to 2·S/B as n grows
    b = 450e9 * H100.efficiency.comm
    assert bw_part("all_reduce", s, 1024) == pytest.approx(2 * s / b, rel=2e-3)
    assert bw_part("all_reduce", s, 2) == pytest.approx(s / b)
    # inter-node is slower than intra-node for every kind
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
        intra = collective_time_s(kind=kind, bytes=s, group_size=8, tier="intra", target=H100)
        inter = collective_time_s(kind=kind, bytes=s, group_size=8, tier="inter", target=H100)
        assert inter > intra


def test_bad_collective_arguments() -> None:
    with pytest.raises(ValueError):
        collective_time_s(kind="broadcast", bytes=1, group_size=2, tier="intra", target=NPU)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        collective_time_s(kind="p2p", bytes=1, group_size=2, tier="rack", target=NPU)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        collective_time_s(kind="p2p", bytes=-1, group_size=2, tier="intra", target=NPU)
    with pytest.raises(ValueError):
        collective_time_s(kind="p2p", bytes=1, group_size=0, tier="intra", target=NPU)
    with pytest.raises(ValueError):
        all_to_all_time_s(bytes=1, group_size=4, stride=0, target=NPU)


# ---------------------------------------------------------------- comm: tiers


def test_group_tier() -> None:
    assert group_tier(stride=1, group_size=8, devices_per_node=8) == "intra"  # TP8
    assert group_tier(stride=2, group_size=4, devices_per_node=8) == "intra"  # span 7
    assert group_tier(stride=8, group_size=2, devices_per_node=8) == "inter"  # span 9
    assert group_tier(stride=1, group_size=16, devices_per_node=8) == "inter"
    assert group_tier(stride=4, group_size=96, devices_per_node=384) == "intra"  # a whole CloudMatrix domain
    # blocks of 4·64 = 256 ranks: the second one, ranks 256–511, straddles the 384-device domain boundary
    assert group_tier(stride=4, group_size=64, devices_per_node=384) == "inter"
    assert group_tier(stride=1, group_size=1, devices_per_node=8) == "intra"
    # span fits but groups of 3 tile 8-device nodes unevenly: {6, 7, 8} straddles two nodes
    assert group_tier(stride=1, group_size=3, devices_per_node=8) == "inter"
    with pytest.raises(ValueError):
        group_tier(stride=0, group_size=2, devices_per_node=8)


def test_local_peer_range() -> None:
    assert local_peer_range(stride=1, group_size=8, devices_per_node=8) == (8, 8)
    assert local_peer_range(stride=2, group_size=8, devices_per_node=8) == (4, 4)  # {0,2,4,6 | 8,…}
    assert local_peer_range(stride=8, group_size=4, devices_per_node=8) == (1, 1)
    assert local_peer_range(stride=16, group_size=4, devices_per_node=8) == (1, 1)
    assert local_peer_range(stride=1, group_size=3, devices_per_node=8) == (1, 3)  # {6,7 | 8}
    assert local_peer_range(stride=3, group_size=4, devices_per_node=8) == (1, 3)  # {0,3,6 | 9}, {2,5 | 8,11}


def test_all_to_all_tiers_hand_computed() -> None:
    s = 1e9
    bi, be = 196e9 * 0.7, 25e9 * 0.7
    # inside one node: the intra-node all-to-all
    assert all_to_all_time_s(bytes=s, group_size=8, stride=1, target=NPU) == pytest.approx(
        7 / 8 * s / bi + 7 * 0.5e-6 + COLL_LAUNCH)
    # one member per node: all traffic on RoCE
    assert all_to_all_time_s(bytes=s, group_size=4, stride=8, target=NPU) == pytest.approx(
        3 / 4 * s / be + 3 * 1.5e-6 + COLL_LAUNCH)
    # EP32 over 4 nodes of 8: 7/32 of the buffer on HCCS, 24/32 on RoCE, concurrently → the RoCE share
    t = all_to_all_time_s(bytes=s, group_size=32, stride=1, target=NPU)
    assert t == pytest.approx(24 / 32 * s / be + 24 * 1.5e-6 + COLL_LAUNCH)
    assert 7 / 32 * s / bi < t - COLL_LAUNCH  # the intra share is hidden under it
    # a split group beats treating every peer as remote, and is slower than a one-node group
    flat_inter = collective_time_s(kind="all_to_all", bytes=s, group_size=32, tier="inter", target=NPU)
    flat_intra = collective_time_s(kind="all_to_all", bytes=s, group_size=32, tier="intra", target=NPU)
    assert flat_intra < t < flat_inter


def test_gemm_shape_efficiency_hand_computed() -> None:
    """curve(M) · K/(K + K0) · padding; the grouped SwiGLU experts mix K = hidden (w1, w3) and K = width (w2)."""
    curve = ((64, 0.25), (4096, 1.0))
    assert curve_factor(curve, 32) == 0.25 and curve_factor(curve, 8192) == 1.0
    assert curve_factor(curve, 512) == pytest.approx(0.25 + 0.75 * 0.5)  # halfway in log M
    assert k_pipeline(450, 450) == 0.5 and k_pipeline(7, None) == 1.0
    dense = gemm_shape_efficiency((4096, 4096, 1800), grouped=False, alignment=8, curve=curve, k0=600)
    assert dense == pytest.approx(0.75)
    grouped = gemm_shape_efficiency((512, 600, 1800), grouped=True, alignment=8, curve=curve, k0=600)
    assert grouped == pytest.approx(curve_factor(curve, 512) * 3 / (2 / 0.75 + 1 / 0.5))
    assert gemm_shape_efficiency((4096, 4095, 1800), grouped=False, alignment=8, curve=curve, k0=600) == \
        pytest.approx(0.75 * 4095 / 4096)  # N = 4095 pads to 4096


def test_h800_fp8_gemms_follow_deepgemm() -> None:
    """The H800 target's FP8 GEMM model against DeepGEMM's README table (M = 4096; TFLOPS): within 8%."""
    h800 = load_target("h800")
    for k, n, measured in ((512, 32768, 775), (1536, 24576, 1212), (2048, 7168, 1168), (7168, 4096, 1410),
                           (16384, 7168, 1520)):
        model = h800.fp8_flops * h800.efficiency.compute * gemm_shape_efficiency(
            (4096, n, k), grouped=False, alignment=8, curve=h800.efficiency.fp8_gemm_m, k0=h800.efficiency.gemm_k0)
        assert model / 1e12 == pytest.approx(measured, rel=0.08)


def test_fp8_runs_decoder_gemms_at_the_fp8_peak_and_pays_the_cast() -> None:
    """Under training_dtype fp8 a decoder GEMM runs at fp8_flops and first quantizes its activations (1.5 bytes per
    bf16 byte at HBM speed); the output layer, attention and vector ops keep bf16."""
    fp8 = load_target("h800", training_dtype="fp8")
    bf16 = load_target("h800")
    gemm = _op(OpKind.MATMUL, m=4096, n=4096, k=4096, params=4096 * 4096)
    t8, t16 = annotation_time_s(gemm, scale=1.0, target=fp8)[0], annotation_time_s(gemm, scale=1.0, target=bf16)[0]
    act_in = gemm.bytes_read - 2 * gemm.param_count
    cast = act_in * 1.5 / (fp8.hbm_bandwidth_bytes_per_s * fp8.efficiency.memory) + fp8.launch.other_s
    assert t8 - cast - MATMUL_LAUNCH == pytest.approx((t16 - MATMUL_LAUNCH) / 2)
    head = _op(OpKind.MATMUL, m=4096, n=4096, k=4096, params=4096 * 4096)
    from dataclasses import replace
    head = replace(head, layer_kind=LayerKind.HEAD)
    assert annotation_time_s(head, scale=1.0, target=fp8) == annotation_time_s(head, scale=1.0, target=bf16)
    with pytest.raises(Exception, match="no FP8"):
        load_target("a100", training_dtype="fp8")


def _attention(seq: int, *, heads: int = 32, head_dim: int = 128) -> OpAnnotation:
    """A causal core-attention op over ``seq`` tokens as the trace records it: FLOPs halved for the mask, autograd's
    dX at twice the forward, reads Q, K, V and writes O (bf16), score GEMM (queries, keys, head dim)."""
    fwd = 4.0 * seq * seq * head_dim * heads / 2
    act = 2 * seq * heads * head_dim
    return OpAnnotation(
        name="attn_core", op_kind=OpKind.ATTENTION, module_path="layers.0.attn.core", layer_kind=LayerKind.DENSE,
        fwd_flops=fwd, bwd_input_flops=2 * fwd, bwd_weight_flops=0.0, bytes_read=3 * act, bytes_written=act,
        output_bytes=act, saved_bytes=0, saved_inputs=(), param_count=0, shard=ShardHint.TP,
        matmul_mnk=(seq, seq, head_dim), causal=True)


def _table_at(table: tuple[tuple[int, float], ...], seq: int) -> float:
    """The target's own table read by hand: linear in log seq_len between its points, clamped at both ends."""
    if seq <= table[0][0]:
        return table[0][1]
    for (s0, f0), (s1, f1) in zip(table, table[1:]):
        if seq <= s1:
            return f0 + (f1 - f0) * (math.log(seq) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return table[-1][1]


def test_attention_uses_its_measured_efficiency_and_fa_backward_count() -> None:
    """H100 attention: forward at attention_fwd of the bf16 peak; backward 1.25× the traced dX FLOPs (the fused
    kernel recomputes the scores) at attention_bwd; both read at the op's sequence length (4k here)."""
    attn = _attention(4096)  # compute-bound: s/4 FLOPs per byte
    fwd, dx, _ = annotation_time_s(attn, scale=1.0, target=H100)
    eff = H100.efficiency
    at_4k_fwd, at_4k_bwd = dict(eff.attention_fwd)[4096], dict(eff.attention_bwd)[4096]
    assert fwd - MATMUL_LAUNCH == pytest.approx(attn.fwd_flops / (H100.cube_flops * at_4k_fwd))
    assert dx - MATMUL_LAUNCH == pytest.approx(attn.bwd_input_flops * 1.25 / (H100.cube_flops * at_4k_bwd))


def test_attention_time_per_flop_falls_with_sequence_length_as_the_table_says() -> None:
    """On h100 the fused attention's forward and backward time per FLOP fall from a 1k to a 16k sequence by the
    target's own attention_fwd / attention_bwd tables (FlashAttention-3), read in log seq_len between points and
    clamped outside them; the length read is the keys', which CP does not split (the K/V all-gather)."""
    from dataclasses import replace

    eff = H100.efficiency
    peak = H100.cube_flops / 1e15  # PFLOP/s: times per PFLOP are of order 1 s, well above approx's abs tolerance

    def per_pflop(seq: int, *, scale: float = 1.0, bytes_moved: bool = True) -> tuple[float, float]:
        """Forward and backward seconds per PFLOP (the backward on FlashAttention's 2.5× count)."""
        op = _attention(seq)
        op = op if bytes_moved else replace(op, bytes_read=0, bytes_written=0)
        fwd, dx, _ = annotation_time_s(op, scale=scale, target=H100)
        return ((fwd - MATMUL_LAUNCH) * 1e15 / (op.fwd_flops * scale),
                (dx - MATMUL_LAUNCH) * 1e15 / (op.bwd_input_flops * 1.25 * scale))

    lengths = (1024, 2048, 4096, 6000, 8192, 16384)
    times = [per_pflop(s) for s in lengths]
    for seq, (fwd, dx) in zip(lengths, times):
        assert fwd == pytest.approx(1 / (peak * _table_at(eff.attention_fwd, seq))), seq
        assert dx == pytest.approx(1 / (peak * _table_at(eff.attention_bwd, seq))), seq
    assert all(a[0] > b[0] and a[1] > b[1] for a, b in zip(times, times[1:]))  # strictly faster per FLOP
    fwd_at = dict(eff.attention_fwd)
    assert times[0][0] / times[-1][0] == pytest.approx(fwd_at[16384] / fwd_at[1024])  # 0.623 / 0.428
    first, last = eff.attention_fwd[0], eff.attention_fwd[-1]
    # clamped below (256 tokens: s/4 FLOPs per byte is memory-bound, so its bytes are left out here)
    assert per_pflop(first[0] // 2, bytes_moved=False)[0] == pytest.approx(1 / (peak * first[1]))
    assert per_pflop(last[0] * 8)[0] == pytest.approx(1 / (peak * last[1]))  # and above (128k)
    # cp = 8 at 16k: each rank's 2k queries run over all 16k keys, priced at the 16k figure, not the 2k one
    assert per_pflop(16384, scale=1 / 8) == pytest.approx(times[-1])


def test_attention_efficiency_as_one_number_is_the_same_at_every_length() -> None:
    """The scalar form of attention_fwd / attention_bwd still prices every length alike; a table with no
    sequence length to read it at is refused."""
    scalar = H100.efficiency.model_copy(update=dict(attention_fwd=0.5, attention_bwd=0.4))
    h100 = H100.model_copy(update=dict(efficiency=scalar))
    for seq in (1024, 16384):
        op = _attention(seq)
        fwd, dx, _ = annotation_time_s(op, scale=1.0, target=h100)
        assert fwd - MATMUL_LAUNCH == pytest.approx(op.fwd_flops / (h100.cube_flops * 0.5))
        assert dx - MATMUL_LAUNCH == pytest.approx(op.bwd_input_flops * 1.25 / (h100.cube_flops * 0.4))
    no_shape = _op(OpKind.ATTENTION, m=4096, n=4096, k=128, params=0)  # matmul_mnk None
    assert annotation_time_s(no_shape, scale=1.0, target=h100)[0] > 0
    with pytest.raises(ValueError, match="table over sequence length"):
        annotation_time_s(no_shape, scale=1.0, target=H100)


def test_kernel_granularity_pays_per_aten_kernel_and_training_dtype_scales_bytes() -> None:
    """An eager target pays forward/backward per-kernel launches from the op's kernel counts; an "op" target one
    launch per op; an fp32 target moves twice the bf16 IR bytes."""
    from dataclasses import replace

    op = replace(_op(OpKind.ELEMENTWISE, m=2, n=64, k=1, params=64), fwd_kernels=5, bwd_input_kernels=7,
                 bwd_weight_kernels=3)
    launch = NPU.launch.model_copy(update=dict(granularity="kernel", forward_kernel_s=1e-6, backward_kernel_s=2e-6))
    eager = NPU.model_copy(update=dict(launch=launch))
    base = annotation_time_s(op, scale=1.0, target=NPU)
    kern = annotation_time_s(op, scale=1.0, target=eager)
    assert kern[0] - 5e-6 == pytest.approx(base[0] - OTHER_LAUNCH)
    assert kern[1] - 14e-6 == pytest.approx(base[1] - OTHER_LAUNCH)
    assert kern[2] - 6e-6 == pytest.approx(base[2] - OTHER_LAUNCH)
    view = replace(op, bytes_read=0, bytes_written=0, fwd_flops=0, bwd_input_flops=0, bwd_weight_flops=0)
    assert annotation_time_s(view, scale=1.0, target=NPU)[0] == 0.0  # a view launches nothing on an accelerator
    assert annotation_time_s(view, scale=1.0, target=eager)[0] == pytest.approx(5e-6)  # eager still dispatches
    fp32 = NPU.model_copy(update=dict(training_dtype="fp32"))
    assert fp32.dtype_bytes == 4 and NPU.dtype_bytes == 2
    mem = annotation_time_s(op, scale=1.0, target=fp32)[0] - OTHER_LAUNCH  # memory-bound: bytes double
    assert mem == pytest.approx(2 * (base[0] - OTHER_LAUNCH))
