"""The census of a training step with expert tensor parallelism (``expert_tp > 1``): what the
runtime issues beyond what the cost model prices today is exactly the expert-TP all-reduces.

Per MoE layer, micro-batch and rank, expert TP adds (models/moe.py ``GroupedExperts``): forward,
one all-reduce of fc2's partial output over the expert-TP group (``expert_tp`` members of the
layer's TP group), ``R x h`` elements in the activation dtype, ``R`` the rows this rank's
experts received (``T k`` at ep 1, dropless; summed over an EP group ``ep T k``); backward, one
all-reduce of the experts' input gradient of the same size (the copy into the group); a full
recompute of the layer repeats the forward one. The cost model (``planner/cost``) does not
price them yet, nor divides the experts' parameters by ``expert_tp``, so the plans here keep the
experts' data-parallel group at one rank (no expert gradient sync whose size would differ).
Checked on 4-rank plans: every priced collective is issued (the token all-to-alls as
tests/test_moe_census.py checks them: count and world bytes), and what is left over is
all-reduces on groups of ``expert_tp`` ranks, as many as above, ``R h`` bytes each at ep 1 and
``ep T k h`` bytes per EP group in all at ep 2.
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
K = CONFIG.moe.router_topk
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
def test_expert_tp_adds_exactly_its_all_reduces_to_the_priced_step(plan_name: str) -> None:
    plan = PLANS[plan_name]
    per_rank = run_distributed(_worker, plan.world_size, plan_name)
    micro = plan.num_microbatches
    world_extra_bytes = 0.0
    want_world_bytes = 0.0
    for rank, (_, second) in enumerate(per_rank):
        where = f"{plan_name} rank {rank}"
        assert not [c for c in second if c.kind.startswith("unknown:")], where
        issued = Counter(_key(c) for c in second if not _is_tokens(_key(c)))
        priced = _priced(plan, 0)
        priced_rest = Counter({k: v for k, v in priced.items() if not _is_tokens(k)})
        assert not priced_rest - issued, f"{where}: priced, not issued {priced_rest - issued}"
        extra = issued - priced_rest
        want_count: Counter = Counter()
        for layer in plan.layers:
            dp = plan.world_size // layer.tp
            tokens = plan.global_batch_size // micro // dp * CONFIG.seq_length
            per_call = 2 + (1 if layer.recompute else 0)
            want_count[layer.expert_tp] += per_call * micro
            # the world's rows: T k per rank, whatever the EP exchange moved (dropless)
            want_world_bytes += per_call * micro * tokens * K * CONFIG.hidden_size * 4
            if layer.ep == 1:  # every rank's experts see its own T k rows
                size = float(tokens * K * CONFIG.hidden_size * 4)
                assert extra[("all_reduce", layer.expert_tp, True, size)] >= per_call * micro
        got_count = Counter()
        for (kind, size, consecutive, nbytes), n in extra.items():
            assert kind == "all_reduce" and consecutive, (where, kind, size)
            got_count[size] += n
            world_extra_bytes += nbytes * n
        assert got_count == want_count, (where, dict(got_count), dict(want_count))
    assert world_extra_bytes == want_world_bytes
