"""pretrain_vision_classify.py end to end: the embedded default trains, Swin runs pipelined from
flags, and shape mistakes stop with one error line (exit code 2)."""

from __future__ import annotations

import pytest

from harness import assert_one_error_line, assert_resume_continues, run_main, train_from_flags
from megatron_auto.config import ConfigError


@pytest.mark.multirank
def test_embedded_default_trains_loss_falls_and_accuracy_rises(tmp_path):
    # The embedded default (no data flag, default ViT) on 2 ranks; fewer iterations than the
    # default run and no evaluation, to keep the test short.
    argv = ["--train-iters", "40", "--log-interval", "1", "--eval-iters", "0"]
    records = train_from_flags("pretrain_vision_classify", 2, argv, tmp_path)
    assert [r["iteration"] for r in records] == list(range(1, 41))
    first = sum(r["lm_loss"] for r in records[:10]) / 10
    last = sum(r["lm_loss"] for r in records[-10:]) / 10
    assert last < first - 0.5, (first, last)  # from ~ln(10) = 2.3 well down
    assert sum(r["accuracy"] for r in records[-10:]) / 10 > 0.5
    assert sum(r["accuracy"] for r in records[:5]) / 5 < 0.4


@pytest.mark.multirank
def test_swin_from_flags_pipelined_over_two_stages(tmp_path):
    argv = ["--vision-backbone-type", "swin", "--mock-data", "--img-h", "16", "--img-w", "16",
            "--patch-dim", "2", "--swin-embed-dim", "16", "--swin-depths", "2,2",
            "--swin-num-heads", "2,4", "--swin-window-size", "4", "--num-classes", "4",
            "--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
            "--micro-batch-size", "2", "--train-iters", "3", "--log-interval", "1",
            "--eval-interval", "3", "--eval-iters", "1"]
    records = train_from_flags("pretrain_vision_classify", 2, argv, tmp_path)
    train = [r for r in records if r.get("split") != "valid"]
    assert len(train) == 3 and all(0 < r["lm_loss"] < 5 for r in train)
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in train)
    assert [r["split"] for r in records if "split" in r] == ["valid"]


def _config(*flags):
    from megatron_auto.arguments import build_parser
    from megatron_auto.families.vision.flags import add_vision_args, vision_config_from_args

    return vision_config_from_args(add_vision_args(build_parser()).parse_args(list(flags)))


@pytest.mark.single
def test_presets_and_shape_flags():
    huge = _config("--vision-backbone-type", "swin", "--swin-backbone-type", "huge",
                   "--img-h", "224", "--img-w", "224")
    assert (huge.swin_embed_dim, huge.swin_depths, huge.swin_num_heads, huge.swin_window_size) \
        == (320, (2, 2, 42, 2), (10, 20, 40, 80), 7)
    assert huge.num_layers == 48
    assert [s.grid_h for s in huge.swin_stages()] == [56, 28, 14, 7]
    tiny = _config("--vision-backbone-type", "swin", "--swin-backbone-type", "tiny",
                   "--img-h", "224", "--img-w", "224", "--swin-depths", "2,2,2,2")
    assert tiny.swin_embed_dim == 96 and tiny.swin_depths == (2, 2, 2, 2)  # flag overrides
    vit = _config("--hidden-size", "64", "--num-layers", "2")
    assert (vit.model_type, vit.hidden_size, vit.num_layers, vit.seq_length) == ("vit", 64, 2, 65)
    with pytest.raises(ConfigError, match=r"--swin-backbone-type=tiny: needs "
                                          r"--vision-backbone-type swin"):
        _config("--swin-backbone-type", "tiny")


@pytest.mark.multirank
@pytest.mark.parametrize("flags, message", [
    (["--img-h", "30"], "error: --img-h=30: must be divisible by --patch-dim=4"),
    (["--vision-backbone-type", "swin", "--swin-window-size", "3"],
     "error: --swin-window-size=3: must divide stage 1's 8x8 feature map"),
])
def test_shape_mistakes_exit_2_with_one_error_line(capfd, flags, message):
    assert_one_error_line("pretrain_vision_classify", flags, message, capfd)


@pytest.mark.multirank
def test_swin_checkpoint_resumes_under_another_plan(tmp_path):
    # Saved by one process, resumed on 2 ranks with TP 2 (the relative position bias table is
    # then split by heads): the resumed run continues where the first stopped.
    shape = ["--vision-backbone-type", "swin", "--mock-data", "--img-h", "16", "--img-w", "16",
             "--patch-dim", "2", "--swin-embed-dim", "16", "--swin-depths", "2,2",
             "--swin-num-heads", "2,4", "--swin-window-size", "4", "--num-classes", "4",
             "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "0",
             "--lr-decay-style", "constant"]
    assert_resume_continues("pretrain_vision_classify", shape, tmp_path, 2,
                            ["--tensor-model-parallel-size", "2"])


@pytest.mark.multirank
def test_checkpoint_of_another_backbone_is_refused(tmp_path, capfd):
    ckpt = tmp_path / "ckpt"
    vit = ["--mock-data", "--img-h", "8", "--img-w", "8", "--patch-dim", "2", "--num-layers",
           "2", "--hidden-size", "16", "--num-attention-heads", "2", "--global-batch-size", "2",
           "--train-iters", "1", "--eval-iters", "0"]
    assert run_main("pretrain_vision_classify", 1, vit + ["--save", str(ckpt)]) == [0]
    capfd.readouterr()
    assert run_main("pretrain_vision_classify", 1, vit[:-4] + [
        "--img-h", "16", "--train-iters", "2", "--eval-iters", "0", "--load", str(ckpt)]) == [2]
    err = capfd.readouterr().err
    assert "the checkpoint's model has img_h=8 but this run has img_h=16; set --img-h" in err
