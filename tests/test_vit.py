"""ViT under every kind of plan: the equivalence invariant against one process (docs/design.md §4).

Tiny ViT: 8x8 images, 2x2 patches (16 patches + class token), 4 layers of width 32 with 4 heads,
5 classes; fp32, dropout off, 3 AdamW steps; relative tolerance 1e-5 on losses and parameters
(tests/harness.py).
"""

from __future__ import annotations

import pytest

from harness import Equivalence, FamilyEquivalenceTests, layer, plan_of
from vision_utils import SEARCHED, assert_matches_plain_pytorch, vision_recipe
from megatron_auto.config import ConfigError
from megatron_auto.families.vision.config import VisionConfig

CONFIG = VisionConfig(model_type="vit", img_h=8, img_w=8, patch_dim=2, num_channels=3,
                      num_classes=5, num_layers=4, hidden_size=32, num_attention_heads=4,
                      ffn_hidden_size=64)


VIT = Equivalence(vision_recipe(CONFIG), "vit")


FOUR_RANK_PLANS = {
    # per-layer TP degrees, ZeRO-2/3 and a strided TP layout side by side in one stage
    "zero-tp-mix": plan_of(4, [layer(tp=2), layer(tp=1, dp_mode="zero3"), layer(tp=4),
                               layer(tp=2, dp_mode="zero2", consecutive=False)],
                           vocab_tp=2, vocab_dp_mode="zero2"),
    # ViT has one layer type: any stage boundary falls inside the type run
    "pp2-3+1": plan_of(4, [layer(tp=2)] * 4, layers_per_stage=(3, 1), vocab_tp=2),
    "recompute-some": plan_of(4, [layer(tp=2, recompute=True), layer(tp=2),
                                  layer(tp=1, recompute=True, dp_mode="zero3"), layer(tp=2)],
                              layers_per_stage=(2, 2), num_microbatches=4, schedule="gpipe"),
}


class TestViTEquivalence(FamilyEquivalenceTests):
    equivalence = VIT
    searched = SEARCHED
    searched_model = {"model_type": "vit"}
    four_rank_plans = FOUR_RANK_PLANS


@pytest.mark.multirank
def test_reference_trains_and_names_parameters_plan_independently():
    state = VIT.reference_trains().state
    assert "embedding.cls_token" in state and "embedding.position_embeddings" in state
    assert state["embedding.position_embeddings"].shape == (17, 32)
    assert state["layers.3.self_attention.linear_qkv.weight"].shape == (96, 32)


@pytest.mark.single
def test_image_size_not_divisible_by_patch_is_one_line_error():
    with pytest.raises(ConfigError) as err:
        VisionConfig(model_type="vit", img_h=30, img_w=32, patch_dim=4)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("--img-h=30: must be divisible by --patch-dim=4")
    assert "e.g. 28" in msg


@pytest.mark.single
def test_tp_that_does_not_divide_heads_is_rejected_by_the_plan():
    from megatron_auto.plan import Plan, PlanError

    plan = Plan.from_dict(plan_of(8, [layer(tp=8)] * 4, num_microbatches=1, vocab_tp=8))
    with pytest.raises(PlanError, match=r"layers\[0\].tp=8: must divide layer 0's 4 heads"):
        plan.validate(CONFIG)


@pytest.mark.multirank
def test_same_loss_and_gradients_as_a_plain_pytorch_vit():
    assert_matches_plain_pytorch(CONFIG)
