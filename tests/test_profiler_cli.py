"""The profiler subcommands, run through a parser built like megatron_auto/cli.py builds its own."""

from __future__ import annotations

import argparse
import json

import pytest

from megatron_auto.planner.inputs.hardware import ClusterSpec
from megatron_auto.planner.inputs.presets import make_cluster
from megatron_auto.planner.inputs.profiles import ModelProfile
from megatron_auto.cli import add_model_flags, model_config_from_flags
from megatron_auto.profiler import cli as pcli

TINY_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "32", "--vocab-size", "256"]


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-auto")
    sub = parser.add_subparsers(dest="command")
    pcli.add_profile_model_parser(sub, add_model_flags, model_config_from_flags)
    pcli.add_profile_hardware_parser(sub)
    pcli.add_calibrate_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.mark.multirank
@pytest.mark.parametrize("command", ["profile-model", "profile-hardware", "calibrate"])
def test_help_has_examples(command, capsys):
    with pytest.raises(SystemExit):
        _run([command, "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and ("megatron-auto" in out or "torchrun" in out)


@pytest.mark.single
def test_profile_model_writes_and_then_reuses(tmp_path, capsys):
    out = tmp_path / "p.json"
    argv = ["profile-model", *TINY_FLAGS, "--device", "cpu", "--cache-dir", str(tmp_path / "c"),
            "--batch-sizes", "2", "3", "--iters", "1", "--warmup-iters", "0", "--out", str(out)]
    assert _run(argv) == 0
    profile = ModelProfile.load(out)
    assert profile.layer_types["gpt"].parameter_count > 0
    assert "from the cache" not in capsys.readouterr().out  # measured
    assert _run(argv) == 0
    assert "from the cache" in capsys.readouterr().out
    assert ModelProfile.load(out) == profile


@pytest.mark.single
def test_profile_hardware_single_process(tmp_path, capsys):
    out = tmp_path / "cluster.json"
    assert _run(["profile-hardware", "--out", str(out), "--message-sizes", "4096", "8192",
                 "--iters", "1"]) == 0
    spec = ClusterSpec.load(out)
    assert spec.world_size == 1 and spec.peak_flops["fp32"] > 0
    assert "not measured (one process)" in capsys.readouterr().out


@pytest.mark.pure
def test_calibrate_command_end_to_end(tmp_path, capsys):
    from megatron_auto.config import ModelConfig
    from megatron_auto.plan import Plan
    from megatron_auto.planner.cost.estimate import evaluate_plan
    from megatron_auto.planner.inputs.model_spec import TrainingSpec
    from megatron_auto.families.registry import model_spec
    from megatron_auto.planner.inputs.profiles import analytic_profile

    cfg = ModelConfig(num_layers=2, hidden_size=512, num_attention_heads=8, seq_length=256)
    spec, training = model_spec(cfg), TrainingSpec(8, precision="fp32")
    cluster = make_cluster("a100-40g", 1, 2)
    profile = analytic_profile(spec, training, cluster)
    runs = []
    for i, (m, rec) in enumerate([(1, False), (4, True), (2, False)]):
        plan = Plan.uniform(2, 2, global_batch_size=8, num_microbatches=m, recompute=rec,
                            model=cfg.to_dict())
        est = evaluate_plan(plan, spec, training, cluster, profile)
        plan.save(tmp_path / f"plan{i}.json")
        # Measured: 20% slower compute-bound time, 2 GiB more memory than predicted.
        record = {"iteration": 1, "iteration_time_s": 1.2 * est.iteration_time_s,
                  "peak_memory_bytes": est.peak_memory_bytes + 2 * 2**30}
        (tmp_path / f"m{i}.jsonl").write_text(json.dumps(record) + "\n")
        runs += ["--run", str(tmp_path / f"m{i}.jsonl"), str(tmp_path / f"plan{i}.json")]
    out = tmp_path / "calibrated.json"
    assert _run(["calibrate", *runs, "--cluster", "a100-40g-1x2", "--cluster-out", str(out),
                 "--skip-iterations", "0", "--json"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["memory_reserve_bytes"] == pytest.approx(cluster.memory_reserve_bytes + 2 * 2**30,
                                                           rel=1e-3)
    assert fitted["activation_scale"] == pytest.approx(1.0, abs=1e-3)
    assert ClusterSpec.load(out).memory_reserve_bytes == pytest.approx(
        fitted["memory_reserve_bytes"], abs=1)


@pytest.mark.pure
def test_calibrate_bad_flags(tmp_path):
    with pytest.raises(SystemExit):
        _run(["calibrate", "--cluster", "a100-40g-1x2"])  # --run is required
    with pytest.raises(ValueError, match="--skip-iterations -1"):
        _run(["calibrate", "--run", "m", "p", "--cluster", "x", "--skip-iterations", "-1"])
    with pytest.raises(ValueError, match="--bf16=True: cannot be combined with --fp16"):
        _run(["calibrate", "--run", "m", "p", "--cluster", "x", "--bf16", "--fp16"])
