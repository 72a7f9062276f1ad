"""Expert parallelism as a search dimension against exhaustive enumeration: every plan of tiny
MoE instances (``planner_enumerate``, which writes out ``ep``, ``expert_tp`` and
``expert_dp_mode`` on the MoE layers itself) is priced with ``evaluate`` and the search must return the optimum, at budgets
from the least peak up; the instances are chosen so that the optimum takes ``ep > 1`` at some
budget and ``ep = 1`` at another, and the same for ``expert_tp`` (the dimensions are not
vacuous)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_auto.planner import ModelSpec, SearchOptions, TrainingSpec, analytic_profile, \
    evaluate, search
from megatron_auto.planner.inputs.model_spec import ExpertSpec, LayerType
from megatron_auto.planner.inputs.presets import make_cluster

from planner_enumerate import all_plans

pytestmark = [pytest.mark.pure, pytest.mark.exhaustive]

DP_MODES = ("ddp", "zero3")
# (devices, global batch, layer kinds "m" MoE / "d" dense, experts, shared width)
INSTANCES = [
    (4, 4, "mm", 4, 0),     # every layer MoE, no shared experts
    (4, 4, "md", 4, 128),   # MoE then dense, shared experts (a TP-split MLP beside them)
    (2, 2, "mmd", 2, 0),    # three layers on two devices: pp 1..3, ep 1..2
]
BUDGET_FRACTIONS = (1.0, 1.05, 1.3, 2.0, 4.0)
_CACHE: dict = {}


def _spec(kinds: str, experts: int, shared: int) -> ModelSpec:
    base = dict(hidden_size=64, num_attention_heads=4, seq_length=32, activation="swiglu",
                add_bias_linear=False)
    moe = LayerType(name="gpt_moe", ffn_hidden_size=shared, count=kinds.count("m"),
                    moe=ExpertSpec(num_experts=experts, topk=2, ffn_hidden_size=256), **base)
    types: tuple[LayerType, ...] = (moe,)
    if "d" in kinds:
        types += (LayerType(name="gpt", ffn_hidden_size=128, count=kinds.count("d"), **base),)
    order = tuple(0 if k == "m" else 1 for k in kinds)
    return ModelSpec(layer_types=types, layer_order=order, vocab_size=128,
                     embedding_hidden_size=64, seq_length=32, name="gpt")


def _instance(case):
    if case not in _CACHE:
        world, batch, kinds, experts, shared = case
        spec = _spec(kinds, experts, shared)
        training = TrainingSpec(batch, "fp32")
        cluster = dataclasses.replace(make_cluster("a100-40g", 1, world),
                                      memory_reserve_bytes=10 ** 5, device_memory_bytes=10 ** 8,
                                      nccl_communicator_bytes=5e3)
        profile = analytic_profile(spec, training, cluster)
        priced = []
        for plan in all_plans(spec, batch, world, cluster.devices_per_node, dp_modes=DP_MODES,
                              recompute=(False,)):
            est = evaluate(plan, spec, training, cluster, profile)
            priced.append((est.iteration_time_s, est.peak_memory_bytes,
                           max(s.ep for s in plan.layers), max(s.expert_tp for s in plan.layers)))
        _CACHE[case] = spec, training, cluster, profile, priced
    return _CACHE[case]


def _options(**kw):
    # optimality_gap 0: the exact optimum (the default stops within a certified 1 %)
    return SearchOptions(show_progress=False, dp_modes=DP_MODES, allow_recompute=False,
                         optimality_gap=0.0, **kw)


@pytest.mark.parametrize("case", INSTANCES, ids=lambda c: f"{c[0]}dev-B{c[1]}-{c[2]}-E{c[3]}"
                         + ("-shared" if c[4] else ""))
def test_search_equals_the_enumerated_optimum_with_ep(case):
    spec, training, cluster, profile, priced = _instance(case)
    assert len(priced) <= 2 * 10 ** 5
    assert any(ep > 1 for _, _, ep, _ in priced)
    least = min(peak for _, peak, _, _ in priced)
    for fraction in BUDGET_FRACTIONS:
        budget = int(math.ceil(least * fraction))
        best = min(t for t, peak, _, _ in priced if peak <= budget)
        for baselines in (False, True):
            result = search(spec, training, cluster, profile, budget,
                            _options(include_baselines=baselines))
            again = evaluate(result.plan, spec, training, cluster, profile, budget)
            assert again.feasible
            assert again.iteration_time_s == pytest.approx(result.estimate.iteration_time_s,
                                                           rel=1e-12)
            assert result.estimate.iteration_time_s == pytest.approx(best, rel=1e-9), \
                (fraction, baselines, result.estimate.iteration_time_s / best - 1)
            assert result.plan.search["proven_optimal"] is True


def test_the_instances_choose_ep_at_some_budget_and_not_at_another():
    # The optimum's ep over the budgets: both ep > 1 and ep = 1 occur, so the search must
    # really weigh the dimension (memory against all-to-all time).
    seen, seen_etp = set(), set()
    for case in INSTANCES:
        _, _, _, _, priced = _instance(case)
        least = min(peak for _, peak, _, _ in priced)
        for fraction in BUDGET_FRACTIONS:
            budget = least * fraction
            best = min((t, ep, etp) for t, peak, ep, etp in priced if peak <= budget)
            seen.add(best[1] > 1)
            seen_etp.add(best[2] > 1)
    assert seen == {True, False}
    # and expert TP (the experts split over the layer's TP ranks) likewise
    assert seen_etp == {True, False}
