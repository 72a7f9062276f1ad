"""Expert parameters and their optimizer state per rank halve from ep 1 to ep 2.

Two ranks (dp 2), the MoE model of tests/test_moe_equivalence.py, one training step: the bytes
(``parallel.memory.storage_bytes``, the memory meter's storage count, unrounded) of the routed
experts' parameters plus their AdamW moments on each rank. With ep 2 each rank holds half the
experts and their state, exactly half of ep 1's; the router and the shared experts (replicated
under EP) do not change."""

from __future__ import annotations

import pytest

from dist_utils import run_distributed
from megatron_auto.config import ModelConfig
from megatron_auto.plan import Plan
from test_equivalence import layer, make_batch, plan_of
from test_moe_equivalence import CONFIGS, moe_layers

pytestmark = pytest.mark.multirank

MODEL = "top2-shared"


def _worker(rank, world_size, plan_dicts, config_dict):
    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.parallel.memory import storage_bytes
    from megatron_auto.parallel.optimizer import OptimizerConfig
    from megatron_auto.training.lr_scheduler import LRConfig
    from megatron_auto.training.trainer import build_trainer, train_step

    out = []
    for plan_dict in plan_dicts:
        trainer = build_trainer(ModelConfig.from_dict(config_dict), Plan.from_dict(plan_dict),
                                lambda cfg, ctx, seed: GPTStage(cfg, ctx, seed=seed),
                                optimizer_config=OptimizerConfig(),
                                lr_config=LRConfig(lr=1e-3, decay_style="constant"), seed=1234)
        train_step(trainer, make_batch(0))
        kinds = {"experts": [], "dense": []}
        for fqn, p in trainer.stage.named_parameters():
            kind = "experts" if ".mlp.experts." in fqn else "dense"
            state = trainer.optimizer.state.get(p, {})
            kinds[kind] += [p] + [v for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")]
        out.append({k: storage_bytes(v, rounded=False) for k, v in kinds.items()})
    return out


def test_expert_memory_per_rank_halves_from_ep1_to_ep2():
    base = plan_of(2, [layer()] * 4)
    plans = [base, moe_layers(base, MODEL, ep=2)]
    per_rank = run_distributed(_worker, 2, plans, CONFIGS[MODEL].to_dict())
    config = CONFIGS[MODEL]
    h, f, e = config.hidden_size, config.expert_ffn_hidden_size, config.moe.num_experts
    full = len(config.moe_layers) * e * 3 * h * f * 4 * 3  # SwiGLU, fp32, param + 2 moments
    for ep1, ep2 in per_rank:
        assert ep1["experts"] == full
        assert ep2["experts"] * 2 == ep1["experts"]
        assert ep2["dense"] == ep1["dense"]
