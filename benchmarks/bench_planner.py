"""Planner speed and quality: search wall time and the searched plan's estimated throughput
against the best baseline space, on three reference problems (analytic profiles, no GPU).

    python benchmarks/bench_planner.py            # all three
    python benchmarks/bench_planner.py --only a   # one of a, b, c
    python benchmarks/bench_planner.py --table-out table.md   # the docs/planner.md §7 table

(a) BERT-Large-like, 24 layers, 8 GPUs (a100-40g-1x8), budgets 8/12/16/20 GB, batch 64.
(b) GPT 1.5B (48 layers, h=1600, 25 heads -> 32 heads for TP), 16 GPUs (a100-40g-2x8), 40 GB.
(c) GPT-3 175B (96 layers, h=12288, 96 heads, s=2048), 1024 GPUs (h100-80g 128x8), 80 GB.
The search is exact when it finishes (``proven optimal``); it stops proving after the default
time limit (search.DEFAULT_TIME_LIMIT_S) and says so. For a search that ends with a pipeline,
every classic partition kind (even, memory- and time-balanced, the paper's BMW) is priced for
the winner's task and printed next to the exact answer. The CPU time is printed next to the
wall time because a shared machine inflates the latter (the time limit counts CPU seconds).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from megatron_auto.planner import (InfeasibleError, ModelSpec, SearchOptions, TrainingSpec,
                                   analytic_profile, search)
from megatron_auto.planner.inputs.presets import get_cluster, make_cluster

GB = 1e9


ROWS: list[str] = []


def _partitions(plan) -> str:
    parts = plan.search.get("partitions")
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, dict) or len(parts) <= 1:
        return "one stage"
    return ", ".join(
        f"{k} {v['samples_per_s']:.1f}" if v.get("samples_per_s") else f"{k} -"
        for k, v in parts.items())


def _gap(search: dict) -> str:
    """The certified gap a search records (answer / lower bound - 1), as a percentage."""
    gap = search.get("optimality_gap")
    return "n/a" if gap is None else f"{gap:.2%}"


def _proven(search: dict) -> str:
    """yes, or what stopped the search first: the time limit or the gap asked for."""
    if search.get("proven_optimal"):
        return "yes"
    return "no (time limit)" if search.get("time_limited") else "no (gap reached)"


MODULE_RECOMPUTE: tuple = ()  # --module-recompute: the per-layer choices beside none/full
GAP: dict = {}  # --optimality-gap (default: the search's)


def run(label: str, spec: ModelSpec, training: TrainingSpec, cluster, budgets_gb,
        time_limit_s: float | None = None) -> None:
    profile = analytic_profile(spec, training, cluster)
    for budget in budgets_gb:
        t0 = time.perf_counter()
        c0 = time.process_time()
        try:
            result = search(spec, training, cluster, profile, int(budget * GB),
                            SearchOptions(show_progress=False, include_baselines=False,
                                          time_limit_s=time_limit_s,
                                          module_recompute=MODULE_RECOMPUTE, **GAP))
        except InfeasibleError as err:
            print(f"{label} {budget:>5.0f} GB: infeasible: {err}")
            continue
        search_s = time.perf_counter() - t0
        search_cpu = time.process_time() - c0
        t1 = time.perf_counter()
        c1 = time.process_time()
        full = search(spec, training, cluster, profile, int(budget * GB),
                      SearchOptions(show_progress=False, time_limit_s=time_limit_s, **GAP))
        baseline_s = time.perf_counter() - t1
        baseline_cpu = time.process_time() - c1
        best_name, best = None, None
        for name, est in full.baselines.items():
            if est is not None and (best is None or est.samples_per_s > best.samples_per_s):
                best_name, best = name, est
        core = result.estimate.samples_per_s  # the full space alone (no baseline searched)
        plan = full.plan
        info = result.plan.search
        tps = sorted({layer.tp for layer in plan.layers})
        modes = sorted({layer.dp_mode for layer in plan.layers})
        rc = sum(layer.recompute for layer in plan.layers)
        base_txt = (f"best baseline {best_name} {best.samples_per_s:9.2f} samples/s "
                    f"(x{full.estimate.samples_per_s / best.samples_per_s:.3f})"
                    if best else "no baseline fits")
        adopted = plan.search.get("adopted_from_baseline")
        print(f"{label} {budget:>5.0f} GB: search {search_s:6.2f} s wall, {search_cpu:6.2f} s CPU "
              f"(with baselines {baseline_s:6.2f} s) | {full.estimate.samples_per_s:9.2f} "
              f"samples/s (full space alone {core:9.2f}, proven optimal "
              f"{info['proven_optimal']}, gap {_gap(info)} / {_gap(plan.search)}, adopted from "
              f"baseline {adopted}) | pp={plan.pp_size} "
              f"m={plan.num_microbatches} stages={list(plan.pipeline.layers_per_stage)} "
              f"tp={tps} dp={modes} recompute={rc}/{plan.num_layers} vocab={plan.vocab.tp}/"
              f"{plan.vocab.dp_mode} | {base_txt} | partitions {_partitions(plan)}")
        cut = plan.search.get("baselines_time_limited") or []
        base_md = (f"{best_name} {best.samples_per_s:.1f} "
                   f"(x{full.estimate.samples_per_s / best.samples_per_s:.3f})"
                   if best else "none fits")
        if cut:
            base_md += f"; cut by the time limit: {', '.join(cut)}"
        ROWS.append(
            f"| {label} | {budget:.0f} GB | {search_cpu:.2f} ({search_s:.2f}) | "
            f"{baseline_cpu:.2f} ({baseline_s:.2f}) | {core:.1f} | "
            f"{full.estimate.samples_per_s:.1f}{' (baseline adopted)' if adopted else ''} | "
            f"{_proven(info)} / {_proven(plan.search)} | "
            f"{_gap(info)} / {_gap(plan.search)} | pp {plan.pp_size}, "
            f"m {plan.num_microbatches}, tp {tps}, {'/'.join(modes)}, recompute {rc} | "
            f"{base_md} | {_partitions(plan)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["a", "b", "c"], help="run one problem")
    parser.add_argument("--module-recompute", nargs="+", default=[], metavar="VALUE",
                        help='also search these per-layer recompute values (e.g. selective)')
    parser.add_argument("--markdown", action="store_true",
                        help="also print the rows as the table of docs/planner.md section 7")
    parser.add_argument("--table-out", default=None, metavar="FILE",
                        help="also write that table (Markdown, with the run's load) to FILE")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="the search's CPU-time limit (default search.DEFAULT_TIME_LIMIT_S)")
    parser.add_argument("--optimality-gap", type=float, default=None, metavar="GAP",
                        help="the search's certified gap (default 0.01; 0 proves the optimum)")
    args = parser.parse_args()
    if args.optimality_gap is not None:
        GAP["optimality_gap"] = args.optimality_gap
    global MODULE_RECOMPUTE
    MODULE_RECOMPUTE = tuple(args.module_recompute)
    load0 = os.getloadavg()[0]
    if args.only in (None, "a"):
        spec = ModelSpec.uniform(24, 1024, 16, 512, 30592, name="bert", causal=False)
        run("(a) BERT-Large 8xA100-40G", spec, TrainingSpec(64), get_cluster("a100-40g-1x8"),
            [8, 12, 16, 20], args.time_limit)
    if args.only in (None, "b"):
        spec = ModelSpec.uniform(48, 1600, 32, 1024, 50304, name="gpt-1.5b")
        run("(b) GPT-1.5B 16xA100-40G", spec, TrainingSpec(128), get_cluster("a100-40g-2x8"),
            [40], args.time_limit)
    if args.only in (None, "c"):
        spec = ModelSpec.uniform(96, 12288, 96, 2048, 51200, name="gpt3-175b")
        run("(c) GPT-3 175B 1024xH100", spec, TrainingSpec(1536),
            make_cluster("h100-80g", num_nodes=128, devices_per_node=8), [80], args.time_limit)
    table = ["| problem | budget | search CPU s (wall), full space alone | with baselines CPU s "
             "(wall) | full space alone samples/s | answer samples/s | proven (alone / with "
             "baselines) | certified gap (alone / with baselines) | plan | best baseline | "
             "partitions of the winner's task (samples/s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|", *ROWS]
    if args.markdown:
        print("\n".join(table))
    if args.table_out:
        note = (f"\nLoad average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, "
                f"on {os.cpu_count()} CPUs.\n")
        Path(args.table_out).write_text("\n".join(table) + "\n" + note, encoding="utf-8")


if __name__ == "__main__":
    main()
