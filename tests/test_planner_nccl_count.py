"""The fast NCCL communicator count equals the set of process groups it stands for.

``gpu_terms.nccl_bytes`` counts a rank's groups as arithmetic progressions of local indices
(O(layouts) per rank, needed for 1024-GPU plans); ``gpu_terms.rank_process_groups`` builds the
groups themselves as the runtime does. Every rank of random plans of every small shape.
"""

from __future__ import annotations

import random

import pytest

from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy, even_partition
from megatron_auto.planner.cost import gpu_terms as g

pytestmark = pytest.mark.pure


def _plans(seed: int):
    rng = random.Random(seed)
    for world in (1, 2, 4, 8, 16):
        for pp in (p for p in (1, 2, 4, 8) if p <= world and world % p == 0):
            n = world // pp
            tps = [t for t in (1, 2, 4, 8, 16) if t <= n]
            for _ in range(6):
                layers = 4
                strategies = tuple(LayerStrategy(tp=rng.choice(tps),
                                                 tp_consecutive=rng.random() < 0.5)
                                   for _ in range(max(layers, pp)))
                yield Plan(world_size=world, global_batch_size=16 * world, num_microbatches=1,
                           pipeline=PipelineSpec(size=pp, schedule="1f1b",
                                                 layers_per_stage=even_partition(
                                                     len(strategies), pp)),
                           vocab=VocabStrategy(tp=rng.choice(tps)), layers=strategies)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_count_equals_the_groups(seed):
    checked = 0
    for plan in _plans(seed):
        for rank in range(plan.world_size):
            assert g.nccl_bytes(plan, rank, 1.0) == len(g.rank_process_groups(plan, rank)), \
                (plan.to_dict(), rank)
            checked += 1
        for k in range(plan.pp_size):
            n = plan.stage_size
            assert g.stage_nccl_bytes(plan, k, 1.0) == max(
                len(g.rank_process_groups(plan, r)) for r in range(k * n, (k + 1) * n))
    assert checked > 500
