"""Swin under every kind of plan: the equivalence invariant against one process (docs/design.md §4),
plus the window machinery (partition, shift mask, relative positions) and the shape errors.

Tiny Swin: 16x16 images, 2x2 patches (8x8 grid), three stages of 2 blocks (widths 16, 32, 64;
heads 2, 4, 8), window 2: stages 1 and 2 shift their odd blocks by 1, stage 3 (2x2 grid) is one
unshifted window. Layers 2 and 4 begin with patch merging. fp32, dropout off, 3 AdamW steps;
relative tolerance 1e-5 on losses and parameters.
"""

from __future__ import annotations

import pytest
import torch

from harness import Equivalence, FamilyEquivalenceTests, layer, plan_of
from vision_utils import SEARCHED, assert_matches_plain_pytorch, vision_recipe
from megatron_auto.config import ConfigError
from megatron_auto.models.swin import (SHIFT_MASK_VALUE, relative_position_index,
                                       shifted_window_mask, window_partition, window_reverse)
from megatron_auto.families.vision.config import VisionConfig

CONFIG = VisionConfig(model_type="swin", img_h=16, img_w=16, patch_dim=2, num_channels=3,
                      num_classes=5, swin_embed_dim=16, swin_depths=(2, 2, 2),
                      swin_num_heads=(2, 4, 8), swin_window_size=2)


SWIN = Equivalence(vision_recipe(CONFIG), "swin")


FOUR_RANK_PLANS = {
    "zero-tp-mix": plan_of(4, [layer(tp=2), layer(tp=1, dp_mode="zero3"), layer(tp=4),
                               layer(tp=2, dp_mode="zero2", consecutive=False),
                               layer(tp=1, dp_mode="zero2"), layer(tp=4, dp_mode="zero3")],
                           vocab_tp=2, vocab_dp_mode="zero3"),
    # boundary inside stage 1's run of blocks (layers 0 | 1, same type)
    "pp2-inside-type-run": plan_of(4, [layer(tp=2)] * 6, layers_per_stage=(1, 5), vocab_tp=2),
    # boundary exactly at a Swin stage change: stage 2 of the pipeline starts with the merging
    # block, so the hop carries stage 1's (b, 64, 16) activation and its gradient
    "pp2-at-stage-change": plan_of(4, [layer(tp=1), layer(tp=2), layer(tp=2, dp_mode="zero3"),
                                       layer(tp=1), layer(tp=2), layer(tp=1)],
                                   layers_per_stage=(2, 4), num_microbatches=4),
    "recompute-some": plan_of(4, [layer(tp=2, recompute=True), layer(tp=2),
                                  layer(tp=2, recompute=True), layer(tp=1, dp_mode="zero2"),
                                  layer(tp=4, recompute=True, dp_mode="zero3"), layer(tp=2)],
                              vocab_tp=4),
}


class TestSwinEquivalence(FamilyEquivalenceTests):
    equivalence = SWIN
    searched = SEARCHED
    searched_model = {"model_type": "swin"}
    four_rank_plans = FOUR_RANK_PLANS


@pytest.mark.multirank
def test_reference_state_has_the_swin_shapes():
    state = SWIN.reference_trains().state
    assert "layers.0.downsample.reduction.weight" not in state
    assert state["layers.2.downsample.reduction.weight"].shape == (32, 64)  # 4C -> 2C
    assert state["layers.4.downsample.norm.weight"].shape == (128,)
    # (2w-1)^2 relative offsets, one column per head of the stage
    assert state["layers.1.self_attention.relative_position_bias_table"].shape == (9, 2)
    assert state["layers.5.self_attention.relative_position_bias_table"].shape == (9, 8)
    assert state["head.output_layer.weight"].shape == (5, 64)


@pytest.mark.single
def test_stage_shapes_windows_and_shifts():
    stages = CONFIG.swin_stages()
    assert [(s.grid_h, s.hidden_size, s.num_heads, s.window, s.shift) for s in stages] == [
        (8, 16, 2, 2, 1), (4, 32, 4, 2, 1), (2, 64, 8, 2, 0)]
    assert [CONFIG.has_patch_merging(i) for i in range(6)] == [False, False, True, False, True,
                                                                False]
    assert CONFIG.layer_output_shape(1) == (64, 16) and CONFIG.layer_output_shape(2) == (16, 32)


