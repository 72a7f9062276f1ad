"""Write the grid's tables and figures next to its results file.

``results.md`` / ``results.csv``: the paper-layout table (``tables.table_rows``), and with
``--run`` records also ``measured.md`` / ``measured.csv``. With matplotlib (the ``plots`` extra):
``throughput_<cluster>.png`` (samples/s against budget per model and method) and, per cell,
``plans/<cell>/ours.png`` (our plan's per-layer strategy map, per-stage memory against the
budget and per-stage time; the same figure as ``megatron-auto explain --plot``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..utils import plots
from ..plan import Plan
from .grid import Cell
from .methods import OURS, Method
from .tables import markdown, measured_rows, table_rows, to_csv

logger = logging.getLogger("megatron_auto")


def write_tables(records: Sequence[Mapping[str, Any]], methods: Sequence[Method],
                 cells: Sequence[Cell], out_dir: Path) -> dict[str, Path]:
    rows = table_rows(records, methods, cells)
    written = {}
    for name, text in (("results.md", markdown(rows)), ("results.csv", to_csv(rows))):
        (out_dir / name).write_text(text, encoding="utf-8")
        written[name] = out_dir / name
    measured = measured_rows(records)
    if len(measured) > 1:
        for name, text in (("measured.md", markdown(measured)), ("measured.csv", to_csv(measured))):
            (out_dir / name).write_text(text, encoding="utf-8")
            written[name] = out_dir / name
    return written


def write_figures(records: Sequence[Mapping[str, Any]], methods: Sequence[Method],
                  cells: Sequence[Cell], out_dir: Path) -> list[Path]:
    """The figures, or none with one warning when matplotlib is missing."""
    by_key = {(r["cell"]["model"], r["cell"]["cluster"], float(r["cell"]["budget_gb"]),
               r["method"]): r for r in records}
    written: list[Path] = []
    try:
        for cluster in sorted({c.cluster for c in cells}):
            series: dict[str, dict[str, list[tuple[float, float | None]]]] = {}
            for c in cells:
                if c.cluster != cluster:
                    continue
                for m in methods:
                    r = by_key.get((c.model, c.cluster, c.budget_gb, m.name))
                    value = r.get("samples_per_s") if r and r.get("status") == "ok" else None
                    series.setdefault(c.model, {}).setdefault(m.label, []).append(
                        (c.budget_gb, value))
            path = out_dir / f"throughput_{cluster}.png"
            plots.plot_throughput_against_budget(series, str(path), title=cluster)
            written.append(path)
        for c in cells:
            r = by_key.get((c.model, c.cluster, c.budget_gb, OURS))
            if r and r.get("plan_path") and Path(r["plan_path"]).exists():
                plan = Plan.load(r["plan_path"])
                path = Path(r["plan_path"]).with_suffix(".png")
                plots.plot_plan(plan, str(path))
                written.append(path)
    except plots.PlotError as err:
        logger.warning("reproduce: no figures: %s", err)
    return written
