"""BERT masked-LM + sentence-order samples from sentence-split documents.

Sentences come from the ``_sentence`` level indexed files (``preprocess_data.py
--split-sentences``: each document is a run of sentence sequences) or, for document-level
files, from cutting each document after sentence-ending tokens (ids whose text ends in
``. ! ?``) on the fly.

A *sample* is a run of consecutive sentences of one document (at least two with the binary
head) whose total length reaches a target (``seq_length - 3``, or with probability
``short_seq_prob`` a random shorter one); the list of samples is built per epoch, shuffled per
epoch and cached. Item ``i`` is then made deterministically from ``(seed, i)``: cut the run into
segment A and B at a random sentence boundary; with probability 1/2 swap them (``is_random=1``,
the sentence-order head's target); truncate to fit; lay out ``[CLS] A [SEP] B [SEP]``; select
``masked_lm_prob`` of the non-special tokens, of which 80% become ``[MASK]``, 10% a random token
and 10% stay; pad to ``seq_length``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from megatron_auto.data.index_cache import array_digest, cached_arrays, params_hash, resolve_cache_dir
from megatron_auto.data.indexed_dataset import IndexedDataset

IGNORE_LABEL = -1  # labels where no prediction is made (Megatron's convention)
_SENTENCE_END = (".", "!", "?", "。", "！", "？")


def sentence_end_ids(tokenizer: Any) -> np.ndarray:
    """Token ids whose text ends a sentence (for splitting document-level data)."""
    ids = []
    for i in range(tokenizer.vocab_size):
        try:
            text = tokenizer.detokenize([i]).strip()
        except Exception:  # special/unused ids some tokenizers cannot decode alone
            continue
        if text.endswith(_SENTENCE_END):
            ids.append(i)
    return np.asarray(ids, dtype=np.int64)


def build_sentences(
    indexed: IndexedDataset, document_ids: np.ndarray, end_ids: np.ndarray | None, eod: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Sentences of the documents as (sentences (n, 3): [sequence, offset, length], doc_bounds).

    ``doc_bounds`` (num_docs + 1,) gives each document's sentence range. Trailing ``eod`` tokens
    are dropped (they end documents, not sentences). Sentence-level data (more sequences than
    documents) uses its sequences; document-level data is cut after ``end_ids`` tokens.
    """
    if len(indexed) > indexed.num_documents or end_ids is None or not len(end_ids):
        return _sequences_as_sentences(indexed, document_ids, eod)
    rows: list[tuple[int, int, int]] = []
    bounds = [0]
    for doc in document_ids:
        for seq in indexed.document_sequences(int(doc)):
            toks = indexed[seq]
            n = len(toks)
            while n and eod is not None and toks[n - 1] == eod:
                n -= 1
            cuts = np.nonzero(np.isin(toks[:n], end_ids))[0] + 1
            start = 0
            for end in list(cuts) + [n]:
                if end > start:
                    rows.append((seq, start, int(end) - start))
                    start = int(end)
        bounds.append(len(rows))
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3), np.asarray(bounds, dtype=np.int64)


def _sequences_as_sentences(
    indexed: IndexedDataset, document_ids: np.ndarray, eod: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """``build_sentences`` when every sequence is a sentence, vectorised (no per-sentence loop)."""
    first = indexed.document_indices[document_ids]
    count = indexed.document_indices[document_ids + 1] - first
    # The sequence ids of all selected documents: first[d], first[d] + 1, ... for each d.
    seq_doc = np.repeat(np.arange(len(document_ids)), count)
    seqs = np.repeat(first, count) + (np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count))
    lengths = indexed.sequence_lengths[seqs].astype(np.int64)
    if eod is not None and len(seqs):
        tokens = np.frombuffer(indexed._bin, dtype=indexed.dtype)
        last = indexed.sequence_pointers[seqs] // indexed.dtype.itemsize + np.maximum(lengths - 1, 0)
        lengths -= (lengths > 0) & (tokens[last] == eod)  # a trailing eod ends the document
    keep = lengths > 0
    rows = np.stack([seqs[keep], np.zeros(int(keep.sum()), np.int64), lengths[keep]], axis=1)
    per_doc = np.bincount(seq_doc[keep], minlength=len(document_ids))
    return rows.astype(np.int64), np.concatenate([[0], np.cumsum(per_doc)]).astype(np.int64)


