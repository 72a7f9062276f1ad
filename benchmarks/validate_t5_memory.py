"""T5's analytic peak memory against one CPU process's measured peak (MemTracker).

Prices the default T5 shape (``T5Config`` with a 2048 vocabulary, fp32, dropout 0.1, global
batch 8 in 2 micro-batches, one process) with the analytic profile on a one-device CPU cluster
(``--cluster FILE``, e.g. one written by ``megatron-auto profile-hardware``; by default a
minimal CPU description, since only the device kind and no communication matter for one
process), trains it for 3 iterations with ``pretrain_t5.py --plan`` without and with recompute,
and prints predicted and measured peaks and the error::

    python benchmarks/validate_t5_memory.py [--cluster cluster.json]

It prints what it measured; it asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy  # noqa: E402
from megatron_auto.planner.inputs.hardware import ClusterSpec  # noqa: E402
from megatron_auto.planner.inputs.model_spec import TrainingSpec  # noqa: E402
from megatron_auto.families.registry import model_spec  # noqa: E402
from megatron_auto.planner.inputs.profiles import analytic_profile  # noqa: E402
from megatron_auto.planner.search.driver import evaluate  # noqa: E402
from megatron_auto.families.t5.config import T5Config  # noqa: E402

CONFIG = T5Config(vocab_size=2048)
GLOBAL_BATCH, MICROBATCHES = 8, 2


def flags(cfg: T5Config) -> list[str]:
    return ["--vocab-size", str(cfg.vocab_size), "--num-layers", str(cfg.num_layers),
            "--encoder-num-layers", str(cfg.encoder_num_layers), "--decoder-num-layers",
            str(cfg.decoder_num_layers), "--hidden-size", str(cfg.hidden_size),
            "--num-attention-heads", str(cfg.num_attention_heads), "--ffn-hidden-size",
            str(cfg.ffn_hidden_size), "--seq-length", str(cfg.seq_length),
            "--max-position-embeddings", str(cfg.max_position_embeddings),
            "--decoder-seq-length", str(cfg.decoder_seq_length), "--kv-channels",
            str(cfg.kv_channels), "--hidden-dropout", str(cfg.hidden_dropout),
            "--attention-dropout", str(cfg.attention_dropout)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default=None, metavar="FILE",
                        help="a CPU cluster profile (its device kind and reserve are used)")
    args = parser.parse_args()
    if args.cluster:
        cluster = dataclasses.replace(ClusterSpec.load(args.cluster), num_nodes=1,
                                      devices_per_node=1, allreduce_busbw_table={},
                                      p2p_bw_table={})
    else:
        cluster = ClusterSpec(name="cpu-1x1", num_nodes=1, devices_per_node=1,
                              device_name="cpu", device_memory_bytes=2**34,
                              peak_flops={"fp32": 1e10, "bf16": 1e9}, memory_reserve_bytes=0)
    spec = model_spec(CONFIG)
    training = TrainingSpec(global_batch_size=GLOBAL_BATCH, precision="fp32")
    profile = analytic_profile(spec, training, cluster)
    work = Path(tempfile.mkdtemp(prefix="validate_t5_memory_"))
    for recompute in (False, True):
        plan = Plan(world_size=1, global_batch_size=GLOBAL_BATCH, num_microbatches=MICROBATCHES,
                    pipeline=PipelineSpec(size=1, layers_per_stage=(CONFIG.num_layers,)),
                    vocab=VocabStrategy(),
                    layers=tuple(LayerStrategy(recompute=recompute)
                                 for _ in range(CONFIG.num_layers)))
        est = evaluate(plan, spec, training, cluster, profile)
        plan_file, metrics = work / f"recompute-{recompute}.json", work / f"{recompute}.jsonl"
        Plan.from_dict({**plan.to_dict(), "estimate": est.to_dict(),
                        "model": CONFIG.to_dict()}).save(plan_file)
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
             "pretrain_t5.py", "--mock-data", *flags(CONFIG), "--plan", str(plan_file),
             "--train-iters", "3", "--log-interval", "1", "--metrics-file", str(metrics)],
            cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode:
            print(f"recompute={recompute}: FAILED\n{proc.stderr[-3000:]}")
            continue
        measured = max(json.loads(line)["peak_memory_bytes"]
                       for line in metrics.read_text().splitlines())
        predicted = max(s.peak_memory_bytes for s in est.stages)
        print(f"recompute={recompute!s:5s} analytic peak {predicted / 2**20:7.2f} MiB, measured "
              f"{measured / 2**20:7.2f} MiB ({(predicted / measured - 1) * 100:+.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
