"""From Megatron-style ``--data-path`` / ``--split`` to (train, valid, test) datasets.

``--data-path`` is either prefixes (``A B``) or weight/prefix pairs (``0.3 A 0.7 B``).
``--split 969,30,1`` cuts each prefix's *documents*, in order, into contiguous train / valid /
test ranges in those proportions. With several prefixes each split blends the per-prefix
datasets with the given weights (unweighted prefixes: weights proportional to their tokens,
i.e. the blend reads every dataset at the same pace, like concatenating them).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from megatron_auto.data.bert_dataset import BertDataset
from megatron_auto.data.blended_dataset import BlendedDataset, samples_per_dataset
from megatron_auto.data.errors import DataInputError
from megatron_auto.data.gpt_dataset import GPTDataset
from megatron_auto.data.indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """``["0.3", "A", "0.7", "B"]`` -> (["A", "B"], [0.3, 0.7]); ``["A", "B"]`` -> (["A", "B"], None).

    Items containing spaces are split first, so ``["0.3 A 0.7 B"]`` works too. Weights are
    returned as given (not normalised).
    """
    tokens = [t for item in data_path for t in str(item).split()]
    if not tokens:
        raise DataInputError("--data-path is empty; give PREFIX [PREFIX ...] or WEIGHT PREFIX [WEIGHT PREFIX ...]")
    numeric = [_is_number(t) for t in tokens]
    if not any(numeric):
        return tokens, None
    if len(tokens) % 2 or not all(numeric[0::2]) or any(numeric[1::2]):
        raise DataInputError(
            f"--data-path {' '.join(tokens)}: mixes weights and prefixes; use either "
            f"'PREFIX PREFIX ...' or 'WEIGHT PREFIX WEIGHT PREFIX ...' (e.g. 0.3 A 0.7 B)"
        )
    weights = [float(t) for t in tokens[0::2]]
    if not all(np.isfinite(weights)) or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise DataInputError(f"--data-path weights {weights}: must be finite and non-negative with "
                             f"a positive sum, e.g. --data-path 0.3 A 0.7 B")
    return tokens[1::2], weights


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"98/2/0"``) -> three fractions summing to 1; missing parts are 0."""
    parts = [p for p in str(split).replace("/", ",").split(",") if p.strip() != ""]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise DataInputError(f"--split {split!r}: expected up to three numbers like 969,30,1") from None
    if (not 1 <= len(values) <= 3 or not all(np.isfinite(values)) or any(v < 0 for v in values)
            or sum(values) <= 0):
        raise DataInputError(
            f"--split {split!r}: expected up to three non-negative numbers with a positive sum, like 969,30,1"
        )
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def check_dataset(ds: IndexedDataset, vocab_size: int | None) -> None:
    """Refuse a dataset that holds no tokens, or ids the model's vocabulary cannot embed."""
    if ds.num_tokens == 0:
        raise DataInputError(
            f"--data-path {ds.prefix}: the dataset holds no tokens ({ds.num_documents} documents); "
            f"preprocess a non-empty input with tools/preprocess_data.py")
    if vocab_size is None:
        return
    low, high = ds.token_id_range()
    if low < 0 or high >= vocab_size:
        raise DataInputError(
            f"--data-path {ds.prefix}: token ids span [{low}, {high}] but the vocabulary has "
            f"{vocab_size} ids; use the tokenizer the data was preprocessed with (or a "
            f"--vocab-size above {high})")


def split_document_ranges(num_documents: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous [start, end) document ranges, sizes rounded so they sum to ``num_documents``."""
    bounds = [0]
    for f in np.cumsum(fractions):
        bounds.append(int(round(f * num_documents)))
    bounds[-1] = num_documents
    return [(bounds[i], bounds[i + 1]) for i in range(len(fractions))]


def build_train_valid_test_datasets(
    data_prefix: Sequence[str],
    split: str,
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int,
    test_samples: int,
    cache_dir: str | None = None,
    model: str = "gpt",
    tokenizer: Any = None,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
    masked_lm_prob: float = 0.15,
    short_seq_prob: float = 0.1,
    binary_head: bool = True,
    vocab_size: int | None = None,
) -> tuple[Any, Any, Any]:
    """(train, valid, test) datasets; ``None`` for a split with no documents or no samples asked.

    ``model="gpt"`` gives ``GPTDataset`` items, ``model="bert"`` ``BertDataset`` items (needs
    ``tokenizer`` with cls/sep/mask/pad). Several prefixes give ``BlendedDataset``s.
    Raises ``DataInputError`` for an empty dataset, a training split without documents, or
    (given ``vocab_size``, the model's vocabulary) token ids outside ``[0, vocab_size)``.
    """
    if model not in ("gpt", "bert"):
        raise ValueError(f"model={model!r}: expected 'gpt' or 'bert'")
    if model == "bert" and tokenizer is None:
        raise ValueError("model='bert' needs tokenizer= (for [CLS]/[SEP]/[MASK]/pad ids and random tokens)")
    prefixes, weights = parse_data_path(data_prefix)
    indexed = [IndexedDataset(p) for p in prefixes]
    for ds in indexed:
        check_dataset(ds, vocab_size)
    if weights is None:
        weights = [float(max(ds.num_tokens, 1)) for ds in indexed]
    fractions = parse_split(split)
    ranges = [split_document_ranges(ds.num_documents, fractions) for ds in indexed]
    eod = getattr(tokenizer, "eod", None) if tokenizer is not None else None

    def one(ds: IndexedDataset, docs: np.ndarray, num: int, name: str) -> Any:
        if model == "gpt":
            return GPTDataset(ds, docs, num, seq_length, seed, cache_dir, eod, eod_mask_loss, reset_position_ids, name)
        return BertDataset(
            ds, docs, num, seq_length, seed, tokenizer, cache_dir, masked_lm_prob, short_seq_prob, binary_head, name
        )

    results: list[Any] = []
    for split_i, (name, num) in enumerate(zip(SPLIT_NAMES, (train_samples, valid_samples, test_samples))):
        usable = [
            (d, np.arange(*ranges[d][split_i], dtype=np.int64))
            for d in range(len(indexed))
            if ranges[d][split_i][1] > ranges[d][split_i][0] and weights[d] > 0
        ]
        if not usable and num and name == "train":
            raise DataInputError(
                f"--split {split}: the training split gets no documents of {' '.join(prefixes)}; "
                f"give the first part a positive share, e.g. --split 969,30,1")
        if not usable or not num:
            if num:
                logger.warning("%s: %d samples requested but --split %s leaves it no documents", name, num, split)
            results.append(None)
            continue
        if len(prefixes) == 1:
            d, docs = usable[0]
            results.append(one(indexed[d], docs, int(num), name))
            continue
        w = [weights[d] for d, _ in usable]
        counts = samples_per_dataset(w, int(num))
        parts = [one(indexed[d], docs, max(c, 1), f"{name}[{d}]") for (d, docs), c in zip(usable, counts)]
        results.append(BlendedDataset(parts, w, int(num)))
        logger.info("%s: blend of %s with weights %s, samples %s", name, [prefixes[d] for d, _ in usable], w, counts)
    return results[0], results[1], results[2]