def build_samples_mapping(
    sentence_lengths: np.ndarray,
    doc_bounds: np.ndarray,
    num_samples: int,
    max_num_tokens: int,
    short_seq_prob: float,
    seed: int,
    min_sentences: int,
) -> np.ndarray:
    """(num_samples, 3) int64 rows [first sentence, end sentence (exclusive), target length]."""
    rng = np.random.default_rng(seed)
    epochs: list[np.ndarray] = []
    total = 0
    while total < num_samples:
        rows = []
        for d in range(len(doc_bounds) - 1):
            first, last = int(doc_bounds[d]), int(doc_bounds[d + 1])
            if last - first < min_sentences:
                continue
            start, acc = first, 0
            target = _target_length(rng, max_num_tokens, short_seq_prob)
            for s in range(first, last):
                acc += int(sentence_lengths[s])
                if (acc >= target or s == last - 1) and s + 1 - start >= min_sentences:
                    rows.append((start, s + 1, target))
                    start, acc = s + 1, 0
                    target = _target_length(rng, max_num_tokens, short_seq_prob)
        if not rows:
            raise ValueError(
                f"BERT dataset: no document has {min_sentences} or more sentences; preprocess with "
                f"--split-sentences (or use document text with sentence punctuation)"
            )
        epoch = np.asarray(rows, dtype=np.int64)
        epochs.append(epoch[rng.permutation(len(epoch))])
        total += len(epoch)
    return np.concatenate(epochs)[:num_samples]


def _target_length(rng: np.random.Generator, max_num_tokens: int, short_seq_prob: float) -> int:
    if rng.random() < short_seq_prob:
        return int(rng.integers(2, max_num_tokens + 1))
    return max_num_tokens


def truncate_pair(
    a: np.ndarray, b: np.ndarray, max_tokens: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Shorten the longer segment, from a random end, until the pair fits ``max_tokens``."""
    while len(a) + len(b) > max_tokens:
        excess = len(a) + len(b) - max_tokens
        longer_is_a = len(a) >= len(b)
        seg = a if longer_is_a else b
        cut = max(1, min(excess, abs(len(a) - len(b))))
        seg = seg[cut:] if rng.random() < 0.5 else seg[: len(seg) - cut]
        a, b = (seg, b) if longer_is_a else (a, seg)
    return a, b


def make_bert_item(
    a: np.ndarray,
    b: np.ndarray,
    is_random: bool,
    seq_length: int,
    rng: np.random.Generator,
    specials: dict[str, int],
    random_ids: np.ndarray,
    masked_lm_prob: float,
) -> dict[str, np.ndarray]:
    """Lay out, mask and pad one pair (``b`` empty: single segment, ``[CLS] A [SEP]``)."""
    cls, sep, mask, pad = specials["cls"], specials["sep"], specials["mask"], specials["pad"]
    parts = [[cls], a, [sep]] + ([b, [sep]] if len(b) else [])
    tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    types = np.zeros(len(tokens), dtype=np.int64)
    types[len(a) + 2 :] = 1
    special = np.zeros(len(tokens), dtype=bool)
    special[[0, len(a) + 1, len(tokens) - 1]] = True
    candidates = np.nonzero(~special)[0]
    labels = np.full(len(tokens), IGNORE_LABEL, dtype=np.int64)
    loss_mask = np.zeros(len(tokens), dtype=np.float32)
    if len(candidates):
        num = min(len(candidates), max(1, int(round(len(candidates) * masked_lm_prob))))
        chosen = np.sort(rng.choice(candidates, size=num, replace=False))
        labels[chosen] = tokens[chosen]
        loss_mask[chosen] = 1.0
        r = rng.random(num)
        tokens[chosen[r < 0.8]] = mask  # 80%: [MASK]; 0.8..0.9: kept as is
        randomized = chosen[r >= 0.9]  # 10%: a random ordinary token
        tokens[randomized] = random_ids[rng.integers(0, len(random_ids), len(randomized))]
    n = len(tokens)
    if n > seq_length:
        raise ValueError(f"BERT sample of {n} tokens exceeds seq_length={seq_length}")
    pad_n = seq_length - n
    padding_mask = np.concatenate([np.ones(n, np.int64), np.zeros(pad_n, np.int64)])
    return {
        "text": np.concatenate([tokens, np.full(pad_n, pad, np.int64)]),
        "types": np.concatenate([types, np.zeros(pad_n, np.int64)]),
        "labels": np.concatenate([labels, np.full(pad_n, IGNORE_LABEL, np.int64)]),
        "is_random": np.asarray(int(is_random), dtype=np.int64),
        "loss_mask": np.concatenate([loss_mask, np.zeros(pad_n, np.float32)]),
        "padding_mask": padding_mask,
    }


def _random_ids(vocab_size: int, specials: dict[str, int]) -> np.ndarray:
    ids = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.asarray(list(specials.values()), np.int64))
    if not len(ids):
        raise ValueError(f"vocab_size={vocab_size}: no ordinary tokens left besides the specials")
    return ids


class BertDataset:
    """``num_samples`` BERT items (``text types labels is_random loss_mask padding_mask``).

    Needs a tokenizer with ``cls sep mask pad vocab_size`` (and ``eod`` if the data has one).
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        document_ids: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        tokenizer: Any,
        cache_dir: str | None = None,
        masked_lm_prob: float = 0.15,
        short_seq_prob: float = 0.1,
        binary_head: bool = True,
        name: str = "train",
    ) -> None:
        if seq_length < 5:
            raise ValueError(f"--seq-length {seq_length}: BERT needs at least 5 ([CLS] A [SEP] B [SEP])")
        if not 0 < masked_lm_prob < 1:
            raise ValueError(f"--mask-prob {masked_lm_prob}: must be in (0, 1), e.g. 0.15")
        try:
            self.specials = {k: int(getattr(tokenizer, k)) for k in ("cls", "sep", "mask", "pad")}
        except AttributeError as err:
            raise ValueError(f"BERT needs a tokenizer with [CLS]/[SEP]/[MASK]/pad tokens: {err}") from None
        self.indexed, self.num_samples = indexed, int(num_samples)
        self.seq_length, self.seed = int(seq_length), int(seed)
        self.masked_lm_prob, self.binary_head, self.name = masked_lm_prob, binary_head, name
        self.random_ids = _random_ids(tokenizer.vocab_size, self.specials)
        self.max_num_tokens = seq_length - (3 if binary_head else 2)
        document_ids = np.asarray(document_ids, dtype=np.int64)
        eod = getattr(tokenizer, "eod", None)
        # Sentences cut on the fly depend on token values, so the key names the files too
        # (path, size and modification time), besides the document selection.
        bin_path = os.path.abspath(indexed.prefix + ".bin")
        params = {
            "kind": "bert",
            "data": [bin_path, os.path.getsize(bin_path), os.path.getmtime(bin_path), indexed.num_documents],
            "documents": array_digest(document_ids),
            "num_samples": self.num_samples,
            "seq_length": self.seq_length,
            "seed": self.seed,
            "short_seq_prob": short_seq_prob,
            "binary_head": binary_head,
            "eod": eod,
            "vocab_size": tokenizer.vocab_size,
        }

        def build() -> tuple[np.ndarray, np.ndarray]:
            end_ids = None if len(indexed) > indexed.num_documents else sentence_end_ids(tokenizer)
            sentences, bounds = build_sentences(indexed, document_ids, end_ids, eod)
            mapping = build_samples_mapping(
                sentences[:, 2], bounds, self.num_samples, self.max_num_tokens, short_seq_prob, self.seed,
                2 if binary_head else 1,
            )
            return sentences, mapping

        self.sentences, self.samples = cached_arrays(
            resolve_cache_dir(indexed.prefix, cache_dir, "BertDataset_indices"),
            params_hash(params),
            ("sentences", "samples"),
            build,
            f"BertDataset {name} {params} prefix={indexed.prefix}",
        )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"BertDataset({self.name}): index {idx} out of range [0, {self.num_samples})")
        first, end, target = (int(v) for v in self.samples[idx])
        rng = np.random.default_rng([self.seed, int(idx)])
        sents = [self.indexed.get(int(s), int(o), int(n)).astype(np.int64) for s, o, n in self.sentences[first:end]]
        if self.binary_head:
            cut = int(rng.integers(1, len(sents)))
            a, b = np.concatenate(sents[:cut]), np.concatenate(sents[cut:])
            is_random = bool(rng.random() < 0.5)
            if is_random:
                a, b = b, a
        else:
            a, b, is_random = np.concatenate(sents), np.zeros(0, np.int64), False
        a, b = truncate_pair(a, b, target, rng)
        return make_bert_item(
            a, b, is_random, self.seq_length, rng, self.specials, self.random_ids, self.masked_lm_prob
        )


