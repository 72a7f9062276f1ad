"""Every bad input of issue 12, one table: exit code 2, one ``error:`` line, no traceback, and the
message names the field, the value and the fix.

Categories (the case names start with them): ``flag`` (the pretrain scripts' flags, rejected
while parsing, before any process group exists), ``plan`` (a ``--plan`` file), ``checkpoint``
(a ``--load`` directory, found bad after the world is joined: forked one-rank runs),
``cli`` (``megatron-auto``) and ``preprocess`` (``tools/preprocess_data.py``). The data-stage
cases (empty dataset or split, token ids past the vocabulary, a tokenizer model that is not
one, malformed ``--split`` / blend weights) are the table of ``tests/test_bad_data_inputs.py``;
argparse's own errors (unknown flags, bad choices) print a usage line too and are checked in
``tests/test_arguments.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "1", "--eval-iters", "0", "--mock-data",
        "--vocab-size", "64"]
CLI_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32"]


def _files(tmp_path):
    """The bad files the cases point at (made fresh in each test's directory)."""
    (tmp_path / "a_file").write_text("not a directory\n")
    (tmp_path / "no_layers.json").write_text(json.dumps(
        {"format": "megatron_auto.plan", "version": 1, "world_size": 1}))
    (tmp_path / "not_json.json").write_text("{plan")
    bad_latest = tmp_path / "bad_latest"
    bad_latest.mkdir()
    (bad_latest / "latest_checkpointed_iteration.txt").write_text("oops\n")
    corrupt = tmp_path / "corrupt"
    (corrupt / "iter_0000002").mkdir(parents=True)
    (corrupt / "latest_checkpointed_iteration.txt").write_text("2\n")
    (corrupt / "iter_0000002" / "checkpoint_info.json").write_text('{"format": "megatr')
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "latest_checkpointed_iteration.txt").write_text("4\n")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "one.jsonl").write_text('{"text": "1 2 3"}\n')
    (tmp_path / "old_text_document.bin").write_bytes(b"mine")
    (tmp_path / "not_object.jsonl").write_text('{"iteration": 1, "lm_loss": 2.0}\n[1, 2]\n')
    (tmp_path / "valid_only.jsonl").write_text(
        '{"iteration": 5, "split": "valid", "lm_loss": 2.0, "ppl": 7.4}\n')
    (tmp_path / "string_values.jsonl").write_text(
        '{"iteration": 1, "lm_loss": 2.5}\n{"iteration": 2, "lm_loss": "2.1"}\n')
    galvatron = {"pp_deg": 1, "tp_sizes_enc": "1,1", "tp_consecutive_flags": "1,1",
                 "dp_types_enc": "0,0", "global_bsz": 8, "chunks": 1}
    for name, change in (("bsz", {"global_bsz": 8.5}), ("ckpt", {"checkpoint": "0,2"}),
                         ("chunks", {"chunks": 0}), ("consec", {"tp_consecutive_flags": "1,3"})):
        (tmp_path / f"galvatron_{name}.json").write_text(json.dumps({**galvatron, **change}))
    return tmp_path


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


