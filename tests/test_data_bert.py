"""BERT samples: layout, sentence pairs and order, masking statistics, determinism."""

from types import SimpleNamespace

import numpy as np
import pytest

from megatron_auto.data import IndexedDataset, IndexedDatasetBuilder, MockBertDataset, build_train_valid_test_datasets
from megatron_auto.data.bert_dataset import IGNORE_LABEL, BertDataset

pytestmark = pytest.mark.pure

SPECIAL = dict(pad=0, cls=1, sep=2, mask=3, eod=4)
PERIOD = 5  # "." in the document-level test


class ToyTokenizer(SimpleNamespace):
    """ids 0-4 special, 5 is '.', others are words; enough for BertDataset."""

    def detokenize(self, ids):
        return " ".join("." if i == PERIOD else f"w{i}" for i in ids)


def toy_tokenizer(vocab_size=5000):
    return ToyTokenizer(vocab_size=vocab_size, **SPECIAL)


def write_sentence_docs(prefix, num_docs, sents_per_doc, sent_len):
    """Sentence-level data; token 100 + running counter, so order inside a document is visible."""
    b = IndexedDatasetBuilder(prefix, np.int32)
    t = 100
    for _ in range(num_docs):
        n = sents_per_doc * sent_len
        b.add_document(np.arange(t, t + n), [sent_len] * sents_per_doc)
        t += n + 1000  # a gap between documents
    b.finalize()
    return IndexedDataset(prefix)


def originals(item):
    return np.where(item["labels"] != IGNORE_LABEL, item["labels"], item["text"])


def check_layout(item, seq_length):
    text, types, pad = item["text"], item["types"], item["padding_mask"]
    n = int(pad.sum())
    assert pad[:n].all() and not pad[n:].any()
    assert text[0] == SPECIAL["cls"] and text[n - 1] == SPECIAL["sep"] and (text[n:] == SPECIAL["pad"]).all()
    seps = np.nonzero(originals(item)[:n] == SPECIAL["sep"])[0]
    assert len(seps) == 2 and seps[1] == n - 1
    assert (types[: seps[0] + 1] == 0).all() and (types[seps[0] + 1 : n] == 1).all() and not types[n:].any()
    assert item["text"].shape == (seq_length,) and item["is_random"].shape == ()
    assert (item["loss_mask"] == (item["labels"] != IGNORE_LABEL)).all()
    return seps[0], n


def test_pairs_are_consecutive_sentences_and_order_label(tmp_path):
    idx = write_sentence_docs(str(tmp_path / "s"), num_docs=20, sents_per_doc=6, sent_len=7)
    ds = BertDataset(idx, np.arange(20), 200, 64, seed=5, tokenizer=toy_tokenizer(), cache_dir=str(tmp_path / "c"))
    swapped = 0
    for i in range(len(ds)):
        item = ds[i]
        sep, n = check_layout(item, 64)
        orig = originals(item)
        a, b = orig[1:sep], orig[sep + 1 : n - 1]
        assert len(a) and len(b) and len(a) + len(b) <= 61
        # Within a segment tokens are consecutive (one document, contiguous sentences)...
        assert (np.diff(a) == 1).all() and (np.diff(b) == 1).all()
        # ...and A precedes B in the document unless the pair was swapped.
        assert (a[0] > b[-1]) == bool(item["is_random"])
        assert abs(int(a[0]) - int(b[0])) < 6 * 7  # same document
        swapped += int(item["is_random"])
    assert 60 <= swapped <= 140  # 50% +- 4 sigma over 200


