"""Where the full space's proven answer bounds the baseline spaces (``spaces.baselines_inside``),
a baseline search stops once it reaches that answer, and a baseline space the answer is a plan of
(``spaces.plan_in_space``) reports it without a search. Checked: each baseline reported next to
an answer equals that baseline space searched on its own (which never uses either), pinned and
multi-node cases included, where a baseline may beat the pinned answer or use a TP degree the
full space leaves out. (Forcing either rule to "yes" fails these cases.)"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_auto.planner import (BASELINE_SPACES, InfeasibleError, ModelSpec, SearchOptions,
                                   TrainingSpec, analytic_profile, search)
from megatron_auto.planner.inputs.presets import make_cluster
from megatron_auto.planner.search.spaces import baselines_inside

pytestmark = pytest.mark.pure

SPEC = ModelSpec.uniform(8, 64, 4, 32, 128, name="gpt")
TRAINING = TrainingSpec(8, "bf16")
# Exact searches (gap 0): the rules compare each baseline with its own optimum.
QUIET = dict(show_progress=False, report_partitions=False, optimality_gap=0.0)


def _cluster(nodes: int, per_node: int):
    return dataclasses.replace(make_cluster("a100-40g", nodes, per_node),
                               memory_reserve_bytes=10 ** 5, device_memory_bytes=10 ** 8,
                               nccl_communicator_bytes=5e3)


# (nodes, devices per node, budget in bytes, pins): the floor applies to the first two only
CASES = [
    (1, 8, 10 ** 8, {}),
    (1, 8, 2_500_000, {}),
    (2, 4, 10 ** 8, {}),                          # tp 8 baselines cross nodes: no floor
    (1, 8, 10 ** 8, {"pp": 2}),                   # the pp baseline (pp 8) is outside
    (1, 8, 10 ** 8, {"tp": 4}),
    (1, 8, 2_500_000, {"tp": 4}),                 # megatron3d's tp 1 plans beat the answer
    (1, 8, 10 ** 8, {"dp_modes": ("zero1",)}),    # dp/tp/pp baselines use ddp
    (1, 8, 10 ** 8, {"sequence_parallel": True}),
    (1, 8, 10 ** 8, {"partition": "memory"}),     # baselines split evenly
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{c[3]}")
def test_reported_baselines_equal_their_own_search(case):
    nodes, per_node, budget, pins = case
    cluster = _cluster(nodes, per_node)
    profile = analytic_profile(SPEC, TRAINING, cluster)
    options = SearchOptions(**QUIET, **pins)
    assert baselines_inside(options, cluster.world_size, per_node) == (not pins and nodes == 1)
    result = search(SPEC, TRAINING, cluster, profile, budget, options)
    assert result.plan.search["proven_optimal"]
    for name in BASELINE_SPACES:
        alone_options = dataclasses.replace(options, space=name, include_baselines=False)
        try:
            alone = search(SPEC, TRAINING, cluster, profile, budget, alone_options).estimate
        except InfeasibleError:
            alone = None
        reported = result.baselines[name]
        if alone is None:
            assert reported is None, name
            continue
        assert reported is not None, name
        assert reported.samples_per_s == pytest.approx(alone.samples_per_s, rel=1e-9), name
        if not pins and nodes == 1:  # inside the full space: never above its answer
            assert reported.samples_per_s <= result.estimate.samples_per_s * (1 + 1e-9), name
