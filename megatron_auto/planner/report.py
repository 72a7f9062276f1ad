"""Human-readable plan reports (pure text functions; no I/O).

``render_explain`` is what ``megatron-auto explain`` prints and ``megatron-auto plan`` shows after
a search: the plan in one paragraph, a per-layer table (consecutive layers with the same stage,
type and strategy are folded into one row), a per-stage time and memory breakdown with the
constraint that binds each stage, and the equivalent classic Megatron flags or why there are none.

Inputs are plain data: the ``Plan``, the estimate as its JSON dict (``Estimate.to_dict()`` or a
plan file's ``estimate``) and, optionally, the per-layer cost records of the cost model.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..plan import Plan
from ..plan_offload import offload_label
from ..plan_recompute import recompute_label

BREAKDOWN_ORDER = ("parameters", "gradients", "optimizer_states", "activations", "embedding",
                   "transient", "context_reserve")


def format_bytes(n: float | None) -> str:
    """``1.50 GB`` / ``320.0 MB`` / ``-``, decimal units (1 GB = 1e9 B) like
    ``--memory-budget-gb`` and the presets' device memory."""
    if n is None:
        return "-"
    if abs(n) >= 1e9:
        return f"{n / 1e9:.2f} GB"
    if abs(n) >= 1e6:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e3:.1f} kB"


def format_time(s: float | None) -> str:
    """``1.234 s`` / ``12.3 ms`` / ``45 us`` / ``-``."""
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} us"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned text table with a dashed rule under the header."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _span(start: int, end: int) -> str:
    return str(start) if start == end else f"{start}-{end}"


def describe_plan(plan: Plan) -> str:
    """One paragraph: world, pipeline, batch, vocabulary."""
    pipe = plan.pipeline
    stages = "+".join(str(n) for n in pipe.layers_per_stage)
    return (f"{plan.world_size} ranks, {plan.num_layers} layers; pipeline {pipe.size} stage(s) "
            f"({pipe.schedule}, layers {stages}, {plan.stage_size} ranks each); global batch "
            f"{plan.global_batch_size} in {plan.num_microbatches} micro-batch(es) of "
            f"{plan.microbatch_size}; vocabulary tp {plan.vocab.tp} x dp {plan.vocab_dp_size} "
            f"({plan.vocab.dp_mode})"
            + (f"; context parallelism cp {plan.cp_size} (each rank holds 2 of "
               f"{2 * plan.cp_size} sequence chunks)" if plan.cp_size > 1 else ""))


def describe_estimate(estimate: Mapping[str, Any]) -> str:
    """Iteration time, throughput, bubble and peak memory against the budget."""
    parts = [f"{format_time(estimate.get('iteration_time_s'))} per iteration"]
    if "samples_per_s" in estimate:
        parts.append(f"{estimate['samples_per_s']:.1f} samples/s")
    if "tokens_per_s" in estimate:
        parts.append(f"{estimate['tokens_per_s']:,.0f} tokens/s")
    if "bubble_fraction" in estimate:
        parts.append(f"pipeline bubble {estimate['bubble_fraction']:.1%}")
    peak = estimate.get("peak_memory_bytes")
    if peak is None and estimate.get("stages"):
        peak = max(s.get("peak_memory_bytes", 0) for s in estimate["stages"])
    memory = f"peak memory {format_bytes(peak)}"
    if estimate.get("memory_budget_bytes") is not None:
        memory += f" of {format_bytes(estimate['memory_budget_bytes'])} budget"
        if estimate.get("feasible") is False:
            memory += " (DOES NOT FIT)"
    parts.append(memory)
    host = max((s.get("host_memory_bytes", 0.0) for s in estimate.get("stages") or ()),
               default=0.0)
    if host:  # activation / optimizer offload (cost/offload.py): the host side of the memory
        optimizer = max((s.get("host_optimizer_bytes", 0.0)
                         for s in estimate.get("stages") or ()), default=0.0)
        kinds = (["activations"] if host > optimizer else []) + (
            ["optimizer share"] if optimizer else [])
        text = f"host memory {format_bytes(host)} per device (offloaded {' and '.join(kinds)})"
        if estimate.get("host_memory_budget_bytes") is not None:
            text += f" of {format_bytes(estimate['host_memory_budget_bytes'])} host budget"
        parts.append(text)
    return ", ".join(parts)


