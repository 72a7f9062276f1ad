"""Megatron-LM compatible indexed datasets: a ``.bin`` token array plus an ``.idx`` index.

Format (byte-compatible with Megatron-LM's ``MMapIndexedDataset``; docs/design.md §5.4)::

    .idx  b"MMIDIDX\\x00\\x00"         9 bytes magic
          <Q version = 1
          <B dtype code                 (DTYPE_CODES below)
          <Q sequence count  S
          <Q document count  D          (= number of documents + 1)
          int32[S]  sequence lengths    (in tokens)
          int64[S]  sequence pointers   (byte offset of each sequence in .bin)
          int64[D]  document indices    (0, then the sequence index that ends each document)
    .bin  the tokens of all sequences, back to back, in the dtype of the header

A *sequence* is the unit written by one ``add_item`` call (a whole document, or one sentence
when preprocessing splits sentences); a *document* is a run of sequences closed by
``end_document``. Both files are memory-mapped on open, so opening costs O(1) data reads, and
every structural fact is validated first so that a damaged file fails with a clear message
instead of returning garbage tokens later.
"""

from __future__ import annotations

import os
import struct
from typing import Sequence

import numpy as np

from ..utils.atomicfile import AtomicFile
from megatron_auto.data.errors import DataInputError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Header: magic, <Q version, <B dtype code, <Q sequence count, <Q document count.
_HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8

DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class IndexedDatasetError(DataInputError):
    """A missing, damaged or incompatible ``.bin/.idx`` pair; the message names file and fix."""


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def dtype_code(dtype: np.dtype | type) -> int:
    """The header code of a numpy dtype; raises for dtypes the format cannot store."""
    dt = np.dtype(dtype)
    if dt not in _CODE_OF_DTYPE:
        names = ", ".join(np.dtype(v).name for v in DTYPE_CODES.values())
        raise IndexedDatasetError(f"dtype={dt.name}: not storable in an indexed dataset; use one of {names}")
    return _CODE_OF_DTYPE[dt]


