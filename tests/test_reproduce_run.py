"""``megatron-auto reproduce --run`` end to end on CPU: a tiny grid (2 models scaled down, 2
budgets, 3 methods, 2 gloo ranks) measured, planned on the measured profiles, trained with
torchrun, with the measured columns next to the estimates; a rerun trains nothing again."""

from __future__ import annotations

import json

import pytest

from megatron_auto.cli import main
from megatron_auto.reproduce.results import ResultsFile

pytestmark = pytest.mark.multirank


def test_tiny_grid_runs_end_to_end_and_resumes(tmp_path, capsys):
    argv = ["reproduce", "--run", "--models", "gpt-tiny,bert-tiny", "--budgets", "2,4",
            "--methods", "ddp,zero3,ours", "--nproc-per-node", "2", "--run-iters", "3",
            "--out", str(tmp_path), "--no-plots", "--quiet"]
    assert main(argv) == 0
    records = list(ResultsFile(tmp_path / "results.jsonl").all())
    assert len(records) == 2 * 2 * 3
    for r in records:
        assert r["status"] == "ok", r
        meas = r["measured"]
        assert meas["status"] == "ok", (r["method"], meas)
        assert meas["samples_per_s"] > 0 and meas["iterations"] == 3
        assert meas["peak_memory_bytes"] > 0
        # The plan that ran was searched on this machine's measured cluster.
        plan = json.loads(open(r["plan_path"]).read())
        assert plan["world_size"] == 2
        assert r["cell"]["cluster"].startswith("measured-")
    table = (tmp_path / "measured.md").read_text().splitlines()
    assert len(table) == 2 + len(records) and "meas. samples/s" in table[0]
    capsys.readouterr()
    assert main(argv) == 0
    assert "searched 0, trained 0" in capsys.readouterr().out
