"""The least peak memory any plan of a task can have, and a plan that has it.

Two uses: the search skips a task whose least peak exceeds the budget before any branching
(no plan of it can fit), and an infeasible budget reports the least peak over every task
(``InfeasibleError.min_memory_bytes``) together with a plan that reaches it, so searching at
the reported value succeeds by construction.

A stage's peak (``cost_model.evaluate_plan``) is ``max(backward peak, optimizer-step peak)``:

    backward = reserve + sum_i persistent_i + max(transients) + embedding persistent
    step     = reserve + sum_i step_peak_i + embedding step peak

(fragmentation folded into the persistent and transient terms, ``stage_costs``). With fused
AdamW a stage that shards nothing drops the step's foreach temporaries: those stages get a
second family of fronts, over the unsharded strategies with that smaller step peak.

For a transient level ``tau`` (only strategies whose transient is at most ``tau``; the largest
one present is then at most ``tau``), the stage's reachable ``(sum persistent, sum step peak)``
pairs are built layer by layer as an exact Pareto front (no memory cells, no rounding): the
front of ``l + 1`` layers is the Pareto-pruned Minkowski sum of the front of ``l`` layers and
the layer's strategies. The stage's least peak is the best ``max`` over the front and the
levels; the task's is the exact min-max partition of those (``partition.min_max_partition``).

Not modelled here: the transient of a relayout between two layers of different layouts (a
gathered micro-batch, smaller than a layer's backward in practice) and the NCCL communicators
(a GPU term that depends on the set of process groups; zero on CPU clusters). The value is
therefore a lower bound on every plan's peak (exact when neither binds), and the witness plan
is priced by ``evaluate_plan``, whose peak is what an infeasible budget reports.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ...plan import LayerStrategy, Plan
from .mixed_offload import MixedOffloadTask, stage_variants
from .partition import min_max_partition
from .tasks import Task
from .task_plans import task_plan

# A front larger than this is thinned to its ``MAX_FRONT`` lowest-persistent points plus the
# lowest-step point; never reached by the models of the tests and benchmarks (a few hundred).
MAX_FRONT = 20000


@dataclass(frozen=True)
class _Fronts:
    """Pareto fronts of one layer window at one transient level, per prefix length ``l + 1``:
    ``persistent[l]``, ``step[l]`` (sorted by persistent) and, to rebuild a point, the index of
    its predecessor in front ``l - 1`` and the strategy index of layer ``l``."""

    persistent: list[np.ndarray]
    step: list[np.ndarray]
    parent: list[np.ndarray]
    choice: list[np.ndarray]

    @functools.cached_property
    def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every length's front in one array (persistent, step) and each length's offset."""
        sizes = [len(x) for x in self.persistent]
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        return np.concatenate(self.persistent), np.concatenate(self.step), offsets


