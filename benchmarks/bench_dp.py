"""Data-parallel runtime costs on a small GPT: our DDP against torch DDP, and recompute overhead.

Runs ``--world-size`` ranks (gloo on CPU, NCCL when every rank has a GPU) and prints:

- plain data parallelism: median iteration time of ``megatron_auto``'s bucketed DDP
  (``parallel/data_parallel.py``) and of ``torch.nn.parallel.DistributedDataParallel`` on the
  same model, batch and optimizer, and their ratio (ours / torch). The two are measured in
  alternating rounds inside the same process group, so machine noise hits both alike;
- recompute: median iteration time with activation recompute on every layer over the time
  without (our runtime, ``ddp``), i.e. the price of the memory it saves.

Usage::

    python benchmarks/bench_dp.py                 # 2 ranks, forked here
    torchrun --nproc-per-node 2 benchmarks/bench_dp.py

No assertion is made on the numbers; they go in reports.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_auto.config import ModelConfig  # noqa: E402
from megatron_auto.models.gpt import GPTStage  # noqa: E402
from megatron_auto.parallel.context import ParallelContext  # noqa: E402
from megatron_auto.parallel.data_parallel import DataParallel  # noqa: E402
from megatron_auto.plan import Plan  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2,
                   help="ranks to fork when not under torchrun")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=4,
                   help="samples per rank per micro-batch")
    p.add_argument("--num-microbatches", type=int, default=2)
    p.add_argument("--iters", type=int, default=6, help="measured rounds per variant")
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args(argv)


def _batch(config: ModelConfig, size: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    s = config.seq_length
    return {"tokens": torch.randint(0, config.vocab_size, (size, s), generator=gen),
            "labels": torch.randint(0, config.vocab_size, (size, s), generator=gen),
            "loss_mask": torch.ones(size, s)}


class Runner:
    """One model + optimizer + way of synchronising gradients; ``step()`` is one iteration."""

    def __init__(self, kind: str, args: argparse.Namespace, world_size: int,
                 device: torch.device) -> None:
        self.kind = kind
        self.config = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                  num_attention_heads=args.num_attention_heads,
                                  seq_length=args.seq_length, vocab_size=args.vocab_size,
                                  hidden_dropout=0.0, attention_dropout=0.0)
        self.m = args.num_microbatches
        self.mb = args.micro_batch_size * world_size  # the whole micro-batch; each rank slices
        plan = Plan.uniform(world_size, args.num_layers, global_batch_size=self.mb * self.m,
                            num_microbatches=self.m, dp_mode="ddp",
                            recompute=kind == "ours+recompute")
        self.ctx = ParallelContext(plan, device=device)
        self.stage = GPTStage(self.config, self.ctx, seed=1)
        if kind == "torch-ddp":
            self.model: Any = torch.nn.parallel.DistributedDataParallel(self.stage)
            self.dp = None
            params = self.model.parameters()
        else:
            self.model = self.stage
            self.dp = DataParallel(self.stage, self.ctx)
            params = self.dp.parameters()
        self.opt = torch.optim.AdamW(params, lr=1e-4)
        self.batches = [_batch(self.config, self.mb, seed=k) for k in range(self.m)]
        self.total = float(self.mb * self.m * self.config.seq_length)

    def step(self) -> None:
        if self.dp is not None:
            self.dp.zero_grad()
        else:
            self.opt.zero_grad(set_to_none=False)
        for k, b in enumerate(self.batches):
            last = k == self.m - 1
            if self.dp is not None:
                self.dp.set_microbatch(k, self.m)
                loss, _ = self.model(b["tokens"], labels=b["labels"], loss_mask=b["loss_mask"])
                (loss / self.total).backward()
            elif last:
                loss, _ = self.model(b["tokens"], labels=b["labels"], loss_mask=b["loss_mask"])
                (loss / self.total).backward()
            else:
                with self.model.no_sync():
                    loss, _ = self.model(b["tokens"], labels=b["labels"],
                                         loss_mask=b["loss_mask"])
                    (loss / self.total).backward()
        if self.dp is not None:
            self.dp.finish_grad_sync()
        self.opt.step()


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    """Wall time of ``fn`` as the slowest rank saw it."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run(args: argparse.Namespace) -> dict[str, float] | None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = (torch.device("cuda", rank % torch.cuda.device_count())
              if torch.cuda.is_available() else torch.device("cpu"))
    kinds = ["ours", "torch-ddp", "ours+recompute"]
    runners = {k: Runner(k, args, world_size, device) for k in kinds}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(args.warmup + args.iters):
        for k in kinds:  # alternate variants inside every round: noise hits all alike
            t = _timed(runners[k].step, device)
            if i >= args.warmup:
                times[k].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    if rank != 0:
        return None
    c = runners["ours"].config
    print(f"bench_dp: {world_size} ranks ({dist.get_backend()}), GPT {c.num_layers} layers, "
          f"hidden {c.hidden_size}, seq {c.seq_length}, {args.num_microbatches} micro-batches of "
          f"{args.micro_batch_size} samples per rank, {args.iters} rounds (median)")
    print(f"  ours (bucketed DDP)      {med['ours'] * 1e3:9.1f} ms/iter  "
          f"({runners['ours'].dp.num_buckets} buckets)")
    print(f"  torch DDP                {med['torch-ddp'] * 1e3:9.1f} ms/iter")
    print(f"  ratio ours / torch DDP   {med['ours'] / med['torch-ddp']:9.3f}")
    print(f"  recompute on all layers  {med['ours+recompute'] * 1e3:9.1f} ms/iter")
    print(f"  recompute overhead       {med['ours+recompute'] / med['ours']:9.3f}x")
    return med


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        run(args)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        try:
            run(args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.start_processes(_worker, args=(args.world_size, port, args),
                                          nprocs=args.world_size, start_method="fork")


if __name__ == "__main__":
    main()
