"""Cost model: hand calculations for memory and time, relayouts, schedules."""

from __future__ import annotations

import pytest

from megatron_auto.plan import Plan
from megatron_auto.planner import ModelSpec, TrainingSpec, evaluate
from megatron_auto.planner.cost.memory_model import embedding_memory, layer_memory, model_states
from megatron_auto.planner.cost.estimate import in_flight
from megatron_auto.layout import Layout
from megatron_auto.planner.cost.time_model import (embedding_time, layer_time, overlap,
                                                   pipeline_time, relayout_cost,
                                                   stage_boundary_cost)

from planner_fakes import FakeCluster, round_profile

pytestmark = pytest.mark.pure

SPEC2 = ModelSpec.uniform(2, 64, 4, 16, 64, name="gpt")


def test_evaluate_uniform_two_layer_plan_matches_hand_calculation():
    # World 2, pp 1, tp 1 (dp 2), ddp, B = 4 in m = 2 micro-batches -> 1 sample per rank.
    # Per layer: F = 0.01 s, backward 0.02 s; DDP all-reduce of 4 B x 1000 grads over 2 ranks:
    #   2*(1/2)*4000/1e4 = 0.4 s, exposed beyond the 0.02 s backward: 0.38 s.
    # Embedding+head (pp 1): forward 0.005, backward 0.010; all-reduce of 4 x 520 B: 0.208 s,
    #   exposed 0.198 s.
    # C = 2*(0.01+0.02) + 0.005 + 0.010 = 0.075 s; T_pipe = C + (m-1) C = 0.15 s.
    # Tail = 2*0.38 + 0.198 = 0.958 s  ->  1.108 s, plus the step's three scalar all-reduces
    #   over 2 ranks (grad norm 8 B, skip flag 4 B, loss and tokens 16 B): 28/1e4 = 0.0028 s
    #   -> 1.1108 s.
    # Memory per rank: layers 2 x 16 B x 1000 = 32000; activations 2 x 100 (1 in flight);
    #   embedding states 16 x 520 = 8320 plus activations 10 + 40 = 50, of which the loss's 40
    #   are released before the layers' backward (counted for 1 - 1 = 0 other micro-batches:
    #   8330); transient: the loss's kept 40 plus the larger of its own 80 (forward) and the
    #   head's gradient of the tied weight, 4 x 500 = 2000 (backward), which autograd then holds
    #   through the layers' backward (a layer's: 0) until the embedding's: 2040; reserve 1000
    #   ->  43570 bytes during backward. The optimizer step holds the 16 B x 2520 states plus
    #   4 B x 2520 of foreach temporaries, no activations: 50400 + 1000 = 51400, the peak (the
    #   7830 beyond the backward peak shown as optimizer_step_excess).
    plan = Plan.uniform(2, 2, global_batch_size=4, num_microbatches=2)
    est = evaluate(plan, SPEC2, TrainingSpec(4), FakeCluster(), round_profile(),
                   memory_budget_bytes=51400)
    assert est.iteration_time_s == pytest.approx(1.1108)
    assert est.samples_per_s == pytest.approx(4 / 1.1108)
    stage = est.stages[0]
    assert stage.peak_memory_bytes == pytest.approx(51400)
    assert stage.memory_breakdown["optimizer_step_excess"] == pytest.approx(7830)
    assert stage.memory_breakdown["parameters"] == pytest.approx(8000)
    assert stage.memory_breakdown["optimizer_states"] == pytest.approx(16000)
    assert stage.memory_breakdown["activations"] == pytest.approx(200)
    assert stage.memory_breakdown["embedding"] == pytest.approx(8330)
    assert stage.memory_breakdown["transient"] == pytest.approx(2040)
    assert est.feasible
    assert not evaluate(plan, SPEC2, TrainingSpec(4), FakeCluster(), round_profile(),
                        memory_budget_bytes=51399).feasible
    d = est.to_dict()
    assert set(d) >= {"iteration_time_s", "samples_per_s", "stages"}
    assert set(d["stages"][0]["memory_breakdown"]) >= {
        "parameters", "gradients", "optimizer_states", "activations", "embedding",
        "context_reserve"}


