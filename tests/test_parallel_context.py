"""Rank arithmetic (pure, up to 1024 ranks) and the group cache of ParallelContext (gloo)."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from megatron_auto.layout import plan_group_ranks
from megatron_auto.parallel.context import (ParallelContext, StageLayout, dp_group_ranks,
                                            stage_layout, tp_dp_rank, tp_group_ranks)
from megatron_auto.plan import LayerStrategy, Plan, PipelineSpec, VocabStrategy


def _powers_of_two(n: int) -> list[int]:
    return [1 << k for k in range(n.bit_length()) if n % (1 << k) == 0]


@pytest.mark.single
@pytest.mark.parametrize("world_size,pp", [(1, 1), (2, 1), (4, 2), (8, 1), (16, 4), (64, 2),
                                           (256, 8), (1024, 1), (1024, 4)])
def test_groups_partition_every_stage(world_size: int, pp: int) -> None:
    n = world_size // pp
    for stage in range(pp):
        ranks = list(range(stage * n, (stage + 1) * n))
        for tp in _powers_of_two(n):
            for consecutive in (True, False):
                tps = tp_group_ranks(ranks, tp, consecutive)
                dps = dp_group_ranks(ranks, tp, consecutive)
                # partitions: every rank exactly once, right sizes and counts
                assert sorted(r for g in tps for r in g) == ranks
                assert sorted(r for g in dps for r in g) == ranks
                assert len(tps) == n // tp and all(len(g) == tp for g in tps)
                assert len(dps) == tp and all(len(g) == n // tp for g in dps)
                # a TP group and a DP group meet in exactly one rank (they form a grid)
                for tg in tps[:4]:
                    for dg in dps[:4]:
                        assert len(set(tg) & set(dg)) == 1
                # positions in the groups agree with tp_dp_rank
                for g in tps:
                    for pos, r in enumerate(g):
                        assert tp_dp_rank(r - ranks[0], n, tp, consecutive)[0] == pos
                for g in dps:
                    for pos, r in enumerate(g):
                        assert tp_dp_rank(r - ranks[0], n, tp, consecutive)[1] == pos


@pytest.mark.single
def test_layouts_hand_computed() -> None:
    # 8 ranks, tp=2: consecutive pairs (0,1),(2,3)...; strided partners 4 apart (0,4),(1,5)...
    assert tp_group_ranks(range(8), 2, True) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert tp_group_ranks(range(8), 2, False) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dp_group_ranks(range(8), 2, True) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dp_group_ranks(range(8), 2, False) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert tp_dp_rank(5, 8, 2, True) == (1, 2)
    assert tp_dp_rank(5, 8, 2, False) == (1, 1)
    # a second stage keeps its own global ranks
    assert tp_group_ranks([4, 5, 6, 7], 2, False) == [[4, 6], [5, 7]]


@pytest.mark.single
def test_layout_normalisation_and_errors() -> None:
    assert stage_layout(0, 1, False, 4) == StageLayout(0, 1, True)
    assert stage_layout(1, 4, False, 4) == StageLayout(1, 4, True)
    assert stage_layout(0, 2, False, 4) == StageLayout(0, 2, False)
    with pytest.raises(ValueError, match="tp=3: must be a positive divisor of the 4 ranks"):
        stage_layout(0, 3, True, 4)
    with pytest.raises(ValueError, match="tp=8"):
        tp_group_ranks(range(4), 8, True)


def _mixed_plan(num_layers: int, world_size: int = 4) -> Plan:
    # alternating three layouts over many layers: groups must depend on layouts only
    strategies = [LayerStrategy(tp=2, tp_consecutive=True), LayerStrategy(tp=2, tp_consecutive=False),
                  LayerStrategy(tp=1)]
    layers = tuple(strategies[i % 3] for i in range(num_layers))
    return Plan(world_size=world_size, global_batch_size=8, num_microbatches=2,
                pipeline=PipelineSpec(1, "1f1b", (num_layers,)), vocab=VocabStrategy(tp=4),
                layers=layers)


def _context_worker(rank: int, world_size: int) -> dict:
    few = ParallelContext(_mixed_plan(3))
    many = ParallelContext(_mixed_plan(24))
    ctx = many
    out = {"few": few.num_groups, "many": many.num_groups}
    g = ctx.layer_groups(1)  # tp=2 strided
    out["strided"] = (g.tp_ranks, g.dp_ranks, g.tp_rank, g.dp_rank)
    g0 = ctx.layer_groups(0)
    out["consec"] = (g0.tp_ranks, g0.dp_ranks, g0.tp_rank, g0.dp_rank)
    # the same rank tuple is the same group object across layouts (the cache)
    assert ctx.layer_groups(2).dp_group is ctx.vocab_groups().tp_group  # both the whole world
    assert ctx.layer_groups(0) is ctx.layer_groups(3)
    # a group actually works: sum of ranks over the strided TP group
    t = torch.tensor([float(rank)])
    torch.distributed.all_reduce(t, group=g.tp_group)
    out["sum"] = t.item()
    pp_plan = Plan(world_size=4, global_batch_size=4, num_microbatches=2,
                   pipeline=PipelineSpec(2, "1f1b", (1, 2)), vocab=VocabStrategy(tp=2),
                   layers=(LayerStrategy(tp=2), LayerStrategy(tp=1), LayerStrategy(tp=2)))
    pctx = ParallelContext(pp_plan)
    out["pp"] = (pctx.stage, pctx.stage_ranks, pctx.prev_rank, pctx.next_rank,
                 pctx.embedding_group is not None, pctx.is_first_stage, pctx.is_last_stage)
    with pytest.raises(ValueError, match="lives on stage"):
        pctx.layer_groups(0 if pctx.stage == 1 else 1)
    with pytest.raises(KeyError, match="is not used on stage"):
        ctx.layout_groups(StageLayout(1, 2, True))  # ctx has one stage only
    # the groups made are the pure list gpu_terms counts, in its order
    for made in (few, many, pctx):
        assert made.group_ranks == plan_group_ranks(made.plan)
    return out


@pytest.mark.multirank
def test_context_groups_on_four_ranks() -> None:
    results = run_distributed(_context_worker, 4)
    # TP groups {01,23} {02,13} (two layouts) + 4 singletons + world + 2 strided-DP pairs
    # ({0,1},{2,3} already exist) -> the count must not change with the layer count.
    for r in results:
        assert r["few"] == r["many"]
    assert results[0]["few"] == 1 + 2 + 2 + 4  # world, {01,23}, {02,13}, singletons
    assert results[1]["strided"] == ([1, 3], [0, 1], 0, 1)
    assert results[2]["strided"] == ([0, 2], [2, 3], 1, 0)
    assert results[1]["consec"] == ([0, 1], [1, 3], 1, 0)
    assert [r["sum"] for r in results] == [2.0, 4.0, 2.0, 4.0]
    assert results[0]["pp"] == (0, [0, 1], None, 2, True, True, False)
    assert results[3]["pp"] == (1, [2, 3], 1, None, True, False, True)


@pytest.mark.multirank
def test_context_rejects_wrong_world_size() -> None:
    def worker(rank: int, world_size: int) -> str:
        try:
            ParallelContext(_mixed_plan(3, world_size=4))
        except ValueError as err:
            return str(err)
        return "no error"

    msgs = run_distributed(worker, 2)
    assert "plan field world_size=4 but this run has 2 ranks" in msgs[0]
