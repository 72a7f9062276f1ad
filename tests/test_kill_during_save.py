"""A worker SIGKILLed in the middle of a checkpoint save, under ``torchrun --max-restarts``.

The kill lands inside the save of iteration 8 (``--save-interval 4``): every rank's DCP shard of
it is on disk in ``.incomplete_iter_0000008`` but nothing is published yet (no verification
record, no rename, ``latest`` still names iteration 4). To hit that moment every time, the
workers of the first launch load a ``sitecustomize`` (written by the test, on their
``PYTHONPATH`` only) that stops rank 1 at the start of ``checkpoint._publish`` for that
iteration, writes a marker with its pid and the shard files it sees, and sleeps; the test then
kills that pid with SIGKILL, as a crash would. In the asynchronous case (``--async-save``) the
stall is in rank 1's background save thread while its training thread goes on, so the process
dies with an asynchronous save in flight.

torchrun restarts both workers (the restarted ones run unmodified: the fault applies to restart
0 only); they must resume from the intact checkpoint of iteration 4, never from the half-written
one, clean its debris at their next save, and finish with the losses of an uninterrupted run
(dropout on: the RNG streams come back too; relative 1e-5).

Also here: ``--train-iters 0 --save D`` writes the initial checkpoint (iteration 0), and a run
resumed from it trains exactly the iterations of a run started from scratch.

Mutations seen caught (``python tests/mutation_check.py latest-before-write debris-kept
rng-not-restored initial-optimizer-state``): ``latest`` written when a save starts (it then
names the unfinished save of iteration 8, which a restart can only fall back from: both kill
tests fail);
the debris of an interrupted save never removed (both kill tests); the RNG streams not restored
on load (both kill tests: the dropout masks after iteration 4 differ; the iteration-0 resume
still passes, its streams equal a fresh start's); the optimizer state created for a checkpoint
that has none (the iteration-0 resume stops with DCP's "Missing key ... step").
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from harness import metrics_losses, run_main
from test_preemption import (DEADLINE_S, ROOT, SMALL, _assert_same_losses, _children, _env,
                             _wait_for)

pytestmark = pytest.mark.multirank

LAST = 12
FAULT_ITERATION = 8

INJECT = '''
import os
if "RANK" in os.environ and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    import json, time
    import torch.distributed as dist
    from megatron_auto.training import checkpoint as _ckpt

    _original = _ckpt._publish

    def _stalled(info, work, save_dir, group=None):
        if info["iteration"] == {iteration} and dist.get_rank() == 1:
            shards = sorted(n for n in os.listdir(work) if n.endswith(".distcp"))
            with open({marker!r} + ".tmp", "w") as f:
                json.dump({{"pid": os.getpid(), "shards": shards,
                           "latest": open(os.path.join(save_dir,
                                          "latest_checkpointed_iteration.txt")).read().strip()}},
                          f)
            os.replace({marker!r} + ".tmp", {marker!r})
            time.sleep(DEADLINE)  # until the test kills this process
        return _original(info, work, save_dir, group)

    _ckpt._publish = _stalled
'''


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run's losses of iterations 1..LAST (forked ranks, same flags)."""
    metrics = tmp_path_factory.mktemp("straight") / "m.jsonl"
    assert run_main("pretrain_gpt", 2, SMALL + ["--exit-interval", str(LAST),
                                                 "--metrics-file", str(metrics)]) == [0, 0]
    losses = metrics_losses(metrics)
    assert sorted(losses) == list(range(1, LAST + 1))
    return losses


def _launch_with_fault(tmp_path, args):
    import subprocess
    import sys

    inject, marker = tmp_path / "inject", tmp_path / "stalled.json"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        INJECT.replace("DEADLINE", str(int(DEADLINE_S))).format(iteration=FAULT_ITERATION,
                                                                   marker=str(marker)))
    env = _env()
    env["PYTHONPATH"] = str(inject) + os.pathsep + env["PYTHONPATH"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--max-restarts", "1", os.path.join(ROOT, "pretrain_gpt.py"), *args]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, marker


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_during_a_save_restarts_from_the_previous_checkpoint_exactly(
        tmp_path, straight, mode):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = SMALL + ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "4",
                    "--exit-interval", str(LAST), "--metrics-file", str(metrics)]
    if mode == "async":
        args.append("--async-save")
    proc, marker = _launch_with_fault(tmp_path, args)
    _wait_for(marker.exists, proc, f"rank 1 inside the save of iteration {FAULT_ITERATION}")
    stalled = json.loads(marker.read_text())
    # mid-save: both shards written, nothing published
    assert stalled["shards"] == ["__0_0.distcp", "__1_0.distcp"], stalled
    assert stalled["latest"] == "4", stalled
    assert sorted(os.listdir(ckpt)) == [f".incomplete_iter_{FAULT_ITERATION:07d}",
                                        "iter_0000004", "latest_checkpointed_iteration.txt"]
    assert stalled["pid"] in _children(proc.pid)
    os.kill(stalled["pid"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, out[-4000:]
    loaded = re.findall(r"> loaded checkpoint \S*iter_(\d+) \(iteration (\d+)", out)
    assert loaded == [("0000004", "4")], out[-4000:]  # the restart, from the intact one
    # ... which ``latest`` named: the killed save never made it point at anything partial
    assert "damaged checkpoint" not in out and "instead of iteration" not in out, out[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(LAST)
    assert not [n for n in os.listdir(ckpt) if n.startswith(".incomplete")], os.listdir(ckpt)
    _assert_same_losses(metrics_losses(metrics), straight,
                        f"SIGKILL during a {mode} save + restart")


def test_train_iters_0_writes_the_initial_checkpoint_and_a_resume_is_exact(tmp_path, straight):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    assert run_main("pretrain_gpt", 2, SMALL + ["--train-iters", "0", "--save",
                                                 str(ckpt)]) == [0, 0]
    assert sorted(os.listdir(ckpt)) == ["iter_0000000", "latest_checkpointed_iteration.txt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    info = json.loads((ckpt / "iter_0000000" / "checkpoint_info.json").read_text())
    assert (info["iteration"], info["consumed_samples"]) == (0, 0)
    assert run_main("pretrain_gpt", 2, SMALL + ["--load", str(ckpt), "--exit-interval", "3",
                                                 "--metrics-file", str(metrics)]) == [0, 0]
    resumed = metrics_losses(metrics)
    _assert_same_losses(resumed, {i: straight[i] for i in (1, 2, 3)},
                        "resumed from the --train-iters 0 checkpoint")
