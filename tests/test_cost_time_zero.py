"""Data-parallel time terms priced as the runtime issues them: ``ddp`` gradients in buckets
(one all-reduce per bucket, not per layer) and ZeRO on the vocab modules unit by unit (the
counts come from what FSDP2 was seen to issue; ``tests/test_collective_count.py`` checks them
against a real training step)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import pytest

from megatron_auto.layout import Layout
from megatron_auto.planner.cost.memory_model import vocab_parameters
from megatron_auto.planner.cost.time_model import (DDP_BUCKET_BYTES, embedding_time, layer_time,
                                                   vocab_dp_collectives, vocab_units)

from planner_fakes import FakeCluster, round_profile

LATENCY = 1e-3


@dataclass(frozen=True)
class LatencyCluster(FakeCluster):
    """FakeCluster whose all-reduce pays ``LATENCY`` per call."""

    def allreduce_time(self, nbytes, group_size, consecutive=True, span=None):
        base = super().allreduce_time(nbytes, group_size, consecutive, span)
        return base + LATENCY if base > 0 else 0.0


@pytest.mark.pure
def test_ddp_layers_pay_one_latency_per_bucket_not_per_layer():
    # Four layers whose fp32 gradients fill half a bucket each: the runtime packs them into two
    # buckets and issues two all-reduces over the 2 replicas, i.e. 2 latencies plus every byte
    # once at the ring rate (2 (g - 1)/g = 1 byte-time per byte for g = 2).
    cluster = LatencyCluster(bandwidth=1e9)
    params = DDP_BUCKET_BYTES // 8  # 4 B each: half a bucket
    lt = replace(round_profile("fp32").layer_types["gpt"], parameter_count=params)
    syncs = [layer_time(lt, cluster, Layout(1, True), "ddp", False, 2, 2).sync
             for _ in range(4)]
    runtime_calls = 2
    assert sum(syncs) == pytest.approx(runtime_calls * LATENCY + 4 * 4 * params / 1e9)
    # One layer of three buckets: three calls.
    big = replace(lt, parameter_count=3 * DDP_BUCKET_BYTES // 4)
    assert layer_time(big, cluster, Layout(1, True), "ddp", False, 2, 2).sync == \
        pytest.approx(3 * LATENCY + 3 * DDP_BUCKET_BYTES / 1e9)


@pytest.mark.pure
def test_vocab_units_are_the_runtimes_fsdp_units():
    emb = round_profile().embedding  # 500 embedding params, 20 head params (the final norm), tied
    # One stage, tied: the embedding unit serves embed() and logits(): used twice per forward.
    assert vocab_units(emb, 1, True, True, 1) == [(500, 2), (20, 1)]
    # Last of two stages, tied: the final norm and the stage's own copy of the embedding.
    assert vocab_units(emb, 1, False, True, 2) == [(20, 1), (500, 1)]
    assert vocab_units(emb, 2, True, False, 2) == [(250, 1)]
    untied = replace(emb, tied=False, head_parameters=20 + 64 * 8, final_norm_parameters=20)
    assert vocab_units(untied, 1, True, True, 1) == [(500, 1), (20, 1), (512, 1)]
    # The norm's share unknown (older profiles): the head stays one unit.
    assert vocab_units(replace(untied, final_norm_parameters=0), 1, False, True, 2) == [(532, 1)]
    for profile in (emb, untied):
        for first, last, pp in ((True, True, 1), (True, False, 2), (False, True, 2)):
            assert sum(p for p, _ in vocab_units(profile, 1, first, last, pp)) == \
                vocab_parameters(profile, 1, first, last, pp)


@pytest.mark.pure
def test_vocab_zero_collective_counts_per_micro_batch_and_iteration():
    emb = round_profile("fp32").embedding
    # Seen from FSDP2 on one tied stage, ZeRO-3: the embedding gathered for embed and logits in
    # forward and again for both in backward, the final norm once each way; one reduce-scatter
    # per unit. ZeRO-2: the embedding twice per iteration, the norm once; reduce-scatters alike.
    z3 = vocab_dp_collectives(emb, 1, 2, "zero3", True, True, 1, "fp32")
    assert sorted(c.nbytes for c in z3.forward) == [80, 2000, 2000]
    assert sorted((c.kind, c.nbytes) for c in z3.backward) == [
        ("zero_gather", 80), ("zero_gather", 2000), ("zero_gather", 2000),
        ("zero_scatter", 80), ("zero_scatter", 2000)]
    z2 = vocab_dp_collectives(emb, 1, 2, "zero2", True, True, 1, "bf16")
    assert z2.forward == ()
    assert sorted(c.nbytes for c in z2.per_iteration) == [40, 1000, 1000]  # bf16 gathers
    assert sorted(c.nbytes for c in z2.backward) == [80, 2000]  # fp32 reduce-scatters
    # Priced: with the fake ring ((g - 1)/g = 1/2 byte-time per byte, no latency) the ZeRO-3
    # forward gathers move 80 + 2000 + 2000 bytes at 1e4 B/s.
    t = embedding_time(emb, FakeCluster(), 1, "zero3", 4, 2, True, True, 1, 16, "fp32")
    assert t.dp_comm == pytest.approx((2 * 4080 + 2080) / 2 / 1e4)


@pytest.mark.single
def test_the_runtimes_ddp_bucket_is_the_one_priced():
    from megatron_auto.parallel.data_parallel import DataParallel
    from megatron_auto.parallel.ddp_buckets import GradBuckets

    for cls in (DataParallel, GradBuckets):
        assert inspect.signature(cls.__init__).parameters["bucket_size_bytes"].default == \
            DDP_BUCKET_BYTES


def _vocab_step(rank: int, world_size: int, plan_dict: dict, untie: bool) -> list:
    import torch

    from megatron_auto.config import ModelConfig
    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.plan import Plan
    from megatron_auto.training.trainer import build_trainer, train_step
    from test_collective_count import CONFIG, recording

    cfg = ModelConfig.from_dict({**CONFIG.to_dict(), "untie_embeddings_and_output_weights": untie})
    trainer = build_trainer(cfg, Plan.from_dict(plan_dict),
                            lambda c, ctx, seed: GPTStage(c, ctx, seed=seed))
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.seq_length + 1), generator=gen)
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "loss_mask": torch.ones(8, cfg.seq_length),
             "position_ids": torch.arange(cfg.seq_length).expand(8, -1).contiguous()}
    with recording() as calls:
        train_step(trainer, batch if trainer.reads_data else None)
    return calls


@pytest.mark.multirank
@pytest.mark.parametrize("pp, mode, untie", [(1, "zero3", False), (1, "zero2", True),
                                             (2, "zero2", False)])
def test_vocab_zero_units_gather_and_scatter_what_the_cost_model_prices(pp, mode, untie):
    from collections import Counter

    from dist_utils import run_distributed
    from megatron_auto.config import ModelConfig
    from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
    from megatron_auto.planner import TrainingSpec
    from megatron_auto.families.registry import model_spec
    from megatron_auto.planner.cost.collectives import stage_collectives
    from megatron_auto.planner.inputs.profiles import analytic_profile
    from test_collective_count import CONFIG, _is_block

    world = 2 * pp  # 2-rank stages; tp-2 layers (no ZeRO of their own), vocab tp 1 over dp 2
    plan = Plan(world_size=world, global_batch_size=8, num_microbatches=2,
                pipeline=PipelineSpec(pp, "1f1b", (5,) if pp == 1 else (2, 3)),
                vocab=VocabStrategy(dp_mode=mode), layers=(LayerStrategy(tp=2),) * 5)
    per_rank = run_distributed(_vocab_step, world, plan.to_dict(), untie)
    cfg = ModelConfig.from_dict({**CONFIG.to_dict(), "untie_embeddings_and_output_weights": untie})
    spec = model_spec(cfg)
    profile = analytic_profile(spec, TrainingSpec(8, "fp32"), FakeCluster())
    as_called = {"all_gather": "all_gather", "zero_gather": "all_gather",
                 "zero_scatter": "reduce_scatter"}
    for rank, calls in enumerate(per_rank):
        priced: Counter = Counter()
        for c, count in stage_collectives(plan, spec, profile, "fp32",
                                          plan.stage_of_rank(rank)).items():
            if c.kind in as_called:
                priced[(as_called[c.kind], c.group_size, c.consecutive, c.nbytes)] += count
        issued = Counter((kind, len(ranks), _is_block(ranks), float(nbytes))
                         # the stage hop's sends/recvs are the pipeline census's (issue 28)
                         for kind, ranks, nbytes, _ in calls
                         if kind not in ("all_reduce", "send", "recv"))
        # the last stage's tied copy is the word embedding alone (no position rows)
        assert issued == priced, f"rank {rank}: runtime {dict(issued)} != priced {dict(priced)}"
