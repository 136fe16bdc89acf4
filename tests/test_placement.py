"""Expert placement policies (moeplan/placement.py): greedy and EPLB against brute force, EPLB's published example,
and properties of every placement.

Bounds asserted against the brute-force optimum ``opt`` of "E experts on n shards, exactly k = E/n per shard" (the
k-partitioning problem), for the greedy rule (LPT restricted to shards with a free slot, "modified LPT"):

- k = 2: greedy is optimal. Theorem: with two items per part, pairing the i-th largest with the i-th smallest is
  optimal (exchange argument), and modified LPT builds exactly that pairing: the n heaviest experts open the n
  shards, then the rest, heaviest first, each joins the lightest open shard.
- k = 3: greedy ≤ (4/3 − 1/(3n))·opt. Theorem: Kellerer & Woeginger, "A tight bound for 3-partitioning", Discrete
  Applied Mathematics 45 (1993) 249–259, for this very rule. Graham's 4/3 − 1/(3n) for plain LPT does not transfer
  to other k: the slot limit changes which shard an expert can join.
- any k: greedy = opt when the heaviest expert outweighs all the others together (then opt ≥ load[0] + the k − 1
  lightest loads, and greedy fills the other shards first and ends at exactly that).
- k ≥ 4: no worst-case bound is asserted (none proved here); greedy ≥ opt checks the brute force itself.

EPLB's replication step is checked for exact optimality (the largest-load-per-replica rule minimises the maximum
load per replica: D'Hondt's method), and its packing step, which is the same modified LPT, with the k = 2 and
k = 3 theorems above on its own replicas.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan import expert_load
from moeplan.placement import (LayerPlacement, balanced_packing, contiguous, eplb, greedy, place, rebalance_experts,
                               replicate_experts)


def rank_load(load, placed: LayerPlacement) -> np.ndarray:  # noqa: ANN001
    """Tokens per shard of one layer (moeplan.expert_load.rank_tokens: replicas split their expert's tokens)."""
    return expert_load.rank_tokens(np.asarray(load, dtype=float)[None, :], placed.shards)[0]


def imbalance(tokens) -> float:  # noqa: ANN001
    return float(expert_load.imbalance(np.asarray(tokens, dtype=float)))

# deepseek-ai/EPLB README.md (commit d52c72d5), "Interface and Example": 2 layers × 12 experts, 16 replicas,
# 4 groups, 2 nodes, 8 GPUs, and the phy2log it prints.
README_WEIGHT = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                          [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
README_PHY2LOG = np.array([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                           [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])


def _partitions(items: tuple[int, ...], k: int) -> Iterator[list[tuple[int, ...]]]:
    """Every split of ``items`` into unordered groups of exactly ``k``."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for mates in itertools.combinations(rest, k - 1):
        left = tuple(i for i in rest if i not in mates)
        for tail in _partitions(left, k):
            yield [(first, *mates), *tail]


def _optimum(load: np.ndarray, num_shards: int) -> float:
    """The smallest possible max shard load with ``len(load)/num_shards`` experts per shard (brute force)."""
    k = len(load) // num_shards
    return min(max(load[list(g)].sum() for g in split) for split in _partitions(tuple(range(len(load))), k))


def _max_load(load: np.ndarray, placement: LayerPlacement) -> float:
    return float(rank_load(load, placement).max())


def _instances(seed: int, count: int, size: int) -> Iterator[np.ndarray]:
    """Random loads: half small integers (many ties), half skewed floats (a few hot experts)."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        yield (rng.integers(0, 6, size).astype(float) if i % 2 else rng.pareto(1.5, size) * 100)


# ---- greedy against brute force -----------------------------------------------------------------------------------
@pytest.mark.parametrize("num_shards", [2, 3, 4])
def test_greedy_is_optimal_with_two_experts_per_shard(num_shards):
    for load in _instances(num_shards, 40, 2 * num_shards):
        assert _max_load(load, greedy(load, num_shards)) == pytest.approx(_optimum(load, num_shards))


@pytest.mark.parametrize("num_shards", [2, 3])
def test_greedy_within_the_kellerer_woeginger_bound_with_three_experts_per_shard(num_shards):
    bound = 4 / 3 - 1 / (3 * num_shards)
    for load in _instances(10 + num_shards, 40, 3 * num_shards):
        best = _optimum(load, num_shards)
        assert best - 1e-9 <= _max_load(load, greedy(load, num_shards)) <= bound * best + 1e-9
    if num_shards == 2:  # the bound is tight: 4→a, 2→b, 2→b, 2→a, 1→b (b full), 1→a gives 7 = 7/6 · 6
        tight = np.array([1, 1, 4, 2, 2, 2])
        assert _max_load(tight, greedy(tight, 2)) == 7 == pytest.approx(bound * _optimum(tight, 2))


def test_greedy_is_not_optimal_for_four_experts_per_shard_but_never_beats_the_optimum():
    gaps = [_max_load(load, greedy(load, 2)) - _optimum(load, 2) for load in _instances(7, 40, 8)]
    assert min(gaps) >= -1e-9 and max(gaps) > 0


@pytest.mark.parametrize(("num_experts", "num_shards"), [(6, 2), (8, 2), (6, 3), (8, 4), (9, 3)])
def test_greedy_is_optimal_when_one_expert_outweighs_the_rest(num_experts, num_shards):
    rng = np.random.default_rng(num_experts * num_shards)
    for _ in range(10):
        load = rng.integers(0, 50, num_experts).astype(float)
        hot = int(rng.integers(num_experts))
        load[hot] = load.sum() - load[hot] + rng.integers(0, 20)
        k = num_experts // num_shards
        floor = load[hot] + np.sort(np.delete(load, hot))[:k - 1].sum()
        assert _max_load(load, greedy(load, num_shards)) == pytest.approx(_optimum(load, num_shards)) == floor


def test_greedy_ties_and_slot_order_are_deterministic():
    # equal loads keep id order, equal shard loads go to the lower shard, shards list ids in ascending order
    assert greedy([1, 1, 1, 1], 2).shards == ((0, 2), (1, 3))
    assert greedy([0, 5, 3, 9, 1, 2], 3).shards == ((0, 3), (1, 4), (2, 5))


def test_greedy_can_be_worse_than_contiguous_but_wins_on_the_median():
    load = np.array([1, 1, 4, 2, 2, 2])  # contiguous is optimal (6, 6), greedy's slot limit forces 7
    assert _max_load(load, contiguous(6, 2)) == 6 and _max_load(load, greedy(load, 2)) == 7
    rng = np.random.default_rng(0)
    gre, con = [], []
    for _ in range(200):
        load = rng.zipf(1.8, 32).astype(float)
        gre.append(imbalance(rank_load(load, greedy(load, 8))))
        con.append(imbalance(rank_load(load, contiguous(32, 8))))
    assert np.median(gre) < np.median(con)


# ---- EPLB ---------------------------------------------------------------------------------------------------------
def test_eplb_reproduces_the_readme_example():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    np.testing.assert_array_equal(phy2log, README_PHY2LOG)
    np.testing.assert_array_equal(logcnt, [np.bincount(row, minlength=12) for row in README_PHY2LOG])
    assert log2phy.shape == (2, 12, 2)
    for layer in range(2):
        for expert in range(12):
            replicas = log2phy[layer, expert]
            assert sorted(replicas[replicas >= 0]) == list(np.flatnonzero(phy2log[layer] == expert))
    layers = eplb(README_WEIGHT, 16, 4, 2, 8)
    assert layers[0].shards[:2] == ((5, 6), (5, 7)) and layers[1].shards[-1] == (3, 1)
    assert place("eplb", README_WEIGHT, 8, num_replicas=16, num_groups=4, num_nodes=2).layers == layers


@pytest.mark.parametrize(("num_experts", "num_replicas"), [(3, 5), (4, 7), (4, 8), (5, 8)])
def test_replicate_experts_minimises_the_max_load_per_replica(num_experts, num_replicas):
    for load in _instances(num_replicas, 20, num_experts):
        _, _, logcnt = replicate_experts(load[None, :], num_replicas)
        got = (load.astype(np.float32) / logcnt[0]).max()
        best = min((load / np.array(c)).max()
                   for c in itertools.product(range(1, num_replicas - num_experts + 2), repeat=num_experts)
                   if sum(c) == num_replicas)
        assert got == pytest.approx(best, rel=1e-6)


@pytest.mark.parametrize(("num_experts", "num_replicas", "num_gpus"), [(4, 6, 2), (5, 9, 3), (4, 8, 4), (6, 8, 4)])
def test_eplb_packs_its_replicas_within_the_modified_lpt_bounds(num_experts, num_replicas, num_gpus):
    per_gpu = num_replicas // num_gpus
    bound = {2: 1.0, 3: 4 / 3 - 1 / (3 * num_gpus)}[per_gpu]
    for load in _instances(num_gpus, 20, num_experts):
        (layer,) = eplb(load[None, :], num_replicas, 1, 1, num_gpus)  # global policy
        replica_loads = np.concatenate([[load[e] / n] * n for e, n in enumerate(layer.replicas())])
        best = _optimum(replica_loads, num_gpus)
        assert best - 1e-4 <= _max_load(load, layer) <= bound * best * (1 + 1e-6) + 1e-4


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(2, 4), st.integers(1, 4), st.data())
def test_eplb_placement_properties(per_gpu, num_gpus, num_groups, data):
    num_experts = num_groups * data.draw(st.integers(1, 3))
    num_replicas = num_gpus * max(per_gpu, -(-num_experts // num_gpus))
    num_nodes = data.draw(st.sampled_from([d for d in (1, 2, 4) if num_gpus % d == 0]))
    weight = np.array(data.draw(st.lists(st.lists(st.integers(0, 1000), min_size=num_experts,
                                                  max_size=num_experts), min_size=1, max_size=3)))
    phy2log, log2phy, logcnt = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    assert (logcnt >= 1).all() and (logcnt.sum(-1) == num_replicas).all()
    for layer, row in enumerate(phy2log):
        np.testing.assert_array_equal(np.bincount(row, minlength=num_experts), logcnt[layer])
        for expert in range(num_experts):
            replicas = log2phy[layer, expert]
            assert sorted(replicas[replicas >= 0]) == list(np.flatnonzero(row == expert))
        if num_groups % num_nodes == 0:  # hierarchical: every expert group lives on exactly one node
            node = np.arange(num_replicas) // (num_replicas // num_nodes)
            group = row // (num_experts // num_groups)
            assert all(len(set(node[group == g])) == 1 for g in range(num_groups))
    for layer, placed in zip(weight, eplb(weight, num_replicas, num_groups, num_nodes, num_gpus)):
        assert placed.slots_per_shard == (num_replicas // num_gpus,) * num_gpus
        assert rank_load(layer, placed).sum() == pytest.approx(layer.sum())


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.data())
def test_greedy_places_every_expert_once_with_equal_slots(per_shard, num_shards, data):
    num_experts = per_shard * num_shards
    load = np.array(data.draw(st.lists(st.integers(0, 10_000), min_size=num_experts, max_size=num_experts)))
    placed = greedy(load, num_shards)
    assert sorted(e for shard in placed.shards for e in shard) == list(range(num_experts))
    assert placed.slots_per_shard == (per_shard,) * num_shards and placed.extra_slots == 0
    assert (placed.replicas() == 1).all()
    assert rank_load(load, placed).sum() == pytest.approx(load.sum())
    if per_shard <= 2:  # greedy is optimal there, so never worse than contiguous
        assert _max_load(load, placed) <= _max_load(load, contiguous(num_experts, num_shards))
    if per_shard >= 2:  # EPLB without replicas, one node, is the same greedy (its one-per-GPU shortcut aside)
        (same,) = eplb(load[None, :], num_experts, 1, 1, num_shards)
        assert [set(s) for s in same.shards] == [set(s) for s in placed.shards]


# ---- per model, memory, scoring and errors ------------------------------------------------------------------------
def test_place_reports_sizes_a_policy_cannot_use():
    load = np.ones((3, 12))
    assert place("contiguous", load, 4).layers == (contiguous(12, 4),) * 3
    assert [p.status for p in (place("greedy", load, 5), place("eplb", load, 5))] == ["not-applicable"] * 2
    assert place("greedy", load, 5).reason == ("num_experts=12: must be a multiple of num_shards=5 "
                                               "(each shard holds num_experts/num_shards experts)")
    assert place("eplb", load, 4, num_replicas=14).reason.startswith("num_replicas=14: must be a multiple")
    assert place("eplb", load, 4, num_replicas=8).reason.startswith("num_replicas=8: must be ≥ num_experts=12")
    assert place("eplb", load, 4, num_groups=5).reason.startswith("num_experts=12: must be a multiple of num_groups")
    assert place("eplb", load, 4, num_groups=3, num_nodes=2).status == "ok"  # 3 % 2 ≠ 0: global policy
    assert place("eplb", load, 6, num_groups=4, num_nodes=4).reason.startswith("num_gpus=6: must be a multiple")


def test_extra_slots_price_replicas():
    assert contiguous(12, 4).extra_slots == 0 and contiguous(12, 4).slots_per_shard == (3, 3, 3, 3)
    assert place("eplb", np.arange(24.0).reshape(2, 12), 4, num_replicas=16).extra_slots == 1
    readme = place("eplb", README_WEIGHT, 8, num_replicas=16, num_groups=4, num_nodes=2)
    assert readme.extra_slots == 0  # 2 slots per GPU, and 12 experts on 8 GPUs need ⌈12/8⌉ = 2 without replicas
    assert LayerPlacement(3, ((0, 1, 2, 2), (2,))).extra_slots == 2


def test_replicas_split_their_tokens_evenly_and_imbalance_is_max_over_mean():
    placed = LayerPlacement(3, ((0, 2), (1, 2)))
    np.testing.assert_allclose(rank_load([4, 6, 10], placed), [9, 11])
    assert imbalance([9, 11]) == pytest.approx(0.1) and imbalance([0, 0]) == 0.0


@pytest.mark.parametrize(("call", "message"), [
    (lambda: greedy([1, 2, 3], 2), r"^num_experts=3: must be a multiple of num_shards=2"),
    (lambda: greedy([[1, 2]], 1), r"^load shape=\(1, 2\): must be a non-empty 1-D array$"),
    (lambda: greedy([1, -2], 1), r"^load=-2.0: loads must be finite and ≥ 0$"),
    (lambda: greedy([1, float("nan")], 1), r"^load=non-finite: loads must be finite and ≥ 0$"),
    (lambda: contiguous(4, 0), r"^num_shards=0: must be an integer ≥ 1$"),
    (lambda: rebalance_experts(README_WEIGHT, 16, 4, 2, 6), r"^num_replicas=16: must be a multiple of num_gpus=6"),
    (lambda: balanced_packing([[1, 2, 3]], 2), r"^items=3: must be a multiple of num_packs=2"),
    (lambda: replicate_experts([[1, 2, 3]], 2), r"^num_phy=2: must be ≥ num_log=3$"),
    (lambda: place("random", np.ones((1, 4)), 2), r"^policy='random': must be one of"),
    (lambda: place("greedy", np.ones((1, 4)), 2, num_replicas=6), r"^num_replicas=6: only policy 'eplb' replicates"),
    (lambda: LayerPlacement(3, ((0, 1),)), r"^shards missing=\[2\]: every logical expert needs at least one slot$"),
    (lambda: LayerPlacement(2, ((0, 1, 2),)), r"^shards expert=2: must be in \[0, 2\)$"),
])
def test_bad_arguments_raise_one_line_value_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
