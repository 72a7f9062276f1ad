"""Seeds of interleaved tasks priced at their own micro-batches in flight.

An interleaved task (``virtual_size`` v > 1) is otherwise seeded with plain plans cut into
chunks (``interleaving.interleaved_variant``): the incumbent, or its plain sibling's seeds.
Their strategies were chosen for a plain stage's in-flight count, ``min(pp - k, m)``, but an
interleaved stage holds the activations of each of its chunks, several micro-batches each
(``interleaving.chunk_in_flight``): such seeds either do not fit or are far too lean, and the
walk, whose chunk-level bounds are weak, may not find better (LLaMA-7B on 8 GPUs at 36 GB,
pp 2, v 4: the walk's best after 57 CPU s was 6.19 s per iteration; the per-stage choice below
gives 5.71 s).

Here each stage's layers, over its chunks of the even split (or the pinned one), are chosen by
one ``stage_dp.solve_stage`` run over the stage's whole layer sequence, each layer priced at its
chunk's in-flight count, under the seeds' safe memory model (``seeds`` module: bytes rounded up
to cells, the room down) or its bold variant, with the stage's embedding/head and the largest
received inputs (``LayerTables.hop_bytes``) taken from the room first. ``evaluate_plan`` prices
every plan, so a seed that does not fit is dropped.
"""

from __future__ import annotations

import math

import numpy as np

from ...plan import LayerStrategy, Plan, even_partition
from ..cost.interleaving import interleaved_variant
from .seeds import SEED_CELLS, _levels, _step, seed_options, seed_plans, seed_transitions
from .stage_dp import solve_stage
from .tasks import Task
from .task_plans import task_plan


#: Rooms the layers are given, in units of the safe (or bold) room: both models are
#: conservative in a way (the safe one charges each layer its larger peak, the bold one leaves
#: the step peak out), so a little more room often still fits, and ``evaluate_plan`` drops
#: what does not. One DP table answers every room (its columns).
ROOM_SWEEP = (1.0, 1.03, 1.06, 1.1, 1.15)
CELLS = int(SEED_CELLS * max(ROOM_SWEEP)) + 1


def cut_seeds(task: Task, incumbent: Plan | None, partition: tuple[int, ...] | None
              ) -> list[Plan]:
    """The incumbent (while there is none, the plain sibling's seeds) cut into ``v`` chunks per
    stage (``interleaving.interleaved_variant``), where it is of this task's schedule, batch and
    vocabulary (and the pinned ``partition``, if any)."""
    given = [incumbent] if incumbent is not None else seed_plans(task.sibling(), None)
    variants = [interleaved_variant(p, task.v) for p in given
                if (p.pp_size, p.num_microbatches, p.vocab, p.global_batch_size)
                == (task.pp, task.m, task.vocab, task.global_batch)]
    return [p for p in variants if p is not None and (
        partition is None or tuple(p.pipeline.layers_per_stage) == tuple(partition))]


def own_seeds(task: Task, partition: tuple[int, ...] | None = None) -> list[Plan]:
    """``interleaved_seeds`` the first time a task asks, then none (they do not change)."""
    if "interleaved" in task.seed_rows:
        return []
    task.seed_rows["interleaved"] = True
    return interleaved_seeds(task, partition)


def interleaved_seeds(task: Task, partition: tuple[int, ...] | None = None) -> list[Plan]:
    """Plans of an interleaved ``task`` on the even chunk split (or ``partition``), each
    stage's strategies by a DP at its chunks' in-flight counts (module docstring); [] for a
    plain task or where no stage DP finds a fit."""
    if task.v == 1:
        return []
    lengths = tuple(partition) if partition is not None else tuple(
        even_partition(task.num_layers, task.chunks))
    if len(lengths) != task.chunks or min(lengths) < 1:
        return []
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    plans, seen = [], set()
    for bold in (True, False):
        for over in ROOM_SWEEP:
            chosen: dict[int, LayerStrategy] = {}
            for s in range(task.pp):
                picked = _stage_layers(task, s, lengths, starts, bold, over)
                if picked is None:
                    break
                chosen.update(picked)
            else:
                layers = tuple(chosen[i] for i in range(task.num_layers))
                if layers not in seen:
                    seen.add(layers)
                    plans.append(task_plan(task, lengths, layers))
    return plans


def _stage_layers(task: Task, s: int, lengths: tuple[int, ...], starts: list[int],
                  bold: bool, over: float = 1.0) -> dict[int, LayerStrategy] | None:
    """Stage ``s``'s strategies (layer index -> strategy): the best DP answer over the
    transient levels with ``over`` times the room, or None where none fits."""
    own = [c for c in range(task.chunks) if task.stage_of(c) == s]
    where = [(i, task.spec.layer_order[i], task.in_flight[c])
             for c in own for i in range(starts[c], starts[c] + lengths[c])]
    embs = [task.emb[c] for c in own]
    received = task.tables.most_hop_bytes * sum(task.in_flight[c] for c in own if c > 0)
    persistent = sum(e.persistent for e in embs) + received
    step_peak = sum(e.step_peak for e in embs)
    top = max(e.transient for e in embs)
    best: tuple[float, dict[int, LayerStrategy]] | None = None
    for tau in _levels(task):
        if bold:
            room = (task.room * (1 - 1e-9) - persistent - max(tau, top)
                    - task.nccl_floor[s])
        else:
            room = (task.room * (1 - 1e-9) - max(persistent + max(tau, top), step_peak)
                    - task.nccl_bound)
        if room < 0:
            continue
        found = _solve(task, tuple((t, k_in) for _, t, k_in in where), tau, bold)
        if found is None:
            continue
        table, kept = found
        cells = min(int(room * over // _step(task)), CELLS)
        value = float(table.best[len(where) - 1, cells])
        picks = table.choices(len(where), cells) if math.isfinite(value) else None
        if picks is None or (best is not None and value >= best[0]):
            continue
        best = (value, {i: task.tables.costs(t, k_in).strategies[int(kept[j][p])]
                        for j, ((i, t, k_in), p) in enumerate(zip(where, picks))})
    return None if best is None else best[1]


def _solve(task: Task, window: tuple[tuple[int, int], ...], tau: float, bold: bool):
    """The stage DP over ``window`` (layer type, in-flight count per layer) with strategies
    of transient at most ``tau``: ``(tables, kept strategy indices per layer)``, None where a
    layer has none (cached in the layer tables' memo)."""
    step = _step(task)
    key = ("interleaved seed", window, tau, task.m, step, bold)
    cache = task.tables.memo
    if key not in cache:
        if task.on_new_table is not None:
            task.on_new_table()  # the deadline
        found = [seed_options(task, t, k_in, tau, bold) for t, k_in in window]
        if any(f is None for f in found):
            cache[key] = None
            return None
        kept = [f[0] for f in found if f is not None]
        opts = [f[1] for f in found if f is not None]
        trans = seed_transitions(task, {t for t, _ in window})
        cache[key] = (solve_stage(opts, trans, CELLS), kept)
    return cache[key]
