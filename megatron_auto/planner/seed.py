"""Fast, good plans of one task: the incumbents the exact search starts from.

The exact search (``exact.TaskSearch``) prunes against the best plan found so far, and a
time-limited search returns it; the better the first plans, the sooner the proof and the better
a cut-short answer. The seeds are plans of the full space found by the classic heuristic (the
one Galvatron-BMW uses): a per-stage DP over a *safe* memory model, the partitions it suggests,
every plan priced by ``evaluate_plan``. They never decide the answer; the search's proof does.

Per stage ``k`` (its micro-batches in flight ``k_in``) and transient level ``tau`` (strategies
whose transient is at most ``tau``), ``dp.solve_stage`` minimises the stage's time per
micro-batch plus its optimizer step and sync tail spread over the ``m`` micro-batches, with each
layer charged ``max(persistent, step peak)`` bytes rounded UP to cells and the stage's room
``budget - reserve - NCCL bound - embedding - max(tau, embedding transient)`` rounded DOWN: a
plan it returns fits both of ``evaluate_plan``'s peaks (relayout transients aside;
``evaluate_plan`` has the last word). One DP run answers every stage length. A bold variant
charges the persistent bytes only and the fewest NCCL communicators (near the budget the safe
one is too careful); its plans may not fit, and ``evaluate_plan`` drops those.

Partitions tried: the pinned one if any, else the even split and the time-balanced split of
these stage values (``partition.min_max_partition``).
"""

from __future__ import annotations

import math

import numpy as np

from ..plan import LayerStrategy, PipelineSpec, Plan, even_partition
from .dp import LayerOptions, StageTables, solve_stage
from .gpu_terms import search_nccl_bound
from .partition import min_max_partition
from .tasks import Task

SEED_CELLS = 512  # the safe memory model's resolution: the stage's room in this many cells
SEED_LEVELS = 3  # transient levels tried per stage (bucket tops, largest included)


def _step(task: Task) -> float:
    return max(1.0, task.room / SEED_CELLS)


def _levels(task: Task) -> list[float]:
    tops = sorted({hi for _, hi in task.buckets})
    picks = sorted({int(round(x)) for x in np.linspace(0, len(tops) - 1, SEED_LEVELS)})
    return [tops[i] for i in picks]


def _table(task: Task, window: tuple[int, ...], k_in: int, tau: float, bold: bool
           ) -> StageTables | None:
    step = _step(task)
    key = ("seed", window, k_in, tau, task.m, step, bold)
    cache = task.tables.rest
    if key not in cache:
        opts = []
        by_type = {}
        for t in set(window):
            c = task.tables.costs(t, k_in)
            keep = np.nonzero(c.transient <= tau)[0]
            if len(keep) == 0:
                cache[key] = None
                return None
            charged = c.persistent if bold else np.maximum(c.persistent, c.step_peak)
            mem = np.ceil(charged[keep] / step - 1e-12)
            cost = (c.microbatch + (c.optimizer + c.exposed_sync) / task.m)[keep]
            by_type[t] = (keep, LayerOptions(mem=mem.astype(np.int64), cost=cost,
                                             aux=np.zeros((len(keep), 0)),
                                             cls=task.tables.classes(t, k_in)[keep]))
        opts = [by_type[t][1] for t in window]
        trans = np.minimum.reduce([task.relayout[t] for t in set(window)]) \
            if len(set(window)) > 1 else task.relayout[window[0]]
        cache[key] = (solve_stage(opts, trans, SEED_CELLS), by_type)
    return cache[key]


def _stage(task: Task, k: int, start: int, bold: bool):
    """Per length: (value, level) of stage ``k`` from ``start`` under the safe model (or the
    bold one: persistent bytes only, the fewest NCCL communicators)."""
    order = task.spec.layer_order
    window = tuple(order[start:start + task.max_len])
    key = (window, k, bold)
    if key in task.__dict__.setdefault("_seed_rows", {}):
        return task._seed_rows[key]
    e = task.emb[k]
    out = np.full(task.max_len, math.inf)
    level: list = [None] * task.max_len
    for tau in _levels(task):
        found = _table(task, window, task.in_flight[k], tau, bold)
        if found is None:
            continue
        table, _ = found
        if bold:
            room = (task.room * (1 - 1e-9) - e.persistent - max(tau, e.transient)
                    - task.nccl_floor[k])
        else:
            room = (task.room * (1 - 1e-9)
                    - max(e.persistent + max(tau, e.transient), e.step_peak)
                    - search_nccl_bound(task.cluster, task.n, task.pp))
        if room < 0:
            continue
        cells = min(int(room // _step(task)), SEED_CELLS)
        vals = table.best[:, cells] + e.microbatch + (e.optimizer + e.exposed_sync) / task.m
        n = len(window)
        better = vals < out[:n]
        for ln in np.nonzero(better)[0]:
            level[ln] = (tau, cells)
        out[:n] = np.where(better, vals, out[:n])
    task._seed_rows[key] = (out, level)
    return out, level


def _layers(task: Task, part: tuple[int, ...], bold: bool) -> list[LayerStrategy] | None:
    out: list[LayerStrategy] = []
    start = 0
    order = task.spec.layer_order
    for k, length in enumerate(part):
        vals, level = _stage(task, k, start, bold)
        if length > len(vals) or not math.isfinite(vals[length - 1]):
            return None
        tau, cells = level[length - 1]
        window = tuple(order[start:start + task.max_len])
        table, by_type = _table(task, window, task.in_flight[k], tau, bold)
        picks = table.choices(length, cells)
        if picks is None:
            return None
        k_in = task.in_flight[k]
        for j, p in enumerate(picks):
            t = window[j]
            out.append(task.tables.costs(t, k_in).strategies[int(by_type[t][0][p])])
        start += length
    return out


def seed_plans(task: Task, partition: tuple[int, ...] | None = None) -> list[Plan]:
    """Heuristic plans of ``task`` (the module docstring), the ``partition`` given or several."""
    L, pp = task.num_layers, task.pp
    single = len(task.spec.layer_types) == 1
    plans, seen = [], set()
    for bold in (True, False):
        if partition is not None:
            parts = [partition]
        else:
            parts = [even_partition(L, pp)]
            if pp > 1:
                def row(k: int, start: int) -> np.ndarray:
                    return _stage(task, k, start, bold)[0]
                timed = min_max_partition(L, pp, row, task.max_len, not single)
                if timed is not None:
                    parts.append(timed)
        for part in parts:
            layers = _layers(task, tuple(part), bold)
            if layers is None or (tuple(part), tuple(layers)) in seen:
                continue
            seen.add((tuple(part), tuple(layers)))
            plans.append(Plan(world_size=task.world_size, global_batch_size=task.global_batch,
                              num_microbatches=task.m,
                              pipeline=PipelineSpec(size=pp, schedule=task.schedule,
                                                    layers_per_stage=tuple(part)),
                              vocab=task.vocab, layers=tuple(layers),
                              model=task.spec.plan_model_record()))
    return plans

