"""What ``--timing-log-level`` costs: training steps with the timers against steps without.

Two trainers of the same model and plan run in one process (one rank, the plan's micro-batches
through the pipeline schedule), one with ``--timing-log-level 0`` and one with the level under
test, step by step in alternating order so machine load affects both alike. Every
``--log-interval`` steps the timed trainer's window is taken and gathered over the world, as
the training loop does. The report is the ratio of median step times ``timed / untimed``
(1.0 = free; the target at level 1 is <= 1.02).

    python benchmarks/bench_timers.py [--level 1 --num-microbatches 4 --steps 30 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from megatron_auto.config import ModelConfig
from megatron_auto.parallel.optimizer import OptimizerConfig
from megatron_auto.plan import Plan
from megatron_auto.training.lr_scheduler import LRConfig


def make_batch(cfg: ModelConfig, batch: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length + 1), generator=gen)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(batch, cfg.seq_length),
            "position_ids": torch.arange(cfg.seq_length).expand(batch, -1).contiguous()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--level", type=int, default=1, choices=[1, 2])
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default: torch's choice); 1 is steadier on busy machines")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.parallel.timers import gather_over_ranks
    from megatron_auto.training.trainer import build_trainer, train_step

    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29534")})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                      vocab_size=args.vocab_size, hidden_dropout=0.0, attention_dropout=0.0)
    plan = Plan.uniform(1, cfg.num_layers, global_batch_size=args.global_batch_size,
                        num_microbatches=args.num_microbatches)

    def trainer(level: int):
        return build_trainer(cfg, plan, lambda c, ctx, seed: GPTStage(c, ctx, seed=seed),
                             optimizer_config=OptimizerConfig(),
                             lr_config=LRConfig(lr=1e-4, decay_style="constant"),
                             device=device, timing_log_level=level)

    trainers = {"untimed": trainer(0), "timed": trainer(args.level)}

    def step_time(name: str, batch: dict[str, torch.Tensor]) -> float:
        t = trainers[name]
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(t, batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t.timers.end_iteration()  # inside the measured time: the loop pays it every iteration
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"untimed": [], "timed": []}
    for step in range(args.warmup + args.steps):
        batch = make_batch(cfg, args.global_batch_size, step)
        order = ("untimed", "timed") if step % 2 == 0 else ("timed", "untimed")
        measured = {name: step_time(name, batch) for name in order}
        if (step + 1) % args.log_interval == 0:
            start = time.perf_counter()
            gather_over_ranks(trainers["timed"].timers.take(), device)
            measured["timed"] += time.perf_counter() - start  # the report, once per interval
        if step >= args.warmup:
            for name, seconds in measured.items():
                times[name].append(seconds)
    untimed, timed = statistics.median(times["untimed"]), statistics.median(times["timed"])
    print(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, seq {cfg.seq_length}, "
          f"batch {args.global_batch_size} in {args.num_microbatches} micro-batches, device "
          f"{device}, {torch.get_num_threads()} thread(s), {args.steps} steps")
    print(f"median step time: --timing-log-level 0 {untimed * 1e3:.2f} ms, "
          f"--timing-log-level {args.level} {timed * 1e3:.2f} ms")
    print(f"time ratio level {args.level} / level 0: {timed / untimed:.4f}"
          + (" (target <= 1.02)" if args.level == 1 else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
