"""The equivalence invariant (docs/design.md §4) end to end, through the training step the CLI runs.

Every plan below trains the same tiny GPT (h=32, s=16, 4 layers, dropout off, fp32) for a few
steps of AdamW with gradient clipping on the same global batches; losses and the updated
parameters (gathered to full tensors) must match a one-process run within relative 1e-5.
The one-process reference runs through exactly the same code (a one-rank plan).
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from harness import GLOBAL_BATCH, STEPS, Equivalence, Recipe, layer, plan_of, run_plans
from megatron_auto.config import ModelConfig
from megatron_auto.families.registry import family_of
from megatron_auto.parallel.optimizer import OptimizerConfig
from megatron_auto.training.lr_scheduler import LRConfig
from megatron_auto.training.precision import PrecisionConfig

pytestmark = pytest.mark.multirank

CONFIG = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                     seq_length=16, vocab_size=60, make_vocab_size_divisible_by=16,
                     hidden_dropout=0.0, attention_dropout=0.0)


def make_batch(step: int, vocab: int = CONFIG.vocab_size) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, CONFIG.seq_length + 1), generator=gen)
    loss_mask = (torch.rand(GLOBAL_BATCH, CONFIG.seq_length, generator=gen) > 0.1).float()
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": loss_mask,
            "position_ids": torch.arange(CONFIG.seq_length).expand(GLOBAL_BATCH, -1).contiguous()}


GPT_RECIPE = Recipe(CONFIG, family_of(CONFIG).build_stage, make_batch,
                    # eps 1e-6: the key bias has a mathematically zero gradient (softmax
                    # ignores it), so its gradient is rounding noise that Adam would blow up to
                    # +-lr per step with a tiny eps, differently under each plan; a larger eps
                    # keeps such noise negligible.
                    optimizer=OptimizerConfig(weight_decay=0.1, clip_grad=1.0, adam_eps=1e-6))
GPT = Equivalence(GPT_RECIPE, "gpt")


def gpt_recipe(config: ModelConfig = CONFIG, *, precision=None, lr=1e-3,
               same_batch=False) -> Recipe:
    """The tiny GPT's recipe with another config, precision, learning rate, or the batch of
    step 0 at every step (``same_batch``)."""
    return dataclasses.replace(
        GPT_RECIPE, config=config, precision=PrecisionConfig(**(precision or {})),
        lr=LRConfig(lr=lr, decay_style="constant"),
        batch=(lambda step: make_batch(0)) if same_batch else make_batch)


def test_tensor_parallel_two_ranks_matches_one_process_for_five_steps():
    GPT.check_tensor_parallel(2, steps=5)


FOUR_RANK_PLANS = {
    "tp4": plan_of(4, [layer(tp=4)] * 4, vocab_tp=4),
    "tp2xdp2": plan_of(4, [layer(tp=2)] * 4, vocab_tp=2),
    "pp2-uneven-3+1": plan_of(4, [layer(tp=2)] * 4, layers_per_stage=(3, 1), vocab_tp=2),
    "pp4-gpipe-4mb": plan_of(4, [layer()] * 4, layers_per_stage=(1, 1, 1, 1), num_microbatches=4,
                             schedule="gpipe"),
    "pp4-1f1b-8mb": plan_of(4, [layer()] * 4, layers_per_stage=(1, 1, 1, 1), num_microbatches=8),
    "pp2-1mb": plan_of(4, [layer(tp=2)] * 4, layers_per_stage=(2, 2), num_microbatches=1,
                       vocab_tp=2),
    "pp1-mix": plan_of(4, [layer(tp=2), layer(tp=1, dp_mode="zero3"), layer(tp=4),
                           layer(tp=2, dp_mode="zero2", consecutive=False)], vocab_tp=2),
    "recompute-some": plan_of(4, [layer(tp=2, recompute=True), layer(tp=2),
                                  layer(tp=1, recompute=True), layer(tp=2, consecutive=False)],
                              layers_per_stage=(2, 2), num_microbatches=4, schedule="gpipe"),
}


FIVE_STEP_PLANS = ("tp4", "tp2xdp2")  # pure tensor parallelism: checked over five steps


@pytest.fixture(scope="module")
def four_rank_results():
    names = list(FOUR_RANK_PLANS)
    steps = [5 if n in FIVE_STEP_PLANS else STEPS for n in names]
    return dict(zip(names, GPT.run(4, [FOUR_RANK_PLANS[n] for n in names], steps=steps)))


@pytest.mark.parametrize("name", list(FOUR_RANK_PLANS))
def test_four_rank_plan_matches_one_process(four_rank_results, name):
    GPT.check(four_rank_results[name], name)


def test_eight_ranks_pipeline_with_per_layer_layouts():
    plan = plan_of(8, [layer(tp=4), layer(tp=1, dp_mode="zero2"), layer(tp=2, consecutive=False),
                       layer(tp=2, dp_mode="zero3", recompute=True)],
                   layers_per_stage=(2, 2), num_microbatches=2, vocab_tp=2, vocab_dp_mode="zero2")
    (trained,) = GPT.run(8, [plan])
    GPT.check(trained, "8 ranks pp2 mixed")


def random_plans(count: int, seed: int, world_size: int = 4) -> list[dict]:
    """Random valid plans for CONFIG on ``world_size`` ranks (seeded, reproducible)."""
    rng = random.Random(seed)
    plans = []
    while len(plans) < count:
        pp = rng.choice([1, 2, 4])
        n = world_size // pp
        cuts = sorted(rng.sample(range(1, CONFIG.num_layers), pp - 1))
        bounds = [0] + cuts + [CONFIG.num_layers]
        lps = tuple(bounds[i + 1] - bounds[i] for i in range(pp))
        tps = [t for t in (1, 2, 4) if n % t == 0]
        mb = rng.choice([1, 2, 4])
        layers = [layer(tp=rng.choice(tps), dp_mode=rng.choice(["ddp", "zero2", "zero3"]),
                        consecutive=rng.random() < 0.5, recompute=rng.random() < 0.3)
                  for _ in range(CONFIG.num_layers)]
        try:
            plans.append(plan_of(world_size, layers, layers_per_stage=lps, num_microbatches=mb,
                                 schedule=rng.choice(["1f1b", "gpipe"]), vocab_tp=rng.choice(tps),
                                 vocab_dp_mode=rng.choice(["ddp", "zero2", "zero3"])))
        except ValueError:
            continue  # e.g. a dp degree that does not divide the micro-batch: draw again
    return plans


def test_random_plans_match_one_process():
    plans = random_plans(6, seed=20261129)
    for plan, trained in zip(plans, GPT.run(4, plans, steps=2)):
        GPT.check(trained, f"random plan {plan}")


def test_bf16_run_trains():
    # Two stages of one rank: bf16 activations cross the p2p hop; ZeRO layers on both sides.
    plan = plan_of(2, [layer(), layer(dp_mode="zero2"), layer(), layer(dp_mode="zero3")],
                   layers_per_stage=(2, 2))
    (trained,) = run_plans(gpt_recipe(precision={"bf16": True}, lr=1e-2, same_batch=True), 2,
                           [plan], steps=6)
    losses, state = trained.losses, trained.state
    assert all(math.isfinite(l) for l in losses)
    # Same batch every step: the model memorises it, so the loss must fall clearly.
    assert losses[-1] < losses[0] - 0.1, losses
    # The first (untrained) loss is the fp32 one up to bf16 rounding.
    assert losses[0] == pytest.approx(GPT.reference().losses[0], rel=2e-2)
    assert all(v.dtype == torch.float32 for v in state.values())  # fp32 master parameters


def test_fp16_skips_overflowing_steps_and_recovers():
    plan = plan_of(2, [layer(tp=2)] * 4, vocab_tp=2)
    start_scale = 2.0 ** 24  # large enough that the first backward overflows fp16
    precision = {"fp16": True, "initial_loss_scale": start_scale, "hysteresis": 1}
    (trained,) = run_plans(gpt_recipe(precision=precision, lr=1e-2, same_batch=True), 2,
                           [plan], steps=10)
    results, state = trained.results, trained.state
    skipped = [r["skipped"] for r in results]
    assert skipped[0], "the first step should overflow at loss scale 2^24"
    # Recovery: once the scale fits, most steps update the weights (an occasional later
    # overflow is normal dynamic scaling and is skipped again).
    assert skipped.count(False) >= 5, f"training did not recover: {skipped}"
    scales = [r["loss_scale"] for r in results]
    # Every skipped step halves the scale (hysteresis 1); clean steps keep it (window 1000).
    for before, after, skip in zip(scales, scales[1:], skipped):
        assert after == (before / 2 if skip else before)
    assert all(math.isinf(r["grad_norm"]) or math.isnan(r["grad_norm"])
               for r, s in zip(results, skipped) if s)
    assert all(torch.isfinite(v).all() for v in state.values())
    losses = [r["lm_loss"] for r, s in zip(results, skipped) if not s]
    assert losses[-1] < results[0]["lm_loss"]
