"""Local moves on a gap-stopped answer (``planner/search/polish.py``).

On tiny instances whose every plan is enumerated (planner_enumerate):

- ``polish`` started from enumerated plans that fit ends at a plan that fits, is never slower
  than its start, and has no faster neighbour that fits (it is a local optimum of its own move
  set); the starts include plans with a faster neighbour, so a polish that moves nothing fails;
- a search stopped by a loose ``--optimality-gap`` returns such a local optimum, keeps the lower
  bound of the same search without moves, and is never slower than that search's answer;
- the moves stay inside the searched space (pinned DP modes and vocabulary TP degree).
"""

from __future__ import annotations

import importlib
import itertools
import math
from dataclasses import replace

import pytest

from megatron_auto.plan import Plan, VocabStrategy
from megatron_auto.plan_errors import PlanError
from megatron_auto.planner import evaluate, search
from megatron_auto.planner.search.polish import MAX_ROUNDS, neighbours, polish
from megatron_auto.planner.search.walk_state import TIE

from test_planner_exhaustive import BUDGET_FRACTIONS, INSTANCES, _id, _options, instance

pytestmark = [pytest.mark.pure, pytest.mark.exhaustive]

driver = importlib.import_module("megatron_auto.planner.search.driver")

# Instances with data parallelism (a batch of 1 leaves dp = 1 and no move to make): 4 and 8
# devices, one to four stages, fp32 and bf16, two layer types.
CASES = [INSTANCES[3], INSTANCES[4], INSTANCES[6], INSTANCES[10]]
MODES = ("ddp", "zero1", "zero2", "zero3")


def _vocabs(plan):
    return [VocabStrategy(tp=tp, dp_mode=m) for tp in (1, 2, 4, 8) if plan.stage_size % tp == 0
            for m in MODES]


def _faster_neighbour(plan, time_s, spec, training, cluster, profile, budget, allowed):
    """A neighbour that fits and is faster than ``time_s`` by more than a tie, or None."""
    for cand in neighbours(plan, _vocabs(plan), MODES):
        if not allowed(cand):
            continue
        est = evaluate(cand, spec, training, cluster, profile, budget)
        if est.feasible and est.iteration_time_s < time_s * (1 - TIE):
            return cand
    return None


def test_neighbours_change_one_run_or_the_vocabulary():
    # two stages of two ranks, a micro-batch of 4 (every vocabulary TP degree divides it);
    # stage 0 is one run of equal strategies, stage 1 two (recompute differs)
    plan = Plan.uniform(4, 4, global_batch_size=4, pp=2, dp_mode="zero1",
                        recompute=[False, False, False, True])
    runs = 0
    for stage in range(plan.pp_size):
        idx = list(plan.stage_layers(stage))
        runs += 1 + sum(plan.layers[a] != plan.layers[b] for a, b in zip(idx, idx[1:]))
    out = list(neighbours(plan, _vocabs(plan), MODES))
    vocab_moves = [p for p in out if p.vocab != plan.vocab]
    assert len(vocab_moves) == len(_vocabs(plan)) - 1
    assert all(p.layers == plan.layers for p in vocab_moves)
    layer_moves = [p for p in out if p.vocab == plan.vocab]
    assert len(layer_moves) == runs * (len(MODES) - 1)
    for p in layer_moves:
        changed = [i for i, (a, b) in enumerate(zip(p.layers, plan.layers)) if a != b]
        assert changed and all(p.layers[i] == replace(plan.layers[i], dp_mode=p.layers[changed[0]]
                                                      .dp_mode) for i in changed)
        # one maximal run of equal strategies within one stage
        stages = {next(k for k in range(plan.pp_size) if i in plan.stage_layers(k))
                  for i in changed}
        assert len(stages) == 1 and changed == list(range(changed[0], changed[-1] + 1))
        assert len({plan.layers[i] for i in changed}) == 1


