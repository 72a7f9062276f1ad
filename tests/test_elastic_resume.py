"""Elastic resume under ``--auto-parallel`` (issue 12, item 4): a checkpoint saved under a plan
searched for 4 ranks is loaded by runs on 2 ranks and on 1, each of which searches a plan for
its own cluster; the checkpoint is resharded into it (parameters, AdamW state, data position)
and the losses equal the uninterrupted one-process run's (fp32, dropout off). The log names the
plan that was saved and the plan used now.

Clusters are presets (``--cluster a100-40g-1xN``), so no hardware is measured; the model
profile is measured once and cached for the module.
"""

from __future__ import annotations

import shutil

import pytest

from harness import metrics_losses, run_main

pytestmark = pytest.mark.multirank

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "512",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "16",
         "--lr", "1e-3", "--lr-decay-iters", "4", "--lr-warmup-iters", "1", "--log-interval",
         "1", "--mock-data", "--eval-iters", "0"]


def _main(world_size, argv, cache_dir, **kw):
    return run_main("pretrain_gpt", world_size, argv, env={"MEGATRON_AUTO_CACHE": cache_dir},
                    **kw)


def test_auto_parallel_resume_on_fewer_ranks_continues_exactly(tmp_path, capfd):
    from megatron_auto.plan import Plan

    cache = str(tmp_path / "cache")
    ckpt, first = tmp_path / "ckpt", tmp_path / "first.jsonl"
    assert _main(4, MODEL + [
        "--auto-parallel", "--cluster", "a100-40g-1x4", "--train-iters", "2", "--save",
        str(ckpt), "--metrics-file", str(first), "--plan-out", str(tmp_path / "p4.json")],
        cache, timeout_s=600) == [0] * 4
    saved_plan = Plan.load(tmp_path / "p4.json")
    assert saved_plan.world_size == 4
    reference = tmp_path / "ref.jsonl"
    assert _main(1, MODEL + ["--train-iters", "4", "--metrics-file", str(reference)],
                 cache) == [0]
    want = metrics_losses(reference)
    assert metrics_losses(first) == pytest.approx({i: want[i] for i in (1, 2)}, rel=1e-5)
    for world in (2, 1):
        load, metrics = tmp_path / f"ckpt{world}", tmp_path / f"resumed{world}.jsonl"
        shutil.copytree(ckpt, load)
        capfd.readouterr()
        assert _main(world, MODEL + [
            "--auto-parallel", "--cluster", f"a100-40g-1x{world}", "--train-iters", "4",
            "--load", str(load), "--metrics-file", str(metrics), "--plan-out",
            str(tmp_path / f"p{world}.json")], cache, timeout_s=600) == [0] * world
        out = capfd.readouterr().out
        assert Plan.load(tmp_path / f"p{world}.json").world_size == world
        assert f"resharded: saved under a 4-rank plan (pp={saved_plan.pp_size}" in out, out[-3000:]
        assert f"now a {world}-rank plan" in out
        got = metrics_losses(metrics)
        assert sorted(got) == [3, 4], world
        assert got == pytest.approx({i: want[i] for i in (3, 4)}, rel=1e-5), world
