"""The worked example of docs/cost_model.md §9: `megatron-auto evaluate` on an H100 preset for
GPT-1.3B prints the iteration time and peak memory derived there by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_auto.cli import main

pytestmark = pytest.mark.pure

DOC = Path(__file__).resolve().parents[1] / "docs" / "cost_model.md"


def _doc_example() -> tuple[list[str], float, float]:
    text = DOC.read_text()
    section = text[text.index("### Worked example: GPT-1.3B on one H100"):]
    command = section[section.index("```") + 3:]
    command = command[:command.index("```")].replace("\\\n", " ").split()
    assert command[:2] == ["megatron-auto", "evaluate"]
    m = re.search(r"Result: iteration time ([0-9.]+) s, peak memory ([0-9,]+) B", section)
    assert m, "the worked example states its result line"
    return command[1:], float(m[1]), float(m[2].replace(",", ""))


def test_cli_matches_the_worked_example(capsys):
    args, time_s, peak = _doc_example()
    assert main(args + ["--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    # the doc rounds to 1 us and 1 byte
    assert est["iteration_time_s"] == pytest.approx(time_s, abs=1e-6)
    assert est["peak_memory_bytes"] == pytest.approx(peak, abs=1.0)
    stage = est["stages"][0]
    assert stage["microbatch_time_s"] == pytest.approx(0.121244, abs=1e-6)
    assert stage["memory_breakdown"]["transient"] == pytest.approx(4.1209e9, rel=1e-4)
