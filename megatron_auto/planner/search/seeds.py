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
these stage values (``partition.min_max_partition``). Besides, the best uniform plans (one
strategy for all layers, as Megatron-LM's grid; :func:`uniform_plans`), so that the full
space's answer never loses to a uniform baseline space however early the time limit stops it.
Deep single-type models (more than ``DP_SEED_MAX_LAYERS`` layers) use stages that mix at most
two strategies (:func:`pair_plans`, vectorised over both strategies and the split point)
instead of the per-stage DP, which costs seconds there.
"""

from __future__ import annotations

import math

import numpy as np

from ...plan import LayerStrategy, Plan, even_partition
from .stage_dp import LayerOptions, StageTables, solve_stage
from ..cost.time_model import pipeline_time
from .partition import min_max_partition
from .tasks import Task
from .task_plans import task_plan

SEED_CELLS = 384  # the safe memory model's resolution: the stage's room in this many cells
SEED_LEVELS = 2  # transient levels tried per stage (bucket tops, the largest included)


def _step(task: Task) -> float:
    return max(1.0, task.room / SEED_CELLS)


def _levels(task: Task) -> list[float]:
    tops = sorted({hi for _, hi in task.tables.buckets})
    picks = sorted({int(round(x)) for x in np.linspace(0, len(tops) - 1, SEED_LEVELS)})
    return [tops[i] for i in picks]


# A seed DP over a window: its tables, and per layer type the kept strategies and their options.
SeedTable = tuple[StageTables, dict[int, tuple[np.ndarray, LayerOptions]]]


def _table(task: Task, window: tuple[int, ...], k_in: int, tau: float, bold: bool
           ) -> SeedTable | None:
    step = _step(task)
    key = ("seed", window, k_in, tau, task.m, step, bold)
    cache = task.tables.memo
    if key not in cache:
        if task.on_new_table is not None:
            task.on_new_table()  # the deadline: DP runs are the slow part
        by_type: dict[int, tuple[np.ndarray, LayerOptions]] = {}
        for t in set(window):
            found = seed_options(task, t, k_in, tau, bold)
            if found is None:
                cache[key] = None
                return None
            by_type[t] = found
        opts = [by_type[t][1] for t in window]
        cache[key] = (solve_stage(opts, seed_transitions(task, set(window)), SEED_CELLS),
                      by_type)
    return cache[key]


def seed_options(task: Task, t: int, k_in: int, tau: float, bold: bool
                 ) -> tuple[np.ndarray, LayerOptions] | None:
    """A layer of type ``t`` at ``k_in`` micro-batches in flight in a seed DP: the indices of
    its strategies of transient at most ``tau`` and their options (time per micro-batch with the
    step and sync tail spread over the ``m`` micro-batches; bytes rounded up to cells, the
    persistent ones if ``bold``, else the larger peak); None where none is that small."""
    c = task.tables.costs(t, k_in)
    keep = np.nonzero(c.transient <= tau)[0]
    if len(keep) == 0:
        return None
    charged = c.persistent if bold else np.maximum(c.persistent, c.step_peak)
    mem = np.ceil(charged[keep] / _step(task) - 1e-12)
    cost = (c.microbatch + (c.optimizer + c.exposed_sync) / task.m)[keep]
    return keep, LayerOptions(mem=mem.astype(np.int64), cost=cost, aux=np.zeros((len(keep), 0)),
                              cls=task.tables.classes(t, k_in)[keep])


def seed_transitions(task: Task, types: set[int]) -> np.ndarray:
    """The relayout costs a seed DP charges between classes (the least over ``types``)."""
    if len(types) > 1:
        return np.minimum.reduce([task.tables.relayout[t] for t in types])
    return task.tables.relayout[next(iter(types))]


def _stage(task: Task, k: int, start: int, bold: bool):
    """Per length: (value, level) of stage ``k`` from ``start`` under the safe model (or the
    bold one: persistent bytes only, the fewest NCCL communicators)."""
    order = task.spec.layer_order
    window = tuple(order[start:start + task.max_len])
    key = (window, k, bold)
    if key in task.seed_rows:
        return task.seed_rows[key]
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
                    - task.nccl_bound)
        if room < 0:
            continue
        cells = min(int(room // _step(task)), SEED_CELLS)
        vals = table.best[:, cells] + e.microbatch + (e.optimizer + e.exposed_sync) / task.m
        n = len(window)
        better = vals < out[:n]
        for ln in np.nonzero(better)[0]:
            level[ln] = (tau, cells)
        out[:n] = np.where(better, vals, out[:n])
    task.seed_rows[key] = (out, level)
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
        found = _table(task, window, task.in_flight[k], tau, bold)
        if found is None:  # not reached: _stage found this level's table
            return None
        table, by_type = found
        picks = table.choices(length, cells)
        if picks is None:
            return None
        k_in = task.in_flight[k]
        for j, p in enumerate(picks):
            t = window[j]
            out.append(task.tables.costs(t, k_in).strategies[int(by_type[t][0][p])])
        start += length
    return out


UNIFORM_KEPT = 2  # uniform plans priced by evaluate_plan per task (the best by a quick estimate)


def uniform_plans(task: Task, partition: tuple[int, ...] | None = None) -> list[Plan]:
    """The best uniform plans of the task (one strategy for every layer, the even or pinned
    split: the Megatron grid inside the full space), ranked by a quick estimate from the cost
    arrays (stage sums, ``cost_time.pipeline_time``) with a memory check that ignores
    relayouts; the best ``UNIFORM_KEPT`` are returned for ``evaluate_plan`` to price."""
    if len(task.spec.layer_types) != 1:
        return []
    part = tuple(partition or even_partition(task.num_layers, task.pp))
    stage_costs = [task.tables.costs(0, task.in_flight[k]) for k in range(task.pp)]
    reserve = float(task.cluster.memory_reserve_bytes)
    ranked = []
    for s in stage_costs[0].strategies:
        micro, back, tails, steps, fits = [], [], [], [], True
        for k, c in enumerate(stage_costs):
            i = c.position.get(s)
            if i is None:
                fits = False
                break
            e, n = task.emb[k], part[k]
            micro.append(e.microbatch + n * float(c.microbatch[i]))
            back.append(e.backward + n * float(c.backward[i]))
            tails.append(e.exposed_sync + n * float(c.exposed_sync[i]))
            steps.append(e.optimizer + n * float(c.optimizer[i]))
            floor = reserve + task.nccl_floor[k]
            backward_peak = n * float(c.persistent[i]) + max(float(c.transient[i]),
                                                             e.transient) + e.persistent
            step_peak = n * float(c.step_floor[i]) + e.step_floor
            if max(backward_peak, step_peak) + floor > task.budget:
                fits = False
                break
        if fits:
            ranked.append((pipeline_time(micro, back, tails, task.m, steps).iteration, s))
    ranked.sort(key=lambda x: x[0])
    return [task_plan(task, part, (s,) * task.num_layers) for _, s in ranked[:UNIFORM_KEPT]]


PAIR_WINDOW = 2  # the time-balanced pair split tries stage lengths within this of even
DP_SEED_MAX_LAYERS = 32  # above this, the per-stage DP seed gives way to the pair seed


def _pair_stage(task: Task, k: int, length: int, bold: bool):
    """Best stage of ``length`` layers made of two strategies ``a`` (first ``x`` layers) and
    ``b``: ``(value, a, b, x)`` or None, memory checked on both peaks with the NCCL bound
    (the fewest communicators if ``bold``)."""
    e = task.emb[k]
    nccl = task.nccl_floor[k] if bold else task.nccl_bound
    # kept with the layer tables, by all it reads: a middle stage's is the same for every
    # vocabulary layout of the table (no embedding, the same communicators)
    key = ("pair", task.in_flight[k], length, bold, e, nccl, task.budget)
    cache = task.tables.memo
    if key in cache:
        return cache[key]
    c = task.tables.costs(0, task.in_flight[k])
    value = c.microbatch + (c.optimizer + c.exposed_sync) / task.m
    room = task.budget * (1 - 1e-9) - task.cluster.memory_reserve_bytes - nccl
    top = np.maximum(np.maximum(c.transient[:, None], c.transient[None, :]), e.transient)
    x = _pair_splits(c, top, e, room, length)
    y = length - x
    va, vb = value[:, None, None], value[None, :, None]
    total = x * va + y * vb
    cls = task.tables.classes(0, task.in_flight[k])
    trans = task.tables.relayout[0][cls[:, None], cls[None, :]][:, :, None]
    total = total + np.where((x > 0) & (y > 0), trans, 0.0)
    backward = (x * c.persistent[:, None, None] + y * c.persistent[None, :, None]
                + top[:, :, None] + e.persistent)
    step = x * c.step_peak[:, None, None] + y * c.step_peak[None, :, None] + e.step_peak
    total = np.where((backward <= room) & (step <= room), total, np.inf)
    j = int(np.argmin(total))
    a, b, i = np.unravel_index(j, total.shape)
    out = None
    if np.isfinite(total.flat[j]):
        out = (float(total.flat[j]) + e.microbatch + (e.optimizer + e.exposed_sync) / task.m,
               c.strategies[int(a)], c.strategies[int(b)], int(np.broadcast_to(
                   x, total.shape)[a, b, i]))
    cache[key] = out
    return out


#: Split points a pair stage tries (``_pair_splits``): every one up to this many, else these.
PAIR_CANDIDATES = 10


def _pair_splits(c, top: np.ndarray, e, room: float, length: int) -> np.ndarray:
    """The split points ``x`` (layers of strategy ``a``) that ``_pair_stage`` prices per pair
    ``(a, b)``, ascending: all of ``0..length``, or, for long stages, the few where the best
    of them lies. Both peaks are linear in ``x``, so the ones that fit form an interval
    ``[lo, hi]``; the time is linear in ``x`` inside ``1..length-1`` (one relayout) and
    differs at the ends. So the least time, and the smallest ``x`` reaching it, is at ``0``,
    ``length``, ``max(lo, 1)`` or ``min(hi, length - 1)``: those are kept, with ``lo`` and
    ``hi`` widened by one each way against rounding (the caller checks every one exactly).
    Shape ``(1, 1, length + 1)`` or ``(S, S, PAIR_CANDIDATES)``."""
    if length + 1 <= PAIR_CANDIDATES:
        return np.arange(length + 1)[None, None, :]
    lo = np.zeros(top.shape)
    hi = np.full(top.shape, float(length))
    for per, fixed in ((c.persistent, top + e.persistent), (c.step_peak, e.step_peak)):
        d = per[:, None] - per[None, :]  # the peak grows by d per layer moved from b to a
        r = room - length * per[None, :] - fixed  # and fits while d x <= r
        with np.errstate(divide="ignore", invalid="ignore"):
            q = r / d
        hi = np.where(d > 0, np.minimum(hi, np.floor(q)), hi)
        lo = np.where(d < 0, np.maximum(lo, np.ceil(q)), lo)
        hi = np.where((d == 0) & (r < 0), -1.0, hi)  # fits nowhere: every candidate is checked
    lo, hi = np.clip(lo, 0, length), np.clip(hi, 0, length)
    cands = np.stack([np.zeros(top.shape), lo - 1, lo, lo + 1, np.ones(top.shape),
                      np.full(top.shape, length - 1.0), hi - 1, hi, hi + 1,
                      np.full(top.shape, float(length))], axis=-1)
    return np.sort(np.clip(cands, 0, length), axis=-1).astype(np.int64)


def pair_plans(task: Task, partition: tuple[int, ...] | None = None) -> list[Plan]:
    """Plans whose stages each mix at most two strategies (:func:`_pair_stage`): the even or
    pinned split and, for pipelines, the time-balanced split over stage lengths within
    ``PAIR_WINDOW`` of even. For deep single-type models, where a DP per stage costs seconds."""
    if len(task.spec.layer_types) != 1:
        return []
    L, pp = task.num_layers, task.pp
    plans = []
    for bold in (True, False):
        parts = [tuple(partition or even_partition(L, pp))]
        if partition is None and pp > 1:
            even = L // pp
            lengths = [ln for ln in range(max(1, even - PAIR_WINDOW), even + PAIR_WINDOW + 2)
                       if ln <= task.max_len]

            def row(k: int, start: int, bold=bold) -> np.ndarray:
                out = np.full(task.max_len, np.inf)
                for ln in lengths:
                    found = _pair_stage(task, k, ln, bold)
                    if found is not None:
                        out[ln - 1] = found[0]
                return out
            timed = min_max_partition(L, pp, row, task.max_len, False)
            if timed is not None:
                parts.append(timed)
        for part in parts:
            layers: list[LayerStrategy] = []
            for k, ln in enumerate(part):
                found = _pair_stage(task, k, ln, bold)
                if found is None:
                    break
                _, a, b, x = found
                layers.extend([a] * x + [b] * (ln - x))
            else:
                plans.append(task_plan(task, part, layers))
    return plans


def seed_plans(task: Task, partition: tuple[int, ...] | None = None) -> list[Plan]:
    """Heuristic plans of ``task`` (the module docstring), the ``partition`` given or several."""
    L, pp = task.num_layers, task.pp
    single = len(task.spec.layer_types) == 1
    plans = uniform_plans(task, partition)
    if (partition is not None or pp == 1) and all(
            len(task.tables.costs(t, k_in)) == 1 for t in range(len(task.spec.layer_types))
            for k_in in set(task.in_flight)):
        return plans  # one strategy per layer and one split: the uniform plan is the plan
    if L > DP_SEED_MAX_LAYERS and len(task.spec.layer_types) == 1:
        return plans + pair_plans(task, partition)
    seen = {(p.pipeline.layers_per_stage, p.layers) for p in plans}
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
            plans.append(task_plan(task, part, layers))
    return plans

