"""Progress of long work: the reporter's plain lines (not a terminal), the bar on a terminal,
silence off rank 0, and the jobs that report (search, profilers, checkpoints)."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import types

import pytest

from megatron_auto.utils import progress as progress_module
from megatron_auto.utils.progress import Progress


class FakeClock:
    def __init__(self, step: float = 1.0) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


@pytest.fixture
def fake_time(monkeypatch):
    """Every time.monotonic() call of the reporter advances 1 s (so every job is 'long')."""
    clock = FakeClock()
    monkeypatch.setattr(progress_module, "time", types.SimpleNamespace(monotonic=clock))
    return clock


@pytest.mark.pure
def test_plain_lines_every_interval_and_a_final_line():
    out, now = io.StringIO(), [0.0]
    p = Progress("job", 10, "docs", stream=out, interval_s=5.0, clock=lambda: now[0])
    for t in range(1, 11):
        now[0] = float(t)
        p.update(1, tokens_per_s=123.4)
    p.close()
    p.close()  # idempotent
    assert out.getvalue().splitlines() == [
        "job: 1/10 docs (10%), 1.0 s, 1 docs/s, tokens per s: 123.4",  # first update: at once
        "job: 6/10 docs (60%), 6.0 s, 1 docs/s, tokens per s: 123.4",  # then every 5 s
        "job: done, 10/10 docs, 10.0 s, 1 docs/s, tokens per s: 123.4"]


@pytest.mark.pure
def test_delay_unknown_total_and_disabled():
    out, now = io.StringIO(), [0.0]
    with Progress("quick", 3, stream=out, delay_s=2.0, clock=lambda: now[0]) as p:
        now[0] = 1.0
        p.update(3)
    assert out.getvalue() == ""  # finished before the delay: silent
    with Progress("open", None, "files", stream=out, interval_s=0.0, clock=lambda: now[0]) as p:
        now[0] = 3.0
        p.update_to(4)
    assert out.getvalue().splitlines() == ["open: 4 files, 2.0 s, 2 files/s",
                                           "open: done, 4 files, 2.0 s, 2 files/s"]
    silent = io.StringIO()
    with Progress("other rank", 5, stream=silent, enabled=False) as p:
        p.update(5)
    assert silent.getvalue() == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.pure
def test_a_terminal_gets_a_bar_unless_asked_for_lines():
    pytest.importorskip("tqdm", reason="tqdm is the 'progress' extra (installed by 'test')")
    tty = _Terminal()
    with Progress("search", 4, "tasks", stream=tty) as p:
        p.update(4, best="1.0 samples/s")
    text = tty.getvalue()
    assert "\r" in text and "search" in text and "4/4" in text and "best=1.0 samples/s" in text
    plain = _Terminal()
    with Progress("search", 4, "tasks", stream=plain, bar=False, clock=lambda: 1.0) as p:
        p.update(4)
    assert "\r" not in plain.getvalue() and "search: done, 4/4 tasks" in plain.getvalue()


@pytest.mark.pure
def test_search_reports_tasks_and_best_so_far(fake_time, capsys):
    from megatron_auto.planner import ModelSpec, SearchOptions, TrainingSpec, search
    from planner_fakes import FakeCluster, round_profile

    spec = ModelSpec.uniform(4, 64, 4, 16, 64, name="gpt")
    search(spec, TrainingSpec(8), FakeCluster(devices_per_node=4, bandwidth=2e4),
           round_profile(), 10 ** 6, SearchOptions(include_baselines=False,
                                                   memory_step_bytes=256))
    lines = capsys.readouterr().err.splitlines()
    assert lines, "the search printed no progress"
    pattern = re.compile(r"megatron-auto search: (done, )?(\d+)/(\d+) tasks.*best: (none yet|"
                         r"[0-9.]+ samples/s)$")
    assert all(pattern.match(line) for line in lines), lines
    final = pattern.match(lines[-1])
    assert final.group(1) == "done, " and final.group(4) != "none yet"


def _profile_hardware_rank(rank, world_size):
    from megatron_auto.profiler import hardware_profiler as hp

    progress_module.time = types.SimpleNamespace(monotonic=FakeClock())  # this child only
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        hp.profile_hardware(hp.HardwareProfilerConfig(message_sizes=(4096, 16384), iters=1))
    return err.getvalue()


@pytest.mark.multirank
def test_hardware_profiler_reports_on_rank_0_only():
    from dist_utils import run_distributed

    first, second = run_distributed(_profile_hardware_rank, 2)
    assert second == ""
    final = first.splitlines()[-1]
    done = re.match(r"megatron-auto profile-hardware: done, (\d+)/(\d+) measurements", final)
    assert done and done.group(1) == done.group(2), first


@pytest.mark.single
def test_model_profiler_reports_every_measurement(fake_time, capsys):
    import torch

    from megatron_auto.config import ModelConfig
    from megatron_auto.profiler import model_profiler as mp
    from megatron_auto.profiler.measure import ModelProfilerConfig

    torch.set_num_threads(1)
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                         vocab_size=128, make_vocab_size_divisible_by=128)
    mp.profile_model(config, "fp32", "cpu",
                     config=ModelProfilerConfig(batch_sizes=(1, 2), warmup_iters=0, iters=1))
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("megatron-auto profile-model (gpt): done, 6/6 measurements")


def _checkpoint_rank(rank, world_size, directory):
    import torch

    from megatron_auto.config import ModelConfig
    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.plan import Plan
    from megatron_auto.training import checkpoint
    from megatron_auto.training.logging import get_logger, setup_logging
    from megatron_auto.training.trainer import build_trainer, train_step

    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                         vocab_size=64, make_vocab_size_divisible_by=16)
    plan = Plan.uniform(world_size, 1, global_batch_size=2)
    trainer = build_trainer(config, plan, lambda c, ctx, seed: GPTStage(c, ctx, seed=seed))
    tokens = torch.arange(2 * 17).remainder(64).view(2, 17)
    train_step(trainer, {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                         "loss_mask": torch.ones(2, 16)})  # optimizer state to save
    setup_logging(rank)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    get_logger().addHandler(handler)
    checkpoint.save_checkpoint(trainer, directory)
    checkpoint.load_checkpoint(trainer, directory)
    get_logger().removeHandler(handler)
    return out.getvalue()


@pytest.mark.multirank
def test_checkpoint_save_and_load_say_size_and_rate(tmp_path):
    from dist_utils import run_distributed

    first, second = run_distributed(_checkpoint_rank, 2, str(tmp_path / "ckpt"))
    assert second == ""
    lines = first.splitlines()
    assert re.match(r"> saving checkpoint at iteration 1 to .*iter_0000001 \([0-9.]+ MiB from 2 "
                    r"rank\(s\)\) \.\.\.$", lines[0]), lines
    assert re.search(r"^> saved checkpoint .* in [0-9.]+ s \([0-9.]+ MiB/s\)$", lines[1])
    assert re.match(r"> loading checkpoint .* \([0-9.]+ MiB into 2 rank\(s\)\) \.\.\.$", lines[2])
    assert re.search(r"^> loaded checkpoint .* \([0-9.]+ MiB/s\)$", lines[3])

