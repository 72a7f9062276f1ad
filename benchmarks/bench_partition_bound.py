"""The root bound with and without the partition bound (``search/partition_bound.py``), in the
same run, on the same inputs (analytic profiles, no GPU).

    python benchmarks/bench_partition_bound.py
    python benchmarks/bench_partition_bound.py --repeats 3 --time-limit 30
    python benchmarks/bench_partition_bound.py --table-out docs/planner.md   # its table, in place

Each case is searched once per setting per repeat (alternating which goes first) with the
given time limit (CPU seconds) and optimality gap; the table shows, per setting, the least
CPU seconds, the answer's samples/s and the certified gap the search reports. Where both
prove their answer (gap at or below the one asked) the answers must agree.
"""

from __future__ import annotations

import time

from bench_moe_plans import write_table
from search_ab import on_off_table, parse_args

from megatron_auto.planner import ModelSpec, SearchOptions, TrainingSpec, analytic_profile, search
from megatron_auto.planner.inputs.presets import get_cluster
from megatron_auto.planner.search import partition_bound

GB = 1e9
BEGIN = "<!-- bench_partition_bound.py --table-out: begin -->"
END = "<!-- bench_partition_bound.py: end -->"

GPT_6_7B = ModelSpec.uniform(32, 4096, 32, 1024, 50304, name="gpt")
GPT_1_5B = ModelSpec.uniform(48, 1600, 32, 1024, 50304, name="gpt-1.5b")
BERT = ModelSpec.uniform(24, 1024, 16, 512, 30592, name="bert", causal=False)

# (label, spec, batch, cluster, budget GB, host GB or None, pinned pp or None): the search's
# reference cases, and a 6.7B GPT on one node with the pipeline pinned to 4 stages (as
# ``--pipeline-model-parallel-size 4`` without interleaving pins it), without and with a host
# budget (then activation offload and per-stage optimizer offload are searched too)
CASES = [
    ("BERT-Large 8xA100-40G", BERT, 64, "a100-40g-1x8", 8, None, None),
    ("GPT-1.5B 16xA100-40G", GPT_1_5B, 128, "a100-40g-2x8", 40, None, None),
    ("GPT 6.7B 8xA100-40G, pp 4", GPT_6_7B, 32, "a100-40g-1x8", 20, None, 4),
    ("GPT 6.7B 8xA100-40G, pp 4", GPT_6_7B, 32, "a100-40g-1x8", 16, 64, 4),
    ("GPT 6.7B 8xA100-40G, pp 4", GPT_6_7B, 32, "a100-40g-1x8", 14, 64, 4),
]


def _search(case, limit: float, gap: float):
    _, spec, batch, cluster_name, budget, host, pp = case
    training, cluster = TrainingSpec(batch), get_cluster(cluster_name)
    profile = analytic_profile(spec, training, cluster)
    options = SearchOptions(show_progress=False, include_baselines=False,
                            report_partitions=False, time_limit_s=limit, optimality_gap=gap,
                            host_memory_budget_bytes=host * GB if host else None, pp=pp,
                            virtual_sizes=(1,) if pp else (1, 2, 4))
    t0 = time.process_time()
    result = search(spec, training, cluster, profile, int(budget * GB), options)
    return time.process_time() - t0, result


def main() -> None:
    args = parse_args(__doc__)
    table = on_off_table(args, CASES, partition_bound, _search, host_column=True)
    if args.table_out:
        write_table(args.table_out, table, BEGIN, END)


if __name__ == "__main__":
    main()
