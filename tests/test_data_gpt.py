"""GPT dataset indices, splits, blending and data-path parsing, checked by brute force."""

import os

import numpy as np
import pytest

from megatron_auto.data import (
    BlendedDataset,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    MockGPTDataset,
    build_train_valid_test_datasets,
    parse_data_path,
    parse_split,
)
from megatron_auto.data.blended_dataset import build_blending_indices
from megatron_auto.data.builder import split_document_ranges
from megatron_auto.data.gpt_dataset import make_gpt_item

pytestmark = pytest.mark.pure


def write_docs(prefix, lengths, start=0, sentences=1):
    """Documents of the given lengths whose tokens are consecutive ints from ``start``."""
    b = IndexedDatasetBuilder(prefix, np.int32)
    t = start
    for n in lengths:
        toks = np.arange(t, t + n)
        cuts = np.array_split(toks, sentences) if n >= sentences else [toks]
        b.add_document(toks, [len(c) for c in cuts])
        t += n
    b.finalize()
    return IndexedDataset(prefix)


def test_samples_match_brute_force_stream_and_cover_every_token(tmp_path):
    # 1 + 4*9 = 37 tokens split over uneven documents (one empty, one with 3 sentences).
    lengths = [5, 0, 11, 1, 7, 13]
    ds_idx = write_docs(str(tmp_path / "d"), lengths, sentences=3)
    docs = np.arange(len(lengths))
    ds = GPTDataset(ds_idx, docs, num_samples=4, seq_length=9, seed=3, cache_dir=str(tmp_path / "c"))
    doc_tokens = [ds_idx.get_document(d).tolist() for d in docs]
    stream = [t for p in ds.doc_idx for t in doc_tokens[int(docs[p])]]  # brute force
    for j in range(4):
        assert ds.sample_tokens(j).tolist() == stream[j * 9 : j * 9 + 10]
    seen = set()
    for i in range(len(ds)):
        item = ds[i]
        assert item["tokens"].dtype == np.int64 and item["loss_mask"].dtype == np.float32
        np.testing.assert_array_equal(item["labels"][:-1], item["tokens"][1:])
        seen |= set(item["tokens"].tolist()) | set(item["labels"].tolist())
    assert seen == set(range(sum(lengths)))  # every token of the split, in one epoch
    assert sorted(ds.shuffle_idx.tolist()) == [0, 1, 2, 3]


def test_indices_deterministic_cached_and_seed_dependent(tmp_path):
    idx = write_docs(str(tmp_path / "d"), [7] * 30)
    a = GPTDataset(idx, np.arange(30), 50, 8, seed=1, cache_dir=str(tmp_path / "c"))
    files = sorted(os.listdir(tmp_path / "c" / "GPTDataset_indices"))
    assert len([f for f in files if f.endswith(".npy")]) == 3
    b = GPTDataset(idx, np.arange(30), 50, 8, seed=1, cache_dir=str(tmp_path / "c"))  # from cache
    c = GPTDataset(idx, np.arange(30), 50, 8, seed=1, cache_dir=str(tmp_path / "c2"))  # rebuilt
    d = GPTDataset(idx, np.arange(30), 50, 8, seed=2, cache_dir=str(tmp_path / "c"))
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        np.testing.assert_array_equal(getattr(a, name), getattr(c, name))
    assert not np.array_equal(a.shuffle_idx, d.shuffle_idx)
    # 50 samples of 8 need 401 tokens: two epochs of 210, each document exactly twice.
    assert np.bincount(a.doc_idx).tolist() == [2] * 30
    np.testing.assert_array_equal(a[17]["tokens"], c[17]["tokens"])


def test_default_cache_is_next_to_data(tmp_path):
    idx = write_docs(str(tmp_path / "d"), [9] * 4)
    GPTDataset(idx, np.arange(4), 3, 8, seed=1)
    assert os.path.isdir(tmp_path / "cache" / "GPTDataset_indices")


def test_eod_mask_and_position_reset():
    sample = np.array([5, 6, 0, 7, 8, 0, 9])
    item = make_gpt_item(sample, eod=0, eod_mask_loss=True, reset_position_ids=True)
    assert item["loss_mask"].tolist() == [1, 1, 0, 1, 1, 0]
    assert item["position_ids"].tolist() == [0, 1, 2, 0, 1, 2]
    plain = make_gpt_item(sample)
    assert plain["loss_mask"].tolist() == [1] * 6 and plain["position_ids"].tolist() == list(range(6))


