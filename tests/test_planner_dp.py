"""The per-stage DP: hand-solved instances and brute force on random ones."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_auto.planner.search.stage_dp import LayerOptions, solve_stage

pytestmark = pytest.mark.pure


def opts(mem, cost, cls, aux=None):
    mem = np.asarray(mem, dtype=np.int64)
    aux = np.zeros((len(mem), 1)) if aux is None else np.asarray(aux, dtype=float)
    return LayerOptions(mem=mem, cost=np.asarray(cost, dtype=float), aux=aux,
                        cls=np.asarray(cls, dtype=np.int64))


def brute_force(layers, transition, cells):
    best, best_choice = np.inf, None
    for choice in itertools.product(*[range(len(x.mem)) for x in layers]):
        mem = sum(int(x.mem[s]) for x, s in zip(layers, choice))
        if mem > cells:
            continue
        cost = sum(float(x.cost[s]) for x, s in zip(layers, choice))
        for a, b, sa, sb in zip(layers, layers[1:], choice, choice[1:]):
            cost += transition[a.cls[sa], b.cls[sb]]
        if cost < best:
            best, best_choice = cost, choice
    return best, best_choice


def test_hand_solved_three_layers_without_transitions():
    # Two strategies per layer: fast (time 1, memory 4) and lean (time 3, memory 1).
    # Budget 9 cells: three fast layers need 12 > 9; two fast + one lean = 9 cells, time 5.
    # Optimum: time 5 (any order with exactly one lean layer).
    layer = opts([4, 1], [1.0, 3.0], [0, 0])
    tables = solve_stage([layer] * 3, np.zeros((1, 1)), 9)
    value, _ = tables.value(3, 9)
    assert value == pytest.approx(5.0)
    assert sorted(tables.choices(3, 9)) == [0, 0, 1]
    # Budget 3: only all-lean fits (3 cells), time 9. Budget 2: infeasible.
    assert tables.value(3, 3)[0] == pytest.approx(9.0)
    assert tables.value(3, 2)[0] == np.inf
    assert tables.choices(3, 2) is None
    # Prefix answers come from the same run: two layers in 8 cells -> both fast, time 2.
    assert tables.value(2, 8)[0] == pytest.approx(2.0)


def test_hand_solved_transition_cost_changes_the_answer():
    # Class A strategies are cheap on layer 0, class B cheap on layer 1; switching costs 5.
    # Layer 0: A time 1, B time 4. Layer 1: A time 4, B time 1. Memory 1 each, budget 2.
    # Options: AA = 1+4 = 5, BB = 4+1 = 5, AB = 1+1+5 = 7, BA = 4+4+5 = 13. Optimum 5.
    # With a switch cost of 1: AB = 3 is the optimum.
    l0 = opts([1, 1], [1.0, 4.0], [0, 1])
    l1 = opts([1, 1], [4.0, 1.0], [0, 1])
    expensive = np.array([[0.0, 5.0], [5.0, 0.0]])
    cheap = np.array([[0.0, 1.0], [1.0, 0.0]])
    assert solve_stage([l0, l1], expensive, 2).value(2, 2)[0] == pytest.approx(5.0)
    t = solve_stage([l0, l1], cheap, 2)
    assert t.value(2, 2)[0] == pytest.approx(3.0)
    assert t.choices(2, 2) == [0, 1]


def test_aux_follows_the_optimal_path():
    # Aux carries a tail per strategy; the optimum (strategy 1 on both layers: time 2) sums 0.5s.
    layer = opts([1, 1], [2.0, 1.0], [0, 0], aux=[[10.0], [0.25]])
    value, aux = solve_stage([layer, layer], np.zeros((1, 1)), 5).value(2, 5)
    assert value == pytest.approx(2.0)
    assert aux[0] == pytest.approx(0.5)


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_brute_force_on_random_instances(seed):
    rng = np.random.default_rng(seed)
    n_layers = int(rng.integers(1, 7))
    n_classes = int(rng.integers(1, 4))
    transition = rng.uniform(0, 2, size=(n_classes, n_classes))
    np.fill_diagonal(transition, 0.0)
    layers = []
    for _ in range(n_layers):
        s = int(rng.integers(1, 7))
        layers.append(opts(rng.integers(0, 6, size=s), rng.uniform(0, 5, size=s),
                           rng.integers(0, n_classes, size=s)))
    cells = int(rng.integers(0, 25))
    tables = solve_stage(layers, transition, cells)
    for prefix in range(1, n_layers + 1):
        for cap in range(cells + 1):
            expected, _ = brute_force(layers[:prefix], transition, cap)
            got, _ = tables.value(prefix, cap)
            assert got == pytest.approx(expected), (prefix, cap)
            choice = tables.choices(prefix, cap)
            if np.isfinite(expected):
                mem = sum(int(x.mem[s]) for x, s in zip(layers, choice))
                assert mem <= cap
                cost = sum(float(x.cost[s]) for x, s in zip(layers, choice)) + sum(
                    transition[a.cls[sa], b.cls[sb]]
                    for a, b, sa, sb in zip(layers, layers[1:], choice, choice[1:]))
                assert cost == pytest.approx(expected)
            else:
                assert choice is None


def test_memory_axis_stops_where_memory_no_longer_binds():
    # Fast (time 1, 4 cells) and lean (time 3, 1 cell): three fast layers need 12 cells, so
    # with a 1000-cell cap the DP runs over 0..12 only; every larger cap has the optimum 3.
    layer = opts([4, 1], [1.0, 3.0], [0, 0])
    tables = solve_stage([layer] * 3, np.zeros((1, 1)), 1000)
    assert tables.solved_cells == 12 and tables.max_cells == 1000
    assert tables.value(3, 11)[0] == pytest.approx(1.0 + 1.0 + 3.0)
    for cap in (12, 13, 500, 1000):
        assert tables.value(3, cap)[0] == pytest.approx(3.0)
        assert tables.choices(3, cap) == [0, 0, 0]
    # A strategy above the cap never counts: 2 cells, one layer -> the lean one.
    assert solve_stage([layer], np.zeros((1, 1)), 2).value(1, 2)[0] == pytest.approx(3.0)


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="one entry per strategy"):
        LayerOptions(mem=np.array([1, 2]), cost=np.array([1.0]), aux=np.zeros((2, 1)),
                     cls=np.array([0, 0]))
    with pytest.raises(ValueError, match="max_cells"):
        solve_stage([opts([1], [1.0], [0])], np.zeros((1, 1)), -1)
