"""Module-list activation offload (``layers[i].offload = ["mlp"]``, ...) as a dimension of the
exact search, proven by enumeration.

Every plan of the tiny 2-rank space of tests/test_planner_exhaustive_offload.py (no optimizer
offload here) is written out independently of the search's strategy code, each layer's
``offload`` false, true, ``["core_attn"]`` or ``["mlp"]`` (no layer recomputes), priced by
``evaluate``. At several budgets the search (host budget given, gap 0) returns the enumerated
optimum; at some budget that optimum offloads a module list, and there a search offered only
false/true (``spaces.OFFLOAD_MODULE_CHOICES`` emptied) is slower, so the dimension is what
finds it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.planner import evaluate, search
from megatron_auto.planner.search import spaces
from planner_enumerate import _divisors, compositions, virtual_sizes
from test_planner_exhaustive_offload import BATCH, DP_MODES, LAYERS, SEQ, WORLD, _instance, _options

pytestmark = pytest.mark.pure

OFFLOADS = (False, True, ("core_attn",), ("mlp",))
FACTORS = (1.0, 1.05, 1.1, 1.2, 1.3, 1.45, 1.6, 2.0)


def _layer_choices(lt, n: int, b_m: int) -> list[LayerStrategy]:
    return [LayerStrategy(tp=tp, dp_mode=mode, sequence_parallel=sp, offload=offload)
            for tp in _divisors(n)
            if not (lt.num_attention_heads % tp or lt.ffn_hidden_size % tp or b_m % (n // tp))
            for mode in (DP_MODES if n // tp > 1 else ("ddp",))
            for sp in ((False, True) if tp > 1 and SEQ % tp == 0 else (False,))
            for offload in OFFLOADS]


def _every_plan(spec):
    for pp in _divisors(WORLD):
        n = WORLD // pp
        for m in _divisors(BATCH):
            b_m = BATCH // m
            choices = _layer_choices(spec.layer_types[0], n, b_m)
            vocabs = [VocabStrategy(tp=tp, dp_mode=mode) for tp in _divisors(n)
                      if spec.vocab_size % tp == 0 and b_m % (n // tp) == 0
                      for mode in (DP_MODES if n // tp > 1 else ("ddp",))]
            for v in virtual_sizes(LAYERS, pp, m):
                for part in compositions(LAYERS, pp * v):
                    pipe = PipelineSpec(size=pp, schedule="1f1b", layers_per_stage=part,
                                        virtual_size=v)
                    for layers in itertools.product(choices, repeat=LAYERS):
                        for vocab in vocabs:
                            yield Plan(world_size=WORLD, global_batch_size=BATCH,
                                       num_microbatches=m, pipeline=pipe, vocab=vocab,
                                       layers=layers, model=spec.plan_model_record())


@pytest.fixture(scope="module")
def priced():
    _, spec, training, cluster, profile = _instance()
    out = []
    for plan in _every_plan(spec):
        e = evaluate(plan, spec, training, cluster, profile)
        lists = any(isinstance(s.offload, tuple) for s in plan.layers)
        out.append((e.iteration_time_s, e.peak_memory_bytes, e.host_memory_bytes, lists))
    assert len(out) > 100
    return out


def _no_fraction(host: float):
    # no optimizer offload: this file's enumeration has none
    return dataclasses.replace(_options(host), optimizer_offload_fractions=())


def test_search_with_module_lists_returns_the_enumerated_optimum(priced, monkeypatch):
    _, spec, training, cluster, profile = _instance()
    host = max(h for _, _, h, _ in priced)
    least = min(p for _, p, _, _ in priced)
    uses_lists = []
    for factor in FACTORS:
        budget = int(math.ceil(least * factor))
        fits = [(t, f) for t, p, _, f in priced if p <= budget]
        best_time = min(t for t, _ in fits)
        result = search(spec, training, cluster, profile, budget, _no_fraction(host))
        assert result.plan.search["proven_optimal"], factor
        assert result.estimate.peak_memory_bytes <= budget
        assert result.estimate.iteration_time_s == pytest.approx(best_time, rel=1e-9), factor
        best_without = min((t for t, f in fits if not f), default=math.inf)
        if math.inf > best_without > best_time * (1 + 1e-9):  # only a module list reaches it
            uses_lists.append((budget, best_without))
    assert uses_lists, "no budget's optimum needs a module list"
    # offered false/true only, the search finds the best plan without lists, and no better
    monkeypatch.setattr(spaces, "OFFLOAD_MODULE_CHOICES", ())
    for budget, best_without in uses_lists:
        without = search(spec, training, cluster, profile, budget, _no_fraction(host))
        assert without.estimate.iteration_time_s == pytest.approx(best_without, rel=1e-9)
