"""The bottleneck bound: the pipeline's sum and its largest stage bounded together (Alpa).

A non-interleaved pipeline's iteration time is at least ``sum_k C_k + (m - 1) max_k C_k``
(``cost_time.pipeline_time``; tails, step and overhead only add). Bounding the sum and the
maximum each over its own best partition (the older bound) lets two different partitions
stand for one plan; this module bounds them over the *same* partition, by enumerating the
bottleneck value (Alpa, OSDI 2022, §5.2; docs/planner.md §4).

For the stages ``k..pp-1`` over layers ``[a, L)`` and a grid ``g_0 < ... < g_{N-1}`` of
bottleneck values, ``S[j, k, a]`` is the least ``sum`` of the stages' time rows (``row(k, a)[l
- 1]``: a lower bound on the time per micro-batch of stage ``k`` holding layers ``[a, a + l)``)
over the partitions whose every row is at most ``g_j`` (a DP over stages). A partition whose
largest row lies in ``(g_{j-1}, g_j]`` has sum at least ``S[j]`` and maximum above ``lo_j``
(``lo_j = g_j`` when the grid holds every row value, ``g_{j-1}`` when it is a subsample), so
for any ``x`` (the largest stage time of the stages already placed):

    min over partitions of  sum + (m - 1) max(x, max row)
        >=  G(x) = min_j  S[j] + (m - 1) max(x, lo_j)

and every plan of the suffix is at least its rows (``Task.time_row``: a relaxation). ``G`` is
what ``exact.TaskSearch`` adds to the exact share of the stages placed so far; the tests
compare it with enumeration of every partition on small row tables.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

INF = math.inf
# Above this many distinct row values the grid is a subsample (quantiles): S is then taken
# at the grid point above a partition's maximum and the maximum at the one below (weaker,
# still a bound); DP work grows with the grid.
MAX_GRID = 512

Row = Callable[[int, int], np.ndarray]  # (stage position k, start a) -> row over lengths


class Bottleneck:
    """``G`` tables of one task's suffixes (module docstring).

    ``row(k, a)``: lower bounds on stage ``k``'s time per micro-batch holding ``l`` layers from
    ``a``, over ``l = 1..max_len`` (inf where nothing fits); only stage positions ``first..``
    are tabled. ``single``: rows do not depend on ``a`` (one layer type). ``steady``: the
    factor of the maximum (``m - 1``).
    """

    def __init__(self, row: Row, pp: int, num_layers: int, max_len: int, single: bool,
                 steady: float, first: int = 1, grid_limit: int = MAX_GRID) -> None:
        self.pp, self.L, self.max_len, self.steady = pp, num_layers, max_len, float(steady)
        self.first = first
        L = num_layers
        rows: dict[int, np.ndarray] = {}  # k -> (starts, lengths) with inf outside
        for k in range(first, pp):
            r = np.full((L + 1, max_len), INF)
            starts = np.arange(k, L - (pp - 1 - k))
            if len(starts):
                r[starts] = (np.broadcast_to(row(k, 0), (len(starts), max_len)) if single
                             else np.stack([row(k, int(a)) for a in starts]))
                ends = starts[:, None] + np.arange(1, max_len + 1)[None, :]
                r[starts] = np.where(ends <= L - (pp - 1 - k), r[starts], INF)
            rows[k] = r
        values = np.unique(np.concatenate([r[np.isfinite(r)] for r in rows.values()]
                                          + [np.zeros(0)]))
        if len(values) > grid_limit:
            picks = np.unique(np.round(np.linspace(0, len(values) - 1, grid_limit)).astype(int))
            grid = values[picks]
            lo = np.concatenate([[0.0], grid[:-1]])  # the maximum lies above the point below
        else:
            grid = values
            lo = grid.copy()  # the maximum is a row value: exactly a grid point
        self.grid, self.lo = grid, lo
        n = len(grid)
        # S[j, k, a] for k in first..pp (k == pp: the empty suffix, 0 at a == L)
        S = np.full((n, pp + 1 - first, L + 1), INF)
        S[:, pp - first, L] = 0.0
        lengths = np.arange(1, max_len + 1)
        for k in range(pp - 1, first - 1, -1):
            r = rows[k]                                            # (a, l)
            ends = np.minimum(np.arange(L + 1)[:, None] + lengths[None, :], L)
            nxt = S[:, k + 1 - first][:, ends]                      # (j, a, l)
            cand = np.where(r[None, :, :] <= grid[:, None, None], r[None, :, :] + nxt, INF)
            S[:, k - first] = cand.min(axis=2)
        self.S = S
        # V[j] = S[j] + steady * lo_j and its suffix minimum over j (the j with lo_j > x)
        V = S + self.steady * lo[:, None, None]
        self.R = np.minimum.accumulate(V[::-1], axis=0)[::-1]     # R[j] = min_{j' >= j} V

    def g(self, k: int, a: np.ndarray | int, x: np.ndarray | float) -> np.ndarray:
        """``G`` of the stages ``k..pp-1`` over layers from ``a`` (arrays broadcast), given the
        largest stage time ``x`` of the stages before; ``k == pp``: ``steady * x`` at ``a ==
        L``. inf where no partition of the suffix exists."""
        a = np.asarray(a)
        x = np.asarray(x, dtype=float)
        a, x = np.broadcast_arrays(a, x)
        finite = np.isfinite(x)
        x = np.where(finite, x, 0.0)  # inf (nothing fits before): inf below, never 0 * inf
        idx = k - self.first
        n = len(self.grid)
        if n == 0:  # nothing finite: only the empty suffix
            out = np.where(a == self.L, self.steady * x, INF) if k == self.pp else \
                np.full(x.shape, INF)
            return np.where(finite, out, INF)
        # j*: the last grid cell whose lo is at most x (its S holds with max(x, lo) = x)
        j_star = np.searchsorted(self.lo, x, side="right") - 1
        s_at = np.where(j_star >= 0, self.S[np.clip(j_star, 0, n - 1), idx, a], INF)
        if k == self.pp:
            s_at = np.where(a == self.L, 0.0, INF)
        first = s_at + self.steady * x
        nxt = j_star + 1
        rest = np.where(nxt < n, self.R[np.clip(nxt, 0, n - 1), idx, a], INF)
        return np.where(finite, np.minimum(first, rest), INF)
