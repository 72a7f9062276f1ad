"""The configuration dataclasses and the ``megatron-auto`` planning path never import torch, and
the console entry's fast exit (``megatron_auto/console.py``) loses none of their output.

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
    from megatron_auto.planner.interop.galvatron import plan_to_galvatron_config
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


MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "128", "--vocab-size", "1024", "--cluster", "a100-40g-1x8"]


def _console(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m megatron_auto ARGS``: the console script's entry (megatron_auto/console.py)."""
    return subprocess.run([sys.executable, "-m", "megatron_auto", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_console_entry_writes_everything_before_its_fast_exit(tmp_path):
    """The planning commands end with os._exit: the plan file, the whole report on stdout and
    the exit status are there as with cli.main in-process (which the test runs for comparison),
    and the plan is the same."""
    from megatron_auto.cli import main
    from megatron_auto.plan import Plan

    console = _console(["plan", *MODEL, "--plan-out", str(tmp_path / "console.json"),
                        "--quiet"], tmp_path)
    assert console.returncode == 0, console.stderr
    assert console.stdout.rstrip().endswith(f"plan written to {tmp_path / 'console.json'}")
    assert "Against baselines" in console.stdout
    assert main(["plan", *MODEL, "--plan-out", str(tmp_path / "inproc.json"), "--quiet"]) == 0
    ours, theirs = Plan.load(str(tmp_path / "console.json")), Plan.load(str(tmp_path /
                                                                          "inproc.json"))
    assert ours.layers == theirs.layers and ours.pipeline == theirs.pipeline
    assert ours.estimate == theirs.estimate
    # the JSON explanation of evaluate is complete too (a cut stdout would not parse)
    evaluate = _console(["evaluate", "--plan", str(tmp_path / "console.json"), "--json"],
                        tmp_path)
    assert evaluate.returncode == 0, evaluate.stderr
    assert json.loads(evaluate.stdout)["samples_per_s"] == ours.estimate["samples_per_s"]


def test_console_entry_keeps_error_lines_and_exit_status(tmp_path):
    bad = _console(["plan", *MODEL, "--global-batch-size", "-3", "--plan-out",
                    str(tmp_path / "x.json"), "--quiet"], tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.startswith("megatron-auto plan: error: --global-batch-size=-3")
    assert not (tmp_path / "x.json").exists()
    usage = _console(["plan", "--no-such-flag"], tmp_path)  # argparse's own exit status
    assert usage.returncode == 2 and "unrecognized arguments: --no-such-flag" in usage.stderr
    helped = _console([], tmp_path)  # no subcommand: the help, through the ordinary exit
    assert helped.returncode == 2 and "plan" in helped.stdout