def test_masking_statistics():
    ds = MockBertDataset(vocab_size=30000, seq_length=128, num_samples=400, seed=3)
    selected = candidates = as_mask = kept = 0
    for i in range(len(ds)):
        item = ds[i]
        check_layout(item, 128)
        chosen = item["labels"] != IGNORE_LABEL
        orig = originals(item)
        candidates += int(((orig != SPECIAL["cls"]) & (orig != SPECIAL["sep"]) & (item["padding_mask"] == 1)).sum())
        selected += int(chosen.sum())
        as_mask += int((item["text"][chosen] == SPECIAL["mask"]).sum())
        kept += int((item["text"][chosen] == item["labels"][chosen]).sum())
    # ~7500 selections: the 80/10/10 fractions have a standard deviation below 0.005.
    assert abs(selected / candidates - 0.15) < 0.005
    assert abs(as_mask / selected - 0.8) < 0.02
    assert abs(kept / selected - 0.1) < 0.02
    assert abs((selected - as_mask - kept) / selected - 0.1) < 0.02  # random replacements


def test_deterministic_per_seed_and_index(tmp_path):
    idx = write_sentence_docs(str(tmp_path / "s"), 10, 4, 9)
    kw = dict(num_samples=30, seq_length=40, tokenizer=toy_tokenizer())
    a = BertDataset(idx, np.arange(10), seed=1, cache_dir=str(tmp_path / "a"), **kw)
    b = BertDataset(idx, np.arange(10), seed=1, cache_dir=str(tmp_path / "b"), **kw)
    c = BertDataset(idx, np.arange(10), seed=2, cache_dir=str(tmp_path / "a"), **kw)
    for key in a[7]:
        np.testing.assert_array_equal(a[7][key], b[7][key])
    assert any(not np.array_equal(a[i]["text"], c[i]["text"]) for i in range(5))


def test_document_level_data_split_on_the_fly(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "d"), np.int32)
    for d in range(8):  # one sequence per document: 4 "sentences" ending with '.', then eod
        words = [[100 + 50 * d + 10 * s + k for k in range(6)] + [PERIOD] for s in range(4)]
        b.add_item([t for w in words for t in w] + [SPECIAL["eod"]])
        b.end_document()
    b.finalize()
    train, _, _ = build_train_valid_test_datasets([str(tmp_path / "d")], "1,0,0", 32, 1, 20, 0, 0,
                                                  model="bert", tokenizer=toy_tokenizer())
    assert len(train.sentences) == 32 and (train.sentences[:, 2] == 7).all()  # eod dropped
    for i in range(len(train)):
        sep, n = check_layout(train[i], 32)
        assert SPECIAL["eod"] not in originals(train[i])[:n].tolist()


def test_single_sentence_documents_error(tmp_path):
    idx = write_sentence_docs(str(tmp_path / "s"), 5, 1, 10)
    with pytest.raises(ValueError, match="no document has 2 or more sentences; preprocess with --split-sentences"):
        BertDataset(idx, np.arange(5), 10, 32, 1, toy_tokenizer(), cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"needs a tokenizer with \[CLS\]"):
        BertDataset(idx, np.arange(5), 10, 32, 1, SimpleNamespace(vocab_size=10), cache_dir=str(tmp_path / "c"))


def test_mock_bert_errors():
    with pytest.raises(ValueError, match="seq_length=4 >= 5"):
        MockBertDataset(100, 4, 10)


def test_sentence_table_matches_brute_force(tmp_path):
    eod = SPECIAL["eod"]
    docs = [[[10, 11], [12, eod]], [], [[20], [], [21, 22, eod]], [[eod]], [[30, 31, 32], [33]]]
    b = IndexedDatasetBuilder(str(tmp_path / "s"), np.int32)
    for doc in docs:
        for sent in doc:
            b.add_item(sent)
        b.end_document()
    b.finalize()
    idx = IndexedDataset(str(tmp_path / "s"))
    from megatron_auto.data.bert_dataset import build_sentences

    chosen = np.array([0, 1, 2, 4])
    rows, bounds = build_sentences(idx, chosen, None, eod)
    expected_rows, expected_bounds, seq = [], [0], 0
    for d, doc in enumerate(docs):  # brute force over the nested lists
        for sent in doc:
            n = len(sent) - (1 if sent and sent[-1] == eod else 0)
            if d in chosen and n:
                expected_rows.append([seq, 0, n])
            seq += 1
        if d in chosen:
            expected_bounds.append(len(expected_rows))
    assert rows.tolist() == expected_rows and bounds.tolist() == expected_bounds
