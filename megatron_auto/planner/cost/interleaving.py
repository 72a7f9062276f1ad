"""The interleaved 1F1B schedule as the cost model sees it (``pipeline.virtual_size`` v > 1).

The schedule's rules (the compute order, the warm-up counts, the in-flight maximum) are
``megatron_auto/schedule.py``, which the runtime (``parallel/interleaved.py``) runs too. From
them this module derives what the cost model needs:

- :func:`schedule_times`: the iteration's makespan, exactly, for any per-chunk times (the
  reference the cost model's closed form, :func:`pipeline_fill`, is measured against);
- which local chunks the in-flight activations belong to, over time. The mix changes during
  the steady state (a stage may hold more of its first chunk later than at the end of its
  warm-up), so the peak with uneven chunks is the largest ``sum_j n_j a_j`` over the count
  vectors ``n`` the schedule passes through; :func:`in_flight_vectors` returns the maximal ones
  (each right after a forward).

Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...plan import PipelineSpec, Plan, PlanError
from ...schedule import interleaved_order


Vectors = tuple[tuple[int, ...], ...]
# in_flight_vectors by (pp, v, micro-batches, stage), kept by the caller that asks often (a
# search's SearchCache): walking a long schedule costs milliseconds, and nothing is kept here.
InFlightMemo = dict[tuple[int, int, int, int], Vectors]


def in_flight_vectors(pp: int, v: int, num_microbatches: int, stage: int,
                      memo: InFlightMemo | None = None) -> Vectors:
    """The maximal per-local-chunk in-flight counts of ``stage`` over one iteration.

    Entry ``j`` of a vector counts the micro-batches whose local chunk ``j`` (global chunk
    ``j * pp + stage``) activations are held; a vector dominated entry by entry by another is
    dropped. With ``v == 1`` (the non-interleaved 1F1B) this is ``((min(pp - stage, m),),)``.
    ``memo``: earlier answers, read and extended.
    """
    key = (pp, v, num_microbatches, stage)
    if memo is not None and key in memo:
        return memo[key]
    out = _maximal_vectors(pp, v, num_microbatches, stage)
    if memo is not None:
        memo[key] = out
    return out


def _maximal_vectors(pp: int, v: int, num_microbatches: int, stage: int) -> Vectors:
    held = [0] * v
    seen: list[tuple[int, ...]] = []
    for forward, _, chunk in interleaved_order(pp, v, num_microbatches, stage):
        held[chunk // pp] += 1 if forward else -1
        if forward:
            seen.append(tuple(held))
    # the distinct vectors no other one dominates, in order of first appearance (distinct, so
    # "another at least as large everywhere" is strict domination); vectorised, in blocks:
    # GPT-3's 1,536 micro-batches give thousands of vectors
    uniq = list(dict.fromkeys(seen))
    arr = np.array(uniq, dtype=np.int64)
    dominated = np.zeros(len(uniq), dtype=bool)
    for lo in range(0, len(uniq), 256):
        block = arr[lo:lo + 256]
        ge = np.all(arr[None, :, :] >= block[:, None, :], axis=2)   # [i in block, other]
        ge[np.arange(len(block)), np.arange(lo, lo + len(block))] = False
        dominated[lo:lo + len(block)] = ge.any(axis=1)
    return tuple(vec for vec, d in zip(uniq, dominated.tolist()) if not d)


def peak_activations(per_chunk: list[float], pp: int, v: int, num_microbatches: int,
                     stage: int, memo: InFlightMemo | None = None
                     ) -> tuple[float, tuple[int, ...]]:
    """``(bytes, counts)``: the largest ``sum_j n_j per_chunk[j]`` over :func:`in_flight_vectors`
    and the counts that reach it (the first in schedule order on ties)."""
    best = -1.0
    best_vec: tuple[int, ...] = ()
    for vec in in_flight_vectors(pp, v, num_microbatches, stage, memo):
        value = sum(n * a for n, a in zip(vec, per_chunk))
        if value > best:
            best, best_vec = value, vec
    return max(best, 0.0), best_vec


def pipeline_fill(chunk_times: list[list[float]]) -> float:
    """The fill-and-drain part of an interleaved iteration: ``sum_k max_j c_{k,j}`` over stages
    ``k`` and their chunks' per-micro-batch times ``c_{k,j}`` (with v = 1, ``sum_k C_k``).

    With equal chunks this is ``sum_k C_k / v``: the bubble shrinks by ``v``. The iteration is
    then ``fill + (m - 1/v) max_k C_k`` (``cost_time.pipeline_time``): the schedule's makespan
    (:func:`schedule_times`) exactly with equal chunks; with uneven ones it is off both ways
    (docs/cost_model.md §6)."""
    return sum(max(times) for times in chunk_times)


def schedule_times(pp: int, v: int, num_microbatches: int, forward: list[float],
                   backward: list[float]) -> tuple[float, list[float]]:
    """``(makespan, per-stage end)`` of one interleaved iteration, exactly, when global chunk
    ``c``'s forward takes ``forward[c]`` and its backward ``backward[c]`` (p2p hops included).

    Each stage runs ``schedule.interleaved_order`` one op after another; the forward of chunk ``c > 0``
    waits for the forward of chunk ``c - 1`` of the same micro-batch, the backward of chunk
    ``c`` for that of chunk ``c + 1`` (the last chunk's for its own forward). An op starts when
    its stage is free and its input is there: ``end = max(stage free, input end) + duration``,
    evaluated in dependency order (a longest path; the order never deadlocks,
    ``tests/test_interleaved.py``). The cost model prices with the closed form of
    :func:`pipeline_fill` instead, which equals this with equal chunks and is 8 % under to
    11 % over it for random chunk times within +-30 % (``tests/test_planner_interleaving.py``
    measures it): the exact search needs lower bounds that are sums over chunks, and the one
    this makespan provably has (below) is too weak to prune interleaved tasks (docs/cost_model.md
    §6, §8). With equal chunks it is ``m C + (pp - 1) C / v``.

    Proven lower bound: stage ``b``'s first op (chunk ``b`` of micro-batch 0) waits for the
    forwards of chunks ``0..b-1``; its last (the backward of chunk ``b`` of the last
    micro-batch) is followed by the backwards of chunks ``b-1..0``; in between it runs all its
    ops: ``makespan >= m C_b + sum_{c<b} (forward[c] + backward[c])``."""
    chunks = pp * v
    m = num_microbatches
    orders = [interleaved_order(pp, v, m, k) for k in range(pp)]
    done_f = [[-1.0] * chunks for _ in range(m)]
    done_b = [[-1.0] * chunks for _ in range(m)]
    pos, clock = [0] * pp, [0.0] * pp
    left = sum(len(o) for o in orders)
    while left:
        moved = 0
        for k in range(pp):
            order, i, t = orders[k], pos[k], clock[k]
            while i < len(order):
                fwd, mb, c = order[i]
                if fwd:
                    ready = done_f[mb][c - 1] if c > 0 else 0.0
                else:
                    ready = done_b[mb][c + 1] if c < chunks - 1 else done_f[mb][c]
                if ready < 0:
                    break
                t = (t if t > ready else ready) + (forward[c] if fwd else backward[c])
                (done_f if fwd else done_b)[mb][c] = t
                i += 1
            moved += i - pos[k]
            pos[k], clock[k] = i, t
        if not moved:
            raise RuntimeError(f"interleaved schedule pp={pp} v={v} m={m} deadlocked")
        left -= moved
    return max(clock), clock


def chunk_in_flight(pp: int, v: int, num_microbatches: int,
                    memo: InFlightMemo | None = None) -> list[int]:
    """Per model chunk ``c`` (stage ``c % pp``, local chunk ``c // pp``), the micro-batches of
    that chunk held at ONE moment of its stage's schedule: the maximal in-flight vector with
    the largest total (the first on ties). Any single vector the schedule passes through is at
    most the stage's peak mix (``peak_activations`` takes the largest), so pricing each chunk's
    activations at this count never exceeds ``evaluate_plan``'s activation bytes: the exact
    search's memory cuts and bounds use it as a lower bound."""
    out = [0] * (pp * v)
    for stage in range(pp):
        vec = max(in_flight_vectors(pp, v, num_microbatches, stage, memo), key=sum)
        for j, count in enumerate(vec):
            out[j * pp + stage] = count
    return out


def interleaved_variant(plan: Plan, v: int) -> Plan | None:
    """``plan`` on the interleaved schedule with ``v`` chunks per stage: stage ``k`` keeps its
    layer count and its layers' strategies, in order, split into ``v`` near-equal chunks
    (chunk ``j * pp + k`` holds part ``j``). A starting point (a seed) for the exact search of
    the interleaved tasks. None when the plan cannot interleave (one stage, a stage with fewer
    than ``v`` layers, ``m`` not a multiple of pp, or a strategy the layer now in its place
    cannot take). ``plan`` may itself be interleaved: its stages' layers are taken in chunk
    order."""
    pp = plan.pp_size
    if v == plan.virtual_size:
        return plan
    if pp == 1 or plan.num_microbatches % pp or plan.pipeline.schedule != "1f1b":
        return None
    per_stage = [[plan.layers[i] for c in plan.stage_chunks(k)
                  for i in plan.chunk_layer_range(c)] for k in range(pp)]
    if any(len(s) < v for s in per_stage):
        return None
    parts = [[list(s[j * len(s) // v:(j + 1) * len(s) // v]) for j in range(v)]
             for s in per_stage]
    sizes = tuple(len(parts[k][j]) for j in range(v) for k in range(pp))
    layers = tuple(x for j in range(v) for k in range(pp) for x in parts[k][j])
    try:
        return replace(plan, layers=layers, estimate=None, search=None,
                       pipeline=PipelineSpec(size=pp, schedule="1f1b", layers_per_stage=sizes,
                                             virtual_size=v, optimizer_offload_fraction=plan
                                             .pipeline.optimizer_offload_fraction))
    except PlanError:
        return None


def pinned_virtual_sizes(per_chunk: int | None, pp: int | None,
                         num_layers: int | None) -> tuple[int, ...]:
    """``SearchOptions.virtual_sizes`` for Megatron's ``--num-layers-per-virtual-pipeline-stage``
    (``per_chunk``, None: search ``(1, 2, 4)``): the virtual size ``L / (pp N)``, which needs
    the pinned ``pp``. Raises ``ValueError`` naming the flag, the value and the fix."""
    if per_chunk is None:
        return (1, 2, 4)
    flag = "--num-layers-per-virtual-pipeline-stage"
    if pp is None or num_layers is None:
        raise ValueError(f"{flag}={per_chunk}: when searching it pins the virtual size, which "
                         f"needs --pipeline-model-parallel-size too; give it, or drop {flag} "
                         f"to let the planner choose")
    if per_chunk < 1 or num_layers % (pp * per_chunk) or num_layers // (pp * per_chunk) < 2:
        raise ValueError(f"{flag}={per_chunk}: --num-layers={num_layers} must be a multiple of "
                         f"pp x {per_chunk} = {pp * per_chunk} with at least 2 chunks per "
                         f"stage; choose a divisor of {num_layers // pp} below {num_layers // pp}")
    return (num_layers // (pp * per_chunk),)
