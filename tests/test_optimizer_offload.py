"""Optimizer offload (``pipeline.optimizer_offload_fraction``, parallel/optimizer_offload.py):
the plan field, equivalence with the device optimizer, checkpoints across fractions.

Equivalence runs use the equivalence tests' tiny GPT (fp32, dropout off, AdamW with clipping,
3 steps) against one process without offload, relative 1e-5 (tests/harness.py).
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from harness import layer, plan_of
from megatron_auto.plan import Plan, PlanError
from test_equivalence import CONFIG, GPT


def with_fraction(plan_dict: dict, fraction) -> dict:
    """``plan_dict`` with ``pipeline.optimizer_offload_fraction`` set (a number or a list)."""
    return dict(plan_dict, pipeline=dict(plan_dict["pipeline"], optimizer_offload_fraction=fraction))


ONE = plan_of(1, [layer()] * 4)
DDP2 = plan_of(2, [layer()] * 4)
ZERO1_2 = plan_of(2, [layer(dp_mode="zero1")] * 4, vocab_dp_mode="zero1")
PP2 = plan_of(2, [layer()] * 4, layers_per_stage=(2, 2), num_microbatches=4)

ONE_RANK = {f"one-{f}": with_fraction(ONE, f) for f in (0.5, 1.0)}
TWO_RANKS = {
    "ddp2-0.5": with_fraction(DDP2, 0.5),
    "ddp2-1.0": with_fraction(DDP2, 1.0),
    "zero1-0.5": with_fraction(ZERO1_2, 0.5),
    "zero1-1.0": with_fraction(ZERO1_2, 1.0),
    "pp2-per-stage": with_fraction(PP2, [1.0, 0.5]),
}


# ------------------------------------------------------------------------------ plan field
@pytest.mark.single
def test_fraction_round_trips_and_zero_is_omitted():
    assert "optimizer_offload_fraction" not in Plan.from_dict(ONE).to_dict()["pipeline"]
    assert Plan.from_dict(with_fraction(ONE, 0)).to_dict() == Plan.from_dict(ONE).to_dict()
    half = Plan.from_dict(with_fraction(ONE, 0.5))
    assert half.pipeline.optimizer_offload_fraction == 0.5
    assert Plan.from_dict(half.to_dict()) == half
    per_stage = Plan.from_dict(with_fraction(PP2, [1, 0]))
    assert per_stage.to_dict()["pipeline"]["optimizer_offload_fraction"] == [1.0, 0.0]
    assert Plan.from_dict(with_fraction(PP2, [0, 0])).to_dict() == Plan.from_dict(PP2).to_dict()


@pytest.mark.single
@pytest.mark.parametrize("plan, message", [
    (with_fraction(ONE, 1.5), r"pipeline.optimizer_offload_fraction=1.5: must be a number in \[0, 1\]"),
    (with_fraction(ONE, True), r"optimizer_offload_fraction=True: must be a number"),
    (with_fraction(ONE, "half"), r"optimizer_offload_fraction='half': must be a number"),
    (with_fraction(PP2, [1.0]), r"lists 1 stage\(s\) but pipeline.size=2"),
    (with_fraction(PP2, [1.0, -0.1]), r"every entry must be a number in \[0, 1\]"),
    (with_fraction(plan_of(2, [layer(dp_mode="zero3")] * 4), 1.0),
     r"stage 0 offloads its optimizer but layers\[0\].dp_mode='zero3'"),
    (with_fraction(plan_of(2, [layer()] * 4, vocab_dp_mode="zero2"), 0.5),
     r"vocab.dp_mode='zero2'; use ddp/zero1"),
])
def test_bad_fraction_is_one_clear_error(plan, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(plan)


@pytest.mark.single
def test_a_zero3_stage_that_does_not_offload_is_fine():
    plan = with_fraction(plan_of(2, [layer(), layer(), layer(dp_mode="zero3"), layer()],
                                 layers_per_stage=(2, 2), num_microbatches=4), [1.0, 0.0])
    assert Plan.from_dict(plan).pipeline.optimizer_offload_fraction == (1.0, 0.0)


@pytest.mark.single
def test_split_is_by_bytes_in_parameter_order():
    from megatron_auto.parallel.optimizer_offload import offloaded_mask

    params = [torch.zeros(10), torch.zeros(30), torch.zeros(20, dtype=torch.float64), torch.zeros(40)]
    # bytes 40, 120, 160, 160 (total 480): starts at 0, 40, 160, 320
    assert offloaded_mask(params, 0.0) == [False] * 4
    assert offloaded_mask(params, 0.25) == [True, True, False, False]  # limit 120
    assert offloaded_mask(params, 0.5) == [True, True, True, False]  # limit 240
    assert offloaded_mask(params, 1.0) == [True] * 4


# ----------------------------------------------------------------------------- equivalence
@pytest.mark.multirank
@pytest.mark.parametrize("name", list(ONE_RANK))
def test_offloaded_optimizer_matches_one_process_one_rank(name):
    GPT.check_named(1, ONE_RANK, name)


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_offloaded_optimizer_matches_one_process_two_ranks(name):
    GPT.check_named(2, TWO_RANKS, name)


def _offload_worker(rank, world_size, plan_dict):
    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.parallel.optimizer_offload import HostOffloadAdamW
    from megatron_auto.training.pretrain import build_trainer, train_step
    from test_equivalence import make_batch

    trainer = build_trainer(CONFIG, Plan.from_dict(plan_dict),
                            lambda cfg, ctx, seed: GPTStage(cfg, ctx, seed=seed))
    train_step(trainer, make_batch(0))
    opt = trainer.optimizer
    assert isinstance(opt, HostOffloadAdamW)
    owned = sum(p.numel() for g in opt.param_groups for p in g["params"])
    host_states = [v for s in opt.state.values() for v in s.values()
                   if v.dim() > 0 and v.device.type == "cpu"]
    device_inner = opt.device_optimizer.state if opt.device_optimizer else {}
    return {"owned": owned, "offloaded": opt.offloaded_elements,
            "host_state": sum(v.numel() for v in host_states),
            "device_state": sum(v.numel() for s in device_inner.values() for v in s.values()
                                if v.dim() > 0),
            "bytes": opt.transfer_bytes(), "host_bytes": opt.host_bytes()}


@pytest.mark.multirank
def test_offloaded_share_holds_its_state_on_the_host():
    """On CPU "host" and "device" are the same memory, so this checks the bookkeeping: the
    offloaded elements' moments are the host optimizer's, the rest the device optimizer's."""
    half, full = (run_distributed(_offload_worker, 2, with_fraction(ZERO1_2, f)) for f in (0.5, 1.0))
    for h, f in zip(half, full):
        assert f["offloaded"] == f["owned"] and f["device_state"] == 0
        assert 0.4 * h["owned"] <= h["offloaded"] <= 0.75 * h["owned"], h
        assert h["device_state"] == 2 * (h["owned"] - h["offloaded"])
        assert h["bytes"] == {"device_to_host": 4 * h["offloaded"], "host_to_device": 4 * h["offloaded"]}
        assert h["host_bytes"] == 16 * h["offloaded"]  # master, grad buffer, two moments (fp32)


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.multirank
@pytest.mark.parametrize("save, load", [
    ((2, with_fraction(ZERO1_2, 1.0)), (1, ONE)),
    ((1, ONE), (2, with_fraction(DDP2, 0.5))),
    ((1, with_fraction(ONE, 0.5)), (1, with_fraction(ONE, 1.0))),
], ids=["zero1-offload->one", "one->ddp-half", "half->full"])
def test_checkpoint_continues_exactly_across_fractions(tmp_path, save, load):
    from test_checkpoint import SPLIT, STEPS, _phase, assert_matches_reference

    _phase(*save, 0, SPLIT, save_dir=tmp_path)
    assert_matches_reference(_phase(*load, SPLIT, STEPS, load_dir=tmp_path),
                             f"optimizer offload {save[1]['pipeline']} -> {load[1]['pipeline']}")


