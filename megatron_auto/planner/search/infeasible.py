"""Budgets no plan fits: the least peak memory over a search's tasks and the error saying so.

``search`` raises :class:`InfeasibleError` with the least peak any plan of the space needs,
as ``evaluate`` prices the plan reaching it, rounded up to a report step (docs/planner.md §6):
searching at the reported value succeeds, and it is within 1 % of the enumerated least peak
(``tests/test_planner_exhaustive.py``). Interleaved tasks never lower it
(:func:`interleaved_least_peak`), so only the plain tasks are priced.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..cost.estimate import evaluate_plan
from .least_memory import cheap_least_peak, task_least_peak
from ..inputs.model_spec import TrainingSpec
from .tasks import Task

GB = 1e9


class InfeasibleError(ValueError):
    """No plan of the space fits the budget; ``min_memory_bytes`` would (None if none ever can)."""

    def __init__(self, message: str, min_memory_bytes: float | None) -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes


def interleaved_least_peak(task: Task) -> float:
    """A lower bound on the peak of every plan of an interleaved task: its non-interleaved
    sibling's least peak (``least_memory.task_least_peak``) for single-type models, else 0.

    Why: with ``m >= pp`` (the interleaved schedule's rule) stage ``k``'s order passes through a
    moment where each of its local chunks holds at least ``pp - k`` micro-batches, the
    count a 1F1B stage ``k`` holds (right after its warm-up plus one forward, or at the end of
    an all-forward warm-up when ``m == pp``; ``interleaving.in_flight_vectors``). So an
    interleaved stage needs at least what a plain stage with the same layers and strategies
    needs (states, transients and the embedding/head are the same); with one layer type that
    plain stage is a plan of the sibling (any contiguous lengths), whose least peak is the
    least over all of them."""
    if len(task.spec.layer_types) != 1:
        return 0.0
    return task_least_peak(task.sibling(), None).bytes


def report_step(least: float) -> float:
    """The step the least memory is reported at: a power of ten of bytes at most 0.5 % of it
    and at most 1 MB (so gigabytes show three decimals), never below one byte."""
    return float(10 ** max(0, min(6, math.floor(math.log10(max(least * 0.005, 1.0))))))


def infeasible_error(space: str, world: int, budget: float,
                     tasks: list[tuple[Task, tuple[int, ...] | None]],
                     training: TrainingSpec) -> InfeasibleError:
    """The error for a budget no plan fits: the least peak over the tasks, as ``evaluate``
    prices the plan reaching it, rounded up to the report step (so searching at it succeeds)."""
    least = math.inf
    for task, pin in sorted(tasks, key=lambda x: cheap_least_peak(x[0])):
        if cheap_least_peak(task) >= least:
            break
        lp = task_least_peak(task, pin)
        if lp.plan is None or lp.bytes >= least:
            continue
        peak = evaluate_plan(lp.plan, task.spec,
                             replace(training, global_batch_size=task.global_batch),
                             task.cluster, task.profile).peak_memory_bytes
        least = min(least, max(peak, lp.bytes))
    if not math.isfinite(least):
        return InfeasibleError(
            f"no plan of space {space!r} exists for this model on {world} devices (check "
            f"divisibility of batch, heads and layers, or widen the space)", None)
    unit = report_step(least)
    shown = math.ceil(least / unit) * unit
    digits = max(3, 9 - int(round(math.log10(unit))))
    text = f"{shown / GB:.{digits}f}"
    return InfeasibleError(
        f"memory budget {budget / GB:.3f} GB per device is too small: the least memory any plan "
        f"of space {space!r} needs is {text} GB (framework reserve included); raise "
        f"--memory-budget-gb to at least {text}, lower the global batch, or widen the "
        f"search space", shown)
