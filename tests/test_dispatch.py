"""EP dispatchers: expected nodes a token reaches and bytes per link tier, against hand counts and brute force."""
from itertools import combinations

import pytest

from moeplan.cost_models.dispatch import (METADATA_BYTES_PER_EXPERT, Routing, dispatch_cost, expected_bins_hit,
                                          hierarchical_valid)
from moeplan.targets import load_target

NPU = load_target("ascend-910b")
H800 = load_target("h800")


def brute_force_bins(e, k, bins, groups=1, topk_groups=1):
    """Mean distinct bins over every equally likely choice: topk_groups of the groups, then k of their experts."""
    per_group, per_bin = e // groups, e // bins
    total = count = 0
    for chosen in combinations(range(groups), topk_groups):
        pool = [x for g in chosen for x in range(g * per_group, (g + 1) * per_group)]
        for experts in combinations(pool, k):
            total += len({x // per_bin for x in experts})
            count += 1
    return total / count


@pytest.mark.parametrize("e,k,bins", [(8, 2, 4), (8, 3, 2), (12, 4, 3), (16, 4, 8)])
def test_expected_bins_topk_matches_brute_force(e, k, bins):
    assert expected_bins_hit(Routing(e, k), bins) == pytest.approx(brute_force_bins(e, k, bins))


@pytest.mark.parametrize("e,k,bins,groups,m", [(16, 4, 4, 4, 2), (16, 4, 8, 4, 2), (16, 3, 2, 8, 4),
                                               (16, 4, 4, 8, 2)])
def test_expected_bins_group_limited_matches_brute_force(e, k, bins, groups, m):
    routing = Routing(e, k, "group_limited", groups, m)
    assert expected_bins_hit(routing, bins) == pytest.approx(brute_force_bins(e, k, bins, groups, m))


def test_deepseek_v3_reaches_at_most_four_nodes():
    """256 experts in 8 groups on 8 nodes, 4 groups chosen, top-8: at most 4 nodes (DeepSeek-V3 §2.1.2)."""
    nodes = expected_bins_hit(Routing(256, 8, "group_limited", 8, 4), 8)
    assert 3.5 < nodes < 4.0
    assert expected_bins_hit(Routing(256, 8), 8) > 5  # without the limit a token spreads over more nodes


def test_moge_hits_every_group_device():
    """Pangu Pro MoE: 64 experts in 8 groups, one per group: every device of an 8-way group holds one group."""
    assert expected_bins_hit(Routing(64, 8, "moge", 8, 1), 8) == 8.0


def test_flat_bytes_per_tier_hand_counted():
    """EP32 over 4 nodes of 8: a rank's T·k copies split 7/32 on the node's links, 24/32 off-node."""
    t, h, k = 1000, 7168, 8
    c = dispatch_cost("flat", tokens=t, hidden=h, payload_bytes=2, routing=Routing(256, k), group_size=32,
                      stride=1, target=H800)
    copies = t * k * h * 2
    assert c.wire_intra_bytes == pytest.approx(copies * 7 / 32)
    assert c.wire_inter_bytes == pytest.approx(copies * 24 / 32)


def test_hierarchical_halves_the_inter_node_bytes_of_the_volume_sketch():
    """docs/references.md §3.2: EP over 4 nodes with top-8, flat sends k·(1 − 1/4) = 6 token copies off-node per token, the
    hierarchical all-gather 4 − 1 = 3 (plus the routing metadata)."""
    t, h, k, row = 4096, 7680, 8, 7680 * 2
    routing = Routing(256, k)
    flat = dispatch_cost("flat", tokens=t, hidden=h, payload_bytes=2, routing=routing, group_size=32, stride=1,
                         target=NPU)
    hier = dispatch_cost("hierarchical", tokens=t, hidden=h, payload_bytes=2, routing=routing, group_size=32,
                         stride=1, target=NPU)
    assert flat.wire_inter_bytes == pytest.approx(6 * t * row)
    assert hier.wire_inter_bytes == pytest.approx(3 * t * (row + k * METADATA_BYTES_PER_EXPERT))
    assert hier.wire_intra_bytes == pytest.approx(t * k * row * 7 / 8)  # the all-to-all-v inside the node
    assert hier.time_s == pytest.approx(hier.busy_inter_s + hier.busy_intra_s)  # gather, then all-to-all


def test_dedup_sends_one_copy_per_remote_node():
    """DeepEP-style: a token goes once to each other node that holds one of its experts."""
    t, h, k = 4096, 7168, 8
    routing = Routing(256, k, "group_limited", 8, 4)
    c = dispatch_cost("dedup", tokens=t, hidden=h, payload_bytes=2, routing=routing, group_size=64, stride=1,
                      target=H800)
    remote = expected_bins_hit(routing, 8) * 7 / 8
    assert c.wire_inter_bytes == pytest.approx(t * remote * (h * 2 + k * METADATA_BYTES_PER_EXPERT))
    flat = dispatch_cost("flat", tokens=t, hidden=h, payload_bytes=2, routing=routing, group_size=64, stride=1,
                         target=H800)
    assert c.wire_inter_bytes < flat.wire_inter_bytes / 2 and c.time_s < flat.time_s


def test_dispatcher_validity_and_degenerate_groups():
    assert not hierarchical_valid(group_size=8, stride=1, devices_per_node=8)  # one node
    assert not hierarchical_valid(group_size=4, stride=8, devices_per_node=8)  # one rank per node
    assert hierarchical_valid(group_size=32, stride=1, devices_per_node=8)
    with pytest.raises(ValueError, match="hierarchical"):
        dispatch_cost("hierarchical", tokens=10, hidden=8, payload_bytes=2, routing=Routing(8, 2), group_size=4,
                      stride=8, target=NPU)
    with pytest.raises(ValueError, match="dispatcher='ring'"):
        dispatch_cost("ring", tokens=10, hidden=8, payload_bytes=2, routing=Routing(8, 2), group_size=16,  # type: ignore[arg-type]
                      stride=1, target=NPU)
    zero = dispatch_cost("dedup", tokens=10, hidden=8, payload_bytes=2, routing=Routing(8, 2), group_size=1,
                         stride=1, target=NPU)
    assert zero.time_s == 0 and zero.wire_inter_bytes == 0
    with pytest.raises(ValueError, match="num_bins=3"):
        expected_bins_hit(Routing(8, 2), 3)