def _pareto(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Indices of the points no other point is at most in both coordinates (first kept)."""
    order = np.lexsort((q, p))
    qs = q[order]
    best_before = np.concatenate([[math.inf], np.minimum.accumulate(qs)[:-1]])
    return order[qs < best_before]


def _fronts(task: Task, window: tuple[int, ...], k_in: int, tau: float,
            plain: bool = False) -> _Fronts | None:
    """Fronts of ``window`` (layer types) at ``k_in`` micro-batches in flight, level ``tau``.
    ``plain``: only strategies that shard nothing, with the step peak fused AdamW leaves them
    (``step_floor``); else every strategy with its full step peak."""
    key = ("fronts", window, k_in, tau, plain)
    cache = task.tables.memo
    if key in cache:
        return cache[key]
    opts = {}
    for t in set(window):
        c = task.tables.costs(t, k_in)
        ok = c.transient <= tau
        if plain:
            ok &= c.sharded == 0
        idx = np.nonzero(ok)[0]
        if len(idx) == 0:
            cache[key] = None
            return None
        step = c.step_floor if plain else c.step_peak
        keep = idx[_pareto(c.persistent[idx], step[idx])]
        opts[t] = (keep, c.persistent[keep], step[keep])
    out = _Fronts([], [], [], [])
    p_prev, q_prev = np.zeros(1), np.zeros(1)
    for t in window:
        keep, p, q = opts[t]
        pc = (p_prev[:, None] + p[None, :]).ravel()
        qc = (q_prev[:, None] + q[None, :]).ravel()
        sel = _pareto(pc, qc)
        if len(sel) > MAX_FRONT:  # keep the extremes; see MAX_FRONT
            sel = np.sort(np.concatenate([sel[:MAX_FRONT], sel[-1:]]))  # distinct indices
        out.persistent.append(pc[sel])
        out.step.append(qc[sel])
        out.parent.append(sel // len(p))
        out.choice.append(keep[sel % len(p)])
        p_prev, q_prev = pc[sel], qc[sel]
    cache[key] = out
    return out


def _levels(task: Task, window: tuple[int, ...], k_in: int) -> list[float]:
    """Transient levels worth a front: those of strategies no other strategy is at most in
    persistent, transient and step peak alike (a dominated one is never needed: whenever it is
    allowed, the one dominating it is too)."""
    out: set[float] = set()
    for t in set(window):
        c = task.tables.costs(t, k_in)
        keys = np.stack([c.persistent, c.transient, c.step_peak], axis=1)
        no_worse = (keys[:, None, :] <= keys[None, :, :]).all(axis=2)   # [j, i]
        better = (keys[:, None, :] < keys[None, :, :]).any(axis=2)
        dominated = (no_worse & better).any(axis=0)
        out.update(float(x) for x in c.transient[~dominated])
    return sorted(out)


def _window(task: Task, start: int) -> tuple[int, ...]:
    order = task.spec.layer_order
    return tuple(order[start:start + task.max_len])


def _families(task: Task, e) -> list[bool]:
    """Front families of a stage: every strategy, and (fused AdamW, nothing of the stage's
    embedding/head sharded) the unsharded ones with their smaller step peak."""
    fused = bool(getattr(task.cluster, "fused_optimizer", False))
    return [False, True] if fused and not e.sharded else [False]


def _point_peak(fr: _Fronts, ln: int, tau: float, e, reserve: float, plain: bool
                ) -> np.ndarray:
    return np.maximum(fr.persistent[ln] + max(tau, e.transient) + e.persistent,
                      fr.step[ln] + (e.step_floor if plain else e.step_peak)) + reserve


def stage_least(task: Task, k: int, start: int) -> tuple[np.ndarray, list]:
    """Least peak bytes of stage ``k`` from layer ``start``, per length ``1..max_len`` (inf
    past the model's end), and per length the level that reaches it."""
    window = _window(task, start)
    k_in = task.in_flight[k]
    e = task.emb[k]
    reserve = float(task.cluster.memory_reserve_bytes) + task.nccl_floor[k]
    key = ("least_row", window, k_in, e, reserve)
    cache = task.tables.memo
    if key in cache:
        return cache[key]
    out = np.full(task.max_len, math.inf)
    where: list = [None] * task.max_len
    n = len(window)
    for plain in _families(task, e):
        for tau in _levels(task, window, k_in):
            fr = _fronts(task, window, k_in, tau, plain)
            if fr is None:
                continue
            p, q, offsets = fr.flat
            peak = np.maximum(p + max(tau, e.transient) + e.persistent,
                              q + (e.step_floor if plain else e.step_peak)) + reserve
            least = np.minimum.reduceat(peak, offsets)
            better = least < out[:n]
            for ln in np.nonzero(better)[0]:
                where[ln] = (tau, plain)
            out[:n] = np.where(better, least, out[:n])
    cache[key] = (out, where)
    return out, where


def _rebuild(task: Task, k: int, start: int, length: int, tau: float, plain: bool
             ) -> list[LayerStrategy]:
    window = _window(task, start)
    fr = _fronts(task, window, task.in_flight[k], tau, plain)
    assert fr is not None
    point = int(np.argmin(_point_peak(fr, length - 1, tau, task.emb[k], 0.0, plain)))
    picks = []
    for ln in range(length - 1, -1, -1):
        picks.append(int(fr.choice[ln][point]))
        point = int(fr.parent[ln][point])
    picks.reverse()
    k_in = task.in_flight[k]
    chosen = [task.tables.costs(window[i], k_in).strategies[s] for i, s in enumerate(picks)]
    if len(set(window[:length])) == 1:
        # One layer type: any order has the same memory; grouping equal layouts avoids
        # relayouts inside the stage (whose transients are not modelled above).
        chosen.sort(key=lambda s: (s.tp, not s.tp_consecutive, s.dp_mode, str(s.recompute)))
    return chosen


def cheap_least_peak(task: Task) -> float:
    """A lower bound on the task's least peak that needs no front: every layer at its least
    persistent bytes (at the fewest micro-batches in flight of any stage), spread perfectly over
    the stages, plus the least transient and the reserve; or the embedding/head stage alone.
    Per-stage offload tasks (mixed_offload): each term the least over the variants."""
    k_min = min(task.in_flight)
    order = task.spec.layer_order
    variants = task.variants if isinstance(task, MixedOffloadTask) else [task]
    types = range(len(task.spec.layer_types))
    persistent = [min(float(v.tables.costs(t, k_min).persistent.min()) for v in variants)
                  for t in types]
    spread = sum(persistent[order[i]] for i in range(task.num_layers))
    transient = min(float(v.tables.costs(t, k_min).transient.min())
                    for v in variants for t in types)

    def end(k: int) -> float:
        return min(max(e.persistent + max(e.transient, transient), e.step_floor)
                   for e in (v.emb[k] for _, v in stage_variants(task, k)))

    return (float(task.cluster.memory_reserve_bytes) + min(task.nccl_floor)
            + max(spread / task.pp + transient, end(0), end(task.chunks - 1)))


@dataclass(frozen=True)
class LeastPeak:
    """A task's least peak (a lower bound on every plan's peak) and a plan reaching it."""

    bytes: float
    plan: Plan | None


def task_least_peak(task: Task, partition: tuple[int, ...] | None = None) -> LeastPeak:
    """Least peak over every strategy of the task and every partition (or the ``partition``
    given), cached on the task."""
    cache = task.least_peaks
    if partition in cache:
        return cache[partition]
    single = len(task.spec.layer_types) == 1
    # per (stage, start): the least over the stage's variants (mixed_offload; a uniform task
    # is its only one) per length, and per length the variant, its task and level reaching it
    rows: dict[tuple[int, int], tuple[np.ndarray, list]] = {}

    def row(k: int, start: int) -> np.ndarray:
        key = (k, 0 if single else start)
        if key not in rows:
            found = [(j, var) + stage_least(var, k, key[1]) for j, var in stage_variants(task, k)]
            values = np.stack([f[2] for f in found])
            best = values.argmin(axis=0)
            rows[key] = (values.min(axis=0), [found[b][:2] + (found[b][3][ln],)
                                              for ln, b in enumerate(best.tolist())])
        return rows[key][0]

    part = partition
    if part is None:
        part = min_max_partition(task.num_layers, task.pp, row, task.max_len, not single)
    elif any(not math.isfinite(float(row(k, sum(part[:k]))[n - 1])) for k, n in enumerate(part)):
        part = None
    if part is None:
        result = LeastPeak(math.inf, None)
    else:
        worst, start, layers, picks = 0.0, 0, [], []
        for k, length in enumerate(part):
            value = float(row(k, start)[length - 1])
            worst = max(worst, value)
            j, var, (tau, plain) = rows[(k, 0 if single else start)][1][length - 1]
            layers.extend(_rebuild(var, k, start, length, tau, plain))
            picks.append(j)
            start += length
        fraction = task.field(picks) if isinstance(task, MixedOffloadTask) \
            else task.rules.optimizer_offload
        plan = task_plan(task, part, layers, fraction)
        result = LeastPeak(worst, plan)
    cache[partition] = result
    return result
