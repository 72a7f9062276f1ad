"""GPU cost terms (docs/cost_model.md §9): hand-computed cases for every formula of
planner/cost/gpu_terms.py and their effect on evaluate_plan and the analytic profile."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.planner import ModelSpec, TrainingSpec, evaluate
from megatron_auto.planner.cost import gpu_terms as g
from megatron_auto.planner.inputs.hardware import ClusterError
from megatron_auto.planner.inputs.presets import PRESET_NAMES, get_cluster
from megatron_auto.planner.inputs.profiles import analytic_profile

from planner_fakes import FakeCluster, round_profile

pytestmark = pytest.mark.pure


def test_attention_flops_causal_fused_kernels_do_the_lower_triangle():
    # s = k = 4, h = 8: 4 s k h = 512; the lower triangle with its diagonal is 10 of 16 products
    assert g.attention_score_flops(4, 4, 8, causal=True, backend="math") == 512
    assert g.attention_score_flops(4, 4, 8, causal=True, backend="flash") == 320
    assert g.attention_score_flops(4, 4, 8, causal=True, backend="efficient") == 320
    assert g.attention_score_flops(4, 4, 8, causal=False, backend="flash") == 512
    # windowed attention (k != s) is not triangular
    assert g.attention_score_flops(4, 2, 8, causal=True, backend="flash") == 256


def test_attention_kept_and_scratch_bytes():
    # math: softmax output (2 B), its mask (1 B), dropped-out probabilities (2 B) per score
    assert g.attention_kept_bytes(2, heads=2, s=4, k=4, backend="math") == 5 * 2 * 16
    # flash: one fp32 log-sum-exp per query and head
    assert g.attention_kept_bytes(2, heads=2, s=4, k=4, backend="flash") == 4 * 2 * 4
    assert g.attention_scratch_bytes(2, 2, 4, 4, 8, "math") == 2 * 2 * 16
    assert g.attention_scratch_bytes(2, 2, 4, 4, 8, "cudnn") == 4 * 4 * 8


def test_gemm_roofline_picks_the_slower_arm():
    # 1000^3: 2e9 FLOPs at 1e12 = 2 ms; bytes 2 x 3e6 = 6e6 at 1e9 B/s = 6 ms
    assert g.gemm_time(1000, 1000, 1000, 2, 1e12, 1e9) == pytest.approx(6e-3)
    assert g.gemm_shape_class(1000, 1000, 1000, 2, 1e12, 1e9) == "memory-bound"
    assert g.gemm_time(1000, 1000, 1000, 2, 1e12, 1e12) == pytest.approx(2e-3)
    assert g.gemm_shape_class(1000, 1000, 1000, 2, 1e12, 1e12) == "compute-bound"
    assert g.gemm_time(1000, 1000, 1000, 2, 1e12, 0.0) == pytest.approx(2e-3)


def test_elementwise_bytes_and_weight_cast():
    # s=2, h=3, f=12, bf16: norms 2*2*2*6=48, residuals 2*3*2*6=72, dropouts 2*5*6=60 -> 180;
    # GELU reads and writes 2*24 elements of 2 B: 96 (SwiGLU 144); tp=2 halves the activation
    assert g.elementwise_bytes(2, 3, 12, 2, "gelu", 1) == 276
    assert g.elementwise_bytes(2, 3, 12, 2, "swiglu", 1) == 324
    assert g.elementwise_bytes(2, 3, 12, 2, "gelu", 2) == 228
    assert g.weight_cast_bytes(10, 2, mixed=True) == 60
    assert g.weight_cast_bytes(10, 4, mixed=False) == 0


def test_fused_adamw_has_no_step_temporaries_unless_sharded():
    assert g.step_temporary_bytes(True, False, 100) == 0
    assert g.step_temporary_bytes(True, True, 100) == 400
    assert g.step_temporary_bytes(False, False, 100) == 400


def _plan(world, pp, tp, vocab_tp=1, dp_mode="ddp", layers=4, m=2):
    lps = (layers // pp,) * pp
    return Plan(world_size=world, global_batch_size=16, num_microbatches=m,
                pipeline=PipelineSpec(size=pp, schedule="1f1b", layers_per_stage=lps),
                vocab=VocabStrategy(tp=vocab_tp), layers=tuple(
                    LayerStrategy(tp=tp, dp_mode=dp_mode) for _ in range(layers)))


def test_process_groups_of_a_rank_by_hand():
    # 4 ranks, pp 2 (stages {0,1}, {2,3}), layers tp 2, vocab tp 1. Rank 0: the world, its
    # stage {0,1} (also the layers' TP group and the vocab's DP group), the embedding pair
    # {0,2}, the p2p pair with rank 2; every other group is one rank.
    groups = g.rank_process_groups(_plan(4, 2, 2), 0)
    assert groups == {(0, 1, 2, 3), (0, 1), (0, 2), ("p2p", 0, 2)}
    assert g.nccl_bytes(_plan(4, 2, 2), 0, 100.0) == 400
    # 4 ranks, pp 1, tp 2 consecutive: world = stage, TP {0,1}, DP {0,2}
    assert g.rank_process_groups(_plan(4, 1, 2), 0) == {(0, 1, 2, 3), (0, 1), (0, 2)}
    # the search's bound covers every plan of the stage size
    for plan in (_plan(4, 1, 2), _plan(4, 1, 1), _plan(4, 1, 4), _plan(4, 2, 2), _plan(4, 4, 1)):
        for k in range(plan.pp_size):
            assert g.stage_nccl_bytes(plan, k, 1.0) <= g.search_nccl_bound(
                _Nccl(), plan.stage_size, plan.pp_size)


@dataclass
class _Nccl:
    nccl_communicator_bytes: float = 1.0


@dataclass(frozen=True)
class GpuFake(FakeCluster):
    fused_optimizer: bool = False
    nccl_communicator_bytes: float = 0.0
    fragmentation_fraction: float = 0.0


SPEC2 = ModelSpec.uniform(2, 64, 4, 16, 64, name="gpt")


def test_evaluate_fused_optimizer_nccl_and_fragmentation_by_hand():
    # The hand case of test_planner_cost_model: backward peak 43570 B, step peak 50400 states
    # + 10080 foreach temporaries + 1000 reserve = 51400 (binding).
    plan = Plan.uniform(2, 2, global_batch_size=4, num_microbatches=2)
    base = evaluate(plan, SPEC2, TrainingSpec(4), GpuFake(), round_profile())
    assert base.stages[0].peak_memory_bytes == pytest.approx(51400)
    # fused AdamW: the step holds the states only, 50400 + 1000 = 51400 - 10080 = 41320 < 43570
    fused = evaluate(plan, SPEC2, TrainingSpec(4), GpuFake(fused_optimizer=True), round_profile())
    assert fused.stages[0].peak_memory_bytes == pytest.approx(43570)
    assert fused.stages[0].memory_breakdown["optimizer_step_excess"] == 0
    # NCCL: world = stage = {0, 1}, one communicator of 100 B, in both peaks
    nccl = evaluate(plan, SPEC2, TrainingSpec(4), GpuFake(fused_optimizer=True,
                                                          nccl_communicator_bytes=100.0),
                    round_profile())
    assert nccl.stages[0].memory_breakdown["nccl_communicators"] == 100
    assert nccl.stages[0].peak_memory_bytes == pytest.approx(43670)
    # fragmentation 10% of activations 200 + transient 2040 + embedding activations 50 = 229 B
    frag = evaluate(plan, SPEC2, TrainingSpec(4), GpuFake(fused_optimizer=True,
                                                          fragmentation_fraction=0.1),
                    round_profile())
    assert frag.stages[0].memory_breakdown["fragmentation_reserve"] == pytest.approx(229)
    assert frag.stages[0].peak_memory_bytes == pytest.approx(43799)


def test_flash_profile_drops_the_score_matrix_and_half_the_causal_flops():
    spec = ModelSpec.uniform(2, 256, 4, 128, 1000)
    h100 = get_cluster("h100-80g-1x8")
    math_cluster = dataclasses.replace(h100, attention_backend="math", hbm_bandwidth=0.0)
    flash_cluster = dataclasses.replace(h100, hbm_bandwidth=0.0)
    training = TrainingSpec(8, precision="bf16")
    lm = analytic_profile(spec, training, math_cluster).layer_types["gpt"]
    lf = analytic_profile(spec, training, flash_cluster).layer_types["gpt"]
    s, h, a = 128, 256, 4
    assert lf.attention_backend == "flash" and lm.attention_backend == "math"
    assert lm.activation_split_bytes - lf.activation_split_bytes == pytest.approx(
        5 * a * s * s - 4 * a * s)
    assert lm.flops_per_sample - lf.flops_per_sample == pytest.approx(4 * s * s * h - 2 * s * (s + 1) * h)


def test_gpu_profile_tables_every_tp_with_replicated_elementwise_work():
    spec = ModelSpec.uniform(2, 256, 4, 128, 1000)
    cluster = get_cluster("h100-80g-1x8")
    lt = analytic_profile(spec, TrainingSpec(8, precision="bf16"), cluster).layer_types["gpt"]
    assert set(lt.forward_time_by_tp) == {1, 2, 4}
    w = cluster.hbm_bandwidth
    # the element-wise part that TP does not split: (14*2 + 2) s h bytes per sample
    replicated = 30 * 128 * 256 / w
    t1, t4 = lt.forward_time_by_tp[1][0], lt.forward_time_by_tp[4][0]
    assert t4 > t1 / 4 and t4 > replicated
    # per call: launches + 6 B per local parameter over W, a third of it in forward
    assert lt.forward_time_by_tp[2][1] == pytest.approx(50e-6 + 6 * lt.parameter_count / 2 / w / 3)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_carry_gpu_terms_with_sources(name):
    c = get_cluster(name)
    assert c.hbm_bandwidth > 0 and c.attention_backend == "flash" and c.fused_optimizer
    assert c.nccl_communicator_bytes > 0 and 0 < c.fragmentation_fraction < 1
    for word in ("spec sheet", "HBM", "NCCL_BUFFSIZE", "fragmentation", "NVLink", "InfiniBand"):
        assert word in c.source
    assert {"bf16", "fp16", "fp32"} <= set(c.peak_flops)
    assert ("fp8" in c.peak_flops) == (not name.startswith("a100"))
    again = type(c).from_dict(c.to_dict())
    assert again == c


def test_bad_gpu_fields_name_the_field():
    c = get_cluster("h100-80g-1x8")
    with pytest.raises(ClusterError, match="attention_backend='fast'"):
        dataclasses.replace(c, attention_backend="fast")
    with pytest.raises(ClusterError, match="fragmentation_fraction"):
        dataclasses.replace(c, fragmentation_fraction=1.5)
    with pytest.raises(ClusterError, match="nccl_communicator_bytes"):
        dataclasses.replace(c, nccl_communicator_bytes=-1.0)


def test_doc_preset_table_matches_the_presets():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "cost_model.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith(("| a100-", "| h100-", "| h200-"))]
    assert len(rows) == 4
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        c = get_cluster(f"{cells[0]}-1x8")
        assert float(cells[1].split()[0]) * 1e12 == c.peak_flops["bf16"]
        assert (cells[2] == "–") == ("fp8" not in c.peak_flops)
        assert float(cells[3].split()[0]) * 1e12 == c.peak_flops["fp32"]
        assert float(cells[5].split()[0]) == pytest.approx(c.hbm_bandwidth / 1e12, abs=0.006)
        assert float(cells[6].split()[0]) * 1e9 == c.intra_node_busbw
