"""T5's recipe for the equivalence harness (tests/harness.py), used by tests/test_t5.py.

fp32, dropout off, AdamW with clipping for a few steps on the same global batches (random ids,
padded encoder inputs, masked labels); every stage reads the batch (the decoder's ids and the
encoder mask travel with it).
"""

from __future__ import annotations

import functools

import torch

from harness import GLOBAL_BATCH, Recipe, Searched
from megatron_auto.families.registry import family_of
from megatron_auto.families.t5.config import T5Config
from megatron_auto.families.t5.flags import add_t5_args, t5_config_from_args
from megatron_auto.parallel.optimizer import OptimizerConfig
from megatron_auto.training.trainer import TaskSpec

#: --auto-parallel for the equivalence tests: a preset cluster (analytic profile), this batch
AUTO_ARGV = ("--auto-parallel", "--cluster", "a100-40g-1x8", "--global-batch-size", "8")


def make_batch(config: T5Config, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(700 + step)
    se, sd, v = config.seq_length, config.decoder_seq_length, config.vocab_size
    tokens = torch.randint(0, v, (GLOBAL_BATCH, se), generator=gen)
    decoder_tokens = torch.randint(0, v, (GLOBAL_BATCH, sd), generator=gen)
    labels = torch.randint(0, v, (GLOBAL_BATCH, sd), generator=gen)
    encoder_mask = torch.ones(GLOBAL_BATCH, se)
    encoder_mask[1, se - 3:] = 0.0  # padded encoder inputs: masked keys under every plan
    encoder_mask[6, se // 2:] = 0.0
    loss_mask = torch.ones(GLOBAL_BATCH, sd)
    loss_mask[2, sd - 2:] = 0.0
    loss_mask[5] = 0.0  # a sample without targets must not count under any plan
    return {"tokens": tokens, "decoder_tokens": decoder_tokens, "encoder_mask": encoder_mask,
            "labels": labels, "loss_mask": loss_mask}


def t5_recipe(config: T5Config) -> Recipe:
    """The harness's recipe for a T5 config (its stage from the family registry)."""
    return Recipe(config, family_of(config).build_stage, functools.partial(make_batch, config),
                  # eps 1e-5: near-zero gradient elements (the key bias) are rounding noise that
                  # a tiny eps would turn into +-lr steps, differently under each plan
                  optimizer=OptimizerConfig(weight_decay=0.1, clip_grad=1.0, adam_eps=1e-5),
                  task=TaskSpec(every_stage_reads_batch=True))


#: the plan --auto-parallel finds for the equivalence tests' batch
SEARCHED = Searched(AUTO_ARGV, add_t5_args, t5_config_from_args)
