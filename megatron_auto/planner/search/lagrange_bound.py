"""The Lagrangian root bound: memory priced by a multiplier instead of a DP over bytes.

The root bound of a task (``Task.root_bound``) solves a DP over memory cells for every stage
position (``Task.rest``): exact up to the cell rounding, and the slow part of settling a task
(about half a CPU second per layer table on LLaMA-7B). Most tasks are settled by that bound
alone, far above the incumbent. This module gives a much cheaper bound to try first.

For one stage position ``k`` and bound ``J_b`` (tasks module), a plan's stage holds layers
``i`` with strategies ``s_i`` whose weighted times ``t_i`` (``alpha`` per micro-batch, ``beta``
optimizer, ``gamma`` sync tail) sum to its share of ``J_b``, and whose persistent bytes ``p_i``
and step-peak floors ``q_i`` satisfy ``sum p_i <= R_p`` and ``sum q_i <= R_q`` (the rooms the
DP rows use: ``room`` less the NCCL floor, the embedding/head's bytes and the stage's least
transient). For any ``lam, mu >= 0`` (weak duality)

    sum_i t_i >= sum_i (t_i + lam p_i + mu q_i) - lam R_p - mu R_q
              >= sum_i min_s (t_s + lam p_s + mu q_s) - lam R_p - mu R_q,

so the largest of these over a grid of multipliers is a lower bound on the stage's share (a
row per length, like ``Task.stage_bound``), and a length whose least bytes alone pass a room
is infeasible (inf). The rows need no DP: one prefix sum per multiplier over the layer order.
:class:`LagrangeRows` has the rows and their futures, so ``partition_bound`` (every ``J_b`` of
one partition at once) runs on them unchanged; ``lagrange_root`` is that bound plus the fixed
step overhead. With identical layers the relaxation loses at most about one layer's trade-off
step against the DP (a few per cent, measured on LLaMA-7B), so it settles the tasks whose DP
bound clears the incumbent by more than that, and leaves the others to the DP.

Interleaved tasks of one layer type (:class:`TiedLagrangeRows`, ``tied_lagrange_root``): a
stage's chunks share its room, as in the tied bound (``tied.tied_rest``): position ``s`` is
stage ``s``'s block of ``n`` layers, one at each of its chunks' in-flight counts but the lowest
and the others at the lowest (a layer's bytes grow with the count, and every chunk holds a
layer), so the block's Lagrangian value is ``sum_lead h_c + (n - v + 1) h_low - lam R``, ``h_c``
the least priced strategy at count ``c``. That leaves a stage free to pile its layers on its
chunk of the fewest micro-batches in flight while the fill, ``sum_k max_j c_{k,j}`` in the
interleaved formula, is priced as ``C_k / v``: so each row is the least, over the size ``D`` of
the stage's longest chunk ``j``, of the larger of that value with at most ``D`` layers a chunk
and the value with chunk ``j``'s layers at the weight less the fill's share plus one
(``TiedLagrangeRows.stage_bound``; ``FILL``). With few micro-batches the fill is a large part of
the iteration: LLaMA-7B on 8 GPUs at 36 GB, pp 2, v 4, m 8, the task's bound rose from 5.18 to
5.53 s against a best plan of 5.71 s found by its seeds. The
partition bound over the blocks then needs no DP table; where it reaches the incumbent, the
tied bound's tables are never built. The blocks' room also loses the least bytes of their
chunks' received inputs (``Task.hop_floor``). (Giving each
chunk the stage's whole room instead, as the chunk-level rows do, is too weak to pay for its
partition search over ``pp v`` chunks: measured 38 ms a task, none settled on LLaMA-7B at 24 GB.)
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from . import partition_bound as partition_bounds
from .tied import block_fixed


class Task(Protocol):
    """What the bound reads of a ``tasks.Task`` (which imports this module)."""

    spec: Any
    tables: Any
    num_layers: int
    chunks: int
    max_len: int
    m: int
    pp: int
    room: float
    overhead: float
    branches: list[int]

    @property
    def in_flight(self) -> list[int]: ...

    @property
    def emb(self) -> list[Any]: ...

    @property
    def nccl_floor(self) -> list[float]: ...

    @property
    def hop_floor(self) -> list[float]: ...

    def weights(self, k: int, b: int) -> Any: ...

    def stage_of(self, k: int) -> int: ...

INF = math.inf
#: Multipliers per memory axis (seconds per byte, geometric between the strategies' least and
#: largest trade-off slopes, and 0).
GRID = 48
#: False: ``Task.root_bound`` goes without it (the DP bound alone, as before).
ENABLED = True
#: Partition nodes its partition bound may visit before it claims only the ``J_b`` minima: a
#: pre-filter must stay cheap (BERT-Large's whole search is a few tenths of a second, and
#: GPT-3's 16-64-stage tasks would spend the time limit here).
NODE_LIMIT = 300
#: Stage rows (positions x bounds ``J_b``) above which a task goes without it: each row prices
#: every strategy at every multiplier, and a 64-stage pipeline has 4,160 of them (GPT-3 175B
#: on 1,024 GPUs: the time limit went to these rows and the answer was 8 % slower).
MAX_ROWS = 64
#: Stages above which an interleaved task goes without its stage-block rows
#: (:class:`TiedLagrangeRows`). A stage has at most three distinct rows (its own bound, another
#: stage's, the mean one), so 32 stages price 96 rows and 33 bounds share one DP tail
#: (``partition_bound.branch_future``): 0.07 CPU s on GPT-3 175B's 32-stage tasks, which
#: without it kept their compute bounds, 18-27 % below these (8 to 32 stages).
TIED_MAX_STAGES = 32
#: False: the stage-block rows leave the fill out (each stage's fill priced as ``C_k / v``, as
#: the chunk-level rows do), as before; tests compare both.
FILL = True
#: Block lengths up to which the fill term prices every longest-chunk size (above, cells).
FILL_EXACT_MAX_LEN = 48


def multipliers(task: Task) -> np.ndarray:
    """The grid of one memory axis: 0 and ``GRID`` points spanning every pairwise slope
    (time saved per byte added) of the task's strategies at weights 1 and ``m``."""
    slopes: list[float] = []
    for k in range(task.chunks):
        for t in set(task.spec.layer_order):
            c = task.tables.costs(t, task.in_flight[k])
            time, mem = np.asarray(c.microbatch, float), np.asarray(c.persistent, float)
            dt = time[:, None] - time[None, :]
            dm = mem[None, :] - mem[:, None]
            ok = (dt > 0) & (dm > 0)
            if ok.any():
                s = dt[ok] / dm[ok]
                slopes += [float(s.min()), float(s.max()) * max(task.m, 1)]
    if not slopes:
        return np.zeros(1)
    return np.concatenate([[0.0], np.geomspace(min(slopes) / 4, max(slopes) * 4, GRID)])


