"""Per-stage dynamic programming: the best strategy for every layer of a stage under a memory cap.

Named axes: ``l`` layer of the stage (prefix length ``l + 1``), ``v`` memory in cells (a cell is
``memory_step_bytes``; every cost is rounded UP to cells and the budget DOWN, so a plan the DP
accepts never exceeds the budget in bytes), ``s`` strategy of a layer, ``c`` layout class
(transition costs depend only on the classes of two adjacent layers).

Recurrence (``f_l[v, s]`` = least objective of layers ``0..l`` using at most ``v`` cells with layer
``l`` on strategy ``s``)::

    f_0[v, s] = cost_0[s]                                            if v >= mem_0[s]
    H_l[u, c] = min_{s'} f_{l-1}[u, s'] + T[class(s'), c]            (best predecessor into class c)
    f_l[v, s] = H_l[v - mem_l[s], class(s)] + cost_l[s]               if v >= mem_l[s], else +inf

``min_{s'}`` is taken in two steps, first within each class and then over classes, so one layer
costs O(V * (S + C^2)) numpy work instead of O(V * S^2). Every array op runs over the whole memory
axis at once (no Python loop over ``v``). The DP is exact for its discretised costs: the tests
compare it with brute force.

One run answers every prefix length and every budget up to ``max_cells`` (``f`` is
non-increasing in ``v``), which the search uses to price stages of any length and position with
one DP per (layer-type sequence, micro-batches in flight, transient level).

Where memory does not bind, the memory axis is cut short (exactly): a DP without memory first
finds, for every prefix, an optimal path and its cells ``W_l``; ``best[l, v]`` is that optimum
for every ``v >= W_l``, so the DP runs over ``0..max_l W_l`` cells only and the columns beyond
repeat its last one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

INF = np.inf
# float64: the search uses the tables as lower bounds, which float32 rounding could push above
# the value they bound.
DTYPE = np.float64


@dataclass(frozen=True)
class LayerOptions:
    """The candidate strategies of one layer position, as arrays over ``s``.

    ``mem`` cells (int), ``cost`` the objective to minimise, ``aux`` values carried along the
    optimal path (summed, e.g. the sync tail; shape ``(S, K)``; ``K = 0`` skips the bookkeeping),
    ``cls`` class index into the transition matrix.
    """

    mem: np.ndarray
    cost: np.ndarray
    aux: np.ndarray
    cls: np.ndarray
    # Derived in __post_init__: the strategies of each class, and the classes in that order.
    groups: list[tuple[int, np.ndarray]] = field(init=False, repr=False, compare=False)
    class_list: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        s = len(self.mem)
        if not (len(self.cost) == len(self.cls) == self.aux.shape[0] == s):
            raise ValueError("LayerOptions arrays must all have one entry per strategy")
        if s == 0:
            raise ValueError("LayerOptions needs at least one strategy")
        if (np.asarray(self.mem) < 0).any():
            raise ValueError("LayerOptions.mem must be >= 0 cells")
        object.__setattr__(self, "groups", _class_groups(np.asarray(self.cls)))
        object.__setattr__(self, "class_list", np.array([c for c, _ in self.groups]))


@dataclass
class StageTables:
    """Results of one DP run for every prefix of the layer sequence and every cap ``v``.

    ``best[l, v]``: least objective for the first ``l+1`` layers within ``v`` cells (inf when
    infeasible); ``best_aux[l, v]``: the aux sums along that optimum; ``best_s[l, v]``: the last
    layer's strategy; ``pred[l]``: for ``l >= 1``, the best predecessor strategy per (class,
    cells left), used by :meth:`choices`.
    """

    layers: Sequence[LayerOptions]
    best: np.ndarray
    best_aux: np.ndarray
    best_s: np.ndarray
    pred: list[np.ndarray]
    # Cells the DP ran over (the columns of ``pred``); ``best`` repeats its last column beyond.
    solved_cells: int | None = None

    @property
    def max_cells(self) -> int:
        return self.best.shape[1] - 1

    def value(self, num_layers: int, cells: int) -> tuple[float, np.ndarray]:
        """``(objective, aux)`` of the best plan for the first ``num_layers`` layers."""
        if cells < 0 or num_layers < 1:
            return INF, np.zeros(self.best_aux.shape[2])
        cells = min(cells, self.max_cells)
        return float(self.best[num_layers - 1, cells]), self.best_aux[num_layers - 1, cells]

    def choices(self, num_layers: int, cells: int) -> list[int] | None:
        """Strategy index of each of the first ``num_layers`` layers in the optimum, or None."""
        cells = min(cells, self.max_cells if self.solved_cells is None else self.solved_cells)
        if cells < 0 or not np.isfinite(self.best[num_layers - 1, cells]):
            return None
        s = int(self.best_s[num_layers - 1, cells])
        v = cells
        out = [s]
        for layer in range(num_layers - 1, 0, -1):
            opts = self.layers[layer]
            u = v - int(opts.mem[s])
            s = int(self.pred[layer][opts.cls[s], u])
            v = u
            out.append(s)
        return out[::-1]


def solve_stage(layers: Sequence[LayerOptions], transition: np.ndarray,
                max_cells: int) -> StageTables:
    """Run the DP over ``layers`` (in order) with caps ``0..max_cells`` cells.

    ``transition[c_prev, c]`` is the objective added when a layer of class ``c`` follows one of
    class ``c_prev`` (0 on the diagonal in practice, but not assumed). Arrays are laid out
    ``(s, v)`` so that "use ``mem[s]`` more cells" is a contiguous shift along ``v``.
    """
    if max_cells < 0:
        raise ValueError(f"max_cells={max_cells}: must be >= 0")
    transition = np.asarray(transition, dtype=DTYPE)
    full = max_cells + 1
    max_cells = min(max_cells, _unconstrained_cells(layers, transition, max_cells))
    num_classes = transition.shape[0]
    width = max_cells + 1
    v = np.arange(width)
    n_layers = len(layers)
    k = layers[0].aux.shape[1]
    best = np.full((n_layers, width), INF)
    best_aux = np.zeros((n_layers, width, k))
    best_s = np.zeros((n_layers, width), dtype=np.int64)
    preds: list[np.ndarray] = [np.zeros((0, 0), dtype=np.int64)]

    first = layers[0]
    f = np.full((len(first.mem), width), INF, dtype=DTYPE)         # (s, v)
    aux = np.zeros((len(first.mem), width, k))                     # (s, v, k)
    for s, m in enumerate(first.mem):
        if m <= max_cells:
            f[s, m:] = first.cost[s]
            aux[s, m:] = first.aux[s]
    _record(0, f, aux, v, best, best_aux, best_s)
    sub_transition: dict[tuple[int, int], np.ndarray] = {}
    for layer in range(1, n_layers):
        # Best strategy of the previous layer within each of its classes, at every cap.
        groups = layers[layer - 1].groups
        prev_classes = np.array([c for c, _ in groups])
        by_class = np.empty((len(groups), width), dtype=DTYPE)       # (c', v)
        arg_class = np.empty((len(groups), width), dtype=np.int32)
        for row, (_, idx) in enumerate(groups):
            if len(idx) == 1:
                by_class[row] = f[idx[0]]
                arg_class[row] = idx[0]
                continue
            a = f[idx].argmin(axis=0)
            by_class[row] = f[idx[a], v]
            arg_class[row] = idx[a]
        # Best predecessor into every class the current layer uses (only those).
        targets = layers[layer].class_list
        pair = (id(layers[layer - 1]), id(layers[layer]))
        if pair not in sub_transition:  # same options layer after layer: compute once
            sub_transition[pair] = transition[np.ix_(prev_classes, targets)][:, :, None]
        into = by_class[:, None, :] + sub_transition[pair]
        best_prev = into.argmin(axis=0)                              # (c, v) row of by_class
        h = np.full((num_classes, width), INF, dtype=DTYPE)
        pred = np.zeros((num_classes, width), dtype=np.int32)
        h[targets] = into.min(axis=0)
        pred[targets] = arg_class[best_prev, v[None, :]]             # strategy of layer - 1
        opts = layers[layer]
        f_new = np.full((len(opts.mem), width), INF, dtype=DTYPE)
        aux_new = np.zeros((len(opts.mem), width, k))
        for s, m in enumerate(opts.mem):
            if m > max_cells:
                continue
            c = opts.cls[s]
            f_new[s, m:] = h[c, :width - m] + opts.cost[s]
            if k:
                aux_new[s, m:] = aux[pred[c, :width - m], v[:width - m]] + opts.aux[s]
        f, aux = f_new, aux_new
        preds.append(pred)                                           # (c, v)
        _record(layer, f, aux, v, best, best_aux, best_s)
    if width < full:  # memory does not bind beyond max_cells: the last column repeats
        pad = full - width
        best = np.concatenate([best, np.repeat(best[:, -1:], pad, axis=1)], axis=1)
        best_s = np.concatenate([best_s, np.repeat(best_s[:, -1:], pad, axis=1)], axis=1)
        best_aux = np.concatenate([best_aux, np.repeat(best_aux[:, -1:], pad, axis=1)], axis=1)
    return StageTables(layers=list(layers), best=best, best_aux=best_aux, best_s=best_s,
                       pred=preds, solved_cells=max_cells)


def _unconstrained_cells(layers: Sequence[LayerOptions], transition: np.ndarray,
                         max_cells: int) -> int:
    """The most cells an optimal path of some prefix needs when memory is ignored (strategies
    over ``max_cells`` left out); ``max_cells`` where some prefix has no path at all.

    For each prefix, the DP without memory gives its optimum and the cells of one path that
    reaches it: with at least that many cells the capped DP reaches the optimum too, and no
    cap does better. So beyond the largest of these the capped DP's columns are all equal.
    """
    first = layers[0]
    mem = np.asarray(first.mem, dtype=np.int64)
    g = np.where(mem <= max_cells, np.asarray(first.cost, dtype=DTYPE), INF)
    used = mem.copy()
    need = 0
    for layer in range(len(layers)):
        if layer:
            prev, opts = layers[layer - 1], layers[layer]
            into = g[:, None] + transition[np.asarray(prev.cls)][:, opts.class_list]  # (s', c)
            arg = into.argmin(axis=0)
            col = {c: j for j, c in enumerate(opts.class_list.tolist())}
            pick = np.array([col[c] for c in np.asarray(opts.cls).tolist()])
            mem = np.asarray(opts.mem, dtype=np.int64)
            g = np.where(mem <= max_cells, into[arg, np.arange(len(arg))][pick] + opts.cost, INF)
            used = used[arg][pick] + mem
        s = int(g.argmin())
        if not np.isfinite(g[s]):
            return max_cells
        need = max(need, int(used[s]))
    return need


def _class_groups(cls: np.ndarray) -> list[tuple[int, np.ndarray]]:
    # sorted(set()) rather than np.unique, which imports numpy.ma (tens of ms of start-up)
    return [(c, np.nonzero(cls == c)[0]) for c in sorted(set(cls.tolist()))]


def _record(layer: int, f: np.ndarray, aux: np.ndarray, v: np.ndarray, best: np.ndarray,
            best_aux: np.ndarray, best_s: np.ndarray) -> None:
    s = f.argmin(axis=0)
    best[layer] = f[s, v]
    if aux.shape[2]:
        best_aux[layer] = aux[s, v]
    best_s[layer] = s
