"""The process groups ``ParallelContext`` really creates are the ones the planner counts.

The planner charges one NCCL communicator per process group of two or more ranks that a rank
belongs to (``gpu_terms.nccl_bytes``, its fast count, and ``gpu_terms.rank_process_groups``,
the groups it stands for). Here every rank of 4- and 8-rank gloo worlds builds
``ParallelContext`` for random plans (pipeline degrees 1, 2, 4 and interleaved, random TP
degrees and orders per layer, random vocab TP, context parallelism) and reads back the groups
torch.distributed registered for it (``_world.pg_group_ranks``: the groups this rank is a
member of, whoever asked for them), which no planner code computes. Per rank and plan they
equal ``rank_process_groups`` without its p2p pairs (NCCL's per-peer communicators of the
pipeline sends, which run on the world group and create no process group), and their count
plus those pairs is the fast count.

Seen to catch (``python tests/mutation_check.py nccl-missing-pair``): the fast count without
the embedding pair of the first and last stage (a missing group: 4-, 8-rank plans with pp > 1
fail on their end stages).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from dist_utils import run_distributed
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy, even_partition

pytestmark = pytest.mark.multirank


def random_plans(world: int, seed: int, count: int) -> list[Plan]:
    """``count`` valid random plans of ``world`` ranks (the same on every rank)."""
    rng = random.Random(seed)
    out: list[Plan] = []
    while len(out) < count:
        pp = rng.choice([p for p in (1, 2, 4) if world % p == 0 and p < world])
        n = world // pp
        virtual = rng.choice((1, 2)) if pp > 1 else 1
        cp = rng.choice([c for c in (1, 2) if n % c == 0]) if rng.random() < 0.25 else 1
        tps = [t for t in (1, 2, 4, 8) if (n // cp) % t == 0]
        num_layers = pp * virtual * rng.choice((1, 2))
        layers = tuple(LayerStrategy(tp=rng.choice(tps),
                                     tp_consecutive=cp > 1 or rng.random() < 0.5, cp=cp)
                       for _ in range(num_layers))
        try:
            plan = Plan(world_size=world, global_batch_size=8 * world, num_microbatches=2,
                        pipeline=PipelineSpec(pp, "1f1b",
                                              even_partition(num_layers, pp * virtual),
                                              virtual_size=virtual),
                        vocab=VocabStrategy(tp=rng.choice(tps)), layers=layers)
        except ValueError:
            continue  # a combination the plan refuses (its own tests cover those)
        out.append(plan)
    return out


def _registered_groups() -> dict[Any, tuple[int, ...]]:
    """Every process group torch.distributed holds on this rank, by object: its global ranks."""
    import torch.distributed as dist

    return {pg: tuple(sorted(ranks))
            for pg, ranks in dist.distributed_c10d._world.pg_group_ranks.items()}


def _groups_worker(rank: int, world_size: int, plans: list[Plan]) -> list[set[tuple[int, ...]]]:
    from megatron_auto.parallel.context import ParallelContext

    world = tuple(range(world_size))
    out = []
    for plan in plans:
        before = _registered_groups()
        ParallelContext(plan)
        new = [ranks for pg, ranks in _registered_groups().items() if pg not in before]
        assert len(new) == len(set(new)), f"a group created twice: {sorted(new)}"
        # the world group is the context's too (it reuses it rather than create a copy)
        out.append({g for g in new + [world] if len(g) > 1})
    return out


@pytest.mark.parametrize("world,seed", [(4, 0), (8, 1)])
def test_parallel_context_creates_the_groups_the_planner_counts(world: int, seed: int) -> None:
    from megatron_auto.planner.cost import gpu_terms

    plans = random_plans(world, seed, 12)
    per_rank = run_distributed(_groups_worker, world, plans)
    shapes: set[Any] = set()
    for rank, groups in enumerate(per_rank):
        for plan, real in zip(plans, groups):
            where = f"rank {rank} of {plan.to_dict()}"
            counted = gpu_terms.rank_process_groups(plan, rank)
            pairs = {g for g in counted if g[0] == "p2p"}
            assert real == counted - pairs, where
            assert gpu_terms.nccl_bytes(plan, rank, 1.0) == len(real) + len(pairs), where
            shapes.add((plan.pp_size, plan.virtual_size, plan.layers[0].cp))
    # the draw covers the shapes the docstring names
    assert {s[0] for s in shapes} >= {1, 2} and any(s[1] > 1 for s in shapes)
