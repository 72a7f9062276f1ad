"""One Lagrangian bound for a layer table's vocabulary layouts (search/family_bound.py).

The task whose ends carry the least of its siblings' embedding/head terms must be bounded at
most as high as every sibling, by both Lagrangian bounds (plain and stage-block), on tasks
where memory binds and the siblings' own bounds differ; where its bound reaches the cutoff no
sibling prices its own. The searches' answers with the family bound in use are compared with
every plan in tests/test_planner_exhaustive*.py (their spaces have four vocabulary layouts a
layer table and more).
"""

from __future__ import annotations

import pytest

from megatron_auto.plan import VocabStrategy
from megatron_auto.planner.search import family_bound, lagrange_bound as lb, tasks as task_mod
from megatron_auto.planner.search.family_bound import Family, join_families, least_ends
from megatron_auto.planner.search.tasks import Task
from planner_fakes import tiny_gpt
from test_planner_partition_bound import RULES, _task as interleaved_task

pytestmark = pytest.mark.pure

# the layouts of a 2-rank stage, the least-bounded not first (a proxy copying the first
# sibling's ends would be bounded above the least sibling)
VOCABS = [VocabStrategy(tp=tp, dp_mode=mode) for tp, mode in
          [(2, "zero3"), (1, "ddp"), (2, "ddp"), (1, "zero3")]]
# (world, layers, batch, micro-batches, virtual size), the shapes of test_planner_partition_bound
SHAPES = [(4, 4, 16, 8, 1), (4, 4, 4, 2, 2)]


def _siblings(shape, factor):
    """A task per layout of ``VOCABS``, sharing one layer table, at ``factor`` times the least
    peak of the shape's plans (of the first layout)."""
    world, layers, batch, m, v = shape
    spec, _, cluster, profile = tiny_gpt(world, layers, batch, hidden=64, ffn=256, seq=32,
                                         vocab=128)
    budget = interleaved_task(shape, factor)[0].budget
    step = max(1, int((budget - cluster.memory_reserve_bytes) / 2048))
    shared: dict = {}
    return [Task(spec, profile, cluster, world, batch, 2, m, "1f1b", RULES, voc, budget, step,
                 shared, virtual_size=v) for voc in VOCABS]


def _bounds(task):
    """The Lagrangian bound that applies: the plain one, or the stage-block one of an
    interleaved task (whose plain one is 0, ``lagrange_applies``)."""
    if task.v == 1:
        return [lb.lagrange_root(task)]
    assert task.tied_applies() and lb.lagrange_root(task) == 0.0
    return [lb.tied_lagrange_root(task)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("factor", [1.02, 1.3])
def test_the_least_ends_bound_no_sibling_above_it(shape, factor):
    siblings = _siblings(shape, factor)
    assert len({id(t.tables) for t in siblings}) == 1
    own = [_bounds(t) for t in siblings]
    proxy = _bounds(least_ends(siblings))
    for kind, value in enumerate(proxy):
        values = [b[kind] for b in own]
        assert value <= min(values) * (1 + 1e-12), (kind, value, values)
        assert value > 0.5 * min(values)  # a bound, not a zero
        assert values[0] > min(values)  # the siblings differ: the first is not the least


@pytest.mark.parametrize("shape", SHAPES)
def test_a_family_bound_that_reaches_the_cutoff_settles_every_sibling(shape, monkeypatch):
    siblings = _siblings(shape, 1.3)
    name = "lagrange_root" if shape[-1] == 1 else "tied_lagrange_root"
    bound = "lagrange_bound" if shape[-1] == 1 else "tied_lagrange_bound"
    cutoff = 0.9 * getattr(least_ends(siblings), bound)()
    calls = []
    real = getattr(task_mod, name)

    def counted(task, cut=lb.INF):
        calls.append(task)
        return real(task, cut)
    monkeypatch.setattr(task_mod, name, counted)
    join_families(siblings)
    assert all(isinstance(t.family, Family) for t in siblings)
    got = [getattr(t, bound)(cutoff) for t in siblings]
    assert len(calls) == 1 and calls[0] not in siblings  # the proxy's bound alone
    assert all(g >= cutoff for g in got)
    # above every sibling's bound, each prices its own (after the one family bound)
    fresh = _siblings(shape, 1.3)
    join_families(fresh)
    calls.clear()
    high = 2 * max(_bounds(t)[0] for t in _siblings(shape, 1.3))
    calls.clear()
    for t in fresh:
        getattr(t, bound)(high)
    assert len(calls) == 1 + len(fresh)


def test_small_families_and_offload_tasks_keep_their_own_bounds():
    siblings = _siblings(SHAPES[0], 1.3)
    join_families(siblings[:family_bound.FAMILY_MIN - 1])
    assert all(t.family is None for t in siblings)
