"""What ``--timing-log-level`` reports: console lines, metrics fields, the estimate comparison.

Input: every rank's seconds per iteration by timer name (``parallel.timers.gather_over_ranks``
of ``Timers.take()``), rank 0 formats. Three outputs:

- the console block under the iteration line, Megatron-LM's layout::

      (min, max) time across ranks (ms):
          forward-backward ...............................: (812.31, 812.40)

  (``--timing-log-option max`` prints only the max, ``all`` every rank's value);
- the metrics-file fields (an extension of docs/design.md §5.3): ``timers_<name>_max_s`` and
  ``timers_<name>_min_s`` per timer that ran on some rank, ``<name>`` with ``-`` written
  ``_`` (``timers_forward_compute_max_s``). TensorBoard / W&B receive them with
  ``--log-timers-to-tensorboard`` (``experiment_log.TIMER_PREFIX``);
- per pipeline stage, the measured breakdown next to the planner's estimate of the same terms,
  printed once with the "planner estimate vs this run" line, so that the term the cost model
  got wrong stands out.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..parallel.timers import P2P_TIMERS, TIMER_NAMES

TIMING_LOG_OPTIONS = ("max", "minmax", "all")
METRIC_PREFIX = "timers_"


def _ordered(rows: Sequence[Mapping[str, float]]) -> list[str]:
    seen = {name for row in rows for name in row}
    return [n for n in TIMER_NAMES if n in seen] + sorted(seen - set(TIMER_NAMES))


def timer_metrics(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """``timers_<name>_max_s`` / ``_min_s`` over the ranks that ran each timer."""
    out: dict[str, float] = {}
    for name in _ordered(rows):
        values = [row[name] for row in rows if name in row]
        key = METRIC_PREFIX + name.replace("-", "_")
        out[key + "_max_s"] = max(values)
        out[key + "_min_s"] = min(values)
    return out


def format_timer_lines(rows: Sequence[Mapping[str, float]], option: str = "minmax") -> list[str]:
    """The console block (milliseconds), Megatron's layout; see the module docstring."""
    if option not in TIMING_LOG_OPTIONS:
        raise ValueError(f"--timing-log-option={option!r}: choose one of "
                         f"{', '.join(TIMING_LOG_OPTIONS)}")
    names = _ordered(rows)
    if not names:
        return []
    head = {"max": "max time across ranks (ms):", "minmax": "(min, max) time across ranks (ms):",
            "all": "times across ranks (ms):"}[option]
    lines = [head]
    for name in names:
        values = [row.get(name) for row in rows]
        ran = [v for v in values if v is not None]
        if option == "max":
            shown = f"{max(ran) * 1e3:.2f}"
        elif option == "minmax":
            shown = f"({min(ran) * 1e3:.2f}, {max(ran) * 1e3:.2f})"
        else:
            shown = "(" + ", ".join("-" if v is None else f"{v * 1e3:.2f}" for v in values) + ")"
        lines.append(f"    {name} {'.' * max(2, 48 - len(name))}: {shown}")
    return lines


# The breakdown terms compared with the estimate: label -> measured timers (summed).
MEASURED_TERMS: dict[str, tuple[str, ...]] = {
    "forward": ("forward-compute",),
    "backward": ("backward-compute",),
    "p2p waits + bubble": P2P_TIMERS,
    "DP sync": ("all-grads-sync",),
    "optimizer": ("optimizer",),
}


def predicted_stage_terms(stage: Mapping[str, Any], num_microbatches: int,
                          iteration_time_s: float | None) -> dict[str, float]:
    """The estimate's per-stage time split into :data:`MEASURED_TERMS` (seconds per iteration).

    From the cost model's stage record (``planner/cost_model.StageEstimate``): ``m`` micro-batches
    of ``forward_time_s`` and ``backward_time_s``; the rest of ``microbatch_time_s`` (relayouts
    and the p2p hop) plus the bubble (``iteration_time_s - time_s``) is the pipeline's waiting;
    ``sync_tail_s`` the exposed DP sync; what ``time_s`` keeps beyond those is the optimizer
    step. A term whose inputs the record lacks is left out.
    """
    m = num_microbatches
    out: dict[str, float] = {}
    fwd, bwd = stage.get("forward_time_s"), stage.get("backward_time_s")
    micro, tail, total = stage.get("microbatch_time_s"), stage.get("sync_tail_s"), stage.get("time_s")
    if fwd is not None:
        out["forward"] = m * fwd
    if bwd is not None:
        out["backward"] = m * bwd
    if None not in (micro, fwd, bwd):
        waits = m * (micro - fwd - bwd)
        if iteration_time_s is not None and total is not None:
            waits += max(0.0, iteration_time_s - total)
        out["p2p waits + bubble"] = waits
    if tail is not None:
        out["DP sync"] = tail
    if None not in (total, micro, tail):
        out["optimizer"] = max(0.0, total - m * micro - tail)
    return out


def measured_stage_terms(rows: Sequence[Mapping[str, float]], ranks: Sequence[int]) -> dict[str, float]:
    """:data:`MEASURED_TERMS` of one stage: per term, the max over the stage's ``ranks``."""
    out: dict[str, float] = {}
    for label, names in MEASURED_TERMS.items():
        per_rank = [sum(rows[r].get(n, 0.0) for n in names) for r in ranks
                    if any(n in rows[r] for n in names)]
        if per_rank:
            out[label] = max(per_rank)
        elif label == "p2p waits + bubble" and any(rows[r] for r in ranks):
            out[label] = 0.0  # one stage: no pipeline, nothing to wait for
    return out


def _versus(predicted: float | None, measured: float | None) -> str:
    if predicted is None:
        return f"{measured * 1e3:.1f} measured" if measured is not None else "-"
    if measured is None:
        return f"{predicted * 1e3:.1f} predicted, not measured"
    rel = f" ({(predicted / measured - 1) * 100:+.0f}%)" if measured > 0 else ""
    return f"{predicted * 1e3:.1f} vs {measured * 1e3:.1f}{rel}"


def format_stage_comparison(rows: Sequence[Mapping[str, float]], estimate: Mapping[str, Any],
                            num_microbatches: int) -> list[str]:
    """One line per pipeline stage: predicted vs measured ms per iteration, term by term."""
    stages = list(estimate.get("stages") or [])
    world = len(rows)
    if not stages or not rows or world % len(stages):  # no rows: timers off
        return []
    per_stage = world // len(stages)
    lines = []
    for k, stage in enumerate(stages):
        ranks = list(range(k * per_stage, (k + 1) * per_stage))
        predicted = predicted_stage_terms(stage, num_microbatches,
                                          estimate.get("iteration_time_s"))
        measured = measured_stage_terms(rows, ranks)
        terms = [f"{label} {_versus(predicted.get(label), measured.get(label))}"
                 for label in MEASURED_TERMS if label in predicted or label in measured]
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        lines.append(f">   stage {k} ({span}), ms per iteration, predicted vs measured (max over "
                     f"the stage's ranks): " + " | ".join(terms))
    return lines
