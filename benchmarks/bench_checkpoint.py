"""Checkpoint cost: synchronous against asynchronous save, load (with verification), size.

One process (a gloo world of one) holds a GPT of about 100 M parameters (12 layers, hidden 768,
vocabulary 32000) with its AdamW state, and saves it alternately with ``save_checkpoint`` and
``save_checkpoint(async_save=True)`` in the same run (so machine load affects both alike):

- sync stall: the whole ``save_checkpoint`` call (training waits for all of it);
- async stall: until ``save_checkpoint(async_save=True)`` returns (the state copy), and the
  time until the background save completed (``wait_for_pending_save``);
- the verification record's share of a save (the CRC-32 pass, ``describe_files``);
- load: ``read_info`` (choosing and verifying) plus ``load_checkpoint``, and verification alone;
- size on disk.

Reports medians over ``--repeats`` and the ratios async stall / sync stall and verification /
load. Writes under a temporary directory (``--dir`` to choose one), removed at the end.

    python benchmarks/bench_checkpoint.py [--repeats 3 --hidden-size 768 --num-layers 12]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from megatron_auto.config import ModelConfig
from megatron_auto.parallel.optimizer import OptimizerConfig
from megatron_auto.plan import Plan
from megatron_auto.training.lr_scheduler import LRConfig
from megatron_auto.training.precision import PrecisionConfig


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-attention-heads", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    args = parser.parse_args()

    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.training import checkpoint
    from megatron_auto.training.checkpoint_verify import choose_checkpoint, describe_files
    from megatron_auto.training.trainer import build_trainer

    with socket.socket() as sock:  # a free port: other runs may hold any fixed one
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", str(port))})
    dist.init_process_group("gloo")
    cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=64,
                      vocab_size=args.vocab_size, hidden_dropout=0.0, attention_dropout=0.0)
    plan = Plan.uniform(1, cfg.num_layers, global_batch_size=1)
    trainer = build_trainer(cfg, plan, lambda c, ctx, seed: GPTStage(c, ctx, seed=seed),
                            optimizer_config=OptimizerConfig(),
                            lr_config=LRConfig(lr=1e-4, decay_style="constant"),
                            precision=PrecisionConfig(), device=torch.device("cpu"))
    checkpoint._init_optimizer_state(trainer.optimizer)  # AdamW's state exists, as after a step
    params = sum(p.numel() for p in trainer.stage.parameters())
    root = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    sync_s, async_stall_s, async_total_s, record_s, load_s, verify_s = [], [], [], [], [], []
    size = 0
    try:
        for repeat in range(args.repeats):
            trainer.iteration = 2 * repeat + 1
            start = time.perf_counter()
            path = checkpoint.save_checkpoint(trainer, os.path.join(root, "sync"))
            sync_s.append(time.perf_counter() - start)
            size = _dir_bytes(path)
            start = time.perf_counter()
            describe_files(path)
            record_s.append(time.perf_counter() - start)

            trainer.iteration = 2 * repeat + 2
            start = time.perf_counter()
            checkpoint.save_checkpoint(trainer, os.path.join(root, "async"), async_save=True)
            async_stall_s.append(time.perf_counter() - start)
            checkpoint.wait_for_pending_save()
            async_total_s.append(time.perf_counter() - start)

            start = time.perf_counter()
            choose_checkpoint(os.path.join(root, "sync"))
            verify_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            checkpoint.load_checkpoint(trainer, os.path.join(root, "sync"))
            load_s.append(time.perf_counter() - start)
            for kind in ("sync", "async"):  # keep one checkpoint per kind on disk
                for name in os.listdir(os.path.join(root, kind)):
                    if name.startswith("iter_") and not name.endswith(f"{trainer.iteration:07d}"):
                        shutil.rmtree(os.path.join(root, kind, name), ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()

    med = statistics.median
    print(f"model: {params / 1e6:.1f} M parameters ({cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}, vocabulary {cfg.padded_vocab_size}); checkpoint "
          f"{size / 1e9:.2f} GB (parameters + AdamW moments, fp32); {args.repeats} repeats, "
          f"medians")
    print(f"sync save (training stalls for all of it): {med(sync_s):.2f} s, of which the "
          f"verification record (CRC-32 of every file) {med(record_s):.2f} s")
    print(f"async save: training stalls {med(async_stall_s):.2f} s (state copy), complete "
          f"after {med(async_total_s):.2f} s")
    print(f"load: {med(load_s):.2f} s, of which choosing and verifying {med(verify_s):.2f} s")
    print(f"ratio async stall / sync stall: {med(async_stall_s) / med(sync_s):.3f}")
    print(f"ratio async complete / sync save: {med(async_total_s) / med(sync_s):.3f}")
    print(f"ratio verification / load: {med(verify_s) / med(load_s):.3f}")


if __name__ == "__main__":
    main()
