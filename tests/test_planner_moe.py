"""The planner's MoE layer type and its cost terms (planner/cost/moe.py), by hand: the spec
builder's types, the EP all-to-alls' counts and bytes, the expert memory per ep, the capacity
factor, the TP collectives of an MoE layer without shared experts, the space's ep choices, the
Megatron flag export and the explain table."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_auto.config import ModelConfig
from megatron_auto.families.gpt.config import MoEConfig
from megatron_auto.families.gpt.family import model_spec
from megatron_auto.layout import layer_tp_collectives, make_layout
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.planner import TrainingSpec, analytic_profile, evaluate
from megatron_auto.planner.cost import moe as cost_moe
from megatron_auto.planner.cost.collectives import stage_collectives
from megatron_auto.planner.inputs.presets import make_cluster
from megatron_auto.planner.interop.megatron_flags import to_megatron_flags
from megatron_auto.planner.report import render_layers
from megatron_auto.planner.search.spaces import SpaceRules, layer_strategies

pytestmark = pytest.mark.pure

H, S, F_E, E, K = 64, 32, 256, 4, 2


def _config(layers=4, freq=1, shared=None, capacity=None) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=H, num_attention_heads=4,
                       ffn_hidden_size=128, seq_length=S, max_position_embeddings=S,
                       vocab_size=128, add_bias_linear=False, activation="swiglu",
                       moe=MoEConfig(num_experts=E, router_topk=K, ffn_hidden_size=F_E,
                                     layer_freq=freq, shared_expert_intermediate_size=shared,
                                     expert_capacity_factor=capacity))


def test_the_gpt_spec_builder_emits_an_moe_type_next_to_the_dense_one():
    spec = model_spec(_config(freq=2))
    dense, moe = spec.layer_types
    assert (dense.name, moe.name) == ("gpt", "gpt_moe")
    assert spec.layer_order == (1, 0, 1, 0)  # MoE every other layer from layer 0
    assert dense.moe is None and dense.ffn_hidden_size == 128
    assert moe.moe.num_experts == E and moe.moe.topk == K and moe.moe.ffn_hidden_size == F_E
    assert moe.ffn_hidden_size == 0  # no shared experts: no dense MLP
    only = model_spec(_config(shared=96))
    assert [t.name for t in only.layer_types] == ["gpt_moe"]
    assert only.layer_types[0].ffn_hidden_size == 96
    # the layer's own parameters: an MoE layer without shared experts has none of the MLP's,
    # and the router's E x h
    assert dense.num_parameters - moe.num_parameters == 3 * H * 128 - E * H
    assert cost_moe.expert_parameters(moe.moe, moe) == E * 3 * H * F_E


def _costs(ep, mode="ddp", expert_mode=None, capacity=None, samples=2.0, tp=1, n=4,
           recompute=False, precision="fp32"):
    spec = model_spec(_config(capacity=capacity))
    lt = spec.layer_types[0]
    cluster = make_cluster("a100-40g", 1, n)
    training = TrainingSpec(8, precision)
    profile = analytic_profile(spec, training, cluster).layer_types[lt.name]
    s = LayerStrategy(tp=tp, dp_mode=mode, ep=ep, expert_dp_mode=expert_mode,
                      recompute=recompute)
    layout = make_layout(tp, True, n)
    return lt, cost_moe.expert_costs(profile, lt, cluster, s, layout, n, samples, precision)


def test_expert_states_per_rank_halve_from_ep_1_to_ep_2():
    lt, one = _costs(1)
    _, two = _costs(2)
    experts = cost_moe.expert_parameters(lt.moe, lt)
    # ddp: 4 B parameter + 4 B gradient + 8 B Adam moments per local expert parameter
    def states(c):
        return c.memory.parameters + c.memory.gradients + c.memory.optimizer_states
    assert states(one) - states(two) == pytest.approx(16 * experts / 2)
    # zero3 experts over the expert-DP group of dp / ep = 2 ranks: a quarter of ep 1's ddp
    _, z3 = _costs(2, expert_mode="zero3")
    assert states(z3) == pytest.approx(16 * experts / 4)


def test_the_all_to_alls_priced_per_micro_batch():
    lt = model_spec(_config()).layer_types[0]
    layout = make_layout(1, True, 4)
    samples = 2.0
    none = cost_moe.moe_collectives(lt, LayerStrategy(), layout, 4, samples, 4)
    assert none == ((), ())
    fwd, bwd = cost_moe.moe_collectives(lt, LayerStrategy(ep=2), layout, 4, samples, 4)
    tokens = samples * S * K * H * 4  # every assignment's hidden state, fp32
    assert [c.kind for c in fwd + bwd] == ["all_to_all"] * 5
    assert [c.nbytes for c in fwd] == [8 * E, tokens, tokens]  # counts, dispatch, combine
    assert [c.nbytes for c in bwd] == [tokens, tokens]
    assert {c.group_size for c in fwd + bwd} == {2}
    _, again = cost_moe.moe_collectives(lt, LayerStrategy(ep=2, recompute=True), layout, 4,
                                        samples, 4)
    assert len(again) == 5  # full recompute re-runs the forward's three
    # under TP 2 (consecutive) the EP group's members are tp apart: strided over ep * tp ranks
    strided = cost_moe.moe_collectives(lt, LayerStrategy(tp=2, ep=2), make_layout(2, True, 8),
                                       8, samples, 4)[0][1]
    assert (strided.consecutive, strided.span) == (False, 4)


def test_expert_parallelism_adds_all_to_all_time_and_the_imbalance():
    _, one = _costs(1)
    _, two = _costs(2)
    assert one.time.ep_comm == 0.0 and two.time.ep_comm > 0.0
    # the busiest EP rank computes LOAD_IMBALANCE times the mean assignments
    assert two.time.compute > one.time.compute


def test_the_capacity_factor_caps_the_load():
    moe = model_spec(_config(capacity=1.0)).layer_types[0].moe
    assert cost_moe.load_factors(moe, 1) == (1.0, 1.0)
    assert cost_moe.load_factors(moe, 2) == (1.0, 1.0)  # no expert takes over its share
    dropless = model_spec(_config()).layer_types[0].moe
    assert cost_moe.load_factors(dropless, 2) == (1.0, cost_moe.LOAD_IMBALANCE)
    half = dataclasses.replace(dropless, capacity_factor=0.5)
    assert cost_moe.load_factors(half, 2) == (0.5, 0.5)
    _, capped = _costs(2, capacity=1.0)
    _, free = _costs(2)
    assert capped.time.compute < free.time.compute
    assert capped.memory.activations_per_microbatch < free.memory.activations_per_microbatch


def test_an_moe_layer_without_shared_experts_has_one_tp_all_reduce_each_way():
    layout = make_layout(2, True, 2)
    fwd, bwd = layer_tp_collectives(layout, 2, 1000.0, sequence_parallel=False, mlp=False)
    assert len(fwd) == len(bwd) == 1
    _, again = layer_tp_collectives(layout, 2, 1000.0, sequence_parallel=False, mlp=False,
                                    recompute=True)
    assert len(again) == 2
    dense = layer_tp_collectives(layout, 2, 1000.0, sequence_parallel=False)
    assert [len(x) for x in dense] == [2, 2]


def _plan(layers, world=4, model=None):
    return Plan(world_size=world, global_batch_size=8, num_microbatches=2,
                pipeline=PipelineSpec(size=1, schedule="1f1b", layers_per_stage=(len(layers),)),
                vocab=VocabStrategy(tp=1, dp_mode="ddp"), layers=tuple(layers), model=model)


def test_evaluate_prices_the_experts_and_the_census_lists_the_all_to_alls():
    config = _config(layers=2)
    spec = model_spec(config)
    training = TrainingSpec(8, "fp32")
    cluster = make_cluster("a100-40g", 1, 4)
    profile = analytic_profile(spec, training, cluster)
    one = evaluate(_plan([LayerStrategy()] * 2), spec, training, cluster, profile)
    two = evaluate(_plan([LayerStrategy(ep=2)] * 2), spec, training, cluster, profile)
    experts = cost_moe.expert_parameters(spec.layer_types[0].moe, spec.layer_types[0])
    stage_one, stage_two = one.stages[0].memory_breakdown, two.stages[0].memory_breakdown
    assert stage_one["parameters"] - stage_two["parameters"] == pytest.approx(
        2 * 4 * experts / 2)
    counts = stage_collectives(_plan([LayerStrategy(ep=2)] * 2), spec, profile, "fp32", 0)
    a2a = {c: n for c, n in counts.items() if c.kind == "all_to_all"}
    # two layers x two micro-batches x (3 forward + 2 backward), 2 of them the counts
    assert sum(a2a.values()) == 2 * 2 * 5
    assert sum(n for c, n in a2a.items() if c.nbytes == 8 * E) == 2 * 2


def test_the_space_offers_ep_on_moe_layers_only():
    spec = model_spec(_config(freq=2))
    dense, moe = spec.layer_types
    rules = SpaceRules(sequence_parallel=(False, True))
    assert {s.ep for s in layer_strategies(dense, 8, 8, rules, 8)} == {1}
    moes = layer_strategies(moe, 8, 8, rules, 8)
    assert not any(s.sequence_parallel for s in moes)
    assert {s.ep for s in moes if s.tp == 1} == {1, 2, 4}  # powers of two dividing E = 4
    assert {s.ep for s in moes if s.tp == 4} == {1, 2}  # ... and dp = 2
    # the experts' own DP flavour only where dp / ep > 1 ranks share them
    assert all(s.expert_dp_mode is None for s in moes if s.tp * s.ep == 8)
    assert {s.expert_dp_mode for s in moes if s.tp == 1 and s.ep == 2 and s.dp_mode == "ddp"
            and not s.recompute} == {None, "zero1", "zero2", "zero3"}
    pinned = layer_strategies(moe, 8, 8, SpaceRules(eps=(1,), expert_dp_modes=False), 8)
    assert {(s.ep, s.expert_dp_mode) for s in pinned} == {(1, None)}


def test_megatron_flags_export_one_expert_parallel_size():
    record = model_spec(_config(layers=2, freq=2)).plan_model_record()
    flags, reasons = to_megatron_flags(_plan([LayerStrategy(ep=2), LayerStrategy()],
                                             model=record))
    assert reasons == []
    assert flags[flags.index("--expert-model-parallel-size") + 1] == "2"
    _, reasons = to_megatron_flags(_plan([LayerStrategy(ep=2, expert_dp_mode="zero3")] * 2))
    assert any("expert_dp_mode" in r for r in reasons)
    _, reasons = to_megatron_flags(_plan([LayerStrategy(ep=2), LayerStrategy(ep=4)]))
    assert any("--expert-model-parallel-size" in r for r in reasons)


def test_explain_shows_ep():
    text = render_layers(_plan([LayerStrategy(ep=2, expert_dp_mode="zero3"), LayerStrategy()]))
    header, _, first, second = text.splitlines()[:4]
    assert "ep" in header.split()
    assert "2 zero3" in first and " 1 " in second
    assert "ep" not in render_layers(_plan([LayerStrategy()] * 2)).splitlines()[0].split()


def _search_moe(**options):
    """The search's answer for a 2-layer MoE model on 4 devices, 100 MB each."""
    from megatron_auto.planner import SearchOptions, search

    spec = model_spec(_config(layers=2))
    training = TrainingSpec(8, "fp32")
    cluster = dataclasses.replace(make_cluster("a100-40g", 1, 4), memory_reserve_bytes=10 ** 5,
                                  device_memory_bytes=10 ** 8)
    profile = analytic_profile(spec, training, cluster)
    return search(spec, training, cluster, profile, 10 ** 8,
                  SearchOptions(show_progress=False, include_baselines=False,
                                report_partitions=False, **options))


