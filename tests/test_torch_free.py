"""The configuration dataclasses and the ``megatron-auto`` planning path never import torch.

Importing torch costs more than a second (far more on a loaded machine), which would dominate
``megatron-auto plan``. Each check runs in a fresh interpreter (this test process has torch
loaded already) that imports the modules, runs the commands, and reports what ``sys.modules``
holds afterwards.
"""

from __future__ import annotations

import pytest

import json
import subprocess
import sys
import textwrap
from pathlib import Path

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import json, sys
    from pathlib import Path

    out = Path(sys.argv[1])
    from megatron_auto import arguments, config, planning, plan_source, run_config  # noqa: F401
    from megatron_auto.cli import main
    from megatron_auto.planner.galvatron import plan_to_galvatron_config
    from megatron_auto.plan import Plan

    # The training scripts' conversion, for each plan source.
    run = arguments.parse_run_config(["--auto-parallel", "--bf16", "--num-layers", "2"])
    classic = arguments.parse_run_config(["--tensor-model-parallel-size", "2"])
    plan_source.make_plan(classic.plan_source, classic.model, 2)

    model = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "128", "--vocab-size", "1024", "--cluster", "a100-40g-1x8"]
    codes = {}
    codes["plan"] = main(["plan", *model, "--plan-out", str(out / "plan.json"), "--quiet"])
    codes["evaluate"] = main(["evaluate", "--plan", str(out / "plan.json"), "--json"])
    codes["explain"] = main(["explain", "--plan", str(out / "plan.json")])
    # A plan Galvatron can express (the searched one may mix ddp and zero2, which it cannot).
    galvatron, why = plan_to_galvatron_config(Plan.uniform(8, 4, global_batch_size=16,
                                                           num_microbatches=2, tp=2))
    assert galvatron is not None, why
    gpath = out / "galvatron_config_small_1nodes_8gpus_per_node.json"
    gpath.write_text(json.dumps(galvatron))
    codes["import-galvatron"] = main(["import-galvatron", "--galvatron-config", str(gpath),
                                      "--plan-out", str(out / "imported.json")])
    print("RESULT " + json.dumps({
        "codes": codes,
        "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    }))
''')


def test_planning_commands_and_run_config_import_no_torch(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    assert result["codes"] == {"plan": 0, "evaluate": 0, "explain": 0, "import-galvatron": 0}
    assert result["torch"] == [], f"torch modules imported: {result['torch'][:5]}"
    assert (tmp_path / "imported.json").is_file()
