"""``pretrain_gpt.py --auto-parallel`` choosing context parallelism on 4 gloo ranks for a
"long" (CPU-sized) sequence: ``--cp-min-seq-length`` lowers the length from which the search
tries cp > 1 (planner/search/cp_space.py rule 4), and the searched plan trains to the losses of
one process (fp32, dropout off, 3 steps, relative 1e-5).

The global batch of 2 samples with tp and pp pinned to 1 leaves 4 ranks that data parallelism
alone cannot use (dp <= 2): every plan the search may answer has cp 2 or 4, so the test checks
a CP plan chosen and trained, not the cost model's preference."""

from __future__ import annotations

import pytest

from harness import metrics_records, run_main

pytestmark = pytest.mark.multirank

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "256", "--max-position-embeddings", "256", "--vocab-size", "256",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "2",
         "--lr", "1e-3", "--log-interval", "1", "--mock-data"]


def test_auto_parallel_chooses_cp_for_a_long_sequence_and_trains_like_one_process(tmp_path):
    from megatron_auto.plan import Plan

    cache = {"MEGATRON_AUTO_CACHE": str(tmp_path / "cache")}
    metrics, plan_out = tmp_path / "cp.jsonl", tmp_path / "plan.json"
    argv = [*MODEL, "--auto-parallel", "--cluster", "a100-40g-1x4",
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--cp-min-seq-length", "256", "--train-iters", "3", "--metrics-file", str(metrics),
            "--plan-out", str(plan_out)]
    assert run_main("pretrain_gpt", 4, argv, env=cache, timeout_s=600) == [0] * 4
    plan = Plan.load(plan_out)
    assert plan.world_size == 4 and plan.estimate is not None
    assert {layer.cp for layer in plan.layers} in ({2}, {4})
    ref_metrics = tmp_path / "ref.jsonl"
    assert run_main("pretrain_gpt", 1, [*MODEL, "--train-iters", "3", "--metrics-file",
                                        str(ref_metrics)], env=cache) == [0]
    got, want = metrics_records(metrics), metrics_records(ref_metrics)
    assert [r["iteration"] for r in got] == [1, 2, 3]
    for g, w in zip(got, want, strict=True):
        assert g["lm_loss"] == pytest.approx(w["lm_loss"], rel=1e-5)
