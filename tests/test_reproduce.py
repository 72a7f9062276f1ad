"""``megatron-auto reproduce``: the simulated grid, its results file, tables and bad input.

The claim checked here is the one the grid exists for: every baseline is a sub-space of ours,
searched by the same engine, so in every cell where ``ours`` is proven optimal it is at least the
best baseline (a time-limited answer is not proven and says so in its record).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_auto.cli import main
from megatron_auto.reproduce import grid, methods, results, simulate, tables
from megatron_auto.reproduce.measure import launcher

pytestmark = pytest.mark.pure

CELLS = dict(models="bert-huge-32,gpt3-1.3b", budgets="8,16", clusters="a100-40g-1x8")


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grid")
    code = main(["reproduce", "--models", CELLS["models"], "--budgets", CELLS["budgets"],
                 "--clusters", CELLS["clusters"], "--out", str(out), "--no-plots", "--quiet"])
    assert code == 0
    return out, results.ResultsFile(out / "results.jsonl")


def test_every_cell_has_every_method_and_ours_is_never_below_a_baseline(grid_run):
    _, res = grid_run
    records = list(res.all())
    assert len(records) == 2 * 2 * len(methods.METHODS)
    by_cell: dict[str, dict[str, dict]] = {}
    compared = 0
    for r in records:
        by_cell.setdefault(results.record_key(r)[0], {})[r["method"]] = r
    for key, row in by_cell.items():
        ours = row["ours"]
        assert ours["status"] == "ok", key
        # the claim needs a proven answer: a search the time limit stopped says so in its
        # record (on a loaded machine the widened space, SP and zero1 included, can take
        # BERT-Huge-32 past the 10 s limit) and is compared with nothing
        assert ours["proven_optimal"] is (not ours["time_limited"]), key
        for name, r in row.items():
            if r["status"] == "ok":
                if ours["proven_optimal"]:
                    assert ours["samples_per_s"] >= r["samples_per_s"] * (1 - 1e-9), (key, name)
                    compared += 1
                assert r["peak_memory_bytes"] <= float(r["cell"]["budget_gb"]) * 1e9
    # The 16 GB cells are proven within seconds: the comparison is never vacuous.
    assert compared >= 5


def test_an_oom_mark_states_a_minimum_above_the_budget(grid_run):
    """An OOM mark's least memory is above the cell's budget (else a plan would have fit)."""
    _, res = grid_run
    wrong = [results.record_key(r) + (r["min_memory_gb"],) for r in res.all()
             if r["status"] == "infeasible" and r["min_memory_gb"] <= r["cell"]["budget_gb"]]
    assert wrong == []


def test_tables_mark_the_best_and_state_the_speedup(grid_run):
    out, res = grid_run
    text = (out / "results.md").read_text()
    head, rule, *rows = text.strip().splitlines()
    assert "ours / best baseline" in head and len(rows) == 4
    labels = [m.label for m in methods.METHODS.values()]
    for line in rows:
        cols = [c.strip() for c in line.strip("|").split("|")]
        values = {}
        for label, entry in zip(labels, cols[3:-1]):
            if entry and entry[0].isdigit():
                values[label] = float(entry.split()[0])
        best = max(values.values())
        starred = [label for label, entry in zip(labels, cols[3:-1]) if entry.endswith("*")]
        assert starred and all(values[s] == best for s in starred)
        base = max(v for k, v in values.items() if not k.startswith("ours"))
        # The entries are rounded for display, the ratio is computed before rounding: equal to
        # the displayed precision (0.01) plus what the entries' rounding can move it.
        assert cols[-1].endswith("x")
        assert float(cols[-1][:-1]) == pytest.approx(values["ours"] / base, abs=0.011)
    csv = (out / "results.csv").read_text().splitlines()
    assert len(csv) == 5 and csv[0].startswith("model,cluster,budget (GB)")


def test_rerun_resumes_without_searching_again(grid_run, tmp_path):
    out, res = grid_run
    copy = tmp_path / "results.jsonl"
    lines = res.path.read_text().splitlines()
    # An interrupted run: the last record is cut short by the kill.
    copy.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    resumed = results.ResultsFile(copy)
    assert len(list(resumed.all())) == len(lines) - 2
    cells = grid.cells(grid.select_models(CELLS["models"]), [CELLS["clusters"]], [8, 16],
                       lambda c: 40)
    searched = simulate.simulate(cells, list(methods.METHODS.values()), resumed, None)
    assert searched == 1  # only the torn record is searched again
    assert len(list(results.ResultsFile(copy).all())) == len(lines) - 1


def test_results_file_of_another_grid_version_is_refused(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"format": results.FORMAT, "grid_version": 0}) + "\n")
    with pytest.raises(results.ResultsError, match="grid version 0.*new --results path"):
        results.ResultsFile(path)
    path.write_text('{"iteration": 1}\n')
    with pytest.raises(results.ResultsError, match="not a reproduce results file"):
        results.ResultsFile(path)


@pytest.mark.parametrize("flags, message", [
    (["--models", "bert-giant"], "--models bert-giant: unknown model"),
    (["--clusters", "tpu-v9-1x8"], "--clusters tpu-v9-1x8"),
    (["--budgets", "0"], "--budgets 0: must be a positive number"),
    (["--budgets", "-8"], "--budgets -8: must be a positive number"),
    (["--budgets", "eight"], "--budgets 'eight': not a number"),
    (["--methods", "ours,deepspeed"], "--methods deepspeed: unknown method"),
    (["--budgets", "100", "--clusters", "a100-40g-1x8"], "every budget exceeds"),
])
def test_bad_input_is_one_line_and_exit_2(flags, message, tmp_path, capsys):
    code = main(["reproduce", "--models", "bert-huge-32", *flags, "--out", str(tmp_path),
                 "--quiet", "--no-plots"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and message in err[0], err


def test_methods_are_restricted_spaces_of_one_engine():
    ours = methods.METHODS["ours"].options()
    assert ours.space == "full" and ours.allow_recompute and not ours.include_baselines
    assert methods.METHODS["ours-no-recompute"].options().allow_recompute is False
    assert methods.METHODS["pp-gpipe"].options().schedule == "gpipe"
    assert methods.METHODS["3d"].options().allow_recompute is False
    with pytest.raises(methods.MethodError, match="schedule is fixed by the method"):
        methods.METHODS["pp-1f1b"].options(schedule="gpipe")


def test_slurm_launch_uses_srun_and_a_rendezvous_on_the_first_node():
    env = {"SLURM_JOB_ID": "42", "SLURM_NNODES": "2", "MASTER_ADDR": "node1"}
    cmd = launcher(8, env)
    assert cmd[0] == "srun" and "--nodes=2" in cmd and "--nnodes=2" in cmd
    assert "--nproc-per-node=8" in cmd and "--rdzv-endpoint=node1:29500" in cmd
    local = launcher(2, {})
    assert "--standalone" in local and "srun" not in local


def test_table_entries_for_oom_and_missing_plans():
    rec = {"cell": {"model": "m", "cluster": "c", "budget_gb": 8}}
    rows = tables.table_rows([
        {**rec, "method": "ddp", "status": "infeasible", "min_memory_gb": 16.4},
        {**rec, "method": "megatron-tp", "status": "no_plan"},
        {**rec, "method": "ours", "status": "ok", "samples_per_s": 10.0},
        {**rec, "method": "zero3", "status": "ok", "samples_per_s": 8.0},
    ], [methods.METHODS[n] for n in ("ddp", "zero3", "megatron-tp", "ours")])
    assert rows[1][3:] == ["OOM (needs 16.4 GB)", "8.0", "-", "10.0 *", "1.25x"]
