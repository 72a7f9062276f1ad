"""The partition bound: every ``J_b`` of one partition at once.

``Task.future(b)`` gives each bound ``J_b`` (tasks module) its own least partition, and the root
bound is the largest of those minima. But a plan has one partition: for every plan with chunk
lengths ``l_0 .. l_{c-1}`` (starts ``a_k``) the iteration time is at least ``max_b sum_k
R_{k,b}(a_k, l_k) + overhead``, ``R`` the stage rows ``Task.stage_bound`` (each a lower bound on
that chunk's share of ``J_b`` at that start and length). So

    min over partitions of  max_b  sum_k R_{k,b}(a_k, l_k)

is a lower bound too, and never below ``max_b min_P`` (a min of maxima is at least the maximum
of minima). It is much stronger where each ``J_b`` alone can put few layers on its own stage
and pile the rest, at weight 1, on the others: a long pipeline with many micro-batches, or a
per-stage offload task (``mixed_offload``) whose stage ``b`` takes its cheapest variant in
``J_b`` and a different one in every other bound.

It is found by a small branch and bound over the partitions (chunk lengths in order, each
stage's candidates sorted by ``max_b (placed + R + future_b)``, cut once that reaches the least
found or the ``cutoff``), which stops after ``NODE_LIMIT`` nodes and then claims nothing.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np


INF = math.inf


class Task(Protocol):
    """What the bound reads of a ``tasks.Task`` (which imports this module)."""

    num_layers: int
    chunks: int
    max_len: int
    spec: Any
    branches: list[int]

    def future(self, b: int) -> np.ndarray: ...

    def stage_bound(self, k: int, start: int, b: int) -> np.ndarray: ...

#: Partition nodes the bound may visit before it gives up (0 returned: no claim).
NODE_LIMIT = 4000
#: False: the root bound goes without it, as before (benchmarks/bench_partition_bound.py
#: measures both in one run).
ENABLED = True


class _GiveUp(Exception):
    pass


def partition_bound(task: Task, cutoff: float, k0: int = 0, a0: int = 0,
                    placed: np.ndarray | None = None, node_limit: int | None = None) -> float:
    """A lower bound on ``max_b J_b - overhead`` of every plan of ``task`` (module docstring):
    the least over partitions where it is below ``cutoff``, else ``cutoff`` (every partition
    reaches it), 0.0 where the node limit stopped it, inf where no partition fits. From chunk
    position ``k0`` at layer ``a0`` with ``placed`` (per ``J_b``, the earlier chunks' exact
    share): the plans below a node of the exact search."""
    L, chunks, max_len = task.num_layers, task.chunks, task.max_len
    single = len(task.spec.layer_types) == 1
    futures = np.stack([task.future(b) for b in task.branches])  # (b, chunk, start)
    rows: dict[tuple[int, int], np.ndarray] = {}
    best = cutoff
    nodes = 0
    limit = NODE_LIMIT if node_limit is None else node_limit

    def row(k: int, a: int) -> np.ndarray:  # (b, length)
        key = (k, 0 if single else a)
        if key not in rows:
            rows[key] = np.stack([task.stage_bound(k, key[1], b) for b in task.branches])
        return rows[key]

    def walk(k: int, a: int, acc: np.ndarray) -> None:
        nonlocal best, nodes
        nodes += 1
        if nodes > limit:
            raise _GiveUp
        if k == chunks - 1:
            if L - a <= max_len:
                best = min(best, float((acc + row(k, a)[:, L - a - 1]).max()))
            return
        longest = min(L - a - (chunks - 1 - k), max_len)
        lens = np.arange(1, longest + 1)
        placed = acc[:, None] + row(k, a)[:, :longest]  # (b, length)
        bounds = (placed + futures[:, k + 1, a + lens]).max(axis=0)
        for i in np.argsort(bounds, kind="stable").tolist():
            if not bounds[i] < best:
                break
            walk(k + 1, a + int(lens[i]), placed[:, i])

    try:
        walk(k0, a0, np.zeros(len(task.branches)) if placed is None else placed)
    except _GiveUp:
        return 0.0
    return best


def min_plus(row, nxt: np.ndarray, k: int, num_layers: int, pp: int, max_len: int,
              single: bool, combine) -> np.ndarray:
    """``out[a] = min over lengths l of combine(row(a)[l - 1], nxt[a + l])`` for the starts
    ``a`` stage ``k`` may have (later stages need a layer each); inf elsewhere."""
    L = num_layers
    out = np.full(L + 1, INF)
    starts = np.arange(k, L - (pp - 1 - k))
    if len(starts) == 0:
        return out
    lengths = np.arange(1, max_len + 1)
    ends = starts[:, None] + lengths[None, :]                      # (a, l)
    longest = L - (pp - 1 - k)
    vals = np.stack([row(int(a)) for a in starts]) if not single else \
        np.broadcast_to(row(0), (len(starts), max_len))
    tail = np.where(ends <= longest, nxt[np.minimum(ends, L)], INF)
    out[starts] = combine(vals, tail).min(axis=1)
    return out


def futures(rows: Task, b: int, shared: np.ndarray | None = None,
            last: int | None = None) -> np.ndarray:
    """``F[k, a]``: the least share of ``J_b`` of chunk positions ``k..`` over layers
    ``[a, L)`` by ``rows.stage_bound``, every partition considered (a DP over positions).

    ``shared``, ``last``: the rows of ``J_b`` after position ``last`` are those of the bound
    ``shared`` is the future of, whose rows are reused from there (:func:`branch_future`)."""
    L, chunks = rows.num_layers, rows.chunks
    f = np.full((chunks + 1, L + 1), INF)
    f[chunks, L] = 0.0
    top = chunks - 1
    if shared is not None and last is not None:
        f[last + 1:] = shared[last + 1:]
        top = last
    single = len(rows.spec.layer_types) == 1
    for k in range(top, -1, -1):
        f[k] = min_plus(lambda a, k=k: rows.stage_bound(k, a, b), f[k + 1], k, L, chunks,
                        rows.max_len, single, np.add)
    return f


#: The bound of no stage's own (``Task.weights``: every stage weighed as another's): the
#: future that :func:`branch_future` shares between the ``J_b``.
NO_OWN_STAGE = -1


def branch_future(rows: Task, b: int, memo: dict[int, np.ndarray], pp: int,
                  owned: list[int]) -> np.ndarray:
    """``futures(rows, b)``, kept in ``memo``, for rows whose weights depend only on whether a
    position runs on stage ``b`` (``Task.weights``; the mean bound ``b == pp`` weighs every
    position alike). After the last position stage ``b`` owns (``owned[b]``) the rows of
    ``J_b`` are those of a bound with no own stage, so that DP is run once and its tail
    shared: ``pp`` bounds cost about half the DP steps of separate ones."""
    if b not in memo:
        if b >= pp:
            memo[b] = futures(rows, b)
        else:
            if NO_OWN_STAGE not in memo:
                memo[NO_OWN_STAGE] = futures(rows, NO_OWN_STAGE)
            memo[b] = futures(rows, b, memo[NO_OWN_STAGE], owned[b])
    return memo[b]
