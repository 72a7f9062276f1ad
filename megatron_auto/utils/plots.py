"""Pictures of plans and runs: the per-layer strategy map, per-stage memory and time, metrics.

Used by ``megatron-auto explain --plot`` and ``megatron-auto plot-metrics`` (and by the
experiment grid's report). matplotlib is an optional extra (``pip install megatron_auto[plots]``);
without it every function raises :class:`PlotError` with that fix. Figures are drawn on
``matplotlib.figure.Figure`` objects directly (no pyplot), so nothing depends on a display or on
global backend state; the file type follows the path's suffix (``.png``, ``.pdf``, ``.svg``).

Inputs are plain data (a ``Plan`` and its estimate dict, metrics-file records), like the text
reports of ``planner/report.py``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

from ..plan import Plan

# Memory components in the order the cost model's breakdown lists them (bottom to top).
MEMORY_COMPONENTS = ("parameters", "gradients", "optimizer_states", "activations", "embedding",
                     "transient", "context_reserve", "optimizer_step_excess")
DP_MODE_COLORS = {"ddp": "#4c72b0", "zero1": "#8172b3", "zero2": "#dd8452", "zero3": "#c44e52"}


class PlotError(ValueError):
    """Plotting cannot run here (no matplotlib) or was given unusable input; names the fix."""


def _figure(rows: int, height_per_row: float) -> Any:
    try:
        from matplotlib.figure import Figure  # noqa: PLC0415 - optional, heavy package
    except ImportError as err:
        raise PlotError(f"plots need matplotlib, which does not import here ({err}); install "
                        f"it with: pip install 'megatron_auto[plots]' (or pip install "
                        f"matplotlib)") from None
    return Figure(figsize=(10, height_per_row * rows), layout="constrained")


def plot_path(path: str) -> str:
    """The file a figure saved to ``path`` lands in: matplotlib appends ``.png`` to a name
    without a suffix (its ``savefig.format``), so ``out`` is written as ``out.png``."""
    return path if os.path.splitext(path)[1] else path + ".png"


def _save(fig: Any, path: str) -> str:
    """Save ``fig``; returns the path of the file written (:func:`plot_path`)."""
    path = plot_path(path)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise PlotError(f"{path}: the directory {parent} does not exist; create it or choose "
                        f"another path")
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as err:
        raise PlotError(f"{path}: cannot write the figure ({err}); use a writable .png, .pdf or "
                        f".svg path") from None
    return path


def _stage_boundaries(plan: Plan) -> list[int]:
    """First layer index of every stage after the first."""
    out, start = [], 0
    for count in plan.pipeline.layers_per_stage[:-1]:
        start += count
        out.append(start)
    return out


def draw_strategy_map(ax: Any, plan: Plan) -> None:
    """Layer index on x; bar height = TP degree, colour = DP flavour, hatch = recompute;
    dashed lines at stage boundaries."""
    xs = range(plan.num_layers)
    layers = plan.layers
    ax.bar(xs, [s.tp for s in layers], width=0.9,
           color=[DP_MODE_COLORS.get(s.dp_mode, "#999999") for s in layers],
           hatch=None, edgecolor="black", linewidth=0.3)
    for i, s in enumerate(layers):
        if s.recompute:
            ax.bar([i], [s.tp], width=0.9, color="none", hatch="//", edgecolor="black",
                   linewidth=0)
        if not s.tp_consecutive and s.tp > 1:
            ax.text(i, s.tp, "s", ha="center", va="bottom", fontsize=7)
    for b in _stage_boundaries(plan):
        ax.axvline(b - 0.5, color="black", linestyle="--", linewidth=1)
    from matplotlib.patches import Patch  # noqa: PLC0415 - optional package, imported above

    used = sorted({s.dp_mode for s in layers})
    handles = [Patch(facecolor=DP_MODE_COLORS.get(m, "#999999"), label=m) for m in used]
    if any(s.recompute for s in layers):
        handles.append(Patch(facecolor="white", hatch="//", edgecolor="black", label="recompute"))
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    ax.set_xlabel("layer (dashed: pipeline stage boundary; 's': strided TP ranks)")
    ax.set_ylabel("tensor-parallel degree")
    ax.set_yticks(sorted({s.tp for s in layers}))
    ax.set_title(f"per-layer strategy: pp={plan.pp_size}, {plan.num_microbatches} micro-batches, "
                 f"vocab tp={plan.vocab.tp} {plan.vocab.dp_mode}")


def draw_stage_memory(ax: Any, stages: Sequence[Mapping[str, Any]],
                      budget_bytes: float | None) -> None:
    """Per-stage peak memory stacked by component, against the budget."""
    bottoms = [0.0] * len(stages)
    xs = list(range(len(stages)))
    for component in MEMORY_COMPONENTS:
        heights = [float(s.get("memory_breakdown", {}).get(component, 0.0)) / 1e9 for s in stages]
        if any(heights):
            ax.bar(xs, heights, bottom=bottoms, label=component.replace("_", " "))
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    if budget_bytes:
        ax.axhline(budget_bytes / 1e9, color="red", linestyle="-", linewidth=1.5, label="budget")
    ax.set_xticks(xs, [f"stage {k}" for k in xs])
    ax.set_ylabel("peak memory per device (GB)")
    ax.legend(loc="upper right", fontsize=7, ncols=2)
    ax.set_title("per-stage memory at its peak")


def draw_stage_time(ax: Any, stages: Sequence[Mapping[str, Any]], num_microbatches: int,
                    iteration_time_s: float | None) -> None:
    """Per-stage time per iteration: forward and backward of all micro-batches, sync tail,
    the rest (relayouts, p2p, optimizer step); the iteration time as a line."""
    xs = list(range(len(stages)))
    parts = {
        "forward": [num_microbatches * float(s.get("forward_time_s", 0.0)) for s in stages],
        "backward": [num_microbatches * float(s.get("backward_time_s", 0.0)) for s in stages],
        "gradient sync tail": [float(s.get("sync_tail_s", 0.0)) for s in stages],
    }
    known = [sum(values) for values in zip(*parts.values())]
    parts["relayout, p2p, optimizer"] = [max(0.0, float(s.get("time_s", 0.0)) - k)
                                         for s, k in zip(stages, known)]
    bottoms = [0.0] * len(stages)
    for label, values in parts.items():
        ax.bar(xs, [v * 1e3 for v in values], bottom=[b * 1e3 for b in bottoms], label=label)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if iteration_time_s:
        ax.axhline(iteration_time_s * 1e3, color="black", linestyle=":", label="iteration")
    ax.set_xticks(xs, [f"stage {k}" for k in xs])
    ax.set_ylabel("time per iteration (ms)")
    ax.legend(loc="upper right", fontsize=7)
    ax.set_title("per-stage time (bubble = iteration minus the stage's bar)")


def plot_plan(plan: Plan, path: str, estimate: Mapping[str, Any] | None = None,
              memory_budget_bytes: float | None = None) -> str:
    """The strategy map, plus per-stage memory and time when an estimate is known. Returns
    the path written (:func:`plot_path`)."""
    estimate = estimate if estimate is not None else plan.estimate
    stages = list((estimate or {}).get("stages") or [])
    fig = _figure(3 if stages else 1, 3.2)
    axes = fig.subplots(3 if stages else 1, 1, squeeze=False)[:, 0]
    draw_strategy_map(axes[0], plan)
    if stages:
        budget = memory_budget_bytes or (estimate or {}).get("memory_budget_bytes")
        draw_stage_memory(axes[1], stages, budget)
        draw_stage_time(axes[2], stages, plan.num_microbatches,
                        (estimate or {}).get("iteration_time_s"))
    return _save(fig, path)


_PLOTTED_FIELDS = ("samples_per_s", "iteration_time_s", "predicted_iteration_time_s",
                   "peak_memory_bytes", "predicted_peak_memory_bytes")


def _plotted(key: str) -> bool:
    return key.endswith("_loss") or key in _PLOTTED_FIELDS


def read_metrics_file(path: str) -> list[dict[str, Any]]:
    """The records of a ``--metrics-file`` (JSON lines), checked for what :func:`plot_metrics`
    draws: each line a JSON object, ``iteration`` an integer, ``split`` a string, every drawn
    field (losses, throughput, times, memory) a number or null. ``PlotError`` names the line,
    the key and the value."""
    records = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise PlotError(f"{where}: not a JSON object ({err.msg}); pass the file written "
                                f"by --metrics-file") from None
            if not isinstance(record, dict):
                raise PlotError(f"{where}: a JSON {type(record).__name__}, not an object; pass "
                                f"the file written by --metrics-file (one object per line)")
            for key, value in record.items():
                if key not in ("iteration", "split") and not _plotted(key):
                    continue  # not drawn: whatever it holds changes no figure
                ok = (isinstance(value, int) and not isinstance(value, bool) if key == "iteration"
                      else isinstance(value, str) if key == "split"
                      else value is None or (isinstance(value, (int, float))
                                             and not isinstance(value, bool)))
                if not ok:
                    raise PlotError(f"{where}: {key}={value!r} is not "
                                    + ("an integer" if key == "iteration" else "a string"
                                       if key == "split" else "a number") + "; pass the file "
                                    "written by --metrics-file")
            records.append(record)
    return records


def plot_metrics(records: Sequence[Mapping[str, Any]], path: str) -> str:
    """Loss, throughput, and predicted against measured time and memory of a metrics file.
    Returns the path written (:func:`plot_path`)."""
    train = [r for r in records if r.get("split", "train") == "train" and "iteration" in r]
    valid = [r for r in records if r.get("split") == "valid"]
    if not train:
        found = (f"its {len(valid)} records are all validation records (\"split\": \"valid\"), "
                 f"and the plots are of training" if valid else
                 "no line has an 'iteration'")
        raise PlotError(f"the metrics file has no training records ({found}); pass the "
                        f"--metrics-file of a training run, which logs a training record every "
                        f"--log-interval iterations")
    fig = _figure(2, 3.4)
    (loss_ax, speed_ax), (time_ax, mem_ax) = fig.subplots(2, 2)
    it = [r["iteration"] for r in train]
    loss_keys = sorted({k for r in train for k in r if k.endswith("_loss")})
    for key in loss_keys:
        loss_ax.plot(it, [r.get(key) for r in train], label=f"train {key}")
    if valid:
        loss_ax.plot([r["iteration"] for r in valid], [r.get("lm_loss") for r in valid], "o-",
                     label="valid lm_loss")
    loss_ax.set_xlabel("iteration")
    loss_ax.set_ylabel("loss")
    loss_ax.legend(fontsize=7)
    speed_ax.plot(it, [r.get("samples_per_s") for r in train])
    speed_ax.set_xlabel("iteration")
    speed_ax.set_ylabel("samples/s")
    _versus(time_ax, it, train, "iteration_time_s", "predicted_iteration_time_s", 1e3, "ms")
    _versus(mem_ax, it, train, "peak_memory_bytes", "predicted_peak_memory_bytes", 1e-9, "GB")
    return _save(fig, path)


def _versus(ax: Any, it: Sequence[int], records: Sequence[Mapping[str, Any]], measured: str,
            predicted: str, scale: float, unit: str) -> None:
    values = [r.get(measured) for r in records]
    if any(v is not None for v in values):
        ax.plot(it, [v * scale if v is not None else None for v in values], label="measured")
    guesses = [r.get(predicted) for r in records]
    if any(v is not None for v in guesses):
        ax.plot(it, [v * scale if v is not None else None for v in guesses], "--",
                label="predicted")
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"{measured.replace('_', ' ')} ({unit})")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def plot_throughput_against_budget(
        series: Mapping[str, Mapping[str, Sequence[tuple[float, float | None]]]],
        path: str, title: str = "") -> str:
    """One panel per model: samples/s against the memory budget, one line per method
    (``series[model][method] = [(budget_gb, samples_per_s or None when it does not fit)]``);
    budgets where a method does not fit are left out of its line (the experiment grid)."""
    if not series:
        raise PlotError(f"{path}: nothing to plot (no grid records); run the grid first")
    models = list(series)
    cols = min(3, len(models))
    rows = -(-len(models) // cols)
    fig = _figure(rows, 3.0)
    axes = fig.subplots(rows, cols, squeeze=False)
    for idx, model in enumerate(models):
        ax = axes[idx // cols][idx % cols]
        for method, points in series[model].items():
            xs = [b for b, v in points if v is not None]
            ys = [v for _, v in points if v is not None]
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, label=method,
                        linewidth=2.2 if method == "ours" else 1.0)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("memory budget per device (GB)")
        ax.set_ylabel("samples/s")
    for idx in range(len(models), rows * cols):
        axes[idx // cols][idx % cols].set_visible(False)
    axes[0][0].legend(fontsize=6, loc="upper left")
    if title:
        fig.suptitle(title)
    return _save(fig, path)
