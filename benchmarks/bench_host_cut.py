"""The exact search's host cut (``exact.EARLY_HOST_CUT``): search work and CPU time with the
cut and with the leaf check alone, in the same run, on the same inputs (analytic profiles, no
GPU).

    python benchmarks/bench_host_cut.py
    python benchmarks/bench_host_cut.py --repeats 5
    python benchmarks/bench_host_cut.py --table-out docs/planner.md   # its table, in place

With a host budget (``--host-memory-budget-gb``) every layer strategy also offers activation
offload and each task is searched at the optimizer offload fractions too; without the cut a
branch whose stage has already offloaded more activations than the host holds is walked to its
leaves and priced there. Each row searches exactly (gap 0, no time limit) once per setting per
repeat, alternating which goes first, and prints the nodes, the plans priced, the least CPU
seconds of each and their ratio; the two answers must agree (the cut only drops plans that do
not fit).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench_moe_plans import write_table
from search_ab import tiny_gpt

from megatron_auto.planner import ModelSpec, SearchOptions, TrainingSpec, analytic_profile, search
from megatron_auto.planner.inputs.presets import get_cluster
from megatron_auto.planner.search import exact

GB = 1e9
# --table-out into a file holding these two lines replaces what lies between them
BEGIN, END = "<!-- bench_host_cut.py --table-out: begin -->", "<!-- bench_host_cut.py: end -->"



def _tiny():
    """One device, four small GPT layers, a 1 GB device (tests/test_planner_host_cut.py's
    instance): parameters and activations both matter, so offload is chosen somewhere."""
    return tiny_gpt(1, 4, 2)


def _bert():
    spec = ModelSpec.uniform(24, 1024, 16, 512, 30592, name="bert", causal=False)
    return spec, TrainingSpec(64), get_cluster("a100-40g-1x8")


# (label, inputs, device budget bytes, host budgets bytes): the tiny instance at its least
# device budget under each host budget (0.54 MB: 1% of the most host bytes any of its plans
# needs, where the cut fires; 1.6 MB, 5.4 MB: 3% and 10%), and BERT-Large at 8 GB
CASES = [
    ("tiny GPT 1 device", _tiny, [(52877152, 537661.44), (52403527, 1612984.32),
                                  (52403527, 5376614.4)]),
    ("BERT-Large 8xA100-40G", _bert, [(8 * GB, 0.25 * GB), (8 * GB, 1 * GB), (8 * GB, 4 * GB)]),
]


def _once(spec, training, cluster, profile, budget, host, cut: bool):
    exact.EARLY_HOST_CUT = cut
    options = SearchOptions(show_progress=False, optimality_gap=0.0, time_limit_s=1e6,
                            host_memory_budget_bytes=host, include_baselines=False,
                            report_partitions=False)
    start = time.process_time()
    result = search(spec, training, cluster, profile, budget, options)
    return time.process_time() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--table-out", default=None, metavar="FILE",
                        help="write the table as Markdown; in a file with the BEGIN/END markers "
                             "(docs/planner.md's offload section) between them")
    args = parser.parse_args()
    rows = ["| case | host GB | nodes cut / leaf-only | priced cut / leaf-only | CPU s cut | "
            "CPU s leaf-only | speed-up |", "|---|---|---|---|---|---|---|"]
    print("\n".join(rows))
    try:
        for label, inputs, budgets in CASES:
            spec, training, cluster = inputs()
            profile = analytic_profile(spec, training, cluster)
            for budget, host in budgets:
                times: dict[bool, list[float]] = {True: [], False: []}
                results = {}
                for r in range(args.repeats):
                    for cut in ((True, False) if r % 2 == 0 else (False, True)):
                        cpu, results[cut] = _once(spec, training, cluster, profile, budget,
                                                  host, cut)
                        times[cut].append(cpu)
                a, b = results[True], results[False]
                if abs(a.estimate.iteration_time_s / b.estimate.iteration_time_s - 1) > 1e-9:
                    raise SystemExit(f"{label} host {host} GB: the answers differ "
                                     f"({a.estimate.iteration_time_s} vs "
                                     f"{b.estimate.iteration_time_s})")
                ta, tb = min(times[True]), min(times[False])
                rows.append(f"| {label} | {host / GB:.4g} | {a.plan.search['nodes']} / "
                            f"{b.plan.search['nodes']} | {a.plan.search['plans_priced']} / "
                            f"{b.plan.search['plans_priced']} | {ta:.3f} | {tb:.3f} | "
                            f"{tb / ta:.2f}x |")
                print(rows[-1], flush=True)
    finally:
        exact.EARLY_HOST_CUT = True
    if args.table_out:
        write_table(Path(args.table_out), "\n".join(rows) + "\n", BEGIN, END)


if __name__ == "__main__":
    main()
