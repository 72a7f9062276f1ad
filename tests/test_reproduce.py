"""``megatron-auto reproduce``: the simulated grid, its results file, tables and bad input.

The claim checked here is the one the grid exists for: every baseline is a sub-space of ours,
searched by the same engine, and every search starts from the plans of the methods inside its
space, so in every cell ``ours`` is at least every other method, proven optimal or stopped by
the (short) time limit alike; every answer is a plan of its own method's space.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_auto.cli import main
from megatron_auto.plan import Plan
from megatron_auto.planner.search.driver import InfeasibleError, SearchOptions, search
from megatron_auto.reproduce import grid, methods, results, simulate, tables
from megatron_auto.reproduce.measure import launcher

pytestmark = pytest.mark.pure

CELLS = dict(models="bert-huge-32,gpt3-1.3b", budgets="8,16", clusters="a100-40g-1x8")
CELL_TIME_LIMIT = "2"  # s per cell: the 8 GB cells' ours variants stop at it (CI stays short)


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grid")
    code = main(["reproduce", "--models", CELLS["models"], "--budgets", CELLS["budgets"],
                 "--clusters", CELLS["clusters"], "--cell-time-limit", CELL_TIME_LIMIT,
                 "--out", str(out), "--no-plots", "--quiet", "--table-out", str(out / "t.md")])
    assert code == 0
    return out, results.ResultsFile(out / "results.jsonl")


def test_every_cell_has_every_method_and_ours_is_never_below_any(grid_run):
    out, res = grid_run
    records = list(res.all())
    assert len(records) == 2 * 2 * len(methods.METHODS)
    by_cell: dict[str, dict[str, dict]] = {}
    for r in records:
        by_cell.setdefault(results.record_key(r)[0], {})[r["method"]] = r
    for key, row in by_cell.items():
        ours = row["ours"]
        assert ours["status"] == "ok", key
        for name, r in row.items():
            if r["status"] != "ok":
                continue
            assert r["proven_optimal"] is (not r["time_limited"]), (key, name)
            assert r["peak_memory_bytes"] <= float(r["cell"]["budget_gb"]) * 1e9
            # proven or stopped by the time limit: ours starts from every plan of its cell
            assert ours["samples_per_s"] >= r["samples_per_s"] * (1 - 1e-9), (key, name)
            # and so does each search from the plans found before it inside its space, in its
            # cell or at a smaller budget (name@8GB)
            for seed in r["warm_start"]:
                method, _, budget = seed.partition("@")
                other = row if not budget else by_cell[key.replace(
                    f"@{r['cell']['budget_gb']:g}GB", f"@{budget}")]
                assert r["samples_per_s"] >= other[method]["samples_per_s"] * (1 - 1e-9), \
                    (key, name, seed)
    # proven answers are compared too (the 16 GB cells are proven within the limit); stopped
    # ones: here where the limit stops them, and in test_a_cell_stopped_at_once_keeps_the_claim
    oks = [r for row in by_cell.values() for r in row.values() if r["status"] == "ok"]
    assert any(r["proven_optimal"] for r in oks)
    # warm starts across budgets, and a method known not to fit at 8 GB is not searched at
    # 16 GB when its least memory is above that: the same least memory, from the 8 GB search
    assert any("@8GB" in seed for row in by_cell.values() for r in row.values()
               for seed in r.get("warm_start", ()))
    reused = [(k, r) for k, row in by_cell.items() for r in row.values() if "from_budget_gb" in r]
    assert reused
    for key, r in reused:
        first = by_cell[key.replace("@16GB", "@8GB")][r["method"]]
        assert r["cell"]["budget_gb"] == 16 and r["from_budget_gb"] == 8 and r["search_time_s"] == 0
        assert (r["status"], r.get("min_memory_gb")) == \
            (first["status"], first.get("min_memory_gb"))
        assert r["status"] == "no_plan" or r["min_memory_gb"] > 16
    text = (out / "t.md").read_text()
    assert "ours >= every method of its cell: holds in every cell" in text
    assert f"--cell-time-limit {CELL_TIME_LIMIT}" in text and "†" in text


def test_a_cell_stopped_at_once_keeps_the_claim(tmp_path):
    """With a cell limit that stops every big search at once (each gets the 0.05 s floor), the
    ablations and ours are still at least the baselines inside their spaces."""
    names = ("zero3", "3d", "galvatron-base", "ours-no-recompute", "ours")
    chosen = [methods.METHODS[n] for n in names]
    res = results.ResultsFile(tmp_path / "r.jsonl")
    cell = grid.Cell("bert-huge-32", "a100-40g-1x8", 8)
    simulate.simulate([cell], chosen, res, None, cell_time_limit_s=0.01)
    row = {r["method"]: r for r in res.all()}
    assert not row["ours"]["proven_optimal"] and not row["ours-no-recompute"]["proven_optimal"]
    for name in names[:-1]:
        assert row["ours"]["samples_per_s"] >= row[name]["samples_per_s"] * (1 - 1e-9), name
    for name in ("zero3", "3d", "galvatron-base"):  # no recompute: inside ours w/o recompute
        assert row["ours-no-recompute"]["samples_per_s"] >= \
            row[name]["samples_per_s"] * (1 - 1e-9), name


def test_every_answer_is_a_plan_of_its_own_space(grid_run):
    """Warm starts never hand a search a plan from outside its space: each answer (a seed's
    plan or one the search found) passes its method's space rules."""
    _, res = grid_run
    checked = 0
    for r in res.all():
        if r["status"] == "ok":
            spec = grid.ALL_MODELS[r["cell"]["model"]].spec()
            plan = Plan.load(r["plan_path"])
            assert methods.in_space(plan, spec, methods.METHODS[r["method"]], 8), r["method"]
            checked += 1
            # the rules the ablations and the 3D grid without recompute are named after
            if r["method"] in ("3d", "ours-no-recompute", "galvatron-base"):
                assert not any(s.recompute for s in plan.layers), r["method"]
            if r["method"] in ("3d", "3d-recompute", "ours-no-bmw", "galvatron-base"):
                assert list(plan.pipeline.layers_per_stage) == [
                    len(plan.layers) // plan.pipeline.num_chunks] * plan.pipeline.num_chunks
    assert checked >= 30


def test_in_space_refuses_plans_outside_the_method():
    spec = grid.ALL_MODELS["bert-huge-32"].spec()
    model = spec.plan_model_record()
    m = methods.METHODS

    def plan(**kw):
        return Plan.uniform(8, 32, global_batch_size=128, num_microbatches=8, model=model, **kw)

    assert methods.in_space(plan(tp=2, pp=2, recompute=True), spec, m["ours"], 8)
    assert not methods.in_space(plan(tp=2, pp=2, recompute=True), spec,
                                m["ours-no-recompute"], 8)
    uneven = plan(tp=2, pp=2, layers_per_stage=(15, 17))
    assert methods.in_space(uneven, spec, m["ours"], 8)
    assert not methods.in_space(uneven, spec, m["ours-no-bmw"], 8)
    assert methods.in_space(plan(pp=8), spec, m["pp-1f1b"], 8)
    # interleaved: even over the 2 x 2 chunks, or not
    assert methods.in_space(plan(tp=2, pp=2, virtual_size=2), spec, m["ours-no-bmw"], 8)
    assert not methods.in_space(plan(tp=2, pp=2, virtual_size=2, layers_per_stage=(6, 10, 10, 6)),
                                spec, m["ours-no-bmw"], 8)
    assert not methods.in_space(plan(pp=8, schedule="gpipe"), spec, m["ours"], 8)
    assert methods.in_space(plan(pp=8, schedule="gpipe"), spec, m["pp-gpipe"], 8)
    assert not methods.in_space(plan(tp=2, dp_mode="zero3"), spec, m["3d"], 8)
    assert not methods.in_space(plan(tp=2, pp=2, sequence_parallel=True), spec,
                                m["galvatron-base"], 8)
    # tp over both nodes of a 2x8 cluster is the tp method's, not in ours (tp within a node)
    wide = Plan.uniform(16, 32, global_batch_size=128, tp=16, model=model)
    assert methods.in_space(wide, spec, m["megatron-tp"], 8)
    assert not methods.in_space(wide, spec, m["ours"], 8)


def test_a_seeded_search_is_never_below_its_seed_even_when_stopped_at_once():
    """``search(incumbents=...)``: a search stopped at once returns the seed (marked not proven,
    from_incumbent); a finished one is the space's optimum whatever it started from; a seed
    over the budget is ignored."""
    model = grid.ALL_MODELS["bert-huge-32"]  # at 40 GB: proven in well under a second
    cluster = simulate.load_cluster("a100-40g-1x8")
    inputs = simulate.cell_inputs(model, cluster, 40)
    args = (inputs.spec, inputs.training, inputs.cluster, inputs.profile, inputs.budget_bytes)
    quiet = dict(show_progress=False, include_baselines=False, optimality_gap=0.0)  # exact
    best = search(*args, SearchOptions(**quiet))
    assert best.search["proven_optimal"]
    dp = search(*args, SearchOptions(space="dp", **quiet))
    assert best.estimate.samples_per_s > dp.estimate.samples_per_s
    stopped = search(*args, SearchOptions(time_limit_s=1e-9, **quiet), incumbents=[best.plan])
    assert stopped.search["from_incumbent"] and not stopped.search["proven_optimal"]
    assert stopped.estimate.samples_per_s == pytest.approx(best.estimate.samples_per_s,
                                                           rel=1e-12)
    proven = search(*args, SearchOptions(**quiet), incumbents=[dp.plan])
    assert proven.search["proven_optimal"] and not proven.search["from_incumbent"]
    assert proven.estimate.samples_per_s == pytest.approx(best.estimate.samples_per_s,
                                                          rel=1e-9)
    # At the least memory any plan needs, the dp plan does not fit: it is no incumbent.
    with pytest.raises(InfeasibleError) as err:
        search(*args[:4], 1, SearchOptions(**quiet))
    least = int(err.value.min_memory_bytes)
    assert dp.estimate.peak_memory_bytes > least
    tight = search(*args[:4], least, SearchOptions(time_limit_s=1e-9, **quiet),
                   incumbents=[dp.plan])
    assert not tight.search["from_incumbent"] and tight.estimate.peak_memory_bytes <= least


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
        starred = [label for label, entry in zip(labels, cols[3:-1]) if "*" in entry.split()]
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
    searched = simulate.simulate(cells, list(methods.METHODS.values()), resumed, None,
                                 cell_time_limit_s=1)
    assert searched == 1  # only the torn record is searched again
    again = list(results.ResultsFile(copy).all())
    assert len(again) == len(lines) - 1
    # ... warm-started by the plans of the finished methods (read from their files), so
    # it is again at least every method of its cell
    last = again[-1]
    assert last["method"] == "ours" and last["warm_start"]
    assert all(last["samples_per_s"] >= r["samples_per_s"] * (1 - 1e-9) for r in again
               if r["cell"] == last["cell"] and r["status"] == "ok")


def test_results_file_of_another_grid_version_is_refused(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"format": results.FORMAT, "grid_version": 0}) + "\n")
    with pytest.raises(results.ResultsError, match="grid version 0.*new --results path"):
        results.ResultsFile(path)
    path.write_text('{"iteration": 1}\n')
    with pytest.raises(results.ResultsError, match="not a reproduce results file"):
        results.ResultsFile(path)


