"""Optimizer and activation offload as dimensions of the exact search, proven by enumeration.

Every plan of a tiny 2-rank space is written out here independently of the search's strategy
code (pipeline degree, partition, micro-batch count, interleaving, per layer every TP degree
with its DP ranks dividing the micro-batch, ``ddp``/``zero1``, SP where it divides the sequence,
activation offload (``offload`` false or true); the vocabulary's TP and flavour) at each
``pipeline.optimizer_offload_fraction`` the search offers (0, 1/2, 1: per stage on a plain
pipeline, one for every stage of an interleaved one), priced by ``evaluate``. ("Offloads" below: any optimizer fraction or any layer offloading.) A plan is feasible when its
device peak fits the budget and its host bytes the host budget. At several budgets the search
(host budget given, gap 0) must return the enumerated optimum; at some the optimum offloads and
at another it does not, so a search without the dimension fails here. Without a host budget the
search offloads nothing (the default space is unchanged).
"""

from __future__ import annotations

import itertools
import math

import pytest

from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.planner import SearchOptions
from megatron_auto.planner import evaluate, search
from megatron_auto.planner.inputs.model_spec import LayerType
from planner_enumerate import _divisors, compositions, virtual_sizes
from planner_fakes import tiny_gpt

pytestmark = pytest.mark.pure

WORLD, BATCH, LAYERS, SEQ = 2, 2, 2, 16
DP_MODES = ("ddp", "zero1")
FRACTIONS = (0.0, 0.5, 1.0)
FACTORS = (1.0, 1.1, 1.3, 1.6, 2.0, 4.0)


def _instance():
    # parameters dominate (h 256, f 1024, 16 tokens): the optimizer's moments are worth moving
    spec, training, cluster, profile = tiny_gpt(WORLD, LAYERS, BATCH, seq=SEQ)
    return spec.layer_types[0], spec, training, cluster, profile


