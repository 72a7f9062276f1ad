"""benchmarks/bench_vs_galvatron.py's pure parts: the re-keying of Galvatron's shipped files into
the layout 2.4's reader opens (same numbers), and the refusal of stored Galvatron results in a
published table. Galvatron itself is not installed here (the benchmark builds its own venv)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_vs_galvatron.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_vs_galvatron", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _files(tmp: Path, comp: dict, mem: dict) -> dict[str, Path]:
    files = {name: tmp / f"{name}.json" for name in
             ("computation", "memory", "allreduce", "p2p", "overlap", "sp_time", "sp_time_1x8")}
    files["computation"].write_text(json.dumps(comp))
    files["memory"].write_text(json.dumps(mem))
    for name in ("allreduce", "p2p", "overlap", "sp_time_1x8"):
        files[name].write_text(json.dumps({"from": name}))
    return files  # no sp_time file for this shape: the 1x8 one stands in


def test_stage_rekeys_old_layouts_without_changing_numbers(tmp_path):
    bench = _bench()
    case = {"layers": [{"hidden_size": 64, "layer_num": 2, "seq_len": 128}]}
    layer = {"parameter_size": 3.0, "tp_activation_per_bsz_dict": {"1": 5.0}}
    other = {"model_states": 8.0, "activation": {"1": 2.0}}
    files = _files(tmp_path, {"layertype_0_bsz4": 11.5, "layertype_other_bsz4": 1.25},
                   {"layertype_0": layer, "other_memory_pp_off": other})
    staged = bench._stage_for_galvatron(case, files, tmp_path / "staged")
    comp = json.loads((Path(staged["configs"]) / "computation.json").read_text())
    assert comp == {"layertype_0_bsz4_seq128": 11.5, "layertype_other_bsz4_seq128": 1.25}
    mem = json.loads((Path(staged["configs"]) / "memory.json").read_text())
    assert mem["layertype_0"] == {"128": layer}
    # one model-states number (vocab tp 1) -> one per vocab tp, halved per doubling
    assert mem["other_memory_pp_off"]["128"]["model_states"] == {"1": 8.0, "2": 4.0, "4": 2.0,
                                                                "8": 1.0}
    assert mem["other_memory_pp_off"]["128"]["activation"] == {"1": 2.0}
    hw = Path(staged["hardware"])
    assert json.loads((hw / "sp_time.json").read_text()) == {"from": "sp_time_1x8"}
    assert json.loads((hw / "p2p.json").read_text()) == {"from": "p2p"}


def test_published_table_refuses_stored_galvatron_results(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--keep-galvatron", str(tmp_path / "k"),
                           "--table-out", str(tmp_path / "t.md")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert "--keep-galvatron with --table-out" in proc.stderr
    assert not (tmp_path / "k").exists() and not (tmp_path / "t.md").exists()
