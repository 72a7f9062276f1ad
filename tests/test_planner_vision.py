"""The planner's view of the image classifiers: layer types per Swin stage, window attention in
the analytic profile, and searched plans the runtime accepts (pure: no torch.distributed)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_auto.planner import ModelSpec, SearchOptions, TrainingSpec, analytic_profile, search
from megatron_auto.families.registry import model_spec
from megatron_auto.planner.inputs.presets import get_cluster
from megatron_auto.families.vision.config import SWIN_PRESETS, VisionConfig

pytestmark = pytest.mark.pure


def swin(preset: str, img: int = 224) -> VisionConfig:
    embed, depths, heads = SWIN_PRESETS[preset]
    return VisionConfig(model_type="swin", img_h=img, img_w=img, patch_dim=4,
                        swin_embed_dim=embed, swin_depths=depths, swin_num_heads=heads,
                        swin_window_size=7, num_classes=1000)


VIT_BASE = VisionConfig(model_type="vit", img_h=224, img_w=224, patch_dim=16, num_layers=12,
                        hidden_size=768, num_attention_heads=12, num_classes=1000)


def _total_parameters(spec: ModelSpec) -> int:
    return (sum(spec.layer_type(i).num_parameters for i in range(spec.num_layers))
            + spec.embedding_parameters + spec.head_parameters)


def test_swin_tiny_layer_types_follow_the_stages():
    spec = model_spec(swin("tiny"))
    assert [(t.name, t.count, t.seq_length, t.hidden_size, t.num_attention_heads,
             t.merge_input_hidden) for t in spec.layer_types] == [
        ("swin1", 2, 3136, 96, 3, 0), ("swin2_merge", 1, 784, 192, 6, 96),
        ("swin2", 1, 784, 192, 6, 0), ("swin3_merge", 1, 196, 384, 12, 192),
        ("swin3", 5, 196, 384, 12, 0), ("swin4_merge", 1, 49, 768, 24, 384),
        ("swin4", 1, 49, 768, 24, 0)]
    assert spec.layer_order[:4] == (0, 0, 1, 2) and spec.num_layers == 12
    # stage 4's 7x7 map is one window; every stage's window is 7
    assert {t.window_size for t in spec.layer_types} == {7}


@pytest.mark.parametrize("cfg", [VIT_BASE, swin("tiny"), swin("huge")], ids=["vit-b16", "swin-t",
                                                                             "swin-huge"])
def test_spec_counts_every_parameter_of_the_runtime_model(cfg):
    # VisionConfig.num_parameters equals the runtime stages' parameters (test_vit/test_swin)
    assert _total_parameters(model_spec(cfg)) == cfg.num_parameters()


def test_analytic_profile_charges_window_attention_per_window():
    cfg = swin("tiny")
    spec = model_spec(cfg)
    # the math SDPA kernel, which stores the scores (presets price flash: docs/cost_model.md §9)
    math_cluster = dataclasses.replace(get_cluster("a100-40g-1x8"), attention_backend="math")
    profile = analytic_profile(spec, TrainingSpec(8, precision="bf16"), math_cluster)
    stage1 = profile.layer_types["swin1"]
    # the same layer with full attention over its 3136 tokens
    full_type = dataclasses.replace(spec.layer_types[0], window_size=0)
    full = analytic_profile(dataclasses.replace(spec, layer_types=(full_type,) + spec.layer_types[1:]),
                            TrainingSpec(8, precision="bf16"), math_cluster)
    full1 = full.layer_types["swin1"]
    s, h, a = 3136, 96, 3
    # scores + weighted sum: 4 s k h FLOPs with k = 49 window tokens instead of s
    assert full1.flops_per_sample - stage1.flops_per_sample == pytest.approx(4 * s * (s - 49) * h)
    # softmax output, its dropout mask and the attention output per head: (2*2+1) a s k bytes
    assert full1.activation_split_bytes - stage1.activation_split_bytes == pytest.approx(
        5 * a * s * (s - 49))
    # the layer FLOPs add up to the model's (VisionConfig counts them independently)
    layer_flops = sum(profile.layer_types[spec.layer_type(i).name].flops_per_sample
                      for i in range(spec.num_layers))
    head = 2 * cfg.final_hidden_size * cfg.num_classes
    embed = 2 * cfg.num_patches * cfg.patch_size_flat * cfg.embedding_hidden_size
    assert layer_flops + head + embed == pytest.approx(cfg.forward_flops_per_sample())


@pytest.mark.parametrize("cfg", [VIT_BASE, swin("tiny")], ids=["vit-b16", "swin-t"])
def test_search_gives_plans_the_runtime_accepts(cfg):
    spec = model_spec(cfg)
    cluster = get_cluster("a100-40g-1x8")
    training = TrainingSpec(64, precision="bf16")
    profile = analytic_profile(spec, training, cluster)
    result = search(spec, training, cluster, profile, cluster.budget_bytes(None), SearchOptions())
    plan = result.plan
    plan.validate(cfg)  # every layer's tp divides that layer's heads and FFN (Swin-T: 3 heads)
    if cfg.model_type == "swin" and cfg.swin_num_heads[0] % 2:
        assert all(plan.layers[i].tp == 1 for i in range(cfg.swin_depths[0]))
    assert result.estimate.iteration_time_s > 0