# name: (argv, substrings the one error line must hold: field, value, fix). {d} = tmp dir.
FLAG_CASES = {
    "flag --lr inf": (["--lr", "inf"], ["--lr=inf", "finite"]),
    "flag --lr nan": (["--lr", "nan"], ["--lr=nan", "finite"]),
    "flag --min-lr nan": (["--min-lr", "nan"], ["--min-lr=nan", "finite"]),
    "flag --min-lr above --lr": (["--lr", "1e-4", "--min-lr", "1e-3"],
                                 ["--min-lr=0.001", "between 0 and --lr=0.0001"]),
    "flag --memory-budget-gb inf": (["--auto-parallel", "--memory-budget-gb", "inf"],
                                    ["--memory-budget-gb=inf", "finite"]),
    "flag --clip-grad inf": (["--clip-grad", "inf"], ["--clip-grad=inf", "finite"]),
    "flag --bf16 with --fp16": (["--bf16", "--fp16"], ["--bf16", "--fp16", "choose one"]),
    "flag --train-iters 0 without --save": (["--train-iters", "0"],
                                            ["--train-iters=0", "add --save"]),
    "flag batch not divisible": (["--global-batch-size", "3"],
                                 ["--global-batch-size=3", "multiple of --micro-batch-size"]),
    "flag heads do not divide hidden": (["--num-attention-heads", "5"],
                                        ["--hidden-size=32", "--num-attention-heads=5"]),
    "flag --save-interval without --save": (["--save-interval", "5"],
                                            ["--save-interval=5", "needs --save DIR"]),
    "flag --async-save without --save": (["--async-save"],
                                         ["--async-save=True", "needs --save DIR"]),
    "flag --exit-interval 0": (["--exit-interval", "0"], ["--exit-interval=0", "positive integer"]),
    "flag --exit-duration-in-mins nan": (["--exit-duration-in-mins", "nan"],
                                         ["--exit-duration-in-mins=nan", "positive number"]),
    "flag --exit-duration-in-mins 0": (["--exit-duration-in-mins", "0"],
                                       ["--exit-duration-in-mins=0.0", "positive number"]),
    "flag --distributed-timeout-minutes 0": (["--distributed-timeout-minutes", "0"],
                                             ["--distributed-timeout-minutes=0.0",
                                              "positive number of minutes"]),
    "flag --load is a file": (["--load", "{d}/a_file"],
                              ["--load={d}/a_file", "is a file, not a directory"]),
    "flag --data-path with --mock-data": (["--data-path", "x"],
                                          ["--data-path=x", "--mock-data", "drop one"]),
    "plan file missing": (["--plan", "{d}/nope.json"],
                          ["--plan {d}/nope.json", "cannot read the file", "check the path"]),
    "plan file not JSON": (["--plan", "{d}/not_json.json"], ["--plan {d}/not_json.json"]),
    "plan field missing": (["--plan", "{d}/no_layers.json"],
                           ["--plan {d}/no_layers.json", "layers=None", "one object per layer"]),
    "plan next to a layout flag": (["--plan", "{d}/no_layers.json",
                                    "--tensor-model-parallel-size", "2"],
                                   ["--tensor-model-parallel-size=2", "conflicts with --plan",
                                    "drop the flag"]),
    # issue 30 case 1: every output path is checked before any work (see also
    # test_unwritable_save_dir_trains_nothing below)
    "flag --save under /proc": (["--save", "/proc/megatron_auto_ck", "--save-interval", "1"],
                                ["--save=/proc/megatron_auto_ck", "cannot create the directory",
                                 "choose a writable path"]),
    "flag --save is a file": (["--save", "{d}/a_file"],
                              ["--save={d}/a_file: is a file, not a directory"]),
    "flag --save under a file, --async-save": (["--save", "{d}/a_file/ck", "--async-save"],
                                               ["--save={d}/a_file/ck: cannot create the "
                                                "directory ({d}/a_file is a file)"]),
    "flag --tensorboard-dir is a file": (["--tensorboard-dir", "{d}/a_file"],
                                         ["--tensorboard-dir={d}/a_file: is a file"]),
    "flag --metrics-file in a missing directory": (
        ["--metrics-file", "{d}/nope/m.jsonl"],
        ["--metrics-file={d}/nope/m.jsonl: the directory {d}/nope does not exist"]),
    "flag --metrics-file is a directory": (["--metrics-file", "{d}"],
                                           ["--metrics-file={d}: is a directory"]),
    "flag --plan-out under a file": (["--plan-out", "{d}/a_file/plan.json"],
                                     ["--plan-out={d}/a_file/plan.json: the directory "
                                      "{d}/a_file is a file"]),
    "flag --data-cache-path is a file": (["--data-cache-path", "{d}/a_file"],
                                         ["--data-cache-path={d}/a_file: is a file"]),
    "flag --wandb-save-dir is a file": (["--wandb-project", "p", "--wandb-save-dir",
                                         "{d}/a_file"], ["--wandb-save-dir={d}/a_file"]),
}
CHECKPOINT_CASES = {
    "checkpoint latest not a number": (["--load", "{d}/bad_latest"],
                                       ["--load={d}/bad_latest", "'oops'", "not an iteration",
                                        "rewrite it"]),
    "checkpoint corrupt info, --no-load-fallback": (
        ["--load", "{d}/corrupt", "--no-load-fallback"],
        ["--load={d}/corrupt: damaged checkpoint", "checkpoint_info.json is corrupt",
         "drop --no-load-fallback"]),
    "checkpoint corrupt info, nothing to fall back to": (
        ["--load", "{d}/corrupt"], ["--load={d}/corrupt: no intact checkpoint",
                                    "checkpoint_info.json is corrupt", "drop --load"]),
    "checkpoint latest names a missing directory": (
        ["--load", "{d}/missing"], ["--load={d}/missing: no intact checkpoint",
                                    "iter_0000004 is incomplete: the directory is missing"]),
}
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
PREPROCESS_CASES = {
    "preprocess output under a file": (["--input", "{d}/one.jsonl", "--output-prefix",
                                        "{d}/a_file/out"],
                                       ["--output-prefix={d}/a_file/out_text_document.bin: the "
                                        "directory {d}/a_file is a file"]),
    "preprocess output exists": (["--input", "{d}/one.jsonl", "--output-prefix", "{d}/old"],
                                 ["--output-prefix: {d}/old_text_document.bin already exists; "
                                  "add --overwrite to replace it"]),
    "preprocess missing input": (["--input", "{d}/nope.jsonl"],
                                 ["--input {d}/nope.jsonl", "file not found", "JSON-lines"]),
    "preprocess empty input": (["--input", "{d}/empty.jsonl"],
                               ["--input {d}/empty.jsonl", "no non-blank lines",
                                "one {\"text\": \"...\"} object per line"]),
}


