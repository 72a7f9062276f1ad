"""The simulated grid: every method searched and priced in every cell, on any machine.

Per cell the planning inputs are built once (the model's spec, the cluster preset or file, the
analytic profile or a measured / imported one from ``--profile-dir``), then each method's
restricted space is searched with the same engine and memory step. A method that cannot fit is
recorded ``infeasible`` with the least memory its space needs (the planner's exact minimum), not
dropped; nothing one cell does stops the grid.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..plan import Plan
from ..planner.inputs.hardware import ClusterSpec
from ..planner.inputs.model_spec import ModelSpec, TrainingSpec
from ..planner.inputs.presets import get_cluster
from ..planner.inputs.profiles import ModelProfile, analytic_profile
from ..planner.search.driver import InfeasibleError, search
from .grid import Cell, GridError, GridModel, ALL_MODELS
from .methods import RUN_ORDER, Method
from .results import ResultsFile
from .warm import Found

GB = 1e9
#: CPU seconds of a cell's searches together (``--cell-time-limit``; the planner's limits are
#: CPU seconds too, so an answer does not depend on the machine's load): the whole 1x8 grid
#: (60 cells x 11 methods) then takes minutes of CPU; each search still proves what it can.
DEFAULT_CELL_TIME_LIMIT_S = 4.0
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
                time_limit_s: float | None = None, search_batch_size: bool = False,
                seeds: Mapping[str, tuple[Plan, float]] | None = None
                ) -> tuple[dict[str, Any], Plan | None]:
    """Search ``method`` in ``cell``: the record of the results file (see docs/reproduce.md)
    and the plan (None without one). ``seeds``: plans of ``method``'s space and their
    samples/s, by label (``warm.Found.seeds``); the search starts from them, so its answer is
    at least each of them."""
    # Gap 0: the grid compares methods (ours is never below one inside its space), which needs
    # each search's optimum, not a plan within the default 1 %.
    extra: dict[str, Any] = {"search_batch_size": search_batch_size, "report_partitions": False,
                             "optimality_gap": 0.0}
    if time_limit_s is not None:
        extra["time_limit_s"] = time_limit_s
    options = method.options(**extra)
    seeds = dict(seeds or {})
    record: dict[str, Any] = {"cell": cell.to_dict(), "method": method.name,
                              "global_batch_size": inputs.training.global_batch_size,
                              "warm_start": sorted(seeds)}
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        result = search(inputs.spec, inputs.training, inputs.cluster, inputs.profile,
                        inputs.budget_bytes, options,
                        incumbents=[plan for plan, _ in seeds.values()])
    except InfeasibleError as err:
        least = err.min_memory_bytes
        # No minimum: the space has no plan at all for this shape (divisibility), not an OOM.
        finite = least is not None and math.isfinite(least)
        record.update(status="infeasible" if least is not None else "no_plan",
                      search_time_s=time.perf_counter() - t0,
                      search_cpu_s=time.process_time() - cpu0,
                      min_memory_gb=math.ceil(least / GB * 100) / 100 if finite else None,
                      min_memory_bytes=least if finite else None, message=str(err))
        return record, None
    est = result.estimate
    info = result.search
    record.update(
        status="ok", search_time_s=time.perf_counter() - t0,
        search_cpu_s=time.process_time() - cpu0, time_limit_s=info.get("time_limit_s"),
        samples_per_s=est.samples_per_s, iteration_time_s=est.iteration_time_s,
        peak_memory_bytes=est.peak_memory_bytes,
        stage_peak_memory_bytes=[s.peak_memory_bytes for s in est.stages],
        pp=result.plan.pp_size, virtual_size=result.plan.pipeline.virtual_size,
        num_microbatches=result.plan.num_microbatches,
        global_batch_size=result.plan.global_batch_size,
        proven_optimal=info.get("proven_optimal"), time_limited=info.get("time_limited"),
        # No plan the search priced beat the fastest seed: the answer is that plan, which is
        # all a time-limited search may have to offer.
        from_warm_start=(max(seeds, key=lambda n: seeds[n][1])
                         if info.get("from_incumbent") and seeds else None))
    if plan_dir is not None:
        path = plan_dir / cell.key / f"{method.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        result.plan.save(path)
        record["plan_path"] = str(path)
    return record, result.plan


def _finished_plan(record: Mapping[str, Any]) -> Plan | None:
    """A resumed record's plan (from its plan file), to warm-start the rest."""
    path = record.get("plan_path")
    if record.get("status") != "ok" or not path or not Path(path).exists():
        return None
    return Plan.load(path)


