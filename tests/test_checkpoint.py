"""Checkpoints (--save / --load): exact resume, resharding across plans, clear errors.

The model and batches are the equivalence tests' (tiny GPT, fp32, dropout off), with a cosine
LR schedule so that a resumed run must also restore its schedule position. Every resumed run is
compared with an uninterrupted one-process run of the same number of steps.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from harness import (RTOL, Trained, assert_same_training, build, layer, metrics_losses,
                     plan_of, run_main, run_phase)
from megatron_auto.config import ModelConfig
from megatron_auto.plan import Plan
from megatron_auto.training.lr_scheduler import LRConfig
from test_equivalence import CONFIG, GPT_RECIPE

STEPS = 4
SPLIT = 2  # steps before the checkpoint
# The equivalence tests' tiny GPT with a cosine schedule (a resumed run restores its position).
CKPT = dataclasses.replace(GPT_RECIPE, lr=LRConfig(lr=1e-3, min_lr=1e-4, decay_style="cosine",
                                                  warmup_iters=1, decay_iters=STEPS))

ONE = plan_of(1, [layer()] * 4, num_microbatches=1)
# 4 ranks, one stage: TP 2 x DP 2, ZeRO-3 / ZeRO-2 layers, strided TP, vocab TP 2 with ZeRO-2.
MIXED = plan_of(4, [layer(tp=2), layer(tp=1, dp_mode="zero3"), layer(tp=4),
                    layer(tp=2, dp_mode="zero2", consecutive=False)],
                vocab_tp=2, vocab_dp_mode="zero2")
# 4 ranks, two stages of TP 2 (uneven 3+1): the tied word embedding lives on both stages.
PP2_TP2 = plan_of(4, [layer(tp=2)] * 4, layers_per_stage=(3, 1), vocab_tp=2)
# 4 ranks, two stages of DP 2 with ZeRO-3 embeddings (a DTensor tied copy on each stage).
PP2_ZERO3 = plan_of(4, [layer(), layer(dp_mode="zero3"), layer(dp_mode="zero2"), layer()],
                    layers_per_stage=(2, 2), vocab_dp_mode="zero3")
# 2 ranks: TP 2 everywhere, vocab TP 2.
TP2 = plan_of(2, [layer(tp=2)] * 4, vocab_tp=2)
# 4 ranks, context parallelism 2 (issue 24): ring x DP 2, ring with ZeRO-3, ring x TP 2,
# Ulysses; parameters are replicated over cp, so names and shapes match every other plan's.
CP2 = plan_of(4, [layer(cp=2), layer(cp=2, dp_mode="zero3"), layer(cp=2, tp=2),
                  layer(cp=2, cp_mode="ulysses")])


def _trainer(plan_dict):
    """The recipe's trainer for ``plan_dict`` on this rank (collective)."""
    return build(CKPT, Plan.from_dict(plan_dict))


def _phase(world_size, plan_dict, first_step, last_step, load_dir=None, save_dir=None) -> Trained:
    """Steps [first_step, last_step) after an optional load, then an optional save; every rank
    ends at ``last_step`` having consumed as many global batches."""
    trained = run_phase(CKPT, world_size, plan_dict, first_step, last_step, load_dir=load_dir,
                        save_dir=save_dir)
    assert set(trained.iterations) == {last_step}
    assert set(trained.consumed_samples) == {last_step * ONE_GBS}
    return trained


ONE_GBS = Plan.from_dict(ONE).global_batch_size
_REFERENCE: dict[str, Trained] = {}


def reference() -> Trained:
    """The uninterrupted one-process run of STEPS steps (computed once per session)."""
    if "ref" not in _REFERENCE:
        _REFERENCE["ref"] = _phase(1, ONE, 0, STEPS)
    return _REFERENCE["ref"]


def assert_matches_reference(trained: Trained, label: str) -> None:
    """A resumed run's steps equal the uninterrupted run's same steps (tests/harness.py)."""
    assert trained.first_step == SPLIT
    assert_same_training(reference(), trained, label)


