"""The uniform baseline spaces (dp, zero3, tp, pp, megatron3d) against their plans written out.

Each of these spaces holds one plan per (pp, tp, recompute, micro-batch count): every layer the
same strategy, the even split, the vocabulary at the layers' tp. The search prices such a task's
one plan instead of bounding and walking it (``task_plans.only_plan``); checked here against the
grid built by the test from the spaces' definitions (docs/planner.md §2), priced with
``evaluate``: the baseline's answer is the fastest plan of its grid that fits, at budgets from
where nothing fits to where nothing binds, searched alone and as reported next to the answer.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy, even_partition
from megatron_auto.plan_errors import PlanError
from megatron_auto.planner import (InfeasibleError, ModelSpec, SearchOptions, TrainingSpec,
                                   analytic_profile, evaluate, search)
from megatron_auto.planner.inputs.presets import make_cluster

pytestmark = pytest.mark.pure

WORLD, LAYERS, BATCH = 4, 4, 8
SPEC = ModelSpec.uniform(LAYERS, 64, 4, 32, 128, name="gpt")
TRAINING = TrainingSpec(BATCH, "bf16")
CLUSTER = dataclasses.replace(make_cluster("a100-40g", 1, WORLD), memory_reserve_bytes=10 ** 5,
                              device_memory_bytes=10 ** 8, nccl_communicator_bytes=5e3)
QUIET = dict(show_progress=False, report_partitions=False, optimality_gap=0.0)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def grid(name: str) -> list[Plan]:
    """Every plan of the named uniform space, from its definition."""
    settings = {  # (pp, tp, dp mode, recompute) choices
        "dp": [(1, 1, "ddp", False)],
        "zero3": [(1, 1, "zero3", False)],
        "tp": [(1, WORLD, "ddp", False)],
        "pp": [(WORLD, 1, "ddp", False)],
        "megatron3d": [(pp, tp, "ddp", rc) for tp in _divisors(WORLD) for pp in _divisors(WORLD)
                       if WORLD % (tp * pp) == 0 and pp <= LAYERS for rc in (False, True)],
    }[name]
    out = []
    for pp, tp, mode, recompute in settings:
        dp = WORLD // (pp * tp)
        for m in _divisors(BATCH):
            layer = LayerStrategy(tp=tp, dp_mode=mode if dp > 1 else "ddp", recompute=recompute)
            vocab = VocabStrategy(tp=tp, dp_mode=mode if dp > 1 else "ddp")
            try:
                out.append(Plan(world_size=WORLD, global_batch_size=BATCH, num_microbatches=m,
                                pipeline=PipelineSpec(size=pp, schedule="1f1b",
                                                      layers_per_stage=even_partition(LAYERS, pp)),
                                vocab=vocab, layers=(layer,) * LAYERS,
                                model=SPEC.plan_model_record()))
            except PlanError:
                continue  # e.g. dp replicas that do not divide the micro-batch
    return out


PROFILE = analytic_profile(SPEC, TRAINING, CLUSTER)
PRICED = {name: [evaluate(p, SPEC, TRAINING, CLUSTER, PROFILE) for p in grid(name)]
          for name in ("dp", "zero3", "tp", "pp", "megatron3d")}


@pytest.mark.parametrize("name", sorted(PRICED))
def test_a_uniform_baseline_is_the_best_plan_of_its_grid(name):
    priced = PRICED[name]
    assert len(priced) >= 2  # several micro-batch counts at least
    least = min(e.peak_memory_bytes for e in priced)
    for fraction in (0.99, 1.0, 1.2, 2.0, 10.0):
        budget = int(math.ceil(least * fraction))
        fits = [e.iteration_time_s for e in priced if e.peak_memory_bytes <= budget]
        options = SearchOptions(space=name, include_baselines=False, **QUIET)
        if not fits:
            with pytest.raises(InfeasibleError):
                search(SPEC, TRAINING, CLUSTER, PROFILE, budget, options)
            continue
        alone = search(SPEC, TRAINING, CLUSTER, PROFILE, budget, options)
        assert alone.estimate.iteration_time_s == pytest.approx(min(fits), rel=1e-9), fraction
        assert alone.plan.search["proven_optimal"] is True
        reported = search(SPEC, TRAINING, CLUSTER, PROFILE, budget,
                          SearchOptions(**QUIET)).plan.search["baselines"][name]
        assert reported == pytest.approx(BATCH / min(fits), rel=1e-9), fraction
