"""Every bad input of ``megatron-auto`` (issues 12 and 30): exit code 2, one ``error:`` line, no
traceback, the message naming the field, the value and the fix; and the flags that cannot
apply, one warning each while the command succeeds. The pretrain scripts' table is
``tests/test_bad_inputs.py``.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from bad_input_helpers import CLI_MODEL, assert_one_error_line, fill, make_files, run_cli

def _plan_with_unknown_cluster(tmp_path):
    from megatron_auto import cli

    path = tmp_path / "searched.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["plan", *CLI_MODEL, "--cluster", "a100-40g-1x8", "--plan-out",
                         str(path), "--quiet"]) == 0
    plan = json.loads(path.read_text())
    plan["search"]["cluster"] = "tpu-v9-1x8"
    path.write_text(json.dumps(plan))
    return path


CLI_CASES = {
    "cli unknown search.cluster in a plan file": (
        ["evaluate", "--plan", "{d}/searched.json"],
        ["--plan={d}/searched.json", "search.cluster='tpu-v9-1x8'", "give --cluster"]),
    "cli --memory-budget-gb inf": (["plan", *CLI_MODEL, "--memory-budget-gb", "inf"],
                                   ["--memory-budget-gb=inf", "finite"]),
    "cli unknown --cluster": (["plan", *CLI_MODEL, "--cluster", "nope"],
                              ["--cluster nope", "not a preset name", "presets are"]),
    # issue 30 case 13: the model is named, whatever its sequence length
    "cli vision SP from the classic flags": (
        ["evaluate", "--model-type", "vit", "--img-h", "64", "--img-w", "64", "--patch-dim",
         "8", "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--micro-batch-size", "1"],
        ["--sequence-parallel: the vit model does not run sequence parallelism yet; drop the "
         "flag"]),
    "cli vision SP in a plan file": (
        ["evaluate", "--model-type", "vit", "--plan", "{d}/vit_sp.json"],
        ["plan field layers[0].sequence_parallel=True: the vit model does not run sequence "
         "parallelism yet; set it to false"]),
    # cases 14-16: plot-metrics reads the file it plots
    "cli plot-metrics line not an object": (
        ["plot-metrics", "{d}/not_object.jsonl"],
        ["{d}/not_object.jsonl:2: a JSON list, not an object"]),
    "cli plot-metrics validation records only": (
        ["plot-metrics", "{d}/valid_only.jsonl"],
        ["no training records (its 1 records are all validation records (\"split\": "
         "\"valid\")", "pass the --metrics-file of a training run"]),
    "cli plot-metrics string values": (
        ["plot-metrics", "{d}/string_values.jsonl"],
        ["{d}/string_values.jsonl:2: lm_loss='2.1' is not a number"]),
    # case 22: Galvatron values are taken as written or refused
    "cli galvatron global_bsz 8.5": (
        ["import-galvatron", "--galvatron-config", "{d}/galvatron_bsz.json", "--world-size",
         "8", "--plan-out", "{d}/g.json"], ["key 'global_bsz'=8.5 must be an integer"]),
    "cli galvatron checkpoint 2": (
        ["import-galvatron", "--galvatron-config", "{d}/galvatron_ckpt.json", "--world-size",
         "8", "--plan-out", "{d}/g.json"], ["key 'checkpoint' entry 1 is 2; use 0 or 1"]),
    "cli galvatron chunks 0": (
        ["import-galvatron", "--galvatron-config", "{d}/galvatron_chunks.json", "--world-size",
         "8", "--plan-out", "{d}/g.json"], ["key 'chunks'=0 must be at least 1"]),
    "cli galvatron tp_consecutive_flags 3": (
        ["import-galvatron", "--galvatron-config", "{d}/galvatron_consec.json",
         "--world-size", "8", "--plan-out", "{d}/g.json"],
        ["key 'tp_consecutive_flags' entry 1 is 3; use 0 or 1"]),
    # beyond the 22: outputs that cannot be written stop the command before it works
    "cli plan --plan-out under a file": (
        ["plan", *CLI_MODEL, "--plan-out", "{d}/a_file/plan.json", "--quiet"],
        ["--plan-out={d}/a_file/plan.json: the directory {d}/a_file is a file"]),
    "cli evaluate --plan-out is a directory": (
        ["evaluate", *CLI_MODEL, "--plan-out", "{d}"], ["--plan-out={d}: is a directory"]),
    "cli explain --plot in a missing directory": (
        ["explain", *CLI_MODEL, "--plot", "{d}/nope/plan"],
        ["--plot={d}/nope/plan.png: the directory {d}/nope does not exist"]),
    "cli plot-metrics -o under a file": (
        ["plot-metrics", "{d}/empty.jsonl", "-o", "{d}/a_file/m.png"],
        ["--output={d}/a_file/m.png: the directory {d}/a_file is a file"]),
    "cli import-galvatron --plan-out under a file": (
        ["import-galvatron", "--galvatron-config", "{d}/galvatron_bsz.json", "--world-size",
         "8", "--plan-out", "{d}/a_file/g.json"],
        ["--plan-out={d}/a_file/g.json: the directory {d}/a_file is a file"]),
    "cli profile-model --out under a file": (
        ["profile-model", *CLI_MODEL, "--out", "{d}/a_file/p.json"],
        ["--out={d}/a_file/p.json: the directory {d}/a_file is a file"]),
    "cli profile-hardware --out is a directory": (["profile-hardware", "--out", "{d}"],
                                                  ["--out={d}: is a directory"]),
    "cli calibrate --cluster-out under a file": (
        ["calibrate", "--run", "{d}/m.jsonl", "{d}/p.json", "--cluster", "a100-40g-1x8",
         "--cluster-out", "{d}/a_file/c.json"],
        ["--cluster-out={d}/a_file/c.json: the directory {d}/a_file is a file"]),
    "cli reproduce --out is a file": (["reproduce", "--out", "{d}/a_file"],
                                      ["--out={d}/a_file: is a file, not a directory"]),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", list(CLI_CASES))
def test_bad_megatron_auto_input_is_one_error_line(tmp_path, case):
    from megatron_auto import cli

    argv, expected = CLI_CASES[case]
    d = make_files(tmp_path)
    if "searched.json" in " ".join(argv):
        _plan_with_unknown_cluster(d)
    if "vit_sp.json" in " ".join(argv):
        from megatron_auto.plan import Plan
        Plan.uniform(8, 4, global_batch_size=8, num_microbatches=2, tp=2,
                     sequence_parallel=True).save(d / "vit_sp.json")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(fill(argv, d))
    assert_one_error_line(code, err.getvalue(), fill(expected, d), case)


@pytest.mark.pure
def test_plots_report_the_file_they_write(tmp_path):
    """Case 17: a path without a suffix is written as .png (matplotlib's rule), and the
    message names that file, not the path given."""
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the 'plots' extra)")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"iteration": 1, "lm_loss": 2.0, "samples_per_s": 3.0}\n')
    code, err, out = run_cli(["plot-metrics", str(metrics), "-o", str(tmp_path / "curves")])
    assert code == 0, err
    assert out.strip() == f"plot written to {tmp_path / 'curves.png'}"
    assert (tmp_path / "curves.png").is_file() and not (tmp_path / "curves").exists()
    code, err, out = run_cli(["explain", *CLI_MODEL, "--plot", str(tmp_path / "plan")])
    assert code == 0, err
    assert out.rstrip().endswith(f"plot written to {tmp_path / 'plan.png'}")
    assert (tmp_path / "plan.png").is_file()


# name: (argv, the warning lines); each command succeeds.
CLI_WARNING_CASES = {
    # case 21 on the planning command: tp pinned to 1 leaves nothing for SP
    "plan --sequence-parallel at tp 1": (
        ["plan", *CLI_MODEL, "--sequence-parallel", "--tensor-model-parallel-size", "1",
         "--plan-out", "{d}/p.json", "--quiet", "--time-limit", "2"],
        ["--sequence-parallel: does nothing with --tensor-model-parallel-size 1 (sequence "
         "parallelism splits over the tensor-parallel group, as in Megatron-LM); raise the TP "
         "size or drop the flag"]),
    "evaluate --sequence-parallel with the classic tp 1": (
        ["evaluate", *CLI_MODEL, "--sequence-parallel"],
        ["--sequence-parallel: does nothing with --tensor-model-parallel-size 1 (sequence "
         "parallelism splits over the tensor-parallel group, as in Megatron-LM); raise the TP "
         "size or drop the flag"]),
    # case 20 on the CLI: another family's flags, and the shared flags a ViT ignores
    "evaluate a GPT with vision and T5 flags": (
        ["evaluate", *CLI_MODEL, "--img-h", "64", "--decoder-seq-length", "16"],
        ["--img-h=64 --decoder-seq-length=16: ignored with --model-type gpt (they describe "
         "another model family; pick its --model-type or drop them)"]),
    "evaluate a ViT with --seq-length and --swin-window-size": (
        ["evaluate", "--model-type", "vit", "--seq-length", "64", "--swin-window-size", "7"],
        ["--swin-window-size=7: the Swin backbone's shape; ignored by the vit backbone (add "
         "--vision-backbone-type swin, or drop them)",
         "--seq-length=64: ignored by the vit model (its tokens are the image's patches: "
         "--img-h, --img-w and --patch-dim set the sequence)"]),
    "a budget above the device memory": (
        ["evaluate", *CLI_MODEL, "--memory-budget-gb", "100"],
        ["--memory-budget-gb=100.0 exceeds the 40.0 GB of a A100-SXM4-40GB"]),
    "galvatron chunks that do not split the batch": (
        ["import-galvatron", "--galvatron-config", "{d}/galvatron_uneven.json", "--world-size",
         "2", "--plan-out", "{d}/g.json"],
        ["galvatron config {d}/galvatron_uneven.json: chunks=3 does not split global_bsz=8 "
         "into equal micro-batches that every layer's dp divides; using 4 micro-batches "
         "(noted in the plan's search.notes)"]),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", list(CLI_WARNING_CASES))
def test_megatron_auto_flags_that_cannot_apply_warn_once(tmp_path, case):
    argv, warnings = CLI_WARNING_CASES[case]
    d = make_files(tmp_path)
    (d / "galvatron_uneven.json").write_text(json.dumps(
        {"pp_deg": 1, "tp_sizes_enc": "1,1", "tp_consecutive_flags": "1,1",
         "dp_types_enc": "0,0", "global_bsz": 8, "chunks": 3}))
    code, err, _ = run_cli(fill(argv, d))
    assert code == 0, err
    assert err == ["warning: " + w for w in fill(warnings, d)], err


@pytest.mark.pure
def test_reproduce_flags_of_the_other_mode_warn(tmp_path):
    """reproduce: the --run flags without --run say they are ignored (here before a budget
    that fits no device stops the command, so no grid runs)."""
    code, err, _ = run_cli(["reproduce", "--models", "bert-huge-32", "--budgets", "1000",
                         "--nproc-per-node", "4", "--run-iters", "5", "--out", str(tmp_path),
                         "--quiet", "--no-plots"])
    assert code == 2
    assert err[:2] == [
        "warning: --nproc-per-node=4: ignored; it applies to --run (train the plans on this "
        "cluster)",
        "warning: --run-iters=5: ignored; it applies to --run (train the plans on this cluster)"]
    assert "every budget exceeds the device memory" in err[2] and len(err) == 3
