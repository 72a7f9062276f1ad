"""Every bad input of the data tools (``tools/preprocess_data.py``, ``tools/train_tokenizer.py``):
exit code 2, one ``error:`` line, no traceback, the message naming the field, the value and the
fix, and nothing written or replaced. The pretrain scripts' table is ``tests/test_bad_inputs.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from bad_input_helpers import assert_one_error_line, fill, load_tool, make_files

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


@pytest.mark.single
@pytest.mark.parametrize("case", list(PREPROCESS_CASES))
def test_bad_preprocess_input_is_one_error_line(tmp_path, case):
    module = load_tool("preprocess_data")
    argv, expected = PREPROCESS_CASES[case]
    d = make_files(tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        tokenizer = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
        prefix = [] if "--output-prefix" in argv else ["--output-prefix", str(d / "out")]
        code = module.main(fill(argv, d) + prefix + tokenizer)
    assert_one_error_line(code, err.getvalue(), fill(expected, d), case)
    assert not [n for n in os.listdir(d) if n.startswith("out") or n.endswith(".tmp")]
    assert (d / "old_text_document.bin").read_bytes() == b"mine"  # never replaced


@pytest.mark.single
def test_preprocess_overwrite_and_unread_tokenizer_flags(tmp_path):
    """--overwrite replaces an existing dataset; a tokenizer flag the chosen tokenizer does
    not read is one warning."""
    d = make_files(tmp_path)
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = load_tool("preprocess_data").main([
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
    d = make_files(tmp_path)
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
            code = load_tool("train_tokenizer").main(["--input", str(corpus), *argv])
        assert_one_error_line(code, err.getvalue(), expected, case)
    assert (d / "tok.model").read_bytes() == b"my model"
    assert not [n for n in os.listdir(d) if n.startswith(("t2", "t3"))]
