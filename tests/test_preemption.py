"""Runs that are killed, preempted or told to stop, then resumed: nothing lost, exact losses.

- SIGTERM to ``torchrun`` (which forwards it to its workers) mid-run: both ranks finish the
  iteration, agree, save, exit; the restart continues exactly (losses equal an uninterrupted
  run's, dropout on, same plan: the RNG streams are restored).
- ``torchrun --max-restarts 1`` with one worker killed by SIGKILL: the restarted workers resume
  from the last interval checkpoint and finish with the uninterrupted run's losses.
- ``--exit-interval`` and ``--exit-duration-in-mins`` save and end the run (exit 0);
  ``--distributed-timeout-minutes`` ends a rank whose peer never joins a collective.

The uninterrupted references are forked in-process (same flags, same plan); every run uses
``--train-iters 1000`` with a fixed LR schedule and is ended by ``--exit-interval``, so the data
and schedule never depend on where a run stopped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from harness import metrics_losses, metrics_records, run_main

pytestmark = pytest.mark.multirank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "128", "--global-batch-size", "4",
         "--micro-batch-size", "2", "--log-interval", "1", "--eval-iters", "0",
         "--lr-decay-iters", "20", "--lr-warmup-iters", "1", "--train-iters", "1000",
         "--tensor-model-parallel-size", "2"]
DEADLINE_S = 240.0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _torchrun(args, tmp_path, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", *extra, os.path.join(ROOT, "pretrain_gpt.py"), *args]
    return subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate, proc, what):
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}:\n{proc.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _straight(tmp_path, last):
    """The uninterrupted run's losses of iterations 1..last (forked ranks, same flags)."""
    metrics = tmp_path / "straight.jsonl"
    assert run_main("pretrain_gpt", 2, SMALL + ["--exit-interval", str(last),
                                                "--metrics-file", str(metrics)]) == [0, 0]
    losses = metrics_losses(metrics)
    assert sorted(losses) == list(range(1, last + 1))
    return losses


def _assert_same_losses(got, want, label):
    its = sorted(want)
    assert sorted(got) == its, label
    torch.testing.assert_close(torch.tensor([got[i] for i in its], dtype=torch.float64),
                               torch.tensor([want[i] for i in its], dtype=torch.float64),
                               rtol=1e-5, atol=0, msg=lambda m: f"{label}: {m}")


def _children(pid):
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def test_sigterm_saves_at_the_iteration_boundary_and_resumes_exactly(tmp_path):
    ckpt, m1, m2 = tmp_path / "ckpt", tmp_path / "m1.jsonl", tmp_path / "m2.jsonl"
    proc = _torchrun(SMALL + ["--save", str(ckpt), "--load", str(ckpt),
                              "--metrics-file", str(m1)], tmp_path)
    _wait_for(lambda: len(metrics_records(m1, missing_ok=True)) >= 3, proc, "iteration 3")
    proc.send_signal(signal.SIGTERM)  # preemption: torchrun forwards it to both workers
    out, _ = proc.communicate(timeout=DEADLINE_S)
    stopped = max(metrics_losses(m1))
    assert f"> exiting at iteration {stopped}: SIGTERM received (--exit-signal-handler); " \
           f"saving a checkpoint" in out, out[-4000:]
    assert stopped < 1000
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
    assert sorted(os.listdir(ckpt)) == [f"iter_{stopped:07d}", "latest_checkpointed_iteration.txt"]
    last = stopped + 2
    # The same command again (forked here) resumes where it stopped.
    assert run_main("pretrain_gpt", 2, SMALL + [
        "--save", str(ckpt), "--load", str(ckpt), "--exit-interval", str(last),
        "--metrics-file", str(m2)]) == [0, 0]
    resumed = metrics_losses(m2)
    assert sorted(resumed) == [stopped + 1, stopped + 2]
    _assert_same_losses({**metrics_losses(m1), **resumed}, _straight(tmp_path, last),
                        "SIGTERM + resume")