# ------------------------------------------------------------------------------ resume
@pytest.mark.multirank
def test_resume_one_process_equals_uninterrupted_run(tmp_path):
    first = _phase(1, ONE, 0, SPLIT, save_dir=tmp_path)
    assert first.losses == pytest.approx(reference().losses[:SPLIT], rel=RTOL)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == str(SPLIT)
    info = json.loads((tmp_path / "iter_0000002" / "checkpoint_info.json").read_text())
    assert info["iteration"] == SPLIT and info["consumed_samples"] == SPLIT * ONE_GBS
    assert info["model"]["num_layers"] == CONFIG.num_layers and info["plan"]["world_size"] == 1
    assert_matches_reference(_phase(1, ONE, SPLIT, STEPS, load_dir=tmp_path),
                             "resume, one process")


# ---------------------------------------------------------------------------- reshard
RESHARD_CASES = {
    # name: (saving world, saving plan, loading world, loading plan)
    "mixed4->pp2tp2": (4, MIXED, 4, PP2_TP2),
    "mixed4->one": (4, MIXED, 1, ONE),
    "pp2tp2->tp2": (4, PP2_TP2, 2, TP2),
    "pp2zero3->mixed4": (4, PP2_ZERO3, 4, MIXED),
    "one->pp2zero3": (1, ONE, 4, PP2_ZERO3),
    "cp2->one": (4, CP2, 1, ONE),
    "pp2tp2->cp2": (4, PP2_TP2, 4, CP2),
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(RESHARD_CASES))
def test_checkpoint_loads_under_another_plan_and_continues_exactly(tmp_path, name):
    save_world, save_plan, load_world, load_plan = RESHARD_CASES[name]
    _phase(save_world, save_plan, 0, SPLIT, save_dir=tmp_path)
    assert_matches_reference(_phase(load_world, load_plan, SPLIT, STEPS, load_dir=tmp_path),
                             name)


