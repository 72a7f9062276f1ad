"""Pipeline partitions: even, memory-balanced, and our bi-objective (BMW) balancing.

Every function here works on *stage tables*, not on layers: ``row(k, start)`` returns, for stage
position ``k`` starting at layer ``start``, an array over lengths ``1..max_len`` (entry ``j`` is a
stage of ``j + 1`` layers; ``inf`` when that stage cannot exist, e.g. it does not fit in memory).
The search builds those rows from the per-stage DP (time) or from the least memory a stage can
have (memory), so the partition code never sees strategies.

BMW (balanced memory workload), our design, in three steps (docs/planner.md §5):

1. *Memory-aware time balance.* Each stage's time row already accounts for memory: the per-stage
   DP chooses recompute/ZeRO/TP for that stage's own budget and in-flight micro-batches, so a
   stage close to the memory limit is slower and an infeasible one is ``inf``. The exact
   min-max partition of those rows (:func:`min_max_partition`, ties broken by the sum) balances
   time subject to memory: the two objectives meet in one table.
2. Seeds: that partition, the even split and the memory-balanced split (the min-max partition of
   the stages' least memory). All three are scored with the full pipeline model.
3. *Local moves* (:func:`improve`): shift one stage boundary by one or two layers while the
   pipeline score improves. Starting from the best seed, the result can only get better, so BMW
   is never worse than the even or the memory-balanced split under the same cost model.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..plan import even_partition

Row = Callable[[int, int], np.ndarray]
Partition = tuple[int, ...]


def min_max_partition(num_layers: int, num_stages: int, row: Row, max_len: int,
                      row_depends_on_start: bool = True) -> Partition | None:
    """Partition minimising the largest stage value (ties: the smallest sum); None if every
    partition has an infinite stage.

    ``best[k][e]`` = (largest, sum) over stages ``0..k`` covering layers ``[0, e)``; stage ``k``
    of length ``j`` ending at ``e`` starts at ``e - j``. Vectorised over the start for each
    length, so one stage costs ``max_len`` numpy steps (plus ``num_layers`` row calls when the
    row depends on the start, e.g. several layer types).
    """
    if num_stages > num_layers:
        return None
    inf = np.inf
    width = max_len

    def table(k: int) -> np.ndarray:  # (start, length-1) -> value
        out = np.full((num_layers, width), inf)
        if row_depends_on_start:
            for a in range(num_layers):
                vals = np.asarray(row(k, a), dtype=float)[:width]
                out[a, :len(vals)] = vals
        else:
            vals = np.asarray(row(k, 0), dtype=float)[:width]
            out[:, :len(vals)] = vals[None, :]
        return out

    best_max = np.full(num_layers + 1, inf)
    best_sum = np.full(num_layers + 1, inf)
    vals = table(0)[0]
    ends = np.arange(1, width + 1)
    keep = ends <= num_layers
    best_max[ends[keep]] = vals[keep]
    best_sum[ends[keep]] = vals[keep]
    back: list[np.ndarray] = [np.zeros(num_layers + 1, dtype=np.int64)]
    starts = np.arange(num_layers + 1)
    for k in range(1, num_stages):
        t = table(k)
        new_max = np.full(num_layers + 1, inf)
        new_sum = np.full(num_layers + 1, inf)
        arg = np.full(num_layers + 1, -1, dtype=np.int64)
        remaining = num_stages - 1 - k  # later stages need a layer each
        for j in range(width):
            a = starts[k:max(k, num_layers - remaining - j)]  # stage covers [a, a + j + 1)
            if len(a) == 0:
                continue
            e = a + j + 1
            cand_max = np.maximum(best_max[a], t[a, j])
            cand_sum = best_sum[a] + t[a, j]
            cur_max, cur_sum = new_max[e], new_sum[e]
            better = (cand_max < cur_max) | ((cand_max == cur_max) & (cand_sum < cur_sum))
            new_max[e] = np.where(better, cand_max, cur_max)
            new_sum[e] = np.where(better, cand_sum, cur_sum)
            arg[e] = np.where(better, a, arg[e])
        best_max, best_sum = new_max, new_sum
        back.append(arg)
    if not np.isfinite(best_max[num_layers]):
        return None
    bounds = [num_layers]
    end = num_layers
    for k in range(num_stages - 1, 0, -1):
        end = int(back[k][end])
        bounds.append(end)
    bounds.append(0)
    bounds.reverse()
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def even(num_layers: int, num_stages: int) -> Partition:
    """Counts differing by at most one (the plan module's rule: extra layers on early stages)."""
    return even_partition(num_layers, num_stages)


def memory_balanced(num_layers: int, num_stages: int, memory_row: Row,
                    max_len: int, row_depends_on_start: bool = True) -> Partition | None:
    """The partition whose largest stage needs the least memory (``memory_row`` gives each
    stage's least memory). Exact, unlike a greedy fill."""
    return min_max_partition(num_layers, num_stages, memory_row, max_len, row_depends_on_start)


def improve(partition: Partition, score: Callable[[Partition], float],
            max_rounds: int = 50, steps: tuple[int, ...] = (1, 2)) -> tuple[Partition, float]:
    """Best-improvement local search over single boundary shifts; returns the partition and its
    score, never worse than the input's."""
    current = tuple(partition)
    current_score = score(current)
    for _ in range(max_rounds):
        best, best_score = current, current_score
        for j in range(len(current) - 1):
            for step in steps:
                for direction in (-1, 1):
                    moved = list(current)
                    moved[j] += direction * step
                    moved[j + 1] -= direction * step
                    if moved[j] < 1 or moved[j + 1] < 1:
                        continue
                    cand = tuple(moved)
                    s = score(cand)
                    if s < best_score:
                        best, best_score = cand, s
        if best == current:
            break
        current, current_score = best, best_score
    return current, current_score


def choose_partition(num_layers: int, num_stages: int, time_row: Row, memory_row: Row,
                     score: Callable[[Partition], float], max_len: int, allowed: tuple[str, ...],
                     polish: bool, memory_seed: Partition | None | str = "compute",
                     row_depends_on_start: bool = True
                     ) -> dict[str, tuple[Partition | None, float]]:
    """Score the allowed partition kinds (``even``, ``memory``, ``bmw``) and return
    ``{kind: (partition, score)}``. ``bmw`` is the best seed (all three) improved by local moves
    when ``polish`` (the search polishes only its leading candidates, for speed).
    ``memory_seed`` passes an already computed memory-balanced partition."""
    out: dict[str, tuple[Partition | None, float]] = {}
    seeds: dict[str, Partition | None] = {}
    if "even" in allowed or "bmw" in allowed:
        seeds["even"] = even(num_layers, num_stages)
    if "memory" in allowed or "bmw" in allowed:
        seeds["memory"] = (memory_balanced(num_layers, num_stages, memory_row, max_len,
                                           row_depends_on_start)
                           if memory_seed == "compute" else memory_seed)
    scored = {k: (p, score(p) if p is not None else np.inf) for k, p in seeds.items()}
    for kind in ("even", "memory"):
        if kind in allowed:
            out[kind] = scored[kind]
    if "bmw" in allowed:
        balanced = min_max_partition(num_layers, num_stages, time_row, max_len,
                                     row_depends_on_start)
        if balanced is not None:
            scored["time"] = (balanced, score(balanced))
        start, start_score = min(scored.values(), key=lambda x: x[1])
        if start is not None and polish and np.isfinite(start_score):
            start, start_score = improve(start, score)
        out["bmw"] = (start, start_score)
    return out
