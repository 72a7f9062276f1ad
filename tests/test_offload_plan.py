"""Per-layer activation offload in the plan contract (plan_offload.py).

``layers[i].offload``: false (default, omitted by to_dict: files without it stay byte-identical),
true (every saved activation) or a list of modules (core_attn, mlp, norm); canonical forms;
bad values, offload of a recomputed module, and models that cannot offload: one line naming the
field, the value and the fix.
"""

from __future__ import annotations

import json

import pytest

from megatron_auto.config import ModelConfig
from megatron_auto.plan import LayerStrategy, Plan, PlanError

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("value, canonical", [
    (False, False), (True, True), ([], False), (["norm", "core_attn"], ("core_attn", "norm")),
    (("mlp",), ("mlp",)), (["mlp", "norm", "core_attn"], ("core_attn", "mlp", "norm")),
])
def test_offload_values_take_one_canonical_form(value, canonical):
    layer = LayerStrategy(offload=value)
    assert layer.offload == canonical
    assert layer.offload_modules == (frozenset() if isinstance(canonical, bool)
                                     else frozenset(canonical))


def _plan(offloads, recompute=False) -> Plan:
    plan = Plan.uniform(2, len(offloads), global_batch_size=4, num_microbatches=2,
                        recompute=recompute)
    data = plan.to_dict()
    for entry, value in zip(data["layers"], offloads):
        if value is not False:
            entry["offload"] = value
    return Plan.from_dict(data)


def test_plans_round_trip_and_files_without_offload_stay_byte_identical():
    plain = Plan.uniform(2, 3, global_batch_size=4, num_microbatches=2)
    text = plain.to_json()
    assert "offload" not in text
    assert _plan([False, False, False]).to_json() == text
    mixed = _plan([True, ["norm", "mlp"], False])
    data = mixed.to_dict()
    assert [layer.get("offload", "absent") for layer in data["layers"]] == [
        True, ["mlp", "norm"], "absent"]
    again = Plan.from_dict(json.loads(json.dumps(data)))
    assert again == mixed and again.to_json() == mixed.to_json()


@pytest.mark.parametrize("value, message", [
    (["mlp", "attention"], "plan field layers[0].offload=['mlp', 'attention']: unknown module "
                           "name(s) ['attention']; choose from core_attn, mlp, norm"),
    (["norm", "norm"], "plan field layers[0].offload=['norm', 'norm']: names a module twice"),
    ("all", "plan field layers[0].offload='all': must be true, false or a list of module names "
            "from core_attn, mlp, norm"),
    (1, "plan field layers[0].offload=1: must be true, false"),
])
def test_bad_offload_values_name_the_field(value, message):
    data = Plan.uniform(2, 2, global_batch_size=4, num_microbatches=2).to_dict()
    data["layers"][0]["offload"] = value
    with pytest.raises(PlanError) as err:
        Plan.from_dict(data)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("offload, recompute, message", [
    (True, True, "plan field layers[0].offload=true: the layer recomputes in full "
                 "(recompute=true) and keeps only its input"),
    (["mlp"], True, "plan field layers[0].offload=['mlp']: the layer recomputes in full"),
    (["core_attn", "mlp"], "selective", "plan field layers[0].offload=['core_attn', 'mlp']: "
                                        "module(s) ['core_attn'] are recomputed too"),
    (["norm"], ("mlp", "norm"), "module(s) ['norm'] are recomputed too"),
])
def test_offload_and_recompute_of_the_same_activations_is_refused(offload, recompute, message):
    with pytest.raises(PlanError) as err:
        _plan([offload, False], recompute=recompute)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_offload_combines_with_recompute_of_other_modules():
    plan = _plan([True, ["mlp", "norm"]], recompute="selective")
    assert [layer.offload for layer in plan.layers] == [True, ("mlp", "norm")]
    assert _plan([["core_attn"], False], recompute=("mlp",)).layers[0].offload == ("core_attn",)


CONFIG = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                     seq_length=8, max_position_embeddings=8, vocab_size=32)


def test_models_that_cannot_offload_refuse_it():
    from dataclasses import replace

    from megatron_auto.families.t5.config import T5Config
    t5 = T5Config(encoder_num_layers=1, decoder_num_layers=1, num_layers=2, hidden_size=16,
                  num_attention_heads=2, ffn_hidden_size=32, seq_length=8,
                  decoder_seq_length=8, vocab_size=32)
    with pytest.raises(PlanError, match=r"layers\[1\].offload=true: the t5 model does not "
                                         r"offload activations yet; set offload to false"):
        _plan([False, True]).validate(t5)
    te = replace(CONFIG, transformer_impl="transformer_engine")
    with pytest.raises(PlanError, match=r"layers\[0\].offload=\['norm'\]: the gpt model does "
                                         r"not offload"):
        _plan([["norm"], False]).validate(te)
    _plan([True, ["core_attn", "mlp", "norm"]]).validate(CONFIG)  # GPT, local layers: fine


def test_an_moe_layer_offloads_its_expert_block_only_with_the_whole_layer():
    from megatron_auto.families.gpt.config import MoEConfig
    moe = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                      seq_length=8, max_position_embeddings=8, vocab_size=32,
                      add_bias_linear=False, moe=MoEConfig(num_experts=2))
    with pytest.raises(PlanError, match=r"layers\[0\].offload=\['mlp'\]: an MoE layer's expert "
                                         r"block is offloaded with the whole layer only"):
        _plan([["mlp"], False]).validate(moe)
    _plan([True, ["core_attn", "norm"]]).validate(moe)
