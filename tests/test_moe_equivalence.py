"""MoE GPT models under multi-rank plans train like one process (the equivalence invariant).

fp32, dropout off, three AdamW steps through ``train_step`` (tests/harness.py): losses
relative 1e-5, gradient norms 1e-4, every updated parameter ``rtol 1e-5, atol 1e-6``. Beyond the parameters, the MoE blocks' statistics of each step must agree with one
process: the kept assignments per expert and the sums over the global batch's sequences of the
balance and z-losses (summed over the ranks of TP rank 0 of each layer, which together see
every sequence once). The auxiliary losses are on (their gradient reaches the router), MoE is
every other layer, with shared experts (and a top-1, capacity-dropping model with MoE in
every layer); the plans split the dense parts over TP (the router and experts replicated on
the TP ranks), pipeline, recompute the MoE layers, and shard them with ZeRO-1/3; the
expert-parallel plans split the experts over 2 and 4 ranks (all-to-all dispatch) with dense TP,
a pipeline, recompute, and expert-DP modes different from their layers' (zero1 experts in a
zero3 layer, zero3 experts in a ddp layer, ddp experts in a zero2 layer).
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch

from harness import RTOL, STEPS, Equivalence, Trained, layer, plan_of
from megatron_auto.families.gpt.config import MoEConfig
from test_equivalence import CONFIG as BASE, gpt_recipe

pytestmark = pytest.mark.multirank

MOE = MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32, layer_freq=2,
                shared_expert_intermediate_size=32, aux_loss_coeff=0.01, z_loss_coeff=0.001)
CONFIGS = {
    "top2-shared": dataclasses.replace(BASE, activation="swiglu", add_bias_linear=False, moe=MOE),
    "top1-capacity-gelu": dataclasses.replace(BASE, add_bias_linear=False, moe=dataclasses.replace(
        MOE, router_topk=1, router_pre_softmax=True, expert_capacity_factor=1.0,
        shared_expert_intermediate_size=None, layer_freq=1)),
}


def moe_layers(plan: dict, model: str, **fields) -> dict:
    """``plan`` with ``fields`` (ep, expert_dp_mode) on the MoE layers of ``model``."""
    out = copy.deepcopy(plan)
    for i in CONFIGS[model].moe_layers:
        out["layers"][i].update(fields)
    return out


PLANS = {
    "tp2xdp2": plan_of(4, [layer(tp=2)] * 4, vocab_tp=2),
    "pp2-tp2-zero-recompute": plan_of(4, [layer(tp=2, dp_mode="zero3", recompute=True),
                                          layer(tp=2), layer(dp_mode="zero1", recompute=True),
                                          layer(tp=2, consecutive=False)],
                                      layers_per_stage=(2, 2), vocab_tp=2),
}
# Expert parallelism on the MoE layers (the dense layers as they are): (base plan, fields).
EP_PLANS = {
    "ep4": (plan_of(4, [layer()] * 4), dict(ep=4)),
    "ep2-layer-zero3-experts-zero1": (plan_of(4, [layer(dp_mode="zero3")] * 4),
                                      dict(ep=2, expert_dp_mode="zero1")),
    "tp2-ep2-recompute": (plan_of(4, [layer(tp=2, recompute=True)] * 4, vocab_tp=2),
                          dict(ep=2)),
    "pp2-ep2-experts-zero3": (plan_of(4, [layer()] * 4, layers_per_stage=(2, 2)),
                              dict(ep=2, expert_dp_mode="zero3")),
    "ep2-experts-ddp-zero2": (plan_of(4, [layer(dp_mode="zero2")] * 4),
                              dict(ep=2, expert_dp_mode="ddp")),
}


def moe_stats(trainer) -> dict[int, dict[str, torch.Tensor]]:
    """Layer index -> the MoE block's statistics of the step, on TP rank 0 of each MoE layer
    (the ranks that together see every sequence once); checks the auxiliary losses' scale."""
    from megatron_auto.models.moe import MoELayer

    step_stats = {}
    for name, module in trainer.stage.named_modules():
        if isinstance(module, MoELayer):
            index = int(name.split(".")[1])  # layers.<i>.mlp
            # the trainer's loss_scale / global batch (fp32: scale 1)
            assert module.aux_loss_scale == 1.0 / trainer.plan.global_batch_size
            if trainer.ctx.layer_groups(index).tp_rank == 0:
                step_stats[index] = module.stats
    return step_stats


def summed_stats(trained: Trained) -> list[dict[int, dict[str, torch.Tensor]]]:
    """Per step, each MoE layer's statistics summed over the ranks that reported them."""
    stats: list[dict] = [{} for _ in range(STEPS)]
    for rank_stats in trained.observed:
        for step, step_stats in enumerate(rank_stats):
            for index, values in step_stats.items():
                mine = stats[step].setdefault(index, {k: torch.zeros_like(v)
                                                      for k, v in values.items()})
                for k, v in values.items():
                    mine[k] += v
    return stats


MODELS = {name: Equivalence(dataclasses.replace(gpt_recipe(config), observe=moe_stats), name)
          for name, config in CONFIGS.items()}


@functools.lru_cache(maxsize=None)
def _four_rank(name: str) -> dict[str, Trained]:
    plans = dict(PLANS)
    plans.update({k: moe_layers(base, name, **fields) for k, (base, fields) in EP_PLANS.items()})
    return MODELS[name].run_named(4, plans)


@pytest.mark.parametrize("model", list(CONFIGS))
@pytest.mark.parametrize("plan", list(PLANS) + list(EP_PLANS))
def test_moe_plan_matches_one_process(model, plan):
    trained = _four_rank(model)[plan]
    # losses (relative 1e-5), gradient norms (1e-4), every parameter (rtol 1e-5, atol 1e-6)
    MODELS[model].check(trained, plan)
    label = f"{model}/{plan}"
    stats, ref_stats = summed_stats(trained), summed_stats(MODELS[model].reference())
    assert [sorted(s) for s in stats] == [sorted(s) for s in ref_stats]
    assert list(ref_stats[0]) == list(CONFIGS[model].moe_layers)
    for step, (got, want) in enumerate(zip(stats, ref_stats)):
        for index, values in want.items():
            assert values["sequences"].item() == 8
            assert got[index]["tokens_per_expert"].tolist() == values["tokens_per_expert"].tolist()
            for key in ("balance_sum", "z_sum"):
                torch.testing.assert_close(got[index][key], values[key], rtol=RTOL, atol=1e-9,
                                           msg=lambda m, k=key: f"{label} step {step}: {k}: {m}")
