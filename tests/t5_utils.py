"""Equivalence harness for T5 (tests/test_t5.py): every plan trains the same tiny T5.

fp32, dropout off, AdamW with clipping for a few steps on the same global batches (random ids,
padded encoder inputs, masked labels), through ``build_trainer`` and ``train_step`` (the code
the command line runs); rank 0's losses and gradient norms and the updated parameters (gathered
to full tensors, replicas checked against each other) are compared with one process.
"""

from __future__ import annotations

import torch

from dist_utils import run_distributed
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.families.t5.config import T5Config

GLOBAL_BATCH = 8
STEPS = 3
RTOL = 1e-5
#: --auto-parallel for the equivalence tests: a preset cluster (analytic profile), this batch
AUTO_ARGV = ["--auto-parallel", "--cluster", "a100-40g-1x8", "--global-batch-size", "8"]


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


def layer(tp=1, dp_mode="ddp", consecutive=True, recompute=False) -> LayerStrategy:
    return LayerStrategy(tp=tp, dp_mode=dp_mode, tp_consecutive=consecutive, recompute=recompute)


def plan_of(world_size, layers, *, layers_per_stage=None, num_microbatches=2, schedule="1f1b",
            vocab_tp=1, vocab_dp_mode="ddp") -> dict:
    lps = tuple(layers_per_stage or (len(layers),))
    return Plan(world_size=world_size, global_batch_size=GLOBAL_BATCH,
                num_microbatches=num_microbatches,
                pipeline=PipelineSpec(size=len(lps), schedule=schedule, layers_per_stage=lps),
                vocab=VocabStrategy(tp=vocab_tp, dp_mode=vocab_dp_mode),
                layers=tuple(layers)).to_dict()


def _auto_plans(world_size, config, argv):
    """The plan ``--auto-parallel`` searches on these ranks (collective)."""
    from megatron_auto import auto
    from megatron_auto.arguments import parse_run_config
    from megatron_auto.families.t5.flags import add_t5_args, t5_config_from_args
    from megatron_auto.arguments import build_parser

    run = parse_run_config(argv, add_t5_args(build_parser()),
                           model_config_from_args=t5_config_from_args)
    return [auto.plan_for_run(run.plan_source, config, world_size,
                              precision=run.precision.name).to_dict()]


def _train_worker(rank, world_size, config_dict, plan_dicts, steps):
    from megatron_auto.models.init import gather_full_state
    from megatron_auto.models.t5 import T5Stage
    from megatron_auto.parallel.optimizer import OptimizerConfig
    from megatron_auto.training.lr_scheduler import LRConfig
    from megatron_auto.training.trainer import TaskSpec, build_trainer, train_step

    config = T5Config.from_dict(config_dict)
    if isinstance(plan_dicts, tuple) and plan_dicts[0] == "auto":  # ("auto", argv)
        plan_dicts = _auto_plans(world_size, config, plan_dicts[1])
    out = []
    for plan_dict in plan_dicts:
        trainer = build_trainer(
            config, Plan.from_dict(plan_dict),
            lambda cfg, ctx, seed: T5Stage(cfg, ctx, seed=seed),
            # eps 1e-5: near-zero gradient elements (the key bias) are rounding noise that a
            # tiny eps would turn into +-lr steps, differently under each plan
            optimizer_config=OptimizerConfig(weight_decay=0.1, clip_grad=1.0, adam_eps=1e-5),
            lr_config=LRConfig(lr=1e-3, decay_style="constant"), seed=1234,
            task=TaskSpec(every_stage_reads_batch=True))
        results = []
        for step in range(steps):
            r = train_step(trainer, make_batch(config, step))
            results.append({"loss": r.lm_loss, "grad_norm": r.grad_norm})
        out.append({"results": results, "state": gather_full_state(trainer.stage),
                    "plan": plan_dict})
    return out


def run_plans(config: T5Config, world_size: int, plan_dicts: list[dict] | tuple,
              steps: int = STEPS) -> list:
    """Per plan: (rank 0's per-step losses and norms, the full parameter state of all ranks);
    ``("auto", argv)`` trains the plan ``--auto-parallel`` finds and returns it too."""
    per_rank = run_distributed(_train_worker, world_size, config.to_dict(), plan_dicts, steps)
    merged = []
    for p in range(len(per_rank[0])):
        state: dict[str, torch.Tensor] = {}
        for rank_out in per_rank:
            for name, value in rank_out[p]["state"].items():
                if name in state:  # replicas (DP, tied copies, bias tables) must agree
                    torch.testing.assert_close(value, state[name], rtol=RTOL, atol=1e-7)
                state[name] = value
        merged.append((per_rank[0][p]["results"], state))
    if isinstance(plan_dicts, tuple):
        return [(merged[0], per_rank[0][0]["plan"])]
    return merged


def assert_same(reference, candidate, label: str) -> None:
    """Losses (relative 1e-5), gradient norms (1e-4) and every updated parameter
    (rtol 1e-5, atol 1e-6) of ``candidate`` equal the one-process ``reference``."""
    (ref_results, ref_state), (results, state) = reference, candidate
    for step, (r, c) in enumerate(zip(ref_results, results)):
        assert abs(c["loss"] - r["loss"]) <= RTOL * abs(r["loss"]), \
            f"{label}: step {step} loss {c['loss']} vs one process {r['loss']}"
        assert abs(c["grad_norm"] - r["grad_norm"]) <= 1e-4 * abs(r["grad_norm"]), \
            f"{label}: step {step} grad norm {c['grad_norm']} vs {r['grad_norm']}"
    assert set(state) == set(ref_state), f"{label}: parameter names differ"
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=1e-6,
                                   msg=lambda m, n=name: f"{label}: {n}: {m}")
