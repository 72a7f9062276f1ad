"""--timing-log-level: the phase timers, their reports, and that they never change numerics."""

from __future__ import annotations


import pytest
import torch

from dist_utils import run_distributed
from harness import metrics_records, run_main
from megatron_auto.config import ModelConfig
from megatron_auto.parallel.timers import P2P_TIMERS, Timers
from megatron_auto.plan import Plan
from megatron_auto.training.timing_report import (format_stage_comparison, format_timer_lines,
                                                  predicted_stage_terms, timer_metrics)

CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                     seq_length=16, vocab_size=64, make_vocab_size_divisible_by=16,
                     hidden_dropout=0.0, attention_dropout=0.0)


@pytest.mark.single
def test_timer_levels_and_windows():
    timers = Timers(1)
    assert timers("optimizer-inner-step", 2) is timers("loss-reduce", 2)  # the shared no-op
    for representative in (False, True, True):
        with timers("forward-backward"):
            with timers("forward-compute"):
                torch.ones(64).sum()
        with timers("optimizer-inner-step", 2):  # above level 1: never recorded
            pass
        timers.end_iteration(representative)
    means = timers.take()
    assert set(means) == {"forward-backward", "forward-compute"}
    assert 0 < means["forward-compute"] <= means["forward-backward"]
    assert timers.take() == {}  # a new window
    timers.end_iteration(representative=False)  # only unrepresentative iterations: they count
    assert set(timers.take()) == {"forward-backward", "forward-compute"}
    off = Timers(0)
    with off("forward-compute"):
        pass
    off.end_iteration()
    assert off.take() == {} and not off.enabled
    with pytest.raises(ValueError, match="--timing-log-level=3: choose one of 0, 1, 2"):
        Timers(3)


ROWS = [{"forward-compute": 0.010, "forward-send": 0.002, "optimizer": 0.004},
        {"forward-compute": 0.012, "forward-recv": 0.003, "optimizer": 0.003}]


@pytest.mark.pure
def test_metrics_fields_and_console_block():
    assert timer_metrics(ROWS) == {
        "timers_forward_compute_max_s": 0.012, "timers_forward_compute_min_s": 0.010,
        "timers_forward_recv_max_s": 0.003, "timers_forward_recv_min_s": 0.003,
        "timers_forward_send_max_s": 0.002, "timers_forward_send_min_s": 0.002,
        "timers_optimizer_max_s": 0.004, "timers_optimizer_min_s": 0.003}
    lines = format_timer_lines(ROWS)
    assert lines[0] == "(min, max) time across ranks (ms):"
    assert lines[1].startswith("    forward-compute ....") and lines[1].endswith(": (10.00, 12.00)")
    assert [l.split()[0] for l in lines[1:]] == ["forward-compute", "forward-recv", "forward-send",
                                                 "optimizer"]
    assert format_timer_lines(ROWS, "max")[1].endswith(": 12.00")
    assert format_timer_lines(ROWS, "all")[2].endswith(": (-, 3.00)")  # rank 0 never received
    assert format_timer_lines([{}, {}]) == []


@pytest.mark.pure
def test_stage_terms_against_the_estimate():
    stage = {"forward_time_s": 0.010, "backward_time_s": 0.020, "microbatch_time_s": 0.035,
             "sync_tail_s": 0.004, "time_s": 0.080}
    # 2 micro-batches; the iteration (0.100) is 0.020 longer than the stage: bubble.
    terms = predicted_stage_terms(stage, 2, 0.100)
    assert terms == pytest.approx({"forward": 0.020, "backward": 0.040,
                                   "p2p waits + bubble": 0.030, "DP sync": 0.004,
                                   "optimizer": 0.006})
    estimate = {"iteration_time_s": 0.100, "stages": [stage, stage]}
    lines = format_stage_comparison(ROWS, estimate, 2)
    assert len(lines) == 2
    assert lines[0].startswith(">   stage 0 (rank 0), ms per iteration")
    assert "forward 20.0 vs 10.0 (+100%)" in lines[0]
    assert "p2p waits + bubble 30.0 vs 2.0" in lines[0] and "p2p waits + bubble 30.0 vs 3.0" in lines[1]
    assert "DP sync 4.0 predicted, not measured" in lines[0]
    assert format_stage_comparison(ROWS, {}, 2) == []
    assert format_stage_comparison([], estimate, 2) == []  # timers off: no rows to compare


def _batch(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CONFIG.vocab_size, (8, CONFIG.seq_length + 1), generator=gen)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(8, CONFIG.seq_length),
            "position_ids": torch.arange(CONFIG.seq_length).expand(8, -1).contiguous()}


