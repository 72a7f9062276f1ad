"""``megatron-auto reproduce``: the experiment grid from the command line (docs/reproduce.md).

Simulated by default (searched and priced on the cluster presets or files, on any machine);
``--run`` also trains each plan on the cluster this command runs on and records the measurement
next to the estimate. Results are appended to ``--results`` as they finish and the tables and
figures are rewritten at the end; rerunning the same command resumes.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..planner.inputs.hardware import ClusterSpec
from ..utils.flag_warnings import warn_flag
from ..utils.progress import Progress
from .grid import DEFAULT_CLUSTERS, GRID_VERSION, MODELS, TINY_MODELS, cells, select_budgets, \
    select_models
from .measure import PlanRuns, measure_cluster, measure_profile
from .methods import METHODS, select_methods
from .report import write_figures, write_tables
from .results import ResultsFile, record_key
from .tables import summary
from .simulate import DEFAULT_CELL_TIME_LIMIT_S, load_cluster, simulate

GB = 1e9
logger = logging.getLogger("megatron_auto")


def add_reproduce_parser(sub: Any) -> None:
    p = sub.add_parser(
        "reproduce", allow_abbrev=False,
        help="the paper's experiment grid: every method searched and priced per model, cluster "
             "and budget (--run: also trained here)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("grid")
    g.add_argument("--models", default=None, metavar="A,B",
                   help=f"models (default: all of the paper's: {', '.join(MODELS)}; tiny ones "
                        f"for CPU smoke runs: {', '.join(TINY_MODELS)})")
    g.add_argument("--clusters", default=None, metavar="A,B",
                   help=f"cluster presets or cluster files (default {','.join(DEFAULT_CLUSTERS)})")
    g.add_argument("--budgets", default=None, metavar="GB,GB",
                   help="memory budgets per device in GB (default 8,12,16,20,40; a budget above "
                        "a cluster's device memory skips that cluster)")
    g.add_argument("--methods", default=None, metavar="A,B",
                   help=f"methods (default all: {', '.join(METHODS)})")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="one global batch for every model (default: each model's, 128)")
    g.add_argument("--search-batch-size", action="store_true",
                   help="let every method also search the global batch size")
    g.add_argument("--profile-dir", default=None, metavar="DIR",
                   help="measured or imported model profiles, DIR/<model>.json (default: "
                        "analytic profiles)")
    g.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="CPU seconds per search (default: the planner's, 10 s)")
    g.add_argument("--cell-time-limit", type=float, default=DEFAULT_CELL_TIME_LIMIT_S,
                   metavar="SECONDS",
                   help="CPU seconds of a cell's searches together, shared by weight (most "
                        f"to ours; default {DEFAULT_CELL_TIME_LIMIT_S:g}; 0: no cell limit). A "
                        "search a limit stops is marked not proven optimal")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="reproduce_out", metavar="DIR",
                   help="directory of the results, tables, plans and figures")
    o.add_argument("--results", default=None, metavar="FILE",
                   help="results JSONL (default OUT/results.jsonl; appended, resumed)")
    o.add_argument("--no-plots", action="store_true", help="skip the figures")
    o.add_argument("--table-out", default=None, metavar="FILE",
                   help="also write the Markdown table here, with the command that made it")
    o.add_argument("--quiet", action="store_true", help="no progress lines")
    r = p.add_argument_group("measure on this cluster (--run)")
    r.add_argument("--run", action="store_true",
                   help="re-plan every method on this cluster's measured profiles and train it")
    r.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks per node for --run (default: the GPUs here, else 2)")
    r.add_argument("--run-iters", type=int, default=10, help="iterations per run (default 10)")
    r.add_argument("--run-cluster", default=None, metavar="FILE",
                   help="this cluster's hardware profile (default: measure it now)")
    p.set_defaults(func=cmd_reproduce)


def _reporter(enabled: bool, unit: str) -> Callable[[int, int, str], None]:
    """``(done, total, label)`` callback onto the shared progress reporter (``progress.py``:
    a tqdm bar on a terminal, plain lines otherwise), opened at the first call."""
    state: dict[str, Progress] = {}

    def report(done: int, total: int, label: str) -> None:
        if "bar" not in state:
            state["bar"] = Progress("megatron-auto reproduce", total, unit, enabled=enabled,
                                    interval_s=5.0)
        state["bar"].update_to(done, at=label)
        if done == total:
            state["bar"].close()
    return report


def _load() -> str:
    """The machine's 1-minute load average (wall-clock limits depend on it), or "unknown"."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except (AttributeError, OSError):
        return "unknown"


def _nproc(args: argparse.Namespace) -> int:
    if args.nproc_per_node is not None:
        if args.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node={args.nproc_per_node}: must be >= 1")
        return args.nproc_per_node
    return 2  # CPUs (gloo); on a GPU node pass the GPU count


def _warn_mode_flags(args: argparse.Namespace) -> None:
    """The --run flags without --run, and the grid flags --run replaces, when typed."""
    given = getattr(args, "given_flags", None) or frozenset()
    if args.run:
        unused = [("clusters", "--run plans on this cluster's measured profile"),
                  ("profile_dir", "--run measures the profiles into OUT/profiles")]
    else:
        unused = [(dest, "it applies to --run (train the plans on this cluster)")
                  for dest in ("nproc_per_node", "run_iters", "run_cluster")]
    for dest, why in unused:
        if dest in given:
            warn_flag(f"--{dest.replace('_', '-')}={getattr(args, dest)}: ignored; {why}")


