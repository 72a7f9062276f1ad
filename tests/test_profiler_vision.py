"""The model profiler on the image classifiers: every layer type measured, the search takes it."""

from __future__ import annotations

import pytest

from megatron_auto.planner import SearchOptions, TrainingSpec, search
from megatron_auto.families.registry import model_spec
from megatron_auto.planner.inputs.presets import get_cluster
from megatron_auto.profiler.lookup import lookup_or_measure
from megatron_auto.profiler.measure import ModelProfilerConfig
from megatron_auto.profiler.vision_profiler import profile_vision_model
from megatron_auto.families.vision.config import VisionConfig

pytestmark = pytest.mark.single

QUICK = ModelProfilerConfig(batch_sizes=(2, 3), warmup_iters=0, iters=1)
SWIN = VisionConfig(model_type="swin", img_h=16, img_w=16, patch_dim=2, swin_embed_dim=16,
                    swin_depths=(2, 2), swin_num_heads=(2, 4), swin_window_size=4, num_classes=5)


def test_every_swin_layer_type_is_measured_with_its_own_shape():
    spec = model_spec(SWIN)
    profile = profile_vision_model(SWIN, "fp32", "cpu", config=QUICK)
    assert sorted(profile.layer_types) == sorted(t.name for t in spec.layer_types) == [
        "swin1", "swin2", "swin2_merge"]
    for lt in spec.layer_types:
        p = profile.layer_types[lt.name]
        assert p.parameter_count == lt.num_parameters  # the planner counts what runs
        assert p.forward_time_per_sample_s > 0 or p.forward_time_constant_s > 0
        assert p.activation_split_bytes > 0 and p.recompute_bytes_per_sample > 0
        assert p.hidden_bytes_per_sample == 4 * lt.seq_length * lt.hidden_size
    # recomputing, a layer leaves only its output (the next layer's kept input): for the
    # merging block that is the merged (16 tokens x 32) map, a quarter of what it received
    # per width unit
    assert profile.layer_types["swin2_merge"].recompute_bytes_per_sample == pytest.approx(
        4 * 16 * 32, rel=0.05)
    assert profile.embedding.head_parameters == 2 * 32 + 32 * 5 + 5
    assert not profile.embedding.tied


def test_measured_profile_is_cached_and_searchable(tmp_path):
    vit = VisionConfig(model_type="vit", img_h=8, img_w=8, patch_dim=2, num_layers=2,
                       hidden_size=32, num_attention_heads=4, num_classes=5)
    first = lookup_or_measure(vit, "fp32", "cpu", str(tmp_path), config=QUICK)
    again = lookup_or_measure(vit, "fp32", "cpu", str(tmp_path), config=QUICK)
    assert first.measured and not again.measured
    assert again.profile.layer_types.keys() == {"vit"}
    spec = model_spec(vit)
    cluster = get_cluster("a100-40g-1x8")
    result = search(spec, TrainingSpec(8, precision="fp32"), cluster, again.profile,
                    cluster.budget_bytes(None), SearchOptions(), world_size=4)
    result.plan.validate(vit)
