"""One-process training-step time: our GPT (through ``train_step``) against plain PyTorch.

The plain model has the same shape and math (pre-norm GPT: learned positions, tied embedding
head, nn.LayerNorm, fused QKV nn.Linear, ``F.scaled_dot_product_attention`` causal, GeLU MLP,
summed masked cross entropy divided by the token count, AdamW, global-norm clipping). Both run
in the same process, interleaved step by step so machine load affects them alike; the report
is the ratio of median step times ``plain / ours`` (1.0 = same speed; the target is >= 0.95,
i.e. ours at most ~5% slower).

    python benchmarks/bench_gpt_step.py [--hidden-size 256 --num-layers 4 --steps 20 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_auto.config import ModelConfig
from megatron_auto.plan import Plan
from megatron_auto.training.lr_scheduler import LRConfig
from megatron_auto.parallel.optimizer import OptimizerConfig, build_optimizer
from megatron_auto.training.precision import PrecisionConfig


class PlainLayer(nn.Module):
    def __init__(self, h: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, ffn)
        self.fc2 = nn.Linear(ffn, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PlainGPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(PlainLayer(cfg.hidden_size, cfg.num_attention_heads,
                                               cfg.ffn_hidden_size) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size)

    def forward(self, tokens, labels, loss_mask, position_ids):
        x = self.word(tokens) + self.pos(position_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.norm(x) @ self.word.weight.t()
        ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
        return (ce * loss_mask.flatten()).sum()


def make_batch(cfg: ModelConfig, batch: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length + 1), generator=gen)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(batch, cfg.seq_length),
            "position_ids": torch.arange(cfg.seq_length).expand(batch, -1).contiguous()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default: torch's choice); 1 is steadier on busy machines")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.training.trainer import build_trainer, train_step

    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29533")})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                      vocab_size=args.vocab_size, hidden_dropout=0.0, attention_dropout=0.0)
    opt_cfg = OptimizerConfig()
    plan = Plan.uniform(1, cfg.num_layers, global_batch_size=args.global_batch_size)
    ours = build_trainer(cfg, plan, lambda c, ctx, seed: GPTStage(c, ctx, seed=seed),
                         optimizer_config=opt_cfg, lr_config=LRConfig(lr=1e-4, decay_style="constant"),
                         precision=PrecisionConfig(), device=device)
    plain = PlainGPT(cfg).to(device)
    plain_opt = build_optimizer(plain.parameters(), opt_cfg, lr=1e-4,
                                named_parameters=plain.named_parameters())

    def plain_step(batch: dict[str, torch.Tensor]) -> None:
        plain_opt.zero_grad(set_to_none=True)
        b = {k: v.to(device) for k, v in batch.items()}
        loss = plain(**b) / b["loss_mask"].sum()
        loss.backward()
        nn.utils.clip_grad_norm_(plain.parameters(), opt_cfg.clip_grad, foreach=True)
        plain_opt.step()

    def timed(fn, batch) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"ours": [], "plain": []}
    for step in range(args.warmup + args.steps):
        batch = make_batch(cfg, args.global_batch_size, step)
        t_ours = timed(lambda b: train_step(ours, b), batch)
        t_plain = timed(plain_step, batch)
        if step >= args.warmup:
            times["ours"].append(t_ours)
            times["plain"].append(t_plain)
    ours_s, plain_s = statistics.median(times["ours"]), statistics.median(times["plain"])
    print(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, seq {cfg.seq_length}, "
          f"vocab {cfg.padded_vocab_size}, batch {args.global_batch_size}, device {device}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"median step time: ours {ours_s * 1e3:.1f} ms, plain PyTorch {plain_s * 1e3:.1f} ms")
    print(f"speed ratio plain/ours: {plain_s / ours_s:.3f} (target >= 0.95)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
