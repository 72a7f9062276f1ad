"""The search's new dimensions: ZeRO-1 and sequence parallelism per layer, interleaving (the
virtual size) per plan. On small problems where each is the best choice under the cost model,
the search picks it and beats the same search without it; pins hold; the strategy space
offers SP only where the runtime can run it."""

from __future__ import annotations

import pytest

from megatron_auto.plan import PlanError
from megatron_auto.planner import LayerType, ModelSpec, SearchOptions, TrainingSpec, evaluate
from megatron_auto.planner.cost.interleaving import pinned_virtual_sizes
from megatron_auto.planner.search.driver import InfeasibleError, interleaved_variant, search
from megatron_auto.planner.search.spaces import SpaceRules, layer_strategies

from planner_fakes import FakeCluster, round_profile

pytestmark = pytest.mark.pure

CLUSTER = FakeCluster(devices_per_node=2)
QUIET = dict(show_progress=False, memory_step_bytes=64, include_baselines=False)
SPEC4 = ModelSpec.uniform(4, 64, 4, 16, 64, name="gpt")


def _search(spec, batch, budget, **options):
    return search(spec, TrainingSpec(batch, "fp32"), CLUSTER, round_profile("fp32"), budget,
                  SearchOptions(**QUIET, **options))


def test_zero1_is_chosen_where_it_is_the_best_flavour():
    # 2 ranks, tp 1 (dp 2), 4 layers of 1000 parameters, m = 2, 70000 B: every ddp layer needs
    # 16000 B of states (too much for four of them), zero1 12000 like zero2, but it
    # reduce-scatters once per iteration instead of once per micro-batch.
    free = _search(SPEC4, 8, 70000, pp=1, tp=1, num_microbatches=2)
    without = _search(SPEC4, 8, 70000, pp=1, tp=1, num_microbatches=2,
                      dp_modes=("ddp", "zero2", "zero3"))
    assert {layer.dp_mode for layer in free.plan.layers} == {"zero1"}
    assert free.estimate.samples_per_s > without.estimate.samples_per_s * 1.1
    assert free.estimate.feasible
    pinned = _search(SPEC4, 8, 70000, pp=1, tp=1, num_microbatches=2, dp_modes=("zero1",))
    assert all(layer.dp_mode == "zero1" for layer in pinned.plan.layers)


def test_sequence_parallelism_is_chosen_where_activations_bind():
    # tp 2 on 2 ranks, 64 samples per micro-batch: 100 B kept per sample and layer are 6400 B
    # without SP, 3200 B with it; at 60000 B without recompute nothing fits unless some layers
    # run SP (with recompute allowed, recomputing two layers is the faster way here: the exact
    # search prices both and takes recompute).
    free = _search(SPEC4, 64, 60000, pp=1, tp=2, num_microbatches=1, allow_recompute=False)
    assert any(layer.sequence_parallel for layer in free.plan.layers)
    with pytest.raises(InfeasibleError):
        _search(SPEC4, 64, 60000, pp=1, tp=2, num_microbatches=1, sequence_parallel=False,
                allow_recompute=False)
    roomy = _search(SPEC4, 64, 70000, pp=1, tp=2, num_microbatches=1, allow_recompute=False)
    assert free.estimate.samples_per_s < roomy.estimate.samples_per_s
    # the estimate is evaluate's: the SP plan as written prices the same
    again = evaluate(free.plan, SPEC4, TrainingSpec(64, "fp32"), CLUSTER, round_profile("fp32"),
                     60000)
    assert again.samples_per_s == pytest.approx(free.estimate.samples_per_s) and again.feasible
    pinned = _search(SPEC4, 64, 10 ** 6, pp=1, tp=2, num_microbatches=1, sequence_parallel=True)
    assert all(layer.sequence_parallel for layer in pinned.plan.layers)


