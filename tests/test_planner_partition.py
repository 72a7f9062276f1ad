"""Partition primitives: exact min-max partition against brute force, the paper's BMW moves."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_auto.planner.search.partition import bmw_paper, min_max_partition

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


def test_bmw_paper_moves_layers_off_the_slowest_stage_within_the_memory_cap():
    # 8 layers, 2 stages. Time: stage 0 layers cost 1.5, stage 1 layers 1 (a slower first
    # stage). Memory: stage 0 layers 1, stage 1 layers 2 (stage 1 holds the head).
    # Memory-balanced start: (5, 3) -> memory max(5, 6) = 6, time max(7.5, 3) = 7.5.
    # Time-balanced: (3, 5) -> time max(4.5, 5) = 5, memory max(3, 10) = 10: the cap is 10.
    # Moves off stage 0: (4, 4) -> time 6, memory 8; (3, 5) -> time 5, memory 10 <= cap;
    # (2, 6) would make stage 1 slowest at 6 > 5: stop. Answer (3, 5).
    def time_row(stage, start):
        return np.arange(1, 9, dtype=float) * (1.5 if stage == 0 else 1.0)

    def mem_row(stage, start):
        return np.arange(1, 9, dtype=float) * (1.0 if stage == 0 else 2.0)
    assert bmw_paper(8, 2, time_row, mem_row, 8, 100.0, False) == (3, 5)
    # A budget of 9 stops the walk at (4, 4): (3, 5) needs 10.
    assert bmw_paper(8, 2, time_row, mem_row, 8, 9.0, False) == (4, 4)
