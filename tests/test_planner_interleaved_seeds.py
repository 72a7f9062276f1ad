"""The interleaved tasks' own seeds (search/interleaved_seeds.py) against every plan of small
interleaved tasks (test_planner_partition_bound's instances, every plan priced there).

The seeds are each stage's layers chosen by a DP at the in-flight counts of its chunks, on the
even chunk split; the plain seeds cut into chunks (the only seeds before) were chosen at a
plain stage's count. The seeds never decide the answer (the search's proof does, compared with
enumeration in tests/test_planner_exhaustive*.py), so what is checked is what they are for:
they are plans of the task, and where memory binds they reach the best plan of their split
where the cut plain seeds do not.
"""

from __future__ import annotations

import pytest

from megatron_auto.plan import even_partition
from megatron_auto.planner import evaluate
from megatron_auto.planner.cost.interleaving import interleaved_variant
from megatron_auto.planner.search.interleaved_seeds import interleaved_seeds
from megatron_auto.planner.search.seeds import seed_plans
from planner_fakes import tiny_gpt
from test_planner_partition_bound import _plans
from test_planner_partition_bound import _task as interleaved_task

pytestmark = pytest.mark.pure

# (world, layers, batch, micro-batches, v): chunks holding 3, 2 / 2, 1 micro-batches in flight
SHAPES = [(2, 7, 8, 4, 2), (2, 7, 16, 8, 2)]
FACTORS = (1.05, 1.3, 3.0)


def _best(plans, instance, budget):
    spec, training, cluster, profile = instance
    times = [e.iteration_time_s for e in (evaluate(p, spec, training, cluster, profile, budget)
                                          for p in plans) if e.feasible]
    return min(times, default=float("inf"))


@pytest.mark.parametrize("shape", SHAPES)
def test_own_seeds_reach_the_best_plan_of_their_split(shape):
    world, layers, batch, m, v = shape
    instance = tiny_gpt(world, layers, batch, hidden=64, ffn=256, seq=32, vocab=128)
    beaten = 0
    for factor in FACTORS:
        task, _ = interleaved_task(shape, factor)
        even = tuple(even_partition(layers, task.chunks))
        seeds = interleaved_seeds(task)
        assert seeds
        for plan in seeds:  # plans of the task: its schedule, the even split, its strategies
            assert (plan.pp_size, plan.virtual_size, plan.num_microbatches) == (2, v, m)
            assert tuple(plan.pipeline.layers_per_stage) == even
            for k, layer in zip(range(layers), plan.layers):
                stage_chunk = next(c for c in range(task.chunks)
                                   if sum(even[:c]) <= k < sum(even[:c + 1]))
                assert layer in task.tables.costs(0, task.in_flight[stage_chunk]).strategies
        own = _best(seeds, instance, task.budget)
        split = _best([p for p in _plans(task, instance[0])
                       if tuple(p.pipeline.layers_per_stage) == even], instance, task.budget)
        assert own == pytest.approx(split, rel=1e-12), factor
        cut = [interleaved_variant(p, v) for p in seed_plans(task.sibling())]
        beaten += _best([p for p in cut if p is not None], instance, task.budget) > own * (1 + 1e-9)
    assert beaten > 0


def test_plain_tasks_have_none():
    task, _ = interleaved_task(SHAPES[0], 1.3)
    assert interleaved_seeds(task.sibling()) == []