def _fill(items, d):
    return [item.replace("{d}", str(d)) for item in items]


def _assert_one_error_line(code, err, expected, label):
    assert code == 2, f"{label}: exit {code}\n{err}"
    assert "Traceback" not in err, f"{label}:\n{err}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"{label}: {len(lines)} lines:\n{err}"
    assert "error: " in lines[0], lines[0]
    for text in expected:
        assert text in lines[0], f"{label}: {text!r} not in {lines[0]!r}"


def _train(argv):
    import pretrain_gpt

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = pretrain_gpt.main(argv)
    return code, err.getvalue()


@pytest.mark.single
@pytest.mark.parametrize("case", list(FLAG_CASES))
def test_bad_flag_or_plan_file_is_one_error_line(tmp_path, case):
    argv, expected = FLAG_CASES[case]
    d = _files(tmp_path)
    code, err = _train(TINY + _fill(argv, d))
    _assert_one_error_line(code, err, _fill(expected, d), case)


@pytest.mark.multirank
def test_bad_checkpoint_directory_is_one_error_line(tmp_path):
    from harness import run_main

    d = _files(tmp_path)
    for case, (argv, expected) in CHECKPOINT_CASES.items():  # one loop: start-up costs little
        [(code, err)] = run_main("pretrain_gpt", 1, TINY + _fill(argv, d), capture="stderr")
        _assert_one_error_line(code, err, _fill(expected, d), case)


@pytest.mark.pure
@pytest.mark.parametrize("case", list(CLI_CASES))
def test_bad_megatron_auto_input_is_one_error_line(tmp_path, case):
    from megatron_auto import cli

    argv, expected = CLI_CASES[case]
    d = _files(tmp_path)
    if "searched.json" in " ".join(argv):
        _plan_with_unknown_cluster(d)
    if "vit_sp.json" in " ".join(argv):
        from megatron_auto.plan import Plan
        Plan.uniform(8, 4, global_batch_size=8, num_microbatches=2, tp=2,
                     sequence_parallel=True).save(d / "vit_sp.json")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(_fill(argv, d))
    _assert_one_error_line(code, err.getvalue(), _fill(expected, d), case)


