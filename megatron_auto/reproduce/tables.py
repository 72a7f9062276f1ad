"""Tables in the paper's layout: rows model x cluster x budget, columns methods.

Each entry is the estimated throughput (samples/s); ``OOM`` with the least memory the method
needs when it cannot fit, ``-`` when its space has no plan for the shape. The best entry of a
row is marked, and the last column is the speedup of ``ours`` over the best *baseline* (the
ablations are ours and do not count as baselines). With ``--run`` records, a second table sets
the measured throughput next to the estimate.
"""

from __future__ import annotations

import csv
import io
from typing import Any, Iterable, Mapping, Sequence

from .grid import Cell
from .methods import OURS, Method


def _rows(records: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str, float], dict[str, Any]]:
    rows: dict[tuple[str, str, float], dict[str, Any]] = {}
    for r in records:
        c = r["cell"]
        rows.setdefault((c["model"], c["cluster"], float(c["budget_gb"])), {})[r["method"]] = r
    return rows


def _entry(record: Mapping[str, Any] | None) -> str:
    if record is None:
        return ""
    status = record.get("status")
    if status == "ok":
        return f"{record['samples_per_s']:.1f}"
    if status == "infeasible":
        least = record.get("min_memory_gb")
        return f"OOM (needs {least:g} GB)" if least is not None else "OOM"
    return "-"


def speedup(row: Mapping[str, Mapping[str, Any]], methods: Sequence[Method]) -> float | None:
    """``ours`` over the best baseline of the row (None when either has no plan)."""
    ours = row.get(OURS)
    base = [row[m.name]["samples_per_s"] for m in methods
            if not m.ours and m.name in row and row[m.name].get("status") == "ok"]
    if ours is None or ours.get("status") != "ok" or not base:
        return None
    return ours["samples_per_s"] / max(base)


def table_rows(records: Iterable[Mapping[str, Any]], methods: Sequence[Method],
               cells: Sequence[Cell] | None = None) -> list[list[str]]:
    """Header + one row per cell: model, cluster, budget, each method, speedup."""
    rows = _rows(records)
    order = ([(c.model, c.cluster, c.budget_gb) for c in cells] if cells is not None
             else sorted(rows))
    out = [["model", "cluster", "budget (GB)", *[m.label for m in methods],
            "ours / best baseline"]]
    for key in order:
        row = rows.get(key, {})
        values = {m.name: row[m.name]["samples_per_s"] for m in methods
                  if m.name in row and row[m.name].get("status") == "ok"}
        best = max(values.values(), default=None)
        entries = []
        for m in methods:
            text = _entry(row.get(m.name))
            if best is not None and values.get(m.name) == best:
                text += " *"
            entries.append(text)
        s = speedup(row, methods)
        out.append([key[0], key[1], f"{key[2]:g}", *entries, f"{s:.2f}x" if s else "-"])
    return out


def markdown(rows: Sequence[Sequence[str]]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines) + "\n"


def to_csv(rows: Sequence[Sequence[str]]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


def measured_rows(records: Iterable[Mapping[str, Any]]) -> list[list[str]]:
    """Estimated against measured samples/s and peak memory, one row per measured record."""
    out = [["model", "cluster", "budget (GB)", "method", "est. samples/s", "meas. samples/s",
            "est. peak (GB)", "meas. peak (GB)", "run"]]
    for r in records:
        meas = r.get("measured")
        if meas is None:
            continue
        c = r["cell"]
        est_s = f"{r['samples_per_s']:.2f}" if r.get("status") == "ok" else "-"
        est_m = f"{r['peak_memory_bytes'] / 1e9:.3f}" if r.get("status") == "ok" else "-"
        got_s = meas.get("samples_per_s")
        got_m = meas.get("peak_memory_bytes")
        out.append([c["model"], c["cluster"], f"{float(c['budget_gb']):g}", r["method"], est_s,
                    f"{got_s:.2f}" if got_s else "-",
                    est_m, f"{got_m / 1e9:.3f}" if got_m else "-", meas.get("status", "")])
    return out
