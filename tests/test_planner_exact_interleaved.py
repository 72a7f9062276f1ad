"""The exact search's interleaved tasks (``virtual_size`` v > 1): the facts its bounds and
memory cuts rest on (``tasks`` and ``infeasible.interleaved_least_peak`` docstrings), checked on
the schedule and against every plan of small tasks priced with ``evaluate``."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from megatron_auto.plan import PipelineSpec, Plan, VocabStrategy
from megatron_auto.planner import ModelSpec, TrainingSpec, analytic_profile, evaluate
from megatron_auto.planner.search.infeasible import interleaved_least_peak
from megatron_auto.planner.cost.interleaving import (chunk_in_flight, in_flight_vectors,
                                                     peak_activations)
from megatron_auto.planner.search.least_memory import cheap_least_peak
from megatron_auto.planner.inputs.presets import make_cluster
from megatron_auto.planner.search.spaces import SpaceRules
from megatron_auto.planner.search.tasks import Task

from planner_enumerate import compositions, layer_choices

pytestmark = pytest.mark.pure

SCHEDULES = [(pp, v, m) for pp in (2, 3, 4, 8) for v in (2, 3, 4) for m in (pp, 2 * pp, 5 * pp)]


@pytest.mark.parametrize("pp,v,m", SCHEDULES)
def test_each_local_chunk_holds_at_least_the_plain_count_at_one_moment(pp, v, m):
    # infeasible.interleaved_least_peak: some moment of stage k's order holds >= pp - k micro-batches of
    # every local chunk (the count a plain 1F1B stage k holds), since m >= pp.
    for k in range(pp):
        need = min(pp - k, m)
        assert any(all(n >= need for n in vec) for vec in in_flight_vectors(pp, v, m, k))


@pytest.mark.parametrize("pp,v,m", SCHEDULES)
def test_chunk_in_flight_prices_at_most_the_peak_mix(pp, v, m):
    rng = random.Random(pp * 1000 + v * 100 + m)
    counts = chunk_in_flight(pp, v, m)
    for k in range(pp):
        assert tuple(counts[j * pp + k] for j in range(v)) in in_flight_vectors(pp, v, m, k)
        for _ in range(20):
            kept = [rng.uniform(0.0, 10.0) for _ in range(v)]
            assert sum(counts[j * pp + k] * a for j, a in enumerate(kept)) \
                <= peak_activations(kept, pp, v, m, k)[0] + 1e-9


def _setup(world, layers, batch, precision="fp32"):
    spec = ModelSpec.uniform(layers, 64, 4, 32, 128, name="gpt")
    training = TrainingSpec(batch, precision)
    cluster = dataclasses.replace(make_cluster("a100-40g", 1, world), memory_reserve_bytes=10 ** 5,
                                  device_memory_bytes=10 ** 8, nccl_communicator_bytes=5e3)
    return spec, training, cluster, analytic_profile(spec, training, cluster)


@pytest.mark.parametrize("world,layers,batch,m,v", [(4, 4, 4, 2, 2), (2, 6, 4, 2, 3),
                                                    (2, 8, 8, 4, 2), (4, 5, 8, 4, 2)])
def test_task_bounds_are_below_every_plan_of_the_task(world, layers, batch, m, v):
    # The root bound (J_b with the interleaved weights over every chunk split), the cheap
    # bound and both memory bounds are at most the iteration time / peak of every plan priced
    # (every chunk split, the first 400 strategy combinations of each; recompute off and two
    # DP flavours keep it small).
    spec, training, cluster, profile = _setup(world, layers, batch)
    pp, n = 2, world // 2
    rules = SpaceRules(dp_modes=("ddp", "zero3"), allow_recompute=False,
                       sequence_parallel=(False, True))
    vocab = VocabStrategy(tp=1, dp_mode="ddp")
    task = Task(spec, profile, cluster, world, batch, pp, m, "1f1b", rules, vocab, 10 ** 9,
                10 ** 4, virtual_size=v)
    choices = layer_choices(spec, n, batch // m, 8, spec.layer_types[0], ("ddp", "zero3"),
                            (False,))
    times, peaks = [], []
    for part in compositions(layers, pp * v):
        pipe = PipelineSpec(size=pp, schedule="1f1b", layers_per_stage=part, virtual_size=v)
        for combo in itertools.islice(itertools.product(choices, repeat=layers), 400):
            plan = Plan(world_size=world, global_batch_size=batch, num_microbatches=m,
                        pipeline=pipe, vocab=vocab, layers=combo,
                        model=spec.plan_model_record())
            est = evaluate(plan, spec, training, cluster, profile)
            times.append(est.iteration_time_s)
            peaks.append(est.peak_memory_bytes)
    assert task.root_bound() <= min(times) * (1 + 1e-12)
    # the mean of the J_b over the stages (the branch b = pp) on its own
    assert task.branches[-1] == pp
    assert float(task.future(pp)[0, 0]) + task.overhead <= min(times) * (1 + 1e-12)
    assert task.cheap_bound() <= min(times) * (1 + 1e-12)
    assert task.cheap_bound(False) <= min(times) * (1 + 1e-12)
    assert cheap_least_peak(task) <= min(peaks) * (1 + 1e-12)
    assert 0 < interleaved_least_peak(task) <= min(peaks) * (1 + 1e-12)


@pytest.mark.parametrize("world,layers,batch,m,v", [(4, 4, 4, 2, 2), (2, 6, 4, 2, 3),
                                                    (2, 8, 8, 4, 2)])
def test_the_tied_bound_holds_where_memory_binds(world, layers, batch, m, v):
    # tasks.Task.tied_bound (each stage's chunks sharing its memory) against every plan of the
    # task (every chunk split and every strategy combination, recompute on and off), at budgets
    # from the least peak up: at most the fastest plan that fits, and at some budget above the
    # chunk-level bound (each chunk alone on the device), which is why the search takes it.
    spec, training, cluster, profile = _setup(world, layers, batch)
    pp, n = 2, world // 2
    rules = SpaceRules(dp_modes=("ddp", "zero3"), sequence_parallel=(False,))
    vocab = VocabStrategy(tp=1, dp_mode="ddp")
    choices = layer_choices(spec, n, batch // m, 8, spec.layer_types[0], ("ddp", "zero3"),
                            (False, True))
    priced = []
    for part in compositions(layers, pp * v):
        pipe = PipelineSpec(size=pp, schedule="1f1b", layers_per_stage=part, virtual_size=v)
        for combo in itertools.product(choices, repeat=layers):
            plan = Plan(world_size=world, global_batch_size=batch, num_microbatches=m,
                        pipeline=pipe, vocab=vocab, layers=combo,
                        model=spec.plan_model_record())
            est = evaluate(plan, spec, training, cluster, profile)
            priced.append((est.iteration_time_s, est.peak_memory_bytes))
    least = min(peak for _, peak in priced)
    stronger = 0
    for fraction in (1.0, 1.02, 1.1, 1.3, 2.0):
        budget = least * fraction
        best = min(t for t, peak in priced if peak <= budget)
        task = Task(spec, profile, cluster, world, batch, pp, m, "1f1b", rules, vocab, budget,
                    max(1, int((budget - cluster.memory_reserve_bytes) / 2048)), virtual_size=v)
        tied = task.tied_bound()
        chunked = max(float(task.future(b)[0, 0]) for b in task.branches) + task.overhead
        assert 0 < tied <= best * (1 + 1e-12), (fraction, tied, best)
        # the root adds the partition bound (partition_bound.py): stronger, still below
        assert max(tied, chunked) <= task.root_bound() <= best * (1 + 1e-12)
        stronger += tied > chunked * (1 + 1e-9)
    assert stronger > 0


def test_a_time_limited_pinned_search_keeps_its_virtual_size(monkeypatch):
    # Stopped at once (the seeds only), the pinned v = 2 answer is beaten by the plain 'pp'
    # baseline space; adopting that plan would drop the pin (baseline spaces never interleave).
    # The full space gets a vanishing share of a long limit, so the baselines have the rest and
    # finish whatever the machine's load (a 1e-9 s limit left them the clock's 10 ms slack
    # only, which a loaded CI machine used up before their first plan).
    from planner_fakes import FakeCluster, round_profile

    from megatron_auto.planner import SearchOptions, search
    from megatron_auto.planner.search import driver, lagrange_bound, partition_bound

    monkeypatch.setattr(driver, "MAIN_SHARE", 1e-12)
    # the partition bounds and the Lagrangian stage-block bound prove this small task at its
    # root, before any deadline check: off, the seeds are all the full space gets, which is the
    # case under test
    monkeypatch.setattr(partition_bound, "ENABLED", False)
    monkeypatch.setattr(lagrange_bound, "ENABLED", False)
    spec = ModelSpec.uniform(8, 64, 4, 16, 64, name="gpt")
    result = search(spec, TrainingSpec(8, "fp32"), FakeCluster(devices_per_node=2),
                    round_profile("fp32"), 10 ** 6,
                    SearchOptions(show_progress=False, memory_step_bytes=64, pp=2,
                                  virtual_sizes=(2,), time_limit_s=100.0))
    info = result.plan.search
    assert info["time_limited"] and info["adopted_from_baseline"] is None
    assert (result.plan.pp_size, result.plan.virtual_size) == (2, 2)
    assert info["baselines"]["pp"] > result.estimate.samples_per_s  # what made it matter


def test_a_pinned_interleaved_search_with_no_fitting_seed_keeps_its_time_limit(monkeypatch):
    """Without an answer a plain task's walk goes on past the deadline (its least-memory plan
    is a leaf a few nodes away); an interleaved task has no such plan, and LLaMA-7B pinned to
    pp 4, v 4 at 24 GB walked for more than 5 minutes at a 10 s limit. Here no seed fits
    (patched) and the bounds that settle this small task at its root are off, so the walk
    must run: with a long limit it finds a plan; with a limit that falls between the walk's
    first node and its first leaf, it stops there and says the limit stopped it."""
    from planner_fakes import FakeCluster, Ticks, round_profile

    from megatron_auto.planner import InfeasibleError, SearchOptions, search
    from megatron_auto.planner.search import (exact, lagrange_bound, partition_bound,
                                              search_cache)

    clock = Ticks()
    monkeypatch.setattr(search_cache, "SearchClock", lambda: clock)
    monkeypatch.setattr(exact.TaskSearch, "seed", lambda self: False)
    monkeypatch.setattr(exact.TaskSearch, "seed_interleaved", lambda self: None)
    monkeypatch.setattr(partition_bound, "ENABLED", False)
    monkeypatch.setattr(lagrange_bound, "ENABLED", False)
    nodes: list[float] = []  # clock reads at each walk node
    leaves: list[float] = []
    layer, leaf = exact.TaskSearch._layer, exact.TaskSearch._leaf
    monkeypatch.setattr(exact.TaskSearch, "_layer",
                        lambda self, *a: (nodes.append(clock.reads), layer(self, *a))[1])
    monkeypatch.setattr(exact.TaskSearch, "_leaf",
                        lambda self, *a: (leaves.append(clock.reads), leaf(self, *a))[1])
    spec = ModelSpec.uniform(8, 64, 4, 16, 64, name="gpt")

    def run(limit: float):
        clock.reads = 0
        nodes.clear()
        leaves.clear()
        return search(spec, TrainingSpec(8, "fp32"), FakeCluster(devices_per_node=2),
                      round_profile("fp32"), 10 ** 6,
                      SearchOptions(show_progress=False, memory_step_bytes=64, pp=2,
                                    virtual_sizes=(2,), time_limit_s=limit,
                                    include_baselines=False))

    found = run(1e9)
    assert (found.plan.pp_size, found.plan.virtual_size) == (2, 2)
    first_node, first_leaf = nodes[0], leaves[0]
    assert first_leaf > first_node + 4, (first_node, first_leaf)  # room for a deadline between
    limit = (first_node + first_leaf) // 2
    with pytest.raises(InfeasibleError, match=r"no plan was found in .* --time-limit"):
        run(limit)
    # the walk ran, and its deadline check stopped it (the other interleaved tasks then stop
    # at their first node): no plan priced, and done before the walk's first leaf was due
    assert nodes and not leaves
    assert clock.reads < first_leaf