class MockBertDataset:
    """Random-token BERT items for ``--mock-data``; specials pad=0, cls=1, sep=2, mask=3.

    Item ``i`` depends only on ``(seed, i)``: two random segments filling the sequence.
    """

    SPECIALS = {"pad": 0, "cls": 1, "sep": 2, "mask": 3}

    def __init__(
        self, vocab_size: int, seq_length: int, num_samples: int, seed: int = 1234, masked_lm_prob: float = 0.15
    ) -> None:
        if vocab_size <= len(self.SPECIALS) or seq_length < 5 or num_samples < 0:
            raise ValueError(
                f"MockBertDataset: vocab_size={vocab_size} must be > 4, seq_length={seq_length} >= 5, "
                f"num_samples={num_samples} >= 0"
            )
        self.vocab_size, self.seq_length, self.num_samples, self.seed = vocab_size, seq_length, num_samples, seed
        self.masked_lm_prob = masked_lm_prob
        self.random_ids = np.arange(len(self.SPECIALS), vocab_size, dtype=np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"MockBertDataset: index {idx} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, int(idx)])
        total = self.seq_length - 3
        len_a = int(rng.integers(1, total))
        toks = self.random_ids[rng.integers(0, len(self.random_ids), total)]
        return make_bert_item(
            toks[:len_a], toks[len_a:], bool(rng.random() < 0.5), self.seq_length, rng, self.SPECIALS,
            self.random_ids, self.masked_lm_prob,
        )
