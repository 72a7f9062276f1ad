"""What README and docs/cost_model.md say about the cost model's accuracy is the latest run's.

docs/cost_model.md §9 holds the tables ``benchmarks/validate_cost_model.py --table-out`` wrote;
the first one after "The latest full run" is the latest. Its summary line and README's
sentence on ``validate_cost_model.py`` are recomputed here from that table's rows (count of
plans, worst and median time error, worst memory error and worst under-estimate), so a new
table that is pasted without updating the prose, or prose edited away from the table, fails.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]


def _latest_table() -> tuple[list[dict[str, float]], str]:
    text = (ROOT / "docs" / "cost_model.md").read_text()
    section = text[text.index("The latest full run"):]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| plan |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    # plan | memory predicted, measured, error | time predicted, measured, error | load
    assert header[3] == header[6] == "error", header
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append({"memory": float(cells[3].rstrip("%")), "time": float(cells[6].rstrip("%"))})
    after = "\n".join(lines[start:])
    summary = re.search(r"Time: max \|error\| ([0-9.]+)%, median ([0-9.]+)%; memory: max "
                        r"\|error\| ([0-9.]+)%, worst under-estimate ([0-9.]+)%", after)
    assert summary, "the latest table's summary line"
    return rows, summary.group(0)


def test_the_latest_tables_summary_is_its_rows() -> None:
    rows, summary = _latest_table()
    time = [abs(r["time"]) for r in rows]
    memory = [r["memory"] for r in rows]
    under = max(0.0, -min(memory))
    want = (f"Time: max |error| {max(time):.1f}%, median {statistics.median(time):.1f}%; "
            f"memory: max |error| {max(abs(m) for m in memory):.1f}%, worst under-estimate "
            f"{under:.1f}%")
    assert summary == want


def test_readme_quotes_the_latest_table() -> None:
    rows, _ = _latest_table()
    readme = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"`validate_cost_model.py`: predicted against measured peak memory and "
                  r"iteration time for (\d+) plans .*?memory within ([0-9.]+)%, never more than "
                  r"([0-9.]+)% under; time median ([0-9.]+)%, worst plan ([0-9.]+)%", readme)
    assert m, "README's sentence on validate_cost_model.py"
    time = [abs(r["time"]) for r in rows]
    memory = [r["memory"] for r in rows]
    assert int(m[1]) == len(rows)
    assert float(m[2]) == round(max(abs(x) for x in memory), 1)
    assert float(m[3]) == round(max(0.0, -min(memory)), 1)
    assert float(m[4]) == round(statistics.median(time), 1)
    assert float(m[5]) == round(max(time), 1)