def test_recompute_and_pipeline_hand_calculation():
    # pp 2 (one layer per stage, 1 rank each), m = 2, recompute on both layers.
    # Layer: forward 0.01 x 2 samples = 0.02; backward 2 x 0.02 + 0.02 (recompute) = 0.06.
    # Stage 0: + embedding (no compute) ; stage 1: + head forward 0.01, backward 0.02;
    #   hop into stage 1: 2 samples x 50 B / 1e4 = 0.01 s each way -> 0.02 s.
    # C0 = 0.08; C1 = 0.08 + 0.03 + 0.02 = 0.13. T_pipe = 0.21 + 1 x 0.13 = 0.34 s.
    # No DP (dp = 1). Tied embedding all-reduce between the stages: 2*(1/2)*4*500/1e4 = 0.2 s
    #   on both; stage 1 finishes 0.34 - B0 + 0.2 where B0 = 0.06, stage 0 at 0.34 + 0.2.
    # Iteration = 0.54 s, plus the scalar all-reduces of the step (0.0028 s, see above).
    plan = Plan.uniform(2, 2, global_batch_size=4, num_microbatches=2, pp=2, recompute=True)
    est = evaluate(plan, SPEC2, TrainingSpec(4), FakeCluster(), round_profile())
    assert est.iteration_time_s == pytest.approx(0.5428)
    # Stage 0 (1F1B) holds min(2 - 0, 2) = 2 micro-batches of the 10 B/sample input x 2 samples.
    assert est.stages[0].memory_breakdown["activations"] == pytest.approx(40)
    assert est.stages[1].memory_breakdown["activations"] == pytest.approx(20)


def test_optimizer_step_follows_the_slowest_stage_and_zero_shards_it():
    # The step after backward: 1e-4 s per local parameter plus 0.05 s fixed.
    # Uniform ddp plan of the first test (world 2, pp 1): 2 x 1000 layer + 520 embedding/head
    #   parameters per rank -> 0.252 s + 0.05 s on top of its 1.1108 s.
    # zero3 on every layer and the vocab: each rank updates its half, 1260 params -> 0.126 s.
    cluster = FakeCluster(optimizer_time_per_parameter_s=1e-4, step_overhead_s=0.05)
    plan = Plan.uniform(2, 2, global_batch_size=4, num_microbatches=2)
    est = evaluate(plan, SPEC2, TrainingSpec(4), cluster, round_profile())
    assert est.iteration_time_s == pytest.approx(1.1108 + 0.252 + 0.05)
    base = evaluate(Plan.uniform(2, 2, global_batch_size=4, num_microbatches=2, dp_mode="zero3"),
                    SPEC2, TrainingSpec(4), FakeCluster(), round_profile())
    zero3 = evaluate(Plan.uniform(2, 2, global_batch_size=4, num_microbatches=2, dp_mode="zero3"),
                     SPEC2, TrainingSpec(4), cluster, round_profile())
    assert zero3.iteration_time_s - base.iteration_time_s == pytest.approx(0.126 + 0.05)
    # pp 2 (world 2): stage 0 holds layer 0 + embedding (1500), stage 1 layer 1 + head with its
    #   own tied copy (1520): the step waits for the larger one, 0.152 s, once.
    pp_plan = Plan.uniform(2, 2, global_batch_size=4, num_microbatches=2, pp=2)
    with_step = evaluate(pp_plan, SPEC2, TrainingSpec(4), cluster, round_profile())
    without = evaluate(pp_plan, SPEC2, TrainingSpec(4), FakeCluster(), round_profile())
    assert with_step.iteration_time_s - without.iteration_time_s == pytest.approx(0.152 + 0.05)