def optimal_dtype(vocab_size: int | None) -> type[np.generic]:
    """uint16 when every token id fits (Megatron's rule: vocab < 65500), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


# --------------------------------------------------------------------------------------- writer
class IndexedDatasetBuilder:
    """Streams sequences into ``prefix.bin``; ``finalize`` writes ``prefix.idx``.

    Usage: ``add_item(tokens)`` per sequence, ``end_document()`` after the last sequence of each
    document (or ``add_document(tokens, lengths)``), then ``finalize()``. Files are written
    under temporary names and renamed into place on ``finalize`` (data first, then index), so a
    reader never sees a half-written pair and concurrent writers of identical content are safe.
    """

    def __init__(self, prefix: str, dtype: type[np.generic] | np.dtype = np.int32) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        # A private temporary file (unique across hosts sharing a file system), renamed on
        # finalize.
        self._bin_file = AtomicFile(data_file_path(prefix), "wb")
        self._bin = self._bin_file.file
        self._lengths: list[int] = []
        self._doc_indices: list[int] = [0]
        self._finalized = False

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence. Token ids must fit the builder's dtype."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise IndexedDatasetError(f"add_item: tokens must be 1-D, got shape {arr.shape}")
        if arr.size and np.issubdtype(arr.dtype, np.integer) and np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise IndexedDatasetError(
                    f"add_item: token ids span [{lo}, {hi}] but dtype {self.dtype.name} holds "
                    f"[{info.min}, {info.max}]; build with a wider dtype (e.g. int32)"
                )
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(arr.size))

    @property
    def num_tokens(self) -> int:
        """Tokens added so far."""
        return sum(self._lengths)

    def end_document(self) -> None:
        """Close the current document (the sequences added since the previous call)."""
        self._doc_indices.append(len(self._lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int]) -> None:
        """Append one document made of ``len(lengths)`` sequences cut from ``tokens``."""
        arr = np.asarray(tokens)
        if sum(lengths) != arr.size:
            raise IndexedDatasetError(
                f"add_document: lengths sum to {sum(lengths)} but {arr.size} tokens were given"
            )
        start = 0
        for n in lengths:
            self.add_item(arr[start : start + n])
            start += n
        self.end_document()

    def add_index(self, prefix: str) -> None:
        """Append every sequence and document of the existing dataset at ``prefix``."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"add_index: {index_file_path(prefix)} has dtype {other.dtype.name}, this "
                f"builder {self.dtype.name}; merge datasets of the same dtype"
            )
        offset = len(self._lengths)
        self._lengths.extend(int(n) for n in other.sequence_lengths)
        self._doc_indices.extend(int(d) + offset for d in other.document_indices[1:])
        with open(data_file_path(prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)

    def abort(self) -> None:
        """Discard what was written (no output files appear)."""
        if not self._finalized:
            self._bin_file.abort()
            self._finalized = True

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        if self._finalized:
            return
        if self._doc_indices[-1] != len(self._lengths):
            # Sequences after the last end_document() form a final document (Megatron would
            # silently drop them from the document list, making them unreachable).
            self._doc_indices.append(len(self._lengths))
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        docs = np.asarray(self._doc_indices, dtype=np.int64)
        index = AtomicFile(index_file_path(self.prefix), "wb")
        try:
            f = index.file
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", self._code))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(docs)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(docs.tobytes(order="C"))
            # Data first, then index: a reader that finds the new index also finds its data.
            self._bin_file.commit()
            index.commit()
        except BaseException:
            index.abort()
            self._bin_file.abort()
            raise
        self._finalized = True


# --------------------------------------------------------------------------------------- reader
def _read_index(path: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray, np.memmap | None]:
    """Parse and validate an ``.idx`` file; returns dtype, lengths, pointers, doc indices."""
    if not os.path.isfile(path):
        raise IndexedDatasetError(
            f"{path}: index file not found; pass the prefix without extension (--data-path "
            f"PREFIX for PREFIX.bin/.idx) and create the pair with tools/preprocess_data.py"
        )
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = f.read(_HEADER_SIZE)
    if header[: len(MAGIC)] != MAGIC[: len(header)]:
        raise IndexedDatasetError(
            f"{path}: wrong magic {header[:len(MAGIC)]!r} (expected {MAGIC!r}); this is not a "
            f"Megatron mmap indexed dataset index (old 'TNTIDX' lazy/cached formats are not "
            f"supported); re-create it with tools/preprocess_data.py"
        )
    if len(header) < _HEADER_SIZE:
        raise IndexedDatasetError(
            f"{path}: truncated index: {size} bytes is shorter than the {_HEADER_SIZE}-byte "
            f"header; the file was cut off, re-create it with tools/preprocess_data.py"
        )
    (version,) = struct.unpack_from("<Q", header, len(MAGIC))
    if version != VERSION:
        raise IndexedDatasetError(
            f"{path}: index version {version} is not supported (expected {VERSION}); "
            f"re-create it with tools/preprocess_data.py"
        )
    (code,) = struct.unpack_from("<B", header, len(MAGIC) + 8)
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(
            f"{path}: unknown dtype code {code} (valid: {sorted(DTYPE_CODES)}); the index is "
            f"damaged or from another format; re-create it with tools/preprocess_data.py"
        )
    num_seqs, num_docs = struct.unpack_from("<QQ", header, len(MAGIC) + 9)
    expected = _HEADER_SIZE + num_seqs * (4 + 8) + num_docs * 8
    if size < expected:
        raise IndexedDatasetError(
            f"{path}: truncated index: {size} bytes but the header announces {num_seqs} "
            f"sequences and {num_docs} document entries ({expected} bytes); the file was cut "
            f"off, re-create it with tools/preprocess_data.py"
        )
    # Megatron's multimodal indices append one int8 mode per sequence; text training ignores it.
    if size > expected and size != expected + num_seqs:
        raise IndexedDatasetError(
            f"{path}: index has {size - expected} unexpected trailing bytes ({size} bytes, "
            f"header implies {expected}); the file is damaged, re-create it"
        )
    mm = np.memmap(path, mode="r", dtype=np.uint8) if size > 0 else None
    off = _HEADER_SIZE
    lengths = np.frombuffer(mm, dtype=np.int32, count=num_seqs, offset=off)
    off += num_seqs * 4
    pointers = np.frombuffer(mm, dtype=np.int64, count=num_seqs, offset=off)
    off += num_seqs * 8
    docs = np.frombuffer(mm, dtype=np.int64, count=num_docs, offset=off)
    if num_docs == 0 or docs[0] != 0 or docs[-1] != num_seqs or np.any(np.diff(docs) < 0):
        raise IndexedDatasetError(
            f"{path}: document indices must start at 0, never decrease and end at the "
            f"sequence count {num_seqs}; the index is damaged, re-create it"
        )
    return np.dtype(DTYPE_CODES[code]), lengths, pointers, docs, mm


class IndexedDataset:
    """Read-only, memory-mapped view of ``prefix.bin`` + ``prefix.idx``.

    ``ds[i]`` is sequence ``i`` as a numpy array (a view into the map; copy before mutating),
    ``ds.get(i, offset, length)`` a slice of it. ``sequence_lengths``, ``sequence_pointers``
    and ``document_indices`` expose the index. Every sequence is checked to lie inside the
    ``.bin`` file on open (O(1): pointers are checked against the final byte offset).
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        self.dtype, self.sequence_lengths, self.sequence_pointers, self.document_indices, self._idx_map = (
            _read_index(idx_path)
        )
        if not os.path.isfile(bin_path):
            raise IndexedDatasetError(
                f"{bin_path}: data file not found next to its index {idx_path}; copy the .bin "
                f"with the .idx or re-create both with tools/preprocess_data.py"
            )
        itemsize = self.dtype.itemsize
        n = len(self.sequence_lengths)
        expected = int(self.sequence_lengths.astype(np.int64).sum()) * itemsize
        if n and (int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize) > expected:
            expected = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize
        actual = os.path.getsize(bin_path)
        if actual < expected:
            raise IndexedDatasetError(
                f"{bin_path}: truncated data: {actual} bytes but the index {idx_path} needs "
                f"{expected} ({n} sequences of {self.dtype.name}); the copy was cut off, "
                f"re-create or re-copy the pair"
            )
        if n and (np.any(self.sequence_pointers < 0) or np.any(self.sequence_lengths < 0)):
            raise IndexedDatasetError(f"{idx_path}: negative sequence length or pointer; index damaged")
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if actual > 0 else np.zeros(0, np.uint8)
        self._doc_lengths: np.ndarray | None = None
        self._doc_pointers: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.astype(np.int64).sum())

    def __getitem__(self, idx: int) -> np.ndarray:
        if not isinstance(idx, (int, np.integer)):
            raise TypeError(f"IndexedDataset index must be an int, got {type(idx).__name__}")
        return self.get(int(idx))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end by default)."""
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences in {self.prefix}")
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"slice [{offset}, {offset + length}) outside sequence {idx} of length {seq_len}"
            )
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def token_id_range(self, chunk_tokens: int = 1 << 24) -> tuple[int, int]:
        """(least, largest) token id in the data file, ``(0, -1)`` when it holds none.

        One pass over the memory-mapped ``.bin`` in chunks (about 0.3 s per GB), so a model
        whose vocabulary is too small for the data is refused when the data is opened rather
        than by an index error (a device-side assert on GPUs) in some later batch.
        """
        count = self.num_tokens
        if count == 0:
            return 0, -1
        tokens = np.frombuffer(self._bin, dtype=self.dtype, count=count)
        low, high = None, None
        for start in range(0, count, chunk_tokens):
            part = tokens[start : start + chunk_tokens]
            lo, hi = int(part.min()), int(part.max())
            low = lo if low is None else min(low, lo)
            high = hi if high is None else max(high, hi)
        return int(low), int(high)

    def document_sequences(self, doc: int) -> range:
        """Sequence indices of document ``doc``."""
        return range(int(self.document_indices[doc]), int(self.document_indices[doc + 1]))

    def document_lengths(self) -> np.ndarray:
        """Tokens per document, int64 (num_documents,)."""
        cum = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        return cum[self.document_indices[1:]] - cum[self.document_indices[:-1]]

    def document_pointers(self) -> np.ndarray:
        """Byte offset of each document in ``.bin``, int64 (num_documents,).

        A document's sequences are written back to back, so the document is one slice of the
        data file starting at its first sequence (empty documents get offset 0; never read).
        """
        if len(self) == 0:
            return np.zeros(self.num_documents, dtype=np.int64)
        # Reading a document as one slice needs each sequence to start where the previous one
        # ends. Every Megatron writer does that, but a foreign writer might not: check once.
        starts = self.sequence_pointers[1:]
        ends = self.sequence_pointers[:-1] + self.sequence_lengths[:-1].astype(np.int64) * self.dtype.itemsize
        gaps = np.nonzero(starts != ends)[0]
        if len(gaps):
            i = int(gaps[0]) + 1
            raise IndexedDatasetError(
                f"{index_file_path(self.prefix)}: sequence {i} starts at byte {int(starts[i - 1])} but sequence "
                f"{i - 1} ends at byte {int(ends[i - 1])}; documents must be stored back to back, as "
                f"tools/preprocess_data.py writes them; re-create the files"
            )
        first = np.minimum(self.document_indices[:-1], len(self) - 1)
        return np.where(self.document_indices[1:] > self.document_indices[:-1], self.sequence_pointers[first], 0)

    def get_document(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``doc`` (across its sequences)."""
        doc_len = int(self.document_lengths_cached()[doc])
        if length is None:
            length = doc_len - offset
        if offset < 0 or length < 0 or offset + length > doc_len:
            raise IndexError(f"slice [{offset}, {offset + length}) outside document {doc} of length {doc_len}")
        start = int(self.document_pointers_cached()[doc]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def document_lengths_cached(self) -> np.ndarray:
        if self._doc_lengths is None:
            self._doc_lengths = self.document_lengths()
        return self._doc_lengths

    def document_pointers_cached(self) -> np.ndarray:
        if self._doc_pointers is None:
            self._doc_pointers = self.document_pointers()
        return self._doc_pointers
