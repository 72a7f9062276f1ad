"""Where training data comes from, and how a global batch becomes micro-batches.

Three sources (checked in this order):

- ``--mock-data``: deterministic random tokens (``MockGPTDataset``), vocabulary ``--vocab-size``;
- ``--data-path``: Megatron indexed datasets with the tokenizer the flags name;
- neither: the corpus and SentencePiece tokenizer embedded in the package
  (``megatron_auto.data.embedded_dataset``), preprocessed once into a cache directory.

Batch contract (docs/design.md §4): iteration ``t`` trains on samples ``[consumed, consumed + B)`` of
the training set (``B`` = global batch, ``consumed = (t - 1) * B``). Every rank of the first and
of the last pipeline stage reads that whole global batch and cuts it into ``num_microbatches``
consecutive micro-batches; the stage takes its own data-parallel slice. Middle stages read
nothing. A dataset shorter than needed is cycled (sample index modulo its length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..run_config import DataConfig
from ..utils.flag_warnings import warn_flag


@dataclass
class DataSource:
    """The resolved source: tokenizer (None for mock data), its vocabulary and data prefixes."""

    kind: str
    tokenizer: Any = None
    vocab_size: int | None = None
    data_prefix: list[str] | None = None


class DataError(ValueError):
    """Unusable data flags; the message names the flag, the value and the fix."""


def prepare_data_source(config: DataConfig, *, build_first: Callable[[Callable[[], Any]], Any]
                        = lambda fn: fn(), sentence_level: bool = False) -> DataSource:
    """Resolve the tokenizer and data prefixes of ``config``.

    ``build_first(fn)`` runs a step that writes shared files (the embedded corpus cache); the
    training loop passes a function that runs it on rank 0 first and then on the others, so
    that the one-time preprocessing is not repeated by every rank. ``sentence_level`` asks for
    the sentence-split embedded corpus (BERT's sentence pairs).
    """
    from .. import data as data_lib  # noqa: PLC0415 - keeps `import megatron_auto.training` light

    if config.source == "mock":
        return DataSource(kind="mock", vocab_size=config.vocab_size)
    if config.source == "embedded":
        prefix, model = build_first(lambda: data_lib.embedded_dataset(
            config.cache_dir, split_sentences=sentence_level))
        tokenizer = data_lib.build_tokenizer(data_lib.EMBEDDED_TOKENIZER_TYPE, tokenizer_model=model,
                                             vocab_extra_ids=config.vocab_extra_ids)
        _warn_vocab_size_overridden(config.vocab_size, tokenizer.vocab_size,
                                    "the embedded tokenizer")
        return DataSource(kind="embedded", tokenizer=tokenizer, vocab_size=tokenizer.vocab_size,
                          data_prefix=[prefix])
    if config.tokenizer_type is None:
        raise DataError("--tokenizer-type=None: --data-path needs the tokenizer the data was "
                        "preprocessed with; add --tokenizer-type (and its model/vocab files)")
    # --vocab-size is the NullTokenizer's input; for the others the tokenizer's vocabulary
    # rules (checked against the given value below)
    unread = data_lib.tokenizers.unread_tokenizer_flags(
        config.tokenizer_type, tokenizer_model=config.tokenizer_model,
        vocab_file=config.vocab_file, merge_file=config.merge_file)
    if unread:
        warn_flag(f"{' '.join(unread)}: not read by --tokenizer-type {config.tokenizer_type}; "
                  f"drop {'it' if len(unread) == 1 else 'them'} or choose the tokenizer that "
                  f"reads {'it' if len(unread) == 1 else 'them'}")
    try:
        tokenizer = data_lib.build_tokenizer(
            config.tokenizer_type, tokenizer_model=config.tokenizer_model,
            vocab_file=config.vocab_file, merge_file=config.merge_file,
            vocab_size=config.vocab_size, vocab_extra_ids=config.vocab_extra_ids)
    except (ValueError, OSError) as err:
        raise DataError(f"--tokenizer-type={config.tokenizer_type}: {err}") from None
    if config.tokenizer_type != "NullTokenizer":  # which reads it (its ids are below it)
        _warn_vocab_size_overridden(config.vocab_size, tokenizer.vocab_size,
                                    f"--tokenizer-type {config.tokenizer_type}")
    return DataSource(kind="files", tokenizer=tokenizer, vocab_size=tokenizer.vocab_size,
                      data_prefix=list(config.data_path))


def _warn_vocab_size_overridden(given: int | None, vocabulary: int, tokenizer: str) -> None:
    """--vocab-size next to a tokenizer whose vocabulary differs: the tokenizer's rules."""
    if given is not None and given != vocabulary:
        warn_flag(f"--vocab-size={given}: the model takes the vocabulary of {tokenizer} "
                  f"({vocabulary} ids) instead; drop the flag (it sets the vocabulary of "
                  f"--mock-data and the NullTokenizer only)")


def collate(items: Sequence[Mapping[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack dataset items (dicts of equal-shape numpy arrays) into batch tensors."""
    keys = items[0].keys()
    return {k: torch.from_numpy(np.stack([np.asarray(item[k]) for item in items])) for k in keys}


def load_global_batch(dataset: Any, consumed_samples: int, global_batch_size: int,
                      collate_fn: Callable[[Sequence[Mapping[str, np.ndarray]]], dict[str, torch.Tensor]]
                      = collate) -> dict[str, torch.Tensor]:
    """Samples ``[consumed, consumed + global_batch_size)`` of ``dataset`` (cycled) as tensors."""
    n = len(dataset)
    if n == 0:
        raise DataError("the dataset is empty; check --data-path/--split (every split needs "
                        "documents) or use --mock-data")
    return collate_fn([dataset[(consumed_samples + i) % n] for i in range(global_batch_size)])


def split_microbatches(batch: Mapping[str, torch.Tensor], num_microbatches: int,
                       device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Cut a global batch into ``num_microbatches`` consecutive micro-batches on ``device``.

    Tensors with a batch dimension are sliced; anything else (a 0-d tensor such as BERT's
    ``sop_weight``, a number) is given unchanged to every micro-batch.
    """
    batched = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    size = next(iter(batched.values())).shape[0]
    if size % num_microbatches:
        raise DataError(f"global batch of {size} samples does not split into "
                        f"num_microbatches={num_microbatches}; fix the plan's batch sizes")
    step = size // num_microbatches
    shared = {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
              for k, v in batch.items() if k not in batched}
    # non_blocking: from pinned host memory the copy is asynchronous; from pageable memory (our
    # batches) CUDA stages it and the call returns when the host buffer may be reused, so it is
    # safe either way (PyTorch's guide on non_blocking and pin_memory). Pinning here would add
    # a host copy for the few KiB of token ids a step moves, for no overlap: the step waits on
    # them at once.
    return [{**{k: v[i * step:(i + 1) * step].to(device, non_blocking=True)
                for k, v in batched.items()}, **shared}
            for i in range(num_microbatches)]
