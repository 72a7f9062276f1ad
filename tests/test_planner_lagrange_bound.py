"""The Lagrangian root bound (search/lagrange_bound.py) against enumeration.

On small plain tasks (one stage and two, memory binding or not) every plan of the task is
priced by ``evaluate`` (each split, each strategy of each layer); the Lagrangian bound must stay
at most the fastest plan that fits, and where memory binds it must be above the bound that
ignores memory (``Task.cheap_bound``): it prices memory, or it would settle nothing. A task
whose every plan is over the budget must get an infinite bound. The search's answers with the
bound on and off are compared in tests/test_planner_exhaustive*.py, which run with it on.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from megatron_auto.plan import PipelineSpec, Plan, VocabStrategy
from megatron_auto.planner import evaluate
from megatron_auto.planner.search import lagrange_bound as lb
from megatron_auto.planner.search.spaces import SpaceRules
from megatron_auto.planner.search.tasks import Task
from planner_enumerate import compositions, layer_choices
from planner_fakes import tiny_gpt

pytestmark = pytest.mark.pure

RULES = SpaceRules(dp_modes=("ddp", "zero3"), sequence_parallel=(False, True))
VOCAB = VocabStrategy(tp=1, dp_mode="ddp")
# (world, layers, batch, pp, micro-batches)
SHAPES = [(2, 4, 4, 1, 2), (4, 2, 8, 1, 2), (2, 5, 4, 2, 4), (4, 3, 8, 2, 4)]
_PRICED: dict[tuple, list[tuple[float, float]]] = {}


def _instance(shape):
    world, layers, batch, _, _ = shape
    return tiny_gpt(world, layers, batch, hidden=64, ffn=256, seq=32, vocab=128)


def _new_task(shape, budget, step):
    world, _, batch, pp, m = shape
    spec, _, cluster, profile = _instance(shape)
    return Task(spec, profile, cluster, world, batch, pp, m, "1f1b", RULES, VOCAB, budget, step)


def _priced(shape):
    """(iteration time, peak) of every plan of the shape's task, priced once per shape."""
    if shape not in _PRICED:
        spec, training, cluster, profile = _instance(shape)
        task = _new_task(shape, 1e12, 10 ** 6)
        choices = layer_choices(spec, task.n, task.b_m, 8, spec.layer_types[0],
                                ("ddp", "zero3"), (False, True))
        assert set(choices) == set(task.tables.strategies[0])  # the task's own space
        plans = []
        for part in compositions(task.num_layers, task.pp):
            pipe = PipelineSpec(size=task.pp, schedule="1f1b", layers_per_stage=part)
            for combo in itertools.product(choices, repeat=task.num_layers):
                plans.append(Plan(world_size=task.world_size, global_batch_size=task.global_batch,
                                  num_microbatches=task.m, pipeline=pipe, vocab=VOCAB,
                                  layers=combo, model=spec.plan_model_record()))
        _PRICED[shape] = [(e.iteration_time_s, e.peak_memory_bytes) for e in (
            evaluate(p, spec, training, cluster, profile) for p in plans)]
    return _PRICED[shape]


def _task(shape, factor):
    """The shape's task at ``factor`` times the least peak of its plans, and its fastest plan
    within that budget."""
    priced = _priced(shape)
    budget = min(peak for _, peak in priced) * factor
    cluster = _instance(shape)[2]
    step = max(1, int((budget - cluster.memory_reserve_bytes) / 2048))
    return _new_task(shape, budget, step), min(t for t, peak in priced if peak <= budget)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("factor", [1.0, 1.15, 1.3, 3.0])
def test_the_lagrange_bound_is_below_every_plan_that_fits(shape, factor):
    task, fastest = _task(shape, factor)
    got = lb.lagrange_root(task)
    assert 0 < got <= fastest * (1 + 1e-9)
    # with a cutoff below it, the partition search may stop at the cutoff: still a bound
    assert lb.lagrange_root(task, got / 2) <= fastest * (1 + 1e-9)
    # the task keeps it, and the root bound it is tried before is at least as strong
    assert task.lagrange_bound() == got
    assert got <= task.root_bound() * (1 + 1e-12) <= fastest * (1 + 1e-9)


