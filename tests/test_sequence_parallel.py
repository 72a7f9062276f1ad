"""Sequence parallelism (per-layer ``sequence_parallel``, Megatron-SP): equivalence with one
process, dropout masks unchanged by SP, activation memory divided as the profile's split says,
and the bad-input errors.

Equivalence runs use ``test_equivalence``'s tiny GPT (fp32, dropout off, AdamW with clipping,
3 steps, relative 1e-5 on losses and updated parameters).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dist_utils import run_distributed
from harness import layer, layer_and_input, plan_of, run_plans
from megatron_auto.config import ModelConfig
from megatron_auto.plan import Plan, PlanError
from test_equivalence import CONFIG, GPT, gpt_recipe

SP_PLANS = {
    # every layer SP, tp 2 x dp 2 (vocab tp 2)
    "sp-all-tp2": plan_of(4, [layer(tp=2, sp=True)] * 4, vocab_tp=2),
    # every layer SP over all four ranks
    "sp-all-tp4": plan_of(4, [layer(tp=4, sp=True)] * 4, vocab_tp=4),
    # SP layers next to non-SP layers and layouts of another tp (strided too), recompute, ZeRO
    "sp-some-mixed": plan_of(4, [layer(tp=2, sp=True), layer(tp=4, sp=True, recompute=True),
                                 layer(tp=4), layer(tp=2, consecutive=False, sp=True,
                                                    dp_mode="zero3")],
                             num_microbatches=2, vocab_tp=2),
    # SP on both sides of a stage boundary (and a non-SP layer after it), tp 2 per stage
    "sp-pp2-boundary": plan_of(4, [layer(tp=2), layer(tp=2, sp=True), layer(tp=2, sp=True),
                                   layer(dp_mode="zero1")],
                               layers_per_stage=(2, 2), num_microbatches=2, vocab_tp=2),
    # interleaved v=2 with SP chunks
    "sp-interleaved": plan_of(4, [layer(tp=2, sp=True), layer(tp=2), layer(tp=2, sp=True),
                                  layer(tp=2, sp=True, recompute=True)],
                              layers_per_stage=(1, 1, 1, 1), virtual_size=2,
                              num_microbatches=2, vocab_tp=2),
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(SP_PLANS))
def test_sequence_parallel_plan_matches_one_process(name):
    GPT.check_named(4, SP_PLANS, name)


@pytest.mark.multirank
def test_dropout_masks_are_the_same_with_and_without_sp():
    """Dropout on: an SP plan draws exactly the masks of the same layout without SP."""
    config = replace(CONFIG, hidden_dropout=0.1, attention_dropout=0.1)
    plain = plan_of(2, [layer(tp=2)] * 4, vocab_tp=2)
    sp = plan_of(2, [layer(tp=2, sp=True)] * 4, vocab_tp=2)
    plain_out, sp_out = run_plans(gpt_recipe(config), 2, [plain, sp], steps=2)
    assert sp_out.losses == pytest.approx(plain_out.losses, rel=1e-5)
    # and dropout really was on: the first loss differs from the dropout-off reference
    assert abs(plain_out.losses[0] - GPT.reference().losses[0]) > 1e-4
    assert set(sp_out.state) == set(plain_out.state)
    for name, value in plain_out.state.items():
        torch.testing.assert_close(sp_out.state[name], value, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- memory
def _saved_bytes_worker(rank, world_size, sp):
    from megatron_auto.parallel.context import ParallelContext
    from megatron_auto.profiler.activation_meter import SavedTensorMeter

    config = replace(CONFIG, seq_length=64, max_position_embeddings=64, hidden_size=64,
                     ffn_hidden_size=256)
    plan = Plan.from_dict(plan_of(2, [layer(tp=2, sp=sp)] * 4, vocab_tp=2))
    ctx = ParallelContext(plan)
    groups = ctx.layer_groups(0)
    module, x = layer_and_input(config, groups, 4, sp=sp)
    meter = SavedTensorMeter(module, exclude=[x])
    with meter:
        y = module(x)
    meter.add_output(y)
    y.sum().backward()  # the SP layer's backward runs too
    return {"split": meter.split_bytes, "replicated": meter.replicated_bytes,
            "total": meter.total_bytes}


@pytest.mark.multirank
def test_sp_divides_the_replicated_activations_by_tp():
    """The profile splits a layer's saved activations into a TP-split part S and a replicated
    part R (norm inputs, residual stream, column-parallel inputs, the output); SP keeps R/tp:
    a tp=2 SP layer saves S + R/2."""
    plain = run_distributed(_saved_bytes_worker, 2, False)[0]
    sp = run_distributed(_saved_bytes_worker, 2, True)[0]
    expected = plain["split"] + plain["replicated"] / 2
    assert plain["replicated"] > 0.3 * plain["total"]  # SP has something to divide
    assert sp["total"] == pytest.approx(expected, rel=0.01), (plain, sp)


# -------------------------------------------------------------------------- bad input
@pytest.mark.single
def test_sequence_parallel_needs_tp_above_one():
    bad = plan_of(2, [layer(tp=2)] * 3 + [layer(tp=2)], vocab_tp=2)
    bad["layers"][2] = {"tp": 1, "sequence_parallel": True}
    with pytest.raises(PlanError, match=r"plan field layers\[2\]\.sequence_parallel=True: needs "
                                        r"tp > 1 \(this layer has tp=1\); set tp to 2 or more, "
                                        r"or sequence_parallel to false"):
        Plan.from_dict(bad)


@pytest.mark.single
def test_sequence_parallel_needs_the_sequence_divisible_by_tp():
    plan = Plan.from_dict(plan_of(4, [layer(tp=4, sp=True)] * 4, vocab_tp=4))
    odd = ModelConfig.from_dict(dict(CONFIG.to_dict(), seq_length=18,
                                     max_position_embeddings=18))
    with pytest.raises(PlanError, match=r"layers\[0\]\.sequence_parallel=True: --seq-length=18 "
                                        r"must be divisible by the layer's tp=4"):
        plan.check_model(odd)


@pytest.mark.single
def test_sequence_parallel_round_trips_and_plain_files_stay_as_they_were():
    plan = Plan.from_dict(SP_PLANS["sp-some-mixed"])
    assert [l.sequence_parallel for l in plan.layers] == [True, True, False, True]
    assert Plan.from_dict(plan.to_dict()) == plan
    assert "sequence_parallel" not in plan.to_dict()["layers"][2]


@pytest.mark.single
def test_vision_stages_refuse_sp_and_interleaving_clearly():
    from megatron_auto.models.vit import _refuse_unsupported

    with pytest.raises(PlanError, match=r"layers\[0\]\.sequence_parallel=True: the vision"):
        _refuse_unsupported(Plan.from_dict(SP_PLANS["sp-all-tp2"]))
    with pytest.raises(PlanError, match=r"pipeline\.virtual_size=2: the vision models"):
        _refuse_unsupported(Plan.from_dict(SP_PLANS["sp-interleaved"]))


@pytest.mark.single
def test_checkpoint_moves_between_sp_interleaved_and_plain_plans(tmp_path):
    """Names and global shapes do not depend on SP or interleaving: a checkpoint of an
    interleaved SP plan continues exactly under a non-interleaved plan with other SP layers and
    a zero1 layer (resharded, compared with the uninterrupted one-process run)."""
    from test_checkpoint import SPLIT, STEPS, _phase
    from test_checkpoint import assert_matches_reference as assert_resumed_matches

    _phase(4, SP_PLANS["sp-interleaved"], 0, SPLIT, save_dir=tmp_path)
    resumed = _phase(4, SP_PLANS["sp-pp2-boundary"], SPLIT, STEPS, load_dir=tmp_path)
    assert_resumed_matches(resumed, "sp interleaved -> sp pp2 with zero1")


@pytest.mark.multirank
def test_bert_with_sp_layers_matches_one_process():
    """BERT (padding mask, token types, both heads) with SP next to a non-SP layer: forward
    loss and every gradient equal the one-process stage's (test_bert_model's check)."""
    from megatron_auto.plan import LayerStrategy
    from test_bert_model import CONFIG as BERT_CONFIG
    from test_bert_model import _reference, _worker
    from test_gpt_model import check_against_reference
    from test_gpt_model import plan_of as stage_plan_of

    base = stage_plan_of(2, [(2, True, False)] * BERT_CONFIG.num_layers, vocab_tp=2)
    plan = replace(base, layers=(LayerStrategy(tp=2, sequence_parallel=True),
                                 LayerStrategy(tp=2)))
    check_against_reference(run_distributed(_worker, 2, plan, BERT_CONFIG), _reference())


@pytest.mark.multirank
def test_bf16_with_sp_zero1_and_interleaving_trains():
    """bf16 autocast through the SP linears (they cast by hand), zero1 and the interleaved
    schedule: losses finite, falling on a repeated batch, the first one the fp32 loss up to
    bf16 rounding, fp32 master parameters."""
    import math

    plan = plan_of(4, [layer(tp=2, sp=True, dp_mode="zero1"), layer(tp=2),
                       layer(tp=2, sp=True, recompute=True), layer(tp=2, sp=True)],
                   layers_per_stage=(1, 1, 1, 1), virtual_size=2, num_microbatches=2,
                   vocab_tp=2, vocab_dp_mode="zero1")
    (trained,) = run_plans(gpt_recipe(precision={"bf16": True}, lr=1e-2, same_batch=True), 4,
                           [plan], steps=6)
    losses = trained.losses
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses
    assert losses[0] == pytest.approx(GPT.reference().losses[0], rel=2e-2)
    assert all(v.dtype == torch.float32 for v in trained.state.values())
