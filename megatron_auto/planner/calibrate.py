"""Calibration: fit the cost model's correction terms to measured runs, write them into profiles.

Pure computation over plan files, metrics files and profiles (numpy, no torch): it sits next to
the cost model it inverts. The ``megatron-auto calibrate`` command is ``profiler/cli.py``.

Inputs are runs: a metrics file (``--metrics-file`` JSON lines of a training run, docs/design.md §5.3)
and the plan file it trained with (its ``model`` record names the model). The plans are priced
again with the planner's own cost model (:func:`.cost_model.evaluate_plan`) while four
terms vary; least squares on relative errors picks them (math: docs/profiling.md §4):

- time: ``time_scale`` ``s`` multiplies every compute time of the model profile (equivalently
  divides the cluster's sustained FLOP/s: ``compute_efficiency / s``), ``latency_scale`` ``l``
  multiplies every per-call communication latency of the cluster (collectives, p2p, ZeRO's: a
  call inside a training step also pays the ranks' drift, which a profiler timing calls alone
  sees only in part), and ``overlap_slowdown`` ``g`` is the cluster's compute/communication
  interference; ``min_{s,l,g} sum_i (T_i(s, l, g) / T_i^meas - 1)^2``;
- memory: ``memory_reserve_bytes`` ``R`` (CUDA context, allocator caching and fragmentation)
  and ``activation_scale`` ``a`` multiplying every activation byte of the profile;
  ``min_{R,a} sum_i ((R + M_i(a)) / M_i^meas - 1)^2``, ``M_i`` the predicted peak without reserve.

A term the runs cannot tell apart (no overlapped communication for ``g``; one run, or runs with
the same activation share, for ``a``) keeps its current value and the result says so. The fitted
terms go into the cluster JSON (``overlap_slowdown``, ``memory_reserve_bytes`` and, with no model
profile, ``compute_efficiency``) and into the model profile JSON (times and activations scaled).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..plan import Plan, PlanError
from .cost.estimate import evaluate_plan
from .inputs.hardware import GiB, ClusterSpec
from .inputs.model_spec import ModelSpec, TrainingSpec
from .inputs.presets import get_cluster
from .inputs.profiles import ModelProfile, analytic_profile

MEASURED_FIELDS = ("iteration_time_s", "peak_memory_bytes")
# Relative gap between a run's logged prediction and our re-pricing that earns a warning note.
PREDICTION_MISMATCH = 0.05
PREDICTED_FIELDS = ("predicted_iteration_time_s", "predicted_peak_memory_bytes")
_LAYER_TIME_FIELDS = ("forward_time_per_sample_s", "forward_time_constant_s")
_LAYER_ACT_FIELDS = ("activation_replicated_bytes", "activation_split_bytes",
                     "recompute_bytes_per_sample", "backward_scratch_replicated_bytes",
                     "backward_scratch_split_bytes")
_EMB_TIME_FIELDS = ("embedding_forward_time_per_sample_s", "head_forward_time_per_sample_s",
                    "forward_time_constant_s")
_EMB_ACT_FIELDS = ("embedding_activation_bytes", "head_activation_replicated_bytes",
                   "head_activation_split_bytes", "head_transient_split_bytes")


class CalibrationError(ValueError):
    """Unusable calibration input; the message names the file, the field and the fix."""


# ------------------------------------------------------------------------------ measurements
@dataclass(frozen=True)
class RunMeasurement:
    """One measured run: the plan it used and its measured (and, if logged, predicted) costs."""

    plan: Plan
    plan_path: str
    metrics_path: str
    iteration_time_s: float  # median over the kept iterations
    peak_memory_bytes: float  # maximum over the kept iterations
    num_records: int
    predicted_iteration_time_s: float | None = None
    predicted_peak_memory_bytes: float | None = None


def read_metrics(path: str | os.PathLike, skip_iterations: int = 2) -> dict[str, Any]:
    """Measured costs of one metrics file: median iteration time and maximum peak memory.

    The first ``skip_iterations`` records are dropped (warm-up: allocator growth, lazy
    communicator setup; on CPU the memory tracker also slows iterations 1-2, see
    training/pretrain.py) unless nothing would be left.
    """
    records: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise CalibrationError(
                        f"metrics file {path} line {lineno}: not a JSON object ({err.msg}); a "
                        f"metrics file holds one JSON object per line (--metrics-file)") from None
                if not isinstance(record, dict):
                    raise CalibrationError(f"metrics file {path} line {lineno}: expected a JSON "
                                           f"object, got {type(record).__name__}")
                for name in MEASURED_FIELDS:
                    value = record.get(name)
                    if not isinstance(value, (int, float)) or isinstance(value, bool) \
                            or not math.isfinite(value) or value <= 0:
                        raise CalibrationError(
                            f"metrics file {path} line {lineno}: field {name}={value!r}: needs a "
                            f"positive number; write the file with a training run that measures "
                            f"it (--metrics-file)")
                records.append(record)
    except OSError as err:
        raise CalibrationError(f"metrics file {path}: cannot read it ({err.strerror})") from None
    if not records:
        raise CalibrationError(f"metrics file {path}: holds no records; train with "
                               f"--metrics-file {path} first")
    kept = records[skip_iterations:] or records
    out: dict[str, Any] = {
        "iteration_time_s": float(np.median([r["iteration_time_s"] for r in kept])),
        "peak_memory_bytes": float(max(r["peak_memory_bytes"] for r in kept)),
        "num_records": len(kept)}
    for name in PREDICTED_FIELDS:
        values = [r[name] for r in kept if isinstance(r.get(name), (int, float))]
        out[name] = float(np.median(values)) if values else None
    return out


def load_run(metrics_path: str | os.PathLike, plan_path: str | os.PathLike,
             skip_iterations: int = 2) -> RunMeasurement:
    try:
        plan = Plan.load(plan_path)
    except PlanError as err:
        raise CalibrationError(f"plan file {plan_path}: {err}") from None
    measured = read_metrics(metrics_path, skip_iterations)
    return RunMeasurement(plan=plan, plan_path=os.fspath(plan_path),
                          metrics_path=os.fspath(metrics_path), **measured)


#: A recorded model (a plan's ``model``) -> its spec; the caller knows the model families
#: (``megatron_auto.families.registry.spec_of_record``), the planner does not.
SpecOfRecord = Callable[[Mapping[str, Any]], ModelSpec]


def model_spec_of(plan: Plan, where: str, spec_of: SpecOfRecord) -> ModelSpec:
    """The model a plan was made for, from its ``model`` record (written by the planner)."""
    if not plan.model:
        raise CalibrationError(f"plan file {where}: has no 'model' record; calibrate needs plans "
                               f"written by `megatron-auto plan` (or add the ModelConfig fields)")
    try:
        return spec_of(plan.model)
    except ValueError as err:  # the family's config rejects the record
        raise CalibrationError(f"plan file {where}: field model: {err}") from None


# ------------------------------------------------------------------------- profile scaling
def scale_profile(profile: ModelProfile, time_scale: float = 1.0,
                  activation_scale: float = 1.0) -> ModelProfile:
    """``profile`` with every compute time times ``time_scale`` and activation byte times
    ``activation_scale`` (parameters and per-parameter weight copies are exact: unchanged)."""
    layers = {}
    for key, lt in profile.layer_types.items():
        changes: dict[str, Any] = {f: getattr(lt, f) * time_scale for f in _LAYER_TIME_FIELDS}
        changes.update({f: getattr(lt, f) * activation_scale for f in _LAYER_ACT_FIELDS})
        changes["forward_time_by_tp"] = {t: (a * time_scale, b * time_scale)
                                         for t, (a, b) in lt.forward_time_by_tp.items()}
        changes["activation_bytes_by_tp"] = {t: v * activation_scale
                                             for t, v in lt.activation_bytes_by_tp.items()}
        layers[key] = dataclasses.replace(lt, **changes)
    emb = profile.embedding
    emb_changes = {f: getattr(emb, f) * time_scale for f in _EMB_TIME_FIELDS}
    emb_changes.update({f: getattr(emb, f) * activation_scale for f in _EMB_ACT_FIELDS})
    return dataclasses.replace(profile, layer_types=layers,
                               embedding=dataclasses.replace(emb, **emb_changes))


LATENCY_FIELDS = ("collective_latency_s", "inter_node_latency_s", "p2p_latency_s",
                  "zero_gather_latency_s", "zero_scatter_latency_s")


def scale_latencies(cluster: ClusterSpec, latency_scale: float) -> ClusterSpec:
    """``cluster`` with every per-call communication latency times ``latency_scale``."""
    return dataclasses.replace(cluster, **{f: getattr(cluster, f) * latency_scale
                                           for f in LATENCY_FIELDS})


def scale_cluster_flops(cluster: ClusterSpec, time_scale: float) -> ClusterSpec:
    """``cluster`` whose sustained FLOP/s are divided by ``time_scale``: the efficiency moves
    first; past 1.0 the peaks grow instead (a CPU profile measures its peak, efficiency 1)."""
    efficiency = cluster.compute_efficiency / time_scale
    if efficiency <= 1.0:
        return dataclasses.replace(cluster, compute_efficiency=efficiency)
    peaks = {p: f * efficiency for p, f in cluster.peak_flops.items()}
    return dataclasses.replace(cluster, compute_efficiency=1.0, peak_flops=peaks)


# ------------------------------------------------------------------------- least squares
def least_squares(residuals: Callable[[np.ndarray], np.ndarray], x0: Sequence[float],
                  lower: Sequence[float], priority: Sequence[int] | None = None,
                  max_iter: int = 200) -> tuple[np.ndarray, list[bool]]:
    """Levenberg-Marquardt on ``sum(residuals(x)^2)`` with ``x >= lower``, numeric Jacobian.

    Parameters whose Jacobian columns add no rank at ``x0`` (in ``priority`` order: earlier ones
    win) are not identifiable from the data and stay at ``x0``. Returns ``(x, free)``.
    """
    x = np.asarray(x0, dtype=np.float64).copy()
    low = np.asarray(lower, dtype=np.float64)
    order = list(priority) if priority is not None else list(range(x.size))

    def jacobian(at: np.ndarray, base: np.ndarray, cols: list[int]) -> np.ndarray:
        jac = np.zeros((base.size, len(cols)))
        for k, j in enumerate(cols):
            step = 1e-6 * max(abs(at[j]), 1.0)
            moved = at.copy()
            moved[j] += step
            jac[:, k] = (residuals(moved) - base) / step
        return jac

    r = residuals(x)
    full = jacobian(x, r, list(range(x.size)))
    free: list[int] = []
    for j in order:
        trial = free + [j]
        if np.linalg.matrix_rank(full[:, trial], tol=1e-9 * max(1.0, np.abs(full).max())) == len(trial):
            free.append(j)
    if not free:
        return x, [False] * x.size
    cost, lam = float(r @ r), 1e-3
    for _ in range(max_iter):
        jac = jacobian(x, r, free)
        gram = jac.T @ jac
        grad = jac.T @ r
        improved = False
        while lam < 1e12:
            step = np.linalg.solve(gram + lam * np.diag(np.diag(gram) + 1e-18), -grad)
            trial = x.copy()
            trial[free] = np.maximum(low[free], x[free] + step)
            r_trial = residuals(trial)
            cost_trial = float(r_trial @ r_trial)
            if cost_trial < cost:
                improved = True
                done = cost - cost_trial <= 1e-15 * max(cost, 1e-30) or \
                    np.all(np.abs(trial - x) <= 1e-12 * np.maximum(np.abs(x), 1.0))
                x, r, cost, lam = trial, r_trial, cost_trial, max(lam / 3.0, 1e-12)
                break
            lam *= 4.0
        if not improved or done or cost < 1e-30:
            break
    return x, [j in free for j in range(x.size)]


# ---------------------------------------------------------------------------------- the fit
@dataclass(frozen=True)
class Calibration:
    """Fitted correction terms, relative errors before/after, and notes on what was kept."""

    time_scale: float
    overlap_slowdown: float
    memory_reserve_bytes: float
    activation_scale: float
    time_rms_error_before: float
    time_rms_error_after: float
    memory_rms_error_before: float
    memory_rms_error_after: float
    num_runs: int
    notes: tuple[str, ...] = field(default=())
    latency_scale: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        lines = [f"calibrated on {self.num_runs} run(s):",
                 f"  compute time scale {self.time_scale:.4f} (measured / profiled compute)",
                 f"  latency scale      {self.latency_scale:.4f} (communication per call)",
                 f"  overlap slowdown   {self.overlap_slowdown:.4f}",
                 f"  memory reserve     {self.memory_reserve_bytes / GiB:.3f} GiB",
                 f"  activation scale   {self.activation_scale:.4f}",
                 f"  iteration time RMS relative error {self.time_rms_error_before:.2%} -> "
                 f"{self.time_rms_error_after:.2%}",
                 f"  peak memory RMS relative error    {self.memory_rms_error_before:.2%} -> "
                 f"{self.memory_rms_error_after:.2%}"]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def fit_calibration(runs: Sequence[RunMeasurement], cluster: ClusterSpec,
                    profile: ModelProfile | None = None,
                    precision: str | None = None, *, spec_of: SpecOfRecord) -> Calibration:
    """Fit ``(time_scale, overlap_slowdown)`` and ``(memory_reserve_bytes, activation_scale)``.

    ``profile`` is the model profile the plans were priced with (None: the analytic profile of
    ``cluster``, whose compute then scales through the cluster's FLOP/s). ``precision`` defaults
    to the profile's. ``spec_of`` reads the model spec from a plan's ``model`` record.
    """
    if not runs:
        raise CalibrationError("calibrate needs at least one run (--run METRICS PLAN)")
    precision = precision or (profile.precision if profile else None)
    if precision is None:
        raise CalibrationError("--precision is missing: give the precision the runs trained in "
                               "(fp32, bf16 or fp16) or pass --model-profile")
    cases = []
    for run in runs:
        spec = model_spec_of(run.plan, run.plan_path, spec_of)
        training = TrainingSpec(global_batch_size=run.plan.global_batch_size, precision=precision)
        if run.plan.world_size != cluster.world_size:
            raise CalibrationError(
                f"plan file {run.plan_path}: world_size={run.plan.world_size} but cluster "
                f"{cluster.name!r} has {cluster.world_size} devices; pass the cluster the run used")
        cases.append((run, spec, training))

    def priced(time_scale: float, overlap: float, activation_scale: float,
               reserve: float, latency_scale: float = 1.0) -> list[tuple[float, float]]:
        out = []
        c = dataclasses.replace(scale_latencies(cluster, latency_scale),
                                overlap_slowdown=max(1.0, overlap),
                                memory_reserve_bytes=int(reserve))
        for run, spec, training in cases:
            if profile is None:
                base = analytic_profile(spec, training, scale_cluster_flops(c, time_scale))
                p = scale_profile(base, 1.0, activation_scale)
            else:
                p = scale_profile(profile, time_scale, activation_scale)
            est = evaluate_plan(run.plan, spec, training, c, p)
            out.append((est.iteration_time_s, est.peak_memory_bytes))
        return out

    t_meas = np.array([r.iteration_time_s for r in runs])
    m_meas = np.array([r.peak_memory_bytes for r in runs])
    g0 = cluster.overlap_slowdown

    def time_residuals(x: np.ndarray) -> np.ndarray:  # x = (time scale, overlap, latency scale)
        return np.array([t for t, _ in priced(x[0], x[1], 1.0, 0, x[2])]) / t_meas - 1.0

    # Memory: price once per activation scale with reserve 0, then add R (in GiB for scaling).
    def memory_residuals(x: np.ndarray) -> np.ndarray:
        peaks = np.array([m for _, m in priced(1.0, g0, x[1], 0)])
        return (peaks + x[0] * GiB) / m_meas - 1.0

    notes: list[str] = []
    t_before = time_residuals(np.array([1.0, g0, 1.0]))
    # The runs' own logged predictions should equal what these profiles say about their plans;
    # if not, the plans were priced with another cluster or model profile than the one given.
    repriced = priced(1.0, g0, 1.0, cluster.memory_reserve_bytes)
    for run, (t_now, _) in zip(runs, repriced):
        logged = run.predicted_iteration_time_s
        if logged and abs(t_now / logged - 1.0) > PREDICTION_MISMATCH:
            notes.append(f"{run.metrics_path}: its plan prices at {t_now:.4g} s with this "
                         f"cluster/profile but the run logged a prediction of {logged:.4g} s; "
                         f"pass the --cluster and --model-profile the plan was made with")
    (s, g, lat), t_free = least_squares(time_residuals, [1.0, g0, 1.0], [1e-6, 1.0, 0.0],
                                        priority=[0, 2, 1])
    if not t_free[2]:
        notes.append("latency_scale kept at 1: not identifiable from these runs (it needs runs "
                     "whose numbers of communication calls differ, e.g. TP or ZeRO against DDP)")
    if not t_free[1]:
        notes.append(f"overlap_slowdown kept at {g0:.4f}: not identifiable from these runs (it "
                     f"needs a second run, and runs whose communication overlaps compute)")
    if not t_free[0]:
        notes.append("time_scale kept at 1: the runs' predicted times do not depend on compute")
    r0 = cluster.memory_reserve_bytes / GiB
    m_before = memory_residuals(np.array([r0, 1.0]))
    (r_gib, a), m_free = least_squares(memory_residuals, [r0, 1.0], [0.0, 1e-6], priority=[0, 1])
    if not m_free[1]:
        notes.append("activation_scale kept at 1: it needs two or more runs whose predicted "
                     "activation memory differs (vary micro-batch size or recompute)")
    t_after = time_residuals(np.array([s, g, lat]))
    m_after = memory_residuals(np.array([r_gib, a]))

    def rms(v: np.ndarray) -> float:
        return float(np.sqrt(np.mean(v ** 2)))

    return Calibration(time_scale=float(s), overlap_slowdown=float(g), latency_scale=float(lat),
                       memory_reserve_bytes=float(r_gib * GiB), activation_scale=float(a),
                       time_rms_error_before=rms(t_before), time_rms_error_after=rms(t_after),
                       memory_rms_error_before=rms(m_before), memory_rms_error_after=rms(m_after),
                       num_runs=len(runs), notes=tuple(notes))


def apply_calibration(cal: Calibration, cluster: ClusterSpec,
                      profile: ModelProfile | None) -> tuple[ClusterSpec, ModelProfile | None]:
    """The calibrated cluster and profile. The compute scale goes into the profile when there
    is one (its times are what the cost model uses), else into the cluster's FLOP/s."""
    reserve = int(round(cal.memory_reserve_bytes))
    if reserve >= cluster.device_memory_bytes:
        raise CalibrationError(
            f"fitted memory_reserve_bytes={reserve} is not below the device memory "
            f"{cluster.device_memory_bytes}: the measured peaks exceed what the device holds; "
            f"check that peak_memory_bytes in the metrics is per device, in bytes")
    new_cluster = dataclasses.replace(
        scale_latencies(cluster if profile is not None
                        else scale_cluster_flops(cluster, cal.time_scale), cal.latency_scale),
        overlap_slowdown=max(1.0, cal.overlap_slowdown), memory_reserve_bytes=reserve,
        source=(cluster.source + "; " if cluster.source else "")
        + f"calibrated on {cal.num_runs} run(s): overlap {cal.overlap_slowdown:.4f}, latency "
          f"x{cal.latency_scale:.4f}, reserve "
          f"{reserve / GiB:.3f} GiB" + ("" if profile is not None else
                                         f", compute time scale {cal.time_scale:.4f}"))
    new_profile = None
    if profile is not None:
        new_profile = scale_profile(profile, cal.time_scale, cal.activation_scale)
        meta = dict(new_profile.metadata)
        meta["calibration"] = {"time_scale": cal.time_scale,
                               "activation_scale": cal.activation_scale,
                               "num_runs": cal.num_runs,
                               "previous": dict(profile.metadata).get("calibration")}
        new_profile = dataclasses.replace(new_profile, metadata=meta)
    return new_cluster, new_profile


def calibrate_files(runs: Sequence[tuple[str, str]], cluster: str,
                    model_profile: str | None = None, *, spec_of: SpecOfRecord,
                    cluster_out: str | None = None, model_profile_out: str | None = None,
                    precision: str | None = None, skip_iterations: int = 2) -> Calibration:
    """Calibrate from files and write the results (the ``megatron-auto calibrate`` command).

    ``runs`` are ``(metrics_file, plan_file)`` pairs; ``cluster`` a preset name or cluster JSON;
    ``spec_of`` as for :func:`fit_calibration`.
    The cluster is written to ``cluster_out`` (default: back into ``cluster`` when it is a
    file); the model profile to ``model_profile_out`` (default: back into ``model_profile``).
    """
    spec = get_cluster(cluster)
    if cluster_out is None:
        if not os.path.isfile(cluster):
            raise CalibrationError(f"--cluster {cluster} is a preset, not a file: give "
                                   f"--cluster-out FILE to write the calibrated cluster")
        cluster_out = cluster
    profile = ModelProfile.load(model_profile) if model_profile else None
    measured = [load_run(metrics, plan, skip_iterations) for metrics, plan in runs]
    cal = fit_calibration(measured, spec, profile, precision, spec_of=spec_of)
    new_cluster, new_profile = apply_calibration(cal, spec, profile)
    new_cluster.save(cluster_out)
    if new_profile is not None:
        target = model_profile_out or model_profile
        assert target is not None  # a new profile comes only from a model profile given
        new_profile.save(target)
    elif abs(cal.activation_scale - 1.0) > 1e-6:
        cal = dataclasses.replace(cal, notes=cal.notes + (
            f"activation_scale {cal.activation_scale:.4f} not written: the analytic profile is "
            f"rebuilt from the cluster each time; profile the model (megatron-auto "
            f"profile-model) and calibrate with --model-profile to keep it",))
    return cal