class LagrangeRows:
    """Lagrangian stage rows of a task, read by ``partition_bound`` like the task's own."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.num_layers, self.chunks, self.max_len = task.num_layers, task.chunks, task.max_len
        self.spec, self.branches = task.spec, task.branches
        grid = multipliers(task)
        zeros = np.zeros(len(grid))
        # (lam, mu) pairs: each axis alone (the step peak rarely binds with the backward one)
        self.lam = np.concatenate([grid, zeros])
        self.mu = np.concatenate([zeros, grid])
        self._rows: dict[tuple[int, int, Any], np.ndarray] = {}
        self._future: dict[int, np.ndarray] = {}
        self._least: dict[int, tuple[np.ndarray, np.ndarray, float]] = {}

    def _least_bytes(self, k: int) -> tuple[np.ndarray, np.ndarray, float]:
        """Prefix sums of the least persistent and step-floor bytes over the layer order, and
        the least transient of any layer, at position ``k``."""
        if k not in self._least:
            task = self.task
            costs = [task.tables.costs(t, task.in_flight[k]) for t in task.spec.layer_order]
            persistent = np.cumsum([float(c.persistent.min()) for c in costs])
            step = np.cumsum([float(c.step_floor.min()) for c in costs])
            transient = min(float(c.transient.min()) for c in costs)
            self._least[k] = (np.concatenate([[0.0], persistent]),
                              np.concatenate([[0.0], step]), transient)
        return self._least[k]

    def stage_bound(self, k: int, start: int, b: int) -> np.ndarray:
        """Lower bound on position ``k``'s share of ``J_b`` per length ``1..max_len`` from
        ``start`` (module docstring); inf where the least bytes do not fit."""
        single = len(self.spec.layer_types) == 1
        task = self.task
        w = task.weights(k, b)
        key = (k, 0 if single else start, w)  # the J_b that weigh position k alike share it
        if key in self._rows:
            return self._rows[key]
        start = key[1]
        e = task.emb[k]
        fixed = (w.alpha * (e.microbatch + (task.tables.min_boundary if k > 0 else 0.0))
                 + w.beta * e.optimizer + w.gamma * e.exposed_sync)
        least_p, least_q, transient = self._least_bytes(k)
        room = task.room - task.nccl_floor[task.stage_of(k)]
        room_p = room - e.persistent - max(e.transient, transient)
        room_q = room - e.step_floor
        per_type = {}
        for t in set(task.spec.layer_order):
            c = task.tables.costs(t, task.in_flight[k])
            time = w.alpha * c.microbatch + w.beta * c.optimizer + w.gamma * c.exposed_sync
            priced = (time[None, :] + self.lam[:, None] * c.persistent[None, :]
                      + self.mu[:, None] * c.step_floor[None, :])
            per_type[t] = priced.min(axis=1)
        cols = np.stack([per_type[t] for t in task.spec.layer_order], axis=1)
        prefix = np.concatenate([np.zeros((len(self.lam), 1)), np.cumsum(cols, axis=1)], axis=1)
        lengths = np.arange(1, self.max_len + 1)
        end = np.minimum(start + lengths, self.num_layers)
        relaxed = (prefix[:, end] - prefix[:, [start]]
                   - (self.lam * room_p + self.mu * room_q)[:, None]).max(axis=0) + fixed
        over = ((least_p[end] - least_p[start] > room_p) | (least_q[end] - least_q[start] > room_q)
                | (start + lengths > self.num_layers))
        self._rows[key] = np.where(over, INF, relaxed)
        return self._rows[key]

    def future(self, b: int) -> np.ndarray:
        """``F[k, a]``: the least share of ``J_b`` of positions ``k..`` over layers ``[a, L)``
        by these rows, every partition considered (``Task.future``'s DP)."""
        task = self.task
        owned = [self.chunks - task.pp + s for s in range(task.pp)]  # each stage's last chunk
        return partition_bounds.branch_future(self, b, self._future, task.pp, owned)


def lagrange_root(task: Task, cutoff: float = INF) -> float:
    """A lower bound on the iteration time of every plan of ``task`` from the Lagrangian rows:
    the largest ``J_b``'s least and, with more than one chunk, the partition bound over them
    (``cutoff`` where every partition reaches ``cutoff``); 0 where it does not apply."""
    if not ENABLED or not getattr(task, "lagrange_applies", True) \
            or task.chunks * len(task.branches) > MAX_ROWS:
        return 0.0
    rows = LagrangeRows(task)
    best = max(float(rows.future(b)[0, 0]) for b in rows.branches)
    if task.chunks > 1 and best + task.overhead < cutoff:
        best = max(best, partition_bounds.partition_bound(rows, cutoff - task.overhead,
                                                          node_limit=NODE_LIMIT))
    return best + task.overhead


class TiedLagrangeRows:
    """Lagrangian rows of an interleaved task's stage blocks (module docstring), read by
    ``partition_bound`` like ``tied.TiedRows``: position ``s`` is stage ``s``."""

    def __init__(self, task: Task, fill: bool = True,
                 like: TiedLagrangeRows | None = None) -> None:
        """``like``: rows of the same task whose multipliers and memory prices these share
        (the rows with and without the fill differ only in their rows)."""
        self.task, self.fill = task, fill
        self.num_layers, self.chunks = task.num_layers, task.pp
        self.max_len = task.num_layers - task.pp + 1
        self.spec, self.branches = task.spec, task.branches
        self.own = [[c for c in range(task.chunks) if task.stage_of(c) == s]
                    for s in range(task.pp)]
        self.lam: np.ndarray
        self.mu: np.ndarray
        self._priced: dict[int, np.ndarray]
        if like is not None:
            assert like.task is task
            self.lam, self.mu, self._priced = like.lam, like.mu, like._priced
        else:
            grid = multipliers(task)
            zeros = np.zeros(len(grid))
            self.lam = np.concatenate([grid, zeros])
            self.mu = np.concatenate([zeros, grid])
            self._priced = {}
        self._rows: dict[tuple[int, Any], np.ndarray] = {}
        self._future: dict[int, np.ndarray] = {}

    def stage_bound(self, k: int, start: int, b: int) -> np.ndarray:
        """Lower bound on stage ``k``'s share of ``J_b`` per block size ``1..max_len``.

        A plan's stage of ``n`` layers in ``v`` chunks, its longest chunk ``j`` of ``D``
        layers, has the share ``a C_k + F_k`` (plus its optimizer and sync terms), ``a`` the
        weight less the fill's ``1/v`` and ``F_k = max_i c_{k,i}`` its fill, which is at least
        ``C_k / v`` and at least chunk ``j``'s time. So the share is at least the larger of

        - the block's Lagrangian value at the full weight, its layers at the lowest counts a
          longest chunk of ``D`` allows (one per chunk, the others to the chunks of the fewest
          micro-batches in flight, ``D`` at most each: a layer's bytes grow with the count), and
        - the value with chunk ``j``'s ``D`` layers at weight ``a + 1`` and its count, the
          others at weight ``a``, spread as above over the other chunks (least over ``j``),

        and the row is the least over ``D``: uneven chunks pay in the fill for the memory they
        save. Every ``D`` is priced up to ``FILL_EXACT_MAX_LEN`` layers a block; longer blocks
        take geometric cells of ``D`` (``fill_cells``) and the second term weakened to the
        least time of ``lo`` layers (``fill`` off: the first term at any ``D`` alone)."""
        task, chunks = self.task, self.own[k]
        w = task.weights(chunks[0], b)  # a stage's chunks share their weights
        # keyed by the weights, not the branch: every J_b but a stage's own and the mean one
        # weighs it alike, so a stage has at most three rows (pp + 1 branches otherwise)
        if (k, w) in self._rows:
            return self._rows[k, w]
        t = task.spec.layer_order[0]
        v = len(chunks)
        order = sorted(chunks, key=lambda c: task.in_flight[c])  # chunks by count, ascending
        counts = [task.in_flight[c] for c in order]
        embs = [task.emb[c] for c in order]
        costs = {c: task.tables.costs(t, c) for c in set(counts)}

        def priced(alpha: float) -> np.ndarray:  # (multipliers, chunks): least priced strategy
            def one(c: int) -> np.ndarray:
                y = costs[c]
                time = alpha * y.microbatch + w.beta * y.optimizer + w.gamma * y.exposed_sync
                return (time[None, :] + self._memory_price(c, y)).min(axis=1)
            return np.stack([one(c) for c in counts], axis=1)

        room = task.room - task.nccl_floor[k]
        transient = max(max(e.transient for e in embs),
                        min(float(x.transient.min()) for x in costs.values()))
        room_p = room - sum(e.persistent for e in embs) - transient \
            - sum(task.hop_floor[c] for c in chunks)  # the chunks' received inputs
        room_q = room - sum(e.step_floor for e in embs)
        least = np.array([[float(costs[c].persistent.min()) for c in counts],
                          [float(costs[c].step_floor.min()) for c in counts]])  # (2, v)
        shared = (self.lam * room_p + self.mu * room_q)[:, None, None]
        n = np.arange(1, self.max_len + 1)[:, None]

        def value(h: np.ndarray, x: np.ndarray, ok: np.ndarray) -> np.ndarray:
            """Largest Lagrangian value over the multipliers of the splits ``x`` (chunks
            first, by count) priced ``h``; inf where no split or its least bytes do not fit."""
            got = (np.tensordot(h, x, axes=(1, 0)) - shared).max(axis=0)
            lp, lq = np.tensordot(least, x, axes=(1, 0))
            return np.where(ok & (lp <= room_p) & (lq <= room_q), got, INF)

        exact = self.fill and self.max_len <= FILL_EXACT_MAX_LEN
        if not self.fill:
            lo = hi = np.array([self.max_len])
        elif exact:
            lo = hi = np.arange(1, self.max_len + 1)
        else:
            lo, hi = fill_cells(self.max_len)
        cap = hi[None, :] + 0 * n
        total = n + 0 * cap
        row = value(priced(w.alpha), *split_counts(v, total, cap)) + block_fixed(task, chunks, w)
        if self.fill:
            a = max(w.alpha - 1.0 / v, 0.0)
            rest = block_fixed(task, chunks, replace(w, alpha=a))
            if exact:  # chunk j holds exactly D = cap layers, the others at most D
                h_rest, h_long = priced(a), priced(a + 1.0)
                fill = np.full(row.shape, INF)
                for j in range(v):
                    others = [i for i in range(v) if i != j]
                    x_o, ok = split_counts(v - 1, total - cap, cap)
                    x = np.zeros((v,) + x_o.shape[1:])
                    x[others], x[j] = x_o, cap
                    h = np.where(np.arange(v) == j, h_long, h_rest)
                    own = embs[j].microbatch + (task.tables.min_boundary if order[j] else 0.0)
                    fill = np.minimum(fill, value(h, x, ok & (cap <= total)) + own)
                fill += rest
            else:  # the longest chunk: at least lo layers at the least time a layer has
                t_min = min(float(y.microbatch.min()) for y in costs.values())
                own = min(e.microbatch + (task.tables.min_boundary if c else 0.0)
                          for c, e in zip(order, embs))
                longest = np.maximum(lo[None, :], -(-n // v))  # at least ceil(n / v)
                fill = value(priced(a), *split_counts(v, total, cap)) + rest \
                    + longest * t_min + own
            row = np.maximum(row, fill)
        self._rows[k, w] = row.min(axis=1)
        return self._rows[k, w]

    def _memory_price(self, count: int, costs: Any) -> np.ndarray:
        """``lam p + mu q`` of every strategy at ``count`` per multiplier pair (shared by the
        rows of every weights)."""
        if count not in self._priced:
            self._priced[count] = (self.lam[:, None] * costs.persistent[None, :]
                                   + self.mu[:, None] * costs.step_floor[None, :])
        return self._priced[count]

    def future(self, b: int) -> np.ndarray:
        # one layer type: the rows ignore the start; position s is stage s
        return partition_bounds.branch_future(self, b, self._future, self.task.pp,
                                              list(range(self.task.pp)))


def tied_lagrange_root(task: Task, cutoff: float = INF) -> float:
    """A lower bound on the iteration time of every plan of an interleaved task of one layer
    type from :class:`TiedLagrangeRows` (``cutoff`` where every choice of block sizes reaches
    it); 0 where off. The rows without the fill term first: they cost a few times less and
    settle most tasks (BERT-Large, GPT-1.5B) alone; the fill term only where they do not."""
    if not ENABLED or task.pp > TIED_MAX_STAGES:
        return 0.0
    plain = TiedLagrangeRows(task, fill=False)
    best = _tied_root(plain, cutoff)
    if FILL and best < cutoff:
        best = max(best, _tied_root(TiedLagrangeRows(task, fill=True, like=plain), cutoff))
    return best


def _tied_root(rows: TiedLagrangeRows, cutoff: float) -> float:
    task = rows.task
    best = max(float(rows.future(b)[0, 0]) for b in rows.branches)
    if best + task.overhead < cutoff:
        best = max(best, partition_bounds.partition_bound(rows, cutoff - task.overhead,
                                                          node_limit=NODE_LIMIT))
    return best + task.overhead


def fill_cells(max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cells ``[lo, hi]`` covering the longest-chunk sizes ``1..max_len`` of
    ``TiedLagrangeRows.stage_bound``: one each up to 4, then doubling (few cells: each prices
    the block once more)."""
    edges = [1, 2, 3, 4]
    while edges[-1] < max_len:
        edges.append(min(edges[-1] * 2, max_len))
    lo = np.array([1] + [e + 1 for e in edges[:-1]])
    return lo, np.array(edges)


def split_counts(k: int, total: np.ndarray, cap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(x, ok)``: ``x[j, ...]`` the layers of the ``j``-th of ``k`` chunks (by in-flight
    count, ascending) when ``total`` layers fill them, each at least one and at most ``cap``
    (arrays of one shape), the extra ones on the lowest counts first; ``ok`` where such a split
    exists (elsewhere ``x`` is meaningless)."""
    extra = (total - k).clip(min=0)
    room = (cap - 1).clip(min=0)
    j = np.arange(k).reshape((k,) + (1,) * np.ndim(total))
    x = 1 + np.minimum((extra[None] - j * room[None]).clip(min=0), room[None])
    return x.astype(float), (total >= k) & (extra <= k * room)
