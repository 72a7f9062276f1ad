"""Walks restarted on finer memory cells (search/refine.py) against exhaustive enumeration.

With the restart after a few nodes (``REFINE_AFTER`` = 2, so that it happens on these small
instances), every search of the exhaustive instances (every plan of the full space priced) at
every budget fraction must still answer the enumerated optimum at gap 0, and record a bound at
most the optimum at gap 1 %; the restarts must happen, and the twin must share the layer tables
but not the cell-sized DP tables of its task.
"""

from __future__ import annotations

import math

import pytest

from megatron_auto.planner import search
from megatron_auto.planner.search import refine

from test_planner_exhaustive import BUDGET_FRACTIONS, INSTANCES, _id, _options, instance, optimum

pytestmark = [pytest.mark.pure, pytest.mark.exhaustive]

REL = 1e-9


@pytest.mark.parametrize("case", INSTANCES[:5], ids=_id)
def test_restarted_walks_keep_the_optimum(case, monkeypatch):
    monkeypatch.setattr(refine, "REFINE_AFTER", 2)
    twins = []
    real = refine.finer

    def counted(task, factor=refine.REFINE_FACTOR):
        twin = real(task, factor)
        assert twin.tables is task.tables and twin.step < task.step
        twins.append(twin)
        return twin
    monkeypatch.setattr(refine, "finer", counted)
    spec, training, cluster, profile, priced = instance(*case)
    least = min(peak for _, peak, _ in priced)
    for fraction in BUDGET_FRACTIONS:
        budget = int(math.ceil(least * fraction))
        best = optimum(priced, budget)
        for gap in (0.0, 0.01):
            result = search(spec, training, cluster, profile, budget,
                            _options(case, include_baselines=False, optimality_gap=gap))
            info = result.plan.search
            assert info["lower_bound_s"] <= best * (1 + REL)
            if gap == 0:
                assert result.estimate.iteration_time_s == pytest.approx(best, rel=REL)
                assert info["proven_optimal"] is True
    assert twins  # the restart happened


def test_a_pinned_memory_step_is_kept(monkeypatch):
    """``memory_step_bytes`` given: the walks keep that cell size (no restart)."""
    monkeypatch.setattr(refine, "REFINE_AFTER", 0)
    monkeypatch.setattr(refine, "finer", lambda *a, **k: pytest.fail("restarted"))
    case = INSTANCES[1]
    spec, training, cluster, profile, priced = instance(*case)
    least = min(peak for _, peak, _ in priced)
    search(spec, training, cluster, profile, int(least * 1.05),
           _options(case, include_baselines=False, optimality_gap=0.0,
                    memory_step_bytes=4096))
