"""``megatron-auto reproduce --run`` end to end on CPU: a tiny grid (2 models scaled down, 2
budgets, 3 methods, 2 gloo ranks) measured, planned on the measured profiles, trained with
torchrun, with the measured columns next to the estimates; a rerun trains nothing again."""

from __future__ import annotations

import json

import pytest

from megatron_auto.cli import main
from megatron_auto.reproduce.measure import failure_line
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
        log_tail = open(meas["log"], encoding="utf-8", errors="replace").read()[-4000:]
        assert meas["status"] == "ok", (r["method"], meas, log_tail)
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


def test_a_failed_run_is_named_by_its_error_line_not_torchrun_summary():
    """torchrun ends a failed job's log with its own summary; the record must keep the
    worker's exception instead (the summary's last line is a row of '=')."""
    log = "\n".join([
        "iteration 1 | loss 6.2",
        "[rank1]: Traceback (most recent call last):",
        "[rank1]:   File \"pretrain_gpt.py\", line 3, in <module>",
        "[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:29500",
        "E1202 torch/distributed/elastic/multiprocessing/api.py failed (exitcode: 1)",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        "============================================================",
        "pretrain_gpt.py FAILED",
        "------------------------------------------------------------",
        "Failures:",
        "  <NO_OTHER_FAILURES>",
        "============================================================", ""])
    assert failure_line(log) == "[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:29500"
    assert failure_line("megatron-auto: error: --plan x.json: no such file\n") == \
        "megatron-auto: error: --plan x.json: no such file"
    assert failure_line("just text\n\n") == "just text"