def test_gpipe_holds_every_microbatch():
    assert in_flight("1f1b", 4, 0, 16) == 4
    assert in_flight("1f1b", 4, 3, 16) == 1
    assert in_flight("1f1b", 4, 0, 2) == 2
    assert in_flight("gpipe", 4, 3, 16) == 16
    one = Plan.uniform(2, 2, global_batch_size=8, num_microbatches=4, pp=2)
    gp = Plan.uniform(2, 2, global_batch_size=8, num_microbatches=4, pp=2, schedule="gpipe")
    a = evaluate(one, SPEC2, TrainingSpec(8), FakeCluster(), round_profile())
    b = evaluate(gp, SPEC2, TrainingSpec(8), FakeCluster(), round_profile())
    assert b.iteration_time_s == pytest.approx(a.iteration_time_s)
    assert b.stages[1].memory_breakdown["activations"] == pytest.approx(
        4 * a.stages[1].memory_breakdown["activations"])


def test_model_states_bytes_per_parameter():
    # Mixed precision with fp32 master weights: ddp 16 B; zero2 4 + 16/d (gathered params beside
    # the master shard); zero3 16/d.
    assert sum(model_states(1000, "ddp", 4)[:3]) == pytest.approx(16000)
    assert sum(model_states(1000, "zero2", 4)[:3]) == pytest.approx(4000 + 16000 / 4)
    assert sum(model_states(1000, "zero3", 4)[:3]) == pytest.approx(16000 / 4)
    # zero3 gathers the params and produces unsharded grads for the layer in use.
    assert model_states(1000, "zero3", 4)[3] == pytest.approx(8 * 750)
    # zero1: parameters (the fp32 master weights) and gradient buckets whole, Adam moments
    # of 1/d: 4000 + 4000 + 8000/4, nothing transient.
    assert model_states(1000, "zero1", 4) == pytest.approx((4000, 4000, 2000, 0))
    with pytest.raises(ValueError, match="dp_mode='zero5'"):
        model_states(1, "zero5", 2)


def test_recompute_keeps_only_the_input():
    prof = round_profile().layer_types["gpt"]
    plain = layer_memory(prof, 1, 2, "ddp", False, 3)
    rc = layer_memory(prof, 1, 2, "ddp", True, 3)
    assert plain.activations_per_microbatch == pytest.approx(300)
    assert rc.activations_per_microbatch == pytest.approx(30)
    # Rebuilt during its backward (300) beside its measured scratch (none in this profile).
    assert rc.transient == pytest.approx(300)
    assert plain.transient == pytest.approx(0)


def test_overlap_and_pipeline_formula():
    assert overlap(1.0, 3.0, 1.0) == pytest.approx(3.0)
    assert overlap(1.0, 3.0, 1.5) == pytest.approx(3.5)
    # Two stages of 1 s, 4 micro-batches: (2 + 3) x 1 = 5 s; stage 1's 2 s tail starts
    # B0 = 0.5 s before the end: 5 - 0.5 + 2 = 6.5 s.
    pt = pipeline_time([1.0, 1.0], [0.5, 0.5], [0.0, 2.0], 4)
    assert pt.pipeline == pytest.approx(5.0)
    assert pt.iteration == pytest.approx(6.5)
    assert pt.bubble_fraction == pytest.approx(1 - 4 / 5)


def test_evaluate_rejects_mismatched_plans():
    plan = Plan.uniform(2, 3, global_batch_size=4, num_microbatches=2)
    with pytest.raises(ValueError, match="3 layers but model"):
        evaluate(plan, SPEC2, TrainingSpec(4), FakeCluster(), round_profile())
    big = Plan.uniform(4, 2, global_batch_size=4, num_microbatches=1)
    with pytest.raises(ValueError, match="world_size=4"):
        evaluate(big, SPEC2, TrainingSpec(4), FakeCluster(), round_profile())
    with pytest.raises(ValueError, match="precision"):
        evaluate(Plan.uniform(2, 2, global_batch_size=4), SPEC2, TrainingSpec(4, "fp32"),
                 FakeCluster(), round_profile())


