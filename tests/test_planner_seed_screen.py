"""The seed screen (search/task_plans.py ``table_time``): a seed is left unpriced only when the
task's cost tables bound its iteration time at or above the incumbent's. On small plain tasks
(one stage and two) every plan is priced by ``evaluate``: the tables' bound must stay at most
each plan's time, and be within 10 % of it for half of them at least (or it would screen
nothing)."""

from __future__ import annotations

import pytest

from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.planner import evaluate
from megatron_auto.planner.search.spaces import SpaceRules
from megatron_auto.planner.search.task_plans import table_time
from megatron_auto.planner.search.tasks import Task
from planner_enumerate import split_plans
from planner_fakes import tiny_gpt

pytestmark = pytest.mark.pure

RULES = SpaceRules(dp_modes=("ddp", "zero3"), sequence_parallel=(False, True))
VOCAB = VocabStrategy(tp=2, dp_mode="zero3")
# (world, layers, batch, pp, micro-batches)
SHAPES = [(2, 3, 4, 1, 2), (4, 3, 8, 2, 4), (4, 4, 8, 2, 2)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_table_bound_is_below_every_plan(shape):
    world, layers, batch, pp, m = shape
    spec, training, cluster, profile = tiny_gpt(world, layers, batch, hidden=64, ffn=256,
                                                seq=32, vocab=128)
    task = Task(spec, profile, cluster, world, batch, pp, m, "1f1b", RULES, VOCAB, 1e12, 10 ** 6)
    choices = sorted(set(task.tables.strategies[0]), key=repr)
    ratios = []
    for plan in split_plans(spec, world, batch, m, pp, VOCAB, choices):
        part, combo = plan.pipeline.layers_per_stage, plan.layers
        t = evaluate(plan, spec, training, cluster, profile).iteration_time_s
        bound = table_time(task, plan)
        kept = all(task.costs(k, i).position.get(combo[i]) is not None
                   for k, n in enumerate(part) for i in range(sum(part[:k]), sum(part[:k]) + n))
        assert bound <= t * (1 + 1e-12), (part, combo, bound, t)  # never above its time
        assert (bound > 0) == kept
        if kept:
            ratios.append(bound / t)
    assert ratios and sorted(ratios)[len(ratios) // 2] >= 0.9


def test_a_strategy_outside_the_tables_is_never_screened():
    spec, _, cluster, profile = tiny_gpt(2, 2, 4, hidden=64, ffn=256, seq=32, vocab=128)
    task = Task(spec, profile, cluster, 2, 4, 1, 2, "1f1b", RULES, VOCAB, 1e12, 10 ** 6)
    alien = LayerStrategy(tp=1, dp_mode="zero1")  # zero1 is not in RULES' space
    plan = Plan(world_size=2, global_batch_size=4, num_microbatches=2,
                pipeline=PipelineSpec(size=1, schedule="1f1b", layers_per_stage=(2,)),
                vocab=VOCAB, layers=(alien, alien), model=spec.plan_model_record())
    assert table_time(task, plan) == 0.0
