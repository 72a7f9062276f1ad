"""The search with and without the Lagrangian bound (``search/lagrange_bound.py``), in the same
run, on the same inputs (analytic profiles, no GPU).

    python benchmarks/bench_lagrange_bound.py
    python benchmarks/bench_lagrange_bound.py --repeats 3 --time-limit 10
    python benchmarks/bench_lagrange_bound.py --table-out docs/planner.md   # its table, in place

"Without" is ``lagrange_bound.ENABLED = False``: no task is settled by the Lagrangian bound
before its seeds and DP bounds, and the plain tasks of pass 2 are ordered by the bounds they had
before it. Each case is searched once per setting per repeat (alternating which goes first)
with the given time limit (CPU seconds, the default 10 of ``megatron-auto plan``) and
optimality gap, baselines left out; the table shows, per setting, the least CPU seconds, the
answer's samples/s and the certified gap the search reports. Where both reach the gap asked,
the answers must agree within it.
"""

from __future__ import annotations

from bench_moe_plans import write_table
from bench_partition_bound import BERT, GPT_1_5B, GPT_6_7B, _search
from search_ab import on_off_table, parse_args

from megatron_auto.planner import ModelSpec
from megatron_auto.planner.search import lagrange_bound

BEGIN = "<!-- bench_lagrange_bound.py --table-out: begin -->"
END = "<!-- bench_lagrange_bound.py: end -->"

# LLaMA-7B's shape (hidden 4096, 32 heads, FFN 11008, sequence 2048, vocabulary 32000)
LLAMA_7B = ModelSpec.uniform(32, 4096, 32, 2048, 32000, ffn_hidden_size=11008, name="llama-7b",
                            activation="swiglu")

# (label, spec, batch, cluster, budget GB, host GB or None, pinned pp or None)
CASES = [
    ("BERT-Large 8xA100-40G", BERT, 64, "a100-40g-1x8", 8, None, None),
    ("GPT-1.5B 16xA100-40G", GPT_1_5B, 128, "a100-40g-2x8", 20, None, None),
    ("GPT-1.5B 16xA100-40G", GPT_1_5B, 128, "a100-40g-2x8", 40, None, None),
    ("LLaMA-7B shape 8xA100-40G", LLAMA_7B, 64, "a100-40g-1x8", 26, None, None),
    ("LLaMA-7B shape 8xA100-40G", LLAMA_7B, 64, "a100-40g-1x8", 38, None, None),
    ("GPT 6.7B 8xA100-40G, pp 4", GPT_6_7B, 32, "a100-40g-1x8", 20, None, 4),
]


def main() -> None:
    args = parse_args(__doc__)
    table = on_off_table(args, CASES, lagrange_bound, _search)
    if args.table_out:
        write_table(args.table_out, table, BEGIN, END)


if __name__ == "__main__":
    main()