# ---------------------------------------------------------------------------------- flags
@pytest.mark.single
def test_megatron_flags_build_the_field_and_export_writes_them():
    import argparse

    from megatron_auto.config import ArgumentError
    from megatron_auto.plan_flags import add_parallelism_args, optimizer_offload_from_args
    from megatron_auto.plan_source import plan_from_classic_flags
    from megatron_auto.planner.interop.megatron_flags import to_megatron_flags

    parser = add_parallelism_args(argparse.ArgumentParser())
    assert optimizer_offload_from_args(parser.parse_args([])) == 0.0
    assert optimizer_offload_from_args(parser.parse_args(["--optimizer-cpu-offload"])) == 1.0
    args = parser.parse_args(["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"])
    assert optimizer_offload_from_args(args) == 0.5
    with pytest.raises(ArgumentError, match=r"--optimizer-offload-fraction=0.5: needs --optimizer-cpu-offload"):
        optimizer_offload_from_args(parser.parse_args(["--optimizer-offload-fraction", "0.5"]))
    with pytest.raises(ArgumentError, match=r"--optimizer-offload-fraction=2.0: must be in \[0, 1\]"):
        optimizer_offload_from_args(parser.parse_args(
            ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "2"]))
    from megatron_auto.plan_flags import classic_layout_from_args
    args.global_batch_size, args.micro_batch_size = 8, None
    plan = plan_from_classic_flags(classic_layout_from_args(args), CONFIG, 2)
    assert plan.pipeline.optimizer_offload_fraction == 0.5
    flags, reasons = to_megatron_flags(plan)
    assert not reasons and flags[-3:] == ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]


