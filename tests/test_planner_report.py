"""Plan report text: units, folding of equal layers, stage breakdown and binding."""

import pytest

from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.planner.report import (describe_estimate, format_bytes, format_time,
                                          layer_rows, render_explain, render_stages)

pytestmark = pytest.mark.pure


def test_units():
    assert format_bytes(1.5e9) == "1.50 GB"
    assert format_bytes(320e6) == "320.0 MB"
    assert format_bytes(None) == "-"
    assert format_time(1.5) == "1.500 s"
    assert format_time(0.0123) == "12.30 ms"
    assert format_time(45e-6) == "45 us"


def test_equal_neighbours_fold_but_stage_boundaries_and_changes_do_not():
    layers = [LayerStrategy(tp=2)] * 3 + [LayerStrategy(tp=2, recompute=True), LayerStrategy(tp=2)]
    plan = Plan(world_size=4, global_batch_size=8, num_microbatches=2,
                pipeline=PipelineSpec(size=2, layers_per_stage=(2, 3)),
                vocab=VocabStrategy(tp=2), layers=tuple(layers))
    per_layer = [{"memory_bytes": 2e9, "forward_time_s": 1e-3, "backward_time_s": 2e-3}] * 5
    rows = layer_rows(plan, per_layer)
    # Stage 0: layers 0-1; stage 1: layer 2, then the recomputing layer 3, then layer 4.
    assert [r[0] for r in rows] == ["0-1", "2", "3", "4"]
    assert rows[0][1:] == [0, 2, 1, "ddp", "-", "no", "2.00 GB", "3.00 ms"]
    assert rows[2][6] == "yes"


def test_stages_and_summary_show_budget_and_binding():
    estimate = {"iteration_time_s": 0.5, "samples_per_s": 16.0, "peak_memory_bytes": 3e9,
                "memory_budget_bytes": 2e9, "feasible": False,
                "stages": [{"time_s": 0.5, "peak_memory_bytes": 3e9, "binding": "memory",
                            "memory_breakdown": {"parameters": 1e9, "activations": 2e9}}]}
    summary = describe_estimate(estimate)
    assert "500.00 ms per iteration" in summary and "16.0 samples/s" in summary
    assert "3.00 GB of 2.00 GB budget (DOES NOT FIT)" in summary
    stages = render_stages(estimate)
    header, rule, row = stages.splitlines()
    assert header.split() == ["stage", "time", "peak", "memory", "parameters", "activations",
                              "binding"]
    assert row.split()[-1] == "memory"
    plan = Plan.uniform(2, 2, global_batch_size=8, num_microbatches=4)
    text = render_explain(plan, estimate, megatron=(None, ["reason one"]))
    assert "Not expressible" in text and "- reason one" in text