@pytest.mark.multirank
def test_tied_embedding_saved_once_with_pp2(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    _phase(4, PP2_TP2, 0, SPLIT, save_dir=tmp_path)
    meta = FileSystemReader(str(tmp_path / "iter_0000002")).read_metadata()
    chunks = meta.state_dict_metadata["model.embedding.word_embeddings.weight"].chunks
    # vocab TP 2: two row blocks, each written once although both stages hold them.
    assert sorted(tuple(c.offsets) for c in chunks) == [(0, 0), (CONFIG.padded_vocab_size // 2, 0)]
    assert "optimizer.embedding.word_embeddings.weight.exp_avg" in meta.state_dict_metadata


# ------------------------------------------------------------------------- bad inputs
@pytest.mark.single
def test_load_from_a_directory_without_checkpoint_fails_clearly(tmp_path):
    from megatron_auto.training.checkpoint import CheckpointError, latest_iteration, read_info

    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        read_info(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7\n")
    with pytest.raises(CheckpointError, match="iter_0000007 is incomplete"):
        read_info(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("oops\n")
    with pytest.raises(CheckpointError, match="not an iteration number"):
        latest_iteration(tmp_path)


@pytest.mark.single
def test_checkpoint_of_another_model_shape_is_rejected():
    from megatron_auto.training.checkpoint import CheckpointError, check_model_matches

    saved = CONFIG.to_dict()
    check_model_matches(saved, CONFIG, "d")  # same shape: fine
    other = ModelConfig.from_dict({**saved, "hidden_dropout": 0.1, "seq_length": 8})
    check_model_matches(saved, other, "d")  # dropout and sequence length do not matter
    with pytest.raises(CheckpointError, match=r"--load=d: the checkpoint's model has "
                       r"hidden_size=32 but this run has hidden_size=64; set --hidden-size"):
        check_model_matches(saved, ModelConfig.from_dict({**saved, "hidden_size": 64,
                                                          "ffn_hidden_size": 64}), "d")


# ------------------------------------------------------------------------ entry script
SMALL = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "128", "--global-batch-size", "4",
         "--micro-batch-size", "2", "--log-interval", "1", "--eval-iters", "0",
         "--lr-decay-iters", "6", "--lr-warmup-iters", "1"]


@pytest.mark.multirank
def test_pretrain_gpt_saves_every_interval_and_resumes(tmp_path):
    ckpt, m1, m2, full = tmp_path / "ckpt", tmp_path / "m1", tmp_path / "m2", tmp_path / "full"
    # Two ranks with TP 2 (dropout on: the same plan restores the RNG streams too).
    argv = SMALL + ["--tensor-model-parallel-size", "2"]
    assert run_main("pretrain_gpt", 2, argv + [
        "--train-iters", "4", "--save", str(ckpt), "--save-interval", "2",
        "--metrics-file", str(m1)]) == [0, 0]
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004",
                                        "latest_checkpointed_iteration.txt"]
    assert run_main("pretrain_gpt", 2, argv + [
        "--train-iters", "6", "--load", str(ckpt), "--metrics-file", str(m2)]) == [0, 0]
    assert run_main("pretrain_gpt", 2, argv + [
        "--train-iters", "6", "--metrics-file", str(full)]) == [0, 0]
    resumed, straight = metrics_losses(m2), metrics_losses(full)
    assert sorted(resumed) == [5, 6]
    for it in (5, 6):
        assert resumed[it] == pytest.approx(straight[it], rel=RTOL), it
    # The final checkpoint of the resumed run went to --save only if given: none here.
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


@pytest.mark.multirank
def test_one_command_serves_the_first_launch_and_the_restart(tmp_path, capfd):
    # Changed on purpose (issue 12): a missing or empty --load directory used to be an error;
    # now it starts from scratch, as Megatron does, so `--save D --load D` is restartable.
    ckpt, m1, m2, full = tmp_path / "ckpt", tmp_path / "m1", tmp_path / "m2", tmp_path / "full"
    same = SMALL + ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2"]
    assert run_main("pretrain_gpt", 1, same + ["--train-iters", "2",
                                                  "--metrics-file", str(m1)]) == [0]
    assert f"--load={ckpt}: no finished checkpoint there yet; starting from scratch" in \
        capfd.readouterr().out
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert run_main("pretrain_gpt", 1, same + ["--train-iters", "4",
                                                  "--metrics-file", str(m2)]) == [0]
    assert run_main("pretrain_gpt", 1, SMALL + ["--train-iters", "4",
                                                   "--metrics-file", str(full)]) == [0]
    resumed, straight = metrics_losses(m2), metrics_losses(full)
    assert sorted(resumed) == [3, 4] and sorted(metrics_losses(m1)) == [1, 2]
    for it in (1, 2):
        assert metrics_losses(m1)[it] == pytest.approx(straight[it], rel=RTOL), it
    for it in (3, 4):
        assert resumed[it] == pytest.approx(straight[it], rel=RTOL), it
    # A third launch of the same command has nothing left to do, and says so in one line.
    capfd.readouterr()
    assert run_main("pretrain_gpt", 1, same + ["--train-iters", "4"]) == [0]
    out = capfd.readouterr().out
    assert out.count("nothing left to train") == 1
    assert (f"--load={ckpt}: the checkpoint is at iteration 4, --train-iters=4: nothing left to "
            f"train; raise --train-iters to continue") in out
    assert "iteration        " not in out  # no training line
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_main("pretrain_gpt", 1, SMALL + ["--train-iters", "1", "--load",
                                                   str(empty)]) == [0]


@pytest.mark.multirank
def test_pretrain_gpt_load_errors_exit_2(tmp_path, capfd):
    ckpt = tmp_path / "ckpt"
    assert run_main("pretrain_gpt", 1, SMALL + ["--train-iters", "2", "--save",
                                                   str(ckpt)]) == [0]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    bigger = list(SMALL)
    bigger[bigger.index("--num-layers") + 1] = "3"
    capfd.readouterr()
    assert run_main("pretrain_gpt", 1, bigger + ["--train-iters", "4", "--load",
                                                    str(ckpt)]) == [2]
    assert "has num_layers=2 but this run has num_layers=3; set --num-layers" in \
        capfd.readouterr().err


@pytest.mark.single
def test_loss_scaler_state_round_trips():
    from megatron_auto.training.precision import LossScaler, PrecisionConfig

    config = PrecisionConfig(fp16=True, initial_loss_scale=2.0 ** 16, hysteresis=2,
                             loss_scale_window=3)
    first, second = LossScaler(config), LossScaler(config)
    for found_inf in (True, False, True, True, False):
        first.update(found_inf)
    second.load_state_dict(first.state_dict())
    for found_inf in (False, False, False, True):
        first.update(found_inf)
        second.update(found_inf)
        assert second.state_dict() == first.state_dict()
