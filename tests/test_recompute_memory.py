"""Module recompute's memory, measured on CPU against the cost model (cost/recompute.py).

A tiny GPT whose attention scores dominate what a layer keeps (s = 128, h = 32, 8 heads, a
narrow MLP; dropout on, as the cost model assumes) trains three iterations under the runtime's
meter (parallel/memory.py) with every layer at none, selective, an MLP-only module list and full
recompute. The measured peaks must order none > selective > full (selective releases the score
matrices, full keeps only layer inputs) and none > mlp > full, and the estimate of each plan
(a measured profile, no context reserve) must lie within 10% of its peak and never more than 5%
under it.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from megatron_auto.config import ModelConfig
from megatron_auto.plan import Plan
from planner_fakes import FakeCluster

pytestmark = pytest.mark.multirank

GPT = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=8, ffn_hidden_size=64,
                  seq_length=128, max_position_embeddings=128, vocab_size=256,
                  hidden_dropout=0.1, attention_dropout=0.1)
GLOBAL_BATCH = 4
ITERATIONS = 3
VALUES = {"none": False, "selective": "selective", "mlp": ["mlp"], "full": True}


class CpuCluster(FakeCluster):
    device_name = "cpu"  # dropout keeps a mask of the input's dtype (profiles.dropout_mask_bytes)


def _plan(value) -> Plan:
    return Plan.uniform(1, GPT.num_layers, global_batch_size=GLOBAL_BATCH, num_microbatches=2,
                        recompute=[value] * GPT.num_layers)


def _estimate(plan: Plan, profile) -> float:
    from megatron_auto.families.registry import model_spec
    from megatron_auto.planner.cost.estimate import evaluate_plan
    from megatron_auto.planner.inputs.model_spec import TrainingSpec

    cluster = CpuCluster(devices_per_node=1, memory_reserve_bytes=0,
                         device_memory_bytes=10 ** 12)
    estimate = evaluate_plan(plan, model_spec(GPT), TrainingSpec(
        global_batch_size=GLOBAL_BATCH, precision="fp32"), cluster, profile)
    return estimate.stages[0].peak_memory_bytes


def _peaks(rank, world_size, plan_dicts):
    import pretrain_gpt
    from megatron_auto import data
    from megatron_auto.parallel.memory import PeakMemoryMeter
    from megatron_auto.training.data import collate
    from megatron_auto.training.trainer import build_trainer, train_step

    out = []
    for plan_dict in plan_dicts:
        plan = Plan.from_dict(plan_dict)
        trainer = build_trainer(GPT, plan, pretrain_gpt.model_provider)
        meter = PeakMemoryMeter("cpu", trainer.stage, trainer.optimizer)
        dataset = data.MockGPTDataset(GPT.vocab_size, GPT.seq_length,
                                      GLOBAL_BATCH * ITERATIONS, 1)
        peaks = []
        for it in range(ITERATIONS):
            batch = collate([dataset[i] for i in range(it * GLOBAL_BATCH,
                                                       (it + 1) * GLOBAL_BATCH)])
            with meter:
                train_step(trainer, batch)
            peaks.append(meter.peak_bytes)
        out.append(max(peaks))
    return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from megatron_auto.profiler.lookup import get_or_create_model_profile

    profile = get_or_create_model_profile(GPT, "fp32", torch.device("cpu"),
                                          cache_dir=str(tmp_path_factory.mktemp("profile")))
    plans = {name: _plan(value) for name, value in VALUES.items()}
    peaks = run_distributed(_peaks, 1, [p.to_dict() for p in plans.values()])[0]
    return {name: (peak, _estimate(plans[name], profile))
            for name, peak in zip(plans, peaks)}


def test_selective_and_mlp_peaks_lie_between_none_and_full(measured):
    peak = {name: m[0] for name, m in measured.items()}
    assert peak["none"] > peak["selective"] > peak["full"], peak
    assert peak["none"] > peak["mlp"] > peak["full"], peak


@pytest.mark.parametrize("name", list(VALUES))
def test_estimate_of_each_granularity_is_within_ten_percent(measured, name):
    peak, estimate = measured[name]
    print(f"{name}: measured {peak / 2**20:.3f} MiB, estimate {estimate / 2**20:.3f} MiB "
          f"({estimate / peak - 1:+.1%})")
    assert 0.95 * peak <= estimate <= 1.10 * peak, (name, peak, estimate)
