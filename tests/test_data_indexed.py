"""Indexed dataset: round trip, byte compatibility with the published format, clear errors."""

import os
import struct

import numpy as np
import pytest

from megatron_auto.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError

pytestmark = pytest.mark.pure

# Written from docs/design.md §5.4 / Megatron-LM's published layout, independently of the module.
MAGIC = b"MMIDIDX\x00\x00"
CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
         np.dtype(np.int64): 5, np.dtype(np.float64): 6, np.dtype(np.float32): 7, np.dtype(np.uint16): 8}


def write_by_hand(prefix, docs, dtype):
    """docs: list of documents, each a list of sequences (lists of ints); struct.pack only."""
    seqs = [s for d in docs for s in d]
    itemsize = np.dtype(dtype).itemsize
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, dtype=dtype).tobytes())
    doc_idx = [0]
    for d in docs:
        doc_idx.append(doc_idx[-1] + len(d))
    pointers, p = [], 0
    for s in seqs:
        pointers.append(p)
        p += len(s) * itemsize
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(seqs)}i", *[len(s) for s in seqs]))
        f.write(struct.pack(f"<{len(seqs)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def read_by_spec(prefix):
    """A from-spec reader: returns (dtype, documents as lists of sequences)."""
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == MAGIC
    (version,) = struct.unpack_from("<Q", raw, 9)
    assert version == 1
    (code,) = struct.unpack_from("<B", raw, 17)
    n_seq, n_doc = struct.unpack_from("<QQ", raw, 18)
    off = 34
    lengths = struct.unpack_from(f"<{n_seq}i", raw, off)
    off += 4 * n_seq
    pointers = struct.unpack_from(f"<{n_seq}q", raw, off)
    off += 8 * n_seq
    doc_idx = struct.unpack_from(f"<{n_doc}q", raw, off)
    assert off + 8 * n_doc == len(raw)
    dtype = {v: k for k, v in CODES.items()}[code]
    data = open(prefix + ".bin", "rb").read()
    seqs = [np.frombuffer(data, dtype, n, p).tolist() for n, p in zip(lengths, pointers)]
    return dtype, [seqs[doc_idx[i]:doc_idx[i + 1]] for i in range(n_doc - 1)]


DOCS = [[[1, 2, 3], [4]], [[5, 6, 7, 8, 9]], [[10], [11, 12], [13, 14, 15]]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_round_trip(tmp_path, dtype):
    prefix = str(tmp_path / "rt")
    b = IndexedDatasetBuilder(prefix, dtype)
    for doc in DOCS:
        for seq in doc:
            b.add_item(seq)
        b.end_document()
    b.finalize()
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == 6 and ds.num_documents == 3
    flat = [s for d in DOCS for s in d]
    for i, s in enumerate(flat):
        assert ds[i].tolist() == s
    assert ds.get(5, 1, 2).tolist() == [14, 15]
    assert ds.document_lengths().tolist() == [4, 5, 6]
    assert ds.get_document(2, 1, 4).tolist() == [11, 12, 13, 14]
    assert list(ds.document_sequences(2)) == [3, 4, 5]


def test_reads_hand_written_files(tmp_path):
    prefix = str(tmp_path / "hand")
    write_by_hand(prefix, DOCS, np.int32)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.int32
    assert [ds[i].tolist() for i in range(len(ds))] == [s for d in DOCS for s in d]
    assert ds.document_indices.tolist() == [0, 2, 3, 6]


def test_written_files_match_spec_reader_and_bytes(tmp_path):
    ours, hand = str(tmp_path / "ours"), str(tmp_path / "hand")
    b = IndexedDatasetBuilder(ours, np.uint16)
    for doc in DOCS:
        b.add_document([t for s in doc for t in s], [len(s) for s in doc])
    b.finalize()
    dtype, docs = read_by_spec(ours)
    assert dtype == np.uint16 and docs == DOCS
    write_by_hand(hand, DOCS, np.uint16)
    for ext in (".bin", ".idx"):
        assert open(ours + ext, "rb").read() == open(hand + ext, "rb").read()


def test_merge_and_overflow(tmp_path):
    a, m = str(tmp_path / "a"), str(tmp_path / "m")
    write_by_hand(a, DOCS, np.uint16)
    b = IndexedDatasetBuilder(m, np.uint16)
    b.add_index(a)
    b.add_index(a)
    b.finalize()
    assert read_by_spec(m)[1] == DOCS + DOCS
    b = IndexedDatasetBuilder(str(tmp_path / "o"), np.uint16)
    with pytest.raises(IndexedDatasetError, match=r"ids span \[0, 70000\].*wider dtype"):
        b.add_item([0, 70000])
    b.abort()
    assert not any(n.startswith("o.") for n in os.listdir(tmp_path))  # abort leaves no files


def _corrupt(tmp_path, edit):
    prefix = str(tmp_path / "bad")
    write_by_hand(prefix, DOCS, np.int32)
    edit(prefix)
    return prefix


def _patch(path, offset, data):
    raw = bytearray(open(path, "rb").read())
    raw[offset:offset + len(data)] = data
    open(path, "wb").write(bytes(raw))


def _truncate(path, drop):
    raw = open(path, "rb").read()
    open(path, "wb").write(raw[:-drop])


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda p: _patch(p + ".idx", 0, b"TNTIDX\x00\x00"), r"bad\.idx: wrong magic .*re-create"),
        (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)), r"bad\.idx: index version 2 is not supported"),
        (lambda p: _patch(p + ".idx", 17, struct.pack("<B", 9)), r"bad\.idx: unknown dtype code 9"),
        (lambda p: _truncate(p + ".idx", 8), r"bad\.idx: truncated index: .*6 sequences"),
        (lambda p: open(p + ".idx", "wb").write(MAGIC[:5]),
         r"truncated index: 5 bytes is shorter than the 34-byte header"),
        (lambda p: _truncate(p + ".bin", 4), r"bad\.bin: truncated data: 56 bytes .* needs 60"),
        (lambda p: os.remove(p + ".bin"), r"bad\.bin: data file not found"),
        (lambda p: os.remove(p + ".idx"), r"bad\.idx: index file not found.*preprocess_data"),
        (lambda p: _patch(p + ".idx", 34 + 6 * 12, struct.pack("<q", 5)), r"document indices must start at 0"),
    ],
    ids=["magic", "version", "dtype", "trunc-idx", "trunc-header", "trunc-bin", "no-bin", "no-idx", "doc-idx"],
)
def test_bad_files_give_clear_errors(tmp_path, edit, pattern):
    prefix = _corrupt(tmp_path, edit)
    with pytest.raises(IndexedDatasetError, match=pattern):
        IndexedDataset(prefix)


