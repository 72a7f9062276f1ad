"""The cost of activation offload (planner/cost/offload.py) and its host budget.

Hand-derived bytes on a small GPT (fp32, 4 samples per rank, h 64, s 256, 8 heads, f 256, tp 2):
norm offload moves both norms' inputs, 2 x 4 B x 256 x 64 x 4 = 524,288 B per layer; core_attn
under the presets' flash kernel moves q, k, v (3 x 4 x 256 x 64 / 2 x 4 = 393,216), the output
(131,072) and the log-sum-exp (4 x 8 x 256 / 2 x 4 = 16,384): 540,672 B. Two layers, one
micro-batch in flight (one stage): the host holds twice that. The copies run at the preset's
PCIe figure: backward waits for all of them, forward only beyond the layer's forward compute.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from megatron_auto.config import ModelConfig
from megatron_auto.families.registry import model_spec
from megatron_auto.plan import Plan
from megatron_auto.planner.cost.estimate import evaluate_plan
from megatron_auto.planner.cost.offload import host_budget_problem
from megatron_auto.planner.inputs.hardware import GB
from megatron_auto.planner.inputs.model_spec import TrainingSpec
from megatron_auto.planner.inputs.presets import get_cluster
from megatron_auto.planner.inputs.profiles import analytic_profile

pytestmark = pytest.mark.pure

CONFIG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=256,
                     seq_length=256, max_position_embeddings=256, vocab_size=256)
SPEC, TRAINING = model_spec(CONFIG), TrainingSpec(global_batch_size=8, precision="fp32")
CLUSTER = replace(get_cluster("h100-80g-1x8"), devices_per_node=2, name="h100-80g-1x2")
PROFILE = analytic_profile(SPEC, TRAINING, CLUSTER)


def _estimate(offload, recompute=False, cluster=CLUSTER):
    plan = Plan.uniform(2, 2, global_batch_size=8, num_microbatches=2, tp=2, recompute=recompute)
    plan = replace(plan, layers=tuple(replace(layer, offload=offload) for layer in plan.layers))
    return evaluate_plan(plan, SPEC, TRAINING, cluster, PROFILE)


VALUES = [False, ("norm",), ("mlp",), ("core_attn",), ("core_attn", "mlp", "norm"), True]


def test_hand_derived_host_bytes():
    assert _estimate(("norm",)).host_memory_bytes == 2 * 524_288
    assert _estimate(("core_attn",)).host_memory_bytes == 2 * 540_672
    assert _estimate(False).host_memory_bytes == 0.0
    assert "host_memory_bytes" not in _estimate(False).to_dict()["stages"][0]


def test_offload_moves_device_bytes_to_the_host():
    est = {v: _estimate(v) for v in VALUES}
    host = {v: e.host_memory_bytes for v, e in est.items()}
    peak = {v: e.peak_memory_bytes for v, e in est.items()}
    singles = [host[("norm",)], host[("mlp",)], host[("core_attn",)]]
    assert all(b > 0 for b in singles)
    assert host[("core_attn", "mlp", "norm")] == pytest.approx(sum(singles))  # disjoint modules
    assert host[True] > host[("core_attn", "mlp", "norm")]  # + projections' inputs, residuals
    for value in VALUES[1:]:
        assert peak[value] < peak[False], value
    assert peak[True] == min(peak.values())
    # one layer's moved bytes are back on the device during its backward: the device saves
    # the moved bytes of every layer but one (2 layers, 1 micro-batch in flight)
    saved = peak[False] - peak[("norm",)]
    assert 524_288 <= saved <= 1.1 * 524_288


def test_copies_cost_backward_time_and_forward_time_beyond_compute():
    base, norm = _estimate(False), _estimate(("norm",))
    copy = 524_288 / CLUSTER.host_link_bw
    m, layers = 2, 2  # micro-batches, layers (one stage: the iteration is the stage's time)
    added = norm.iteration_time_s - base.iteration_time_s
    assert added >= m * layers * copy * (1 - 1e-9)  # backward waits for every copy back
    assert added <= m * layers * 2 * copy * (1 + 1e-9)  # and forward for at most as much
    fast = replace(CLUSTER, host_link_bw=1e18)
    assert _estimate(True, cluster=fast).iteration_time_s == pytest.approx(
        _estimate(False, cluster=fast).iteration_time_s, rel=1e-7)
    slow = replace(CLUSTER, host_link_bw=1e6)  # the forward's copy no longer hides
    slow_added = _estimate(("norm",), cluster=slow).iteration_time_s - _estimate(
        False, cluster=slow).iteration_time_s
    assert slow_added > 1.9 * m * layers * 524_288 / 1e6


def test_without_a_host_link_figure_copies_are_not_priced():
    cpu = replace(CLUSTER, host_link_bw=0.0)
    assert _estimate(True, cluster=cpu).iteration_time_s == _estimate(
        False, cluster=cpu).iteration_time_s
    assert _estimate(True, cluster=cpu).host_memory_bytes == _estimate(True).host_memory_bytes


def test_offload_of_a_layer_with_module_recompute_leaves_the_checkpoint_inputs():
    """Offload true beside selective recompute moves what the layer keeps less q, k, v (the
    checkpoint holds them on the device): 3 x 4 B x 256 x 64 / 2 x 4 samples = 393,216 B per
    layer. (The presets' flash kernel keeps no scores, so selective itself releases nothing
    here: cost/recompute.py.)"""
    alone, beside = _estimate(True), _estimate(True, recompute="selective")
    assert alone.host_memory_bytes - beside.host_memory_bytes == 2 * 393_216


def test_presets_carry_the_pcie_figure_with_its_source():
    h100, a100 = get_cluster("h100-80g-1x8"), get_cluster("a100-40g-1x8")
    assert h100.host_link_bw == pytest.approx(0.8 * 63 * GB)
    assert a100.host_link_bw == pytest.approx(0.8 * 31.5 * GB)
    assert "PCIe 5.0 x16" in h100.source and "PCIe 4.0 x16" in a100.source


@pytest.mark.parametrize("host, budget, message", [
    (2.5e9, None, "the plan offloads activations (layers[i].offload) that need 2.50 GB of host "
                  "memory per device: give --host-memory-budget-gb 2.50 or more, or set offload "
                  "to false"),
    (2.5e9, 2.0, "--host-memory-budget-gb=2.0: the plan's offloaded activations need 2.50 GB of "
                 "host memory per device; raise it to 2.50"),
    (0.0, -1.0, "--host-memory-budget-gb=-1.0: must be a positive number"),
    (0.0, float("nan"), "--host-memory-budget-gb=nan: must be a positive number"),
])
def test_host_budget_problems_are_one_line(host, budget, message):
    problem = host_budget_problem(host, budget)
    assert problem is not None and message in problem and "\n" not in problem


def test_host_budgets_that_hold_the_plan_pass():
    assert host_budget_problem(2.5e9, 2.5) is None
    assert host_budget_problem(0.0, None) is None
    est = replace(_estimate(True), host_memory_budget_bytes=1e3)
    assert not est.feasible and est.to_dict()["host_memory_budget_bytes"] == 1e3


def _offload_plan_file(tmp_path, offload=(True, ("norm",), False, False)):
    plan = Plan.uniform(8, 4, global_batch_size=16, num_microbatches=2, tp=2)
    plan = replace(plan, layers=tuple(replace(layer, offload=o)
                                      for layer, o in zip(plan.layers, offload)))
    path = tmp_path / "offload.json"
    plan.save(path)
    return str(path)


CLI_MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "1024"]


def test_evaluate_and_explain_report_host_memory_of_offload_plans(capsys, tmp_path):
    from megatron_auto.cli import main
    path = _offload_plan_file(tmp_path)
    assert main(["evaluate", *CLI_MODEL, "--plan", path, "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-auto evaluate: error: the plan offloads activations") and \
        "give --host-memory-budget-gb" in err and "\n" not in err
    assert main(["evaluate", *CLI_MODEL, "--plan", path, "--json",
                 "--host-memory-budget-gb", "16"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["host_memory_budget_bytes"] == 16e9 and est["feasible"] is True
    assert est["stages"][0]["host_memory_bytes"] > 0
    assert main(["explain", *CLI_MODEL, "--plan", path, "--host-memory-budget-gb", "16"]) == 0
    out = capsys.readouterr().out
    assert "host memory" in out and "of 16.00 GB host budget" in out
    assert "offload" in out and "all" in out and "norm" in out  # the per-layer column
    assert main(["evaluate", *CLI_MODEL, "--plan", path, "--host-memory-budget-gb",
                 "0.000001"]) == 2
    assert "--host-memory-budget-gb=1e-06: the plan's offloaded activations need" in \
        capsys.readouterr().err
    # plans without offload: no budget needed, no host column
    plain = _offload_plan_file(tmp_path, (False,) * 4)
    assert main(["explain", *CLI_MODEL, "--plan", plain]) == 0
    assert "host memory" not in capsys.readouterr().out


def test_megatron_and_galvatron_exports_name_offload_as_a_reason():
    from megatron_auto.planner.interop.galvatron import plan_to_galvatron_config
    from megatron_auto.planner.interop.megatron_flags import to_megatron_flags
    plan = Plan.uniform(2, 2, global_batch_size=8, num_microbatches=2, tp=2)
    plan = replace(plan, layers=(replace(plan.layers[0], offload=("mlp",)), plan.layers[1]))
    flags, reasons = to_megatron_flags(plan)
    assert flags is None and "layers 0 offload activations" in " ".join(reasons)
    config, reasons = plan_to_galvatron_config(plan)
    assert config is None and "layers [0] offload activations" in " ".join(reasons)


# ------------------------------------------------------------------------ optimizer offload
def _optimizer_estimate(fraction, cluster=CLUSTER):
    plan = Plan.uniform(2, 2, global_batch_size=8, num_microbatches=2, tp=2)
    data = plan.to_dict()
    data["pipeline"]["optimizer_offload_fraction"] = fraction
    return evaluate_plan(Plan.from_dict(data), SPEC, TRAINING, cluster, PROFILE)


def test_optimizer_offload_changes_nothing_at_fraction_zero():
    plan = Plan.uniform(2, 2, global_batch_size=8, num_microbatches=2, tp=2)
    assert _optimizer_estimate(0.0).to_dict() == evaluate_plan(
        plan, SPEC, TRAINING, CLUSTER, PROFILE).to_dict()


def test_optimizer_offload_host_bytes_are_sixteen_per_owned_element():
    # one stage, ddp over dp 1 (tp 2 on 2 ranks): the rank owns every local parameter; the
    # profile's own parameter count, not the cost model's, gives the elements
    local = SPEC.num_layers * PROFILE.layer_types["gpt"].local_parameters(2) + \
        PROFILE.embedding.local_embedding_parameters(2) + PROFILE.embedding.head_parameters
    full = _optimizer_estimate(1.0)
    assert full.host_memory_bytes == pytest.approx(16 * local)
    assert full.host_optimizer_bytes == full.host_memory_bytes
    assert _optimizer_estimate(0.5).host_memory_bytes == pytest.approx(8 * local)
    # the device loses the moments (8 B per element) and keeps parameter and gradient
    none = _optimizer_estimate(0.0)
    assert none.stages[0].memory_breakdown["optimizer_states"] > 0
    assert full.stages[0].memory_breakdown["optimizer_states"] == 0.0
    assert none.peak_memory_bytes - full.peak_memory_bytes == pytest.approx(8 * local)


def test_optimizer_offload_step_time_on_gpu_and_cpu():
    none, half, full = (_optimizer_estimate(f) for f in (0.0, 0.5, 1.0))
    # the preset's host AdamW and PCIe copies are slower than the device's HBM-bound step
    assert none.iteration_time_s < half.iteration_time_s < full.iteration_time_s
    free_host = replace(CLUSTER, host_optimizer_time_per_parameter_s=1e-30, host_link_bw=1e30)
    assert _optimizer_estimate(1.0, free_host).iteration_time_s < none.iteration_time_s
    # CPU (one memory: no copies priced, the host step is the device's kernel): unchanged
    cpu = replace(CLUSTER, host_link_bw=0.0, host_optimizer_time_per_parameter_s=0.0)
    times = {f: _optimizer_estimate(f, cpu).iteration_time_s for f in (0.0, 0.5, 1.0)}
    assert times[0.5] == pytest.approx(times[0.0]) and times[1.0] == pytest.approx(times[0.0])


def test_host_budget_names_the_optimizer_share():
    problem = host_budget_problem(2.5e9, None, host_optimizer_bytes=2.5e9)
    assert problem == ("the plan's offloaded optimizer share (pipeline.optimizer_offload_fraction) "
                       "needs 2.50 GB of host memory per device: give --host-memory-budget-gb "
                       "2.50 or more, or lower pipeline.optimizer_offload_fraction")
    both = host_budget_problem(3e9, 2.0, host_optimizer_bytes=1e9)
    assert both.startswith("--host-memory-budget-gb=2.0: the plan's offloaded activations "
                           "(layers[i].offload) and optimizer share") and "3.00 GB" in both
