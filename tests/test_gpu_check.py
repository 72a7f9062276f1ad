"""benchmarks/gpu_check.py --dry-run: every part's code on CPU with tiny shapes (part (d) on two
gloo ranks under torchrun), reporting what it measured in the JSON report."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_auto.planner.inputs.hardware import ATTENTION_BACKENDS

pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[1]


def test_dry_run_runs_every_part_and_reports_predicted_against_measured(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, MEGATRON_AUTO_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"),
                           "--dry-run", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    parts = report["parts"]
    assert report["dry_run"] and set(parts) == set("abcd")
    for key in "abcd":
        assert parts[key]["status"] == "ok", (key, parts[key].get("status"),
                                              parts[key].get("traceback"), parts[key].get("stderr"))
    a = parts["a"]
    assert a["ours"]["tokens_per_s"] > 0 and a["plain"]["tokens_per_s"] > 0
    assert a["speed_ratio_plain_over_ours"] > 0
    b = parts["b"]
    assert b["layer"]["attention_backend"] in ATTENTION_BACKENDS
    assert b["layer"]["forward_per_sample_s"] > 0 and "hbm_bandwidth" in b["cluster"]
    single, multi = parts["c"]["plans"], parts["d"]["plans"]
    assert len(single) >= 6 and {"m1", "m4", "recompute-m1"} <= set(single)
    assert set(multi) == {"dp2", "tp2", "pp2-1f1b", "zero3-mix"} and parts["d"]["world_size"] == 2
    for name, row in {**single, **multi}.items():
        assert row["status"] == "ok", (name, row.get("status"), row.get("traceback"))
        measured, predicted = row["measured"], row["predicted"]["measured_profiles"]
        assert measured["iteration_time_s"] > 0 and measured["peak_memory_bytes"] > 0, name
        assert predicted["iteration_time_s"] > 0 and predicted["peak_memory_bytes"] > 0, name
        assert math.isfinite(predicted["time_error"]) and math.isfinite(predicted["memory_error"])
