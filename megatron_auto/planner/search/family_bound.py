"""One Lagrangian bound for all the vocabulary layouts of a layer table.

A space has a task per vocabulary layout of each (batch, pp, micro-batches, schedule, rules,
virtual size): they share their layer tables (``Task.tables``) and differ only at the
pipeline's ends, in the embedding/head costs of the first and last chunk positions
(``Task.emb``) and in the NCCL communicators the vocabulary's layout adds there
(``Task.nccl_floor``). The Lagrangian bounds (``lagrange_bound.lagrange_root`` and
``tied_lagrange_root``) read those terms in one direction only: the embedding's times add to a
stage's share with non-negative weights, and its bytes, its transient and the communicators'
bytes are taken off the stage's rooms. So a task whose ends carry, term by term, the least of
its siblings' (:func:`least_ends`) has a bound no larger than any sibling's, and where that
one bound reaches the search's cutoff it settles every sibling (``Family``) instead of one
bound each. GPT-1.5B on 16 GPUs at 20 GB: 108 interleaved tasks' tied bounds, over 8 layer
tables. Where it does not reach the cutoff each sibling prices its own bound, as before; the
family's is then one wasted bound per layer table.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Callable, Sequence

from .stage_costs import EmbeddingCosts
from .tasks import Task

#: The fewest siblings for which a family bound is tried: with two, a family that does not
#: settle them costs a third bound.
FAMILY_MIN = 3


def least_ends(tasks: Sequence[Task]) -> Task:
    """A task of the first's layer table whose embedding/head costs and NCCL floors are the
    least of ``tasks``' position by position and term by term (all of one layer table and
    virtual size): its Lagrangian bounds are at most each of theirs (module docstring)."""
    first = tasks[0]
    key = (first.global_batch, first.pp, first.m, first.schedule, first.rules)
    out = Task(first.spec, first.profile, first.cluster, first.world_size, first.global_batch,
               first.pp, first.m, first.schedule, first.rules, first.vocab, first.budget,
               first.step, {key: first.tables}, virtual_size=first.v, cache=first.cache)
    names = [f.name for f in fields(EmbeddingCosts) if f.name != "sharded"]
    out._emb = [EmbeddingCosts(**{n: min(getattr(t.emb[k], n) for t in tasks) for n in names})
                for k in range(first.chunks)]
    out.nccl_floor = [min(t.nccl_floor[k] for t in tasks) for k in range(first.pp)]
    return out


class Family:
    """The tasks of one layer table and virtual size, and their shared bounds (each computed
    once, on a sibling's first ask)."""

    def __init__(self, tasks: Sequence[Task]) -> None:
        self.tasks = list(tasks)
        self._proxy: Task | None = None
        self._bounds: dict[str, float] = {}

    def bound(self, kind: str, compute: Callable[[Task, float], float], cutoff: float) -> float:
        """``compute(least_ends(tasks), cutoff)``, kept under ``kind``: a lower bound on the
        iteration time of every plan of every sibling (``cutoff`` only falls, and a value
        that reached an earlier cutoff reaches a later one)."""
        if kind not in self._bounds:
            if self._proxy is None:
                self._proxy = least_ends(self.tasks)
            self._bounds[kind] = compute(self._proxy, cutoff)
        return self._bounds[kind]


def join_families(tasks: Sequence[Task]) -> None:
    """Give every plain ``Task`` of ``tasks`` its ``Family`` (the tasks of its layer table and
    virtual size) where it has at least ``FAMILY_MIN`` siblings."""
    groups: dict[tuple[int, int], list[Task]] = {}
    for t in tasks:
        if type(t) is Task:  # a per-stage offload task has rows of its own
            groups.setdefault((id(t.tables), t.v), []).append(t)
    for group in groups.values():
        if len(group) >= FAMILY_MIN:
            family = Family(group)
            for t in group:
                t.family = family
