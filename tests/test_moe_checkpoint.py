"""MoE checkpoints store the experts under plan-independent names as global tensors and reshard
between expert-parallel plans: saved after 2 of 4 steps under one plan, loaded under another
(ep 1 <-> ep 2 / ep 4, experts in another data-parallel mode, another world size), the last two
steps must match the uninterrupted one-process run (losses relative 1e-5, parameters
``rtol 1e-5, atol 1e-6``), as tests/test_checkpoint.py requires of dense plans. The optimizer
state of the experts travels too (AdamW's moments: a wrong reshard changes the next steps)."""

from __future__ import annotations

import copy

import pytest
import torch

from dist_utils import run_distributed
from megatron_auto.config import ModelConfig
from megatron_auto.plan import Plan
from test_equivalence import layer, make_batch, plan_of
from test_moe_equivalence import CONFIGS

pytestmark = pytest.mark.multirank

RTOL = 1e-5
STEPS, SPLIT = 4, 2
CONFIG = CONFIGS["top2-shared"]  # MoE layers 0 and 2, shared experts, aux and z-loss on


def _experts(plan: dict, **fields) -> dict:
    out = copy.deepcopy(plan)
    for i in CONFIG.moe_layers:
        out["layers"][i].update(fields)
    return out


ONE = plan_of(1, [layer()] * 4, num_microbatches=1)
DP4 = plan_of(4, [layer()] * 4)
EP4 = _experts(DP4, ep=4)
EP2_ZERO3 = _experts(plan_of(4, [layer(dp_mode="zero3")] * 4), ep=2, expert_dp_mode="zero1")
TP2_PP2 = plan_of(4, [layer(tp=2)] * 4, layers_per_stage=(2, 2), vocab_tp=2)  # dp 1: ep 1
EP2_TWO = _experts(plan_of(2, [layer()] * 4), ep=2, expert_dp_mode="zero3")

CASES = {  # name: (saving world, plan, loading world, plan)
    "ep1-dp4->ep4": (4, DP4, 4, EP4),
    "ep4->one": (4, EP4, 1, ONE),
    "one->ep2-zero3-experts-zero1": (1, ONE, 4, EP2_ZERO3),
    "ep2-zero1-experts->ep2-on-2-ranks": (4, EP2_ZERO3, 2, EP2_TWO),
    "ep2-on-2-ranks->tp2-pp2": (2, EP2_TWO, 4, TP2_PP2),
}


def _worker(rank, world_size, plan_dict, first, last, load_dir, save_dir):
    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.models.init import gather_full_state
    from megatron_auto.parallel.optimizer import OptimizerConfig
    from megatron_auto.training.checkpoint import load_checkpoint, save_checkpoint
    from megatron_auto.training.lr_scheduler import LRConfig
    from megatron_auto.training.trainer import build_trainer, train_step

    trainer = build_trainer(
        ModelConfig.from_dict(CONFIG.to_dict()), Plan.from_dict(plan_dict),
        lambda cfg, ctx, seed: GPTStage(cfg, ctx, seed=seed),
        optimizer_config=OptimizerConfig(weight_decay=0.1, clip_grad=1.0, adam_eps=1e-6),
        lr_config=LRConfig(lr=1e-3, min_lr=1e-4, decay_style="cosine", warmup_iters=1,
                           decay_iters=STEPS), seed=1234)
    if load_dir:
        assert load_checkpoint(trainer, load_dir) == first
    losses = []
    for step in range(first, last):
        batch = make_batch(step) if trainer.reads_data else None
        losses.append(train_step(trainer, batch).lm_loss)
    if save_dir:
        save_checkpoint(trainer, save_dir)
    return {"losses": losses, "state": gather_full_state(trainer.stage)}


def _phase(world, plan, first, last, load_dir=None, save_dir=None):
    outs = run_distributed(_worker, world, plan, first, last,
                           str(load_dir) if load_dir else None,
                           str(save_dir) if save_dir else None)
    state: dict[str, torch.Tensor] = {}
    for out in outs:
        state.update(out["state"])
    return outs[0]["losses"], state


_REF: dict[str, tuple] = {}


def _reference():
    if "ref" not in _REF:
        _REF["ref"] = _phase(1, ONE, 0, STEPS)
    return _REF["ref"]


@pytest.mark.parametrize("name", list(CASES))
def test_moe_checkpoint_reshards_between_expert_plans(tmp_path, name):
    save_world, save_plan, load_world, load_plan = CASES[name]
    _phase(save_world, save_plan, 0, SPLIT, save_dir=tmp_path)
    losses, state = _phase(load_world, load_plan, SPLIT, STEPS, load_dir=tmp_path)
    ref_losses, ref_state = _reference()
    assert losses == pytest.approx(ref_losses[SPLIT:], rel=RTOL), f"{name}: losses differ"
    assert set(state) == set(ref_state)
    assert "layers.0.mlp.experts.linear_fc1.weight" in state
    assert state["layers.0.mlp.experts.linear_fc1.weight"].shape[0] == CONFIG.moe.num_experts
    for fqn, value in ref_state.items():
        torch.testing.assert_close(state[fqn], value, rtol=RTOL, atol=1e-6,
                                   msg=lambda m, n=fqn: f"{name}: {n}: {m}")