def layer_rows(plan: Plan, per_layer: Sequence[Mapping[str, Any]] = (),
               layer_type_names: Sequence[str] | None = None) -> list[list[Any]]:
    """Rows of the per-layer table; equal neighbours (stage, type, strategy) are folded."""
    rows: list[list[Any]] = []
    groups: list[tuple[int, int]] = []
    for i, layer in enumerate(plan.layers):
        key = (plan.stage_of_layer(i), layer, layer_type_names[i] if layer_type_names else "")
        if groups and groups[-1][1] == i - 1:
            j = groups[-1][0]
            prev = (plan.stage_of_layer(j), plan.layers[j], layer_type_names[j] if layer_type_names else "")
            if prev == key:
                groups[-1] = (j, i)
                continue
        groups.append((i, i))
    for start, end in groups:
        layer = plan.layers[start]
        stage = plan.stage_of_layer(start)
        cp = plan.cp_size
        dp = plan.batch_slices(start) if cp > 1 else plan.dp_size(start)
        layout = "-" if layer.tp in (1, plan.stage_size) else (
            "consecutive" if layer.tp_consecutive else "strided")
        cost = per_layer[start] if start < len(per_layer) else {}
        fb = None
        if "forward_time_s" in cost:
            fb = cost.get("forward_time_s", 0.0) + cost.get("backward_time_s", 0.0)
        row = [_span(start, end), stage]
        if layer_type_names:
            row.append(layer_type_names[start])
        row += [layer.tp, dp] + ([f"{cp} {layer.cp_mode}"] if cp > 1 else []) + (
            [_experts_cell(layer)] if _has_experts(plan) else []) + [
                layer.dp_mode, layout, _recompute_cell(layer.recompute)] + (
                [offload_label(layer.offload)] if _offloads(plan) else []) + [
                format_bytes(cost.get("memory_bytes")), format_time(fb)]
        rows.append(row)
    return rows


def _offloads(plan: Plan) -> bool:
    return any(layer.offload is not False for layer in plan.layers)


def _has_experts(plan: Plan) -> bool:
    """Whether some layer carries expert fields (the table then has an ``ep`` column)."""
    return any(layer.ep > 1 or layer.expert_tp > 1 or layer.expert_dp_mode is not None
               for layer in plan.layers)


def _experts_cell(layer: Any) -> str:
    """``ep``, ``xN`` for an expert TP of N, and where it differs from the layer's, the
    experts' DP flavour (``4 zero3``, ``2 x2``)."""
    out = str(layer.ep) + (f" x{layer.expert_tp}" if layer.expert_tp > 1 else "")
    if layer.expert_dp_mode is None or layer.expert_dp_mode == layer.dp_mode:
        return out
    return f"{out} {layer.expert_dp_mode}"


def _recompute_cell(value: Any) -> str:
    """yes / no for whole layers; the granularity for module recompute (selective, mlp+norm)."""
    return ("yes" if value else "no") if isinstance(value, bool) else recompute_label(value)


def render_layers(plan: Plan, per_layer: Sequence[Mapping[str, Any]] = (),
                  layer_type_names: Sequence[str] | None = None) -> str:
    headers = ["layers", "stage"] + (["type"] if layer_type_names else []) + [
        "tp", "dp"] + (["cp"] if plan.cp_size > 1 else []) + (
        ["ep"] if _has_experts(plan) else []) + [
        "dp_mode", "tp layout", "recompute"] + (["offload"] if _offloads(plan) else []) + [
        "memory/layer", "fwd+bwd/microbatch"]
    return table(headers, layer_rows(plan, per_layer, layer_type_names))


def render_stages(estimate: Mapping[str, Any]) -> str:
    """Per-stage time and memory breakdown with the binding constraint."""
    stages = estimate.get("stages") or []
    if not stages:
        return "(no per-stage estimate)"
    keys = [k for k in BREAKDOWN_ORDER if any(k in s.get("memory_breakdown", {}) for s in stages)]
    extra = sorted({k for s in stages for k in s.get("memory_breakdown", {})} - set(keys))
    keys += extra
    host = any(s.get("host_memory_bytes") for s in stages)
    headers = ["stage", "time", "peak memory"] + (["host memory"] if host else []) + keys + [
        "binding"]
    rows = []
    for k, s in enumerate(stages):
        breakdown = s.get("memory_breakdown", {})
        rows.append([k, format_time(s.get("time_s")), format_bytes(s.get("peak_memory_bytes"))]
                    + ([format_bytes(s.get("host_memory_bytes", 0.0))] if host else [])
                    + [format_bytes(breakdown.get(key)) for key in keys]
                    + [s.get("binding") or "-"])
    return table(headers, rows)


