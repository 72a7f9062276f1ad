"""MoE checkpoints store the experts under plan-independent names as global tensors and reshard
between expert-parallel plans: saved after 2 of 4 steps under one plan, loaded under another
(ep 1 <-> ep 2 / ep 4, experts in another data-parallel mode, another world size), the last two
steps must match the uninterrupted one-process run (losses relative 1e-5, parameters
``rtol 1e-5, atol 1e-6``), as tests/test_checkpoint.py requires of dense plans. The optimizer
state of the experts travels too (AdamW's moments: a wrong reshard changes the next steps)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from harness import Trained, assert_same_training, layer, plan_of, run_phase
from test_checkpoint import CKPT
from test_moe_equivalence import CONFIGS

pytestmark = pytest.mark.multirank

STEPS, SPLIT = 4, 2  # CKPT's cosine schedule decays over these STEPS
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


# The dense checkpoint tests' recipe (tiny GPT, cosine schedule) with the MoE config.
MOE_CKPT = dataclasses.replace(CKPT, config=CONFIG)
_REF: dict[str, Trained] = {}


def _reference() -> Trained:
    if "ref" not in _REF:
        _REF["ref"] = run_phase(MOE_CKPT, 1, ONE, 0, STEPS)
    return _REF["ref"]


@pytest.mark.parametrize("name", list(CASES))
def test_moe_checkpoint_reshards_between_expert_plans(tmp_path, name):
    save_world, save_plan, load_world, load_plan = CASES[name]
    run_phase(MOE_CKPT, save_world, save_plan, 0, SPLIT, save_dir=tmp_path)
    resumed = run_phase(MOE_CKPT, load_world, load_plan, SPLIT, STEPS, load_dir=tmp_path)
    state = resumed.state
    assert "layers.0.mlp.experts.linear_fc1.weight" in state
    assert state["layers.0.mlp.experts.linear_fc1.weight"].shape[0] == CONFIG.moe.num_experts
    # the resumed steps' losses (relative 1e-5) and gradient norms (1e-4), the same parameter
    # names, every parameter rtol 1e-5, atol 1e-6
    assert_same_training(_reference(), resumed, name)
