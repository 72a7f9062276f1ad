"""``--optimality-gap`` on ``megatron-auto plan`` and ``--auto-parallel``: the plan file records
the certified gap, ``explain`` prints it, plans written before the field still load and explain,
and a bad value is one line naming the flag (the bound itself against enumeration:
test_planner_gap)."""

from __future__ import annotations

import json

import pytest

from megatron_auto import arguments
from megatron_auto.auto import search_options_for
from megatron_auto.cli import main
from megatron_auto.plan import Plan
from megatron_auto.planner.search.driver import SearchOptions

pytestmark = pytest.mark.pure

SMALL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "128", "--vocab-size", "1024", "--cluster", "a100-40g-1x8",
         "--global-batch-size", "16", "--bf16", "--memory-budget-gb", "8", "--quiet"]


def _plan(capsys, tmp_path, *extra):
    path = tmp_path / "plan.json"
    code = main(["plan", *SMALL, "--plan-out", str(path), *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return Plan.load(path), out, path


def test_plan_records_and_explains_the_gap(capsys, tmp_path):
    exact, out, _ = _plan(capsys, tmp_path, "--optimality-gap", "0")
    info = exact.search
    assert info["optimality_gap"] == 0.0 and info["optimality_gap_target"] == 0.0
    assert info["proven_optimal"] is True
    assert info["lower_bound_s"] == pytest.approx(exact.estimate["iteration_time_s"], rel=1e-9)
    assert "Search: proven optimal (lower bound" in out
    loose, out, path = _plan(capsys, tmp_path, "--optimality-gap", "0.5")
    info = loose.search
    assert info["optimality_gap_target"] == 0.5 and 0 <= info["optimality_gap"] <= 0.5
    # the bound holds against the exact answer, and the loose answer keeps its gap
    assert info["lower_bound_s"] <= exact.estimate["iteration_time_s"] * (1 + 1e-9)
    assert loose.estimate["iteration_time_s"] <= info["lower_bound_s"] * (
        1 + info["optimality_gap"]) * (1 + 1e-12)
    if not info["proven_optimal"]:
        assert f"within {info['optimality_gap']:.2%} of the optimum" in out
    # explain of the written plan prints the same line
    code = main(["explain", "--plan", str(path), "--memory-budget-gb", "8"])
    shown, err = capsys.readouterr()
    assert code == 0, err
    assert "Search: " in shown


def test_a_plan_written_before_the_gap_loads_and_explains(capsys, tmp_path):
    plan, _, path = _plan(capsys, tmp_path)
    data = json.loads(path.read_text())
    for key in ("lower_bound_s", "optimality_gap", "optimality_gap_target"):
        del data["search"][key]
    path.write_text(json.dumps(data))
    assert Plan.load(path).layers == plan.layers
    code = main(["explain", "--plan", str(path), "--memory-budget-gb", "8"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Search: " not in out and "Layers:" in out


@pytest.mark.parametrize("value", ["-0.1", "nan"])
def test_a_bad_gap_is_one_line_naming_the_flag(capsys, tmp_path, value):
    code = main(["plan", *SMALL, "--plan-out", str(tmp_path / "p.json"), "--optimality-gap",
                 value])
    _, err = capsys.readouterr()
    assert code == 2 and f"--optimality-gap={float(value)}" in err and len(
        err.strip().splitlines()) == 1
    with pytest.raises(arguments.ArgumentError, match="--optimality-gap="):
        arguments.parse_run_config(["--auto-parallel", "--optimality-gap", value])


def test_auto_parallel_passes_the_gap_to_the_search():
    config = arguments.parse_run_config(["--auto-parallel", "--optimality-gap", "0.05"])
    pins = config.plan_source
    assert pins.optimality_gap == 0.05
    assert search_options_for(pins, 8, 4).optimality_gap == 0.05
    default = arguments.parse_run_config(["--auto-parallel"]).plan_source
    assert search_options_for(default, 8, 4).optimality_gap == SearchOptions().optimality_gap \
        == 0.01
