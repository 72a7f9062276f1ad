"""``megatron-auto plan / evaluate / explain --model-type vit|swin`` with the script's flags."""

from __future__ import annotations

import pytest

import json

from megatron_auto.cli import main
from megatron_auto.plan import Plan
from megatron_auto.families.vision.config import VisionConfig

SWIN_T = ["--model-type", "swin", "--swin-backbone-type", "tiny", "--img-h", "224", "--img-w",
          "224", "--num-classes", "1000", "--cluster", "a100-40g-1x8", "--bf16"]


@pytest.mark.pure
def test_plan_then_evaluate_and_explain_a_swin_plan(tmp_path, capsys):
    out = tmp_path / "swin.json"
    assert main(["plan", *SWIN_T, "--global-batch-size", "64", "--plan-out", str(out),
                 "--quiet"]) == 0
    plan = Plan.load(out)
    assert plan.model["model_type"] == "swin" and plan.model["swin_depths"] == [2, 2, 6, 2]
    plan.validate(VisionConfig.from_dict(plan.model))  # the runtime accepts it
    # Swin-T's first stage has 3 heads: no layer there is tensor-parallel
    assert plan.layers[0].tp == plan.layers[1].tp == 1
    text = capsys.readouterr().out
    assert "swin2_merge" in text  # the report names the layer types
    assert main(["evaluate", "--plan", str(out), "--json"]) == 0  # the plan records its model
    estimate = json.loads(capsys.readouterr().out)
    assert estimate["iteration_time_s"] > 0
    assert main(["explain", "--plan", str(out)]) == 0
    assert "swin1" in capsys.readouterr().out


@pytest.mark.pure
def test_evaluate_a_classic_vit_layout(capsys):
    flags = ["--model-type", "vit", "--img-h", "224", "--img-w", "224", "--patch-dim", "16",
             "--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
             "--num-classes", "1000", "--cluster", "a100-40g-1x8", "--global-batch-size", "64",
             "--tensor-model-parallel-size", "4", "--micro-batch-size", "8"]
    assert main(["evaluate", *flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_time_s"] > 0


@pytest.mark.pure
def test_bad_vision_shape_is_one_line_exit_2(capsys):
    code = main(["plan", "--model-type", "swin", "--img-h", "32", "--img-w", "32",
                 "--swin-window-size", "3", "--plan-out", "unused.json"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--swin-window-size=3: must divide stage 1's 8x8 feature map" in err[0]


@pytest.mark.single
def test_profile_model_measures_every_swin_layer_type(tmp_path, capsys):
    flags = ["profile-model", "--model-type", "swin", "--img-h", "16", "--img-w", "16",
             "--patch-dim", "2", "--swin-embed-dim", "16", "--swin-depths", "2,2",
             "--swin-num-heads", "2,4", "--swin-window-size", "4", "--num-classes", "5",
             "--batch-sizes", "2", "3", "--iters", "1", "--warmup-iters", "0",
             "--cache-dir", str(tmp_path), "--device", "cpu"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    for name in ("swin1", "swin2_merge", "swin2"):
        assert f"layer {name}: " in out
