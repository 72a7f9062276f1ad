"""Equivalence harness for the vision backbones (ViT, Swin), shared by test_vit and test_swin.

Every plan trains the same tiny classifier (fp32, dropout off) for a few AdamW steps with
gradient clipping on the same global batches of random images, through ``build_trainer`` and
``train_step`` (the code the command line runs); losses, gradient norms and the updated
parameters (gathered to full tensors) must match a one-process run within relative 1e-5.
"""

from __future__ import annotations

import torch

from dist_utils import run_distributed
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.families.vision.config import VisionConfig

GLOBAL_BATCH = 8
#: --auto-parallel for the equivalence tests: a preset cluster (no hardware measurement, the
#: analytic profile) and the harness's global batch
AUTO_ARGV = ["--auto-parallel", "--cluster", "a100-40g-1x8", "--global-batch-size", "8"]
STEPS = 3
RTOL = 1e-5


def make_batch(config: VisionConfig, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    images = torch.randn(GLOBAL_BATCH, config.num_channels, config.img_h, config.img_w,
                         generator=gen)
    labels = torch.randint(0, config.num_classes, (GLOBAL_BATCH,), generator=gen)
    loss_mask = torch.ones(GLOBAL_BATCH)
    loss_mask[3] = 0.0  # a masked-out sample must not count under any plan
    return {"tokens": images, "labels": labels, "loss_mask": loss_mask}


def layer(tp=1, dp_mode="ddp", consecutive=True, recompute=False) -> LayerStrategy:
    return LayerStrategy(tp=tp, dp_mode=dp_mode, tp_consecutive=consecutive, recompute=recompute)


def plan_of(world_size, layers, *, layers_per_stage=None, num_microbatches=2, schedule="1f1b",
            vocab_tp=1, vocab_dp_mode="ddp") -> dict:
    lps = tuple(layers_per_stage or (len(layers),))
    return Plan(world_size=world_size, global_batch_size=GLOBAL_BATCH,
                num_microbatches=num_microbatches,
                pipeline=PipelineSpec(size=len(lps), schedule=schedule, layers_per_stage=lps),
                vocab=VocabStrategy(tp=vocab_tp, dp_mode=vocab_dp_mode),
                layers=tuple(layers)).to_dict()


def _auto_plans(world_size, config, argv):
    """The plan ``--auto-parallel`` searches on these ranks (collective)."""
    from megatron_auto import auto
    from megatron_auto.arguments import build_parser
    from megatron_auto.families.vision.flags import add_vision_args

    from megatron_auto.arguments import parse_run_config
    from megatron_auto.families.vision.flags import vision_config_from_args

    run = parse_run_config(argv, add_vision_args(build_parser()),
                           model_config_from_args=vision_config_from_args)
    return [auto.plan_for_run(run.plan_source, config, world_size,
                              precision=run.precision.name).to_dict()]


def _train_worker(rank, world_size, config_dict, plan_dicts, steps):
    from megatron_auto.models.init import gather_full_state
    from megatron_auto.families.registry import family_of
    from megatron_auto.training.lr_scheduler import LRConfig
    from megatron_auto.parallel.optimizer import OptimizerConfig
    from megatron_auto.training.trainer import build_trainer, train_step

    config = VisionConfig.from_dict(config_dict)
    if isinstance(plan_dicts, tuple) and plan_dicts[0] == "auto":  # ("auto", argv)
        plan_dicts = _auto_plans(world_size, config, plan_dicts[1])
    out = []
    for plan_dict in plan_dicts:
        trainer = build_trainer(
            config, Plan.from_dict(plan_dict),
            family_of(config).build_stage,
            # eps 1e-5: gradient elements that are (nearly) zero, the key bias exactly and
            # some output biases by cancellation (~1e-6), are rounding noise that Adam with a
            # tiny eps would turn into +-lr steps, differently under each plan.
            optimizer_config=OptimizerConfig(weight_decay=0.1, clip_grad=1.0, adam_eps=1e-5),
            lr_config=LRConfig(lr=1e-3, decay_style="constant"), seed=1234)
        results = []
        for step in range(steps):
            batch = make_batch(config, step) if trainer.reads_data else None
            r = train_step(trainer, batch)
            results.append({"loss": r.lm_loss, "grad_norm": r.grad_norm})
        out.append({"results": results, "state": gather_full_state(trainer.stage),
                    "plan": plan_dict})
    return out


def run_plans(config: VisionConfig, world_size: int, plan_dicts: list[dict] | tuple,
              steps: int = STEPS) -> list[tuple[list[dict], dict[str, torch.Tensor]]]:
    """Per plan: (rank 0's per-step losses and norms, the full parameter state of all ranks).

    ``plan_dicts = ("auto", argv)`` trains the plan ``--auto-parallel`` finds with those flags.
    """
    per_rank = run_distributed(_train_worker, world_size, config.to_dict(), plan_dicts, steps)
    merged = []
    for p in range(len(per_rank[0])):
        state: dict[str, torch.Tensor] = {}
        for rank_out in per_rank:
            for name, value in rank_out[p]["state"].items():
                if name in state:  # DP replicas must agree
                    torch.testing.assert_close(value, state[name], rtol=RTOL, atol=1e-7)
                state[name] = value
        merged.append((per_rank[0][p]["results"], state))
    if isinstance(plan_dicts, tuple):
        return [(merged[0], per_rank[0][0]["plan"])]
    return merged


def assert_same(reference, candidate, label: str) -> None:
    """Losses and updated parameters of ``candidate`` equal the one-process ``reference``."""
    (ref_results, ref_state), (results, state) = reference, candidate
    for step, (r, c) in enumerate(zip(ref_results, results)):
        assert abs(c["loss"] - r["loss"]) <= RTOL * abs(r["loss"]), \
            f"{label}: step {step} loss {c['loss']} vs one process {r['loss']}"
        assert abs(c["grad_norm"] - r["grad_norm"]) <= 1e-4 * abs(r["grad_norm"]), \
            f"{label}: step {step} grad norm {c['grad_norm']} vs {r['grad_norm']}"
    assert set(state) == set(ref_state), f"{label}: parameter names differ"
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=1e-6,
                                   msg=lambda m, n=name: f"{label}: {n}: {m}")


def _plain_worker(rank, world_size, config_dict):
    import os
    import sys

    import torch.nn.functional as F

    from megatron_auto.families.registry import family_of
    from megatron_auto.parallel.context import ParallelContext

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    from plain_vision import plain_model

    config = VisionConfig.from_dict(config_dict)
    plan = Plan.from_dict(plan_of(1, [layer()] * config.num_layers, num_microbatches=1))
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
