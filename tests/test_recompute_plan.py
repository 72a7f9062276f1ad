"""Per-layer recompute granularity in the plan contract and Megatron's recompute flags.

``layers[i].recompute``: true/false (whole layer / nothing, as before), "none", "selective",
"full" or a list of modules (core_attn, mlp, norm); canonical forms, old files unchanged, bad
values one line naming the field; Megatron's ``--recompute-granularity selective
--recompute-modules`` build the same plans and are written back.
"""

from __future__ import annotations

import json

import pytest

from megatron_auto.plan import LayerStrategy, Plan, PlanError
from megatron_auto.plan_recompute import normalize_recompute
from megatron_auto.planner.interop.galvatron import plan_to_galvatron_config
from megatron_auto.planner.interop.megatron_flags import (MegatronFlagError,
                                                          plan_from_megatron_flags,
                                                          to_megatron_flags)

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("value, canonical", [
    (False, False), (True, True), ("none", False), ("full", True), ("selective", "selective"),
    (["core_attn"], "selective"), ([], False), (["norm", "mlp"], ("mlp", "norm")),
    (["mlp", "core_attn", "norm"], ("core_attn", "mlp", "norm")), (("mlp",), ("mlp",)),
])
def test_recompute_values_take_one_canonical_form(value, canonical):
    assert normalize_recompute(value) == canonical
    assert LayerStrategy(recompute=value).recompute == canonical


def test_module_properties():
    full, sel, mods = (LayerStrategy(recompute=v) for v in (True, "selective", ["mlp", "norm"]))
    assert full.full_recompute and not full.recompute_modules
    assert not sel.full_recompute and sel.recompute_modules == {"core_attn"}
    assert mods.recompute_modules == {"mlp", "norm"}
    assert not LayerStrategy().recompute_modules and not LayerStrategy().full_recompute


def _plan(values) -> Plan:
    return Plan.uniform(2, len(values), global_batch_size=4, num_microbatches=2,
                        recompute=list(values))


def test_plans_round_trip_and_old_files_stay_byte_identical():
    old = _plan([False, True, False])
    text = old.to_json()
    assert '"recompute": false' in text and '"recompute": true' in text
    assert Plan.from_dict(json.loads(text)).to_json() == text  # unchanged bytes
    new = _plan(["none", "selective", ["norm", "mlp"], "full"])
    data = new.to_dict()
    assert [layer["recompute"] for layer in data["layers"]] == [False, "selective",
                                                                ["mlp", "norm"], True]
    assert Plan.from_dict(json.loads(json.dumps(data))) == new
    # one module tuple applies to every layer
    assert {layer.recompute for layer in Plan.uniform(1, 2, global_batch_size=2,
                                                      recompute=("mlp",)).layers} == {("mlp",)}


@pytest.mark.parametrize("value, message", [
    ("half", "plan field layers[0].recompute='half': choose true, false, one of none, "
             "selective, full, or a list of modules from core_attn, mlp, norm"),
    (["mlp", "attention"], "plan field layers[0].recompute=['mlp', 'attention']: unknown module "
                           "name(s) ['attention']; choose from core_attn, mlp, norm"),
    (["mlp", "mlp"], "names a module twice"),
    (3, "plan field layers[0].recompute=3: must be true, false, one of none, selective, full"),
])
def test_bad_recompute_values_name_the_field(value, message):
    data = _plan([False]).to_dict()
    data["layers"][0]["recompute"] = value
    with pytest.raises(PlanError) as err:
        Plan.from_dict(data)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_models_without_module_recompute_refuse_it():
    from megatron_auto.families.t5.config import T5Config
    t5 = T5Config(encoder_num_layers=1, decoder_num_layers=1, num_layers=2, hidden_size=16,
                  num_attention_heads=2, ffn_hidden_size=32, seq_length=8,
                  decoder_seq_length=8, vocab_size=32)
    with pytest.raises(PlanError, match=r"layers\[1\].recompute='selective': the t5 model "
                                         r"recomputes whole layers only; use true or false"):
        _plan([True, "selective"]).validate(t5)
    _plan([True, False]).validate(t5)


