"""What the one-process benchmark scripts share: the step-count and CPU-threads flags, a
one-rank process group, the tiny GPT's shape flags and synthetic batch, and a step timer that
waits for the device.

Imported by the scripts next to it (``python benchmarks/<script>.py`` puts this folder first
on ``sys.path``).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_auto.config import ModelConfig


def add_step_flags(parser: argparse.ArgumentParser, *, steps: int, warmup: int) -> None:
    """``--steps`` (timed steps) and ``--warmup`` (untimed ones first) with these defaults, and
    ``--threads`` (read by :func:`one_process_world`)."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default: torch's choice); 1 is steadier on busy machines")


def add_gpt_shape_flags(parser: argparse.ArgumentParser, *, num_layers: int = 4,
                        hidden_size: int = 256, num_attention_heads: int = 4,
                        seq_length: int = 128, vocab_size: int = 8192,
                        global_batch_size: int = 8) -> None:
    """Megatron's model-shape flags for :func:`gpt_config`, with these defaults."""
    parser.add_argument("--num-layers", type=int, default=num_layers)
    parser.add_argument("--hidden-size", type=int, default=hidden_size)
    parser.add_argument("--num-attention-heads", type=int, default=num_attention_heads)
    parser.add_argument("--seq-length", type=int, default=seq_length)
    parser.add_argument("--vocab-size", type=int, default=vocab_size)
    parser.add_argument("--global-batch-size", type=int, default=global_batch_size)


def gpt_config(args: argparse.Namespace) -> ModelConfig:
    """The GPT of :func:`add_gpt_shape_flags`' flags, dropout off (steps comparable)."""
    return ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                       vocab_size=args.vocab_size, hidden_dropout=0.0, attention_dropout=0.0)


def one_process_world(args: argparse.Namespace, port: str) -> torch.device:
    """Apply ``--threads``, start a one-rank process group (NCCL on CUDA, else gloo; the
    ``MASTER_PORT`` environment variable wins over ``port``) and return the device."""
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", port)})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def gpt_batch(cfg: ModelConfig, batch: int, step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s synthetic GPT batch: random ids, every token counted."""
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length + 1), generator=gen)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(batch, cfg.seq_length),
            "position_ids": torch.arange(cfg.seq_length).expand(batch, -1).contiguous()}


def timed(fn: Callable[..., Any], *args: Any, device: torch.device) -> float:
    """Seconds of ``fn(*args)``, the device's queued work included."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start
