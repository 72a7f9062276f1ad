"""Partition primitives: exact min-max partition against brute force, local moves."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_auto.planner.partition import choose_partition, improve, min_max_partition

pytestmark = pytest.mark.pure


def compositions(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + cuts + (n,)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("seed", range(20))
def test_min_max_partition_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(2, 9)), int(rng.integers(1, 5))
    if k > n:
        k = n
    cost = rng.uniform(0, 1, size=(k, n, n))  # cost[stage, start, length-1]
    cost[rng.uniform(size=cost.shape) < 0.1] = np.inf

    def row(stage, start):
        return cost[stage, start]

    def value(part):
        vals, start = [], 0
        for s, length in enumerate(part):
            vals.append(cost[s, start, length - 1])
            start += length
        return max(vals), sum(vals)

    best = min((value(p) for p in compositions(n, k)), default=None)
    got = min_max_partition(n, k, row, n)
    if best is None or not np.isfinite(best[0]):
        assert got is None
    else:
        assert sum(got) == n and len(got) == k
        assert value(got) == pytest.approx(best)


def test_hand_solved_balance():
    # 6 identical layers of cost 1, the last stage pays 2 extra (the LM head), 2 stages:
    # splits (4, 2) -> max(4, 4) = 4 is optimal; even (3, 3) gives max(3, 5) = 5.
    def row(stage, start):
        lengths = np.arange(1, 7, dtype=float)
        return lengths + (2.0 if stage == 1 else 0.0)
    assert min_max_partition(6, 2, row, 6, row_depends_on_start=False) == (4, 2)


def test_improve_never_worse_and_finds_local_optimum():
    target = (3, 5, 2)

    def score(p):
        return sum(abs(a - b) for a, b in zip(p, target))
    part, s = improve((5, 3, 2), score)
    assert s <= score((5, 3, 2)) and part == target


def test_choose_partition_bmw_at_least_as_good_as_seeds():
    def row(stage, start):
        return np.arange(1, 9, dtype=float) * (1.5 if stage == 0 else 1.0)

    def mem(stage, start):
        return np.arange(1, 9, dtype=float) * (2.0 if stage == 0 else 1.0)

    def score(p):
        return max(p[0] * 1.5, p[1])
    out = choose_partition(8, 2, row, mem, score, 8, ("even", "memory", "bmw"), polish=True,
                           row_depends_on_start=False)
    assert out["bmw"][1] <= out["even"][1] and out["bmw"][1] <= out["memory"][1]
    assert out["bmw"][0] == (3, 5)  # max(4.5, 5) = 5; (4, 4) -> 6
