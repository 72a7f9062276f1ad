"""The expert-parallel rank arithmetic (expert_layout.py) on 8-rank stages: for every layout and
ep, the EP groups and the expert-DP groups each partition every DP group, an EP group and an
expert-DP group meet in exactly one rank, EP ranks are the positions in the EP group, and the
plan's group list holds every group any rank uses."""

from __future__ import annotations

import itertools

import pytest

from megatron_auto.expert_layout import expert_layout, expert_ranks, plan_expert_group_ranks
from megatron_auto.layout import dp_group_ranks, make_layout, tp_dp_rank
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("tp, consecutive, ep", [
    (tp, c, ep) for tp, c in itertools.product((1, 2, 4), (True, False))
    for ep in (1, 2, 4, 8) if (8 // tp) % ep == 0])
def test_expert_groups_partition_each_dp_group(tp, consecutive, ep):
    stage = list(range(8, 16))  # the second stage of a 16-rank world
    lay = expert_layout(1, tp, consecutive, ep, 1, 8)
    local = make_layout(tp, consecutive, 8)
    dp_groups = dp_group_ranks(stage, local.tp, local.consecutive)
    mine = [expert_ranks(stage, lay, j) for j in range(8)]
    for j, r in enumerate(mine):
        t, _ = tp_dp_rank(j, 8, local.tp, local.consecutive)
        assert stage[j] in r.ep_ranks and stage[j] in r.expert_dp_ranks
        assert r.ep_ranks[r.ep_rank] == stage[j] and r.expert_dp_ranks[r.expert_dp_rank] == stage[j]
        assert len(r.ep_ranks) == ep and len(r.expert_dp_ranks) == 8 // tp // ep
        assert set(r.ep_ranks) | set(r.expert_dp_ranks) <= set(dp_groups[t])
        assert set(r.ep_ranks) & set(r.expert_dp_ranks) == {stage[j]}
    for t, group in enumerate(dp_groups):
        members = [mine[stage.index(g)] for g in group]
        for kind in ("ep_ranks", "expert_dp_ranks"):
            parts = {getattr(m, kind) for m in members}
            assert sorted(x for part in parts for x in part) == sorted(group), kind
        # every member of one EP group agrees on it (the all-to-all's group is consistent)
        for m in members:
            for other in m.ep_ranks:
                assert mine[stage.index(other)].ep_ranks == m.ep_ranks


def test_plan_expert_groups_cover_every_rank_and_only_expert_layers():
    layers = (LayerStrategy(tp=2, ep=2), LayerStrategy(tp=2), LayerStrategy(ep=4),
              LayerStrategy(ep=2, expert_dp_mode="zero1"))
    plan = Plan(world_size=8, global_batch_size=8, num_microbatches=1,
                pipeline=PipelineSpec(size=1, schedule="1f1b", layers_per_stage=(4,)),
                vocab=VocabStrategy(), layers=layers)
    groups = set(plan_expert_group_ranks(plan))
    for i, s in enumerate(layers):
        if s.ep == 1 and s.expert_dp_mode is None:
            continue
        lay = expert_layout(0, s.tp, s.tp_consecutive, s.ep, 1, 8)
        for j in range(8):
            r = expert_ranks(list(range(8)), lay, j)
            assert r.ep_ranks in groups and r.expert_dp_ranks in groups, (i, j)
