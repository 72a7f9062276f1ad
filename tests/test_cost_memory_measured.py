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
below the second iteration's peak (4.51 MB against 4.67 MB).
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


def _peaks(rank, world_size, plan_dict):
    import pretrain_gpt
    from megatron_auto import data
    from megatron_auto.parallel.memory import PeakMemoryMeter
    from megatron_auto.training.data import collate
    from megatron_auto.training.trainer import build_trainer, train_step

    plan = Plan.from_dict(plan_dict)
    trainer = build_trainer(GPT, plan, pretrain_gpt.model_provider)
    meter = PeakMemoryMeter("cpu", trainer.stage, trainer.optimizer)
    dataset = data.MockGPTDataset(GPT.vocab_size, GPT.seq_length, GLOBAL_BATCH * ITERATIONS, 1)
    peaks = []
    for it in range(ITERATIONS):
        batch = collate([dataset[i] for i in range(it * GLOBAL_BATCH, (it + 1) * GLOBAL_BATCH)])
        with meter:
            train_step(trainer, batch)
        peaks.append(meter.peak_bytes)
    return peaks


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    from megatron_auto.profiler.model_profiler import get_or_create_model_profile

    return get_or_create_model_profile(GPT, "fp32", torch.device("cpu"),
                                       cache_dir=str(tmp_path_factory.mktemp("profile")))


@pytest.mark.parametrize("vocab_dp_mode", ["zero1", "ddp"])
def test_estimate_bounds_the_measured_peak_of_recomputing_ddp_layers(profile, vocab_dp_mode):
    from megatron_auto.planner.cost_model import evaluate_plan
    from megatron_auto.planner.model_spec import ModelSpec, TrainingSpec

    plan = Plan.uniform(2, GPT.num_layers, global_batch_size=GLOBAL_BATCH, num_microbatches=2,
                        recompute=True, vocab_dp_mode=vocab_dp_mode)
    cluster = FakeCluster(devices_per_node=2, memory_reserve_bytes=0,
                          device_memory_bytes=10 ** 12)
    estimate = evaluate_plan(plan, ModelSpec.from_model_config(GPT),
                             TrainingSpec(global_batch_size=GLOBAL_BATCH, precision="fp32"),
                             cluster, profile).peak_memory_bytes
    measured = run_distributed(_peaks, 2, plan.to_dict())
    for peaks in measured:
        # the second iteration is the steady state: optimizer states exist through backward
        assert max(peaks) == peaks[1] == peaks[2], peaks
        assert max(peaks) <= estimate <= (1 + OVER_TOLERANCE) * max(peaks), (peaks, estimate)
