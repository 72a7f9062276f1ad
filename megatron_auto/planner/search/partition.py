"""Pipeline partitions: even, memory-balanced, time-balanced, and the paper's BMW moves.

The exact search (``exact.py``) considers every partition, so none of these decides the answer;
they are the partitions other planners would pick, priced for comparison (``plan.search``
``partitions``, ``explain``, the benchmark). Every function works on *stage rows*:
``row(k, start)`` returns, for stage position ``k`` starting at layer ``start``, an array over
lengths ``1..max_len`` (``inf`` where the stage cannot exist).

- even: counts differing by at most one (Galvatron's ``pp_division_even``).
- memory-balanced: the exact min-max partition of the stages' least memory.
- time-balanced: the exact min-max partition of the stages' least time per micro-batch.
- BMW as a published summary of the Galvatron-BMW paper describes it (the paper's own text was
  not available to us): start from the memory-balanced partition and move a boundary layer off
  the slowest stage to a neighbour while the largest stage time does not grow and the largest
  stage memory stays at most that of the time-balanced partition and within the budget
  (:func:`bmw_paper`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ...plan import even_partition

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


def _stage_values(partition: Partition, row: Row) -> list[float]:
    out, start = [], 0
    for k, length in enumerate(partition):
        out.append(float(np.asarray(row(k, start))[length - 1]))
        start += length
    return out


def bmw_paper(num_layers: int, num_stages: int, time_row: Row, memory_row: Row, max_len: int,
              budget: float, row_depends_on_start: bool = True) -> Partition | None:
    """The paper's bi-objective partition as summarised in the module docstring.

    Memory cap: the time-balanced partition's largest stage memory, and the budget. A move takes
    one layer from the slowest stage (its first to the previous stage, or its last to the next)
    and is kept when the largest stage time does not grow and every stage stays under the cap;
    the first such move (earlier neighbour first) is taken, and the walk stops when no move is
    accepted or the slowest stage did not get faster (so it ends: the pair (largest time,
    slowest stage's time) decreases lexicographically at every step).
    """
    start = memory_balanced(num_layers, num_stages, memory_row, max_len, row_depends_on_start)
    timed = min_max_partition(num_layers, num_stages, time_row, max_len, row_depends_on_start)
    if start is None:
        return None
    cap = budget
    if timed is not None:
        cap = min(cap, max(_stage_values(timed, memory_row)))
    current = start
    for _ in range(num_layers * num_stages):
        times = _stage_values(current, time_row)
        slowest = int(np.argmax(times))
        moved = None
        for neighbour in (slowest - 1, slowest + 1):
            if not 0 <= neighbour < num_stages or current[slowest] <= 1:
                continue
            cand = list(current)
            cand[slowest] -= 1
            cand[neighbour] += 1
            if max(cand) > max_len:
                continue
            cand_t = _stage_values(tuple(cand), time_row)
            if max(cand_t) > max(times) or cand_t[slowest] >= times[slowest]:
                continue
            if max(_stage_values(tuple(cand), memory_row)) > cap:
                continue
            moved = tuple(cand)
            break
        if moved is None:
            break
        current = moved
    return current
