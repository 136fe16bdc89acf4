"""Closed-form counts against docs/references.md §1 / §4.1, against the built model, and the ``describe`` data."""
from __future__ import annotations

import pytest

from moeplan.describe import describe_model
from moeplan.flops import count_params, flop_breakdown, flops_per_token, flops_per_token_with_mtp
from moeplan.ir import LayerKind
from moeplan.models import MoEModel
from moeplan.spec import ModelSpec, load_spec, registry_names

B, G = 1e9, 1e9


def _close(value: float, expected: float, rel: float) -> bool:
    return abs(value / expected - 1) <= rel


def test_deepseek_v3_acceptance():
    spec = load_spec("deepseek-v3")
    counts = count_params(spec)
    assert _close(counts.total, 671 * B, 0.01)
    assert _close(counts.activated, 37 * B, 0.03)
    assert _close(flops_per_token(spec, seq_len=4096), 249.8 * G, 0.001)  # docs/references.md §4.1: 249.8 (reported 250)
    assert _close(counts.total + counts.mtp + counts.mtp_copies, 685 * B, 0.01)  # "685B with MTP"


def test_pangu_ultra_acceptance():
    counts = count_params(load_spec("pangu-ultra-moe-718b"))
    assert _close(counts.total, 719 * B, 0.002)  # docs/references.md §1.1: ≈719B from the config, without MTP
    assert _close(counts.activated - counts.output, 39.2 * B, 0.002)  # docs/references.md §1.1: 39.2B counting one vocab matrix
    assert _close(counts.activated, 40.37 * B, 0.001)  # our convention: embedding and output matrix both counted


def test_pangu_pro_acceptance():
    counts = count_params(load_spec("pangu-pro-moe-72b"))
    assert _close(counts.total, 71.99 * B, 0.01) and _close(counts.activated, 16.50 * B, 0.01)
    assert counts.mtp == 0


def test_deepseek_v2_flops():
    """docs/references.md §4.1: DeepSeek-V2 at seq 4096 is 155.0 GFLOP/token by the same formula (reported 155)."""
    v2 = ModelSpec(name="deepseek-v2", vocab_size=102400, hidden_size=5120, num_layers=60, num_dense_layers=1,
                   dense_ffn_size=12288, attention="mla", num_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=160, top_k=6,
                   moe_ffn_size=1536, num_shared_experts=2, shared_ffn_size=3072, seq_len=4096, global_batch=1)
    assert _close(flops_per_token(v2, seq_len=4096), 155.0 * G, 0.002)


def test_gqa_and_mtp_terms():
    llama = load_spec("llama3-70b")
    parts = flop_breakdown(llama, seq_len=8192)
    h, q, kv = 8192, 64 * 128, 8 * 128
    assert parts.attention == 80 * (12 * h * q + 12 * h * kv + 6 * q * 8192)
    assert parts.mlp == 80 * 18 * h * 28672 and parts.logits == 6 * h * 128256 and parts.mtp_extra == 0
    ds = load_spec("deepseek-v3")
    extra = flops_per_token_with_mtp(ds, seq_len=4096) - flops_per_token(ds, seq_len=4096)
    one_layer = (flop_breakdown(ds, seq_len=4096).mlp - 3 * 18 * 7168 * 18432) / 58
    attn = flop_breakdown(ds, seq_len=4096).attention / 61
    assert extra == pytest.approx(one_layer + attn + 6 * 7168 * 129280 + 6 * (3 * 7168 + 2 * 7168 ** 2))


@pytest.mark.parametrize("name", registry_names())
def test_counts_equal_the_built_model(name):
    spec = load_spec(name)
    model = MoEModel(spec, device="meta")
    counts = count_params(spec)
    assert sum(p.numel() for p in model.parameters()) == counts.total + counts.mtp
    main = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp"))
    assert main == counts.total


def test_describe_718b():
    spec = load_spec("pangu-ultra-moe-718b")
    d = describe_model(spec, seq_len=4096)
    counts = count_params(spec)
    assert (d.params_total, d.params_activated, d.params_mtp) == (counts.total, counts.activated, counts.mtp)
    assert d.params_activated_one_vocab == counts.activated - counts.output
    assert d.flops_per_token == flops_per_token(spec, seq_len=4096)
    assert _close(d.traced_flops_per_token, d.flops_per_token, 0.01)
    rows = {r.kind: r for r in d.rows}
    assert [r.kind for r in d.rows] == [LayerKind.EMBEDDING, LayerKind.DENSE, LayerKind.MOE, LayerKind.MTP,
                                        LayerKind.MTP_HEAD, LayerKind.HEAD]
    assert (rows[LayerKind.DENSE].count, rows[LayerKind.MOE].count, rows[LayerKind.MTP].count) == (3, 58, 1)
    moe = rows[LayerKind.MOE]
    assert moe.fwd_bwd_gflop_per_token == pytest.approx(3 * moe.fwd_gflop_per_token, rel=1e-6)
    assert moe.params > 12 * B and moe.activated_params < 0.7 * B and moe.saved_bytes_per_token > 0
    total = sum(r.count * r.fwd_bwd_gflop_per_token for r in d.rows if r.kind not in (LayerKind.MTP,
                                                                                      LayerKind.MTP_HEAD))
    assert total * G == pytest.approx(d.traced_flops_per_token)
