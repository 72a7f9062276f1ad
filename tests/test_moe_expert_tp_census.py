"""The census of a training step with expert tensor parallelism (``expert_tp > 1``): the
runtime issues what the cost model prices (``planner/cost/moe.py``'s expert-TP all-reduces
included).

Per MoE layer, micro-batch and rank, expert TP adds (models/moe.py ``GroupedExperts``): forward,
one all-reduce of fc2's partial output over the expert-TP group (``expert_tp`` members of the
layer's TP group), ``R x h`` elements in the activation dtype, ``R`` the rows this rank's
experts received (``T k`` at ep 1, dropless; summed over an EP group ``ep T k``); backward, one
all-reduce of the experts' input gradient of the same size (the copy into the group); a full
recompute of the layer repeats the forward one. The cost model prices each at the mean rows,
``T k``. Checked on 4-rank plans: at ep 1 every collective is issued exactly as priced; at ep 2
the expert-TP all-reduces' sizes follow the routing, so there the calls the runtime issued
differently from the priced ones are expert-TP all-reduces only, as many as priced and, over
the world, of the priced bytes (the token all-to-alls as tests/test_moe_census.py checks them).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from dist_utils import run_distributed
from test_moe_census import CONFIG, _is_tokens, _key, _priced
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy

pytestmark = pytest.mark.multirank

_L = LayerStrategy
PLANS = {
    # tp 4, dp 1, ep 1: expert-TP groups of 2 (two replicas per TP group) and of 4, recompute
    "tp4-etp2-etp4": Plan(world_size=4, global_batch_size=8, num_microbatches=2,
                          pipeline=PipelineSpec(1, "1f1b", (2,)), vocab=VocabStrategy(tp=4),
                          layers=(_L(tp=4, expert_tp=2, recompute=True), _L(tp=4, expert_tp=4))),
    # tp 2 x dp 2, ep 2 (expert-DP of one rank), expert_tp 2: the all-to-alls and the
    # expert-TP all-reduces on the rows received
    "ep2-tp2-etp2": Plan(world_size=4, global_batch_size=8, num_microbatches=2,
                         pipeline=PipelineSpec(1, "1f1b", (2,)), vocab=VocabStrategy(tp=2),
                         layers=(_L(tp=2, ep=2, expert_tp=2),
                                 _L(tp=2, ep=2, expert_tp=2, recompute=True))),
}


def _worker(rank: int, world_size: int, plan_name: str) -> list[list[Any]]:
    from collective_census import gpt_step_census

    return gpt_step_census(CONFIG, PLANS[plan_name])


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_expert_tp_steps_issue_what_the_cost_model_prices(plan_name: str) -> None:
    plan = PLANS[plan_name]
    per_rank = run_distributed(_worker, plan.world_size, plan_name)
    etps = {layer.expert_tp for layer in plan.layers}
    routed = any(layer.ep > 1 for layer in plan.layers)
    extra_bytes = missing_bytes = 0.0
    for rank, (_, second) in enumerate(per_rank):
        where = f"{plan_name} rank {rank}"
        assert not [c for c in second if c.kind.startswith("unknown:")], where
        issued = Counter(_key(c) for c in second if not _is_tokens(_key(c)))
        priced = Counter({k: v for k, v in _priced(plan, 0).items() if not _is_tokens(k)})
        extra, missing = issued - priced, priced - issued
        if not routed:
            assert not extra and not missing, (where, dict(extra), dict(missing))
            continue
        for part in (extra, missing):
            assert all(kind == "all_reduce" and size in etps and consecutive
                       for kind, size, consecutive, _ in part), (where, dict(part))
        assert sum(extra.values()) == sum(missing.values()), where
        extra_bytes += sum(k[3] * n for k, n in extra.items())
        missing_bytes += sum(k[3] * n for k, n in missing.items())
    assert extra_bytes == pytest.approx(missing_bytes, rel=1e-12)
