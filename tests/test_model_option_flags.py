"""Megatron's --disable-bias-linear, --openai-gelu, --group-query-attention / --num-query-groups:
the flags, their errors, and what the planner counts for them (parameters, FLOPs, TP degrees).

The runtime side (every plan against one process) is tests/test_model_options.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_auto import arguments
from megatron_auto.config import ConfigError, ModelConfig
from megatron_auto.plan_source import make_plan
from megatron_auto.planner.inputs.presets import get_cluster
from megatron_auto.planner.inputs.model_spec import TrainingSpec
from megatron_auto.families.registry import model_spec
from megatron_auto.planner.inputs.profiles import analytic_profile

pytestmark = pytest.mark.pure

LLAMA_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
               "--ffn-hidden-size", "96", "--position-embedding-type", "rope", "--swiglu",
               "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights",
               "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2"]


def test_flags_map_onto_model_config():
    cfg = arguments.parse_run_config(LLAMA_FLAGS).model
    assert (cfg.add_bias_linear, cfg.query_groups, cfg.kv_size) == (False, 2, 16)
    assert not cfg.openai_gelu
    gpt2 = arguments.parse_run_config(["--openai-gelu"]).model
    assert gpt2.openai_gelu and gpt2.add_bias_linear
    assert gpt2.num_query_groups is None and gpt2.query_groups == 4  # multi-head attention
    # Megatron's default with --group-query-attention alone: one key/value head (MQA)
    assert arguments.parse_run_config(["--group-query-attention"]).model.query_groups == 1
    # as many groups as heads is multi-head attention, spelled one way
    assert arguments.parse_run_config(["--group-query-attention", "--num-query-groups", "4"]
                                      ).model == arguments.parse_run_config([]).model


@pytest.mark.parametrize("argv, message", [
    (["--num-query-groups", "2"],
     "--num-query-groups=2: needs --group-query-attention"),
    (["--openai-gelu", "--swiglu"], "--openai-gelu=True: selects the GeLU approximation"),
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-query-groups=3: must be a positive divisor of --num-attention-heads=4"),
    (["--group-query-attention", "--num-query-groups", "0"],
     "--num-query-groups=0: must be a positive divisor"),
])
def test_bad_combinations_name_the_flag(argv, message):
    with pytest.raises(ConfigError) as err:
        arguments.parse_run_config(argv)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_tensor_parallelism_must_keep_key_value_heads_whole():
    run = arguments.parse_run_config(LLAMA_FLAGS + ["--tensor-model-parallel-size", "4"])
    with pytest.raises(ConfigError, match=r"=4: must divide --num-query-groups=2"):
        make_plan(run.plan_source, run.model, 4)
    spec = model_spec(run.model)
    assert spec.max_common_tp() == 2  # 8 heads and 96 FFN would allow 8; 2 groups allow 2
    assert not spec.layer_types[0].tp_divides(4)


def test_planner_counts_parameters_of_the_options():
    for argv in (LLAMA_FLAGS, LLAMA_FLAGS + ["--add-qkv-bias"], ["--openai-gelu"],
                 ["--disable-bias-linear"], ["--add-qkv-bias"],
                 ["--group-query-attention", "--num-query-groups", "2", "--normalization",
                  "RMSNorm"]):
        cfg = arguments.parse_run_config(argv).model
        assert model_spec(cfg).layer_types[0].num_parameters == \
            cfg.num_layer_parameters()
    # by hand for the LLaMA shape: h=64, 8 heads of 8, 2 kv groups -> kv = 16, f = 96
    # QKV (64 + 32) x 64, output 64 x 64, gate+up 2 x 96 x 64, down 64 x 96, two RMSNorms 64
    cfg = arguments.parse_run_config(LLAMA_FLAGS).model
    assert cfg.num_layer_parameters() == 96 * 64 + 64 * 64 + 2 * 96 * 64 + 96 * 64 + 2 * 64
    # --add-qkv-bias (Qwen2): the QKV projection's 64 + 32 biases, no other
    qwen2 = arguments.parse_run_config(LLAMA_FLAGS + ["--add-qkv-bias"]).model
    assert qwen2.num_layer_parameters() - cfg.num_layer_parameters() == 96


def test_grouped_query_attention_lowers_flops_and_kept_bytes():
    mha = arguments.parse_run_config(LLAMA_FLAGS[:-3]).model
    gqa = arguments.parse_run_config(LLAMA_FLAGS).model
    cluster = get_cluster("a100-40g-1x8")
    training = TrainingSpec(global_batch_size=8, precision="bf16")
    p_mha = analytic_profile(model_spec(mha), training, cluster)
    p_gqa = analytic_profile(model_spec(gqa), training, cluster)
    (l_mha,), (l_gqa,) = p_mha.layer_types.values(), p_gqa.layer_types.values()
    s, h = 128, 64
    # keys and values shrink from h to kv = 16: 2 * s * 2h(h - kv) FLOPs fewer ...
    assert l_mha.flops_per_sample - l_gqa.flops_per_sample == 2 * s * 2 * h * (h - 16)
    # ... and K, V kept for backward (2 bytes each in bf16) shrink the same way
    assert l_mha.activation_split_bytes - l_gqa.activation_split_bytes == 2 * s * 2 * (h - 16)
    assert l_mha.parameter_count - l_gqa.parameter_count == 2 * h * (h - 16)


def test_add_qkv_bias_round_trips_through_the_script_flags():
    from megatron_auto.families.gpt.family import model_flags
    qwen2 = arguments.parse_run_config(LLAMA_FLAGS + ["--add-qkv-bias"]).model
    assert qwen2.add_qkv_bias and qwen2.qkv_bias and not qwen2.add_bias_linear
    assert arguments.parse_run_config(model_flags(qwen2)).model == qwen2
    # the plan record names it only when set: plans of other models stay as they were
    assert model_spec(qwen2).config["add_qkv_bias"] is True
    assert "add_qkv_bias" not in model_spec(arguments.parse_run_config([]).model).config


def test_configs_without_the_new_fields_load_as_before():
    """Plans and checkpoints written before these options exist read as the old model."""
    old = {k: v for k, v in ModelConfig().to_dict().items()
           if k not in ("add_bias_linear", "openai_gelu", "num_query_groups", "add_qkv_bias")}
    cfg = ModelConfig.from_dict(old)
    assert cfg == ModelConfig() and cfg.query_groups == cfg.num_attention_heads
    assert dataclasses.replace(cfg, num_attention_heads=8).query_groups == 8
