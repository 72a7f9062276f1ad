"""Context parallelism as a search dimension, proven by enumeration (planner/search/cp_space.py).

Every plan of a tiny 4-rank space with cp is written out here independently of the search's
strategy code (pipeline degree, partition, micro-batch count, one cp degree per plan -- a
power of two dividing the stage with the sequence divisible by 2 cp --, per layer every TP
degree inside the cp group's complement with its DP ranks dividing the micro-batch, the TP
layout where it changes the groups (cp 1 only), DP flavour, SP where tp cp divides the
sequence, ring or Ulysses (heads and groups divisible by cp tp), the vocabulary's TP and
flavour), priced by ``evaluate``, and at several budgets the search (cp searched, gap 0) must
return the enumerated optimum. At some budget the optimum takes cp > 1 and at another cp 1,
so a search without the dimension fails here.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.planner import ModelSpec, SearchOptions, TrainingSpec, analytic_profile
from megatron_auto.planner import evaluate, search
from megatron_auto.planner.inputs.model_spec import LayerType
from megatron_auto.planner.inputs.presets import make_cluster
from planner_enumerate import _divisors, _tp_in_node, compositions, virtual_sizes

pytestmark = pytest.mark.pure

WORLD, BATCH, LAYERS, SEQ = 4, 4, 2, 256
DP_MODES = ("ddp", "zero3")
FACTORS = (1.0, 1.05, 1.3, 2.0, 4.0)


def _layer_choices(lt: LayerType, n: int, cp: int, b_m: int) -> list[LayerStrategy]:
    out = []
    for tp in _divisors(n // cp):
        if not _tp_in_node(tp, WORLD) or lt.num_attention_heads % tp or lt.ffn_hidden_size % tp:
            continue
        dp = n // (tp * cp)
        if b_m % dp:
            continue
        groups = lt.num_query_groups or lt.num_attention_heads
        modes = ["ring"] + (["ulysses"] if cp > 1 and lt.num_attention_heads % (cp * tp) == 0
                            and groups % (cp * tp) == 0 else [])
        for consec in ((True, False) if 1 < tp < n and cp == 1 else (True,)):
            for dp_mode in (DP_MODES if dp * cp > 1 else ("ddp",)):
                for sp in ((False, True) if tp > 1 and lt.seq_length % (tp * cp) == 0
                           else (False,)):
                    for mode in modes:
                        out.append(LayerStrategy(tp=tp, dp_mode=dp_mode, tp_consecutive=consec,
                                                 sequence_parallel=sp, cp=cp, cp_mode=mode))
    return out


def _instance():
    lt = LayerType(name="gpt", hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                   seq_length=SEQ, count=LAYERS)
    spec = ModelSpec(layer_types=(lt,), layer_order=(0,) * LAYERS, vocab_size=128,
                     embedding_hidden_size=64, seq_length=SEQ, name="gpt")
    training = TrainingSpec(BATCH, "fp32")
    cluster = dataclasses.replace(make_cluster("a100-40g", 1, WORLD), memory_reserve_bytes=10 ** 5,
                                  device_memory_bytes=10 ** 9, nccl_communicator_bytes=5e3)
    return lt, spec, training, cluster, analytic_profile(spec, training, cluster)


def _every_plan(lt, spec):
    for pp in _divisors(WORLD):
        if pp > LAYERS:
            continue
        n = WORLD // pp
        for m in _divisors(BATCH):
            b_m = BATCH // m
            for cp in [c for c in _divisors(n) if c & (c - 1) == 0 and SEQ % (2 * c) == 0]:
                choices = _layer_choices(lt, n, cp, b_m)
                vocabs = [VocabStrategy(tp=tp, dp_mode=mode) for tp in _divisors(n // cp)
                          if spec.vocab_size % tp == 0 and b_m % (n // (tp * cp)) == 0
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


def test_search_with_cp_returns_the_enumerated_optimum_at_every_budget():
    lt, spec, training, cluster, profile = _instance()
    priced = []
    for plan in _every_plan(lt, spec):
        e = evaluate(plan, spec, training, cluster, profile)
        priced.append((e.iteration_time_s, e.peak_memory_bytes, plan.cp_size))
    assert len(priced) > 1000
    least = min(p for _, p, _ in priced)
    chosen_cp = []
    for factor in FACTORS:
        budget = int(math.ceil(least * factor))
        best_time, best_cp = min((t, c) for t, p, c in priced if p <= budget)
        result = search(spec, training, cluster, profile, budget, SearchOptions(
            show_progress=False, cp_min_seq_length=0, optimality_gap=0.0, dp_modes=DP_MODES,
            allow_recompute=False))
        assert result.plan.search["proven_optimal"], factor
        assert result.estimate.peak_memory_bytes <= budget
        assert result.estimate.iteration_time_s == pytest.approx(best_time, rel=1e-9), factor
        chosen_cp.append(result.plan.cp_size)
    # the dimension matters: some budget's optimum splits the sequence, another's does not
    assert max(chosen_cp) > 1 and min(chosen_cp) == 1, chosen_cp


def test_short_sequences_keep_the_search_space_without_cp():
    lt, spec, training, cluster, profile = _instance()
    least = min(evaluate(p, spec, training, cluster, profile).peak_memory_bytes
                for p in _every_plan(lt, spec))
    budgets = [int(math.ceil(least * f)) for f in FACTORS]

    def cp_at(budget: int, **knobs) -> int:
        return search(spec, training, cluster, profile, budget, SearchOptions(
            show_progress=False, optimality_gap=0.0, dp_modes=DP_MODES, allow_recompute=False,
            **knobs)).plan.cp_size
    # below CP_MIN_SEQ_LENGTH cp is not searched, even where a cp plan would be faster
    wins = [b for b in budgets if cp_at(b, cp_min_seq_length=0) > 1]
    assert wins and all(cp_at(b) == 1 for b in wins)