@pytest.mark.single
def test_window_partition_round_trips():
    x = torch.randn(2, 6, 4, 3)
    windows = window_partition(x, 2)
    assert windows.shape == (2, 6, 4, 3)
    # window 1 is the top-right 2x2 block, row-major inside
    torch.testing.assert_close(windows[0, 1], x[0, 0:2, 2:4].reshape(4, 3))
    torch.testing.assert_close(window_reverse(windows, 2, 6, 4), x)


@pytest.mark.single
def test_shift_mask_separates_tokens_the_roll_brought_together():
    h = w = 4
    window, shift = 2, 1
    mask = shifted_window_mask(h, w, window, shift)  # (4 windows, 4, 4)
    # Token positions of the rolled grid: rolled[i, j] = original[(i+1) % 4, (j+1) % 4].
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    orig = torch.stack([(rows + shift) % h, (cols + shift) % w], -1).float()
    pos = window_partition(orig[None], window)[0]  # (windows, N, 2) original coordinates
    for win in range(4):
        for a in range(4):
            for b in range(4):
                # tokens are allowed together iff they are neighbours (no wrap-around) originally
                close = bool((pos[win, a] - pos[win, b]).abs().max() <= 1)
                assert (mask[win, a, b] == 0) == close, (win, a, b)
    assert mask.min() == SHIFT_MASK_VALUE
    assert shifted_window_mask(h, w, window, 0).abs().sum() == 0


@pytest.mark.single
def test_relative_position_index_counts_each_offset_once_per_pair():
    idx = relative_position_index(3)  # (9, 9) over a 3x3 window
    assert idx.shape == (9, 9) and idx.min() == 0 and idx.max() == 24
    assert (idx.diagonal() == 12).all()  # offset (0, 0) sits in the middle of the 5x5 table
    assert idx[0, 8] == 0 and idx[8, 0] == 24  # (-2, -2) and (+2, +2)


@pytest.mark.single
def test_window_size_not_dividing_the_feature_map_is_one_line_error():
    with pytest.raises(ConfigError) as err:
        VisionConfig(model_type="swin", img_h=48, img_w=48, patch_dim=4, swin_window_size=5,
                     swin_depths=(2, 2), swin_num_heads=(2, 4))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("--swin-window-size=5: must divide stage 1's 12x12 feature map")
    assert "choose one of 1, 2, 3, 4, 6, 12" in msg


@pytest.mark.single
def test_heads_must_divide_each_stage_width():
    with pytest.raises(ConfigError, match=r"--swin-num-heads=2,5: stage 2 has width 32 .* heads must divide; choose"):
        VisionConfig(model_type="swin", img_h=16, img_w=16, patch_dim=2, swin_embed_dim=16,
                     swin_depths=(1, 1), swin_num_heads=(2, 5), swin_window_size=2)


@pytest.mark.single
def test_per_layer_tp_check_follows_each_stage():
    from megatron_auto.plan import Plan, PlanError

    # tp=4 divides stage 2's and 3's heads (4, 8) but not stage 1's 2 heads
    plan = Plan.from_dict(plan_of(4, [layer(tp=2)] * 2 + [layer(tp=4)] * 4, vocab_tp=4))
    plan.validate(CONFIG)
    bad = Plan.from_dict(plan_of(4, [layer(tp=4)] + [layer(tp=2)] * 5, vocab_tp=4))
    with pytest.raises(PlanError, match=r"layers\[0\].tp=4: must divide layer 0's 2 heads"):
        bad.validate(CONFIG)


@pytest.mark.multirank
def test_same_loss_and_gradients_as_a_plain_pytorch_swin():
    assert_matches_plain_pytorch(CONFIG)


@pytest.mark.multirank
def test_plain_pytorch_check_sees_a_wrong_shift_mask(monkeypatch):
    # The cross-check must be able to fail: without the shift mask the losses differ.
    import megatron_auto.models.swin as swin

    monkeypatch.setattr(swin, "SHIFT_MASK_VALUE", 0.0)
    with pytest.raises(AssertionError):
        assert_matches_plain_pytorch(CONFIG)
