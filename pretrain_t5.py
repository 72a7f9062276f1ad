"""Pretrain a T5 encoder-decoder (span corruption) with a per-layer parallel plan.

    torchrun --standalone --nproc-per-node 2 pretrain_t5.py            # embedded corpus
    torchrun --nproc-per-node 4 pretrain_t5.py --encoder-num-layers 12 --decoder-num-layers 12 \\
        --hidden-size 768 --num-attention-heads 12 --kv-channels 64 --encoder-seq-length 512 \\
        --decoder-seq-length 128 --vocab-extra-ids 100 --mock-data --auto-parallel

Megatron-LM's T5 flags (``--encoder-num-layers --decoder-num-layers --encoder-seq-length
--decoder-seq-length --kv-channels --vocab-extra-ids``) plus every model, training, plan,
checkpoint and logging flag of ``pretrain_gpt.py``. Data: ``--mock-data`` (random ids, the
last ``--vocab-extra-ids`` ids of ``--vocab-size`` are the sentinels), ``--data-path`` (indexed
documents, with the tokenizer they were made with; the sentinels are added to it), or nothing
(the embedded corpus). Only the T5 providers live here; the run is
``megatron_auto.training.pretrain``.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch
from torch import nn

from megatron_auto.arguments import build_parser
from megatron_auto.run_config import DataConfig
from megatron_auto.families.t5.flags import add_t5_args, t5_config_from_args
from megatron_auto.families.t5.config import T5Config
from megatron_auto.training.data import DataSource, collate
from megatron_auto.training.pretrain import launch
from megatron_auto.training.trainer import TaskSpec


def model_provider(config: T5Config, ctx: Any, seed: int) -> nn.Module:
    """This rank's pipeline stage of the T5 (only its own layers, its TP shards)."""
    from megatron_auto.models.t5 import T5Stage

    return T5Stage(config, ctx, seed=seed)


def datasets_provider(data_config: DataConfig, source: DataSource, model_config: T5Config,
                      seed: int, train_samples: int, valid_samples: int,
                      test_samples: int) -> tuple[Any, Any, Any]:
    """(train, valid, test) span-corruption datasets over raw token samples."""
    from megatron_auto import data
    from megatron_auto.data.t5_dataset import T5Dataset, sentinel_ids

    cfg = model_config
    raw_length = cfg.seq_length - 1  # room for the end-of-sequence token
    if source.kind == "mock":
        extra = data_config.vocab_extra_ids
        plain = cfg.vocab_size - extra
        if plain < 2:
            from megatron_auto.config import ConfigError

            raise ConfigError(f"--vocab-extra-ids={extra}: leaves {plain} ids of --vocab-size="
                              f"{cfg.vocab_size} for text; raise --vocab-size")
        sentinels, eos, pad = list(range(plain, cfg.vocab_size)), 1, 0
        bases = (data.MockGPTDataset(plain, raw_length, max(train_samples, 1), seed),
                 data.MockGPTDataset(plain, raw_length, valid_samples, seed + 1)
                 if valid_samples else None, None)
    else:
        tok = source.tokenizer
        sentinels, eos, pad = sentinel_ids(tok), tok.eod, tok.pad
        bases = data.build_train_valid_test_datasets(
            source.data_prefix, data_config.split, raw_length, seed, train_samples,
            valid_samples, test_samples, cache_dir=data_config.cache_dir, model="gpt",
            tokenizer=tok, vocab_size=cfg.vocab_size)
    return tuple(None if base is None else
                 T5Dataset(base, sentinels, encoder_length=cfg.seq_length,
                           decoder_length=cfg.decoder_seq_length, eos=eos, pad=pad, seed=seed)
                 for base in bases)


def batch_fn(items: Sequence[dict]) -> dict[str, torch.Tensor]:
    """T5 items (tokens, decoder_tokens, encoder_mask, labels, loss_mask) stacked."""
    return collate(items)


#: every stage reads the batch: the encoder mask is needed wherever attention runs
T5_TASK = TaskSpec(every_stage_reads_batch=True, model_families=("t5",))


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_t5_args(build_parser("Pretrain a T5 encoder-decoder (span corruption) with a "
                                      "per-layer parallel plan."))
    return launch(model_provider, datasets_provider, batch_fn, argv=argv, parser=parser,
                  model_config_from_args=t5_config_from_args, task=T5_TASK)


if __name__ == "__main__":
    sys.exit(main())
