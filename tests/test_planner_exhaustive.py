"""The whole search against exhaustive enumeration: every plan of the full space of tiny
instances is priced with ``evaluate`` and the search must return the optimum.

Rule checked (docs/planner.md §6): the answer's iteration time equals the least iteration time
of the enumerated plans that fit the budget (relative 1e-9) and ``evaluate`` confirms it fits;
with and without the baseline spaces. Below the enumerated least peak the search raises
``InfeasibleError`` with a minimum between that least peak and 1 % above it, and searching at the
reported minimum succeeds. Budgets: several fractions of the least peak, from binding at the
minimum to not binding at all. Interleaving is part of the space: the enumeration holds every
virtual size and chunk split (``planner_enumerate``), the search its default virtual sizes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_auto.planner import (InfeasibleError, ModelSpec, SearchOptions, TrainingSpec,
                                   analytic_profile, evaluate, search)
from megatron_auto.planner.inputs.model_spec import LayerType
from megatron_auto.planner.inputs.presets import make_cluster

from planner_enumerate import all_plans, count_plans

pytestmark = [pytest.mark.pure, pytest.mark.exhaustive]

# (devices, layers, precision, global batch, attention heads, sub-space) and their plan counts
# with zero1, sequence parallelism and interleaving in the space (planner_enumerate.count_plans;
# the sub-space restricts search and enumeration alike): 93,036 plans in all. Interleaving needs
# pp * v <= layers with pp, v >= 2, so the 4-layer instances hold it (v = 2, uneven chunks
# wherever the count allows); one head keeps the first one's pp = 1 plans (every TP layout
# would be 12 per layer) within the time, the last one pins pp = 2 so that its interleaved
# stages have two ranks (TP, SP and ZeRO inside the chunks) within the plan limit.
NO_RECOMPUTE = dict(pp=2, dp_modes=("ddp", "zero1", "zero3"), recompute=(False,))
# Module recompute as a per-layer dimension (issue 27): selective beside none and full.
SELECTIVE = dict(recompute=(False, True, "selective"))
# Worlds that are not a power of two (a 96-wide model with 6 heads, FFN 384 and 192 vocabulary
# rows: tp 1, 2, 3 and 6 divide it; pp 3 on 3 layers): one node of 6, and two nodes of 3, where
# the within-node rule leaves out tp 2 and 6 and pp 3 (stages of 2 would straddle a node).
# Two layer types: a 4-head FFN-256 layer and a 2-head FFN-128 one (no tp 4 for the second).
SIX = dict(model="six", recompute=(False,), dp_modes=("ddp", "zero3"))
TWO_NODES = dict(model="six", nodes=2, dp_modes=("ddp", "zero1", "zero3"))
TWO_TYPES = dict(model="two-types")
INSTANCES = [
    (2, 4, "fp32", 1, 4, None),           # 304
    (2, 3, "fp32", 4, 4, None),           # 17,392
    (4, 3, "fp32", 1, 4, None),           # 192
    (4, 2, "bf16", 4, 4, None),           # 25,376
    (8, 2, "fp32", 2, 4, None),           # 11,616
    (2, 4, "bf16", 2, 1, None),           # 20,592, 16 of them interleaved
    (4, 4, "fp32", 4, 4, NO_RECOMPUTE),   # 17,564, 2,516 of them interleaved
    (4, 3, "fp32", 1, 4, SELECTIVE),      # 546
    (6, 3, "fp32", 6, 6, SIX),            # 26,916
    (6, 3, "fp32", 6, 6, TWO_NODES),      # 48,400
    (4, 2, "fp32", 4, 4, TWO_TYPES),      # 23,056
]
_ENUMERATED = ("pp", "dp_modes", "recompute")  # the restrict keys search and enumeration share
BUDGET_FRACTIONS = (1.0, 1.01, 1.05, 1.2, 1.6, 3.0)
_CACHE: dict = {}


def _id(case):
    world, layers, precision, batch, heads, restrict = case
    restrict = restrict or {}
    nodes = restrict.get("nodes", 1)
    devices = f"{nodes}x{world // nodes}dev" if nodes > 1 else f"{world}dev"
    return f"{devices}-{layers}L-{precision}-B{batch}" + (f"-h{heads}" if heads != 4 else "") \
        + ("-pp2" if "pp" in restrict else "") \
        + ("-norecompute" if restrict.get("recompute") == (False,) else "") \
        + ("-two-types" if restrict.get("model") == "two-types" else "") \
        + ("-selective" if restrict.get("recompute") == SELECTIVE["recompute"] else "")


def _options(case, **kw):
    restrict = case[5] or {}
    pins = {}
    if "pp" in restrict:
        pins["pp"] = restrict["pp"]
    if "dp_modes" in restrict:
        pins["dp_modes"] = restrict["dp_modes"]
    if "recompute" in restrict:
        pins["allow_recompute"] = True in restrict["recompute"]
        pins["module_recompute"] = tuple(v for v in restrict["recompute"]
                                         if not isinstance(v, bool))
    # The exact optimum is what these tests compare with: gap 0 (the default 1 % gap may stop
    # at a plan within 1 %; test_planner_gap checks that gap against the same enumeration).
    kw.setdefault("optimality_gap", 0.0)
    return SearchOptions(show_progress=False, **pins, **kw)


def instance(world, layers, precision, batch, heads, restrict):
    key = (world, layers, precision, batch, heads, tuple(sorted((restrict or {}).items())))
    if key not in _CACHE:
        spec = _model(layers, heads, (restrict or {}).get("model"))
        nodes = (restrict or {}).get("nodes", 1)
        training = TrainingSpec(batch, precision)
        # A small reserve so that the model's own memory decides which plans fit; the preset's
        # GPU terms stay on (fused AdamW, 5 % fragmentation), the NCCL communicators scaled
        # to the tiny model (5 kB each, a fraction of a percent of a peak) so that they count
        # without deciding everything.
        cluster = dataclasses.replace(make_cluster("a100-40g", nodes, world // nodes),
                                      memory_reserve_bytes=10 ** 5, device_memory_bytes=10 ** 8,
                                      nccl_communicator_bytes=5e3)
        profile = analytic_profile(spec, training, cluster)
        priced = []
        enumerated = {k: v for k, v in (restrict or {}).items() if k in _ENUMERATED}
        for plan in all_plans(spec, batch, world, cluster.devices_per_node, **enumerated):
            est = evaluate(plan, spec, training, cluster, profile)
            priced.append((est.iteration_time_s, est.peak_memory_bytes, plan.virtual_size))
        _CACHE[key] = (spec, training, cluster, profile, priced)
    return _CACHE[key]


def _model(layers, heads, kind):
    if kind == "six":
        return ModelSpec.uniform(layers, 96, heads, 32, 192, ffn_hidden_size=384, name="gpt")
    if kind == "two-types":
        wide = LayerType(name="wide", hidden_size=64, num_attention_heads=heads,
                         ffn_hidden_size=256, seq_length=32, count=1)
        narrow = LayerType(name="narrow", hidden_size=64, num_attention_heads=heads // 2,
                           ffn_hidden_size=128, seq_length=32, count=1)
        per = layers // 2
        return ModelSpec.stacked([(wide, layers - per), (narrow, per)], 128, 64, 32, name="gpt")
    return ModelSpec.uniform(layers, 64, heads, 32, 128, name="gpt")


def optimum(priced, budget, interleaved=None):
    """Least iteration time within ``budget`` (of the interleaved plans only, or of the plain
    ones only, when ``interleaved`` says so)."""
    fits = [t for t, peak, v in priced if peak <= budget
            and (interleaved is None or (v > 1) == interleaved)]
    return min(fits) if fits else None


def _check(result, best, spec, training, cluster, profile, budget, what):
    again = evaluate(result.plan, spec, training, cluster, profile, budget)
    assert again.feasible, what
    assert again.iteration_time_s == pytest.approx(result.estimate.iteration_time_s, rel=1e-12)
    assert result.estimate.iteration_time_s == pytest.approx(best, rel=1e-9), \
        (what, result.estimate.iteration_time_s / best - 1)
    assert result.plan.search["proven_optimal"] is True


@pytest.mark.parametrize("case", INSTANCES, ids=_id)
def test_search_equals_the_enumerated_optimum(case):
    spec, training, cluster, profile, priced = instance(*case)
    least = min(peak for peak in (p for _, p, _ in priced))
    assert len(priced) <= 2 * 10 ** 5
    for fraction in BUDGET_FRACTIONS:
        budget = int(math.ceil(least * fraction))
        best = optimum(priced, budget)
        for baselines in (False, True):
            result = search(spec, training, cluster, profile, budget,
                            _options(case, include_baselines=baselines))
            _check(result, best, spec, training, cluster, profile, budget,
                   (fraction, baselines))
        # interleaving off, and pinned: the optimum of the plain plans, of the interleaved ones
        plain = search(spec, training, cluster, profile, budget,
                       _options(case, include_baselines=False, virtual_sizes=(1,)))
        _check(plain, optimum(priced, budget, False), spec, training, cluster, profile, budget,
               (fraction, "v=1"))
        inter = optimum(priced, budget, True)
        if inter is not None:
            pinned = search(spec, training, cluster, profile, budget,
                            _options(case, include_baselines=False, virtual_sizes=(2,)))
            assert pinned.plan.virtual_size == 2
            _check(pinned, inter, spec, training, cluster, profile, budget, (fraction, "v=2"))


def test_the_instances_hold_interleaved_optima():
    # Not a vacuous v dimension: at some budget of the instances the optimum is interleaved.
    wins = []
    for case in INSTANCES:
        _, _, _, _, priced = instance(*case)
        least = min(p for _, p, _ in priced)
        for fraction in BUDGET_FRACTIONS:
            budget = least * fraction
            best = min((t, v) for t, p, v in priced if p <= budget)
            wins.append(best[1] > 1)
    assert any(wins)


@pytest.mark.parametrize("case", INSTANCES, ids=_id)
def test_infeasible_minimum_is_the_enumerated_least_peak(case):
    spec, training, cluster, profile, priced = instance(*case)
    least = min(p for _, p, _ in priced)
    options = _options(case, include_baselines=False)
    with pytest.raises(InfeasibleError, match="least memory") as info:
        search(spec, training, cluster, profile, int(least * 0.999), options)
    reported = info.value.min_memory_bytes
    assert least <= reported <= 1.01 * least
    found = search(spec, training, cluster, profile, int(math.ceil(reported)), options)
    assert evaluate(found.plan, spec, training, cluster, profile, math.ceil(reported)).feasible


def test_selective_recompute_wins_where_it_beats_none_and_full():
    """A math-kernel cluster (the score matrices are kept, so core attention is worth
    recomputing) and a model of many narrow heads: over every plan of the space with selective
    beside none and full (enumerated), the search finds the optimum at every budget, and at
    some budgets that optimum has selective layers and beats the best plan of none/full only."""
    spec = ModelSpec.uniform(2, 64, 16, 32, 128, name="gpt")
    training = TrainingSpec(2, "fp32")
    cluster = dataclasses.replace(make_cluster("a100-40g", 1, 2), memory_reserve_bytes=10 ** 5,
                                  device_memory_bytes=10 ** 8, nccl_communicator_bytes=5e3,
                                  attention_backend="math")
    profile = analytic_profile(spec, training, cluster)
    priced = []
    for plan in all_plans(spec, 2, 2, cluster.devices_per_node, **SELECTIVE):
        est = evaluate(plan, spec, training, cluster, profile)
        selective = any(layer.recompute == "selective" for layer in plan.layers)
        priced.append((est.iteration_time_s, est.peak_memory_bytes, selective))
    least = min(peak for _, peak, _ in priced)
    wins = 0
    for fraction in (1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0):
        budget = int(math.ceil(least * fraction))
        best = min(t for t, peak, _ in priced if peak <= budget)
        best_plain = min((t for t, peak, sel in priced if peak <= budget and not sel),
                         default=math.inf)
        result = search(spec, training, cluster, profile, budget,
                        SearchOptions(show_progress=False, module_recompute=("selective",),
                                      optimality_gap=0.0))  # the exact optimum
        assert result.estimate.iteration_time_s == pytest.approx(best, rel=1e-9), fraction
        if best < best_plain:
            assert any(layer.recompute == "selective" for layer in result.plan.layers)
            wins += 1
    assert wins >= 1


def test_the_two_node_instance_prunes_by_the_node_rule():
    # The same model and batch on one node of 6 has more plans (tp 2 and 6, pp 3): the rule
    # that keeps TP groups and stages inside a node removes them on two nodes of 3, and the
    # search above still finds the enumerated optimum of what remains.
    world, layers, _, batch, heads, restrict = INSTANCES[-2]
    spec = _model(layers, heads, restrict["model"])
    modes = restrict["dp_modes"]
    assert count_plans(spec, batch, world, 3, dp_modes=modes) \
        < count_plans(spec, batch, world, 6, dp_modes=modes)
    tps = {s.tp for p in all_plans(spec, batch, world, 3, dp_modes=modes) for s in p.layers}
    pps = {p.pp_size for p in all_plans(spec, batch, world, 3, dp_modes=modes)}
    assert tps == {1, 3} and pps == {1, 2}
