"""The memory model against the runtime's measured peak, on tiny plans (docs/cost_model.md §3).

A measured profile of a tiny GPT prices each plan (``evaluate_plan`` with no context reserve,
the CPU meter has none); the plan then trains three iterations on gloo ranks under the
runtime's meter (``parallel/memory.py``, the one ``metrics`` reports). The estimate must not be
below any iteration's peak (an under-estimate is an out-of-memory risk) and not far above the
steady-state one (a model that wastes the budget picks worse plans).

The plans are the one ``test_auto_e2e``'s tight budget chose: ``ddp`` layers with recompute, the
tied vocabulary on one stage in ``zero1`` or ``ddp``. Without pricing the weight gradient a
backward makes before adding it into ``.grad`` (the profile's scratch intercept) and the tied
head's gradient that autograd holds until the embedding's backward, the estimate was 3.5 %
below the second iteration's peak (4.51 MB against 4.67 MB). And an interleaved plan, whose
stages kept every p2p send of the iteration until its end (now released once received).
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from megatron_auto.config import ModelConfig
from megatron_auto.plan import Plan
from planner_fakes import FakeCluster

pytestmark = pytest.mark.multirank

GPT = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                  max_position_embeddings=32, vocab_size=512, hidden_dropout=0.0,
                  attention_dropout=0.0)
GLOBAL_BATCH = 16
ITERATIONS = 3
# The estimate may exceed the steady-state peak by this much (seen when written: +0.9 %, the
# model counting the first layer's input twice, once as the embedding's output).
OVER_TOLERANCE = 0.05


def _plan_estimate(plan: Plan, profile) -> tuple[float, ...]:
    """Per-stage peaks of ``plan`` by the cost model, without a context reserve."""
    from megatron_auto.planner.cost.estimate import evaluate_plan
    from megatron_auto.planner.inputs.model_spec import TrainingSpec
    from megatron_auto.families.registry import model_spec

    cluster = FakeCluster(devices_per_node=plan.world_size, memory_reserve_bytes=0,
                          device_memory_bytes=10 ** 12)
    estimate = evaluate_plan(plan, model_spec(GPT),
                             TrainingSpec(global_batch_size=plan.global_batch_size,
                                          precision="fp32"), cluster, profile)
    return tuple(s.peak_memory_bytes for s in estimate.stages)


def metered_steps(plan_dict):
    """This rank's meter peak of each of ``ITERATIONS`` steps of ``GPT`` under the plan, with
    the trainer and the meter (for callers that read more of them)."""
    import pretrain_gpt
    from megatron_auto import data
    from megatron_auto.parallel.memory import PeakMemoryMeter
    from megatron_auto.training.data import collate
    from megatron_auto.training.trainer import build_trainer, train_step

    plan = Plan.from_dict(plan_dict)
    trainer = build_trainer(GPT, plan, pretrain_gpt.model_provider)
    meter = PeakMemoryMeter("cpu", trainer.stage, trainer.optimizer)
    n = plan.global_batch_size
    dataset = data.MockGPTDataset(GPT.vocab_size, GPT.seq_length, n * ITERATIONS, 1)
    peaks = []
    for it in range(ITERATIONS):
        batch = collate([dataset[i] for i in range(it * n, (it + 1) * n)])
        with meter:
            train_step(trainer, batch)
        peaks.append(meter.peak_bytes)
    return peaks, trainer, meter


def _peaks(rank, world_size, plan_dict):
    return metered_steps(plan_dict)[0]


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    from megatron_auto.profiler.lookup import get_or_create_model_profile

    return get_or_create_model_profile(GPT, "fp32", torch.device("cpu"),
                                       cache_dir=str(tmp_path_factory.mktemp("profile")))


@pytest.mark.parametrize("vocab_dp_mode", ["zero1", "ddp"])
def test_estimate_bounds_the_measured_peak_of_recomputing_ddp_layers(profile, vocab_dp_mode):
    plan = Plan.uniform(2, GPT.num_layers, global_batch_size=GLOBAL_BATCH, num_microbatches=2,
                        recompute=True, vocab_dp_mode=vocab_dp_mode)
    (estimate,) = _plan_estimate(plan, profile)
    measured = run_distributed(_peaks, 2, plan.to_dict())
    for peaks in measured:
        # the second iteration is the steady state: optimizer states exist through backward
        assert max(peaks) == peaks[1] == peaks[2], peaks
        assert max(peaks) <= estimate <= (1 + OVER_TOLERANCE) * max(peaks), (peaks, estimate)


def test_estimate_bounds_the_measured_peak_of_recomputing_zero2_layers(profile):
    # FSDP2 reduce-scatters a checkpointed layer's gradient only at the end of the backward
    # pass: one unsharded copy per layer pending (two were priced: +8.9% in
    # benchmarks/validate_cost_model.py's zero2-recompute).
    plan = Plan.uniform(2, GPT.num_layers, global_batch_size=GLOBAL_BATCH, num_microbatches=2,
                        recompute=True, dp_mode="zero2", vocab_dp_mode="ddp")
    (estimate,) = _plan_estimate(plan, profile)
    measured = run_distributed(_peaks, 2, plan.to_dict())
    for peaks in measured:
        assert max(peaks) <= estimate <= (1 + OVER_TOLERANCE) * max(peaks), (peaks, estimate)


# Interleaved stages also hold one or two gradient sends the peer is not yet known to have
# received, and the global batch's tokens, which the model does not count (docs/cost_model.md
# §3; it counts each chunk's received input): the estimate may be below the peak by this much (seen when written: -2.0 % on the last stage, -0.9 % on the first).
INTERLEAVED_UNDER_TOLERANCE = 0.05


def test_interleaved_stage_peak_does_not_grow_with_the_micro_batches(profile):
    # pp 2, v 2, micro-batches of 4 samples: 4 or 8 of them hold the same in-flight mix, so
    # about the same peak: the larger global batch's tokens and, depending on where the peak
    # falls, one more gradient send not yet known received, under two hidden states in all
    # (seen: +46 KiB and +18 KiB). The runtime used to keep every sent output and gradient
    # alive until the end of the iteration (the p2p send buffers), which grew with the
    # micro-batches (seen: +398 KiB and +402 KiB).
    hidden = 4 * 4 * GPT.seq_length * GPT.hidden_size  # one micro-batch's fp32 hidden state
    peaks = {}
    for m in (4, 8):
        plan = Plan.uniform(2, GPT.num_layers, global_batch_size=4 * m, num_microbatches=m,
                            pp=2, virtual_size=2)
        estimate = _plan_estimate(plan, profile)
        peaks[m] = [max(p) for p in run_distributed(_peaks, 2, plan.to_dict())]
        for stage, (peak, est) in enumerate(zip(peaks[m], estimate)):
            assert peak <= (1 + INTERLEAVED_UNDER_TOLERANCE) * est, (m, stage, peak, est)
            assert est <= (1 + OVER_TOLERANCE) * peak, (m, stage, peak, est)
    for stage in range(2):
        assert peaks[8][stage] - peaks[4][stage] < 2 * hidden, (stage, peaks)