def _starts(spec, training, world):
    """Uniform plans (``Plan.uniform``) over pp, tp, micro-batch count, layer and vocabulary DP
    modes: the plans a user would write by hand, many a move away from better."""
    batch = training.global_batch_size
    out = []
    for pp, tp, m, mode, vmode in itertools.product((1, 2), (1, 2), (1, 2), MODES, MODES):
        try:
            out.append(Plan.uniform(world, spec.num_layers, global_batch_size=batch,
                                    num_microbatches=m, tp=tp, pp=pp, dp_mode=mode,
                                    vocab_dp_mode=vmode,
                                    model=spec.plan_model_record()))
        except PlanError:
            continue  # not a plan of this instance (a degree that does not divide)
    return out


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_polish_ends_at_a_local_optimum_that_fits(case):
    spec, training, cluster, profile, _ = instance(*case)
    priced = [(p, evaluate(p, spec, training, cluster, profile))
              for p in _starts(spec, training, case[0])]
    least = min(e.peak_memory_bytes for _, e in priced)
    improved = 0
    for fraction in (1.2, 3.0):
        budget = int(math.ceil(least * fraction))
        for plan, est in priced:
            if est.peak_memory_bytes > budget:
                continue
            start = evaluate(plan, spec, training, cluster, profile, budget)
            got, got_est, moves = polish(plan, start, spec, training, cluster, profile, budget,
                                         _vocabs(plan), MODES, lambda p: True, lambda: False)
            again = evaluate(got, spec, training, cluster, profile, budget)
            assert again.feasible and again.iteration_time_s == pytest.approx(
                got_est.iteration_time_s, rel=1e-12)
            assert got_est.iteration_time_s <= start.iteration_time_s
            assert (moves > 0) == (got != plan)
            if moves < MAX_ROUNDS:  # not cut by the round limit: no faster neighbour is left
                assert _faster_neighbour(got, got_est.iteration_time_s, spec, training, cluster,
                                         profile, budget, lambda p: True) is None
            improved += got_est.iteration_time_s < start.iteration_time_s * (1 - TIE)
    assert improved >= 5  # many starts had a faster neighbour (measured: 26-153 per instance)


def test_a_gap_stopped_answer_is_polished_and_keeps_its_bound(monkeypatch):
    polished = 0
    for case in CASES:
        spec, training, cluster, profile, priced = instance(*case)
        least = min(peak for _, peak, _ in priced)
        for fraction, gap in itertools.product(BUDGET_FRACTIONS, (0.05, 0.5)):
            budget = int(math.ceil(least * fraction))
            options = _options(case, include_baselines=False, optimality_gap=gap)
            with monkeypatch.context() as m:
                m.setattr(driver, "_polish", lambda *a, **k: 0)
                plain = search(spec, training, cluster, profile, budget, options)
            result = search(spec, training, cluster, profile, budget, options)
            info, ref = result.plan.search, plain.plan.search
            assert info["lower_bound_s"] == pytest.approx(ref["lower_bound_s"], rel=1e-12)
            assert result.estimate.iteration_time_s <= plain.estimate.iteration_time_s
            assert result.estimate.feasible
            assert info["optimality_gap"] <= ref["optimality_gap"] + 1e-12
            assert (info["polish_moves"] > 0) == (
                result.estimate.iteration_time_s < plain.estimate.iteration_time_s)
            if not info["proven_optimal"] and info["polish_moves"] < MAX_ROUNDS:
                world = case[0]
                assert _faster_neighbour(
                    result.plan, result.estimate.iteration_time_s, spec, training, cluster,
                    profile, budget, lambda p: driver._keeps_pins(
                        p, options, spec, world, cluster.devices_per_node)) is None
            polished += info["polish_moves"] > 0
    assert polished > 0  # some gap-stopped answers had a faster neighbour


def test_moves_keep_the_pinned_modes_and_vocabulary_tp():
    case = INSTANCES[3]
    spec, training, cluster, profile, priced = instance(*case)
    budget = int(math.ceil(min(peak for _, peak, _ in priced) * 3.0))
    options = replace(_options(case, include_baselines=False, optimality_gap=0.5),
                      dp_modes=("ddp", "zero3"), vocab_tp=2)
    result = search(spec, training, cluster, profile, budget, options)
    assert {s.dp_mode for s in result.plan.layers} <= {"ddp", "zero3"}
    assert result.plan.vocab.tp == 2 and result.plan.vocab.dp_mode in ("ddp", "zero3")
