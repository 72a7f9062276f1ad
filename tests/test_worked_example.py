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


def _doc_example() -> tuple[list[str], str, str]:
    text = DOC.read_text()
    section = text[text.index("### Worked example: GPT-1.3B on one H100"):]
    command = section[section.index("```") + 3:]
    command = command[:command.index("```")].replace("\\\n", " ").split()
    assert command[:2] == ["megatron-auto", "evaluate"]
    m = re.search(r"Result: iteration time ([0-9.]+) s, peak memory ([0-9.]+) GB", section)
    assert m, "the worked example states its result line"
    return command[1:], m[1], m[2]


def assert_to_stated_digits(value: float, stated: str, scale: float = 1.0) -> None:
    """``value`` rounds to ``stated`` (a decimal as the derivation writes it, in units of
    ``scale``): within half a unit of its last digit."""
    decimals = len(stated.split(".")[1]) if "." in stated else 0
    half_unit = 0.5 * 10.0 ** -decimals * scale
    assert abs(value - float(stated) * scale) <= half_unit, (value, stated, scale)


def test_cli_matches_the_worked_example(capsys):
    args, time_s, peak_gb = _doc_example()
    assert main(args + ["--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    # to the five digits the hand derivation carries (docs/cost_model.md §9)
    assert len(time_s.replace("0.", "", 1)) == 5 and len(peak_gb.replace(".", "")) == 5
    assert_to_stated_digits(est["iteration_time_s"], time_s)
    assert_to_stated_digits(est["peak_memory_bytes"], peak_gb, 1e9)
    stage = est["stages"][0]
    assert_to_stated_digits(stage["microbatch_time_s"], "121.24", 1e-3)  # step 4: C
    assert_to_stated_digits(stage["memory_breakdown"]["transient"], "4.121", 1e9)  # memory 3
