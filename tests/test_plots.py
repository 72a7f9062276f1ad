"""Plan and metrics plots: what is drawn is what the plan and estimate say."""

from __future__ import annotations

import pytest

from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.utils.plots import (PlotError, draw_stage_memory, draw_stage_time,
                                       draw_strategy_map, plot_metrics, plot_plan)

pytestmark = pytest.mark.pure

pytest.importorskip("matplotlib", reason="plots are the optional 'plots' extra (matplotlib); "
                                         "the 'test' extra installs it")

PLAN = Plan(world_size=4, global_batch_size=8, num_microbatches=2,
            pipeline=PipelineSpec(size=2, layers_per_stage=(2, 3)), vocab=VocabStrategy(tp=2),
            layers=(LayerStrategy(tp=2), LayerStrategy(tp=1, dp_mode="zero3"),
                    LayerStrategy(tp=2, recompute=True), LayerStrategy(tp=2, dp_mode="zero2"),
                    LayerStrategy(tp=1)))
STAGES = [{"time_s": 0.5, "forward_time_s": 0.05, "backward_time_s": 0.1, "sync_tail_s": 0.02,
           "peak_memory_bytes": 3e9,
           "memory_breakdown": {"parameters": 1e9, "activations": 1.5e9, "transient": 0.5e9}},
          {"time_s": 0.45, "forward_time_s": 0.04, "backward_time_s": 0.08, "sync_tail_s": 0.0,
           "peak_memory_bytes": 2e9,
           "memory_breakdown": {"parameters": 1e9, "activations": 1e9}}]
ESTIMATE = {"iteration_time_s": 0.6, "memory_budget_bytes": 4e9, "stages": STAGES}


def _axes():
    from matplotlib.figure import Figure

    return Figure().subplots()


def test_strategy_map_bars_are_the_layers_tp_and_stage_boundaries_are_marked():
    ax = _axes()
    draw_strategy_map(ax, PLAN)
    bars = [p for p in ax.patches if p.get_facecolor()[3] > 0]  # the hatched overlays are clear
    assert [round(b.get_height()) for b in bars] == [s.tp for s in PLAN.layers]
    overlays = [p for p in ax.patches if p.get_facecolor()[3] == 0]
    assert [round(p.get_x() + p.get_width() / 2) for p in overlays] == [2]  # layer 2 recomputes
    boundaries = [line.get_xdata()[0] for line in ax.get_lines()]
    assert boundaries == [pytest.approx(1.5)]  # stage 1 starts at layer 2
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"ddp", "zero2", "zero3",
                                                                  "recompute"}


def test_stage_memory_stacks_to_each_stage_peak_with_the_budget_line():
    ax = _axes()
    draw_stage_memory(ax, STAGES, 4e9)
    tops = {}
    for p in ax.patches:
        stage = round(p.get_x() + p.get_width() / 2)
        tops[stage] = max(tops.get(stage, 0.0), p.get_y() + p.get_height())
    assert tops == {0: pytest.approx(3.0), 1: pytest.approx(2.0)}  # GB
    assert [line.get_ydata()[0] for line in ax.get_lines()] == [pytest.approx(4.0)]


def test_stage_time_bars_add_up_to_each_stage_time():
    ax = _axes()
    draw_stage_time(ax, STAGES, 2, 0.6)
    tops = {}
    for p in ax.patches:
        stage = round(p.get_x() + p.get_width() / 2)
        tops[stage] = max(tops.get(stage, 0.0), p.get_y() + p.get_height())
    assert tops == {0: pytest.approx(500.0), 1: pytest.approx(450.0)}  # ms
    assert [line.get_ydata()[0] for line in ax.get_lines()] == [pytest.approx(600.0)]


def test_files_are_written(tmp_path):
    from matplotlib.image import imread

    path = plot_plan(PLAN, str(tmp_path / "plan.png"), ESTIMATE)
    assert imread(path).shape[0] > 500  # three panels
    records = [{"iteration": i, "lm_loss": 7 - i * 0.1, "samples_per_s": 10.0 + i,
                "iteration_time_s": 0.5, "predicted_iteration_time_s": 0.45,
                "peak_memory_bytes": 2e9} for i in range(1, 6)]
    records.append({"iteration": 5, "split": "valid", "lm_loss": 6.4, "ppl": 600.0})
    assert imread(plot_metrics(records, str(tmp_path / "m.png"))).shape[1] > 500


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(PlotError, match="no training records"):
        plot_metrics([{"split": "valid", "iteration": 1}], str(tmp_path / "m.png"))
    with pytest.raises(PlotError, match="does not exist"):
        plot_plan(PLAN, str(tmp_path / "nowhere" / "p.png"), ESTIMATE)


def test_missing_matplotlib_is_named(monkeypatch):
    import sys

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotError, match=r"pip install 'megatron_auto\[plots\]'"):
        plot_plan(PLAN, "x.png", ESTIMATE)


def test_cli_explain_plot_and_plot_metrics(tmp_path, capsys):
    from matplotlib.image import imread

    from megatron_auto.cli import main

    plan = Plan.uniform(8, 4, global_batch_size=16, num_microbatches=2, tp=2, pp=2)
    plan.save(tmp_path / "plan.json")
    model = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "128"]
    assert main(["explain", "--plan", str(tmp_path / "plan.json"), *model, "--cluster",
                 "a100-40g-1x8", "--plot", str(tmp_path / "plan.png")]) == 0
    assert "plot written to" in capsys.readouterr().out
    assert imread(str(tmp_path / "plan.png")).shape[0] > 500
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("\n".join(
        f'{{"iteration": {i}, "lm_loss": {7 - i / 10}, "samples_per_s": 10}}' for i in (1, 2, 3)))
    assert main(["plot-metrics", str(metrics)]) == 0
    assert imread(str(tmp_path / "m.png")).shape[1] > 500
    metrics.write_text("{not json\n")
    assert main(["plot-metrics", str(metrics)]) == 2
    assert "m.jsonl:1: not a JSON object" in capsys.readouterr().err