def cmd_reproduce(args: argparse.Namespace) -> int:
    _warn_mode_flags(args)
    models = select_models(args.models)
    methods = select_methods(args.methods)
    budgets = select_budgets(args.budgets)
    if args.global_batch_size is not None and args.global_batch_size < 1:
        raise ValueError(f"--global-batch-size={args.global_batch_size}: must be positive")
    if args.time_limit is not None and not 0 < args.time_limit < float("inf"):
        raise ValueError(f"--time-limit={args.time_limit:g}: give a positive number of seconds")
    if not 0 <= args.cell_time_limit < float("inf"):
        raise ValueError(f"--cell-time-limit={args.cell_time_limit:g}: give a positive number "
                         f"of seconds, or 0 for no cell limit")
    if args.run_iters < 3:
        raise ValueError(f"--run-iters={args.run_iters}: give at least 3 (the first two "
                         f"iterations are warm-up and not measured)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = ResultsFile(args.results or out / "results.jsonl")
    known: dict[str, ClusterSpec] = {}
    profile_dir = args.profile_dir
    if args.run:
        nproc = _nproc(args)
        path = Path(args.run_cluster) if args.run_cluster else measure_cluster(
            out / "cluster.json", nproc)
        here = load_cluster(str(path))
        known[here.name] = here
        clusters = [here.name]
        profile_dir = out / "profiles"
        profile_dir.mkdir(exist_ok=True)
        for model in models:
            measure_profile(model, profile_dir)
    else:
        clusters = [c.strip() for c in (args.clusters or ",".join(DEFAULT_CLUSTERS)).split(",")
                    if c.strip()]
        for name in clusters:
            known[name] = load_cluster(name)
    grid = cells(models, clusters, budgets, lambda c: known[c].device_memory_bytes / GB)
    if not grid:
        raise ValueError(f"--budgets {args.budgets}: every budget exceeds the device memory of "
                         f"{', '.join(clusters)}; give smaller budgets")
    progress = _reporter(not args.quiet, "searches")
    wall0, cpu0, load0 = time.perf_counter(), time.process_time(), _load()
    searched = simulate(grid, methods, results, out / "plans", profile_dir,
                        args.global_batch_size, args.time_limit, args.search_batch_size,
                        progress, clusters=known,
                        cell_time_limit_s=args.cell_time_limit or None)
    timing = (f"{searched} (cell, method) records in {time.perf_counter() - wall0:.0f} s wall, "
              f"{time.process_time() - cpu0:.0f} s CPU; 1-minute load average {load0} at the "
              f"start, {_load()} at the end")
    measured = 0
    if args.run:
        runs = PlanRuns()
        by_name = {m.name: m for m in models}
        todo = [r for r in results.all() if r["cell"]["cluster"] in clusters
                and r.get("status") == "ok" and "measured" not in r
                and r["method"] in {m.name for m in methods}
                and r["cell"]["model"] in by_name]
        run_progress = _reporter(not args.quiet, "training runs")
        for i, record in enumerate(todo):
            run_progress(i, len(todo), f"{record['cell']['model']} {record['method']}")
            model = by_name[record["cell"]["model"]]
            log_dir = Path(record["plan_path"]).with_suffix("")
            record = {**record, "measured": runs.measure(model, record["plan_path"], nproc,
                                                         args.run_iters, log_dir)}
            results.append(record)
            measured += 1
        run_progress(len(todo), len(todo), "done")
    keys = {c.key for c in grid}
    names = {m.name for m in methods}
    records = [r for r in results.all() if record_key(r)[0] in keys and r["method"] in names]
    written = write_tables(records, methods, grid, out)
    figures = [] if args.no_plots else write_figures(records, methods, grid, out)
    lines = summary(records, methods)
    if args.table_out:
        Path(args.table_out).write_text(table_file(args, models, clusters, budgets, methods,
                                                   (out / "results.md").read_text("utf-8"),
                                                   lines, timing), encoding="utf-8")
    print(f"reproduce (grid version {GRID_VERSION}): {len(grid)} cells x {len(methods)} methods; "
          f"searched {searched}, trained {measured}, results in {results.path} ({timing})")
    for path in [*written.values(), *figures[:3]]:
        print(f"  wrote {path}")
    if len(figures) > 3:
        print(f"  wrote {len(figures) - 3} more figures under {out}")
    print((out / "results.md").read_text(encoding="utf-8"), end="")
    for line in lines:
        print(line)
    return 0


def table_file(args: argparse.Namespace, models: list, clusters: list[str],
               budgets: list[float], methods: list, table: str, lines: list[str],
               timing: str) -> str:
    """``--table-out``'s text: the command that regenerates it (every default spelled out),
    the table's legend, the table and the summary lines."""
    command = (f"megatron-auto reproduce --models {','.join(m.name for m in models)} "
               f"--clusters {','.join(clusters)} --budgets {','.join(f'{b:g}' for b in budgets)}"
               f" --methods {','.join(m.name for m in methods)}"
               f" --cell-time-limit {args.cell_time_limit:g}"
               + (f" --time-limit {args.time_limit:g}" if args.time_limit else "")
               + (f" --global-batch-size {args.global_batch_size}"
                  if args.global_batch_size else "")
               + (" --search-batch-size" if args.search_batch_size else "")
               + (" --profile-dir DIR" if args.profile_dir else ""))
    return (f"<!-- generated by megatron-auto reproduce --table-out; do not edit -->\n\n"
            f"Generated by `{command}` (grid version {GRID_VERSION}; {timing} on the machine "
            f"that made it). Estimated samples/s per method; `*`: best of the row; "
            f"`†`: not proven optimal (the search stopped at its time limit; warm-started by "
            f"the plans of its sub-spaces, so still at least each of them); `OOM (needs X GB)`: "
            f"no plan of the method fits, X is the least memory one needs; `-`: the method has "
            f"no plan for the shape.\n\n" + table + "\n" + "".join(f"- {x}\n" for x in lines))