def test_recomputing_zero_layer_keeps_its_pending_reduce_scatter():
    # 1000 params over dp 2 with recompute: one pending unsharded gradient copy is held to the
    # end of the backward pass, once whatever the micro-batches in flight (measured:
    # test_cost_memory_measured's zero2 recompute stage; two copies were 10% over it):
    # 4 B x 1000 x (1 - 1/2) = 2000 beside the 4 B x 500 gradient shard -> 4000 gradient
    # bytes; a micro-batch keeps only the input (10 B x 3 samples = 30).
    prof = round_profile().layer_types["gpt"]
    for mode in ("zero2", "zero3"):
        cost = layer_memory(prof, 1, 2, mode, True, 3)
        assert cost.gradients == pytest.approx(4000)
        assert cost.activations_per_microbatch == pytest.approx(30)
        assert cost.persistent(4) - cost.persistent(1) == pytest.approx(3 * 30)
    ddp = layer_memory(prof, 1, 2, "ddp", True, 3)
    assert ddp.gradients == pytest.approx(4000) and ddp.activations_per_microbatch == \
        pytest.approx(30)
    assert layer_memory(prof, 1, 2, "zero2", False, 3).gradients == pytest.approx(2000)


def test_loss_softmax_is_released_before_the_layers_backward():
    # Last stage, 1 sample, tied ddp head: the loss keeps 40 B and adds 80 B in forward. With 3
    # micro-batches in flight (GPipe) 2 still hold theirs while the running one's 40 and the
    # larger of its 80 and the head's weight gradient (4 x 500 B, backward) are the transient:
    # persistent = states + 3 x (10 + 40) - 40 (embedding on the same stage). That gradient of
    # the tied weight stays held until the embedding's backward, beside every layer's
    # transient: it counts in persistent, the transient keeps only what is above it.
    emb = embedding_memory(round_profile().embedding, 1, 1, "ddp", 1, True, True, 1)
    assert emb.held_in_backward == pytest.approx(2000)
    assert emb.transient + emb.held_in_backward == pytest.approx(40 + 2000)
    assert emb.persistent(3) == pytest.approx(16 * 520 + 3 * 50 - 40 + 2000)
    # Over two stages each copy's gradient is accumulated at once: nothing held.
    last = embedding_memory(round_profile().embedding, 1, 1, "ddp", 1, False, True, 2)
    assert last.held_in_backward == 0 and last.transient == pytest.approx(40 + 2000)
    # The first stage alone releases nothing early.
    first = embedding_memory(round_profile().embedding, 1, 1, "ddp", 1, True, False, 2)
    assert first.persistent(3) == pytest.approx(16 * 500 + 3 * 10) and first.transient == 0