def test_mock_gpt_deterministic():
    a, b = MockGPTDataset(50, 16, 10, seed=7), MockGPTDataset(50, 16, 10, seed=7)
    np.testing.assert_array_equal(a[3]["tokens"], b[3]["tokens"])
    assert not np.array_equal(a[3]["tokens"], a[4]["tokens"])
    assert a[3]["tokens"].shape == (16,) and a[3]["tokens"].max() < 50
    with pytest.raises(IndexError, match=r"index 10 out of range \[0, 10\)"):
        a[10]


@pytest.mark.parametrize("weights", [[0.3, 0.7], [1, 1, 2], [0.05, 0.9, 0.05]])
def test_blending_proportions_within_one_percent(weights):
    size = 20000
    index, sample = build_blending_indices(weights, size)
    w = np.asarray(weights) / sum(weights)
    for n in (100, 1000, 7777, size):  # every prefix of the blend is balanced
        counts = np.bincount(index[:n], minlength=len(w))
        assert np.all(np.abs(counts / n - w) <= 0.01), (n, counts)
    for d in range(len(w)):  # each dataset's samples used once, in order
        assert sample[index == d].tolist() == list(range(int((index == d).sum())))


def test_parse_data_path_and_split():
    assert parse_data_path(["0.3", "A", "0.7", "B"]) == (["A", "B"], [0.3, 0.7])
    assert parse_data_path(["0.3 A 0.7 B"]) == (["A", "B"], [0.3, 0.7])
    assert parse_data_path(["A", "B"]) == (["A", "B"], None)
    with pytest.raises(ValueError, match="mixes weights and prefixes"):
        parse_data_path(["0.3", "A", "B"])
    with pytest.raises(ValueError, match="--data-path is empty"):
        parse_data_path([])
    np.testing.assert_allclose(parse_split("969,30,1"), [0.969, 0.03, 0.001])
    np.testing.assert_allclose(parse_split("98/2"), [0.98, 0.02, 0.0])
    with pytest.raises(ValueError, match="--split 'a,b'"):
        parse_split("a,b")
    # 10 docs at 0.5/0.25/0.25: rounding of the cumulative bounds 5, 7.5 -> 8, 10.
    assert split_document_ranges(10, [0.5, 0.25, 0.25]) == [(0, 5), (5, 8), (8, 10)]


def test_build_splits_by_documents(tmp_path):
    prefix = str(tmp_path / "d")
    write_docs(prefix, [10] * 100)
    train, valid, test = build_train_valid_test_datasets([prefix], "80,10,10", 16, 1, 40, 5, 0)
    assert test is None and len(train) == 40 and len(valid) == 5
    train_tokens = {t for i in range(len(train)) for t in train[i]["tokens"].tolist()}
    valid_tokens = {t for i in range(len(valid)) for t in valid[i]["tokens"].tolist()}
    assert max(train_tokens) < 800 and min(valid_tokens) >= 800 and max(valid_tokens) < 900


def test_build_blended_from_two_prefixes(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_docs(a, [20] * 50)  # tokens 0..999
    write_docs(b, [20] * 50, start=10_000)
    train, _, _ = build_train_valid_test_datasets(["0.25", a, "0.75", b], "1,0,0", 8, 1, 400, 0, 0,
                                                  cache_dir=str(tmp_path / "c"))
    assert isinstance(train, BlendedDataset) and len(train) == 400
    from_b = sum(train[i]["tokens"][0] >= 10_000 for i in range(400))
    assert from_b == 300  # exactly 3/4: the schedule is within one sample of the weights
    # Unweighted prefixes blend in proportion to their tokens (here 1000 vs 1000).
    train, _, _ = build_train_valid_test_datasets([a, b], "1,0,0", 8, 1, 100, 0, 0)
    assert sum(train[i]["tokens"][0] >= 10_000 for i in range(100)) == 50


def test_build_errors(tmp_path):
    with pytest.raises(ValueError, match="model='t5': expected 'gpt' or 'bert'"):
        build_train_valid_test_datasets(["x"], "1", 8, 1, 1, 0, 0, model="t5")
    with pytest.raises(ValueError, match="model='bert' needs tokenizer="):
        build_train_valid_test_datasets(["x"], "1", 8, 1, 1, 0, 0, model="bert")
    with pytest.raises(Exception, match="index file not found"):
        build_train_valid_test_datasets([str(tmp_path / "none")], "1", 8, 1, 1, 0, 0)