def _layer_choices(lt: LayerType, n: int, b_m: int) -> list[LayerStrategy]:
    out = []
    for tp in _divisors(n):
        if lt.num_attention_heads % tp or lt.ffn_hidden_size % tp or b_m % (n // tp):
            continue
        for mode in (DP_MODES if n // tp > 1 else ("ddp",)):
            for sp in ((False, True) if tp > 1 and SEQ % tp == 0 else (False,)):
                for offload in (False, True, ("core_attn",), ("mlp",)):  # no layer recomputes
                    out.append(LayerStrategy(tp=tp, dp_mode=mode, sequence_parallel=sp,
                                             offload=offload))
    return out


def _every_plan(spec):
    for pp in _divisors(WORLD):
        if pp > LAYERS:
            continue
        n = WORLD // pp
        for m in _divisors(BATCH):
            b_m = BATCH // m
            choices = _layer_choices(spec.layer_types[0], n, b_m)
            vocabs = [VocabStrategy(tp=tp, dp_mode=mode) for tp in _divisors(n)
                      if spec.vocab_size % tp == 0 and b_m % (n // tp) == 0
                      for mode in (DP_MODES if n // tp > 1 else ("ddp",))]
            for v in virtual_sizes(LAYERS, pp, m):
                for part in compositions(LAYERS, pp * v):
                    # per stage on a plain pipeline (search/mixed_offload.py), one for every
                    # stage of an interleaved one
                    fractions = itertools.product(FRACTIONS, repeat=pp) if pp > 1 and v == 1 \
                        else FRACTIONS
                    for fraction in fractions:
                        pipe = PipelineSpec(size=pp, schedule="1f1b", layers_per_stage=part,
                                            virtual_size=v, optimizer_offload_fraction=fraction)
                        for layers in itertools.product(choices, repeat=LAYERS):
                            for vocab in vocabs:
                                yield Plan(world_size=WORLD, global_batch_size=BATCH,
                                           num_microbatches=m, pipeline=pipe, vocab=vocab,
                                           layers=layers, model=spec.plan_model_record())


def _fraction(plan: Plan) -> float:
    value = plan.pipeline.optimizer_offload_fraction
    return max(value) if isinstance(value, tuple) else value


@pytest.fixture(scope="module")
def priced():
    lt, spec, training, cluster, profile = _instance()
    out = []
    for plan in _every_plan(spec):
        e = evaluate(plan, spec, training, cluster, profile)
        out.append((e.iteration_time_s, e.peak_memory_bytes, e.host_memory_bytes,
                    _fraction(plan) + any(s.offload for s in plan.layers)))
    assert len(out) > 100
    return out


def _options(host: float | None) -> SearchOptions:
    return SearchOptions(show_progress=False, optimality_gap=0.0, dp_modes=DP_MODES,
                         allow_recompute=False, host_memory_budget_bytes=host,
                         include_baselines=False, report_partitions=False)


@pytest.mark.parametrize("host_share", [1.0, 0.5, 0.05])
def test_search_with_offload_returns_the_enumerated_optimum(priced, host_share):
    _, spec, training, cluster, profile = _instance()
    # host_share 1: room for every plan's host bytes; 1/2: fraction 1 of the biggest stage
    # does not fit, so the host budget itself decides some answers; 1/20: room for offloaded
    # activations only
    host = host_share * max(h for _, _, h, _ in priced)
    least = min(p for _, p, h, _ in priced if h <= host)
    chosen = []
    for factor in FACTORS:
        budget = int(math.ceil(least * factor))
        fits = [(t, f) for t, p, h, f in priced if p <= budget and h <= host]
        best_time, _ = min(fits)
        result = search(spec, training, cluster, profile, budget, _options(host))
        assert result.plan.search["proven_optimal"], factor
        assert result.estimate.peak_memory_bytes <= budget
        assert result.estimate.host_memory_bytes <= host
        assert result.estimate.iteration_time_s == pytest.approx(best_time, rel=1e-9), factor
        chosen.append((_fraction(result.plan), any(s.offload for s in result.plan.layers)))
    # the dimensions matter: the tightest budget's optimum offloads, a loose one's does not
    assert any(chosen[0]) and not any(chosen[-1]), chosen
    if host_share == 1.0:  # both kinds are chosen somewhere, activation offload on its own too
        assert any(f > 0 for f, _ in chosen) and (0.0, True) in chosen, chosen


def test_without_a_host_budget_nothing_is_offloaded(priced):
    _, spec, training, cluster, profile = _instance()
    least_without = min(p for _, p, _, f in priced if f == 0)
    least = min(p for _, p, _, _ in priced)
    assert least < least_without  # offload is what fits below it
    budget = int(math.ceil(least_without))
    result = search(spec, training, cluster, profile, budget, _options(None))
    assert _fraction(result.plan) == 0 and not result.estimate.host_memory_bytes
    best_time = min(t for t, p, h, f in priced if p <= budget and f == 0)
    assert result.estimate.iteration_time_s == pytest.approx(best_time, rel=1e-9)


def test_plan_cli_offloads_where_nothing_else_fits(tmp_path, capsys):
    """A 4096-wide GPT on two A100-40GB: at 12 GB per device no plan fits without offload
    (the least needs 16.09 GB); with 64 GB of host memory the search offloads the optimizer."""
    import json

    from megatron_auto.cli import main

    model = ["--num-layers", "8", "--hidden-size", "4096", "--num-attention-heads", "32",
             "--seq-length", "512", "--max-position-embeddings", "512", "--vocab-size", "32000",
             "--global-batch-size", "8", "--cluster", "a100-40g-1x2", "--memory-budget-gb", "12",
             "--quiet"]
    out = tmp_path / "plan.json"
    assert main(["plan", *model, "--plan-out", str(tmp_path / "none.json")]) != 0
    assert "the least memory any plan" in capsys.readouterr().err
    assert main(["plan", *model, "--host-memory-budget-gb", "64", "--plan-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "(offloaded optimizer share) of 64.00 GB host budget" in text
    saved = json.loads(out.read_text())
    assert saved["pipeline"]["optimizer_offload_fraction"] > 0
    assert saved["estimate"]["host_memory_budget_bytes"] == 64e9
    assert main(["plan", *model, "--host-memory-budget-gb", "-1", "--plan-out", str(out)]) != 0
    assert "--host-memory-budget-gb=-1.0: must be a positive number" in capsys.readouterr().err