@pytest.mark.single
@pytest.mark.parametrize("case", list(PREPROCESS_CASES))
def test_bad_preprocess_input_is_one_error_line(tmp_path, case):
    spec = importlib.util.spec_from_file_location(
        "preprocess_data", os.path.join(ROOT, "tools", "preprocess_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv, expected = PREPROCESS_CASES[case]
    d = _files(tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        tokenizer = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
        prefix = [] if "--output-prefix" in argv else ["--output-prefix", str(d / "out")]
        code = module.main(_fill(argv, d) + prefix + tokenizer)
    _assert_one_error_line(code, err.getvalue(), _fill(expected, d), case)
    assert not [n for n in os.listdir(d) if n.startswith("out") or n.endswith(".tmp")]
    assert (d / "old_text_document.bin").read_bytes() == b"mine"  # never replaced


# ------------------------------------------------------------------------------ issue 30
def _script(name):
    import importlib
    return importlib.import_module(name)


def _run(name, argv):
    """(exit status, stderr, stdout) of an entry script's main in this process."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = _script(name).main(argv)
    return code, err.getvalue(), out.getvalue()


def _run_worker(rank, world_size, name, argv):
    return _run(name, argv)


T5_TINY = ["--hidden-size", "32", "--num-attention-heads", "4", "--encoder-seq-length", "16",
           "--decoder-seq-length", "8", "--vocab-size", "160", "--micro-batch-size", "2",
           "--global-batch-size", "2", "--train-iters", "1", "--eval-iters", "0", "--mock-data"]
VISION_TINY = ["--img-h", "8", "--img-w", "8", "--patch-dim", "2", "--num-layers", "1",
               "--hidden-size", "16", "--num-attention-heads", "2", "--global-batch-size", "2",
               "--train-iters", "1", "--eval-iters", "0", "--mock-data"]

# name: (script, argv, substrings of the one error line). Errors found while parsing.
SCRIPT_CASES = {
    # case 11: 0 is refused, not replaced by --num-layers
    "t5 --encoder-num-layers 0": ("pretrain_t5", T5_TINY + ["--encoder-num-layers", "0"],
                                  ["--encoder-num-layers=0: must be a positive integer"]),
    "t5 --decoder-num-layers 0": ("pretrain_t5", T5_TINY + ["--decoder-num-layers", "0"],
                                  ["--decoder-num-layers=0: must be a positive integer"]),
    # case 12: the encoder's own flag is named
    "t5 --encoder-seq-length 0": ("pretrain_t5", T5_TINY + ["--encoder-seq-length", "0"],
                                  ["--encoder-seq-length=0: must be a positive integer"]),
    "t5 learned positions shorter than the encoder": (
        "pretrain_t5", T5_TINY + ["--position-embedding-type", "learned",
                                  "--max-position-embeddings", "12", "--encoder-seq-length",
                                  "14"],
        ["--max-position-embeddings=12: must be at least --encoder-seq-length=14"]),
    "vision --save is a file": ("pretrain_vision_classify", VISION_TINY + ["--save",
                                                                         "{d}/a_file"],
                                ["--save={d}/a_file: is a file, not a directory"]),
}


@pytest.mark.single
@pytest.mark.parametrize("case", list(SCRIPT_CASES))
def test_bad_t5_and_vision_flags_are_one_error_line(tmp_path, case):
    name, argv, expected = SCRIPT_CASES[case]
    d = _files(tmp_path)
    code, err, out = _run(name, _fill(argv, d))
    _assert_one_error_line(code, err, _fill(expected, d), case)
    assert "iteration" not in out


@pytest.mark.multirank
def test_unwritable_save_dir_trains_nothing(tmp_path):
    """Case 1: --save that cannot be written (under /proc, a file, under a file, with and
    without --async-save) stops the run before the world is joined: no iteration, no metrics
    record, no plan file; it used to train until the first save and end in a traceback."""
    from dist_utils import run_distributed

    d = _files(tmp_path)
    bad = [f"{d}/a_file", f"{d}/a_file/ck"] + (["/proc/megatron_auto_ck"]
                                               if os.path.isdir("/proc") else [])
    for save in bad:
        for extra in ([], ["--async-save"]):
            metrics, plan = d / "m.jsonl", d / "plan.json"
            argv = TINY + ["--train-iters", "2", "--save", save, "--save-interval", "1",
                           "--metrics-file", str(metrics), "--plan-out", str(plan), *extra]
            [(code, err, out)] = run_distributed(_run_worker, 1, "pretrain_gpt", argv)
            _assert_one_error_line(code, err, [f"--save={save}: "], save)
            assert "iteration" not in out and not metrics.exists() and not plan.exists(), out
    assert (d / "a_file").read_text() == "not a directory\n"


@pytest.mark.multirank
def test_save_never_replaces_another_runs_checkpoint(tmp_path):
    """--save D where D holds a checkpoint this run does not --load is refused before
    training (it would point D's latest at this run and overwrite its iterations); --load D
    continues it and --overwrite saves over it, as Megatron-LM does."""
    from dist_utils import run_distributed

    ckpt = tmp_path / "ckpt"
    latest = ckpt / "latest_checkpointed_iteration.txt"
    assert run_distributed(_run_worker, 1, "pretrain_gpt",
                           TINY + ["--save", str(ckpt)])[0][0] == 0
    assert latest.read_text().strip() == "1"
    before = {p.name: p.stat().st_mtime_ns for p in (ckpt / "iter_0000001").iterdir()}
    [(code, err, out)] = run_distributed(_run_worker, 1, "pretrain_gpt",
                                         TINY + ["--save", str(ckpt), "--train-iters", "2"])
    _assert_one_error_line(code, err, [f"--save={ckpt}: already holds a checkpoint (latest "
                                       f"iteration 1) that this run would replace; add --load "
                                       f"{ckpt} to continue it, --overwrite to save over it"],
                           "save over another run")
    assert "iteration" not in out
    assert {p.name: p.stat().st_mtime_ns for p in (ckpt / "iter_0000001").iterdir()} == before
    assert run_distributed(_run_worker, 1, "pretrain_gpt", TINY + [
        "--save", str(ckpt), "--load", str(ckpt), "--train-iters", "2"])[0][0] == 0
    assert latest.read_text().strip() == "2"
    assert run_distributed(_run_worker, 1, "pretrain_gpt", TINY + [
        "--save", str(ckpt), "--overwrite"])[0][0] == 0
    assert latest.read_text().strip() == "1"  # a fresh run of one iteration saved over it


# name: (script, argv, the one warning line). Flags that cannot apply: the run trains, and
# stderr holds exactly one line, the warning.
WARNING_CASES = {
    # case 18
    "timers at --timing-log-level 0": (
        "pretrain_gpt", TINY + ["--log-timers-to-tensorboard", "--tensorboard-dir", "{d}/tb"],
        "--log-timers-to-tensorboard: --timing-log-level=0 (the default) records no timers; "
        "add --timing-log-level 1 or 2"),
    # case 19
    "memory to TensorBoard without a sink": (
        "pretrain_gpt", TINY + ["--log-memory-to-tensorboard"],
        "--log-memory-to-tensorboard: there is no --tensorboard-dir or --wandb-project to log "
        "to; add one or drop the flag"),
    "--wandb-save-dir without a project": (
        "pretrain_gpt", TINY + ["--wandb-save-dir", "{d}/wandb"],
        "--wandb-save-dir={d}/wandb: applies to a W&B run, and there is none without "
        "--wandb-project; add it or drop the flag"),
    "--compile-backend without --compile": (
        "pretrain_gpt", TINY + ["--compile-backend", "inductor"],
        "--compile-backend=inductor: only chooses the backend of --compile; add --compile or "
        "drop the flag"),
    # case 20
    "--swin-window-size with ViT": (
        "pretrain_vision_classify", VISION_TINY + ["--swin-window-size", "7"],
        "--swin-window-size=7: the Swin backbone's shape; ignored by the vit backbone (add "
        "--vision-backbone-type swin, or drop them)"),
    "--seq-length for a vision model": (
        "pretrain_vision_classify", VISION_TINY + ["--seq-length", "128"],
        "--seq-length=128: ignored by the vit model (its tokens are the image's patches: "
        "--img-h, --img-w and --patch-dim set the sequence)"),
    "ViT shape flags with Swin": (
        "pretrain_vision_classify", VISION_TINY[:4] + [
            "--vision-backbone-type", "swin", "--swin-depths", "1,1", "--swin-num-heads", "1,2",
            "--swin-embed-dim", "8", "--hidden-size", "64", "--global-batch-size", "2",
            "--train-iters", "1", "--eval-iters", "0", "--mock-data"],
        "--hidden-size=64: ignored by the swin model (its tokens are the image's patches: "
        "--img-h, --img-w and --patch-dim set the sequence; --swin-* flags set its shape)"),
    "t5 --num-layers next to both layer counts": (
        "pretrain_t5", T5_TINY + ["--num-layers", "6", "--encoder-num-layers", "1",
                                  "--decoder-num-layers", "1"],
        "--num-layers=6: ignored by the t5 model (--encoder-num-layers, --decoder-num-layers "
        "and --encoder-seq-length set its shape; it has no rotary embeddings and its loss is "
        "over the span targets)"),
    "--eod-mask-loss with mock data": (
        "pretrain_gpt", TINY + ["--eod-mask-loss"],
        "--eod-mask-loss: --mock-data's random tokens have no end-of-document token to mask; "
        "it changes nothing; drop one of them"),
    "--eod-mask-loss for BERT": (
        "pretrain_bert", TINY + ["--eod-mask-loss"],
        "--eod-mask-loss: masks the loss of GPT's end-of-document tokens; a BERT predicts "
        "masked tokens only, so it changes nothing here; drop it"),
    # case 21 (a plan file's sequence_parallel at tp 1 is refused instead: it states a layer)
    "--sequence-parallel at tp 1": (
        "pretrain_gpt", TINY + ["--sequence-parallel", "--tensor-model-parallel-size", "1"],
        "--sequence-parallel: does nothing with --tensor-model-parallel-size 1 (sequence "
        "parallelism splits over the tensor-parallel group, as in Megatron-LM); raise the TP "
        "size or drop the flag"),
}


@pytest.mark.multirank
def test_flags_that_cannot_apply_warn_once(tmp_path):
    from dist_utils import run_distributed

    d = _files(tmp_path)
    for case, (name, argv, warning) in WARNING_CASES.items():  # one loop: start-up is cheap
        [(code, err, out)] = run_distributed(_run_worker, 1, name, _fill(argv, d))
        assert code == 0, f"{case}: {err}"
        assert [line for line in err.splitlines() if line.strip()] == [
            "warning: " + warning.replace("{d}", str(d))], f"{case}:\n{err}"
        assert "iteration        1/" in out, case


@pytest.mark.multirank
def test_sequence_parallel_on_a_vision_model_names_the_model(tmp_path):
    """Case 13: the refusal says the model does not run SP, whatever the image size (it
    used to name a --seq-length rule, a flag ViT does not have)."""
    from dist_utils import run_distributed

    argv = VISION_TINY + ["--sequence-parallel", "--tensor-model-parallel-size", "2"]
    [(code, err, out)] = run_distributed(_run_worker, 1, "pretrain_vision_classify", argv)
    _assert_one_error_line(code, err, ["--sequence-parallel: the vit model does not run "
                                       "sequence parallelism yet; drop the flag"], "vision SP")


def _cli(argv):
    from megatron_auto import cli

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = cli.main(argv)
    return code, [line for line in err.getvalue().splitlines() if line.strip()], out.getvalue()


@pytest.mark.pure
def test_plots_report_the_file_they_write(tmp_path):
    """Case 17: a path without a suffix is written as .png (matplotlib's rule), and the
    message names that file, not the path given."""
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the 'plots' extra)")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"iteration": 1, "lm_loss": 2.0, "samples_per_s": 3.0}\n')
    code, err, out = _cli(["plot-metrics", str(metrics), "-o", str(tmp_path / "curves")])
    assert code == 0, err
    assert out.strip() == f"plot written to {tmp_path / 'curves.png'}"
    assert (tmp_path / "curves.png").is_file() and not (tmp_path / "curves").exists()
    code, err, out = _cli(["explain", *CLI_MODEL, "--plot", str(tmp_path / "plan")])
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
    d = _files(tmp_path)
    (d / "galvatron_uneven.json").write_text(json.dumps(
        {"pp_deg": 1, "tp_sizes_enc": "1,1", "tp_consecutive_flags": "1,1",
         "dp_types_enc": "0,0", "global_bsz": 8, "chunks": 3}))
    code, err, _ = _cli(_fill(argv, d))
    assert code == 0, err
    assert err == ["warning: " + w for w in _fill(warnings, d)], err


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.single
def test_preprocess_overwrite_and_unread_tokenizer_flags(tmp_path):
    """--overwrite replaces an existing dataset; a tokenizer flag the chosen tokenizer does
    not read is one warning."""
    d = _files(tmp_path)
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = _tool("preprocess_data").main([
            "--input", str(d / "one.jsonl"), "--output-prefix", str(d / "old"), "--overwrite",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--merge-file", "m.txt",
            "--log-interval", "0"])
    assert code == 0, err.getvalue()
    assert (d / "old_text_document.bin").read_bytes() != b"mine"
    assert [line for line in err.getvalue().splitlines() if "warning" in line] == [
        "warning: --merge-file=m.txt: not read by --tokenizer-type NullTokenizer; drop it or "
        "choose the tokenizer that reads it"]


@pytest.mark.single
def test_train_tokenizer_bad_inputs_are_one_error_line(tmp_path):
    """tools/train_tokenizer.py: exit 2 and one line (it used to exit 1 with a bare message,
    or train and then fail to write), an existing model kept without --overwrite."""
    d = _files(tmp_path)
    corpus = d / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Sample text number {i}."}) + "\n"
                              for i in range(200)))
    (d / "tok.model").write_bytes(b"my model")
    cases = {
        "exists": (["--model-prefix", str(d / "tok")],
                   [f"--model-prefix: {d / 'tok.model'} already exists; add --overwrite"]),
        "under a file": (["--model-prefix", str(d / "a_file" / "tok")],
                         [f"the directory {d / 'a_file'} is a file"]),
        "missing input": (["--model-prefix", str(d / "t2"), "--input", str(d / "nope")],
                          [f"--input {d / 'nope'}: file not found"]),
        "vocabulary too large": (["--model-prefix", str(d / "t3"), "--vocab-size", "100000"],
                                 ["SentencePiece cannot train a model with these settings",
                                  "lower --vocab-size"]),
    }
    for case, (argv, expected) in cases.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = _tool("train_tokenizer").main(["--input", str(corpus), *argv])
        _assert_one_error_line(code, err.getvalue(), expected, case)
    assert (d / "tok.model").read_bytes() == b"my model"
    assert not [n for n in os.listdir(d) if n.startswith(("t2", "t3"))]


@pytest.mark.multirank
def test_tokenizer_flags_the_tokenizer_does_not_read_warn(tmp_path):
    """A tokenizer input flag the chosen --tokenizer-type does not read, and a --vocab-size
    the tokenizer's vocabulary overrides, each say so in one warning; the run trains."""
    from dist_utils import run_distributed

    from megatron_auto.data.embedded import embedded_tokenizer_model

    model = embedded_tokenizer_model()
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"A short document number {i}, with words."})
                              + "\n" for i in range(64)))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert _tool("preprocess_data").main([
            "--input", str(corpus), "--output-prefix", str(tmp_path / "d"), "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", model, "--append-eod",
            "--log-interval", "0"]) == 0, err.getvalue()
    argv = [a for a in TINY if a != "--mock-data"] + [
        "--data-path", str(tmp_path / "d_text_document"), "--split", "1,0,0",
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
        "--merge-file", "merges.txt", "--data-cache-path", str(tmp_path / "cache")]
    [(code, err, out)] = run_distributed(_run_worker, 1, "pretrain_gpt", argv)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.strip()]
    assert warnings[0] == ("warning: --merge-file=merges.txt: not read by --tokenizer-type "
                           "SentencePieceTokenizer; drop it or choose the tokenizer that reads it")
    assert warnings[1].startswith("warning: --vocab-size=64: the model takes the vocabulary of "
                                  "--tokenizer-type SentencePieceTokenizer (")
    assert len(warnings) == 2 and "iteration        1/" in out


@pytest.mark.pure
def test_reproduce_flags_of_the_other_mode_warn(tmp_path):
    """reproduce: the --run flags without --run say they are ignored (here before a budget
    that fits no device stops the command, so no grid runs)."""
    code, err, _ = _cli(["reproduce", "--models", "bert-huge-32", "--budgets", "1000",
                         "--nproc-per-node", "4", "--run-iters", "5", "--out", str(tmp_path),
                         "--quiet", "--no-plots"])
    assert code == 2
    assert err[:2] == [
        "warning: --nproc-per-node=4: ignored; it applies to --run (train the plans on this "
        "cluster)",
        "warning: --run-iters=5: ignored; it applies to --run (train the plans on this cluster)"]
    assert "every budget exceeds the device memory" in err[2] and len(err) == 3