def test_multimodal_modes_accepted_other_trailing_bytes_rejected(tmp_path):
    prefix = str(tmp_path / "mm")
    write_by_hand(prefix, DOCS, np.int32)
    with open(prefix + ".idx", "ab") as f:
        f.write(bytes(6))  # Megatron multimodal: one int8 mode per sequence
    assert IndexedDataset(prefix)[5].tolist() == [13, 14, 15]
    with open(prefix + ".idx", "ab") as f:
        f.write(b"x")
    with pytest.raises(IndexedDatasetError, match="7 unexpected trailing bytes"):
        IndexedDataset(prefix)


def test_non_contiguous_pointers_are_reported(tmp_path):
    prefix = str(tmp_path / "gap")
    write_by_hand(prefix, DOCS, np.int32)
    # Sequence 2's pointer moved 4 bytes on: still inside .bin, but not back to back.
    _patch(prefix + ".idx", 34 + 6 * 4 + 2 * 8, struct.pack("<q", 4 * 4 + 4))
    ds = IndexedDataset(prefix)
    with pytest.raises(IndexedDatasetError, match="sequence 2 starts at byte 20 but sequence 1 ends at byte 16"):
        ds.get_document(1)


def test_bad_dtype_and_index_errors(tmp_path):
    with pytest.raises(IndexedDatasetError, match="dtype=bool: not storable"):
        IndexedDatasetBuilder(str(tmp_path / "x"), np.bool_)
    prefix = str(tmp_path / "ok")
    write_by_hand(prefix, DOCS, np.int32)
    ds = IndexedDataset(prefix)
    with pytest.raises(IndexError, match="out of range for 6 sequences"):
        ds[6]
    with pytest.raises(IndexError, match="outside sequence 0 of length 3"):
        ds.get(0, 2, 5)
