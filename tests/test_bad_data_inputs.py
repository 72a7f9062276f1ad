"""Bad data and tokenizer inputs stop a run at start-up with one ``error:`` line and exit 2.

Each case names the flag or file in its message; none may end in a traceback (issue: data-stage
errors used to escape as ``TypeError`` / ``IndexError`` / ``RuntimeError`` tracebacks).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from harness import run_main
from megatron_auto.data import IndexedDatasetBuilder
from megatron_auto.data.preprocess import TokenizerArgs, preprocess_jsonl

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "1", "--eval-iters", "0"]


def _write_dataset(prefix, documents, dtype=np.int32):
    builder = IndexedDatasetBuilder(str(prefix), dtype)
    for doc in documents:
        builder.add_document(np.asarray(doc, dtype=np.int64), [len(doc)])
    builder.finalize()
    return str(prefix)


def _cases(tmp_path):
    good = _write_dataset(tmp_path / "good", [list(range(1, 40))] * 8)
    empty = _write_dataset(tmp_path / "empty", [])
    wide = _write_dataset(tmp_path / "wide", [list(range(590, 600))] * 8)
    (tmp_path / "fake.model").write_bytes(b"this is not a protobuf")
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]
    return {
        "empty dataset": ([*null, "--data-path", empty], ["--data-path", "holds no tokens"]),
        "empty training split": ([*null, "--data-path", good, "--split", "0,1,0"],
                                 ["--split 0,1,0", "training split gets no documents"]),
        "token ids past the vocabulary": ([*null, "--data-path", wide],
                                          ["--data-path", "token ids span [590, 599]", "vocabulary has 513 ids"]),
        "tokenizer model that is not one": (
            ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
             str(tmp_path / "fake.model"), "--data-path", good],
            ["--tokenizer-model", "fake.model", "not a SentencePiece model"]),
        "split that is not numbers": ([*null, "--data-path", good, "--split", "a,b"],
                                      ["--split 'a,b'", "969,30,1"]),
        "blend weight not finite": ([*null, "--data-path", "inf", good, "1", good],
                                    ["--data-path weights", "finite"]),
        "blend mixing weights and prefixes": ([*null, "--data-path", "0.5", good, good],
                                              ["--data-path", "mixes weights and prefixes"]),
    }


CASE_NAMES = ["empty dataset", "empty training split", "token ids past the vocabulary",
              "tokenizer model that is not one", "split that is not numbers",
              "blend weight not finite", "blend mixing weights and prefixes"]


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_data_input_is_one_error_line(tmp_path, case):
    argv, expected = _cases(tmp_path)[case]
    [(code, err)] = run_main("pretrain_gpt", 1, TINY + argv, capture="stderr")
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, err
    for fragment in expected:
        assert fragment in errors[0], (fragment, errors[0])


def _tok():
    return TokenizerArgs("NullTokenizer", vocab_size=50)


@pytest.mark.single
@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["empty file", "blank lines"])
def test_preprocess_refuses_an_input_without_documents(tmp_path, content):
    src = tmp_path / "in.jsonl"
    src.write_text(content)
    with pytest.raises(ValueError, match=r"--input .*in\.jsonl: no non-blank lines"):
        preprocess_jsonl(str(src), str(tmp_path / "out"), _tok())
    assert os.listdir(tmp_path) == ["in.jsonl"]  # nothing written, no temporary left


@pytest.mark.single
def test_preprocess_refuses_documents_without_tokens(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"text": ""}) for _ in range(3)) + "\n")
    with pytest.raises(ValueError, match="3 documents but no tokens under --json-keys text"):
        preprocess_jsonl(str(src), str(tmp_path / "out"), _tok())
    assert os.listdir(tmp_path) == ["in.jsonl"]


@pytest.mark.single
def test_preprocess_of_a_missing_input_leaves_no_temporary_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        preprocess_jsonl(str(tmp_path / "missing.jsonl"), str(tmp_path / "out"), _tok())
    assert os.listdir(tmp_path) == []
