"""The partitions other planners would pick, priced for the winner's task.

The exact search already considered every partition. For the winning task (pp, micro-batches,
vocabulary layout) this prices the best plan under each classic partition kind, so
``plan.search["partitions"]`` and ``explain`` show the memory/time trade-off they make:
``even``, ``memory`` (memory-balanced), ``time`` (time-balanced), ``bmw-paper`` (the paper's
moves, ``partition.bmw_paper``) and ``exact`` (the answer). Stage rows: a stage's least time
per micro-batch (the bound DP, memory within the budget) and its least peak memory
(``least_memory``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .exact import TaskSearch
from .walk_state import Incumbent
from .least_memory import stage_least
from ..inputs.model_spec import TrainingSpec
from .partition import bmw_paper, even, memory_balanced, min_max_partition
from .tasks import Task, Weights

KINDS = ("even", "memory", "time", "bmw-paper")
REPORT_TIME_LIMIT_S = 2.0


def _rows(task: Task):
    single = len(task.spec.layer_types) == 1
    cache: dict[tuple, np.ndarray] = {}

    def time_row(k: int, start: int) -> np.ndarray:
        key = ("t", k, 0 if single else start)
        if key not in cache:
            e = task.emb[k]
            full = np.ones(task.max_len)
            cache[key] = task.rest_bound(
                k, key[2], Weights(1.0, 0.0, 0.0), np.arange(1, task.max_len + 1),
                full * (task.room - e.persistent), full * (task.room - e.step_floor),
                full * e.transient) + e.microbatch + (task.tables.min_boundary if k else 0.0)
        return cache[key]

    def memory_row(k: int, start: int) -> np.ndarray:
        key = ("m", k, 0 if single else start)
        if key not in cache:
            cache[key] = stage_least(task, k, key[2])[0]
        return cache[key]
    return time_row, memory_row, not single


def pinned_partition(task: Task, kind: str) -> tuple[int, ...] | None:
    """The partition of ``kind`` (one of ``KINDS``) for this task, or None if none exists."""
    L, pp = task.num_layers, task.pp
    if kind == "even" or pp == 1:
        return even(L, pp)
    time_row, memory_row, by_start = _rows(task)
    if kind == "memory":
        return memory_balanced(L, pp, memory_row, task.max_len, by_start)
    if kind == "time":
        return min_max_partition(L, pp, time_row, task.max_len, by_start)
    if kind == "bmw-paper":
        return bmw_paper(L, pp, time_row, memory_row, task.max_len, task.budget, by_start)
    raise ValueError(f"partition kind {kind!r}: choose one of {', '.join(KINDS)}")


def partition_report(task: Task, training: TrainingSpec, best: Incumbent,
                     time_limit_s: float = REPORT_TIME_LIMIT_S) -> dict[str, Any]:
    """``{kind: {"partition", "samples_per_s", "peak_memory_bytes", "proven_optimal"}}`` for
    the winner's task (None values where a kind has no feasible plan, or none was found before
    the limit: then ``proven_optimal`` is False), plus ``exact``: the answer's own. The kinds
    share ``time_limit_s``, so the report never runs past it (the search's own limit holds:
    the driver passes what is left of it)."""
    assert best.plan is not None and best.estimate is not None
    out: dict[str, Any] = {"exact": {
        "partition": list(best.plan.pipeline.layers_per_stage),
        "samples_per_s": best.estimate.samples_per_s,
        "peak_memory_bytes": best.estimate.peak_memory_bytes,
        "proven_optimal": not best.stopped}}
    if task.pp == 1:
        return out  # one stage: every kind is the same partition
    priced: dict[tuple[int, ...], dict[str, Any]] = {
        tuple(best.plan.pipeline.layers_per_stage): out["exact"]}
    deadline = task.cache.clock() + time_limit_s
    for kind in KINDS:
        part = pinned_partition(task, kind)
        if part is not None and part not in priced:
            found = Incumbent(comparison=True)  # stops at the deadline, plan or not
            TaskSearch(task, training, found, deadline, partition=part).run()
            priced[part] = {
                "partition": list(part),
                "samples_per_s": found.estimate.samples_per_s if found.estimate else None,
                "peak_memory_bytes":
                    found.estimate.peak_memory_bytes if found.estimate else None,
                "proven_optimal": not found.stopped}
        out[kind] = priced[part] if part is not None else {
            "partition": None, "samples_per_s": None, "peak_memory_bytes": None,
            "proven_optimal": True}
    return out