def test_interleaving_is_chosen_where_the_bubble_dominates():
    # pp 2 on 2 ranks, 8 layers, m = 2: the bubble (p - 1) C is half the steady time; v = 2
    # halves it for one more 50 B hop per micro-batch and stage.
    spec = ModelSpec.uniform(8, 64, 4, 16, 64, name="gpt")
    free = _search(spec, 8, 10 ** 6, pp=2, num_microbatches=2)
    plain = _search(spec, 8, 10 ** 6, pp=2, num_microbatches=2, virtual_sizes=(1,))
    assert free.plan.virtual_size == 2 and plain.plan.virtual_size == 1
    assert free.estimate.samples_per_s > plain.estimate.samples_per_s
    tried = free.plan.search["partition"]["virtual_size_samples_per_s"]
    assert set(tried) == {"1", "2", "4"} and max(tried.values()) == tried["2"]
    # pinned: only interleaved plans come out
    pinned = _search(spec, 8, 10 ** 6, pp=2, virtual_sizes=(4,))
    assert pinned.plan.virtual_size == 4 and pinned.plan.num_microbatches % 2 == 0


def test_interleaved_variant_keeps_each_stage_its_layers_and_strategies():
    plan = _search(ModelSpec.uniform(6, 64, 4, 16, 64, name="gpt"), 8, 10 ** 6, pp=2,
                   num_microbatches=2, virtual_sizes=(1,)).plan
    variant = interleaved_variant(plan, 2)
    assert variant is not None and variant.virtual_size == 2
    for k in range(2):
        assert sorted(variant.layers[i].tp for i in variant.stage_layers(k)) == \
            sorted(plan.layers[i].tp for i in plan.stage_layers(k))
        assert len(variant.stage_layers(k)) == len(plan.stage_layers(k))
    assert interleaved_variant(plan, 4) is None  # 3 layers per stage: not 4 chunks


def test_pinned_virtual_size_from_megatrons_flag():
    assert pinned_virtual_sizes(None, None, 8) == (1, 2, 4)
    assert pinned_virtual_sizes(2, 2, 8) == (2,)
    with pytest.raises(ValueError, match="--num-layers-per-virtual-pipeline-stage=3: "
                                         "--num-layers=8 must be a multiple of pp x 3"):
        pinned_virtual_sizes(3, 2, 8)
    with pytest.raises(ValueError, match="needs --pipeline-model-parallel-size"):
        pinned_virtual_sizes(2, None, 8)


def test_space_offers_sequence_parallelism_only_where_it_runs():
    lt = LayerType(name="gpt", hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                   seq_length=6, count=1)
    both = SpaceRules(sequence_parallel=(False, True), allow_recompute=False, dp_modes=("ddp",))
    found = {(s.tp, s.sequence_parallel) for s in layer_strategies(lt, 4, 4, both, 4)}
    # tp 2 divides the 6-token sequence, tp 4 does not; tp 1 never takes SP
    assert found == {(1, False), (2, False), (2, True), (4, False)}
    on = SpaceRules(sequence_parallel=(True,), allow_recompute=False, dp_modes=("ddp",))
    assert {(s.tp, s.sequence_parallel) for s in layer_strategies(lt, 4, 4, on, 4)} == \
        {(1, False), (2, True), (4, False)}
    # zero1 is a flavour of the default space; with dp = 1 only ddp is kept
    default = {(s.tp, s.dp_mode) for s in layer_strategies(lt, 2, 2, SpaceRules(), 2)}
    assert (1, "zero1") in default and (2, "zero1") not in default


def test_bad_virtual_sizes_option_names_it():
    with pytest.raises(ValueError, match="search option virtual_sizes=\\(0,\\)"):
        SearchOptions(virtual_sizes=(0,)).validate()
    with pytest.raises(PlanError):  # sanity: an interleaved plan needs pp > 1
        from megatron_auto.plan import Plan
        Plan.uniform(1, 4, global_batch_size=2, virtual_size=2)
