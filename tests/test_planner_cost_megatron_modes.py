"""Cost model of Megatron's three table stakes, by hand: ZeRO-1 (the distributed optimizer),
sequence parallelism and the interleaved 1F1B schedule (docs/cost_model.md §3-6).

The fake cluster's collectives are ring formulas with one bandwidth (1e4 B/s) and no latency:
all-reduce ``2 (d-1)/d x / 1e4``, all-gather and reduce-scatter ``(d-1)/d x / 1e4``, p2p
``x / 1e4``; the round profile's layer has 1000 parameters, 0.01 s forward per sample, backward
twice that, 50 B hidden per sample (planner_fakes.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_auto.layout import make_layout
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.planner import ModelSpec, TrainingSpec, evaluate
from megatron_auto.planner.cost.memory_model import layer_memory
from megatron_auto.planner.cost.collectives import stage_collectives
from megatron_auto.planner.cost.moves import stage_moves
from megatron_auto.planner.cost.time_model import layer_time, pipeline_time
from megatron_auto.planner.cost.interleaving import in_flight_vectors, peak_activations
from megatron_auto.schedule import max_in_flight, num_warmup

from planner_fakes import FakeCluster, round_profile

pytestmark = pytest.mark.pure

SPEC4 = ModelSpec.uniform(4, 64, 4, 16, 64, name="gpt")


def _layer_profile(**changes):
    return replace(round_profile().layer_types["gpt"], **changes)


# ----------------------------------------------------------------------------- ZeRO-1
def test_zero1_layer_memory_shards_only_the_optimizer_state():
    # 1000 params over dp 4: params 4000 and gradient buckets 4000 stay whole, Adam 8000/4;
    # the step's sqrt(v) temporary is one fp32 value per owned parameter: 4 x 250.
    mem = layer_memory(_layer_profile(), 1, 4, "zero1", False, 1.0)
    assert (mem.parameters, mem.gradients, mem.optimizer_states) == (4000, 4000, 2000)
    assert mem.transient == 0 and mem.step_temporary == 1000
    # no deferred reduce-scatter of a recomputing layer (that is FSDP2's, not our buckets')
    assert layer_memory(_layer_profile(), 1, 4, "zero1", True, 1.0).gradients == 4000


def test_zero1_layer_time_reduce_scatters_in_backward_and_gathers_after_the_step():
    # dp 2, 2 samples per rank: F = 0.02 s, backward 0.04 s. Reduce-scatter of 4 x 1000 B:
    # 0.5 x 4000 / 1e4 = 0.2 s once per iteration, 0.16 s of it not hidden by the backward;
    # all-gather of the updated fp32 parameters after the step: 0.2 s (+ the step itself:
    # 0.001 s per parameter of the 500 owned).
    cluster = replace(FakeCluster(), optimizer_time_per_parameter_s=1e-3)
    t = layer_time(_layer_profile(), cluster, make_layout(1, True, 2), "zero1", False, 2.0, 2)
    assert t.sync == pytest.approx(0.2)
    assert t.exposed_sync == pytest.approx(0.16)
    assert t.optimizer == pytest.approx(0.2 + 0.5)
    assert t.dp_comm == 0 and t.forward == pytest.approx(0.02)
    ddp = layer_time(_layer_profile(), cluster, make_layout(1, True, 2), "ddp", False, 2.0, 2)
    assert ddp.sync == pytest.approx(0.4) and ddp.optimizer == pytest.approx(1.0)


def test_evaluate_prices_zero1_plans():
    # World 2, pp 1, 4 layers, B 4, m 1: layers on zero1 over dp 2 instead of ddp hold
    # 4 x (8000 - 4000) = 16000 B less optimizer state; per layer the reduce-scatter (0.2 s)
    # replaces the all-reduce (0.4 s), exposed beyond the 0.04 s backward: 0.16 instead of
    # 0.36 s, and the parameter all-gather adds 0.2 s after the step: 4 x (0.16 + 0.2 - 0.36)
    # = 0 s difference under this ring model.
    ddp = Plan.uniform(2, 4, global_batch_size=4, dp_mode="ddp", vocab_dp_mode="ddp")
    zero1 = Plan.uniform(2, 4, global_batch_size=4, dp_mode="zero1", vocab_dp_mode="ddp")
    a = evaluate(ddp, SPEC4, TrainingSpec(4), FakeCluster(), round_profile())
    b = evaluate(zero1, SPEC4, TrainingSpec(4), FakeCluster(), round_profile())
    assert (a.stages[0].memory_breakdown["optimizer_states"]
            - b.stages[0].memory_breakdown["optimizer_states"]) == pytest.approx(16000)
    assert b.stages[0].sync_tail_s == pytest.approx(a.stages[0].sync_tail_s - 4 * 0.2)
    assert b.iteration_time_s == pytest.approx(a.iteration_time_s)


# ------------------------------------------------------------------- sequence parallelism
def test_sequence_parallel_divides_the_replicated_activations_by_tp():
    # kept per sample at tp 2: 60 replicated + 40 split -> 60 + 20 = 80 without SP, all of it
    # split with SP: (60 + 40) / 2 = 50; recompute keeps the input's chunk: 10 / 2 = 5.
    lp = _layer_profile(activation_replicated_bytes=60.0, activation_split_bytes=40.0)
    assert layer_memory(lp, 2, 1, "ddp", False, 4.0).activations_per_microbatch == 320
    assert layer_memory(lp, 2, 1, "ddp", False, 4.0,
                        sequence_parallel=True).activations_per_microbatch == 200
    assert layer_memory(lp, 2, 1, "ddp", True, 4.0,
                        sequence_parallel=True).activations_per_microbatch == 20
    # a measured SP table (Galvatron's *_sp records) is used as measured
    lp_sp = replace(lp, activation_bytes_by_tp_sp={1: 100.0, 2: 70.0, 4: 55.0})
    assert lp_sp.sequence_parallel_activation_bytes(2) == 70.0


def test_sequence_parallel_tp_collectives_are_all_gathers_and_reduce_scatters():
    # tp 2 on 2 ranks, 4 samples per rank: F = 0.01 x 4 / 2 = 0.02 s, backward 0.04 s. One
    # (4, s, h) activation = 4 x 50 = 200 B. Without SP: 2 all-reduces per direction,
    # 2 x 0.5 x 200 / 1e4 = 0.02 s each. With SP: forward 2 x (all-gather + reduce-scatter)
    # = 4 x 0.01 s; backward 2 all-gathers of the output gradients, 2 x (re-gather of the input
    # + reduce-scatter of its gradient) = 6 x 0.01 s, and the two 20 B norm-gradient all-reduces,
    # 2 x 0.5 x 20 / 1e4 = 0.002 s each.
    lay = make_layout(2, True, 2)
    plain = layer_time(_layer_profile(), FakeCluster(), lay, "ddp", False, 4.0, 2)
    assert (plain.forward, plain.backward) == pytest.approx((0.02 + 0.04, 0.04 + 0.04))
    sp = layer_time(_layer_profile(), FakeCluster(), lay, "ddp", False, 4.0, 2,
                    sequence_parallel=True, norm_grad_bytes=(20.0, 20.0))
    assert sp.forward == pytest.approx(0.02 + 0.04)
    assert sp.backward == pytest.approx(0.04 + 0.06 + 0.004)
    assert sp.tp_comm == pytest.approx(0.04 + 0.064)
    # recompute repeats the forward's collectives but the last: 1 all-reduce / 3 SP ones
    rc = layer_time(_layer_profile(), FakeCluster(), lay, "ddp", True, 4.0, 2)
    assert rc.backward == pytest.approx(0.06 + 3 * 0.02)


def _sp_plan(sp):
    layers = (LayerStrategy(tp=2, sequence_parallel=sp[0]),
              LayerStrategy(tp=2, sequence_parallel=sp[1]), LayerStrategy(tp=2))
    return Plan(world_size=2, global_batch_size=4, num_microbatches=1,
                pipeline=PipelineSpec(1, "1f1b", (3,)), vocab=VocabStrategy(tp=1),
                layers=layers)


def test_sequence_parallel_boundaries_cost_one_gather_each_way():
    # 2 ranks, vocab tp 1 -> layers tp 2 -> head: the relayouts gather the 4-sample slice
    # (200 B, 0.01 s) forward into the first layer and backward out of the last. An SP run
    # over layers 0-1 adds one all-gather when it is left (forward, into layer 2) and one when
    # it is entered (backward, the gradient of layer 0's input): 0.01 s each, nothing between
    # the two SP layers of one layout.
    spec = ModelSpec.uniform(3, 64, 4, 16, 64, name="gpt")
    moves = stage_moves(_sp_plan((True, True)), spec, round_profile(), 0)
    assert [(m.enter_sp, m.leave_sp) for m in moves] == [(True, False), (False, False),
                                                          (False, True), (False, False)]
    a = evaluate(_sp_plan((False, False)), spec, TrainingSpec(4), FakeCluster(), round_profile())
    b = evaluate(_sp_plan((True, True)), spec, TrainingSpec(4), FakeCluster(), round_profile())
    rows = [dict(r) for r in b.per_layer]
    assert a.stages[0].microbatch_time_s + 0.02 + 2 * (
        rows[0]["forward_time_s"] + rows[0]["backward_time_s"]
        - a.per_layer[0]["forward_time_s"] - a.per_layer[0]["backward_time_s"]) \
        == pytest.approx(b.stages[0].microbatch_time_s)
    # the collective list: 4 gathers of 200 B on the 2-rank group, and the SP layers' own
    gathers = lambda plan: stage_collectives(plan, spec, round_profile(), "bf16", 0)  # noqa
    plain = sum(n for c, n in gathers(_sp_plan((False, False))).items()
                if c.kind == "all_gather")
    with_sp = gathers(_sp_plan((True, True)))
    assert plain == 2
    assert sum(n for c, n in with_sp.items() if c.kind == "all_gather") == 2 + 2 + 2 * 6
    assert sum(n for c, n in with_sp.items() if c.kind == "reduce_scatter") == 2 * 4


def test_sequence_parallel_divides_the_stage_activations():
    # round profile: 100 B replicated per sample; 4 samples per rank at tp 2 (dp 1): 400 B per
    # layer without SP, 200 B with SP, for the two SP layers of the plan.
    spec = ModelSpec.uniform(3, 64, 4, 16, 64, name="gpt")
    a = evaluate(_sp_plan((False, False)), spec, TrainingSpec(4), FakeCluster(), round_profile())
    b = evaluate(_sp_plan((True, True)), spec, TrainingSpec(4), FakeCluster(), round_profile())
    assert a.stages[0].memory_breakdown["activations"] == pytest.approx(3 * 400)
    assert b.stages[0].memory_breakdown["activations"] == pytest.approx(2 * 200 + 400)


# ----------------------------------------------------------------------------- interleaving
def test_interleaved_warmup_and_in_flight_counts_by_hand():
    # pp 2, v 2, m 4. Stage 0: W = 2 (2 - 0 - 1) + (2 - 1) 2 = 4 warm-up forwards; forward t is of
    # local chunk (t // 2) % 2 (0 0 1 1 0 0 1 1), backward t of 1 - (t // 2) % 2 (1 1 0 0 1 1 0 0).
    # Warm-up: (2, 2); steady: +f4 (3, 2) -b0 (3, 1) +f5 (4, 1) -b1 (4, 0) +f6 (4, 1) -b2 (3, 1)
    # +f7 (3, 2) ... -> maximal mixes (3, 2) and (4, 1). Stage 1: W = 2: (2, 0), then (2, 1)
    # and (3, 0).
    assert num_warmup(2, 2, 4, 0) == 4 and num_warmup(2, 2, 4, 1) == 2
    assert set(in_flight_vectors(2, 2, 4, 0)) == {(3, 2), (4, 1)}
    assert set(in_flight_vectors(2, 2, 4, 1)) == {(2, 1), (3, 0)}
    assert max_in_flight(2, 2, 4, 0) == 5 and max_in_flight(2, 2, 4, 1) == 3
    # m == pp: every forward first (Megatron's rule)
    assert in_flight_vectors(2, 2, 2, 1) == ((2, 2),)
    # v = 1 is the plain 1F1B count
    assert in_flight_vectors(4, 1, 8, 1) == ((3,),)
    # uneven chunks pick the worse mix: first chunk twice the second -> (4, 1): 4 x 2 + 1
    assert peak_activations([2.0, 1.0], 2, 2, 4, 0) == (9.0, (4, 1))
    assert peak_activations([1.0, 2.0], 2, 2, 4, 0) == (7.0, (3, 2))


def test_interleaved_pipeline_formula():
    # Equal chunks of c = 1 s on p = 2 stages, v = 2 (C = 2 s per stage), m = 4:
    # fill = 1 + 1, T = 2 + (4 - 1/2) 2 = 9 = m C + (p - 1) C / v (the bubble halves: 1F1B
    # without interleaving takes 4 + 3 x 2 = 10).
    pt = pipeline_time([2.0, 2.0], [1.0, 1.0], [0.0, 0.0], 4, virtual_size=2, fill=2.0)
    assert pt.iteration == pytest.approx(9.0)
    assert pipeline_time([2.0, 2.0], [1.0, 1.0], [0.0, 0.0], 4).iteration == pytest.approx(10.0)


def _interleaved_plan(v):
    chunks = (1,) * (2 * v) if v > 1 else (2, 2)
    return Plan(world_size=2, global_batch_size=4, num_microbatches=4,
                pipeline=PipelineSpec(2, "1f1b", chunks, virtual_size=v),
                vocab=VocabStrategy(tp=1), layers=(LayerStrategy(),) * 4)


def test_evaluate_interleaved_plan_by_hand():
    # World 2, pp 2 (one rank per stage), v 2: chunks 0, 2 on stage 0 and 1, 3 on stage 1, one
    # layer each; m = 4 micro-batches of 1 sample. A layer: 0.01 s forward, 0.02 s backward;
    # a hop into a chunk: 50 B each way, 0.005 + 0.005 s; the head: 0.005 + 0.010 s.
    # Stage 0: chunk 0 0.03, chunk 2 0.01 + 0.03 -> C_0 = 0.07; stage 1: chunk 1 0.04, chunk 3
    # 0.04 + 0.015 -> C_1 = 0.095. Fill = max(0.03, 0.04) + max(0.04, 0.055) = 0.095;
    # T_pipe = 0.095 + (4 - 1/2) 0.095 = 0.4275. The tied embedding's gradient all-reduce between
    # the stages (4 x 500 B over 2: 0.2 s) follows, and the step's three scalar all-reduces
    # (grad norm 8 B, skip flag 4 B, loss 16 B over 2: 28/1e4 = 0.0028 s): 0.6303 s.
    # Memory: per micro-batch a layer keeps 100 B, the embedding 10 B (in chunk 0), and every
    # chunk but the model's first its received input, 50 B (the hop's message). Stage 0's
    # mixes (3, 2) -> 3 x 110 + 2 x 150 = 630 and (4, 1) -> 4 x 110 + 150 = 590: three of
    # chunk 0 and two of chunk 2 in flight, 600 B of layers and inputs (without the inputs
    # 1.25 x the 400 B of the non-interleaved stage, Megatron's 1 + (p-1)/(pv)). Stage 1
    # (chunks 1 and 3, 150 B each): (2, 1) or (3, 0) -> 450.
    est = evaluate(_interleaved_plan(2), SPEC4, TrainingSpec(4), FakeCluster(), round_profile())
    assert est.iteration_time_s == pytest.approx(0.6303)
    assert [s.microbatch_time_s for s in est.stages] == pytest.approx([0.07, 0.095])
    assert est.stages[0].memory_breakdown["activations"] == pytest.approx(600)
    assert est.stages[0].in_flight_microbatches == 5
    assert est.stages[1].memory_breakdown["activations"] == pytest.approx(450)
    plain = evaluate(_interleaved_plan(1), SPEC4, TrainingSpec(4), FakeCluster(),
                     round_profile())
    assert plain.stages[0].memory_breakdown["activations"] == pytest.approx(400)
    # 1F1B: C_0 = 0.06, C_1 = 0.01 + 0.06 + 0.015; T_pipe = 0.145 + 3 x 0.085 = 0.4
    assert plain.iteration_time_s == pytest.approx(0.4 + 0.2 + 0.0028)