def _flags(**kwargs) -> Plan:
    base = dict(world_size=4, num_layers=4, global_batch_size=8, micro_batch_size=1,
                tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    base.update(kwargs)
    return plan_from_megatron_flags(**base)


def test_megatron_selective_flags_build_module_plans_and_are_written_back():
    plan = _flags(recompute_granularity="selective")
    assert {layer.recompute for layer in plan.layers} == {"selective"}
    flags, reasons = to_megatron_flags(plan)
    assert reasons == []
    assert flags[-4:] == ["--recompute-granularity", "selective", "--recompute-modules",
                          "core_attn"]
    plan = _flags(recompute_granularity="selective", recompute_modules=["layernorm", "mlp"])
    assert {layer.recompute for layer in plan.layers} == {("mlp", "norm")}
    flags, _ = to_megatron_flags(plan)
    assert flags[-5:] == ["--recompute-granularity", "selective", "--recompute-modules", "mlp",
                          "layernorm"]
    again = _flags(recompute_granularity="selective", recompute_modules=flags[-2:])
    assert again.layers == plan.layers
    # full block recompute stays what it was
    block = _flags(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    assert [layer.recompute for layer in block.layers] == [True, False, True, False]


def test_plans_megatron_cannot_say_give_reasons():
    mixed = _flags(recompute_granularity="selective")
    layers = list(mixed.layers)
    layers[1] = LayerStrategy(tp=2, recompute=["mlp"])
    flags, reasons = to_megatron_flags(Plan(**{**mixed.__dict__, "layers": tuple(layers)}))
    assert flags is None
    assert "module recompute on layers 0-3 is not the same modules on every layer" in reasons[0]
    config, reasons = plan_to_galvatron_config(mixed)
    assert config is None and "recompute single modules" in "\n".join(reasons)


@pytest.mark.parametrize("kwargs, message", [
    (dict(recompute_granularity="selective", recompute_modules=["moe_act"]),
     "--recompute-modules=moe_act: unknown moe_act; choose from core_attn, mlp, layernorm"),
    (dict(recompute_modules=["mlp"]),
     "--recompute-modules=mlp: needs --recompute-granularity selective"),
    (dict(recompute_granularity="full", recompute_modules=["mlp"]),
     "--recompute-modules=mlp: needs --recompute-granularity selective"),
    (dict(recompute_granularity="selective", recompute_method="block"),
     "--recompute-method=block: Megatron takes it with --recompute-granularity full only"),
    (dict(recompute_granularity="selective", recompute_num_layers=1),
     "--recompute-num-layers=1: Megatron takes it with --recompute-granularity full only"),
])
def test_bad_recompute_flags_name_the_flag(kwargs, message):
    with pytest.raises(MegatronFlagError) as err:
        _flags(**kwargs)
    assert message in str(err.value)


def test_reports_and_logs_name_the_granularity():
    from megatron_auto.planner.report import render_layers
    plan = _plan([True, "selective", ["mlp", "norm"]])
    table = render_layers(plan)
    assert "yes" in table and "selective" in table and "mlp+norm" in table


def test_cost_model_orders_each_granularity_between_none_and_full():
    """Memory: full < selective/mlp < none; time: none < selective/mlp < full (an analytic
    profile of a GPT whose score matrices are large; the CPU measurement of the memory terms is
    tests/test_recompute_memory.py)."""
    from planner_fakes import FakeCluster

    from megatron_auto.config import ModelConfig
    from megatron_auto.families.registry import model_spec
    from megatron_auto.planner.cost.estimate import evaluate_plan
    from megatron_auto.planner.inputs.model_spec import TrainingSpec
    from megatron_auto.planner.inputs.profiles import analytic_profile

    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8,
                         ffn_hidden_size=256, seq_length=256, max_position_embeddings=256,
                         vocab_size=256)
    spec, training = model_spec(config), TrainingSpec(global_batch_size=8, precision="fp32")
    cluster = FakeCluster(devices_per_node=2, memory_reserve_bytes=0)
    profile = analytic_profile(spec, training, cluster)
    out = {}
    for value in (False, "selective", ("mlp",), ("core_attn", "mlp"), True):
        plan = Plan.uniform(2, 2, global_batch_size=8, num_microbatches=2, tp=2,
                            recompute=value)
        est = evaluate_plan(plan, spec, training, cluster, profile)
        out[value] = (est.stages[0].peak_memory_bytes, est.iteration_time_s)
    mem = {k: v[0] for k, v in out.items()}
    time = {k: v[1] for k, v in out.items()}
    for partial in ("selective", ("mlp",), ("core_attn", "mlp")):
        assert mem[True] < mem[partial] < mem[False], (partial, mem)
        assert time[False] < time[partial] < time[True], (partial, time)
    assert mem[("core_attn", "mlp")] < min(mem["selective"], mem[("mlp",)])
