"""tools/preprocess_data.py end to end, sentence splitting, and the embedded default corpus."""

import pytest

import gzip
import importlib.util
import json
import os

import numpy as np

from dist_utils import run_distributed
from megatron_auto.data import IndexedDataset, build_tokenizer, build_train_valid_test_datasets, embedded_dataset
from megatron_auto.data.embedded import embedded_corpus_path
from megatron_auto.data.preprocess import split_sentences

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("preprocess_data", os.path.join(ROOT, "tools", "preprocess_data.py"))
preprocess_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(preprocess_data)


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


@pytest.mark.single
def test_null_tokenizer_end_to_end_with_workers(tmp_path, capsys):
    records = [{"text": " ".join(str((7 * i + k) % 50) for k in range(i % 5)), "title": str(i)} for i in range(40)]
    write_jsonl(tmp_path / "in.jsonl", records)
    outs = {}
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}")
        rc = preprocess_data.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", prefix,
                                   "--tokenizer-type", "NullTokenizer", "--vocab-size", "50", "--append-eod",
                                   "--json-keys", "text", "title", "--workers", str(workers), "--log-interval", "10"])
        assert rc == 0
        outs[workers] = prefix
    out = capsys.readouterr()
    assert "40 documents" in out.out and "tokens/s" in out.out and "processed 10 documents" in out.err
    ds = IndexedDataset(outs[1] + "_text_document")
    assert ds.dtype == np.uint16 and ds.num_documents == 40
    for i, r in enumerate(records):  # eod (= 50) appended to non-empty documents only
        expected = [int(t) for t in r["text"].split()] + ([50] if r["text"] else [])
        assert ds.get_document(i).tolist() == expected
    assert IndexedDataset(outs[1] + "_title_document").get_document(13).tolist() == [13, 50]
    for ext in (".bin", ".idx"):  # workers do not change the output
        for key in ("text", "title"):
            a = open(f"{outs[1]}_{key}_document{ext}", "rb").read()
            assert a == open(f"{outs[2]}_{key}_document{ext}", "rb").read()


@pytest.mark.single
def test_split_sentences_sentencepiece(tmp_path):
    text = "The first sentence. The second one! A third? Yes."
    write_jsonl(tmp_path / "in.jsonl", [{"text": text}, {"text": "Only one"}])
    rc = preprocess_data.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "o"),
                               "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "embedded",
                               "--split-sentences"])
    assert rc == 0
    ds = IndexedDataset(str(tmp_path / "o_text_sentence"))
    assert ds.document_indices.tolist() == [0, 4, 5]
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=preprocess_data.embedded_tokenizer_model())
    assert [tok.detokenize(ds[i].tolist()) for i in range(4)] == split_sentences(text)


@pytest.mark.single
def test_regex_sentence_splitter():
    assert split_sentences("Hi there. (See below.) 3 cats! e.g. this.\n\nNext para", use_nltk=False) == [
        "Hi there.", "(See below.)", "3 cats! e.g. this.", "Next para"]  # no cut before lower case


@pytest.mark.single
def test_errors_are_clear(tmp_path, capsys):
    write_jsonl(tmp_path / "in.jsonl", [{"body": "x"}])
    args = ["--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "5"]
    assert preprocess_data.main(["--input", str(tmp_path / "in.jsonl")] + args) == 2
    assert "in.jsonl:1: no key 'text' (has ['body']); set --json-keys" in capsys.readouterr().err
    assert not any(n.startswith("o_") for n in os.listdir(tmp_path))  # nothing half-written
    assert preprocess_data.main(["--input", str(tmp_path / "missing.jsonl")] + args) == 2
    assert "--input" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert preprocess_data.main(["--input", str(tmp_path / "bad.jsonl")] + args) == 2
    assert "bad.jsonl:1: not valid JSON" in capsys.readouterr().err
    (tmp_path / "list.jsonl").write_text('["text"]\n')
    assert preprocess_data.main(["--input", str(tmp_path / "list.jsonl")] + args) == 2
    assert "list.jsonl:1: a JSON list, not an object" in capsys.readouterr().err


@pytest.mark.single
def test_embedded_corpus_and_tokenizer(tmp_path):
    prefix, model = embedded_dataset(cache_dir=str(tmp_path))
    ds = IndexedDataset(prefix)
    with gzip.open(embedded_corpus_path(), "rt") as f:
        texts = [json.loads(line)["text"] for line in f]
    assert ds.num_documents == len(texts) > 1000 and ds.num_tokens > 300_000
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    first = ds.get_document(0).tolist()
    assert first[-1] == tok.eod and tok.detokenize(first[:-1]) == texts[0]
    mtime = os.path.getmtime(prefix + ".bin")
    assert embedded_dataset(cache_dir=str(tmp_path)) == (prefix, model)  # cached: not rebuilt
    assert os.path.getmtime(prefix + ".bin") == mtime


def _rank_builds_embedded_and_gpt(rank, world_size, cache_dir):
    # Every rank builds the embedded files and the GPT indices at the same moment, into one cache.
    import torch.distributed as dist

    dist.barrier()
    prefix, model = embedded_dataset(cache_dir=cache_dir)
    train, valid, _ = build_train_valid_test_datasets([prefix], "98,2,0", 64, 1, 200, 20, 0, cache_dir=cache_dir)
    return prefix, [train[i]["tokens"].tolist() for i in (0, 57, 199)], valid[3]["labels"].tolist()


@pytest.mark.multirank
def test_embedded_and_indices_built_by_concurrent_ranks(tmp_path):
    results = run_distributed(_rank_builds_embedded_and_gpt, 2, str(tmp_path))
    assert results[0] == results[1]
    assert IndexedDataset(results[0][0]).num_documents > 1000
    leftovers = [n for _, _, files in os.walk(tmp_path) for n in files if ".tmp" in n]
    assert not leftovers