def test_the_command_refuses_another_grid_version_in_one_line(tmp_path, capsys):
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps({"format": results.FORMAT, "grid_version": grid.GRID_VERSION - 1})
                    + "\n")
    code = main(["reproduce", "--models", "bert-huge-32", "--results", str(path), "--out",
                 str(tmp_path), "--quiet", "--no-plots"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"written by grid version {grid.GRID_VERSION - 1}" in err[0] and "--results" in err[0]


@pytest.mark.parametrize("flags, message", [
    (["--models", "bert-giant"], "--models bert-giant: unknown model"),
    (["--clusters", "tpu-v9-1x8"], "--clusters tpu-v9-1x8"),
    (["--budgets", "0"], "--budgets 0: must be a positive number"),
    (["--budgets", "-8"], "--budgets -8: must be a positive number"),
    (["--budgets", "eight"], "--budgets 'eight': not a number"),
    (["--methods", "ours,deepspeed"], "--methods deepspeed: unknown method"),
    (["--budgets", "100", "--clusters", "a100-40g-1x8"], "every budget exceeds"),
    (["--cell-time-limit", "-1"], "--cell-time-limit=-1: give a positive number"),
    (["--time-limit", "0"], "--time-limit=0: give a positive number"),
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
    # a search the time limit stopped is marked; a row where ours is below a method fails the
    # grid's claim, and the summary names it
    rows = [{**rec, "method": "zero3", "status": "ok", "samples_per_s": 12.0,
             "proven_optimal": True},
            {**rec, "method": "ours", "status": "ok", "samples_per_s": 10.0,
             "proven_optimal": False}]
    chosen = [methods.METHODS[n] for n in ("zero3", "ours")]
    assert tables.table_rows(rows, chosen)[1][3:] == ["12.0 *", "10.0 †", "0.83x"]
    assert tables.ours_below(rows, chosen) == [("m@c@8GB", "zero3", 10.0, 12.0)]
    assert "FAILS in 1: m@c@8GB zero3 10.0 < 12.0" in tables.summary(rows, chosen)[1]
