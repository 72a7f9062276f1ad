"""What ``--timing-log-level`` costs: training steps with the timers against steps without.

One trainer (one rank, the plan's micro-batches through the pipeline schedule) runs three
interleaved series of steps: ``--timing-log-level 0``, level 0 again (a control: its ratio is
the noise of the machine), and the level under test. Its ``timers`` are swapped between steps
(timers never change the numerics), each round of three steps in another order; one trainer
gives every series the same memory and caches (with two trainers the timed one, built second,
ran 6-7% *faster*: an artefact of the set-up). Every ``--log-interval`` timed steps the window
is taken and gathered over the world, as the training loop does. Printed: the ratio of median
step times ``timed / level 0`` (1.0 = free; the target at level 1 is <= 1.02), the control's
ratio, and the direct cost -- timer entries per step times the cost of one entry, plus the
per-iteration close -- as a share of a step, which a loaded machine does not blur.

    python benchmarks/bench_timers.py [--level 1 --num-microbatches 4 --steps 30 ...]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
import torch.distributed as dist

from megatron_auto.parallel.timers import Timers
from megatron_auto.parallel.optimizer import OptimizerConfig
from megatron_auto.plan import Plan
from megatron_auto.training.lr_scheduler import LRConfig

from bench_setup import (add_gpt_shape_flags, add_step_flags, gpt_batch, gpt_config,
                         one_process_world, timed)


class _Counting(Timers):
    """Timers that count how many phases a step enters (and which)."""

    def __init__(self, level: int, device: torch.device) -> None:
        super().__init__(level, device)
        self.entries = 0
        self.names: set[str] = set()

    def __call__(self, name: str, level: int = 1):
        if level <= self.level:
            self.entries += 1
            self.names.add(name)
        return super().__call__(name, level)


def _entry_cost(timers: Timers, repeats: int = 20000) -> float:
    """Seconds per ``with timers(name):`` of an empty phase (best of five rounds)."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            with timers("forward-compute"):
                pass
        best = min(best, (time.perf_counter() - start) / repeats)
    timers.end_iteration()
    return best


def _close_cost(timers: Timers, names: set[str], repeats: int = 2000) -> float:
    """Seconds of ``end_iteration`` with ``names`` timers live (best of five rounds)."""
    for name in names:
        with timers(name, 0):
            pass
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            timers.end_iteration()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--level", type=int, default=1, choices=[1, 2])
    add_gpt_shape_flags(parser)
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--log-interval", type=int, default=10)
    add_step_flags(parser, steps=30, warmup=3)
    args = parser.parse_args()

    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.parallel.timers import gather_over_ranks
    from megatron_auto.training.trainer import build_trainer, train_step

    device = one_process_world(args, "29534")
    cfg = gpt_config(args)
    plan = Plan.uniform(1, cfg.num_layers, global_batch_size=args.global_batch_size,
                        num_microbatches=args.num_microbatches)

    t = build_trainer(cfg, plan, lambda c, ctx, seed: GPTStage(c, ctx, seed=seed),
                      optimizer_config=OptimizerConfig(),
                      lr_config=LRConfig(lr=1e-4, decay_style="constant"), device=device)
    timers = {"untimed": Timers(0, device), "timed": Timers(args.level, device)}

    def one_step(batch: dict[str, torch.Tensor]) -> None:
        train_step(t, batch)
        t.timers.end_iteration()  # inside the measured time: the loop pays it every iteration

    def step_time(name: str, batch: dict[str, torch.Tensor]) -> float:
        t.timers = timers[name]
        return timed(one_step, batch, device=device)

    # Rounds of three steps, each round another order of (level 0, level 0 again, timed): the
    # second level-0 series is a control, so its ratio shows the noise of this machine.
    orders = list(itertools.permutations(("untimed", "control", "timed")))
    timers["control"] = Timers(0, device)
    times: dict[str, list[float]] = {name: [] for name in timers}
    for step in range(args.warmup * 3 + 3 * args.steps):
        name = orders[(step // 3) % len(orders)][step % 3]
        seconds = step_time(name, gpt_batch(cfg, args.global_batch_size, step))
        if name == "timed" and len(times["timed"]) % args.log_interval == args.log_interval - 1:
            start = time.perf_counter()
            gather_over_ranks(timers["timed"].take(), device)
            seconds += time.perf_counter() - start  # the report, once per interval
        if step >= args.warmup * 3:
            times[name].append(seconds)
    median = {name: statistics.median(values) for name, values in times.items()}

    # Direct cost, robust to a loaded machine: timer entries per step x the cost of one entry
    # (enter + exit at this level, less level 0's no-op), plus the per-iteration close.
    counting = _Counting(args.level, device)
    t.timers = counting
    train_step(t, gpt_batch(cfg, args.global_batch_size, 0))
    per_entry = _entry_cost(Timers(args.level, device)) - _entry_cost(Timers(0, device))
    close = _close_cost(Timers(args.level, device), counting.names)
    direct = counting.entries * per_entry + close

    print(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, seq {cfg.seq_length}, "
          f"batch {args.global_batch_size} in {args.num_microbatches} micro-batches, device "
          f"{device}, {torch.get_num_threads()} thread(s), {args.steps} steps per series")
    print(f"median step time: --timing-log-level 0 {median['untimed'] * 1e3:.2f} ms "
          f"(control series {median['control'] * 1e3:.2f} ms), --timing-log-level {args.level} "
          f"{median['timed'] * 1e3:.2f} ms")
    print(f"noise: control / level 0 = {median['control'] / median['untimed']:.4f}")
    print(f"direct: {counting.entries} timer entries per step x {per_entry * 1e6:.2f} us + "
          f"{close * 1e6:.1f} us per step = {direct * 1e6:.1f} us, "
          f"{direct / median['untimed'] * 100:.3f}% of a step")
    print(f"time ratio level {args.level} / level 0: {median['timed'] / median['untimed']:.4f}"
          + (" (target <= 1.02)" if args.level == 1 else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
