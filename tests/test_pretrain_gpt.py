"""The GPT entry script end to end: torchrun command, metrics file, clean configuration errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dist_utils import free_port, run_distributed
from harness import metrics_records, run_main, train_from_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_RUN = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
             "4", "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "512",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10",
             "--log-interval", "1", "--lr", "1e-3", "--tensor-model-parallel-size", "2"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.multirank
def test_torchrun_command_writes_ten_metrics_lines(tmp_path):
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "pretrain_gpt.py"), *SMALL_RUN, "--metrics-file", str(metrics)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = metrics_records(metrics)
    assert [r["iteration"] for r in records] == list(range(1, 11))
    for r in records:
        assert r["lm_loss"] > 0 and r["iteration_time_s"] > 0 and r["tokens_per_s"] > 0
        assert {"lr", "grad_norm", "samples_per_s"} <= set(r)
    # Megatron console lines, printed once (rank 0), with the loss of the last stage.
    lines = [l for l in proc.stdout.splitlines() if l.lstrip().startswith("iteration")]
    assert len(lines) == 10 and "lm loss:" in lines[0] and "| consumed samples:" in lines[0]


@pytest.mark.multirank
def test_forked_ranks_pipeline_run_with_plan_file_and_eval(tmp_path):
    from megatron_auto.plan import Plan

    plan = Plan.uniform(2, 2, global_batch_size=4, num_microbatches=2, pp=2, schedule="gpipe")
    plan_path = tmp_path / "plan.json"
    plan.save(plan_path)
    argv = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--vocab-size", "128", "--train-iters", "4", "--log-interval", "2",
            "--eval-interval", "2", "--eval-iters", "1", "--plan", str(plan_path),
            "--plan-out", str(tmp_path / "used.json")]
    records = train_from_flags("pretrain_gpt", 2, argv, tmp_path)
    train = [r for r in records if "split" not in r]
    valid = [r for r in records if r.get("split") == "valid"]
    assert [r["iteration"] for r in train] == [2, 4] and [r["iteration"] for r in valid] == [2, 4]
    assert all(r["ppl"] == pytest.approx(2.718281828 ** r["lm_loss"], rel=1e-6) for r in valid)
    assert Plan.load(tmp_path / "used.json") == plan


@pytest.mark.single
def test_bad_plan_file_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "megatron_auto.plan", "version": 1, "world_size": 1,
                               "global_batch_size": 8, "num_microbatches": 3,
                               "pipeline": {"size": 1, "layers_per_stage": [4]},
                               "layers": [{"tp": 1}] * 4}))
    env = _env()
    env.pop("RANK", None)
    env["MASTER_PORT"] = str(free_port())
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--mock-data",
                           "--plan", str(bad)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "error: --plan" in proc.stderr and "num_microbatches=3" in proc.stderr


@pytest.mark.single
def test_bad_flags_exit_2_with_message(capsys):
    import pretrain_gpt

    assert pretrain_gpt.main(["--bf16", "--fp16"]) == 2
    assert "error: --bf16=True: cannot be combined with --fp16" in capsys.readouterr().err


@pytest.mark.multirank
def test_bert_entry_logs_mlm_and_sop_losses(tmp_path):
    # The BERT script shares the loop; pp=2 also checks that middle/last stages get the batch.
    argv = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "4",
            "--global-batch-size", "4", "--train-iters", "2", "--log-interval", "1",
            "--pipeline-model-parallel-size", "2"]
    records = train_from_flags("pretrain_bert", 2, argv, tmp_path)
    assert [r["iteration"] for r in records] == [1, 2]
    for r in records:
        # Megatron's BERT objective: the optimised loss is the MLM mean plus the SOP mean.
        assert r["lm_loss"] == pytest.approx(r["mlm_loss"] + r["sop_loss"], rel=1e-6)
        assert 0 < r["sop_loss"] < 2 and r["mlm_loss"] > 3
        # One micro-batch per iteration: the CPU memory meter can measure (max over ranks).
        assert r["peak_memory_bytes"] > 0


@pytest.mark.multirank
def test_bert_on_the_embedded_corpus_learns(tmp_path, monkeypatch):
    # No data flags: the shipped corpus, split into sentences for sentence pairs, and its
    # SentencePiece vocabulary. A small BERT must lower its masked-LM loss within 30 steps.
    monkeypatch.setenv("MEGATRON_AUTO_CACHE", str(tmp_path / "cache"))
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--global-batch-size", "16",
            "--micro-batch-size", "16", "--train-iters", "30", "--lr", "2e-3",
            "--lr-warmup-iters", "3", "--log-interval", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0"]
    records = [r for r in train_from_flags("pretrain_bert", 1, argv, tmp_path)
               if "split" not in r]
    first = sum(r["mlm_loss"] for r in records[:3]) / 3
    last = sum(r["mlm_loss"] for r in records[-3:]) / 3
    assert last < first - 1.0, (first, last)


@pytest.mark.multirank
def test_tensorboard_flags_reach_the_event_files(tmp_path):
    # --tensorboard-dir gets exactly the metrics-file records (rank 0 of 2 writes them).
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="the tensorboard package is the 'test' extra's; install it to run this test")
    metrics, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    argv = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--vocab-size", "128", "--train-iters", "4", "--log-interval", "1",
            "--eval-interval", "2", "--eval-iters", "1", "--metrics-file", str(metrics),
            "--tensorboard-dir", str(tb), "--tensorboard-log-interval", "2",
            "--log-validation-ppl-to-tensorboard"]
    assert run_main("pretrain_gpt", 2, argv) == [0, 0]
    records = metrics_records(metrics)
    acc = accumulator.EventAccumulator(str(tb))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("train/lm_loss")]
    want = [(r["iteration"], r["lm_loss"]) for r in records
            if "split" not in r and r["iteration"] % 2 == 0]
    assert [s for s, _ in loss] == [2, 4]
    assert [v for _, v in loss] == pytest.approx([v for _, v in want], rel=1e-6)
    assert [e.step for e in acc.Scalars("valid/ppl")] == [2, 4]


@pytest.mark.single
def test_bad_experiment_log_flag_exits_2(capsys):
    import pretrain_gpt

    assert pretrain_gpt.main(["--tensorboard-log-interval", "0"]) == 2
    assert "error: --tensorboard-log-interval=0: must be a positive integer" in \
        capsys.readouterr().err


def _count_core_attention_worker(rank, world_size, argv):
    import pretrain_gpt
    from megatron_auto.models import transformer

    calls = [0]
    original = transformer.SelfAttention.core_attention

    def counting(self, *args):
        calls[0] += 1
        return original(self, *args)

    transformer.SelfAttention.core_attention = counting
    return pretrain_gpt.main(argv), calls[0]


@pytest.mark.multirank
@pytest.mark.parametrize("flags, per_forward", [([], 1),
                                                (["--recompute-granularity", "selective"], 2)])
def test_selective_recompute_flag_recomputes_core_attention(tmp_path, flags, per_forward):
    """``--recompute-granularity selective`` trained without recompute before (issue 27): now
    the plan says "selective" on every layer and core attention runs again in backward."""
    from megatron_auto.plan import Plan

    argv = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
            "4", "--seq-length", "16", "--vocab-size", "128", "--train-iters", "1",
            "--micro-batch-size", "2", "--global-batch-size", "4",
            "--plan-out", str(tmp_path / "used.json"), *flags]
    ((code, calls),) = run_distributed(_count_core_attention_worker, 1, argv)
    assert code == 0
    layers = Plan.load(tmp_path / "used.json").layers
    assert [layer.recompute for layer in layers] == (["selective"] * 2 if flags else [False] * 2)
    assert calls == 2 * 2 * per_forward  # layers x micro-batches x (forward, recompute)
