"""The tied bound of interleaved tasks (``Task.tied_bound``): a stage's chunks share its memory.

Kept apart from tasks.py, whose chunk-level bounds it complements; it reads a task's tables and
weights only (``task`` is a ``tasks.Task``; not imported, tasks.py imports this).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from .partition_bound import futures

INF = np.inf


def tied_rest(task: Any, k: int, start: int, placed: list[tuple[Any, Any, Any]],
              acc: np.ndarray) -> np.ndarray:
    """Lower bound on the iteration time of every plan whose chunk positions before ``k``
    are placed (layers ``[0, start)``; ``placed[s]``: stage ``s``'s persistent bytes,
    largest transient and step-peak floor so far; ``acc[b]``: their exact share of each
    ``J_b``), for interleaved tasks of one layer type (``tied_applies``). Vectorised over
    candidates: any of ``placed``'s numbers may be an array over them, ``acc`` then
    ``(branch, candidate)``; the result has their shape (0-d for one).

    The chunk-level bound lets every chunk fill the device alone. Here a stage's chunks still to
    place are one block of ``n`` layers (at least one per chunk, the blocks summing to the
    layers left) under what is left of the stage's budget: its NCCL floor, what it placed, its
    chunks' embedding/head bytes (persistent and step floors summed, the largest transient),
    their received inputs' least bytes in the backward peak (``Task.hop_floor``) and,
    per layer, the bytes of a chunk's in-flight count: one layer at each chunk's count but the
    lowest, the others at the lowest (each chunk holds a layer, and a layer's bytes grow with
    the count, so every plan's layers cost at least this; the block's order is free, relayouts
    being left out). In ``J_b`` the chunks of a stage share their weights, so the block's
    weighted cost is the sum of its chunks'; relayouts are left out (chunk boundaries break the
    block's adjacency, and they only add); the chunks' embedding/head costs and incoming
    boundaries are added as ``stage_bound`` adds them. With one layer type which layers a block
    holds does not matter, only how many: a DP over the block sizes gives the least ``J_b``;
    the bound is the best ``b``."""
    L, pp = task.num_layers, task.pp
    acc = np.asarray(acc, dtype=float)
    width = acc.shape[1:]  # () or (candidates,)
    nc = int(np.prod(width)) if width else 1
    left = L - start
    own = [[c for c in range(k, task.chunks) if task.stage_of(c) == s] for s in range(pp)]
    need = [len(c) for c in own]
    span = left - sum(need) + max(need)  # the largest block a stage can hold
    if left < sum(need):
        return np.full(width, INF)
    lens = np.arange(span + 1)
    x = np.arange(left + 1)
    take = lens[None, :] <= x[:, None]  # (x, n): a block of n within x layers
    back = np.where(take, x[:, None] - lens[None, :], 0)
    best = np.full(nc, -INF)
    flat_acc = acc.reshape(len(task.branches), nc)
    for bi, b in enumerate(task.branches):
        nxt = np.full((left + 1, nc), INF)  # nxt[x]: least cost of the later stages on x
        nxt[0] = 0.0
        for s in range(pp - 1, -1, -1):
            if not own[s]:
                continue
            row = _block_row(task, own[s], b, placed[s], span, nc)
            row[:need[s]] = INF
            # cur[x] = min over n <= x of row[n] + nxt[x - n]
            cand = np.where(take[:, :, None], row[None, :, :] + nxt[back], INF)
            nxt = cand.min(axis=1)
        best = np.maximum(best, flat_acc[bi] + nxt[left])
    return (best + task.overhead).reshape(width)


def block_fixed(task: Any, chunks: list[int], w: Any) -> float:
    """The share of a ``J_b`` (weights ``w``) of one stage's chunk positions ``chunks`` that no
    layer choice changes: each chunk's embedding / head terms, and the least incoming boundary
    of every chunk but the model's first, chunk 0 (a stage block's rows in ``_block_row`` and
    ``lagrange_bound.TiedLagrangeRows`` both start from it)."""
    return sum(w.alpha * (e.microbatch + (task.tables.min_boundary if c else 0.0))
               + w.beta * e.optimizer + w.gamma * e.exposed_sync
               for c, e in ((c, task.emb[c]) for c in chunks))


def _block_row(task: Any, chunks: list[int], b: int, placed: tuple[Any, Any, Any], span: int,
               nc: int) -> np.ndarray:
    """``row[n, candidate]``: the least share of ``J_b`` of one stage's chunk positions
    ``chunks`` holding a block of ``n`` layers (``0..span``; row 0 inf), given what the stage
    placed (``placed``: persistent bytes, largest transient, step-peak floor; numbers or arrays
    over ``nc`` candidates). See ``tied_rest``."""
    L, pp = task.num_layers, task.pp
    w = replace(task.weights(chunks[0], b), moves=False)
    embs = [task.emb[c] for c in chunks]
    fixed = block_fixed(task, chunks, w)
    persistent, transient, step = (np.broadcast_to(np.asarray(v, dtype=float), (nc,))
                                   for v in placed)
    room = task.room - task.nccl_floor[task.stage_of(chunks[0])]
    top = np.maximum(transient, max(e.transient for e in embs))
    lens = np.arange(span + 1)
    grid = np.ones((span, 1))
    row = np.full((span + 1, nc), INF)
    low = min(chunks, key=task.bound_in_flight)
    lead = tuple(sorted((task.bound_in_flight(c) for c in chunks if c != low), reverse=True))
    row[1:] = task.rest_bound(  # one table length for every node: L - pp + 1
        low, 0, w, np.broadcast_to(lens[1:, None], (span, nc)),
        grid * (room - persistent - sum(e.persistent for e in embs)
                - sum(task.hop_floor[c] for c in chunks) - top),
        grid * (room - step - sum(e.step_floor for e in embs)), grid * top,
        L - pp + 1, lead) + fixed
    return row


class TiedRows:
    """The stages of an interleaved task as ``partition_bound`` reads chunk positions: position
    ``s`` is stage ``s``'s block of layers (all its chunks), its row ``_block_row`` at the
    root (nothing placed; inf below one layer per chunk). Every plan's stage ``s`` holds some
    ``n_s`` layers, and its share of each ``J_b`` is at least the row at ``n_s``, so the least
    over the block sizes of ``max_b`` of the rows' sums bounds every plan, where the tied bound
    (``tied_rest``) lets each ``J_b`` choose its own sizes."""

    def __init__(self, task: Any) -> None:
        self.task = task
        self.num_layers, self.chunks = task.num_layers, task.pp
        self.max_len = task.num_layers - task.pp + 1
        self.spec, self.branches = task.spec, task.branches
        self.own = [[c for c in range(task.chunks) if task.stage_of(c) == s]
                    for s in range(task.pp)]
        self._rows: dict[tuple[int, int], np.ndarray] = {}
        self._future: dict[int, np.ndarray] = {}

    def stage_bound(self, k: int, start: int, b: int) -> np.ndarray:
        if (k, b) not in self._rows:
            row = _block_row(self.task, self.own[k], b, (0.0, 0.0, 0.0), self.max_len, 1)[:, 0]
            row[:len(self.own[k])] = INF
            self._rows[k, b] = row[1:]
        return self._rows[k, b]

    def future(self, b: int) -> np.ndarray:
        if b not in self._future:  # one layer type (tied_applies): rows ignore the start
            self._future[b] = futures(self, b)
        return self._future[b]
