"""A long walk restarts on finer memory cells.

The DP bounds of a task count memory in cells of ``Task.step`` bytes (about ``BOUND_CELLS`` of
the budget, driver.py), each layer's bytes rounded down to a cell: a relaxation, so a bound
may let through plans a byte-exact one would cut, and where memory binds tightly the walk
then visits thousands of nodes whose bounds sit just under the incumbent. Finer cells cost
more per DP table, which pays only on such walks: LLaMA-7B on 8 GPUs at 48 GB, proven exact
(gap 0), took 6,991 nodes at the default cells and 2,396 with every walk on four times finer
ones, but GPT-1.5B on 16 GPUs, whose one walk takes 127 nodes, then ran 1.7 times longer.
So a plain task's walk runs at the task's cells up to ``REFINE_AFTER`` nodes, and one that
gets there is searched again from its root on a twin task with ``REFINE_FACTOR`` times finer
cells (the same layer tables, plans and objective; its own DP tables). Every bound of either
walk is a valid one (rounding down at any cell size), the incumbent found so far stays, and
what the first walk cut it cut by a valid bound, so the answer and the certified gap keep
their meaning. Measured (two runs each way, the whole `plan` command in one process): LLaMA-7B
at 48 GB, gap 0, 2.65-3.03 -> 1.62-1.91 CPU s (3,010 nodes); the walks of GPT-1.5B at 20 GB
and BERT-Large at 8 GB stay under the limit and are unchanged, and the time-limited LLaMA-7B
runs at 24 and 36 GB end with the same bounds and answers.
"""

from __future__ import annotations

from ..inputs.model_spec import TrainingSpec
from .exact import TaskSearch
from .tasks import Task
from .walk_state import Incumbent

#: Nodes after which a plain task's walk restarts on finer cells.
REFINE_AFTER = 300
#: How many times finer the restarted walk's memory cells are (1: never restart).
REFINE_FACTOR = 4


def finer(task: Task, factor: int = REFINE_FACTOR) -> Task:
    """The task with memory cells ``factor`` times finer, sharing its layer tables."""
    key = (task.global_batch, task.pp, task.m, task.schedule, task.rules)
    return Task(task.spec, task.profile, task.cluster, task.world_size, task.global_batch,
                task.pp, task.m, task.schedule, task.rules, task.vocab, task.budget,
                max(1, task.step // factor), {key: task.tables}, virtual_size=task.v,
                cache=task.cache)


def walk_task(task: Task, training: TrainingSpec, best: Incumbent, deadline: float | None,
                partition: tuple[int, ...] | None, refine: bool = True) -> None:
    """``TaskSearch(task, ...).run()``; with ``refine`` a plain task's walk that passes
    ``REFINE_AFTER`` nodes is searched again on ``finer(task)``."""
    limit = None
    if refine and type(task) is Task and task.v == 1 and REFINE_FACTOR > 1 \
            and task.step >= REFINE_FACTOR:
        limit = best.nodes + REFINE_AFTER
    if TaskSearch(task, training, best, deadline, partition, node_limit=limit).run():
        TaskSearch(finer(task), training, best, deadline, partition).run()
