"""``reproduce --run``: measure the grid's plans on the cluster this command runs on.

1. The cluster: ``--run-cluster FILE`` (a hardware profile), else measured now with
   ``megatron-auto profile-hardware`` under torchrun on ``--nproc-per-node`` ranks.
2. Each model's profile: measured with ``megatron-auto profile-model`` on this machine's device
   (kept in ``<out>/profiles/<model>.json``; reused by later runs).
3. Every method is re-planned on these profiles (``simulate``), so the estimate sits next to a
   measurement of the very plan it prices.
4. Each plan trains with torchrun for ``--run-iters`` iterations on mock data (this node; under
   Slurm, every node of the allocation through ``srun``), and the metrics file gives the
   measured samples/s (mean after the first two iterations) and peak memory (max over ranks).

A failed or out-of-memory run is recorded as such and the grid goes on; a record is written
only once measured, so an interrupted ``--run`` resumes with the first unmeasured pair. Identical
plans of one model (methods often agree) are trained once.

The commands are launched as subprocesses, so this module itself never imports torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..plan import Plan
from .grid import GridModel

logger = logging.getLogger("megatron_auto")
WARMUP_ITERATIONS = 2  # left out of the measured mean (first-call allocations, autotuning)
OOM_MARKERS = ("out of memory", "OutOfMemoryError")


class RunError(ValueError):
    """``--run`` cannot start: a missing script or a failed profiling step, named with the fix."""


def repo_root() -> Path:
    """The checkout holding the ``pretrain_*.py`` entry scripts."""
    return Path(__file__).resolve().parents[2]


def _python() -> list[str]:
    return [sys.executable]


def launcher(nproc: int, environ: Mapping[str, str] | None = None) -> list[str]:
    """torchrun on this node, or ``srun`` + torchrun on every node of a Slurm allocation
    (one agent per node, c10d rendezvous on the allocation's first node)."""
    env = os.environ if environ is None else environ
    torchrun = [*_python(), "-m", "torch.distributed.run"]
    if env.get("SLURM_JOB_ID") and int(env.get("SLURM_NNODES", "1")) > 1:
        nodes = env["SLURM_NNODES"]
        head = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR") or "localhost"
        port = env.get("MASTER_PORT", "29500")
        return ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", *torchrun,
                f"--nnodes={nodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={head}:{port}", f"--rdzv-id={env['SLURM_JOB_ID']}"]
    return [*torchrun, "--standalone", f"--nproc-per-node={nproc}"]


def _run(cmd: Sequence[str], log: Path, timeout_s: float) -> subprocess.CompletedProcess:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(repo_root()), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                  cwd=repo_root(), timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            f.write(f"\nreproduce: timed out after {timeout_s:.0f} s\n")
            return subprocess.CompletedProcess(cmd, 124)


def measure_cluster(out: Path, nproc: int, timeout_s: float = 900) -> Path:
    """The hardware profile of this cluster (``out``), measured unless it exists."""
    if out.exists():
        return out
    cmd = [*launcher(nproc), "-m", "megatron_auto.cli", "profile-hardware", "--out", str(out)]
    proc = _run(cmd, out.with_suffix(".log"), timeout_s)
    if proc.returncode != 0 or not out.exists():
        raise RunError(f"measuring the cluster failed (exit {proc.returncode}); see "
                       f"{out.with_suffix('.log')}, or give a cluster file with --run-cluster")
    return out


def _precision_flags(model: GridModel) -> list[str]:
    return {"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(model.precision, [])


def measure_profile(model: GridModel, profile_dir: Path, timeout_s: float = 1800) -> Path:
    """``profile_dir/<model>.json``, measured on this machine's device unless it exists."""
    out = profile_dir / f"{model.name}.json"
    if out.exists():
        return out
    cmd = [*_python(), "-m", "megatron_auto.cli", "profile-model", *model.cli_flags(),
           *_precision_flags(model), "--out", str(out)]
    proc = _run(cmd, out.with_suffix(".log"), timeout_s)
    if proc.returncode != 0 or not out.exists():
        raise RunError(f"profiling {model.name} failed (exit {proc.returncode}); see "
                       f"{out.with_suffix('.log')}")
    return out


def _plan_identity(path: str) -> str:
    """What decides the training run: the plan without its estimate and search records."""
    data = Plan.load(path).to_dict()
    for key in ("estimate", "search"):
        data.pop(key, None)
    return json.dumps(data, sort_keys=True)


_ERROR_LINE = re.compile(r"\b[\w.]*(Error|Exception)\b:|(^|\s)error: ")


def failure_line(text: str) -> str:
    """The line of a failed run's log that says why: the last exception or ``error:`` line a
    worker printed, else the last non-empty line. torchrun's own report (ChildFailedError, a
    row of ``=``, "Failures:") ends the log and names no cause, so its lines are passed over."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.search(line)
              and "torch.distributed.elastic" not in line]
    return (errors or lines or [""])[-1]


def train_plan(model: GridModel, plan_path: str, nproc: int, iters: int, log_dir: Path,
               timeout_s: float = 1800) -> dict[str, Any]:
    """Train ``plan_path`` for ``iters`` iterations; the ``measured`` record."""
    script = repo_root() / model.script
    if not script.exists():
        raise RunError(f"{script}: entry script not found; run --run from a megatron_auto "
                       f"checkout (the pretrain_*.py scripts live at its root)")
    metrics = log_dir / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    cmd = [*launcher(nproc), str(script), *model.flags(), *_precision_flags(model),
           "--plan", plan_path, "--mock-data", "--train-iters", str(iters), "--log-interval", "1",
           "--eval-iters", "0", "--metrics-file", str(metrics)]
    log = log_dir / "train.log"
    proc = _run(cmd, log, timeout_s)
    text = log.read_text(encoding="utf-8", errors="replace")
    if proc.returncode != 0:
        status = "oom" if any(m in text for m in OOM_MARKERS) else "failed"
        return {"status": status, "exit_code": proc.returncode, "log": str(log),
                "message": failure_line(text)[-300:]}
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("split", "train") == "train" and "samples_per_s" in r]
    steady = train[WARMUP_ITERATIONS:] or train
    if not steady:
        return {"status": "failed", "log": str(log), "message": "no iteration was logged"}
    peaks = [r["peak_memory_bytes"] for r in train if r.get("peak_memory_bytes")]
    return {"status": "ok", "log": str(log), "iterations": len(train),
            "samples_per_s": sum(r["samples_per_s"] for r in steady) / len(steady),
            "iteration_time_s": sum(r["iteration_time_s"] for r in steady) / len(steady),
            "peak_memory_bytes": max(peaks) if peaks else None}


class PlanRuns:
    """Measurements by plan identity, so that identical plans of one model train once."""

    def __init__(self) -> None:
        self._done: dict[tuple[str, str], dict[str, Any]] = {}

    def measure(self, model: GridModel, plan_path: str, nproc: int, iters: int,
                log_dir: Path) -> dict[str, Any]:
        key = (model.name, _plan_identity(plan_path))
        if key not in self._done:
            self._done[key] = train_plan(model, plan_path, nproc, iters, log_dir)
        else:
            self._done[key] = {**self._done[key], "same_plan_as": self._done[key].get("log")}
        return dict(self._done[key])
