"""The partition bound (search/partition_bound.py) against enumeration.

On small tasks (plain and interleaved, memory binding or not) the bound's branch and bound must
equal the least over every chunk split of the largest ``J_b`` sum of the task's stage rows
(enumerated here over ``planner_enumerate.compositions``), also from a node below the root
(placed chunks given); it must be at least every ``J_b``'s own least (``Task.future``), and the
root bound it strengthens must stay at most the iteration time of every plan of the task
(each split, each strategy of each layer, priced by ``evaluate``). A node limit that stops it
claims nothing (0).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from megatron_auto.plan import PipelineSpec, Plan, VocabStrategy
from megatron_auto.planner import evaluate
from megatron_auto.planner.search import partition_bound as pb
from megatron_auto.planner.search.spaces import SpaceRules
from megatron_auto.planner.search.tasks import Task
from planner_enumerate import compositions, layer_choices
from planner_fakes import tiny_gpt

pytestmark = pytest.mark.pure

RULES = SpaceRules(dp_modes=("ddp", "zero3"), sequence_parallel=(False, True))
VOCAB = VocabStrategy(tp=1, dp_mode="ddp")
# (world, layers, batch, micro-batches, virtual size)
SHAPES = [(2, 5, 4, 4, 1), (4, 4, 16, 8, 1), (2, 6, 4, 2, 3), (4, 4, 4, 2, 2)]


def _task(shape, factor):
    world, layers, batch, m, v = shape
    spec, training, cluster, profile = tiny_gpt(world, layers, batch, hidden=64, ffn=256,
                                                seq=32, vocab=128)
    priced = _priced(shape)
    budget = min(peak for _, peak in priced) * factor
    step = max(1, int((budget - cluster.memory_reserve_bytes) / 2048))
    task = Task(spec, profile, cluster, world, batch, 2, m, "1f1b", RULES, VOCAB, budget, step,
                virtual_size=v)
    return task, min(t for t, peak in priced if peak <= budget)


_PRICED: dict[tuple, list[tuple[float, float]]] = {}


def _priced(shape):
    """(iteration time, peak) of every plan of the shape's task (priced once per shape)."""
    if shape not in _PRICED:
        world, layers, batch, m, v = shape
        spec, training, cluster, profile = tiny_gpt(world, layers, batch, hidden=64, ffn=256,
                                                    seq=32, vocab=128)
        task = Task(spec, profile, cluster, world, batch, 2, m, "1f1b", RULES, VOCAB, 1e12,
                    10 ** 6, virtual_size=v)
        _PRICED[shape] = [(e.iteration_time_s, e.peak_memory_bytes) for e in (
            evaluate(p, spec, training, cluster, profile) for p in _plans(task, spec))]
    return _PRICED[shape]


def _plans(task, spec):
    choices = layer_choices(spec, task.n, task.b_m, 8, spec.layer_types[0], ("ddp", "zero3"),
                            (False, True))
    assert set(choices) == set(task.tables.strategies[0])  # the task's own space
    for part in compositions(task.num_layers, task.chunks):
        pipe = PipelineSpec(size=task.pp, schedule="1f1b", layers_per_stage=part,
                            virtual_size=task.v)
        for combo in itertools.product(choices, repeat=task.num_layers):
            yield Plan(world_size=task.world_size, global_batch_size=task.global_batch,
                       num_microbatches=task.m, pipeline=pipe, vocab=VOCAB, layers=combo,
                       model=spec.plan_model_record())


def _enumerated(task, k0=0, a0=0, placed=None):
    """min over the splits of chunks k0.. from layer a0 of max_b (placed + sum of rows)."""
    placed = np.zeros(len(task.branches)) if placed is None else placed
    best = math.inf
    for part in compositions(task.num_layers - a0, task.chunks - k0):
        if max(part) > task.max_len:
            continue
        total, a = placed.copy(), a0
        for k, length in enumerate(part, start=k0):
            total += np.array([task.stage_bound(k, a, b)[length - 1] for b in task.branches])
            a += length
        best = min(best, float(total.max()))
    return best


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("factor", [1.0, 1.3, 3.0])
def test_the_partition_bound_is_the_enumerated_min_max_and_below_every_plan(shape, factor):
    task, fastest = _task(shape, factor)
    got = pb.partition_bound(task, math.inf)
    assert got == pytest.approx(_enumerated(task), rel=1e-12)
    assert got >= max(float(task.future(b)[0, 0]) for b in task.branches) * (1 - 1e-12)
    # below a node: the first chunk placed with each length
    for length in range(1, task.max_len + 1):
        placed = np.array([task.stage_bound(0, 0, b)[length - 1] for b in task.branches])
        if not np.isfinite(placed).all():
            continue
        assert pb.partition_bound(task, math.inf, 1, length, placed) == pytest.approx(
            _enumerated(task, 1, length, placed), rel=1e-12)
    # a cutoff below the least: every split reaches it, so the cutoff itself comes back
    if math.isfinite(got) and got > 0:
        assert pb.partition_bound(task, got / 2) == got / 2
    assert task.root_bound() <= fastest * (1 + 1e-9)


def test_a_stopped_partition_bound_claims_nothing(monkeypatch):
    task, _ = _task(SHAPES[1], 3.0)
    monkeypatch.setattr(pb, "NODE_LIMIT", 1)
    assert pb.partition_bound(task, math.inf) == 0.0
    assert pb.partition_bound(task, math.inf, node_limit=10 ** 6) > 0
