"""A search task's plans as ``Plan`` records: the one with given chunk lengths and layer
strategies (what the walk, the seeds and the least-memory search price), and a task's only
plan where its space leaves it one."""

from __future__ import annotations

from typing import Any, Sequence

from ...plan import LayerStrategy, PipelineSpec, Plan
from ..cost.time_model import pipeline_time
from .mixed_offload import MixedOffloadTask
from .tasks import Task


def task_plan(task: Task, lengths: Sequence[int], layers: Sequence[LayerStrategy],
              fraction: Any = None) -> Plan:
    """The plan of ``task`` with chunk lengths ``lengths`` and one strategy
    per layer; ``fraction``: its optimizer offload (default: the space's)."""
    offload = task.rules.optimizer_offload if fraction is None else fraction
    return Plan(world_size=task.world_size, global_batch_size=task.global_batch,
                num_microbatches=task.m,
                pipeline=PipelineSpec(size=task.pp, schedule=task.schedule,
                                      layers_per_stage=tuple(lengths), virtual_size=task.v,
                                      optimizer_offload_fraction=offload),
                vocab=task.vocab, layers=tuple(layers), model=task.spec.plan_model_record())


def only_plan(task: Task, partition: Sequence[int] | None) -> Plan | None:
    """The one plan of a plain ``task`` whose partition is fixed (``partition``, or one
    stage) and whose every layer has one strategy left (the uniform baseline spaces: dp,
    zero3, tp, pp, each megatron3d grid point; the strategies dominance removed are never
    better, ``stage_costs.prune_dominated``), else None. Pricing it settles the task exactly,
    for less than any bound of it costs. A per-stage offload task (``mixed_offload``) says
    None: its plans differ in their offload fractions."""
    if task.v != 1 or isinstance(task, MixedOffloadTask):
        return None
    if partition is None:
        if task.pp != 1:
            return None
        partition = (task.num_layers,)
    layers: list[LayerStrategy] = []
    for k, length in enumerate(partition):
        for i in range(len(layers), len(layers) + length):
            costs = task.costs(k, i)
            if len(costs) != 1:
                return None
            layers.append(costs.strategies[0])
    return task_plan(task, partition, layers)


def table_time(task: Task, plan: Plan) -> float:
    """A lower bound on ``evaluate_plan``'s iteration time of ``plan``, a plan of the plain
    (v = 1) ``task``, from the task's cost tables alone: each stage's layers and embedding/head
    at their table times, no relayout between them, in ``cost_time.pipeline_time`` (which no
    stage's term lowers) with the fixed step overhead (``Task.overhead``); 0 where a layer's
    strategy is not in its table. A seed bounded at the incumbent's time or above need not be
    priced (whether it fits then stays unknown)."""
    micro, back, tails, steps = [], [], [], []
    start = 0
    for k, n in enumerate(plan.pipeline.layers_per_stage):
        e = task.emb[k]
        c_sum, b_sum, tail, step = e.microbatch, e.backward, e.exposed_sync, e.optimizer
        for layer in range(start, start + n):
            c = task.costs(k, layer)
            i = c.position.get(plan.layers[layer])
            if i is None:
                return 0.0
            c_sum += float(c.forward[i]) + float(c.backward[i])
            b_sum += float(c.backward[i])
            tail += float(c.exposed_sync[i])
            step += float(c.optimizer[i])
        micro.append(c_sum)
        back.append(b_sum)
        tails.append(tail)
        steps.append(step)
        start += n
    return pipeline_time(micro, back, tails, task.m, steps, task.overhead).iteration
