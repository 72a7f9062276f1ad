"""ZeRO-1 (``dp_mode: zero1``, Megatron's distributed optimizer): equivalence, memory, contract.

The equivalence runs use the helpers of ``test_equivalence`` (tiny GPT, fp32, dropout off,
AdamW with clipping, 3 steps, relative 1e-5 against one process).
"""

from __future__ import annotations

import pytest

from dist_utils import run_distributed
from harness import layer, plan_of
from megatron_auto.plan import Plan, PlanError
from test_equivalence import CONFIG, GPT

ZERO1_PLANS = {
    # every layer and the vocab on zero1 over dp=4 (tied embedding in one stage)
    "zero1-dp4": plan_of(4, [layer(dp_mode="zero1")] * 4, vocab_dp_mode="zero1"),
    # zero1 next to zero3, zero2, ddp and tp=2 (dp=2) layers
    "zero1-mixed": plan_of(4, [layer(dp_mode="zero1"), layer(dp_mode="zero3"),
                               layer(tp=2, dp_mode="zero1", consecutive=False),
                               layer(tp=2, dp_mode="zero2")], vocab_tp=2),
    # two stages: the tied word embedding lives on both, each copy a zero1 shard over dp=2
    "zero1-pp2-tied": plan_of(4, [layer(dp_mode="zero1"), layer(tp=2, dp_mode="zero1"),
                                  layer(dp_mode="zero3", recompute=True), layer(dp_mode="zero1")],
                              layers_per_stage=(2, 2), num_microbatches=4,
                              vocab_dp_mode="zero1"),
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(ZERO1_PLANS))
def test_zero1_plan_matches_one_process(name):
    GPT.check_named(4, ZERO1_PLANS, name)


def _optimizer_state_worker(rank, world_size, plan_dict):
    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.training.pretrain import build_trainer, train_step
    from test_equivalence import make_batch

    trainer = build_trainer(CONFIG, Plan.from_dict(plan_dict),
                            lambda cfg, ctx, seed: GPTStage(cfg, ctx, seed=seed))
    train_step(trainer, make_batch(0))
    state = sum(v.numel() for s in trainer.optimizer.state.values() for v in s.values()
                if v.dim() > 0)
    params = sum(p.numel() for p in trainer.stage.parameters())
    return {"state": state, "params": params,
            "pieces": trainer.data_parallel.zero1.num_shard_elements}


@pytest.mark.multirank
def test_zero1_holds_one_dp_th_of_the_optimizer_state():
    ddp, zero1 = (plan_of(4, [layer(dp_mode=m)] * 4, vocab_dp_mode=m) for m in ("ddp", "zero1"))
    full = run_distributed(_optimizer_state_worker, 4, ddp)
    sharded = run_distributed(_optimizer_state_worker, 4, zero1)
    for f, z in zip(full, sharded):
        assert f["state"] == 2 * f["params"]  # AdamW: exp_avg + exp_avg_sq per parameter
        assert z["params"] == f["params"]  # parameters stay replicated
        # each rank's slice is 1/4 of every bucket (buckets padded to a multiple of 4)
        assert z["state"] == 2 * z["pieces"]
        assert f["params"] / 4 - 4 <= z["pieces"] <= f["params"] / 4 + 4, (z, f)
    # the slices partition the parameters: together they cover every element once
    assert sum(z["pieces"] for z in sharded) == full[0]["params"]


@pytest.mark.single
def test_zero1_is_a_plan_dp_mode_and_reads_back():
    plan = Plan.from_dict(ZERO1_PLANS["zero1-mixed"])
    assert plan.layers[0].dp_mode == "zero1"
    assert Plan.from_dict(plan.to_dict()) == plan
    bad = dict(ZERO1_PLANS["zero1-dp4"], layers=[{"tp": 1, "dp_mode": "zero4"}] * 4)
    with pytest.raises(PlanError, match=r"layers\[0\]\.dp_mode='zero4': choose one of ddp, zero1"):
        Plan.from_dict(bad)


# ------------------------------------------------------------------------- checkpoints
@pytest.mark.single
def test_zero1_checkpoint_reshards_and_continues_exactly(tmp_path):
    """Optimizer states of zero1 slices are saved whole and sliced again on load: a checkpoint
    of a pp=2 zero1 plan (dp=2) continues exactly under a one-stage mixed plan whose zero1
    layers have other slices (dp=4 and dp=2)."""
    from test_checkpoint import SPLIT, STEPS, _phase
    from test_checkpoint import assert_matches_reference as assert_resumed_matches

    _phase(4, ZERO1_PLANS["zero1-pp2-tied"], 0, SPLIT, save_dir=tmp_path)
    resumed = _phase(4, ZERO1_PLANS["zero1-mixed"], SPLIT, STEPS, load_dir=tmp_path)
    assert_resumed_matches(resumed, "zero1 pp2 -> zero1 mixed")