def test_the_search_pins_ep_and_otherwise_chooses_it_per_layer():
    from megatron_auto.planner import SearchOptions

    eps = {}
    for pin in (1, 2, 4, None):
        result = _search_moe(expert_parallel=pin)
        eps[pin] = {s.ep for s in result.plan.layers}
        if pin is not None:
            assert eps[pin] == {pin}
    with pytest.raises(ValueError, match=r"^search option expert_parallel=0: "):
        SearchOptions(expert_parallel=0).validate()


def _etp_costs(etp, ep=1, tp=2, n=4):
    spec = model_spec(_config())
    lt = spec.layer_types[0]
    cluster = make_cluster("a100-40g", 1, n)
    training = TrainingSpec(8, "fp32")
    profile = analytic_profile(spec, training, cluster).layer_types[lt.name]
    s = LayerStrategy(tp=tp, ep=ep, expert_tp=etp)
    return lt, cost_moe.expert_costs(profile, lt, cluster, s, make_layout(tp, True, n), n, 2.0,
                                     "fp32")


def test_expert_tp_splits_the_experts_and_adds_an_all_reduce_each_way():
    lt, one = _etp_costs(1)
    _, two = _etp_costs(2)
    experts = cost_moe.expert_parameters(lt.moe, lt)

    def states(c):
        return c.memory.parameters + c.memory.gradients + c.memory.optimizer_states
    assert states(one) == pytest.approx(16 * experts)  # ddp, replicated over the TP ranks
    assert states(two) == pytest.approx(16 * experts / 2)
    assert two.memory.activations_per_microbatch < one.memory.activations_per_microbatch
    assert two.time.compute < one.time.compute  # half of every expert's matmuls
    layout = make_layout(2, True, 4)
    tokens = 1.0 * S * K * H * 4  # one sample's assignments' hidden states, fp32
    fwd, bwd = cost_moe.moe_collectives(lt, LayerStrategy(tp=2, expert_tp=2), layout, 4, 1.0, 4)
    assert [(c.kind, c.group_size, c.nbytes, c.consecutive) for c in fwd + bwd] == \
        [("all_reduce", 2, tokens, True)] * 2
    # with EP: between the dispatch and the combine, and between the two backward exchanges
    fwd, bwd = cost_moe.moe_collectives(lt, LayerStrategy(tp=2, ep=2, expert_tp=2),
                                        make_layout(2, True, 8), 8, 1.0, 4)
    assert [c.kind for c in fwd] == ["all_to_all", "all_to_all", "all_reduce", "all_to_all"]
    assert [c.kind for c in bwd] == ["all_to_all", "all_reduce", "all_to_all"]
    # a strided TP layout: the expert-TP members are dp apart
    strided = cost_moe.moe_collectives(lt, LayerStrategy(tp=4, expert_tp=2, tp_consecutive=False),
                                       make_layout(4, False, 8), 8, 1.0, 4)[0][0]
    assert (strided.consecutive, strided.span) == (False, 4)


def test_the_space_offers_expert_tp_within_the_layer_tp():
    moe = model_spec(_config()).layer_types[0]
    rules = SpaceRules()
    strategies = layer_strategies(moe, 8, 8, rules, 8)
    assert {s.expert_tp for s in strategies if s.tp == 1} == {1}
    assert {s.expert_tp for s in strategies if s.tp == 4} == {1, 2, 4}
    pinned = layer_strategies(moe, 8, 8, SpaceRules(expert_tps=(1,)), 8)
    assert {s.expert_tp for s in pinned} == {1}


def test_explain_shows_expert_tp():
    text = render_layers(_plan([LayerStrategy(tp=2, expert_tp=2), LayerStrategy(tp=2)]))
    header, _, first, second = text.splitlines()[:4]
    assert "ep" in header.split()
    assert "1 x2" in first and "x2" not in second


def test_the_search_pins_expert_tp():
    from megatron_auto.planner import SearchOptions

    for pin in (1, 2, 4):
        result = _search_moe(expert_tensor_parallel=pin, tp=4)
        assert {s.expert_tp for s in result.plan.layers} == {pin}
    with pytest.raises(ValueError, match=r"^search option expert_tensor_parallel=0: "):
        SearchOptions(expert_tensor_parallel=0).validate()
