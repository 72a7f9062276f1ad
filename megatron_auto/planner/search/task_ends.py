"""What a search task's vocabulary layout adds at the pipeline's ends (a mixin of
``tasks.Task``): the relayouts between the embedding/head and the first/last layer, and the
NCCL communicators every plan of the task holds (``gpu_terms``).
"""

from __future__ import annotations

import functools
from typing import Any, Hashable

import numpy as np

from ...layout import all_layouts, vocab_layout
from ...plan import VocabStrategy
from ..cost.gpu_terms import group_count, search_nccl_bound
from ..cost.time_model import relayout_cost, sequence_parallel_switch_time
from ..inputs.cluster_model import ClusterModel
from .layer_tables import LayerTables
from .search_cache import SearchCache
from .spaces import SpaceRules


class TaskEnds:
    """The vocabulary's terms of a task (``tasks.Task`` sets the attributes below)."""

    tables: LayerTables
    cluster: ClusterModel
    cache: SearchCache
    rules: SpaceRules
    vocab: VocabStrategy
    n: int
    b_m: int
    pp: int
    world_size: int
    _future: dict[Hashable, Any]

    def vocab_moves(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """``(into, out_of)`` over layouts: embedding -> a first layer of type ``t``, and a
        last layer of type ``t`` -> the head (relayouts on the vocabulary's layout)."""
        key = ("vocab_moves", t)
        if key not in self._future:
            v = vocab_layout(self.vocab.tp, self.n, self.rules.cp)
            mv, h = self.tables.moved[t], self.tables.hidden[t]
            cl = self.cluster
            # embedding -> first layer: its moved bytes, then entering its SP run; last layer
            # -> head: the hidden state alone, leaving the SP run first (chunk_moves)
            self._future[key] = (
                np.array([relayout_cost(cl, v, b, self.b_m, mv, self.n).total
                          + sequence_parallel_switch_time(cl, b, False, b, sp, self.b_m, h,
                                                          self.n)
                          for b, sp in self.tables.layouts]),
                np.array([relayout_cost(cl, a, v, self.b_m, h, self.n).total
                          + sequence_parallel_switch_time(cl, a, sp, a, False, self.b_m, h,
                                                          self.n)
                          for a, sp in self.tables.layouts]))
        return self._future[key]

    def vocab_moves_backward(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """The backward part of ``vocab_moves(t)`` (entering an SP run gathers the gradient
        in backward, leaving one gathers in forward only)."""
        key = ("vocab_moves_backward", t)
        if key not in self._future:
            v = vocab_layout(self.vocab.tp, self.n, self.rules.cp)
            mv, h = self.tables.moved[t], self.tables.hidden[t]
            cl = self.cluster
            self._future[key] = (
                np.array([relayout_cost(cl, v, b, self.b_m, mv, self.n).backward
                          + sequence_parallel_switch_time(cl, b, False, b, sp, self.b_m, h,
                                                          self.n)
                          for b, sp in self.tables.layouts]),
                np.array([relayout_cost(cl, a, v, self.b_m, h, self.n).backward
                          for a, _ in self.tables.layouts]))
        return self._future[key]

    @functools.cached_property
    def nccl_floor(self) -> list[float]:
        """Per stage, the NCCL communicator bytes every plan of this task holds at least on
        its fullest rank (``gpu_terms``): the fixed groups, the vocabulary's layout on the
        first/last stage and the fewest of one layer layout (0 where not modelled)."""
        per = float(getattr(self.cluster, "nccl_communicator_bytes", 0.0))
        out = []
        for k in range(self.pp):
            if per <= 0:
                out.append(0.0)
                continue
            end = k in (0, self.pp - 1)
            cp = self.rules.cp
            key = (self.n, self.pp, self.world_size, k == 0, k == self.pp - 1,
                   self.vocab.tp if end else 0) + ((cp,) if cp > 1 else ())
            floors = self.cache.nccl_floors
            if key not in floors:
                vocab = {self.vocab_nccl} if end else set()
                floors[key] = min(  # every rank of a stage holds as many
                    group_count(self.n, self.pp, self.world_size, k, 0,
                                vocab | {(lay.tp, lay.consecutive) + ((cp,) if cp > 1 else ())})
                    for lay in all_layouts(self.n, cp))
            out.append(per * floors[key])
        return out

    @property
    def nccl_bound(self) -> float:
        """``gpu_terms.search_nccl_bound`` of this task's stage shape: an upper bound on any
        plan's NCCL bytes per rank (O(stage size) to compute: once per shape and search)."""
        cp = self.rules.cp
        key = (self.n, self.pp) if cp == 1 else (self.n, self.pp, cp)
        bounds = self.cache.nccl_bounds
        if key not in bounds:
            bounds[key] = search_nccl_bound(self.cluster, self.n, self.pp, cp)
        return bounds[key]

    @property
    def vocab_nccl(self) -> tuple[int, ...]:
        """The vocabulary's layout as ``gpu_terms.group_count`` takes it (with the CP degree
        when the task has one)."""
        cp = self.rules.cp
        return (self.vocab.tp, True) if cp == 1 else (self.vocab.tp, True, cp)


    def nccl_with(self, k: int, layouts: frozenset, classes: np.ndarray) -> np.ndarray | float:
        """NCCL bytes of stage ``k`` holding ``layouts`` (``gpu_terms.group_count``'s layout
        keys) and each candidate class's layout (the exact search's memory cut); kept."""
        per = float(getattr(self.cluster, "nccl_communicator_bytes", 0.0))
        if per <= 0:
            return 0.0
        known = self._future
        out = np.empty(len(classes))
        for c in set(classes.tolist()):  # not np.unique: it imports numpy.ma (start-up time)
            key = ("nccl_with", k, layouts, int(c))
            if key not in known:
                known[key] = per * group_count(self.n, self.pp, self.world_size, k, 0,
                                               layouts | {self.tables.nccl_layouts[int(c)]})
            out[classes == c] = known[key]
        return out
