"""Pretrain a BERT (masked LM + sentence-order prediction) with a per-layer parallel plan.

    torchrun --standalone --nproc-per-node 2 pretrain_bert.py            # embedded default
    torchrun --nproc-per-node 4 pretrain_bert.py --mock-data --tensor-model-parallel-size 2

Same flags as ``pretrain_gpt.py``. Only the BERT-specific providers live here; the loop is
``megatron_auto.training.pretrain``. Logged losses: ``lm loss`` (the optimised total, MLM mean
plus SOP mean, as Megatron-LM), ``mlm loss`` and ``sop loss``.
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
from megatron_auto.training.trainer import TaskSpec
from megatron_auto.utils.flag_warnings import warn_flag

# Entries of BertStage.last_losses that the loop sums over micro-batches and ranks.
LOSS_PARTS = ("mlm_loss_sum", "sop_loss_sum", "num_tokens", "num_samples")


def model_provider(config: ModelConfig, ctx: Any, seed: int) -> nn.Module:
    """This rank's pipeline stage of the BERT encoder."""
    from megatron_auto.models.bert import BertStage

    return BertStage(config, ctx, seed=seed)


def datasets_provider(data_config: DataConfig, source: DataSource, model_config: ModelConfig,
                      seed: int, train_samples: int, valid_samples: int,
                      test_samples: int) -> tuple[Any, Any, Any]:
    """(train, valid, test) BERT datasets (sentence pairs, 15% masking)."""
    from megatron_auto import data

    if data_config.eod_mask_loss:
        warn_flag("--eod-mask-loss: masks the loss of GPT's end-of-document tokens; a BERT "
                  "predicts masked tokens only, so it changes nothing here; drop it")

    if source.kind == "mock":
        vocab, seq = model_config.vocab_size, model_config.seq_length
        return (data.MockBertDataset(vocab, seq, train_samples, seed),
                data.MockBertDataset(vocab, seq, valid_samples, seed + 1) if valid_samples else None,
                None)
    return data.build_train_valid_test_datasets(
        source.data_prefix, data_config.split, model_config.seq_length, seed, train_samples,
        valid_samples, test_samples, cache_dir=data_config.cache_dir, model="bert",
        tokenizer=source.tokenizer, vocab_size=model_config.vocab_size)


def batch_fn(items: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Stack BERT items; ``text`` becomes the first stage's ``tokens``.

    ``sop_weight`` = masked tokens / samples of the *global* batch, so that the optimised loss is
    exactly Megatron's MLM mean + SOP mean whatever the micro-batching (see models/bert.py).
    """
    batch = collate(items)
    batch["tokens"] = batch.pop("text")
    batch["sop_weight"] = batch["loss_mask"].float().sum() / batch["loss_mask"].shape[0]
    return batch


def named_losses(sums: dict[str, float]) -> dict[str, float]:
    return {"mlm_loss": sums["mlm_loss_sum"] / max(sums["num_tokens"], 1.0),
            "sop_loss": sums["sop_loss_sum"] / max(sums["num_samples"], 1.0)}


BERT_TASK = TaskSpec(
    model_families=("bert",),
    model_overrides={"model_type": "bert", "num_tokentypes": 2, "bert_binary_head": True},
    sentence_level_data=True, every_stage_reads_batch=True, loss_part_keys=LOSS_PARTS,
    named_losses=named_losses)


def main(argv: Sequence[str] | None = None) -> int:
    return launch(model_provider, datasets_provider, batch_fn, argv=argv, task=BERT_TASK)


if __name__ == "__main__":
    sys.exit(main())