def render_megatron(flags: Sequence[str] | None, reasons: Sequence[str]) -> str:
    if flags is not None:
        return "Equivalent Megatron-LM flags:\n  " + " ".join(flags)
    return "Not expressible as classic Megatron-LM flags:\n" + "\n".join(f"  - {r}" for r in reasons)


def render_explain(plan: Plan, estimate: Mapping[str, Any] | None,
                   per_layer: Sequence[Mapping[str, Any]] = (),
                   megatron: tuple[Sequence[str] | None, Sequence[str]] | None = None,
                   layer_type_names: Sequence[str] | None = None,
                   title: str = "Plan") -> str:
    """The full ``explain`` report (see the module docstring)."""
    parts = [f"{title}: {describe_plan(plan)}"]
    if estimate:
        parts.append("Estimate: " + describe_estimate(estimate))
    gap = describe_gap(plan.search)
    if gap:
        parts.append("Search: " + gap)
    parts.append("Layers:\n" + _indent(render_layers(plan, per_layer, layer_type_names)))
    if estimate:
        parts.append("Stages:\n" + _indent(render_stages(estimate)))
    parts_info = (plan.search or {}).get("partitions") if isinstance(plan.search, Mapping) \
        else None
    if isinstance(parts_info, Mapping) and len(parts_info) > 1:
        parts.append("Partitions of this task (memory/time trade-off):\n"
                     + _indent(render_partitions(parts_info)))
    notes = (plan.search or {}).get("notes") if isinstance(plan.search, Mapping) else None
    if notes:
        parts.append("Notes:\n" + "\n".join(f"  - {n}" for n in notes))
    if megatron is not None:
        parts.append(render_megatron(*megatron))
    return "\n\n".join(parts) + "\n"


def describe_gap(search: Mapping[str, Any] | None) -> str | None:
    """The certified gap of a searched plan (``plan.search``'s ``optimality_gap``,
    ``lower_bound_s``), or None for a plan without one (given, or written before the field)."""
    if not isinstance(search, Mapping) or search.get("optimality_gap") is None:
        return None
    gap, target = search["optimality_gap"], search.get("optimality_gap_target")
    bound = f"lower bound {format_time(search.get('lower_bound_s'))} per iteration"
    if search.get("proven_optimal"):
        return f"proven optimal ({bound})"
    why = ("the time limit stopped the search" if search.get("time_limited")
           else f"stopped at the {target:.2%} gap asked for" if target is not None else "")
    return f"within {gap:.2%} of the optimum ({bound}; {why})"


def render_partitions(partitions: Mapping[str, Any]) -> str:
    """Each partition kind of ``plan.search["partitions"]``: layers per stage, its best plan's
    throughput and peak memory (``exact`` is the answer)."""
    rows = []
    for kind, entry in partitions.items():
        if not isinstance(entry, Mapping):
            continue
        part = entry.get("partition")
        sps = entry.get("samples_per_s")
        rows.append([kind, "+".join(str(x) for x in part) if part else "-",
                     f"{sps:.1f}" if sps else "does not fit" if entry.get("proven_optimal", True)
                     else "none found (time limit)",
                     format_bytes(entry.get("peak_memory_bytes")),
                     "yes" if entry.get("proven_optimal", True) else "no (time limit)"])
    return table(["partition", "layers per stage", "samples/s", "peak memory", "proven"], rows)


def render_baselines(best: Mapping[str, Any], baselines: Mapping[str, Mapping[str, Any] | None],
                     time_limited: Sequence[str] = ()) -> str:
    """Searched plan against each baseline space: throughput and speed-up, or "does not fit";
    a baseline whose search the time limit stopped (``time_limited``) is marked so (its best
    plan found may be slower than the space's best)."""
    rows = [["searched", f"{best.get('samples_per_s', 0):.1f}", "1.00x",
             format_bytes(best.get("peak_memory_bytes"))]]
    for name, est in baselines.items():
        if name in time_limited:
            name = f"{name} (time limit)"
        if not est:
            rows.append([name, "-", "-", "does not fit"])
            continue
        ratio = best.get("samples_per_s", 0) / est["samples_per_s"] if est.get("samples_per_s") else 0
        rows.append([name, f"{est['samples_per_s']:.1f}", f"{ratio:.2f}x",
                     format_bytes(est.get("peak_memory_bytes"))])
    return table(["plan", "samples/s", "searched is", "peak memory"], rows)


def _indent(text: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())
