"""The exact search's host cut (exact.py: a branch is cut once its stage's offloaded activations
pass the host budget), proven by enumeration.

Every plan of a one-device, four-layer GPT is written out here apart from the search's code
(micro-batch count, each layer's activation offload: none, all, ``core_attn`` or ``mlp``, and
``pipeline.optimizer_offload_fraction`` 0, 1/2 or 1) and priced by ``evaluate``. At host budgets
from room for everything down to room for a little, and device budgets from the least that
fits up, the search must return the enumerated optimum; and at a binding host budget the cut
must visit fewer nodes than the leaf check alone (``exact.EARLY_HOST_CUT`` off), so it fires.
Four layers: a stage's host bytes pass the budget before its last layer, where the cut acts.
"""

from __future__ import annotations

import itertools
import math

import pytest

from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.planner import SearchOptions
from megatron_auto.planner import evaluate, search
from megatron_auto.planner.search import exact
from planner_fakes import tiny_gpt

pytestmark = pytest.mark.pure

BATCH, LAYERS, SEQ = 2, 4, 16
OFFLOADS = (False, True, ("core_attn",), ("mlp",))
FRACTIONS = (0.0, 0.5, 1.0)
HOST_SHARES = (1.0, 0.3, 0.03, 0.01)
FACTORS = (1.0, 1.02, 1.05, 1.6)


def _instance():
    return tiny_gpt(1, LAYERS, BATCH, seq=SEQ)


def _price_all():
    spec, training, cluster, profile = _instance()
    out = []
    for m, fraction in itertools.product((1, 2), FRACTIONS):
        pipe = PipelineSpec(size=1, schedule="1f1b", layers_per_stage=(LAYERS,),
                            optimizer_offload_fraction=fraction)
        for offloads in itertools.product(OFFLOADS, repeat=LAYERS):
            plan = Plan(world_size=1, global_batch_size=BATCH, num_microbatches=m, pipeline=pipe,
                        vocab=VocabStrategy(tp=1, dp_mode="ddp"),
                        layers=tuple(LayerStrategy(tp=1, dp_mode="ddp", offload=o)
                                     for o in offloads),
                        model=spec.plan_model_record())
            e = evaluate(plan, spec, training, cluster, profile)
            out.append((e.iteration_time_s, e.peak_memory_bytes, e.host_memory_bytes,
                        any(s.offload for s in plan.layers)))
    assert len(out) == 2 * len(FRACTIONS) * len(OFFLOADS) ** LAYERS
    return out


@pytest.fixture(scope="module")
def priced():
    return _price_all()


def _options(host: float) -> SearchOptions:
    return SearchOptions(show_progress=False, optimality_gap=0.0, dp_modes=("ddp",),
                         allow_recompute=False, host_memory_budget_bytes=host,
                         include_baselines=False, report_partitions=False)


def test_the_search_with_the_host_cut_returns_the_enumerated_optimum(priced):
    spec, training, cluster, profile = _instance()
    most = max(h for _, _, h, _ in priced)
    offloading_answers = 0
    for share in HOST_SHARES:
        host = share * most
        least = min(p for _, p, h, _ in priced if h <= host)
        for factor in FACTORS:
            budget = int(math.ceil(least * factor))
            best = min(t for t, p, h, _ in priced if p <= budget and h <= host)
            result = search(spec, training, cluster, profile, budget, _options(host))
            assert result.plan.search["proven_optimal"], (share, factor)
            assert result.estimate.peak_memory_bytes <= budget
            assert result.estimate.host_memory_bytes <= host * (1 + 1e-9)
            # 1e-9: the search's ties and the last bits of the sums
            assert result.estimate.iteration_time_s == pytest.approx(best, rel=1e-9), \
                (share, factor)
            offloading_answers += any(s.offload for s in result.plan.layers)
    assert offloading_answers > 0  # the instance exercises activation offload at all


def test_the_host_cut_fires_at_a_binding_host_budget(priced, monkeypatch):
    spec, training, cluster, profile = _instance()
    # 1% of the most host bytes any plan needs: room for some offloaded activations, not for
    # every layer's, so many stages pass the budget before their last layer (at 3% or more
    # the bounds already cut those branches and both searches visit the same nodes)
    host = 0.01 * max(h for _, _, h, _ in priced)
    budget = int(math.ceil(min(p for _, p, h, _ in priced if h <= host)))
    cut = search(spec, training, cluster, profile, budget, _options(host))
    monkeypatch.setattr(exact, "EARLY_HOST_CUT", False)
    leaf_only = search(spec, training, cluster, profile, budget, _options(host))
    assert cut.estimate.iteration_time_s == pytest.approx(leaf_only.estimate.iteration_time_s,
                                                          rel=1e-9)
    fewer = [(cut.plan.search[key], leaf_only.plan.search[key])
             for key in ("nodes", "plans_priced")]
    assert all(a < b for a, b in fewer), fewer
