"""``megatron-auto plan`` on worlds that are not powers of two (6, 12 and 24 GPUs, 3 nodes).

Every degree of the written plan divides the ranks it splits, TP groups stay inside a node, the
plan loads (the runtime's validation) and its estimate fits; the space has the odd degrees
(``spaces.divisors``, ``pipeline_degrees``) and leaves out the ones that would straddle a node.
"""

from __future__ import annotations

import pytest

from megatron_auto.cli import main
from megatron_auto.plan import Plan
from megatron_auto.planner.inputs.model_spec import LayerType
from megatron_auto.planner.search.spaces import (SpaceRules, decision_tree_counts, divisors,
                                                 layer_strategies, pipeline_degrees)

pytestmark = pytest.mark.pure

# 12 heads and FFN 3072 divide by 2, 3, 4 and 6.
MODEL = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
         "--seq-length", "512", "--vocab-size", "50304", "--global-batch-size", "48"]


@pytest.mark.parametrize("cluster,world,per_node", [("h100-80g-1x6", 6, 6),
                                                    ("h100-80g-2x6", 12, 6),
                                                    ("h100-80g-3x8", 24, 8)])
def test_plan_on_a_world_that_is_not_a_power_of_two(capsys, tmp_path, cluster, world, per_node):
    out = tmp_path / "plan.json"
    code = main(["plan", *MODEL, "--cluster", cluster, "--memory-budget-gb", "20",
                 "--plan-out", str(out)])
    _, err = capsys.readouterr()
    assert code == 0, err
    plan = Plan.load(out)
    assert plan.world_size == world and world % plan.pp_size == 0
    n = plan.stage_size
    assert n % per_node == 0 or per_node % n == 0  # stages do not straddle a node
    for s in list(plan.layers) + [plan.vocab]:
        assert n % s.tp == 0 and per_node % s.tp == 0, s
    assert plan.estimate["feasible"]


def test_divisors_and_pipeline_degrees():
    assert divisors(1) == [1]
    assert divisors(6) == [1, 2, 3, 6]
    assert divisors(24) == [1, 2, 3, 4, 6, 8, 12, 24]
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert pipeline_degrees(6, 6, 12) == [1, 2, 3, 6]
    assert pipeline_degrees(6, 6, 4) == [1, 2, 3]  # at most one stage per layer
    # 3 nodes of 8: stages of 12, 6 and 3 ranks would straddle a node boundary.
    assert pipeline_degrees(24, 8, 100) == [1, 3, 6, 12, 24]


def test_tp_degrees_divide_the_stage_and_stay_inside_a_node():
    lt = LayerType("x", 768, 12, 3072, 512, 1)
    tps = lambda n, node: sorted({s.tp for s in layer_strategies(lt, n, 48, SpaceRules(), node)})
    assert tps(6, 6) == [1, 2, 3, 6]
    # 2 nodes of 6: tp 4 divides the 12 ranks, but its second group takes ranks 4-7 of both nodes.
    assert tps(12, 6) == [1, 2, 3, 6]
    assert tps(12, 12) == [1, 2, 3, 4, 6, 12]
    assert 4 in tps(8, 8) and 3 not in tps(8, 8)
    # 12 heads leave out tp 8 and 24 even where a node has 24.
    assert tps(24, 24) == [1, 2, 3, 4, 6, 12]


def test_decision_tree_counts_on_six_devices_match_the_strategy_lists():
    lt = LayerType("x", 720, 60, 2880, 60, 1)  # every divisor of 6 and 12 divides it
    for world, node in ((6, 6), (12, 6), (12, 12)):
        listed = sum(len(layer_strategies(lt, world // pp, world, SpaceRules(), node))
                     for pp in pipeline_degrees(world, node, 100))
        assert decision_tree_counts(world, node)["rule 4"] == listed, (world, node)
    assert decision_tree_counts(12, 6)["rule 4"] < decision_tree_counts(12, 12)["rule 4"]


@pytest.mark.parametrize("pins,cluster,message", [
    (["--pipeline-model-parallel-size", "3"], "h100-80g-1x8",
     "--pipeline-model-parallel-size=3: must divide the 8 devices into stages inside a node or of whole nodes of 8; "
     "choose one of 1, 2, 4, 8"),
    (["--tensor-model-parallel-size", "4"], "h100-80g-2x6",
     "--tensor-model-parallel-size=4: must divide the 12 devices and a node of 6 (or be whole nodes); "
     "choose one of 1, 2, 3, 6, 12"),
])
def test_a_pinned_degree_no_plan_can_take_is_one_error_line(capsys, tmp_path, pins, cluster,
                                                            message):
    code = main(["plan", *MODEL, "--cluster", cluster, *pins,
                 "--plan-out", str(tmp_path / "p.json")])
    _, err = capsys.readouterr()
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
