"""The simulated grid: every method searched and priced in every cell, on any machine.

Per cell the planning inputs are built once (the model's spec, the cluster preset or file, the
analytic profile or a measured / imported one from ``--profile-dir``), then each method's
restricted space is searched with the same engine and memory step. A method that cannot fit is
recorded ``infeasible`` with the least memory its space needs (the planner's exact minimum), not
dropped; nothing one cell does stops the grid.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..planner.hardware import ClusterSpec
from ..planner.model_spec import ModelSpec, TrainingSpec
from ..planner.presets import get_cluster
from ..planner.profiles import ModelProfile, analytic_profile
from ..planner.search import InfeasibleError, search
from .grid import Cell, GridError, GridModel, ALL_MODELS
from .methods import Method
from .results import ResultsFile

GB = 1e9
logger = logging.getLogger("megatron_auto")


@dataclass(frozen=True)
class CellInputs:
    spec: ModelSpec
    training: TrainingSpec
    cluster: ClusterSpec
    profile: ModelProfile
    budget_bytes: int


def load_cluster(name_or_file: str) -> ClusterSpec:
    """A preset name or a cluster file; unknown names are a one-line ``GridError``."""
    try:
        return get_cluster(name_or_file)
    except (ValueError, OSError) as err:
        raise GridError(f"--clusters {name_or_file}: {err}") from None


def cell_inputs(model: GridModel, cluster: ClusterSpec, budget_gb: float,
                profile_dir: str | os.PathLike | None = None,
                global_batch_size: int | None = None) -> CellInputs:
    """The planning inputs of one cell. ``profile_dir/<model>.json`` (our profiler's output or
    ``megatron-auto import-galvatron``'s) replaces the analytic profile when it exists."""
    spec = model.spec()
    training = TrainingSpec(global_batch_size=global_batch_size or model.global_batch_size,
                            precision=model.precision)
    profile = None
    if profile_dir is not None:
        path = Path(profile_dir) / f"{model.name}.json"
        if path.exists():
            profile = ModelProfile.load(path)
            profile.check_matches(spec, training.precision)
    if profile is None:
        profile = analytic_profile(spec, training, cluster)
    return CellInputs(spec, training, cluster, profile, cluster.budget_bytes(budget_gb))


def search_cell(cell: Cell, method: Method, inputs: CellInputs, plan_dir: Path | None,
                time_limit_s: float | None = None,
                search_batch_size: bool = False) -> dict[str, Any]:
    """Search ``method`` in ``cell``; the record of the results file (see docs/reproduce.md)."""
    extra: dict[str, Any] = {"search_batch_size": search_batch_size}
    if time_limit_s is not None:
        extra["time_limit_s"] = time_limit_s
    options = method.options(**extra)
    record: dict[str, Any] = {"cell": cell.to_dict(), "method": method.name,
                              "global_batch_size": inputs.training.global_batch_size}
    t0 = time.perf_counter()
    try:
        result = search(inputs.spec, inputs.training, inputs.cluster, inputs.profile,
                        inputs.budget_bytes, options)
    except InfeasibleError as err:
        least = err.min_memory_bytes
        # No minimum: the space has no plan at all for this shape (divisibility), not an OOM.
        record.update(status="infeasible" if least is not None else "no_plan",
                      search_time_s=time.perf_counter() - t0,
                      min_memory_gb=(math.ceil(least / GB * 100) / 100
                                     if least is not None and math.isfinite(least) else None),
                      message=str(err))
        return record
    est = result.estimate
    info = result.search
    record.update(
        status="ok", search_time_s=time.perf_counter() - t0,
        samples_per_s=est.samples_per_s, iteration_time_s=est.iteration_time_s,
        peak_memory_bytes=est.peak_memory_bytes,
        stage_peak_memory_bytes=[s.peak_memory_bytes for s in est.stages],
        pp=result.plan.pp_size, num_microbatches=result.plan.num_microbatches,
        global_batch_size=result.plan.global_batch_size,
        proven_optimal=info.get("proven_optimal"), time_limited=info.get("time_limited"))
    if plan_dir is not None:
        path = plan_dir / cell.key / f"{method.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        result.plan.save(path)
        record["plan_path"] = str(path)
    return record


def simulate(cells: Sequence[Cell], methods: Sequence[Method], results: ResultsFile,
             plan_dir: Path | None, profile_dir: str | None = None,
             global_batch_size: int | None = None, time_limit_s: float | None = None,
             search_batch_size: bool = False,
             progress: Callable[[int, int, str], None] | None = None,
             clusters: dict[str, ClusterSpec] | None = None) -> int:
    """Search every (cell, method) not yet in ``results``; returns how many were searched.
    ``clusters``: specs already loaded by name (a measured one, for ``--run``)."""
    todo = [(c, m) for c in cells for m in methods if not results.done(c.key, m.name)]
    clusters = dict(clusters or {})
    inputs: dict[str, CellInputs] = {}
    for i, (cell, method) in enumerate(todo):
        if progress is not None:
            progress(i, len(todo), f"{cell.key} {method.name}")
        if cell.cluster not in clusters:
            clusters[cell.cluster] = load_cluster(cell.cluster)
        if cell.key not in inputs:
            inputs[cell.key] = cell_inputs(ALL_MODELS[cell.model], clusters[cell.cluster],
                                           cell.budget_gb, profile_dir, global_batch_size)
        try:
            record = search_cell(cell, method, inputs[cell.key], plan_dir, time_limit_s,
                                 search_batch_size)
        except ValueError as err:  # a space with no plan for this shape (e.g. tp vs heads)
            record = {"cell": cell.to_dict(), "method": method.name, "status": "no_plan",
                      "message": str(err)}
        results.append(record)
    if progress is not None:
        progress(len(todo), len(todo), "done")
    return len(todo)