def simulate(cells: Sequence[Cell], methods: Sequence[Method], results: ResultsFile,
             plan_dir: Path | None, profile_dir: str | None = None,
             global_batch_size: int | None = None, time_limit_s: float | None = None,
             search_batch_size: bool = False,
             progress: Callable[[int, int, str], None] | None = None,
             clusters: dict[str, ClusterSpec] | None = None,
             cell_time_limit_s: float | None = None) -> int:
    """Search every (cell, method) not yet in ``results``; returns how many were searched.
    ``clusters``: specs already loaded by name (a measured one, for ``--run``).

    Within a cell the methods run in ``RUN_ORDER`` (small spaces first, ``ours`` last), and
    each starts from the fastest plans in its space found so far for its model and cluster, at
    its budget or a smaller one; a method already known not to fit is recorded so without a
    search (module ``warm``). ``time_limit_s`` limits each search; ``cell_time_limit_s`` all of
    a cell's searches together: each gets its share of what is left (:func:`share`); both in
    CPU seconds, as the planner counts them. A search either limit stops is recorded
    ``proven_optimal: false``."""
    order = sorted(methods, key=lambda m: RUN_ORDER.index(m.name))
    pairs = list(dict.fromkeys((c.model, c.cluster) for c in cells))
    # each model and cluster's budgets smallest first: their plans fit the larger ones
    cells = sorted(cells, key=lambda c: (pairs.index((c.model, c.cluster)), c.budget_gb))
    todo = [(c, m) for c in cells for m in order if not results.done(c.key, m.name)]
    clusters = dict(clusters or {})
    inputs: dict[str, CellInputs] = {}
    shared: dict[tuple[str, str], CellInputs] = {}
    found: dict[tuple[str, str], Found] = {}
    cell_start: dict[str, float] = {}
    for i, (cell, method) in enumerate(todo):
        if progress is not None:
            progress(i, len(todo), f"{cell.key} {method.name}")
        if cell.cluster not in clusters:
            clusters[cell.cluster] = load_cluster(cell.cluster)
        pair = (cell.model, cell.cluster)
        if cell.key not in inputs:
            # One profile object per model and cluster: the planner memoises the strategies it
            # prices per (profile, cluster), so every budget's searches share them.
            if pair not in shared:
                shared[pair] = cell_inputs(ALL_MODELS[cell.model], clusters[cell.cluster],
                                           cell.budget_gb, profile_dir, global_batch_size)
            inputs[cell.key] = dataclasses.replace(
                shared[pair], budget_bytes=shared[pair].cluster.budget_bytes(cell.budget_gb))
            cell_start[cell.key] = time.process_time()
        here = inputs[cell.key]
        if pair not in found:  # resumed: the finished records of this model and cluster
            found[pair] = Found(here.spec, here.cluster.devices_per_node)
            for r in results.all():
                if (r["cell"]["model"], r["cell"]["cluster"]) == pair:
                    found[pair].add(r, _finished_plan(r))
        known = found[pair].known_infeasible(method, here.budget_bytes)
        limit = time_limit_s
        if cell_time_limit_s is not None and known is None:
            left = cell_time_limit_s - (time.process_time() - cell_start[cell.key])
            rest = [m for c, m in todo[i:] if c == cell
                    and found[pair].known_infeasible(m, here.budget_bytes) is None]
            limit = share(left, method, rest, time_limit_s)
        if known is not None:
            record: dict[str, Any] = {"cell": cell.to_dict(), "method": method.name,
                                      "global_batch_size": here.training.global_batch_size,
                                      "search_time_s": 0.0, "search_cpu_s": 0.0, **known}
            if known.get("min_memory_bytes") is not None:
                record["min_memory_gb"] = math.ceil(known["min_memory_bytes"] / GB * 100) / 100
            plan = None
        else:
            seeds = found[pair].seeds(method, cell.budget_gb, here.budget_bytes)
            try:
                record, plan = search_cell(cell, method, here, plan_dir, limit,
                                           search_batch_size, seeds)
            except ValueError as err:  # a space with no plan for this shape (tp vs heads)
                record, plan = {"cell": cell.to_dict(), "method": method.name,
                                "status": "no_plan", "message": str(err)}, None
        found[pair].add(record, plan)
        results.append(record)
        if i + 1 == len(todo) or todo[i + 1][0] != cell:  # the cell is finished
            inputs.pop(cell.key, None)
    if progress is not None:
        progress(len(todo), len(todo), "done")
    return len(todo)


#: Weight of a method in a cell's time. The baselines' spaces are small and mostly proven
#: within their share (an unproven baseline would flatter ours); what they leave goes on to the
#: big spaces, ours last, which start from the baselines' plans anyway.
WEIGHTS = {"galvatron-base": 1.5, "ours-no-bmw": 2.0, "ours-no-recompute": 2.0, "ours": 3.0}
BASELINE_WEIGHT = 1.0
MIN_SEARCH_S = 0.05  # the least any search gets, so that a late one still searches a little


def share(left_s: float, method: Method, rest: Sequence[Method],
          time_limit_s: float | None) -> float:
    """The time limit of ``method``'s search when ``left_s`` seconds of its cell remain for it
    and the ``rest`` of the cell's methods (itself included): its weighted share, at most
    ``time_limit_s``. Small spaces rarely use theirs, so what they leave goes to the later."""
    weights = [WEIGHTS.get(m.name, BASELINE_WEIGHT) for m in rest]
    mine = WEIGHTS.get(method.name, BASELINE_WEIGHT) / sum(weights) * max(left_s, 0.0)
    capped = max(MIN_SEARCH_S, mine)
    return min(capped, time_limit_s) if time_limit_s is not None else capped
