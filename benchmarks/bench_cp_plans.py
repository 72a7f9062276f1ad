"""Long-sequence plans under our cost model: the search's best plan with context parallelism
searched against the best with ``--context-parallel-size 1``, for a LLaMA-7B-like model
(analytic profiles, no GPU; both numbers are estimates of the same cost model, same run).

    python benchmarks/bench_cp_plans.py                    # both problems
    python benchmarks/bench_cp_plans.py --only 32k --time-limit 60

Problems (bf16, 32 layers, hidden 4096, 32 heads, 8 key/value groups, ffn 11008, SwiGLU,
RMSNorm, RoPE, 32000-token vocabulary, no attention dropout: ring attention runs without):

- ``32k``: sequence 32,768 on h100-80g-1x8, global batch 64;
- ``128k``: sequence 131,072 on h100-80g-8x8, global batch 64.

Each search runs through ``megatron-auto plan`` (the command a user types) with its CPU time
limit (``--time-limit``; ``proven`` says whether it finished within the optimality gap) and
the line prints the plan's layout, its estimated iteration time and peak memory; the last line
of a problem is the ratio of the two iteration times (> 1: context parallelism is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_auto.cli import main as cli_main  # noqa: E402

LLAMA = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
         "--attention-dropout", "0", "--ffn-hidden-size", "11008", "--swiglu",
         "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--group-query-attention", "--num-query-groups", "8", "--vocab-size", "32000",
         "--global-batch-size", "64",
         "--bf16"]
PROBLEMS = {"32k": (32768, "h100-80g-1x8"), "128k": (131072, "h100-80g-8x8")}
GB = 1e9


def _layout(plan: dict) -> str:
    layers = plan["layers"]

    def kinds(key, default):
        return sorted({str(layer.get(key, default)) for layer in layers})

    rc = sum(1 for layer in layers if layer.get("recompute"))
    pipe = plan["pipeline"]
    return (f"pp {pipe['size']} m {plan['num_microbatches']} cp {kinds('cp', 1)} "
            f"{kinds('cp_mode', 'ring')} tp {kinds('tp', 1)} dp {kinds('dp_mode', 'ddp')} "
            f"sp {kinds('sequence_parallel', False)} recompute {rc}/{len(layers)}")


def _plan(argv: list[str], out: Path) -> tuple[dict, float]:
    c0 = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        status = cli_main(["plan", *argv, "--quiet", "--plan-out", str(out)])
    if status != 0:
        raise SystemExit(f"megatron-auto plan {' '.join(argv)}: exit status {status}")
    return json.loads(out.read_text()), time.process_time() - c0


def run(name: str, time_limit: float) -> list[str]:
    seq, cluster = PROBLEMS[name]
    argv = [*LLAMA, "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--cluster", cluster, "--time-limit", str(time_limit)]
    lines = [f"{name}: LLaMA-7B-like at sequence {seq} on {cluster}:"]
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, extra in (("cp searched", []), ("cp = 1", ["--context-parallel-size", "1"])):
            plan, cpu = _plan([*argv, *extra], Path(tmp) / "plan.json")
            est, search = plan["estimate"], plan.get("search") or {}
            times[label] = est["iteration_time_s"]
            peak = max(s["peak_memory_bytes"] for s in est["stages"])
            lines.append(f"  {label:12s} {est['iteration_time_s']:9.2f} s/iter  peak "
                         f"{peak / GB:5.1f} GB  {_layout(plan)}  ({cpu:.0f} s CPU, proven "
                         f"{search.get('proven_optimal')})")
    lines.append(f"  ratio (cp = 1 over cp searched): "
                 f"{times['cp = 1'] / times['cp searched']:.3f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=list(PROBLEMS))
    parser.add_argument("--time-limit", type=float, default=120.0, metavar="SECONDS",
                        help="CPU seconds per search (megatron-auto plan --time-limit; "
                             "default 120)")
    args = parser.parse_args()
    for name in [args.only] if args.only else list(PROBLEMS):
        print("\n".join(run(name, args.time_limit)), flush=True)


if __name__ == "__main__":
    main()
