"""The MoE memory model (planner/cost/moe.py) against the runtime's measured peak.

An MoE GPT (every layer MoE, 8 experts, top-2, no shared experts) trains three iterations on
4 gloo ranks under the runtime's memory meter (``parallel/memory.py``, what ``metrics``
reports), with ep 1 and with ep 2 (ddp experts), and with ep 2 and the experts in zero1, zero2
and zero3 over their expert-DP group of 2 ranks. The
analytic profile on a CPU cluster prices each plan (``evaluate_plan`` without a context
reserve, the CPU meter has none). The estimate must bound every iteration's peak from above
(up to :data:`UNDER_TOLERANCE`) and stay within :data:`OVER_TOLERANCE` of the steady-state one; and the measured peak must fall
from ep 1 to ep 2 by about what the estimate says (the experts' states are most of the model).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dist_utils import run_distributed
from megatron_auto.config import ModelConfig
from megatron_auto.families.gpt.config import MoEConfig
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from planner_fakes import FakeCluster

pytestmark = pytest.mark.multirank

CONFIG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                     seq_length=32, max_position_embeddings=32, vocab_size=256,
                     hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
                     activation="swiglu",
                     moe=MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=256))
ITERATIONS = 3
# Measured when written (estimate / steady peak - 1): ep1 -0.16 % (16.79 MB against 16.81 MB),
# ep2 -0.29 % (8.92 MB against 8.95 MB). The analytic profile (this model has no measured one:
# the profiler times dense layers) misses a few small temporaries, 26 kB here, so the lower
# bound allows UNDER_TOLERANCE. The ZeRO expert plans peak after the backward pass, when the
# gradient sync's buffers meet the model states (estimate.evaluate_plan's after-backward peak):
# zero1 -0.4 % (7.14 MB against 7.17 MB: gloo's reduce-scatter copies the expert bucket),
# zero2 +4.0 % (8.71 MB against 8.38 MB), zero3 -0.9 % (7.14 MB against 7.20 MB: two FSDP2
# units' gradient buffers, cost/moe.py fsdp_sync_bytes). Before that term they were priced
# 5.8 % and 17 % under.
UNDER_TOLERANCE = 0.01
OVER_TOLERANCE = 0.05
ZERO_TOLERANCES = (0.05, 0.10)  # (under, over) for the ZeRO expert plans: the target


@dataclass(frozen=True)
class CpuCluster(FakeCluster):
    """The fake cluster as a CPU (``device_name``: dropout masks of the compute dtype)."""

    device_name: str = "cpu"


def _plan(**layer) -> Plan:
    return Plan(world_size=4, global_batch_size=8, num_microbatches=2,
                pipeline=PipelineSpec(1, "1f1b", (2,)), vocab=VocabStrategy(tp=1),
                layers=(LayerStrategy(**layer),) * 2)


PLANS = {"ep1": _plan(), "ep2": _plan(ep=2),
         **{mode: _plan(ep=2, expert_dp_mode=mode) for mode in ("zero1", "zero2", "zero3")}}


def _estimate(plan: Plan) -> float:
    from megatron_auto.families.registry import model_spec
    from megatron_auto.planner.cost.estimate import evaluate_plan
    from megatron_auto.planner.inputs.model_spec import TrainingSpec
    from megatron_auto.planner.inputs.profiles import analytic_profile

    spec = model_spec(CONFIG)
    training = TrainingSpec(global_batch_size=plan.global_batch_size, precision="fp32")
    cluster = CpuCluster(devices_per_node=4, memory_reserve_bytes=0,
                         device_memory_bytes=10 ** 12)
    estimate = evaluate_plan(plan, spec, training, cluster,
                             analytic_profile(spec, training, cluster))
    return estimate.peak_memory_bytes


def _peaks(rank: int, world_size: int, names: list[str]) -> dict[str, list[int]]:
    from megatron_auto import data
    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.parallel.memory import PeakMemoryMeter
    from megatron_auto.training.data import collate
    from megatron_auto.training.lr_scheduler import LRConfig
    from megatron_auto.training.trainer import build_trainer, train_step

    out = {}
    for name in names:
        plan = PLANS[name]
        trainer = build_trainer(CONFIG, plan, lambda cfg, ctx, seed: GPTStage(cfg, ctx,
                                                                              seed=seed),
                                lr_config=LRConfig(lr=1e-3, decay_style="constant"), seed=1234)
        meter = PeakMemoryMeter("cpu", trainer.stage, trainer.optimizer)
        n = plan.global_batch_size
        dataset = data.MockGPTDataset(CONFIG.vocab_size, CONFIG.seq_length, n * ITERATIONS, 1)
        peaks = []
        for it in range(ITERATIONS):
            batch = collate([dataset[i] for i in range(it * n, (it + 1) * n)])
            with meter:
                train_step(trainer, batch)
            peaks.append(meter.peak_bytes)
        out[name] = peaks
        del trainer, meter
    return out


def test_the_estimate_bounds_the_measured_peak_of_expert_parallel_plans():
    names = list(PLANS)
    per_rank = run_distributed(_peaks, 4, names)
    measured = {name: max(max(r[name]) for r in per_rank) for name in names}
    steady = {name: max(r[name][-1] for r in per_rank) for name in names}
    estimates = {name: _estimate(PLANS[name]) for name in names}
    report = {n: (estimates[n], measured[n], round(estimates[n] / steady[n] - 1, 4))
              for n in names}
    for name in names:
        under, over = (ZERO_TOLERANCES if name.startswith("zero")
                       else (UNDER_TOLERANCE, OVER_TOLERANCE))
        assert estimates[name] >= (1 - under) * measured[name], report
        assert estimates[name] <= (1 + over) * steady[name], report
    # ep 2 saves what the estimate says it saves (half the experts' states), within 25 %
    saved, priced = steady["ep1"] - steady["ep2"], estimates["ep1"] - estimates["ep2"]
    assert saved > 0 and abs(saved / priced - 1) <= 0.25, (saved, priced, report)
