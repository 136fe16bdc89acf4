import pytest

from moeplan.errors import LayoutError
from moeplan.layout import Layout, check_layout

PANGU = Layout(tp=8, pp=16, vpp=2, ep=4, etp=1, cp=1, dp=48, micro_batch=2, global_batch=6144, seq_len=4096)
KW = dict(num_devices=6144, devices_per_node=8, num_heads=128, num_kv_heads=0, num_experts=256, num_layer_slots=66)


def test_pangu_layout_is_valid_and_derived_sizes():
    check_layout(PANGU, **KW)
    assert PANGU.num_microbatches == 64
    assert PANGU.expert_shards == 32 and PANGU.tp_extend_ep  # 8 experts per NPU (docs/references.md §1.1)
    assert PANGU.expert_dp == 12 and PANGU.world_size == 6144


@pytest.mark.parametrize("change, match", [
    (dict(tp=16, dp=24), r"tp=16: must be <= devices per node"),
    (dict(ep=5), r"ep=5: must divide dp·cp"),
    (dict(ep=48, etp=8), r"ep=48: experts \(256\) must be divisible by ep·tp/etp = 48"),
    (dict(etp=3), r"etp=3: must divide tp"),
    (dict(dp=47), r"devices=6144: must equal tp·cp·dp·pp"),
    (dict(global_batch=6000), r"global_batch=6000: must be divisible by dp·micro_batch = 96"),
    (dict(micro_batch=0), r"micro_batch=0: must be a positive integer"),
    (dict(cp=3, dp=16), r"cp=3"),
])
def test_rules(change, match):
    lay = Layout(**{**PANGU.__dict__, **change})
    with pytest.raises(LayoutError, match=match):
        check_layout(lay, **KW)


def test_tp_must_divide_heads():
    with pytest.raises(LayoutError, match=r"tp=8: must divide the attention heads \(12\)"):
        check_layout(PANGU, **{**KW, "num_heads": 12})


def test_too_many_microbatches_are_a_typed_rejection():
    from moeplan.layout import MAX_MICROBATCHES, layout_rejection

    model = dict(num_devices=4, devices_per_node=4, num_heads=4, num_kv_heads=0, num_experts=8, num_layer_slots=6)
    lay = Layout(tp=1, pp=1, vpp=1, ep=1, etp=1, cp=1, micro_batch=1, dp=4, global_batch=4 * MAX_MICROBATCHES,
                 seq_len=64)
    assert layout_rejection(lay, **model) is None
    big = Layout(tp=1, pp=1, vpp=1, ep=1, etp=1, cp=1, micro_batch=1, dp=4, global_batch=4 * MAX_MICROBATCHES + 4,
                 seq_len=64)
    r = layout_rejection(big, **model)
    assert r is not None and r.reason == "microbatches" and r.figure == MAX_MICROBATCHES
    assert "65,537 micro-batches per replica" in r.message