def test_gpipe_peak_comes_before_lazy_gradients_exist():
    # ddp on one rank drops its gradients between iterations; GPipe peaks at the first backward
    # with every micro-batch in flight, before the layers not yet differentiated have them.
    # Layer: 1000 params, 100 B x 2 samples = 200 B kept per micro-batch, 4000 B of gradients:
    # counted as max(0, 4000 - 200) = 3800 beside the activations, plus min(200, 4000) in its
    # transient (while it makes its gradient it still holds that micro-batch's activations).
    # 1F1B (or ddp over 2 ranks: buckets stay) keeps 4000.
    prof = round_profile().layer_types["gpt"]
    gpipe = layer_memory(prof, 1, 1, "ddp", False, 2, first_backward_peak=True)
    assert gpipe.gradients_at_peak == pytest.approx(3800)
    assert gpipe.persistent(4) == pytest.approx(4000 + 3800 + 8000 + 4 * 200)
    assert gpipe.transient == pytest.approx(200)
    assert layer_memory(prof, 1, 1, "ddp", False, 2).gradients_at_peak == pytest.approx(4000)
    kept = layer_memory(prof, 1, 2, "ddp", False, 2, first_backward_peak=True)
    assert kept.gradients_at_peak == pytest.approx(4000) and kept.transient == 0
    # pp 2 GPipe, world 2, m = 2, B = 4: stage 0 = layer 0 + embedding, 2 samples per
    # micro-batch. Layer 4000 + 3800 + 8000 + 2 x 200 = 16200; embedding (500 params, 20 B kept
    # per micro-batch, gradients last): 2000 + (2000 - 20) + 4000 + 2 x 20 = 8020; transient:
    # min(200, 4000) (layer) vs min(20, 2000) (embedding); reserve 1000 -> 25420 in backward.
    # The step (16000 + 4000 layer, 8000 + 2000 embedding, + 1000) needs 31000: the peak.
    plan = Plan.uniform(2, 2, global_batch_size=4, num_microbatches=2, pp=2, schedule="gpipe")
    est = evaluate(plan, SPEC2, TrainingSpec(4), FakeCluster(), round_profile())
    stage = est.stages[0]
    assert stage.peak_memory_bytes - stage.memory_breakdown["optimizer_step_excess"] == \
        pytest.approx(25420)
    assert stage.peak_memory_bytes == pytest.approx(31000)


def test_vocab_parallel_loss_all_reduces_are_charged_in_forward():
    # Head on the last stage, vocab TP 2, 2 samples of 4 tokens per rank: the loss all-reduces
    # 4 B (row max) and 8 B (target logit, sum of exponentials) per token over 2 ranks:
    # (32 + 64) B / 1e4 B/s = 0.0096 s, next to the head's forward 0.005 x 2 / 2 = 0.005 s.
    emb = round_profile().embedding
    t = embedding_time(emb, FakeCluster(), 2, "ddp", 2, 2, first=False, last=True, pp=2,
                       seq_length=4)
    assert t.forward == pytest.approx(0.005 + 0.0096)
    # Backward adds the head's input-gradient all-reduce: 50 B x 2 samples / 1e4 = 0.01 s.
    assert t.tp_comm == pytest.approx(0.0096 + 0.01)
    one = embedding_time(emb, FakeCluster(), 1, "ddp", 2, 2, first=False, last=True, pp=2,
                         seq_length=4)
    assert one.forward == pytest.approx(0.01) and one.tp_comm == 0.0  # no TP, no all-reduce


def test_relayout_cost_prices_each_direction_on_its_own_group():
    # 4 ranks, b_m = 8 samples of 50 B: the whole micro-batch is 400 B.
    c, n = FakeCluster(), 4
    # tp1 -> tp2: forward gathers each rank's half (200 B) over its tp2 pair, which holds its
    # two quarters: 1/2 x 200 / 1e4 = 0.01 s; backward only slices (each tp1 quarter lies inside
    # its tp2 half). Transient: the gathered half (it is the result, no copy).
    up = relayout_cost(c, Layout(1, True), Layout(2, True), 8, 50.0, n)
    assert (up.forward, up.backward) == (pytest.approx(0.01), 0.0)
    assert up.transient_bytes == pytest.approx(200)
    down = relayout_cost(c, Layout(2, True), Layout(1, True), 8, 50.0, n)
    assert (down.forward, down.backward) == (0.0, pytest.approx(0.01))
    # tp1 -> strided tp2: a pair {j, j+2} does not hold a half, so the whole micro-batch is
    # gathered over tp1's DP group (the stage): 3/4 x 400 / 1e4 = 0.03 s, beside the kept half
    wide = relayout_cost(c, Layout(1, True), Layout(2, False), 8, 50.0, n)
    assert (wide.forward, wide.transient_bytes) == (pytest.approx(0.03), pytest.approx(600))
    # tp2 consecutive -> strided: both ways a gather over a 2-rank DP group: 1/2 x 400 / 1e4
    swap = relayout_cost(c, Layout(2, True), Layout(2, False), 8, 50.0, n)
    assert (swap.forward, swap.backward) == (pytest.approx(0.02), pytest.approx(0.02))
    same = relayout_cost(c, Layout(2, False), Layout(2, False), 8, 50.0, n)
    assert (same.total, same.transient_bytes) == (0.0, 0.0)
    # Across a stage boundary: the sender's tp2 half (200 B) hops each way (0.02 s), then the
    # receiver re-lays it out like any relayout.
    hop = stage_boundary_cost(c, Layout(2, True), Layout(1, True), 8, 50.0, n, pp=2)
    assert (hop.forward, hop.backward) == (pytest.approx(0.02), pytest.approx(0.03))