def test_sigkill_of_a_rank_under_max_restarts_finishes_with_the_same_losses(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    last = 24
    proc = _torchrun(SMALL + ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "4",
                              "--exit-interval", str(last), "--metrics-file", str(metrics)],
                     tmp_path, "--max-restarts", "1")
    _wait_for(lambda: (ckpt / "latest_checkpointed_iteration.txt").exists()
              and len(metrics_records(metrics, missing_ok=True)) >= 5, proc,
              "the first checkpoint")
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    killed_at = max(metrics_losses(metrics))
    os.kill(workers[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, out[-4000:]
    # The restarted workers say which checkpoint they resumed from.
    match = re.search(r"> loaded checkpoint \S*iter_(\d+) \(iteration (\d+)", out)
    assert match, out[-4000:]
    resumed_from = int(match.group(2))
    # Lost: the iterations since the checkpoint it resumed from, at most one save interval
    # (a kill during the save of iteration 4k, logged before it is saved, loses 4k-3..4k).
    assert resumed_from % 4 == 0 and killed_at - 4 <= resumed_from <= killed_at + 1
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(last)
    _assert_same_losses(metrics_losses(metrics), _straight(tmp_path, last), "SIGKILL + restart")


def test_exit_interval_and_exit_duration_save_and_end_the_run(tmp_path, capfd):
    for case, (flags, reason, stopped) in enumerate((
            (["--exit-interval", "3"], "--exit-interval=3 reached", 3),
            # Asynchronous interval saves: the exit's save waits for the one of iteration 2.
            (["--exit-interval", "3", "--async-save", "--save-interval", "2"],
             "--exit-interval=3 reached", 3),
            # The clock starts when the loop is set up; one iteration of two ranks (a forward,
            # a backward and an all-reduce) takes far longer than 1e-6 min (60 us), so the
            # first iteration is the last. (0.001 min was flaky: a 39 ms first iteration on an
            # idle machine ran a second one.)
            (["--exit-duration-in-mins", "1e-06"], "--exit-duration-in-mins=1e-06 reached", 1))):
        ckpt = tmp_path / f"ckpt{case}"
        capfd.readouterr()
        assert run_main("pretrain_gpt", 2, SMALL + flags + ["--save", str(ckpt)]) == [0, 0]
        out = capfd.readouterr().out
        assert f"> exiting at iteration {stopped}: {reason}" in out, out[-3000:]
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
        if "--async-save" in flags:
            assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000003",
                                                "latest_checkpointed_iteration.txt"]
            assert "> training continues while iteration 2's checkpoint is written" in out
            assert "> asynchronous checkpoint of iteration 3 complete" in out


def _timeout_child(rank, port, write_fd):
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)})
    from megatron_auto.training.pretrain import _init_distributed
    import torch.distributed as dist

    message = "no error"
    try:
        _init_distributed(0.05)  # --distributed-timeout-minutes 0.05: 3 s
        if rank == 1:
            time.sleep(30)  # a peer that hangs and never joins the collective
        else:
            start = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1))
            except Exception as err:  # noqa: BLE001 - whatever gloo raises on a timeout
                message = f"{type(err).__name__} after {time.monotonic() - start:.1f} s: {err}"
    finally:
        os.write(write_fd, message.encode()[:4000])
        os._exit(0)


def test_distributed_timeout_ends_a_rank_whose_peer_hangs():
    from dist_utils import free_port
    from megatron_auto.training import pretrain  # noqa: F401 - imported once, before the fork

    port = free_port()
    read_fd, write_fd = os.pipe()
    pids = []
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _timeout_child(rank, port, write_fd if rank == 0 else os.open(os.devnull, os.O_WRONLY))
        pids.append(pid)
    os.close(write_fd)
    message = os.read(read_fd, 4000).decode()
    os.close(read_fd)
    os.kill(pids[1], signal.SIGKILL)
    for pid in pids:
        os.waitpid(pid, 0)
    assert message != "no error", "the collective with a hung peer returned"
    seconds = float(message.split(" after ")[1].split(" s")[0])
    assert 2.0 <= seconds < 25.0, message
