"""One-process training-step time of the paper's other workloads against plain PyTorch.

For each model (ViT, Swin, T5) ours runs through ``train_step`` (the code the pretrain scripts
run) on a one-rank plan, the plain model (``plain_vision.py``, ``plain_t5.py``: same parameters,
same math, no parallel machinery) through a hand-written step: forward, mean cross entropy, backward,
global-norm clipping, AdamW. Both start from the same weights and train on the same batches,
interleaved step by step so machine load affects them alike. The report per model is the ratio
of median step times ``plain / ours`` (1.0 = same speed; the target is >= 0.9).

    python benchmarks/bench_models.py [--models vit swin t5] [--steps 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plain_t5 import PlainT5  # noqa: E402 - the baselines next to this script
from plain_vision import plain_model  # noqa: E402
from bench_setup import add_step_flags, one_process_world, timed  # noqa: E402

from megatron_auto.parallel.optimizer import OptimizerConfig, build_optimizer  # noqa: E402
from megatron_auto.plan import Plan  # noqa: E402
from megatron_auto.families.t5.config import T5Config  # noqa: E402
from megatron_auto.training.lr_scheduler import LRConfig  # noqa: E402
from megatron_auto.training.trainer import TaskSpec  # noqa: E402
from megatron_auto.families.vision.config import VisionConfig  # noqa: E402

#: Benchmark shapes: a ViT-Ti-like encoder and a small four-window-per-side Swin.
MODELS = {
    "vit": VisionConfig(model_type="vit", img_h=32, img_w=32, patch_dim=4, num_classes=10,
                        num_layers=6, hidden_size=192, num_attention_heads=3),
    "swin": VisionConfig(model_type="swin", img_h=64, img_w=64, patch_dim=4, num_classes=10,
                         swin_embed_dim=48, swin_depths=(2, 2, 2), swin_num_heads=(3, 6, 12),
                         swin_window_size=4),
    # a T5-small-like shape scaled to CPU: 3 + 3 layers of 192, 64 encoder / 32 decoder tokens
    "t5": T5Config(encoder_num_layers=3, decoder_num_layers=3, hidden_size=192,
                   num_attention_heads=3, seq_length=64, decoder_seq_length=32, vocab_size=2048,
                   hidden_dropout=0.0, attention_dropout=0.0),
}


def make_batch(cfg: VisionConfig | T5Config, batch: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    if isinstance(cfg, T5Config):
        se, sd, v = cfg.seq_length, cfg.decoder_seq_length, cfg.vocab_size
        return {"tokens": torch.randint(0, v, (batch, se), generator=gen),
                "decoder_tokens": torch.randint(0, v, (batch, sd), generator=gen),
                "encoder_mask": torch.ones(batch, se), "labels": torch.randint(
                    0, v, (batch, sd), generator=gen), "loss_mask": torch.ones(batch, sd)}
    return {"tokens": torch.randn(batch, cfg.num_channels, cfg.img_h, cfg.img_w, generator=gen),
            "labels": torch.randint(0, cfg.num_classes, (batch,), generator=gen),
            "loss_mask": torch.ones(batch)}


def bench(cfg: VisionConfig | T5Config, batch: int, steps: int, warmup: int,
          device: torch.device) -> tuple[float, float]:
    """Median step seconds (ours, plain) for one model."""
    from megatron_auto.families.registry import family_of
    from megatron_auto.training.pretrain import build_trainer, train_step

    t5 = isinstance(cfg, T5Config)
    opt_cfg = OptimizerConfig()
    plan = Plan.uniform(1, cfg.num_layers, global_batch_size=batch)
    ours = build_trainer(cfg, plan, family_of(cfg).build_stage,
                         optimizer_config=opt_cfg,
                         lr_config=LRConfig(lr=1e-4, decay_style="constant"), device=device,
                         task=TaskSpec(every_stage_reads_batch=True) if t5 else TaskSpec())
    plain = (PlainT5(cfg) if t5 else plain_model(cfg)).to(device)
    plain.load_state_dict(ours.stage.state_dict())
    plain_opt = build_optimizer(plain.parameters(), opt_cfg, lr=1e-4,
                                named_parameters=plain.named_parameters())

    def plain_step(b: dict[str, torch.Tensor]) -> None:
        plain_opt.zero_grad(set_to_none=True)
        if t5:
            loss_sum, tokens = plain({k: v.to(device) for k, v in b.items()})
            loss = loss_sum / tokens
        else:
            loss = F.cross_entropy(plain(b["tokens"].to(device)), b["labels"].to(device))
        loss.backward()
        nn.utils.clip_grad_norm_(plain.parameters(), opt_cfg.clip_grad, foreach=True)
        plain_opt.step()

    times: dict[str, list[float]] = {"ours": [], "plain": []}
    for step in range(warmup + steps):
        b = make_batch(cfg, batch, step)
        # alternate which goes first, so neither always runs on a warmer cache
        order = [("ours", lambda x: train_step(ours, x)), ("plain", plain_step)]
        for name, fn in (order if step % 2 == 0 else order[::-1]):
            t = timed(fn, b, device=device)
            if step >= warmup:
                times[name].append(t)
    return statistics.median(times["ours"]), statistics.median(times["plain"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--global-batch-size", type=int, default=16)
    add_step_flags(parser, steps=10, warmup=2)
    args = parser.parse_args()
    device = one_process_world(args, "29534")
    print(f"device {device}, {torch.get_num_threads()} thread(s), global batch "
          f"{args.global_batch_size}, median of {args.steps} steps")
    print(f"{'model':6} {'parameters':>11} {'ours ms':>9} {'plain ms':>9} {'plain/ours':>10}")
    for name in args.models:
        cfg = MODELS[name]
        ours_s, plain_s = bench(cfg, args.global_batch_size, args.steps, args.warmup, device)
        print(f"{name:6} {cfg.num_parameters():>11,} {ours_s * 1e3:>9.1f} {plain_s * 1e3:>9.1f} "
              f"{plain_s / ours_s:>10.3f}")
    print("target: plain/ours >= 0.9")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
