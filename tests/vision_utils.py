"""The vision backbones' recipe for the equivalence harness (tests/harness.py), shared by
tests/test_vit.py and tests/test_swin.py, and the check against an independent plain PyTorch
model.

fp32, dropout off, AdamW with clipping for a few steps on the same global batches of random
images (one sample masked out).
"""

from __future__ import annotations

import functools

import torch

from dist_utils import run_distributed
from harness import GLOBAL_BATCH, RTOL, Recipe, Searched, one_process_plan
from megatron_auto.families.registry import family_of
from megatron_auto.families.vision.config import VisionConfig
from megatron_auto.families.vision.flags import add_vision_args, vision_config_from_args
from megatron_auto.parallel.optimizer import OptimizerConfig
from megatron_auto.plan import Plan

#: --auto-parallel for the equivalence tests: a preset cluster (no hardware measurement, the
#: analytic profile) and the harness's global batch
AUTO_ARGV = ("--auto-parallel", "--cluster", "a100-40g-1x8", "--global-batch-size", "8")
#: the plan --auto-parallel finds for the equivalence tests' batch
SEARCHED = Searched(AUTO_ARGV, add_vision_args, vision_config_from_args)


def make_batch(config: VisionConfig, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    images = torch.randn(GLOBAL_BATCH, config.num_channels, config.img_h, config.img_w,
                         generator=gen)
    labels = torch.randint(0, config.num_classes, (GLOBAL_BATCH,), generator=gen)
    loss_mask = torch.ones(GLOBAL_BATCH)
    loss_mask[3] = 0.0  # a masked-out sample must not count under any plan
    return {"tokens": images, "labels": labels, "loss_mask": loss_mask}


def vision_recipe(config: VisionConfig) -> Recipe:
    """The harness's recipe for a ViT or Swin config (its stage from the family registry)."""
    return Recipe(config, family_of(config).build_stage, functools.partial(make_batch, config),
                  # eps 1e-5: gradient elements that are (nearly) zero, the key bias exactly
                  # and some output biases by cancellation (~1e-6), are rounding noise that
                  # Adam with a tiny eps would turn into +-lr steps, differently under each plan.
                  optimizer=OptimizerConfig(weight_decay=0.1, clip_grad=1.0, adam_eps=1e-5))


def _plain_worker(rank, world_size, config_dict):
    import os
    import sys

    import torch.nn.functional as F

    from megatron_auto.parallel.context import ParallelContext

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    from plain_vision import plain_model

    config = VisionConfig.from_dict(config_dict)
    plan = Plan.from_dict(one_process_plan(config.num_layers))
    ours = family_of(config).build_stage(config, ParallelContext(plan))
    plain = plain_model(config)
    plain.load_state_dict(ours.state_dict(), strict=True)
    batch = make_batch(config, 0)
    loss, _ = ours(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"])
    loss.backward()
    ce = F.cross_entropy(plain(batch["tokens"]), batch["labels"], reduction="none")
    plain_loss = (ce * batch["loss_mask"]).sum()
    plain_loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters()}
    plain_grads = {n: p.grad for n, p in plain.named_parameters()}
    return float(loss), float(plain_loss), grads, plain_grads


def assert_matches_plain_pytorch(config: VisionConfig) -> None:
    """Our one-process stage computes what an independent plain PyTorch model computes."""
    ((loss, plain_loss, grads, plain_grads),) = run_distributed(_plain_worker, 1,
                                                                config.to_dict())
    assert abs(loss - plain_loss) <= RTOL * abs(plain_loss), (loss, plain_loss)
    assert set(grads) == set(plain_grads)
    for name, g in plain_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
