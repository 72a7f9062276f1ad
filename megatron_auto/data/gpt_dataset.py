"""GPT (causal LM) samples of ``seq_length + 1`` tokens cut across document boundaries.

The index design follows Megatron-LM (our own code): three integer arrays, built once and
cached (``index_cache``):

- ``doc_idx`` (num_epochs * num_docs,): the split's documents, each epoch in a fresh random
  order, concatenated. Reading documents in this order gives one long token stream.
- ``sample_idx`` (num_samples + 1, 2): where sample ``j`` starts in that stream, as
  (position in ``doc_idx``, token offset in that document). Sample ``j`` covers stream tokens
  ``[j * seq_length, (j + 1) * seq_length + 1)``: consecutive samples share one token, the
  last label of one being the first input of the next, so no token is lost between samples.
- ``shuffle_idx`` (num_samples,): the order in which samples are served.

Item ``i`` is sample ``shuffle_idx[i]``. The training loop resumes by indexing from
``consumed_samples`` on; nothing else needs saving.
"""

from __future__ import annotations

import numpy as np

from megatron_auto.data.index_cache import array_digest, cached_arrays, params_hash, resolve_cache_dir
from megatron_auto.data.indexed_dataset import IndexedDataset


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest epoch count whose token stream holds ``num_samples`` samples (+1 shared token)."""
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_sample_indices(
    doc_lengths: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx, sample_idx, shuffle_idx) for documents of ``doc_lengths`` tokens (see module doc).

    ``doc_idx`` holds positions into ``doc_lengths`` (0..len-1), not dataset document ids.
    """
    doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
    tokens_per_epoch = int(doc_lengths.sum())
    if tokens_per_epoch == 0:
        raise ValueError("GPT dataset: the split's documents hold no tokens; check --split and --data-path")
    rng = np.random.default_rng(seed)
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    doc_idx = np.concatenate([rng.permutation(len(doc_lengths)) for _ in range(num_epochs)]).astype(np.int64)
    stream_end = np.concatenate([[0], np.cumsum(doc_lengths[doc_idx])])  # token offset of each doc
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # The document holding stream token t is the last one starting at or before t; 'right'
    # skips empty documents, whose start equals the next one's.
    pos = np.searchsorted(stream_end, starts, side="right") - 1
    sample_idx = np.stack([pos, starts - stream_end[pos]], axis=1).astype(np.int64)
    shuffle_idx = rng.permutation(num_samples).astype(np.int64)
    return doc_idx, sample_idx, shuffle_idx


class GPTDataset:
    """``num_samples`` GPT samples over documents ``document_ids`` of ``indexed``.

    Items are dicts of numpy arrays (s = seq_length): ``tokens`` int64 (s,), ``labels`` int64
    (s,) = tokens shifted by one, ``loss_mask`` float32 (s,) (1 everywhere, 0 where the input
    token is ``eod`` when ``eod_mask_loss``), ``position_ids`` int64 (s,) (restarting after each
    ``eod`` when ``reset_position_ids``). Deterministic for a given seed; indices are cached in
    ``cache_dir`` (default: next to the data).
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        document_ids: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        cache_dir: str | None = None,
        eod: int | None = None,
        eod_mask_loss: bool = False,
        reset_position_ids: bool = False,
        name: str = "train",
    ) -> None:
        if seq_length <= 0 or num_samples <= 0:
            raise ValueError(f"GPTDataset({name}): seq_length={seq_length} and num_samples={num_samples} must be > 0")
        if (eod_mask_loss or reset_position_ids) and eod is None:
            raise ValueError("--eod-mask-loss / --reset-position-ids need the tokenizer's eod id (pass tokenizer=)")
        self.indexed = indexed
        self.document_ids = np.asarray(document_ids, dtype=np.int64)
        self.num_samples, self.seq_length, self.seed = int(num_samples), int(seq_length), int(seed)
        self.eod, self.eod_mask_loss, self.reset_position_ids = eod, eod_mask_loss, reset_position_ids
        self.name = name

        self.doc_lengths = indexed.document_lengths_cached()[self.document_ids]
        # The indices depend only on the selected documents' lengths (not on token values), so
        # the key hashes exactly those: identical-shaped data may share, different data cannot.
        params = {
            "kind": "gpt",
            "document_lengths": array_digest(self.doc_lengths),
            "num_samples": self.num_samples,
            "seq_length": self.seq_length,
            "seed": self.seed,
        }
        key = params_hash(params)
        self.doc_idx, self.sample_idx, self.shuffle_idx = cached_arrays(
            resolve_cache_dir(indexed.prefix, cache_dir, "GPTDataset_indices"),
            key,
            ("doc_idx", "sample_idx", "shuffle_idx"),
            lambda: build_sample_indices(self.doc_lengths, self.num_samples, self.seq_length, self.seed),
            f"GPTDataset {name} {params} prefix={indexed.prefix}",
        )

    def __len__(self) -> int:
        return self.num_samples

    def sample_tokens(self, sample: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``sample`` (before shuffling), int64."""
        pos, offset = (int(v) for v in self.sample_idx[sample])
        remaining = self.seq_length + 1
        parts = []
        while remaining > 0:
            d = int(self.doc_idx[pos])
            take = min(remaining, int(self.doc_lengths[d]) - offset)
            if take > 0:
                parts.append(self.indexed.get_document(int(self.document_ids[d]), offset, take))
                remaining -= take
            pos, offset = pos + 1, 0
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"GPTDataset({self.name}): index {idx} out of range [0, {self.num_samples})")
        return make_gpt_item(
            self.sample_tokens(int(self.shuffle_idx[idx])), self.eod, self.eod_mask_loss, self.reset_position_ids
        )


def make_gpt_item(
    sample: np.ndarray, eod: int | None = None, eod_mask_loss: bool = False, reset_position_ids: bool = False
) -> dict[str, np.ndarray]:
    """The item dict for ``seq_length + 1`` tokens (see ``GPTDataset``)."""
    tokens = np.ascontiguousarray(sample[:-1], dtype=np.int64)
    labels = np.ascontiguousarray(sample[1:], dtype=np.int64)
    loss_mask = np.ones(tokens.shape, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    position_ids = np.arange(tokens.size, dtype=np.int64)
    if reset_position_ids:
        # Positions restart on the token after each eod: subtract the index where the
        # current document began.
        starts = np.zeros(tokens.size, dtype=np.int64)
        after_eod = np.nonzero(tokens[:-1] == eod)[0] + 1
        starts[after_eod] = after_eod
        position_ids -= np.maximum.accumulate(starts)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


class MockGPTDataset:
    """``num_samples`` items of uniformly random tokens in ``[0, vocab_size)`` (``--mock-data``).

    Item ``i`` depends only on ``(seed, i)``, so any rank can build any item.
    """

    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int = 1234) -> None:
        if vocab_size <= 0 or seq_length <= 0 or num_samples < 0:
            raise ValueError(
                f"MockGPTDataset: vocab_size={vocab_size}, seq_length={seq_length} must be > 0 and "
                f"num_samples={num_samples} >= 0"
            )
        self.vocab_size, self.seq_length, self.num_samples, self.seed = vocab_size, seq_length, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"MockGPTDataset: index {idx} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, int(idx)])
        return make_gpt_item(rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64))
