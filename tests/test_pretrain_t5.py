"""pretrain_t5.py end to end: the embedded default trains with falling loss, a pipelined run
from Megatron's T5 flags, and bad input stops with one error line (exit code 2)."""

from __future__ import annotations

import json

import pytest

from dist_utils import run_distributed

pytestmark = pytest.mark.multirank


def _main_worker(rank, world_size, argv):
    import pretrain_t5

    return pretrain_t5.main(argv)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_embedded_default_trains_and_loss_falls(tmp_path):
    # The embedded corpus and the default T5 on 2 ranks, fewer iterations than the default run.
    metrics = tmp_path / "m.jsonl"
    argv = ["--train-iters", "30", "--log-interval", "1", "--eval-iters", "0",
            "--metrics-file", str(metrics)]
    assert run_distributed(_main_worker, 2, argv) == [0, 0]
    records = _records(metrics)
    assert [r["iteration"] for r in records] == list(range(1, 31))
    first = sum(r["lm_loss"] for r in records[:5]) / 5
    last = sum(r["lm_loss"] for r in records[-5:]) / 5
    assert last < first - 1.0, (first, last)  # from ~ln(8k) = 9 well down


def test_pipelined_run_from_megatron_t5_flags(tmp_path):
    metrics = tmp_path / "m.jsonl"
    argv = ["--mock-data", "--vocab-size", "200", "--encoder-num-layers", "2",
            "--decoder-num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
            "--kv-channels", "8", "--encoder-seq-length", "16", "--decoder-seq-length", "8",
            "--vocab-extra-ids", "10", "--pipeline-model-parallel-size", "2",
            "--global-batch-size", "4", "--micro-batch-size", "2", "--train-iters", "3",
            "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
            "--metrics-file", str(metrics)]
    assert run_distributed(_main_worker, 2, argv) == [0, 0]
    records = _records(metrics)
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
    assert run_distributed(_main_worker, 1, ["--mock-data"] + flags) == [2]
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message), err[-2000:]
    assert "Traceback" not in err


def test_checkpoint_resumes_under_another_plan(tmp_path):
    # Saved by one process, resumed on 2 ranks as 2 pipeline stages (split at the encoder /
    # decoder boundary): the resumed run continues where the first stopped.
    shape = ["--mock-data", "--vocab-size", "120", "--vocab-extra-ids", "8", "--num-layers", "2",
             "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
             "--decoder-seq-length", "8", "--global-batch-size", "4", "--log-interval", "1",
             "--eval-iters", "0", "--lr-decay-style", "constant", "--hidden-dropout", "0",
             "--attention-dropout", "0"]
    ckpt = tmp_path / "ckpt"
    full, first, resumed = (tmp_path / n for n in ("full.jsonl", "first.jsonl", "resumed.jsonl"))
    assert run_distributed(_main_worker, 1, shape + ["--train-iters", "3", "--metrics-file",
                                                     str(full)]) == [0]
    assert run_distributed(_main_worker, 1, shape + ["--train-iters", "1", "--save", str(ckpt),
                                                     "--metrics-file", str(first)]) == [0]
    assert run_distributed(_main_worker, 2, shape + [
        "--train-iters", "3", "--load", str(ckpt), "--pipeline-model-parallel-size", "2",
        "--micro-batch-size", "2", "--metrics-file", str(resumed)]) == [0, 0]
    want = [r["lm_loss"] for r in _records(full)][1:]
    got = [r["lm_loss"] for r in _records(resumed)]
    assert got == pytest.approx(want, rel=1e-5)