@pytest.mark.single
def test_the_flag_is_refused_where_it_would_be_ignored():
    import argparse

    from megatron_auto.config import ArgumentError
    from megatron_auto.plan_flags import add_parallelism_args, check_plan_flags, plan_source_from_args

    parser = add_parallelism_args(argparse.ArgumentParser())
    with pytest.raises(ArgumentError, match=r"--optimizer-cpu-offload=True: conflicts with --plan p.json"):
        check_plan_flags(parser.parse_args(["--plan", "p.json", "--optimizer-cpu-offload"]))
    args = parser.parse_args(["--auto-parallel", "--optimizer-cpu-offload"])
    args.global_batch_size = args.micro_batch_size = None
    with pytest.raises(ArgumentError, match=r"--auto-parallel chooses optimizer offload itself "
                                            r"when --host-memory-budget-gb gives it host memory"):
        plan_source_from_args(args)


@pytest.mark.single
def test_the_host_budget_reaches_the_auto_parallel_search():
    import argparse

    from megatron_auto.config import ArgumentError
    from megatron_auto.plan_flags import add_parallelism_args, plan_source_from_args
    from megatron_auto.planner.inputs.pins import search_options

    parser = add_parallelism_args(argparse.ArgumentParser())
    args = parser.parse_args(["--host-memory-budget-gb", "8"])
    args.global_batch_size = args.micro_batch_size = None
    with pytest.raises(ArgumentError, match=r"--host-memory-budget-gb=8.0: only --auto-parallel "
                                            r"reads it"):
        plan_source_from_args(args)
    args = parser.parse_args(["--auto-parallel", "--host-memory-budget-gb", "8"])
    args.global_batch_size = args.micro_batch_size = None
    pins = plan_source_from_args(args)
    assert search_options(pins, 2, 4).host_memory_budget_bytes == 8e9
    args = parser.parse_args(["--auto-parallel"])
    args.global_batch_size = args.micro_batch_size = None
    assert search_options(plan_source_from_args(args), 2, 4).host_memory_budget_bytes is None
    for bad in ("0", "-1", "inf"):
        args = parser.parse_args(["--auto-parallel", "--host-memory-budget-gb", bad])
        args.global_batch_size = args.micro_batch_size = None
        with pytest.raises(ArgumentError, match=r"--host-memory-budget-gb=.*: must be a positive "
                                                r"number"):
            search_options(plan_source_from_args(args), 2, 4)
