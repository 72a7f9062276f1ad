"""What the bad-input tests of the entry points share (``test_bad_inputs.py``: the pretrain
scripts; ``test_bad_cli_inputs.py``: ``megatron-auto``; ``test_bad_tool_inputs.py``: the data
tools): the tiny model flags, the bad files the cases point at, the ``{d}`` placeholder, the
one-error-line check and the in-process runners of a script, the CLI and a tool."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "1", "--eval-iters", "0", "--mock-data",
        "--vocab-size", "64"]
CLI_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32"]


def make_files(tmp_path):
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


def fill(items, d):
    """``items`` with ``{d}`` replaced by the test's directory."""
    return [item.replace("{d}", str(d)) for item in items]


def assert_one_error_line(code, err, expected, label):
    """Exit 2, no traceback, and stderr one ``error:`` line holding every ``expected`` text."""
    assert code == 2, f"{label}: exit {code}\n{err}"
    assert "Traceback" not in err, f"{label}:\n{err}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"{label}: {len(lines)} lines:\n{err}"
    assert "error: " in lines[0], lines[0]
    for text in expected:
        assert text in lines[0], f"{label}: {text!r} not in {lines[0]!r}"


def run_script(name, argv):
    """(exit status, stderr, stdout) of an entry script's main in this process."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = importlib.import_module(name).main(argv)
    return code, err.getvalue(), out.getvalue()


def run_worker(rank, world_size, name, argv):
    """:func:`run_script` on a forked rank (``dist_utils.run_distributed``)."""
    return run_script(name, argv)


def run_cli(argv):
    """``megatron-auto argv`` in this process: (exit status, non-blank stderr lines, stdout)."""
    from megatron_auto import cli

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = cli.main(argv)
    return code, [line for line in err.getvalue().splitlines() if line.strip()], out.getvalue()


def load_tool(name):
    """``tools/<name>.py`` as a module (the tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
