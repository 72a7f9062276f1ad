"""Tables in the paper's layout: rows model x cluster x budget, columns methods.

Each entry is the estimated throughput (samples/s), marked ``†`` when its search stopped at
the time limit (not proven optimal); ``OOM`` with the least memory the method
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


def _entry(record: Mapping[str, Any] | None, best: bool = False) -> str:
    if record is None:
        return ""
    status = record.get("status")
    if status == "ok":
        text = f"{record['samples_per_s']:.1f}" + (" *" if best else "")
        # the search stopped at its time limit: not proven optimal
        return text + (" †" if record.get("proven_optimal") is False else "")
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
            entries.append(_entry(row.get(m.name), best is not None and values.get(m.name) == best))
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


def ours_below(records: Iterable[Mapping[str, Any]], methods: Sequence[Method]
               ) -> list[tuple[str, str, float, float]]:
    """The (cell, method, ours, theirs) where ``ours`` is below a method of its cell by more
    than the search's tie tolerance: the grid's claim, empty when it holds."""
    out = []
    for key, row in _rows(records).items():
        ours = row.get(OURS)
        if ours is None or ours.get("status") != "ok":
            continue
        for m in methods:
            r = row.get(m.name)
            if r is not None and r.get("status") == "ok" \
                    and ours["samples_per_s"] < r["samples_per_s"] * (1 - 1e-9):
                out.append((f"{key[0]}@{key[1]}@{key[2]:g}GB", m.name, ours["samples_per_s"],
                            r["samples_per_s"]))
    return out


def summary(records: Sequence[Mapping[str, Any]], methods: Sequence[Method]) -> list[str]:
    """Lines stating the grid's claim and how much of it is proven: cells, ``ours`` at least
    every method of its cell, searches proven optimal, ``ours`` over the best baseline."""
    rows = _rows(records)
    with_ours = [row for row in rows.values() if row.get(OURS, {}).get("status") == "ok"]
    below = ours_below(records, methods)
    ok = [r for r in records if r.get("status") == "ok"]
    proven = [r for r in ok if r.get("proven_optimal")]
    ours_proven = [row for row in with_ours if row[OURS].get("proven_optimal")]
    ratios = [s for s in (speedup(row, methods) for row in with_ours) if s is not None]
    reused = sum(1 for r in records if r.get("from_budget_gb") is not None)
    lines = [f"{len(rows)} cells; ours has a plan in {len(with_ours)}, proven optimal in "
             f"{len(ours_proven)}; {len(proven)} of {len(ok)} searches with a plan are proven "
             f"optimal (the others stopped at the time limit, warm-started by the plans of "
             f"their sub-spaces); {reused} records are known not to fit from a search at a "
             f"smaller budget and were not searched again",
             "ours >= every method of its cell: " + (
                 "holds in every cell" if not below else
                 f"FAILS in {len(below)}: " + "; ".join(f"{c} {m} {a:.1f} < {b:.1f}"
                                                          for c, m, a, b in below))]
    if ratios:
        lines.append(f"ours / best baseline: min {min(ratios):.2f}x, max {max(ratios):.2f}x, "
                     f"above 1.00x in {sum(r > 1.005 for r in ratios)} of {len(ratios)} cells")
    for name, what in (("ours-no-bmw", "BMW (the searched partition)"),
                       ("ours-no-recompute", "recompute")):
        if not any(m.name == name for m in methods):
            continue
        faster = [k for k, row in rows.items() if row.get(OURS, {}).get("status") == "ok"
                  and row.get(name, {}).get("status") == "ok"
                  and row[OURS]["samples_per_s"] > row[name]["samples_per_s"] * 1.005]
        fits = [k for k, row in rows.items() if row.get(OURS, {}).get("status") == "ok"
                and row.get(name, {}).get("status") == "infeasible"]
        lines.append(f"{what} matters in {len(faster) + len(fits)} cells: ours is faster by "
                     f"more than 0.5% in {len(faster)}, and fits only with it in {len(fits)}"
                     + (f" ({', '.join(f'{k[0]} {k[2]:g} GB' for k in fits)})" if fits else ""))
    return lines
