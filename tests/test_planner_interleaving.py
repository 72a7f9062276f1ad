"""The cost model's view of the interleaved 1F1B schedule (``planner/interleaving.py``,
``cost_time.pipeline_time``) against the runtime's own order (``parallel/interleaved.py``):
the warm-up counts, the in-flight chunk mixes counted along the order, and the iteration time of
a simulation that runs the order with per-chunk durations and the pipeline's dependencies."""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_auto.planner.cost_time import pipeline_time
from megatron_auto.planner.interleaving import (in_flight_vectors, max_in_flight, num_warmup,
                                                pipeline_fill)

pytestmark = pytest.mark.single  # imports the runtime's schedule (torch)

CASES = [(pp, v, m) for pp, v in itertools.product((2, 3, 4), (2, 3, 4))
         for m in (pp, 2 * pp, 3 * pp, 5 * pp)]


def _counted_vectors(pp, v, m, stage):
    """Per-local-chunk held activations after every op of the runtime's order."""
    from megatron_auto.parallel.interleaved import interleaved_order

    held, seen = [0] * v, []
    for forward, _, chunk in interleaved_order(pp, v, m, stage):
        held[chunk // pp] += 1 if forward else -1
        assert held[chunk // pp] >= 0
        seen.append(tuple(held))
    return seen


@pytest.mark.parametrize("pp,v,m", CASES)
def test_warmup_and_in_flight_mixes_match_the_runtime_order(pp, v, m):
    from megatron_auto.parallel import interleaved

    for stage in range(pp):
        assert num_warmup(pp, v, m, stage) == interleaved.num_warmup(pp, v, m, stage)
        seen = _counted_vectors(pp, v, m, stage)
        assert max_in_flight(pp, v, m, stage) == max(sum(n) for n in seen)
        maximal = {n for n in seen
                   if not any(o != n and all(a >= b for a, b in zip(o, n)) for o in seen)}
        assert set(in_flight_vectors(pp, v, m, stage)) == maximal


def _simulate(pp, v, m, f, b):
    """Makespan of the runtime's order: each stage runs its ops in order, a forward of chunk
    c > 0 waits for chunk c - 1's forward of the same micro-batch, a backward for chunk c + 1's
    backward (the last chunk: its own forward). Durations ``f[c]``, ``b[c]`` per global chunk."""
    from megatron_auto.parallel.interleaved import interleaved_order

    orders = [interleaved_order(pp, v, m, k) for k in range(pp)]
    done, pos, clock, last = {}, [0] * pp, [0.0] * pp, pp * v - 1
    progress = True
    while progress:
        progress = False
        for k in range(pp):
            while pos[k] < len(orders[k]):
                forward, mb, c = orders[k][pos[k]]
                if forward:
                    dep = ("f", mb, c - 1) if c > 0 else None
                else:
                    dep = ("b", mb, c + 1) if c < last else ("f", mb, c)
                if dep is not None and dep not in done:
                    break
                start = max(clock[k], done[dep] if dep else 0.0)
                clock[k] = start + (f[c] if forward else b[c])
                done[("f" if forward else "b", mb, c)] = clock[k]
                pos[k] += 1
                progress = True
    assert pos == [len(o) for o in orders]  # the order never deadlocks
    return max(clock)


def _formula(pp, v, m, f, b):
    chunk_times = [[f[c] + b[c] for c in range(k, pp * v, pp)] for k in range(pp)]
    stage = [sum(t) for t in chunk_times]
    return pipeline_time(stage, [0.0] * pp, [0.0] * pp, m, virtual_size=v,
                         fill=pipeline_fill(chunk_times)).pipeline


@pytest.mark.parametrize("pp,v,m", CASES)
def test_pipeline_formula_is_the_simulated_schedule_for_equal_chunks(pp, v, m):
    rng = random.Random(pp * 100 + v * 10 + m)
    # equal chunks everywhere: m C + (p - 1) C / v exactly
    f, b = [1.0] * (pp * v), [2.0] * (pp * v)
    assert _formula(pp, v, m, f, b) == pytest.approx(m * 3 * v + (pp - 1) * 3 * v / v)
    assert _simulate(pp, v, m, f, b) == pytest.approx(_formula(pp, v, m, f, b))
    # stages of different speeds, each stage's chunks equal: still exact or the formula above
    for _ in range(3):
        speed = [rng.uniform(0.5, 2.0) for _ in range(pp)]
        f = [speed[c % pp] for c in range(pp * v)]
        b = [2 * x for x in f]
        simulated, priced = _simulate(pp, v, m, f, b), _formula(pp, v, m, f, b)
        assert simulated <= priced * (1 + 1e-12)
        assert simulated >= priced * 0.9
