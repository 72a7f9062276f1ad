"""Per-stage optimizer offload fractions (``SearchOptions.per_stage_offload``,
``search/mixed_offload.py``) against one fraction for every stage, in the same run, on the
same inputs (analytic profiles, no GPU).

    python benchmarks/bench_mixed_offload.py
    python benchmarks/bench_mixed_offload.py --repeats 3 --time-limit 30
    python benchmarks/bench_mixed_offload.py --table-out docs/planner.md   # its table, in place

Each case is searched once per setting per repeat (alternating which goes first) with a host
budget (so activation offload and optimizer offload are searched), the given time limit (CPU
seconds) and optimality gap; the table shows per setting the least CPU seconds, the answer's
samples/s, its fractions and the certified gap. The per-stage space holds every uniform plan,
so where both are proven its answer is never slower.
"""

from __future__ import annotations

import time

from bench_moe_plans import write_table
from search_ab import least_of, parse_args, tiny_gpt

from megatron_auto.planner import (InfeasibleError, ModelSpec, SearchOptions, TrainingSpec,
                                   analytic_profile, search)
from megatron_auto.planner.inputs.presets import get_cluster

GB = 1e9
BEGIN = "<!-- bench_mixed_offload.py --table-out: begin -->"
END = "<!-- bench_mixed_offload.py: end -->"


def _three_stage():
    """tests/test_planner_mixed_offload.py's instance: three 1 GB devices, a four-layer GPT
    whose activations dominate (stage 0 binds, the last stage owns the most state)."""
    return tiny_gpt(3, 4, 3, hidden=64, ffn=256, seq=256, vocab=128)


def _gpt(layers, hidden, heads, seq, batch, cluster):
    def build():
        return (ModelSpec.uniform(layers, hidden, heads, seq, 50304, name="gpt"),
                TrainingSpec(batch), get_cluster(cluster))
    return build


# (label, inputs, device budget bytes, host budget bytes, pinned pp or None, other options):
# the tiny instance at its least device budget with 60% and 100% of its largest host need, in
# its test's space (ddp, no recompute, no activation offload: the optimizer's fractions alone),
# and larger GPTs in the full space with 64 GB of host memory per rank
TINY = {"dp_modes": ("ddp",), "allow_recompute": False, "activation_offload": False}
CASES = [
    ("tiny GPT 3 stages", _three_stage, 4_670_469, 1_039_565, 3, TINY),
    ("tiny GPT 3 stages", _three_stage, 4_903_993, 1_732_608, 3, TINY),
    ("GPT 2.7B 4xA100-40G", _gpt(32, 2560, 32, 1024, 16, "a100-40g-1x4"), 10e9, 64e9, None, {}),
    ("GPT 6.7B 8xA100-40G, pp 4", _gpt(32, 4096, 32, 1024, 32, "a100-40g-1x8"), 16e9, 64e9, 4,
     {}),
    ("GPT 6.7B 8xA100-40G, pp 4", _gpt(32, 4096, 32, 1024, 32, "a100-40g-1x8"), 14e9, 64e9, 4,
     {}),
]


def _search(case, per_stage: bool, limit: float, gap: float):
    _, build, budget, host, pp, extra = case
    spec, training, cluster = build()
    profile = analytic_profile(spec, training, cluster)
    options = SearchOptions(show_progress=False, include_baselines=False,
                            report_partitions=False, time_limit_s=limit, optimality_gap=gap,
                            host_memory_budget_bytes=host, per_stage_offload=per_stage, pp=pp,
                            virtual_sizes=(1,) if pp else (1, 2, 4), **extra)
    t0 = time.process_time()
    try:
        result = search(spec, training, cluster, profile, int(budget), options)
    except InfeasibleError:  # no plan of the space fits both budgets
        result = None
    return time.process_time() - t0, result


def _cells(result) -> tuple[str, str, str]:
    """samples/s, fractions and certified gap of an answer ("none fits" without one)."""
    if result is None:
        return "none fits", "-", "-"
    return (f"{result.estimate.samples_per_s:.3f}", _fractions(result.plan),
            f"{100 * result.plan.search['optimality_gap']:.2f}%")


def _fractions(plan) -> str:
    value = plan.pipeline.optimizer_offload_fraction
    return "/".join(f"{x:g}" for x in value) if isinstance(value, tuple) else f"{value:g}"


def main() -> None:
    args = parse_args(__doc__)
    lines = [f"Time limit {args.time_limit:g} CPU s, optimality gap {args.gap:g}; least CPU s "
             f"of {args.repeats}.", "",
             "| case | GB | host GB | CPU s per-stage / uniform | samples/s per-stage / uniform "
             "| fractions per-stage / uniform | gap per-stage / uniform |",
             "|---|---|---|---|---|---|---|"]
    for case in CASES:
        best = least_of(args.repeats, (True, False),
                        lambda per_stage, case=case: _search(case, per_stage, args.time_limit,
                                                             args.gap))
        (s_on, on), (s_off, off) = best[True], best[False]
        if on is not None and off is not None and on.plan.search["optimality_gap"] == 0 \
                and off.plan.search["optimality_gap"] == 0:  # both proven: never slower
            assert on.estimate.samples_per_s >= off.estimate.samples_per_s * (1 - 1e-9)
        cells = list(zip(_cells(on), _cells(off)))
        row = (f"| {case[0]} | {case[2] / GB:.4g} | {case[3] / GB:.4g} | {s_on:.2f} / {s_off:.2f} | "
               + " | ".join(f"{a} / {b}" for a, b in cells) + " |")
        print(row, flush=True)
        lines.append(row)
    table = "\n".join(lines) + "\n"
    if args.table_out:
        write_table(args.table_out, table, BEGIN, END)


if __name__ == "__main__":
    main()
