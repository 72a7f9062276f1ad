"""The census of an expert-parallel training step: what the runtime issues equals what the cost
model prices (``planner/cost/census.rank_collectives``, ``cost/moe.py``).

Every collective of one iteration, per rank, read off the dispatcher (tests/collective_census.py)
on 4-rank MoE plans with ``ep = 2``. All but the token all-to-alls match kind, group, bytes and
count exactly: the per-expert count exchanges (``E`` int64), the experts' gradients on their
expert-DP group in their own DP flavour (ddp buckets, ZeRO-1 buckets, FSDP2's gathers and
reduce-scatters), the TP all-reduce of an MoE layer without shared experts, the rest of the
step as tests/test_collective_count.py checks it, the MoE statistics' all-reduce (priced by
``collectives.step_collectives``) among them. The token all-to-alls carry what the router
sends, so their sizes are the routing's: each rank's dispatch (forward) and the combine's
gradient (backward) hold exactly its ``T k`` assignments, the priced size; the combine
(forward) and the dispatch's gradient (backward) hold what the rank's experts received, which
summed over the EP group is the same. Checked: each rank issues as many token exchanges as
priced, half of them of exactly the priced size, and the world's token bytes equal the priced
ones.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from dist_utils import run_distributed
from megatron_auto.config import ModelConfig
from megatron_auto.families.gpt.config import MoEConfig
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy

pytestmark = pytest.mark.multirank

E = 4
CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                     seq_length=8, vocab_size=64, make_vocab_size_divisible_by=16,
                     hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
                     moe=MoEConfig(num_experts=E, router_topk=2, ffn_hidden_size=48))
_L = LayerStrategy
PLANS = {
    # tp 1, dp 4, EP groups {0,1} {2,3}, expert-DP groups {0,2} {1,3}: ddp experts in a ddp
    # layer (buckets on the expert-DP group), zero3 experts in a zero1 layer.
    "ep2-dp4": Plan(world_size=4, global_batch_size=8, num_microbatches=2,
                    pipeline=PipelineSpec(1, "1f1b", (2,)), vocab=VocabStrategy(tp=1),
                    layers=(_L(ep=2), _L(dp_mode="zero1", ep=2, expert_dp_mode="zero3"))),
    # tp 2 x dp 2, ep 2 (expert-DP of one rank), recompute, and a pipeline of two stages of 2
    # with an ep-2 layer each: the TP all-reduce of an MoE layer without shared experts, the
    # recomputed forward's exchanges, the hop.
    "tp2-ep2": Plan(world_size=4, global_batch_size=8, num_microbatches=2,
                    pipeline=PipelineSpec(1, "1f1b", (2,)), vocab=VocabStrategy(tp=2),
                    layers=(_L(tp=2, ep=2, recompute=True), _L(tp=2, dp_mode="zero2"))),
    "pp2-ep2": Plan(world_size=4, global_batch_size=8, num_microbatches=2,
                    pipeline=PipelineSpec(2, "1f1b", (1, 1)), vocab=VocabStrategy(tp=1),
                    layers=(_L(ep=2), _L(ep=2, expert_dp_mode="zero1"))),
}


def _worker(rank: int, world_size: int, plan_name: str) -> list[list[Any]]:
    from collective_census import gpt_step_census

    return gpt_step_census(CONFIG, PLANS[plan_name])


def _priced(plan: Plan, stage: int) -> Counter:
    from collective_census import PRICED_AS
    from megatron_auto.families.registry import model_spec
    from megatron_auto.planner import TrainingSpec
    from megatron_auto.planner.cost.census import rank_collectives
    from megatron_auto.planner.inputs.profiles import analytic_profile
    from planner_fakes import FakeCluster

    spec = model_spec(CONFIG)
    profile = analytic_profile(spec, TrainingSpec(plan.global_batch_size, "fp32"),
                               FakeCluster())
    out: Counter = Counter()
    for c, count in rank_collectives(plan, spec, profile, "fp32", stage).items():
        out[(PRICED_AS[c.kind], c.group_size, c.consecutive, c.nbytes)] += count
    return out


def _key(call: Any) -> tuple[str, int, bool, float]:
    if call.kind in ("send", "recv"):
        return (call.kind, 2, False, float(call.nbytes))
    return (call.kind, call.group_size, call.consecutive, float(call.nbytes))


def _is_tokens(key: tuple[str, int, bool, float]) -> bool:
    return key[0] == "all_to_all" and key[3] != 8 * E  # not the count exchange


def _metrics_key(world: int) -> tuple[str, int, bool, float]:
    """The step's MoE statistics all-reduce (training/moe_metrics.py), written out from the
    runtime's table: one float64 row of E + 3 numbers per MoE layer over every rank."""
    return ("all_reduce", world, True, float(8 * CONFIG.num_layers * (E + 3)))


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_the_expert_parallel_step_issues_what_the_cost_model_prices(plan_name: str) -> None:
    plan = PLANS[plan_name]
    per_rank = run_distributed(_worker, plan.world_size, plan_name)
    issued_tokens = priced_tokens = 0.0
    metrics = _metrics_key(plan.world_size)
    for rank, (first, second) in enumerate(per_rank):
        where = f"{plan_name} rank {rank}"
        assert not [c for c in second if c.kind.startswith("unknown:")], where
        issued = Counter(_key(c) for c in second)
        priced = _priced(plan, plan.stage_of_rank(rank))
        # the statistics all-reduce is priced like the step's other scalars (one per step)
        assert issued[metrics] == priced[metrics] == 1, (where, metrics)
        rest_issued = Counter({k: v for k, v in issued.items() if not _is_tokens(k)})
        rest_priced = Counter({k: v for k, v in priced.items() if not _is_tokens(k)})
        assert rest_issued == rest_priced, (f"{where}: runtime - priced "
                                            f"{dict(rest_issued - rest_priced)}; priced - "
                                            f"runtime {dict(rest_priced - rest_issued)}")
        tokens = [k for k in second if _is_tokens(_key(k))]
        want = [(k, n) for k, n in priced.items() if _is_tokens(k)]
        assert len(tokens) == sum(n for _, n in want) > 0, where
        sizes = {k[3] for k, _ in want}
        exact = sum(1 for c in tokens if float(c.nbytes) in sizes)
        assert exact >= len(tokens) // 2, where  # dispatch and the combine's gradient
        assert {(c.group_size, _key(c)[2]) for c in tokens} == {(k[1], k[2]) for k, _ in want}
        issued_tokens += sum(c.nbytes for c in tokens)
        priced_tokens += sum(k[3] * n for k, n in want)
    assert issued_tokens == priced_tokens
