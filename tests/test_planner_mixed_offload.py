"""Per-stage optimizer offload fractions in the exact search (search/mixed_offload.py), proven by
enumeration.

A three-stage pipeline of a four-layer GPT with long sequences and a small width (activations
dominate), one device per stage: under 1F1B stage 0 holds three micro-batches, the last one,
so the device budget binds on stage 0 while the last stage, with two layers, owns the most
optimizer state. Every plan of the space is written out here apart from the search's code
(partition, micro-batch count, and each stage's ``pipeline.optimizer_offload_fraction`` among
0, 1/2 and 1: 27 combinations) and priced by ``evaluate``. At several host and device budgets
the search must return the enumerated optimum, and at some the optimum offloads stage 0 alone
and is strictly faster than every plan with one fraction for all stages (or no such plan fits),
so a search with uniform fractions only fails here (checked by turning the mixed tasks off).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.plan_optimizer_offload import fraction_problem
from megatron_auto.planner import SearchOptions
from megatron_auto.planner import InfeasibleError, evaluate, search
from megatron_auto.planner.search import task_list
from megatron_auto.planner.search.driver import spaces_of
from megatron_auto.planner.search.mixed_offload import MixedOffloadTask
from megatron_auto.planner.search.least_memory import cheap_least_peak, task_least_peak
from megatron_auto.planner.search.search_cache import SearchCache
from planner_enumerate import compositions
from planner_fakes import tiny_gpt

pytestmark = pytest.mark.pure

WORLD, BATCH, LAYERS, SEQ, PP = 3, 3, 4, 256, 3
FRACTIONS = (0.0, 0.5, 1.0)
HOST_SHARES = (1.0, 0.6, 0.3)
FACTORS = (1.0, 1.02, 1.05, 1.1, 1.5)


def _instance():
    return tiny_gpt(WORLD, LAYERS, BATCH, hidden=64, ffn=256, seq=SEQ, vocab=128)


@pytest.fixture(scope="module")
def priced():
    out = []
    for m in (1, BATCH):
        out += _priced_plans(*_instance(), m)
    assert len(out) == 2 * 3 * len(FRACTIONS) ** PP
    return out


def _priced_plans(spec, training, cluster, profile, m: int) -> list[tuple]:
    """(time, peak, host bytes, fractions) of every plan with ``m`` micro-batches."""
    out = []
    for part in compositions(LAYERS, PP):
        for fractions in itertools.product(FRACTIONS, repeat=PP):
            plan = Plan(world_size=WORLD, global_batch_size=BATCH, num_microbatches=m,
                        pipeline=PipelineSpec(size=PP, schedule="1f1b",
                                              layers_per_stage=part,
                                              optimizer_offload_fraction=fractions),
                        vocab=VocabStrategy(tp=1, dp_mode="ddp"),
                        layers=(LayerStrategy(tp=1, dp_mode="ddp"),) * LAYERS,
                        model=spec.plan_model_record())
            e = evaluate(plan, spec, training, cluster, profile)
            out.append((e.iteration_time_s, e.peak_memory_bytes, e.host_memory_bytes,
                        fractions))
    return out


def _options(host: float) -> SearchOptions:
    return SearchOptions(show_progress=False, optimality_gap=0.0, dp_modes=("ddp",),
                         allow_recompute=False, activation_offload=False, pp=PP,
                         virtual_sizes=(1,), host_memory_budget_bytes=host,
                         include_baselines=False, report_partitions=False)


def _cases(priced):
    most = max(h for _, _, h, _ in priced)
    for share in HOST_SHARES:
        host = share * most
        least = min(p for _, p, h, _ in priced if h <= host)
        for factor in FACTORS:
            yield host, int(math.ceil(least * factor))


def _fractions(plan: Plan) -> tuple[float, ...]:
    value = plan.pipeline.optimizer_offload_fraction
    return tuple(value) if isinstance(value, tuple) else (value,) * plan.pp_size


def test_per_stage_fractions_return_the_enumerated_optimum(priced):
    spec, training, cluster, profile = _instance()
    mixed_wins = 0
    for host, budget in _cases(priced):
        fits = [(t, f) for t, p, h, f in priced if p <= budget and h <= host]
        best_time, _ = min(fits)
        uniform = [t for t, f in fits if len(set(f)) == 1]
        result = search(spec, training, cluster, profile, budget, _options(host))
        assert result.plan.search["proven_optimal"]
        assert fraction_problem(result.plan) is None
        assert result.estimate.peak_memory_bytes <= budget
        assert result.estimate.host_memory_bytes <= host
        assert result.estimate.iteration_time_s == pytest.approx(best_time, rel=1e-9), \
            (host, budget)
        chosen = _fractions(result.plan)
        if not uniform or min(uniform) > best_time * (1 + 1e-6):
            # only a mix reaches the optimum: the answer's stages differ
            assert len(set(chosen)) > 1, chosen
            mixed_wins += 1
    assert mixed_wins >= 3  # the instance exercises the dimension


def test_without_the_mixed_tasks_the_search_misses_those_optima(priced):
    """The enumeration above can fail: with uniform fractions alone (``per_stage_offload``
    off) the search answers slower, or finds nothing, wherever only a mix reaches the optimum."""
    spec, training, cluster, profile = _instance()
    worse = 0
    for host, budget in _cases(priced):
        best_time = min(t for t, p, h, _ in priced if p <= budget and h <= host)
        options = dataclasses.replace(_options(host), per_stage_offload=False)
        try:
            result = search(spec, training, cluster, profile, budget, options)
        except InfeasibleError:  # no plan with one fraction for every stage fits
            worse += 1
            continue
        worse += result.estimate.iteration_time_s > best_time * (1 + 1e-6)
    assert worse >= 3


def test_the_mixed_task_keeps_offload_off_the_ends_a_vocabulary_cannot_offload():
    """A zero3 vocabulary (FSDP2 shards the host optimizer does not step): only the middle
    stage of a three-stage task may offload; every stage of a ddp vocabulary may."""
    spec, training, cluster, profile = tiny_gpt(6, LAYERS, 6, hidden=64, ffn=256, seq=SEQ,
                                                vocab=128)
    options = dataclasses.replace(_options(1e9), dp_modes=("ddp", "zero3"))
    tasks = task_list.build_tasks(spaces_of("full", options, 6)[0], spec, training, cluster,
                                  profile, 1e9, options, 6, 10 ** 6,
                                  SearchCache(profile, cluster))
    mixed = [t for t in tasks if isinstance(t, MixedOffloadTask)]
    by_mode = {t.vocab.dp_mode: t.allowed for t in mixed if t.vocab.tp == 1}
    assert by_mode["zero3"] == [[0], [0, 1, 2], [0]]
    assert by_mode["ddp"] == [[0, 1, 2]] * 3
    for t in mixed:
        assert t.fractions == [0.0, 0.5, 1.0]
        assert t.field([0, 2, 0]) == (0.0, 1.0, 0.0) and t.field([1, 1, 1]) == 0.5


def test_a_mixed_task_s_least_peak_bounds_its_plans_and_its_variants(priced):
    """``least_memory.task_least_peak`` of a mixed task takes each stage's least over its
    variants: at most every variant's own least peak and every enumerated plan's peak (same
    micro-batch count), and reached by a valid plan ``evaluate`` prices at or above it."""
    spec, training, cluster, profile = _instance()
    options = _options(1e12)
    tasks = task_list.build_tasks(spaces_of("full", options, WORLD)[0], spec, training,
                                  cluster, profile, 1e9, options, WORLD, 10 ** 5,
                                  SearchCache(profile, cluster))
    mixed = [t for t in tasks if isinstance(t, MixedOffloadTask)]
    assert {t.m for t in mixed} == {1, BATCH}
    for task in mixed:
        least = task_least_peak(task)
        assert least.bytes <= min(task_least_peak(v).bytes for v in task.variants)
        rows = _priced_plans(spec, training, cluster, profile, task.m)
        assert least.bytes <= min(p for _, p, _, _ in rows) * (1 + 1e-9)
        assert least.plan is not None and fraction_problem(least.plan) is None
        peak = evaluate(least.plan, spec, training, cluster, profile).peak_memory_bytes
        assert peak >= least.bytes * (1 - 1e-9)
        assert cheap_least_peak(task) <= least.bytes * (1 + 1e-9)
