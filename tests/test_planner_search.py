"""The search end to end on small problems: budget respected, monotone in memory, partition
never worse than even or memory-balanced, JSON round trip, infeasible budgets, options."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_auto.plan import Plan
from megatron_auto.planner import (BASELINE_SPACES, InfeasibleError, LayerType, ModelSpec,
                                   SearchOptions, TrainingSpec, analytic_profile, evaluate,
                                   search)
from megatron_auto.families.registry import model_spec

from planner_fakes import FakeCluster, round_profile

pytestmark = pytest.mark.pure

CLUSTER = FakeCluster(devices_per_node=4, bandwidth=2e4)
SPEC = ModelSpec.uniform(6, 64, 4, 16, 64, name="gpt")
QUIET = dict(show_progress=False, memory_step_bytes=256)


def run(budget, **kw):
    opts = {**QUIET, "include_baselines": False, **kw}
    return search(SPEC, TrainingSpec(8), CLUSTER, round_profile(), budget, SearchOptions(**opts))


# The least memory of this space is 35048 B (the optimizer step's temporaries, 4 B per local
# parameter beside the model states, bind for these tiny activations).
@pytest.mark.parametrize("budget", [36000, 40000, 45000, 60000, 90000])
def test_plan_never_exceeds_the_budget(budget):
    result = run(budget)
    est = evaluate(result.plan, SPEC, TrainingSpec(8), CLUSTER, round_profile(), budget)
    assert est.feasible
    assert est.peak_memory_bytes <= budget
    assert result.estimate.iteration_time_s == pytest.approx(est.iteration_time_s)
    for stage in result.plan.estimate["stages"]:
        assert stage["peak_memory_bytes"] <= budget


@pytest.mark.parametrize("pp", [1, None])
def test_more_memory_never_gives_a_slower_plan(pp):
    previous = math.inf
    for budget in range(26000, 80001, 2000):
        try:
            t = run(budget, pp=pp).estimate.iteration_time_s
        except InfeasibleError:
            continue
        assert t <= previous * (1 + 1e-9), budget
        previous = t
    assert math.isfinite(previous)


@pytest.mark.parametrize("budget", [40000, 45000, 60000])
def test_exact_partition_never_loses_to_any_classic_partition(budget):
    result = run(budget, pp=2)
    report = result.plan.search["partitions"]
    best = result.estimate.samples_per_s
    assert report["exact"]["samples_per_s"] == best
    assert set(report) == {"exact", "even", "memory", "time", "bmw-paper"}
    for kind, entry in report.items():
        if entry["samples_per_s"] is not None:
            assert best >= entry["samples_per_s"] * (1 - 1e-12), kind
            assert sum(entry["partition"]) == SPEC.num_layers
    for kind in ("even", "memory", "time", "bmw-paper"):
        try:
            other = run(budget, pp=2, partition=kind)
        except InfeasibleError:
            continue
        assert best >= other.estimate.samples_per_s * (1 - 1e-9), kind
        # A pinned kind is that partition's best plan: what the report says about it.
        if report[kind]["samples_per_s"] is not None:
            assert other.estimate.samples_per_s == pytest.approx(report[kind]["samples_per_s"])


def test_plan_json_round_trip_keeps_the_estimate(tmp_path):
    result = run(45000, optimality_gap=0.0)  # proven: the record says so
    path = tmp_path / "plan.json"
    result.plan.save(path)
    loaded = Plan.load(path)
    assert loaded == result.plan
    # JSON writes floats with repr, which reads back bit-exact: the estimate returns unchanged.
    assert loaded.estimate == result.plan.estimate
    assert loaded.estimate["iteration_time_s"] == result.estimate.iteration_time_s
    again = evaluate(loaded, SPEC, TrainingSpec(8), CLUSTER, round_profile(), 45000)
    assert again.to_dict()["iteration_time_s"] == pytest.approx(
        result.plan.estimate["iteration_time_s"])
    assert loaded.search["proven_optimal"] is True
    assert loaded.search["partitions"]["exact"]["partition"] == list(
        loaded.pipeline.layers_per_stage)


def test_infeasible_budget_states_the_least_memory_that_works():
    with pytest.raises(InfeasibleError, match=r"least memory .* needs is [0-9.]+ GB") as info:
        run(5000)
    message = str(info.value)
    assert "\n" not in message and "--memory-budget-gb" in message and "5000" not in message
    assert "0.000 GB per device is too small" in message
    least = info.value.min_memory_bytes
    assert least > 5000
    # That much memory is enough (the exhaustive tests check it is also within 1 %).
    assert run(math.ceil(least)).estimate.feasible


def test_decision_tree_counts_match_the_strategy_lists():
    # The documented counts (docs/planner.md §2) against the strategies the search uses,
    # summed over every pp, on a model every power of two divides.
    from megatron_auto.planner.search.spaces import (SpaceRules, decision_tree_counts,
                                                     layer_strategies)
    lt = LayerType("x", 1024, 64, 4096, 16, 1)
    for world, expected in ((8, 80), (16, 138), (32, 212), (64, 302)):
        listed = sum(len(layer_strategies(lt, world // pp, world, SpaceRules(), world))
                     for pp in (2 ** j for j in range(world.bit_length())) if pp <= world)
        counts = decision_tree_counts(world)
        assert counts["rule 4"] == counts["rule 3"] == listed == expected, world
        assert counts["branches"] > counts["rule 2"] > counts["rule 3"]
    # One node of 8: tp 16 and up leave the default space.
    assert decision_tree_counts(16, 8)["rule 4"] < decision_tree_counts(16)["rule 4"]


def test_baselines_are_reported_and_never_beat_the_full_space():
    result = search(SPEC, TrainingSpec(8), CLUSTER, round_profile(), 60000,
                    SearchOptions(**QUIET))
    assert set(result.baselines) == set(BASELINE_SPACES)
    for name, est in result.baselines.items():
        if est is not None:
            assert result.estimate.samples_per_s >= est.samples_per_s * (1 - 1e-9), name
    assert result.plan.search["baselines"].keys() == result.baselines.keys()


def test_restricted_spaces_produce_their_shape():
    dp = run(200000, space="dp").plan
    assert dp.pp_size == 1 and {(s.tp, s.dp_mode, s.recompute) for s in dp.layers} == {
        (1, "ddp", False)}
    mg = run(200000, space="megatron3d").plan
    assert mg.is_uniform() and mg.layers[0].dp_mode == "ddp"
    z3 = run(200000, space="zero3").plan
    assert {s.dp_mode for s in z3.layers} == {"zero3"}


def test_pins_are_respected():
    plan = run(60000, pp=2, num_microbatches=4, tp=2).plan
    assert plan.pp_size == 2 and plan.num_microbatches == 4
    assert {s.tp for s in plan.layers} == {2}


def test_multi_type_model_searches_and_plans_every_layer():
    enc = LayerType("enc", 64, 4, 256, 16, 3, causal=False)
    dec = LayerType("dec", 32, 4, 128, 16, 3)
    spec = ModelSpec.stacked([(enc, 3), (dec, 3)], vocab_size=64, embedding_hidden_size=64,
                             seq_length=16, name="encdec")
    training = TrainingSpec(8)
    profile = analytic_profile(spec, training, CLUSTER)
    result = search(spec, training, CLUSTER, profile, 10 ** 8,
                    SearchOptions(show_progress=False, include_baselines=False))
    assert result.plan.num_layers == 6
    assert result.estimate.feasible


@pytest.mark.parametrize("field, value, message", [
    ("space", "zero9", "space='zero9'"),
    ("schedule", "interleaved", "schedule='interleaved'"),
    ("pp", 0, "pp=0: must be a positive integer"),
    ("tp", 2.0, "tp=2.0: must be a positive integer"),
    ("dp_modes", ("fsdp",), "dp_modes"),
    ("partition", "greedy", "partition='greedy'"),
    ("partition", "bmw", "choose one of exact, even, memory, time, bmw-paper"),
])
def test_bad_options_name_the_option(field, value, message):
    with pytest.raises(ValueError, match=message):
        run(60000, **{field: value})


def test_search_is_deterministic():
    a, b = run(40000), run(40000)
    assert a.plan.layers == b.plan.layers
    assert a.plan.pipeline == b.plan.pipeline
    assert np.isclose(a.estimate.iteration_time_s, b.estimate.iteration_time_s)


def test_gpipe_schedule_and_batch_search():
    gp = run(60000, schedule="gpipe").plan
    assert gp.pipeline.schedule == "gpipe"
    one = run(60000)
    # Same time model, never less memory: GPipe can never beat 1F1B.
    assert one.estimate.samples_per_s >= run(60000, schedule="gpipe").estimate.samples_per_s * (
        1 - 1e-9)
    bsz = run(60000, search_batch_size=True)
    assert bsz.plan.global_batch_size in {1, 2, 4, 8, 16, 32, 64}
    assert bsz.estimate.samples_per_s >= one.estimate.samples_per_s * (1 - 1e-9)


def test_time_limit_still_returns_a_plan_and_says_it_is_not_proven():
    result = run(60000, time_limit_s=1e-6)
    assert result.estimate.feasible
    assert result.plan.search["time_limited"] is True
    assert result.plan.search["proven_optimal"] is False
    free = run(60000, optimality_gap=0.0)  # a finished exact search is proven
    assert free.plan.search["proven_optimal"] is True
    assert free.plan.search["time_limited"] is False
    assert free.estimate.samples_per_s >= result.estimate.samples_per_s * (1 - 1e-12)


def test_baselines_stop_at_the_time_limit_even_without_a_plan():
    # A comparison is cut at the deadline whether or not it found a plan; the answer is not.
    result = run(60000, time_limit_s=1e-6, include_baselines=True)
    assert result.estimate.feasible
    cut = result.plan.search["baselines_time_limited"]
    assert cut and set(cut) <= set(result.baselines)
    assert all(result.baselines[name] is None or result.baselines[name].feasible for name in cut)


def test_progress_goes_to_the_callback():
    calls = []
    run(60000, progress=lambda done, total, best: calls.append((done, total)))
    assert calls and all(0 <= done <= total for done, total in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)  # never goes back
    assert calls[-1][0] == calls[-1][1]  # the last call says every task is done


def test_no_plan_at_all_is_explained():
    odd = ModelSpec.uniform(2, 48, 3, 16, 64, name="gpt")  # 3 heads: no tp > 1 divides them
    with pytest.raises(InfeasibleError, match="space 'tp'"):
        search(odd, TrainingSpec(8), CLUSTER, round_profile(), 10 ** 6,
               SearchOptions(show_progress=False, include_baselines=False, space="tp"))


def test_pinned_choices_hold_even_when_a_baseline_would_be_faster():
    # A tiny model on 8 GPUs: pure DP (a baseline, pp=1) is fastest, but the user pinned pp=2.
    from megatron_auto.config import ModelConfig
    from megatron_auto.planner import ModelSpec, TrainingSpec, analytic_profile
    from megatron_auto.planner.inputs.presets import get_cluster

    cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                      vocab_size=512)
    spec, training = model_spec(cfg), TrainingSpec(16, "fp32")
    cluster = get_cluster("a100-40g-1x8")
    profile = analytic_profile(spec, training, cluster)
    free = search(spec, training, cluster, profile, 40 * 10**9, SearchOptions(show_progress=False))
    pinned = search(spec, training, cluster, profile, 40 * 10**9,
                    SearchOptions(pp=2, dp_modes=("zero2",), show_progress=False))
    assert free.plan.pp_size == 1
    assert pinned.plan.pp_size == 2
    assert all(layer.dp_mode == "zero2" for layer in pinned.plan.layers)
