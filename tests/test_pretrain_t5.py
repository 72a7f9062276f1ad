"""pretrain_t5.py end to end: the embedded default trains with falling loss, a pipelined run
from Megatron's T5 flags, and bad input stops with one error line (exit code 2)."""

from __future__ import annotations

import pytest

from harness import assert_one_error_line, assert_resume_continues, train_from_flags

pytestmark = pytest.mark.multirank


def test_embedded_default_trains_and_loss_falls(tmp_path):
    # The embedded corpus and the default T5 on 2 ranks, fewer iterations than the default run.
    argv = ["--train-iters", "30", "--log-interval", "1", "--eval-iters", "0"]
    records = train_from_flags("pretrain_t5", 2, argv, tmp_path)
    assert [r["iteration"] for r in records] == list(range(1, 31))
    first = sum(r["lm_loss"] for r in records[:5]) / 5
    last = sum(r["lm_loss"] for r in records[-5:]) / 5
    assert last < first - 1.0, (first, last)  # from ~ln(8k) = 9 well down


def test_pipelined_run_from_megatron_t5_flags(tmp_path):
    argv = ["--mock-data", "--vocab-size", "200", "--encoder-num-layers", "2",
            "--decoder-num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
            "--kv-channels", "8", "--encoder-seq-length", "16", "--decoder-seq-length", "8",
            "--vocab-extra-ids", "10", "--pipeline-model-parallel-size", "2",
            "--global-batch-size", "4", "--micro-batch-size", "2", "--train-iters", "3",
            "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1"]
    records = train_from_flags("pretrain_t5", 2, argv, tmp_path)
    train = [r for r in records if r.get("split") != "valid"]
    assert len(train) == 3 and all(0 < r["lm_loss"] < 8 for r in train)
    assert [r["split"] for r in records if "split" in r] == ["valid"]


@pytest.mark.parametrize("flags, message", [
    (["--vocab-extra-ids", "0"],
     "error: --vocab-extra-ids=0: T5 span corruption needs sentinel tokens"),
    (["--position-embedding-type", "learned", "--max-position-embeddings", "128",
      "--decoder-seq-length", "200"],
     "error: --decoder-seq-length=200: is longer than the learned position table"),
    (["--untie-embeddings-and-output-weights"],
     "error: --untie-embeddings-and-output-weights: T5 ties its LM head"),
])
def test_bad_input_exits_2_with_one_error_line(capfd, flags, message):
    assert_one_error_line("pretrain_t5", ["--mock-data"] + flags, message, capfd)


def test_checkpoint_resumes_under_another_plan(tmp_path):
    # Saved by one process, resumed on 2 ranks as 2 pipeline stages (split at the encoder /
    # decoder boundary): the resumed run continues where the first stopped.
    shape = ["--mock-data", "--vocab-size", "120", "--vocab-extra-ids", "8", "--num-layers", "2",
             "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
             "--decoder-seq-length", "8", "--global-batch-size", "4", "--log-interval", "1",
             "--eval-iters", "0", "--lr-decay-style", "constant", "--hidden-dropout", "0",
             "--attention-dropout", "0"]
    assert_resume_continues("pretrain_t5", shape, tmp_path, 2,
                            ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2"])
