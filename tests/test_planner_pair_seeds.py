"""The two-strategy stage seeds (search/seeds.py ``_pair_stage``) of long stages try a few split
points per pair (``_pair_splits``); they must find what trying every split finds (the same
value, strategies and split), on stages where memory cuts some pairs, splits them, or fits
nothing."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_auto.plan import VocabStrategy
from megatron_auto.planner.search import seeds
from megatron_auto.planner.search.spaces import SpaceRules
from megatron_auto.planner.search.tasks import Task
from planner_fakes import tiny_gpt

pytestmark = pytest.mark.pure

RULES = SpaceRules(dp_modes=("ddp", "zero1", "zero3"), sequence_parallel=(False, True))
LAYERS = 24


def _task(world, pp, m, budget):
    spec, _, cluster, profile = tiny_gpt(world, LAYERS, 8, hidden=64, ffn=256, seq=32,
                                         vocab=128)
    return Task(spec, profile, cluster, world, 8, pp, m, "1f1b", RULES,
                VocabStrategy(tp=1, dp_mode="ddp"), budget, 4096)


def _budgets(world, pp, m):
    """From below the leanest stage of ``LAYERS / pp`` layers to above the fattest one."""
    probe = _task(world, pp, m, 1e12)
    c = probe.tables.costs(0, probe.in_flight[0])
    n = LAYERS // pp
    lean, fat = n * float(c.persistent.min()), n * float(c.persistent.max())
    base = probe.cluster.memory_reserve_bytes + probe.nccl_bound + probe.emb[0].persistent \
        + float(c.transient.max()) + probe.emb[0].transient
    return [base + f for f in np.linspace(0.9 * lean, 1.1 * fat, 9)]


@pytest.mark.parametrize("world,pp,m", [(4, 1, 2), (4, 2, 4), (2, 1, 8)])
def test_the_few_splits_find_what_every_split_finds(world, pp, m, monkeypatch):
    kinds, same = set(), []
    for budget in _budgets(world, pp, m):
        for bold in (True, False):
            for k in range(pp):
                for length in range(1, LAYERS - pp + 2):
                    few = seeds._pair_stage(_task(world, pp, m, budget), k, length, bold)
                    with monkeypatch.context() as mp:
                        mp.setattr(seeds, "PAIR_CANDIDATES", 10 ** 9)
                        every = seeds._pair_stage(_task(world, pp, m, budget), k, length, bold)
                    where = (budget, bold, k, length)
                    assert (few is None) == (every is None), where
                    if every is not None:  # the same time; the plan may differ where two
                        # splits' times differ by rounding alone (a == b at another x)
                        assert few[0] == pytest.approx(every[0], rel=1e-12, abs=0), where
                        same += [few[1:] == every[1:] or
                                 [few[1]] * few[3] + [few[2]] * (length - few[3]) ==
                                 [every[1]] * every[3] + [every[2]] * (length - every[3])]
                    if length + 1 > seeds.PAIR_CANDIDATES:
                        kinds.add("none" if every is None else
                                  "mixed" if 0 < every[3] < length else "one")
    assert kinds == {"none", "mixed", "one"}  # the instances exercise every case
    assert sum(same) >= 0.95 * len(same)  # and mostly the very same stage
