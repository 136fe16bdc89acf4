import itertools
import random

import pytest

from moeplan.errors import LayoutError
from moeplan.passes.partition_stages import min_max_partition


def brute_force(times, k):
    n, best = len(times), float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(times[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_min_max_partition_is_optimal(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 10)
    k = rng.randint(1, n)
    times = [rng.choice([0.0, rng.uniform(0.1, 3.0)]) for _ in range(n)]
    runs = min_max_partition(times, k).runs
    assert len(runs) == k and all(r >= 1 for r in runs) and sum(runs) == n
    starts = [sum(runs[:i]) for i in range(k)]
    got = max(sum(times[s:s + r]) for s, r in zip(starts, runs))
    assert got == pytest.approx(brute_force(times, k))


def test_too_many_chunks():
    with pytest.raises(LayoutError, match="chunks=5"):
        min_max_partition([1.0, 1.0], 5)


def brute_force_capacity(times, slots, k, cap):
    n, best = len(times), None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        if any(sum(slots[a:b]) > cap for a, b in zip(bounds, bounds[1:])):
            continue
        m = max(sum(times[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = m if best is None else min(best, m)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_capacity_partition_is_optimal(seed):
    rng = random.Random(100 + seed)
    n = rng.randint(2, 10)
    k = rng.randint(1, n)
    times = [rng.uniform(0.1, 3.0) for _ in range(n)]
    slots = [rng.choice([0, 1, 1]) for _ in range(n)]
    cap = rng.randint(1, 3)
    split = min_max_partition(times, k, slots=slots, capacity=cap)
    expect = brute_force_capacity(times, slots, k, cap)
    if expect is None:
        assert split.status == "infeasible" and split.reason
        return
    runs = split.runs
    starts = [sum(runs[:i]) for i in range(k)]
    assert all(sum(slots[s:s + r]) <= cap for s, r in zip(starts, runs))
    assert max(sum(times[s:s + r]) for s, r in zip(starts, runs)) == pytest.approx(expect)


def dp_optimum(times, slots, k, cap):
    """The min-max over ``k`` non-empty contiguous runs of at most ``cap`` slots, by dynamic programming."""
    n, inf = len(times), float("inf")
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for c in range(1, k + 1):
        for j in range(1, n + 1):
            for i in range(c - 1, j):
                if sum(slots[i:j]) <= cap:
                    best[c][j] = min(best[c][j], max(best[c - 1][i], prefix[j] - prefix[i]))
    return best[k][n]


@pytest.mark.parametrize("seed", range(40))
def test_partition_matches_dynamic_programming_on_layer_like_pieces(seed):
    """Pipelines as the pass sees them (an embedding, many equal or near-equal layers, zero-cost pieces, a head),
    sizes brute force cannot reach: the bisection over contiguous sums must land on the optimum."""
    rng = random.Random(500 + seed)
    n = rng.randint(8, 40)
    k = rng.randint(1, min(n, 16))
    layer = rng.uniform(0.5, 2.0)
    times = [rng.uniform(0.1, 3.0)] + [rng.choice([layer, layer, 0.0, rng.uniform(0.1, 2.0)])
                                       for _ in range(n - 2)] + [rng.uniform(0.1, 3.0)]
    slots = [0] + [1] * (n - 2) + [0]
    for cap in (None, -(-sum(slots) // k), -(-sum(slots) // k) + 1):
        split = min_max_partition(times, k, slots=None if cap is None else slots, capacity=cap)
        expect = dp_optimum(times, slots, k, cap if cap is not None else n)
        if expect == float("inf"):
            assert split.status == "infeasible"
            continue
        runs = split.runs
        assert len(runs) == k and min(runs) >= 1 and sum(runs) == n
        starts = [sum(runs[:i]) for i in range(k)]
        assert all(cap is None or sum(slots[s:s + r]) <= cap for s, r in zip(starts, runs))
        assert max(sum(times[s:s + r]) for s, r in zip(starts, runs)) == pytest.approx(expect, rel=1e-12)
