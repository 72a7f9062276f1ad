"""Calibration recovers known correction terms from synthetic runs; bad inputs fail clearly.

Synthetic "measurements" are the cost model's own prices under TRUE terms (time scale 1.25,
overlap slowdown 1.3, communication latencies x2, reserve 3 GiB, activation scale 1.15) that differ from the starting
cluster/profile; the fit starts from the latter and must land on the former.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_auto.config import ModelConfig
from megatron_auto.plan import Plan
from megatron_auto.planner.cost.estimate import evaluate_plan
from megatron_auto.planner.inputs.hardware import GiB, ClusterSpec
from megatron_auto.planner.inputs.model_spec import TrainingSpec
from megatron_auto.families.registry import model_spec, spec_of_record
from megatron_auto.planner.inputs.presets import make_cluster
from megatron_auto.planner.inputs.profiles import ModelProfile, analytic_profile
from megatron_auto.planner import calibrate as cal

pytestmark = pytest.mark.pure

CFG = ModelConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=1024,
                  vocab_size=32000)
SPEC = model_spec(CFG)
TRAINING = TrainingSpec(global_batch_size=32, precision="bf16")
CLUSTER = make_cluster("a100-40g", 1, 8)  # overlap 1.1256, reserve 1.5 GiB
PROFILE = analytic_profile(SPEC, TRAINING, CLUSTER)
TRUE = {"time_scale": 1.25, "overlap": 1.3, "reserve": 3 * GiB, "activation_scale": 1.15,
        "latency_scale": 2.0}
# (tp, dp_mode, recompute, num_microbatches, pp): DP traffic that overlaps, and different
# activation shares so that every term is identifiable.
SHAPES = [(1, "ddp", False, 4, 1), (2, "zero3", True, 8, 1), (4, "zero2", False, 2, 2),
          (8, "ddp", False, 4, 1), (1, "zero3", False, 8, 2), (2, "ddp", True, 4, 1)]


def _plans() -> list[Plan]:
    return [Plan.uniform(8, 4, global_batch_size=32, num_microbatches=m, tp=tp, dp_mode=mode,
                         recompute=rec, pp=pp, model=CFG.to_dict())
            for tp, mode, rec, m, pp in SHAPES]


def _measure(plan: Plan, cluster: ClusterSpec, profile: ModelProfile) -> tuple[float, float]:
    est = evaluate_plan(plan, SPEC, TRAINING, cluster, profile)
    return est.iteration_time_s, est.peak_memory_bytes


def _true_cluster() -> ClusterSpec:
    return dataclasses.replace(cal.scale_latencies(CLUSTER, TRUE["latency_scale"]),
                               overlap_slowdown=TRUE["overlap"],
                               memory_reserve_bytes=TRUE["reserve"])


def _runs(profile_mode: str) -> list[cal.RunMeasurement]:
    true_cluster = _true_cluster()
    if profile_mode == "measured":
        truth = cal.scale_profile(PROFILE, TRUE["time_scale"], TRUE["activation_scale"])
    else:  # analytic: slower compute means lower sustained FLOP/s of the cluster
        slower = cal.scale_cluster_flops(true_cluster, TRUE["time_scale"])
        truth = cal.scale_profile(analytic_profile(SPEC, TRAINING, slower), 1.0,
                                  TRUE["activation_scale"])
    runs = []
    for plan in _plans():
        t, m = _measure(plan, true_cluster, truth)
        runs.append(cal.RunMeasurement(plan, "plan.json", "metrics.jsonl", t, m, 1))
    return runs


def test_fit_recovers_true_terms_with_a_measured_profile():
    result = cal.fit_calibration(_runs("measured"), CLUSTER, PROFILE, spec_of=spec_of_record)
    assert result.time_scale == pytest.approx(TRUE["time_scale"], rel=1e-4)
    assert result.overlap_slowdown == pytest.approx(TRUE["overlap"], rel=1e-4)
    assert result.latency_scale == pytest.approx(TRUE["latency_scale"], rel=1e-4)
    assert result.memory_reserve_bytes == pytest.approx(TRUE["reserve"], rel=1e-4)
    assert result.activation_scale == pytest.approx(TRUE["activation_scale"], rel=1e-4)
    assert result.time_rms_error_before > 0.05 and result.time_rms_error_after < 1e-5
    assert result.memory_rms_error_after < 1e-5 and not result.notes


def test_fit_recovers_compute_efficiency_with_the_analytic_profile():
    result = cal.fit_calibration(_runs("analytic"), CLUSTER, None, precision="bf16",
                                 spec_of=spec_of_record)
    assert result.time_scale == pytest.approx(TRUE["time_scale"], rel=1e-4)
    assert result.overlap_slowdown == pytest.approx(TRUE["overlap"], rel=1e-4)
    new_cluster, new_profile = cal.apply_calibration(result, CLUSTER, None)
    assert new_profile is None
    # 0.78 efficiency / 1.25 = 0.624 of the spec-sheet peak.
    assert new_cluster.compute_efficiency == pytest.approx(0.78 / 1.25, rel=1e-4)
    assert new_cluster.memory_reserve_bytes == pytest.approx(3 * GiB, rel=1e-4)


def test_calibrated_profiles_reproduce_the_measurements():
    runs = _runs("measured")
    result = cal.fit_calibration(runs, CLUSTER, PROFILE, spec_of=spec_of_record)
    new_cluster, new_profile = cal.apply_calibration(result, CLUSTER, PROFILE)
    for run in runs:
        t, m = _measure(run.plan, new_cluster, new_profile)
        assert t == pytest.approx(run.iteration_time_s, rel=1e-4)
        assert m == pytest.approx(run.peak_memory_bytes, rel=1e-4)
    assert new_profile.metadata["calibration"]["time_scale"] == pytest.approx(1.25, rel=1e-4)


def test_one_run_fits_scale_and_reserve_and_says_what_it_kept():
    result = cal.fit_calibration(_runs("measured")[:1], CLUSTER, PROFILE, spec_of=spec_of_record)
    assert result.overlap_slowdown == CLUSTER.overlap_slowdown
    assert result.activation_scale == 1.0
    assert any("overlap_slowdown kept" in n for n in result.notes)
    assert any("activation_scale kept" in n for n in result.notes)
    assert result.time_rms_error_after < 1e-6 and result.memory_rms_error_after < 1e-6


def test_least_squares_hand_checked_line():
    # y = 2x + 1 at x = 0..3: residuals of (a, b) are a*x + b - y; the optimum is (2, 1).
    xs = [0.0, 1.0, 2.0, 3.0]
    ys = [1.0, 3.0, 5.0, 7.0]
    import numpy as np
    (a, b), free = cal.least_squares(
        lambda p: np.array([p[0] * x + p[1] - y for x, y in zip(xs, ys)]), [0.5, 0.0],
        [-10.0, -10.0])
    assert free == [True, True]
    assert a == pytest.approx(2.0, abs=1e-6) and b == pytest.approx(1.0, abs=1e-6)


# ----------------------------------------------------------------------------- files and CLI
def _write_run(tmp_path, index: int, plan: Plan, t: float, m: float, extra=None) -> tuple[str, str]:
    plan_path = tmp_path / f"plan{index}.json"
    plan.save(plan_path)
    metrics = tmp_path / f"metrics{index}.jsonl"
    lines = []
    for it in range(1, 5):
        # The first iteration is a slow warm-up that calibration must skip.
        record = {"iteration": it, "iteration_time_s": t * (3.0 if it == 1 else 1.0),
                  "peak_memory_bytes": m, "predicted_iteration_time_s": 1.0,
                  "predicted_peak_memory_bytes": 2.0, **(extra or {})}
        lines.append(json.dumps(record))
    metrics.write_text("\n".join(lines) + "\n")
    return str(metrics), str(plan_path)


def test_calibrate_files_writes_cluster_and_profile(tmp_path):
    runs = [_write_run(tmp_path, i, r.plan, r.iteration_time_s, r.peak_memory_bytes)
            for i, r in enumerate(_runs("measured"))]
    cluster_path, profile_path = tmp_path / "cluster.json", tmp_path / "profile.json"
    CLUSTER.save(cluster_path)
    PROFILE.save(profile_path)
    result = cal.calibrate_files(runs, str(cluster_path), str(profile_path), spec_of=spec_of_record)
    assert result.time_scale == pytest.approx(1.25, rel=1e-4)
    written = ClusterSpec.load(cluster_path)
    assert written.overlap_slowdown == pytest.approx(1.3, rel=1e-4)
    assert written.memory_reserve_bytes == pytest.approx(3 * GiB, rel=1e-4)
    assert written.compute_efficiency == CLUSTER.compute_efficiency  # went into the profile
    profile = ModelProfile.load(profile_path)
    lt, base = profile.layer_types["gpt"], PROFILE.layer_types["gpt"]
    assert lt.forward_time_per_sample_s == pytest.approx(1.25 * base.forward_time_per_sample_s)
    assert lt.activation_split_bytes == pytest.approx(1.15 * base.activation_split_bytes, rel=1e-4)


def test_preset_cluster_needs_an_output_file(tmp_path):
    runs = [_write_run(tmp_path, 0, _plans()[0], 1.0, 8e9)]
    with pytest.raises(cal.CalibrationError, match="--cluster a100-40g-1x8 is a preset.*--cluster-out"):
        cal.calibrate_files(runs, "a100-40g-1x8", precision="bf16", spec_of=spec_of_record)


def test_missing_metrics_field_is_named(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"iteration": 1, "iteration_time_s": 0.5}) + "\n")
    with pytest.raises(cal.CalibrationError,
                       match=r"m.jsonl line 1: field peak_memory_bytes=None: needs a positive"):
        cal.read_metrics(path)


def test_wrong_file_formats_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("iteration 1 | lm loss: 3.2\n")
    with pytest.raises(cal.CalibrationError, match="bad.jsonl line 1: not a JSON object"):
        cal.read_metrics(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(cal.CalibrationError, match="holds no records"):
        cal.read_metrics(empty)
    metrics, _ = _write_run(tmp_path, 0, _plans()[0], 1.0, 8e9)
    not_a_plan = tmp_path / "cluster_not_plan.json"
    CLUSTER.save(not_a_plan)
    with pytest.raises(cal.CalibrationError, match="plan file .*cluster_not_plan.json"):
        cal.load_run(metrics, not_a_plan)


def test_plan_without_model_record_and_mismatched_world(tmp_path):
    plan = Plan.uniform(8, 4, global_batch_size=32, num_microbatches=4)
    run = cal.RunMeasurement(plan, "p.json", "m.jsonl", 1.0, 8e9, 1)
    with pytest.raises(cal.CalibrationError, match="p.json: has no 'model' record"):
        cal.fit_calibration([run], CLUSTER, PROFILE, spec_of=spec_of_record)
    small = make_cluster("a100-40g", 1, 4)
    with pytest.raises(cal.CalibrationError, match="world_size=8 but cluster .* has 4 devices"):
        cal.fit_calibration(_runs("measured")[:1], small, PROFILE, spec_of=spec_of_record)
    with pytest.raises(cal.CalibrationError, match="--precision is missing"):
        cal.fit_calibration(_runs("measured")[:1], CLUSTER, None, spec_of=spec_of_record)


def test_read_metrics_skips_warmup_and_takes_median_and_max(tmp_path):
    metrics, _ = _write_run(tmp_path, 0, _plans()[0], 0.5, 7e9)
    out = cal.read_metrics(metrics, skip_iterations=1)
    assert out["iteration_time_s"] == 0.5 and out["peak_memory_bytes"] == 7e9
    assert out["num_records"] == 3 and out["predicted_iteration_time_s"] == 1.0
    assert cal.read_metrics(metrics, skip_iterations=0)["iteration_time_s"] == 0.5  # median


def test_a_logged_prediction_from_other_profiles_is_flagged():
    runs = _runs("measured")
    priced_here = _measure(runs[0].plan, CLUSTER, PROFILE)[0]
    consistent = dataclasses.replace(runs[0], predicted_iteration_time_s=priced_here)
    foreign = dataclasses.replace(runs[1], metrics_path="other.jsonl",
                                  predicted_iteration_time_s=123.0)
    result = cal.fit_calibration([consistent, foreign, *runs[2:]], CLUSTER, PROFILE,
                                 spec_of=spec_of_record)
    flagged = [n for n in result.notes if "logged a prediction" in n]
    assert len(flagged) == 1 and flagged[0].startswith("other.jsonl")
