"""Mixtral-style MoE plans under our cost model: the search's best plan with expert parallelism,
the best with ep pinned to 1, and the best Megatron-style uniform EP plan (analytic profiles,
no GPU; every number is an estimate of the same cost model).

    python benchmarks/bench_moe_plans.py                     # both problems
    python benchmarks/bench_moe_plans.py --only 8x8
    python benchmarks/bench_moe_plans.py --table-out docs/planner.md   # its MoE table, in place

Problems (bf16, sequence 4096, Mixtral-8x7B's layer: h 4096, 32 heads, 8 key/value groups,
8 experts of 14336, top-2, RMSNorm, SwiGLU, RoPE, untied 32000-row vocabulary):

- ``1x8``: 8 of its 32 layers (12.9B parameters: the whole model's 747 GB of fp32 states do not
  fit 8 x 80 GB) on h100-80g-1x8, global batch 32;
- ``8x8``: the whole Mixtral-8x7B (32 layers, 46.7B parameters) on h100-80g-8x8, global batch
  256.

Uniform EP plans (Megatron's flags: one tp, pp, ep, the distributed optimizer or not, full
recompute or none, an even split, every micro-batch count) are priced with ``evaluate`` and
the fastest that fits is shown. The search runs within its default CPU time limit
(``proven optimal`` says whether it finished); the CPU seconds are printed (load dependent).
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

from megatron_auto.config import ModelConfig
from megatron_auto.families.gpt.config import MoEConfig
from megatron_auto.families.registry import model_spec
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy, even_partition
from megatron_auto.planner import SearchOptions, TrainingSpec, analytic_profile, evaluate, search
from megatron_auto.planner.inputs.presets import get_cluster

GB = 1e9
# --table-out into a file holding these two lines replaces what lies between them (the docs'
# table is regenerated in place, never edited by hand); any other file is overwritten.
BEGIN, END = "<!-- bench_moe_plans.py --table-out: begin -->", "<!-- bench_moe_plans.py: end -->"


def mixtral(num_layers: int) -> ModelConfig:
    return ModelConfig(num_layers=num_layers, hidden_size=4096, num_attention_heads=32,
                       num_query_groups=8, ffn_hidden_size=14336, seq_length=4096,
                       max_position_embeddings=4096, vocab_size=32000,
                       add_bias_linear=False, activation="swiglu", normalization="rmsnorm",
                       position_embedding_type="rope",
                       untie_embeddings_and_output_weights=True,
                       moe=MoEConfig(num_experts=8, router_topk=2))


PROBLEMS = {"1x8": (8, "h100-80g-1x8", 32), "8x8": (32, "h100-80g-8x8", 256)}


def _uniform_plans(spec, world: int, batch: int, devices_per_node: int):
    """Megatron-style plans: one tp / pp / ep for every layer (ep on the MoE layers)."""
    layers = spec.num_layers
    for tp, pp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8)):
        if world % (tp * pp) or tp > devices_per_node or pp > layers:
            continue
        dp = world // (tp * pp)
        for ep in (e for e in (1, 2, 4, 8) if dp % e == 0):
            for mode, recompute in itertools.product(("ddp", "zero1"), (False, True)):
                layer = LayerStrategy(tp=tp, dp_mode=mode if dp > 1 else "ddp",
                                      recompute=recompute, ep=ep)
                for m in range(1, batch + 1):
                    if batch % m or (batch // m) % dp:
                        continue
                    yield Plan(world_size=world, global_batch_size=batch, num_microbatches=m,
                               pipeline=PipelineSpec(pp, "1f1b", even_partition(layers, pp)),
                               vocab=VocabStrategy(tp=tp, dp_mode=layer.dp_mode),
                               layers=(layer,) * layers, model=spec.plan_model_record())


def _best_uniform(spec, training, cluster, profile, budget):
    best = None
    for plan in _uniform_plans(spec, cluster.world_size, training.global_batch_size,
                               cluster.devices_per_node):
        est = evaluate(plan, spec, training, cluster, profile, budget)
        if est.feasible and (best is None or est.iteration_time_s < best[1].iteration_time_s):
            best = (plan, est)
    return best


def _describe(plan: Plan) -> str:
    eps = sorted({s.ep for s in plan.layers})
    tps = sorted({s.tp for s in plan.layers})
    modes = sorted({s.dp_mode for s in plan.layers})
    experts = sorted({s.experts_dp_mode for s in plan.layers})
    rc = sum(1 for s in plan.layers if s.recompute)
    return (f"pp {plan.pp_size} m {plan.num_microbatches} tp {tps} ep {eps} dp {modes} "
            f"experts {experts} recompute {rc}/{plan.num_layers}")


def run(name: str) -> list[str]:
    layers, cluster_name, batch = PROBLEMS[name]
    spec = model_spec(mixtral(layers))
    training = TrainingSpec(batch, "bf16")
    cluster = get_cluster(cluster_name)
    profile = analytic_profile(spec, training, cluster)
    budget = cluster.usable_memory_bytes
    rows = []
    results = {}
    for label, ep in (("searched", None), ("searched, ep = 1", 1)):
        c0 = time.process_time()
        result = search(spec, training, cluster, profile, budget,
                        SearchOptions(show_progress=False, include_baselines=False,
                                      report_partitions=False, expert_parallel=ep))
        cpu = time.process_time() - c0
        results[label] = result.estimate
        rows.append((label, result.estimate.samples_per_s,
                     result.estimate.peak_memory_bytes, _describe(result.plan),
                     f"{cpu:.1f} s CPU, proven optimal {result.search['proven_optimal']}"))
    uniform = _best_uniform(spec, training, cluster, profile, budget)
    if uniform is not None:
        rows.append(("best uniform EP", uniform[1].samples_per_s,
                     uniform[1].peak_memory_bytes, _describe(uniform[0]), "evaluate"))
    best = results["searched"].samples_per_s
    lines = [f"{name} ({cluster_name}, {layers} layers, global batch {batch}):",
             "| plan | samples/s | searched is | peak memory | layout | how |",
             "|---|---|---|---|---|---|"]
    for label, sps, peak, layout, how in rows:
        lines.append(f"| {label} | {sps:.2f} | {best / sps:.2f}x | {peak / GB:.1f} GB | "
                     f"{layout} | {how} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=list(PROBLEMS))
    parser.add_argument("--table-out", default=None, metavar="FILE",
                        help="write the tables as Markdown; in a file with the BEGIN/END "
                             "markers (docs/planner.md's MoE section) between them")
    args = parser.parse_args()
    out = []
    for name in ([args.only] if args.only else list(PROBLEMS)):
        lines = run(name)
        print("\n".join(lines), flush=True)
        out += lines + [""]
    if args.table_out:
        write_table(Path(args.table_out), "\n".join(out).rstrip("\n") + "\n")


def write_table(path: Path, table: str, begin: str = BEGIN, end: str = END) -> None:
    """``table`` between the ``begin`` and ``end`` lines when ``path`` has them, else the file
    (other benchmarks pass their own markers)."""
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        path.write_text(head + begin + "\n" + table + end + rest.split(end, 1)[1])
    else:
        path.write_text(table)


if __name__ == "__main__":
    main()