def _levels_worker(rank, world_size, plan_dict):
    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.models.init import gather_full_state
    from megatron_auto.training.trainer import build_trainer, train_step

    plan = Plan.from_dict(plan_dict)
    out = {}
    for level in (0, 1, 2):
        trainer = build_trainer(CONFIG, plan, lambda cfg, ctx, seed: GPTStage(cfg, ctx, seed=seed),
                                seed=7, timing_log_level=level)
        losses = []
        for step in range(3):
            result = train_step(trainer, _batch(step) if trainer.reads_data else None)
            trainer.timers.end_iteration()
            losses.append((result.lm_loss, result.grad_norm))
        out[level] = {"losses": losses, "state": gather_full_state(trainer.stage),
                      "timers": trainer.timers.take()}
    return out


@pytest.mark.multirank
def test_timers_do_not_change_numerics_and_cover_the_pipeline():
    plan = Plan.uniform(2, 2, global_batch_size=8, num_microbatches=4, pp=2)
    ranks = run_distributed(_levels_worker, 2, plan.to_dict())
    for out in ranks:
        for level in (1, 2):  # bit for bit: timers never touch the computation
            assert out[level]["losses"] == out[0]["losses"]
            for name, value in out[0]["state"].items():
                assert torch.equal(out[level]["state"][name], value), name
        assert out[0]["timers"] == {}
    common = {"forward-backward", "forward-compute", "backward-compute", "all-grads-sync",
              "optimizer"}
    # 1F1B with 4 micro-batches on 2 stages: the first stage sends forward and receives
    # gradients, the last receives activations and sends gradients.
    first, last = ranks[0][1]["timers"], ranks[1][1]["timers"]
    assert set(first) == common | {"forward-send", "forward-send-backward-recv", "backward-recv"}
    assert set(last) == common | {"forward-recv", "backward-send-forward-recv", "backward-send"}
    assert set(ranks[0][2]["timers"]) == set(first) | {"optimizer-clip-main-grad",
                                                       "optimizer-inner-step", "loss-reduce"}
    for t in (first, last):  # disjoint phases nested in the schedule's timer
        inner = t["forward-compute"] + t["backward-compute"] + t["all-grads-sync"] + \
            sum(t.get(n, 0.0) for n in P2P_TIMERS)
        assert inner <= t["forward-backward"]


@pytest.mark.multirank
def test_pretrain_reports_timers_everywhere(tmp_path):
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="the tensorboard package is the 'test' extra's; install it to run this test")
    stage = {"time_s": 0.05, "microbatch_time_s": 0.02, "forward_time_s": 0.006,
             "backward_time_s": 0.012, "sync_tail_s": 0.001, "peak_memory_bytes": 1e6}
    plan = Plan.uniform(2, 2, global_batch_size=4, num_microbatches=2, pp=2).with_estimate(
        {"iteration_time_s": 0.06, "stages": [stage, stage]})
    plan.save(tmp_path / "plan.json")
    metrics, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    argv = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
            "4", "--seq-length", "16", "--vocab-size", "128", "--train-iters", "4",
            "--log-interval", "2", "--eval-interval", "100", "--plan", str(tmp_path / "plan.json"),
            "--metrics-file", str(metrics), "--timing-log-level", "1",
            "--tensorboard-dir", str(tb), "--log-timers-to-tensorboard"]
    (code0, out0), (code1, out1) = run_main("pretrain_gpt", 2, argv, capture="stdout")
    assert code0 == code1 == 0 and out1 == ""  # rank 0 reports
    records = metrics_records(metrics)
    assert [r["iteration"] for r in records] == [2, 4]
    for r in records:
        assert r["timers_forward_compute_max_s"] >= r["timers_forward_compute_min_s"] > 0
        assert r["timers_forward_recv_max_s"] == r["timers_forward_recv_min_s"]  # one rank
        assert "timers_optimizer_inner_step_max_s" not in r  # level 2 only
    assert out0.count("(min, max) time across ranks (ms):") == 2
    assert "    forward-compute ...." in out0
    [comparison] = [l for l in out0.splitlines() if l.startswith(">   stage 1 (rank 1)")]
    assert "forward 12.0 vs " in comparison and "optimizer 9.0 vs " in comparison
    acc = accumulator.EventAccumulator(str(tb))
    acc.Reload()
    logged = [(e.step, e.value) for e in acc.Scalars("train/timers_forward_compute_max_s")]
    assert logged == [(r["iteration"], pytest.approx(r["timers_forward_compute_max_s"]))
                      for r in records]
