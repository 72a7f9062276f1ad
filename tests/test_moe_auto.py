"""``pretrain_gpt.py --num-experts 4 --auto-parallel`` end to end on 2 gloo ranks: the model
profiler measures the dense layer, the MoE layer type is derived on the measured clock
(profiles.with_analytic_layer_types), the search chooses per-layer ep, and the plan trains."""

from __future__ import annotations

import math

import pytest

from harness import metrics_records, run_main

pytestmark = pytest.mark.multirank

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "256",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "8",
         "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
         "--disable-bias-linear", "--lr", "1e-3", "--log-interval", "1", "--mock-data"]


def test_moe_auto_parallel_plans_and_trains(tmp_path):
    from megatron_auto.plan import Plan

    metrics, plan_out = tmp_path / "m.jsonl", tmp_path / "plan.json"
    argv = [*MODEL, "--auto-parallel", "--train-iters", "3", "--metrics-file", str(metrics),
            "--plan-out", str(plan_out)]
    assert run_main("pretrain_gpt", 2, argv,
                    env={"MEGATRON_AUTO_CACHE": str(tmp_path / "cache")},
                    timeout_s=600) == [0, 0]
    plan = Plan.load(plan_out)
    assert plan.world_size == 2 and plan.estimate is not None
    assert all(layer.ep in (1, 2) for layer in plan.layers)
    records = metrics_records(metrics)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["lm_loss"]) for r in records)
    assert all(len(r["moe_tokens_per_expert"]) == 2 for r in records)  # both layers are MoE


def test_derived_layer_types_run_on_the_measured_clock():
    from dataclasses import replace

    from megatron_auto.config import ModelConfig, MoEConfig
    from megatron_auto.families.registry import model_spec
    from megatron_auto.planner.inputs.model_spec import TrainingSpec
    from megatron_auto.planner.inputs.presets import make_cluster
    from megatron_auto.planner.inputs.profiles import analytic_profile, with_analytic_layer_types

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                      seq_length=16, max_position_embeddings=16, vocab_size=256,
                      add_bias_linear=False,
                      moe=MoEConfig(num_experts=4, router_topk=2, layer_freq=(0, 1)))
    spec = model_spec(cfg)
    training = TrainingSpec(8, "fp32")
    cluster = make_cluster("a100-40g", 1, 2)
    full = analytic_profile(spec, training, cluster)
    assert sorted(full.layer_types) == ["gpt", "gpt_moe"]
    # a "measured" profile: the dense layer only, at 3x the analytic time
    dense = full.layer_types["gpt"]
    measured = replace(full, source="measured", layer_types={"gpt": replace(
        dense, forward_time_per_sample_s=3 * dense.forward_time_per_sample_s)})
    done = with_analytic_layer_types(measured, spec, training, cluster)
    moe, derived = full.layer_types["gpt_moe"], done.layer_types["gpt_moe"]
    assert done.layer_types["gpt"] == measured.layer_types["gpt"]  # measured entries kept
    assert derived.forward_time_per_sample_s == pytest.approx(3 * moe.forward_time_per_sample_s)
    assert derived.activation_split_bytes == moe.activation_split_bytes  # bytes from shapes
    assert done.metadata["analytic_layer_types"] == ["gpt_moe"]
    assert done.metadata["analytic_time_scale"] == pytest.approx(3.0)
    assert with_analytic_layer_types(done, spec, training, cluster) is done
