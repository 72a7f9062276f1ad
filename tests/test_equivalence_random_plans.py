"""A random-plan sweep over every per-layer choice, the new ones included: sequence
parallelism, ZeRO-1 and the interleaved schedule next to tp, strided layouts, ddp / zero2 /
zero3, recompute, pp and uneven stages. Each plan trains test_equivalence's tiny GPT for 2
steps and must match one process (relative 1e-5, docs/design.md §4).
"""

from __future__ import annotations

import pytest

import random

from harness import layer, plan_of
from megatron_auto.plan import PlanError
from test_equivalence import CONFIG, GPT

pytestmark = pytest.mark.multirank

DP_MODES = ["ddp", "zero1", "zero2", "zero3"]


def random_plans(count: int, seed: int, world_size: int = 4) -> list[dict]:
    """Seeded random valid plans; at least one uses each of SP, zero1 and virtual_size 2."""
    rng = random.Random(seed)
    plans: list[dict] = []
    seen = {"sp": False, "zero1": False, "virtual": False}
    while len(plans) < count or not all(seen.values()):
        pp = rng.choice([1, 2, 4])
        virtual = 2 if pp == 2 and rng.random() < 0.5 else 1
        n = world_size // pp
        num_chunks = pp * virtual
        cuts = sorted(rng.sample(range(1, CONFIG.num_layers), num_chunks - 1))
        bounds = [0] + cuts + [CONFIG.num_layers]
        chunks = tuple(bounds[i + 1] - bounds[i] for i in range(num_chunks))
        tps = [t for t in (1, 2, 4) if n % t == 0]
        layers = []
        for _ in range(CONFIG.num_layers):
            tp = rng.choice(tps)
            layers.append(layer(tp=tp, dp_mode=rng.choice(DP_MODES),
                                consecutive=rng.random() < 0.5, recompute=rng.random() < 0.3,
                                sp=tp > 1 and rng.random() < 0.5))
        mb = rng.choice([2, 4] if virtual > 1 else [1, 2, 4])
        try:
            plan = plan_of(world_size, layers, layers_per_stage=chunks, num_microbatches=mb,
                           schedule="1f1b" if virtual > 1 else rng.choice(["1f1b", "gpipe"]),
                           vocab_tp=rng.choice(tps), vocab_dp_mode=rng.choice(DP_MODES),
                           virtual_size=virtual)
        except PlanError:
            continue  # e.g. a dp degree that does not divide the micro-batch: draw again
        plans.append(plan)
        seen["sp"] |= any(l.get("sequence_parallel") for l in plan["layers"])
        seen["zero1"] |= any(l["dp_mode"] == "zero1" for l in plan["layers"])
        seen["virtual"] |= plan["pipeline"].get("virtual_size", 1) > 1
        if len(plans) > 3 * count:
            raise AssertionError(f"seed {seed}: the new choices did not all come up")
    return plans


def test_random_plans_with_sp_zero1_and_interleaving_match_one_process():
    plans = random_plans(6, seed=20261201)
    for plan, trained in zip(plans, GPT.run(4, plans, steps=2)):
        GPT.check(trained, f"random plan {plan}")