@pytest.mark.parametrize("shape", SHAPES)
def test_where_memory_binds_the_lagrange_bound_prices_it(shape):
    """At the least peak every layer must take its leanest strategies: the bound must rise
    above the memory-blind one, and by more than it does with room to spare."""
    tight, _ = _task(shape, 1.0)
    loose, _ = _task(shape, 3.0)
    assert lb.lagrange_root(tight) > tight.cheap_bound() * (1 + 1e-6)
    assert lb.lagrange_root(tight) > lb.lagrange_root(loose) * (1 + 1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_no_plan_fits_gives_an_infinite_bound(shape):
    priced = _priced(shape)
    budget = min(peak for _, peak in priced) * 0.5
    cluster = _instance(shape)[2]
    task = _new_task(shape, budget, max(1, int((budget - cluster.memory_reserve_bytes) / 2048)))
    assert math.isinf(lb.lagrange_root(task))


def test_off_it_claims_nothing(monkeypatch):
    task, _ = _task(SHAPES[0], 1.0)
    monkeypatch.setattr(lb, "ENABLED", False)
    assert lb.lagrange_root(task) == 0.0


# Interleaved tasks of one layer type (two stages; test_planner_partition_bound's instances,
# every plan priced there): the stage-block bounds, tied (DP rows) and Lagrangian.
INTERLEAVED = [(2, 6, 4, 2, 3), (4, 4, 4, 2, 2)]  # (world, layers, batch, micro-batches, v)


@pytest.mark.parametrize("shape", INTERLEAVED)
@pytest.mark.parametrize("factor", [1.0, 1.3, 3.0])
def test_the_stage_block_bounds_are_below_every_interleaved_plan(shape, factor):
    from test_planner_partition_bound import _task as interleaved_task

    task, fastest = interleaved_task(shape, factor)
    assert task.tied_applies()
    tied = task.tied_bound()
    blocks = task.tied_partition_bound()
    lagrange = lb.tied_lagrange_root(task)
    # one choice of block sizes for every J_b: never weaker than each J_b choosing its own
    assert blocks >= tied * (1 - 1e-12)
    assert 0 < lagrange <= fastest * (1 + 1e-9)
    assert blocks <= fastest * (1 + 1e-9)
    assert task.root_bound() <= fastest * (1 + 1e-9)


@pytest.mark.parametrize("shape", INTERLEAVED)
def test_where_memory_binds_the_stage_block_lagrange_bound_prices_it(shape):
    from test_planner_partition_bound import _task as interleaved_task

    tight, _ = interleaved_task(shape, 1.0)
    loose, _ = interleaved_task(shape, 3.0)
    assert lb.tied_lagrange_root(tight) > lb.tied_lagrange_root(loose) * (1 + 1e-6)
    assert lb.tied_lagrange_root(tight) > tight.cheap_bound() * (1 + 1e-6)


def _separate_futures(rows_type, task):
    """Each J_b's future by its own DP over every position (no row or tail shared)."""
    from megatron_auto.planner.search import partition_bound

    return {b: partition_bound.futures(rows_type(task), b) for b in task.branches}


@pytest.mark.parametrize("case", ["plain-2", "plain-2b", "interleaved", "interleaved-b"])
def test_shared_futures_equal_a_dp_per_bound(case):
    """The rows keep one copy per weights and the J_b share the DP tail after their own
    stage's last position (partition_bound.branch_future): every future must equal the DP
    that builds each J_b from its own rows alone."""
    if case.startswith("plain"):
        task, _ = _task(SHAPES[2 if case == "plain-2" else 3], 1.15)
        kinds = [lb.LagrangeRows]
    else:
        from test_planner_partition_bound import _task as interleaved_task

        task, _ = interleaved_task(INTERLEAVED[0 if case == "interleaved" else 1], 1.3)
        kinds = [lb.LagrangeRows, lb.TiedLagrangeRows]
    assert task.pp > 1 and len(task.branches) >= 2
    for kind in kinds:
        want = _separate_futures(kind, task)
        shared = kind(task)
        for b in task.branches:
            np.testing.assert_allclose(shared.future(b), want[b], rtol=1e-12, atol=0.0)
        assert any(math.isfinite(float(want[b][0, 0])) for b in task.branches)


@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_split_counts_are_the_leanest_split_under_a_cap(v):
    """``split_counts`` against every split of ``n`` layers over ``v`` chunks (ascending in
    flight counts), each at least one and at most the cap: it exists exactly where a split
    does, keeps the cap, and no split puts more layers on the lowest counts (for every prefix
    of the chunks, its layers there are the most any split has: so for any weights rising
    with the count, its weighted sum is the least)."""
    n = np.arange(1, 11)[:, None]
    caps = np.arange(1, 11)[None, :]
    x, ok = lb.split_counts(v, n + 0 * caps, caps + 0 * n)
    for i, total in enumerate(n[:, 0].tolist()):
        for c, cap in enumerate(caps[0].tolist()):
            splits = [s for s in itertools.product(range(1, cap + 1), repeat=v) if sum(s) == total]
            got = x[:, i, c]
            assert bool(ok[i, c]) == bool(splits), (total, cap)
            if not splits:
                continue
            assert int(got.sum()) == total and got.min() >= 1 and got.max() <= cap
            for s in splits:
                assert all(sum(got[:j + 1]) >= sum(s[:j + 1]) for j in range(v)), (got, s)


def test_fill_cells_cover_every_length_once():
    for max_len in (1, 2, 5, 13, 64, 94):
        lo, hi = lb.fill_cells(max_len)
        covered = [d for a, b in zip(lo.tolist(), hi.tolist()) for d in range(a, b + 1)]
        assert covered == list(range(1, max(max_len, 4) + 1))


# Interleaved tasks whose chunks hold different in-flight counts (pp 2, v 2, m 4 and 8: counts
# 3, 2 on stage 0 and 2, 1 on stage 1), every plan priced: recompute on or off per layer.
FILL_SHAPES = [(2, 7, 8, 4, 2), (2, 7, 16, 8, 2)]


@pytest.mark.parametrize("shape", FILL_SHAPES)
@pytest.mark.parametrize("factor", [1.0, 1.1, 1.3, 2.0])
@pytest.mark.parametrize("exact", [True, False])
def test_the_fill_makes_uneven_chunks_pay(shape, factor, exact, monkeypatch):
    """The stage-block rows with the fill term (``FILL``: a stage's longest chunk runs in the
    fill at least its layers' least time) are never below the rows without it and stay below
    every plan; where memory binds but leaves a choice, they are above: without the term a
    stage may pile its layers on its chunk of the fewest micro-batches in flight and be
    charged only a 1/v share of them in the fill."""
    from test_planner_partition_bound import _task as interleaved_task

    if not exact:  # the cells of longest-chunk sizes that long blocks take
        monkeypatch.setattr(lb, "FILL_EXACT_MAX_LEN", 0)
    task, fastest = interleaved_task(shape, factor)
    with_fill = lb.tied_lagrange_root(task)
    monkeypatch.setattr(lb, "FILL", False)
    without = lb.tied_lagrange_root(interleaved_task(shape, factor)[0])
    assert 0 < without <= with_fill * (1 + 1e-12)
    assert with_fill <= fastest * (1 + 1e-9)
    if factor in (1.1, 1.3):
        assert with_fill > without * (1 + 1e-3), (with_fill, without)


@pytest.mark.parametrize("shape", INTERLEAVED + FILL_SHAPES)
def test_the_received_inputs_take_their_room(shape, monkeypatch):
    """``evaluate`` keeps each interleaved chunk's received input (but the model's first) until
    its backward (``Task.hop_floor``, its least bytes): the stage-block rows take that room
    from the layers, so the bound rises where memory binds, and stays below every plan (the
    tests above run with it)."""
    from megatron_auto.planner.search import tasks
    from test_planner_partition_bound import _task as interleaved_task

    task, fastest = interleaved_task(shape, 1.02)
    assert task.hop_floor[0] == 0.0 and min(task.hop_floor[1:]) > 0
    with_inputs = lb.tied_lagrange_root(task)
    monkeypatch.setattr(tasks.Task, "hop_floor", property(lambda t: [0.0] * t.chunks))
    without = lb.tied_lagrange_root(interleaved_task(shape, 1.02)[0])
    assert without * (1 + 1e-3) < with_inputs <= fastest * (1 + 1e-9)