class RecordingCluster(FakeCluster):
    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "gathers", [])

    def allgather_time(self, nbytes_total, group_size, consecutive=True, span=None):
        self.gathers.append((nbytes_total, group_size))
        return super().allgather_time(nbytes_total, group_size, consecutive, span)


def test_evaluate_prices_the_embedding_and_head_relayouts():
    # 2 ranks, vocab tp 2 (one replica) and layers tp 1 (two): embedding -> layer 0 slices in
    # forward and gathers the 2-sample micro-batch gradient (100 B) over the layers' DP group in
    # backward; layer 1 -> head gathers the activation in forward and slices in backward. Two
    # gathers of 100 B over 2 ranks per micro-batch, 1/2 x 100 / 1e4 = 0.005 s each.
    plan = Plan.uniform(2, 2, global_batch_size=4, num_microbatches=2, vocab_tp=2)
    cluster = RecordingCluster()
    est = evaluate(plan, SPEC2, TrainingSpec(4), cluster, round_profile())
    assert sorted(cluster.gathers) == [(100, 2), (100, 2)]
    flat = evaluate(Plan.uniform(2, 2, global_batch_size=4, num_microbatches=2, vocab_tp=1),
                    SPEC2, TrainingSpec(4), FakeCluster(), round_profile())
    moved = est.stages[0].microbatch_time_s - flat.stages[0].microbatch_time_s
    vocab = embedding_time(round_profile().embedding, FakeCluster(), 2, "ddp", 2, 2, True, True,
                           1, SPEC2.seq_length, "bf16")
    vocab1 = embedding_time(round_profile().embedding, FakeCluster(), 1, "ddp", 1, 2, True, True,
                            1, SPEC2.seq_length, "bf16")
    assert moved == pytest.approx(0.01 + vocab.microbatch - vocab1.microbatch)


def test_zero_gathers_move_the_compute_dtype_and_reduce_scatters_fp32():
    # zero3 over 2 ranks, 1000 parameters: each gather moves 1/2 x 1000 x (4 B fp32, 2 B bf16)
    # / 1e4 B/s (two per micro-batch), the reduce-scatter 1/2 x 4000 / 1e4 = 0.2 s either way.
    prof = round_profile().layer_types["gpt"]
    fp32 = layer_time(prof, FakeCluster(), Layout(1, True), "zero3", False, 1, 2, "fp32")
    bf16 = layer_time(prof, FakeCluster(), Layout(1, True), "zero3", False, 1, 2, "bf16")
    assert fp32.dp_comm == pytest.approx(2 * 0.2 + 0.2)
    assert bf16.dp_comm == pytest.approx(2 * 0.1 + 0.2)
    # zero2's once-per-iteration gather too: 0.1 s in bf16
    z2 = layer_time(prof, FakeCluster(), Layout(1, True), "zero2", False, 1, 2, "bf16")
    assert z2.sync == pytest.approx(0.1)
