"""The least peak memory any plan of a task can have: the number an infeasible budget reports.

A stage's peak (``evaluate_plan``) is ``max(backward peak, optimizer-step peak)`` with
``backward = sum persistent + max transient + embedding + reserve`` and
``step = sum step_peak + embedding step peak + reserve``. Per transient level ``tau`` (the
strategies whose transient is at most ``tau``; the running layer's transient is the largest),
``dp.solve_stage`` with persistent bytes rounded UP to cells of ``step`` as the memory axis and
the step peak as the objective gives, for every ``v``, the least step peak of a stage whose
persistent bytes fit ``v`` cells; the stage's least peak is the best ``max`` of the two over
``v`` and ``tau``. Partitions: the exact min-max split (``partition.min_max_partition``).

Rounding only adds, so the result is a peak some plan really stays under; it is at most
``max_len * step`` above the true least, and :func:`least_peak` refines ``step`` until that is
at most 0.99 % of it (so the reported minimum is within 1 % of the enumerated one).
"""

from __future__ import annotations

import math

import numpy as np

from .dp import LayerOptions, solve_stage
from .partition import min_max_partition
from .tasks import Task

PRECISION = 0.0099  # the reported least peak is at most this fraction above the true one


def _stage_least(task: Task, k: int, start: int, step: float) -> np.ndarray:
    """Least peak bytes of stage ``k`` from ``start`` per length ``1..max_len``."""
    order = task.spec.layer_order
    window = order[start:start + task.max_len]
    k_in = task.in_flight[k]
    e = task.emb[k]
    reserve = task.cluster.memory_reserve_bytes
    costs = {t: task.tables.costs(t, k_in) for t in set(window)}
    out = np.full(task.max_len, math.inf)
    levels = sorted({float(x) for c in costs.values() for x in c.transient})
    for tau in levels:
        allowed = {t: np.nonzero(c.transient <= tau)[0] for t, c in costs.items()}
        if any(len(a) == 0 for a in allowed.values()):
            continue
        opts = {}
        top = 0
        for t, c in costs.items():
            a = allowed[t]
            mem = np.ceil(c.persistent[a] / step - 1e-12).astype(np.int64)
            opts[t] = LayerOptions(mem=mem, cost=c.step_peak[a], aux=np.zeros((len(a), 0)),
                                   cls=np.zeros(len(a), dtype=np.int64))
            top = max(top, int(mem[np.argmin(c.step_peak[a])]), int(mem.min()))
        cells = top * len(window)
        best = solve_stage([opts[t] for t in window], np.zeros((1, 1)), cells).best
        v = np.arange(cells + 1) * step
        peak = np.maximum(v[None, :] + max(tau, e.transient) + e.persistent,
                          best + e.step_peak) + reserve
        out[:len(window)] = np.minimum(out[:len(window)], peak.min(axis=1))
    return out


def task_least_peak(task: Task, step: float) -> float:
    """Least peak (bytes, rounded up at ``step``) over every partition of the task."""
    single = len(task.spec.layer_types) == 1
    cache: dict[tuple[int, int], np.ndarray] = {}

    def row(k: int, start: int) -> np.ndarray:
        key = (k, 0 if single else start)
        if key not in cache:
            cache[key] = _stage_least(task, k, key[1], step)
        return cache[key]

    part = min_max_partition(task.num_layers, task.pp, row, task.max_len, not single)
    if part is None:
        return math.inf
    worst, start = 0.0, 0
    for k, length in enumerate(part):
        worst = max(worst, float(row(k, start)[length - 1]))
        start += length
    return worst


def least_peak(tasks: list[Task]) -> float | None:
    """Least peak over the tasks, within ``PRECISION`` of the true least (None: no task)."""
    tasks = [t for t in tasks if t.ok]
    if not tasks:
        return None
    longest = max(t.max_len for t in tasks)
    step = max(1.0, max(t.room for t in tasks) / 4096)
    while True:
        best = min(task_least_peak(t, step) for t in tasks)
        if not math.isfinite(best):
            return None
        lower = best - longest * step  # the rounding added less than this
        if longest * step <= PRECISION * max(lower, 0.0) or step <= 1.0:
            return best
        step = max(1.0, PRECISION * 0.9 * max(lower, 1.0) / longest)
