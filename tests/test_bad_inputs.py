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
    "flag --train-iters 0": (["--train-iters", "0"], ["--train-iters=0", "positive integer"]),
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
}
PREPROCESS_CASES = {
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


def _train_worker(rank, world_size, argv):
    return _train(argv)


@pytest.mark.multirank
def test_bad_checkpoint_directory_is_one_error_line(tmp_path):
    from dist_utils import run_distributed

    d = _files(tmp_path)
    for case, (argv, expected) in CHECKPOINT_CASES.items():  # one loop: start-up costs little
        [(code, err)] = run_distributed(_train_worker, 1, TINY + _fill(argv, d))
        _assert_one_error_line(code, err, _fill(expected, d), case)


@pytest.mark.pure
@pytest.mark.parametrize("case", list(CLI_CASES))
def test_bad_megatron_auto_input_is_one_error_line(tmp_path, case):
    from megatron_auto import cli

    argv, expected = CLI_CASES[case]
    d = _files(tmp_path)
    if "searched.json" in " ".join(argv):
        _plan_with_unknown_cluster(d)
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
        code = module.main(_fill(argv, d) + ["--output-prefix", str(d / "out"),
                                             "--tokenizer-type", "NullTokenizer",
                                             "--vocab-size", "100"])
    _assert_one_error_line(code, err.getvalue(), _fill(expected, d), case)
    assert not [n for n in os.listdir(d) if n.startswith("out") or n.endswith(".tmp")]
