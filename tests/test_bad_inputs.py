"""Every bad input of issue 12 to the pretrain scripts, one table: exit code 2, one ``error:``
line, no traceback, and the message names the field, the value and the fix.

Categories (the case names start with them): ``flag`` (the pretrain scripts' flags, rejected
while parsing, before any process group exists), ``plan`` (a ``--plan`` file), ``checkpoint``
(a ``--load`` directory, found bad after the world is joined: forked one-rank runs), then the
T5 and vision scripts' flags and the flags that cannot apply (one warning, the run trains).
``megatron-auto``'s cases are ``tests/test_bad_cli_inputs.py``, the data tools'
``tests/test_bad_tool_inputs.py``. The data-stage cases (empty dataset or split, token ids past
the vocabulary, a tokenizer model that is not one, malformed ``--split`` / blend weights) are
the table of ``tests/test_bad_data_inputs.py``; argparse's own errors (unknown flags, bad
choices) print a usage line too and are checked in ``tests/test_arguments.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from bad_input_helpers import (TINY, assert_one_error_line, fill, load_tool, make_files, run_script,
                               run_worker)

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
    d = make_files(tmp_path)
    code, err = _train(TINY + fill(argv, d))
    assert_one_error_line(code, err, fill(expected, d), case)


@pytest.mark.multirank
def test_bad_checkpoint_directory_is_one_error_line(tmp_path):
    from harness import run_main

    d = make_files(tmp_path)
    for case, (argv, expected) in CHECKPOINT_CASES.items():  # one loop: start-up costs little
        [(code, err)] = run_main("pretrain_gpt", 1, TINY + fill(argv, d), capture="stderr")
        assert_one_error_line(code, err, fill(expected, d), case)


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
    d = make_files(tmp_path)
    code, err, out = run_script(name, fill(argv, d))
    assert_one_error_line(code, err, fill(expected, d), case)
    assert "iteration" not in out


@pytest.mark.multirank
def test_unwritable_save_dir_trains_nothing(tmp_path):
    """Case 1: --save that cannot be written (under /proc, a file, under a file, with and
    without --async-save) stops the run before the world is joined: no iteration, no metrics
    record, no plan file; it used to train until the first save and end in a traceback."""
    from dist_utils import run_distributed

    d = make_files(tmp_path)
    bad = [f"{d}/a_file", f"{d}/a_file/ck"] + (["/proc/megatron_auto_ck"]
                                               if os.path.isdir("/proc") else [])
    for save in bad:
        for extra in ([], ["--async-save"]):
            metrics, plan = d / "m.jsonl", d / "plan.json"
            argv = TINY + ["--train-iters", "2", "--save", save, "--save-interval", "1",
                           "--metrics-file", str(metrics), "--plan-out", str(plan), *extra]
            [(code, err, out)] = run_distributed(run_worker, 1, "pretrain_gpt", argv)
            assert_one_error_line(code, err, [f"--save={save}: "], save)
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
    assert run_distributed(run_worker, 1, "pretrain_gpt",
                           TINY + ["--save", str(ckpt)])[0][0] == 0
    assert latest.read_text().strip() == "1"
    before = {p.name: p.stat().st_mtime_ns for p in (ckpt / "iter_0000001").iterdir()}
    [(code, err, out)] = run_distributed(run_worker, 1, "pretrain_gpt",
                                         TINY + ["--save", str(ckpt), "--train-iters", "2"])
    assert_one_error_line(code, err, [f"--save={ckpt}: already holds a checkpoint (latest "
                                       f"iteration 1) that this run would replace; add --load "
                                       f"{ckpt} to continue it, --overwrite to save over it"],
                           "save over another run")
    assert "iteration" not in out
    assert {p.name: p.stat().st_mtime_ns for p in (ckpt / "iter_0000001").iterdir()} == before
    assert run_distributed(run_worker, 1, "pretrain_gpt", TINY + [
        "--save", str(ckpt), "--load", str(ckpt), "--train-iters", "2"])[0][0] == 0
    assert latest.read_text().strip() == "2"
    assert run_distributed(run_worker, 1, "pretrain_gpt", TINY + [
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

    d = make_files(tmp_path)
    for case, (name, argv, warning) in WARNING_CASES.items():  # one loop: start-up is cheap
        [(code, err, out)] = run_distributed(run_worker, 1, name, fill(argv, d))
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
    [(code, err, out)] = run_distributed(run_worker, 1, "pretrain_vision_classify", argv)
    assert_one_error_line(code, err, ["--sequence-parallel: the vit model does not run "
                                       "sequence parallelism yet; drop the flag"], "vision SP")


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
        assert load_tool("preprocess_data").main([
            "--input", str(corpus), "--output-prefix", str(tmp_path / "d"), "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", model, "--append-eod",
            "--log-interval", "0"]) == 0, err.getvalue()
    argv = [a for a in TINY if a != "--mock-data"] + [
        "--data-path", str(tmp_path / "d_text_document"), "--split", "1,0,0",
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
        "--merge-file", "merges.txt", "--data-cache-path", str(tmp_path / "cache")]
    [(code, err, out)] = run_distributed(run_worker, 1, "pretrain_gpt", argv)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.strip()]
    assert warnings[0] == ("warning: --merge-file=merges.txt: not read by --tokenizer-type "
                           "SentencePieceTokenizer; drop it or choose the tokenizer that reads it")
    assert warnings[1].startswith("warning: --vocab-size=64: the model takes the vocabulary of "
                                  "--tokenizer-type SentencePieceTokenizer (")
    assert len(warnings) == 2 and "iteration        1/" in out
