"""Pretrain a GPT with a per-layer parallel plan (Megatron-LM flag names).

    torchrun --standalone --nproc-per-node 2 pretrain_gpt.py            # embedded default
    torchrun --nproc-per-node 8 pretrain_gpt.py --plan plan.json --data-path PREFIX \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt

Only the three GPT-specific providers live here; the flags are converted once into a
``RunConfig`` and the run is ``megatron_auto.training.pretrain``.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch
from torch import nn

from megatron_auto.config import ModelConfig
from megatron_auto.run_config import DataConfig
from megatron_auto.training.data import DataSource, collate
from megatron_auto.training.pretrain import launch
from megatron_auto.utils.flag_warnings import warn_flag


def model_provider(config: ModelConfig, ctx: Any, seed: int) -> nn.Module:
    """This rank's pipeline stage of the GPT (only its own layers, its TP shards)."""
    from megatron_auto.models.gpt import GPTStage

    return GPTStage(config, ctx, seed=seed)


def datasets_provider(data_config: DataConfig, source: DataSource, model_config: ModelConfig,
                      seed: int, train_samples: int, valid_samples: int,
                      test_samples: int) -> tuple[Any, Any, Any]:
    """(train, valid, test) GPT datasets; mock data gets a separately seeded validation set."""
    from megatron_auto import data

    if source.kind == "mock":
        if data_config.eod_mask_loss:
            warn_flag("--eod-mask-loss: --mock-data's random tokens have no end-of-document "
                      "token to mask; it changes nothing; drop one of them")
        vocab = model_config.vocab_size
        return (data.MockGPTDataset(vocab, model_config.seq_length, train_samples, seed),
                data.MockGPTDataset(vocab, model_config.seq_length, valid_samples, seed + 1)
                if valid_samples else None, None)
    return data.build_train_valid_test_datasets(
        source.data_prefix, data_config.split, model_config.seq_length, seed, train_samples,
        valid_samples, test_samples, cache_dir=data_config.cache_dir, model="gpt",
        tokenizer=source.tokenizer, eod_mask_loss=data_config.eod_mask_loss,
        vocab_size=model_config.vocab_size)


def batch_fn(items: Sequence[dict]) -> dict[str, torch.Tensor]:
    """GPT items (tokens, labels, loss_mask, position_ids) stacked into the global batch."""
    return collate(items)


def main(argv: Sequence[str] | None = None) -> int:
    return launch(model_provider, datasets_provider, batch_fn, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
