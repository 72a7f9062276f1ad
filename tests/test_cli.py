"""``megatron-auto`` end to end, in-process (``main([...])``), on small models."""

import json
from pathlib import Path

import pytest

from megatron_auto.cli import main
from megatron_auto.plan import Plan
from megatron_auto.planner.inputs.hardware import ClusterSpec

# Galvatron 2.4's shipped files (source and license: tests/data/galvatron/README.md).
PROFILES = Path(__file__).resolve().parent / "data" / "galvatron"

SMALL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "128", "--vocab-size", "1024", "--cluster", "a100-40g-1x8"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.pure
def test_evaluate_json_prints_the_estimate_fields(capsys, tmp_path):
    code, out, err = run(capsys, "evaluate", *SMALL, "--tensor-model-parallel-size", "2",
                         "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
                         "--global-batch-size", "16", "--bf16", "--json",
                         "--plan-out", str(tmp_path / "p.json"))
    assert code == 0, err
    est = json.loads(out)
    assert {"iteration_time_s", "samples_per_s", "stages"} <= set(est)
    assert len(est["stages"]) == 2
    # Throughput is the global batch over the iteration time.
    assert est["samples_per_s"] == pytest.approx(16 / est["iteration_time_s"])
    assert est["memory_budget_bytes"] == 40 * 10**9  # default: the device memory
    plan = Plan.load(tmp_path / "p.json")
    assert plan.estimate["iteration_time_s"] == est["iteration_time_s"]
    assert plan.layers[0].tp == 2 and plan.num_microbatches == 4  # 16 / (2 x dp 2)


@pytest.mark.pure
def test_evaluate_plan_file_and_classic_flags_agree(capsys, tmp_path):
    plan = Plan.uniform(8, 4, global_batch_size=16, num_microbatches=2, tp=4, pp=1)
    plan.save(tmp_path / "uniform.json")
    code, out_file, err = run(capsys, "evaluate", *SMALL, "--plan", str(tmp_path / "uniform.json"),
                              "--json")
    assert code == 0, err
    # tp 4 -> dp 2; 16 samples / (micro 4 * dp 2) = 2 micro-batches: the same plan.
    code, out_flags, err = run(capsys, "evaluate", *SMALL, "--tensor-model-parallel-size", "4",
                               "--micro-batch-size", "4", "--global-batch-size", "16", "--json")
    assert code == 0, err
    assert json.loads(out_file) == json.loads(out_flags)


@pytest.mark.pure
def test_explain_prints_layers_stages_and_megatron_flags(capsys):
    code, out, err = run(capsys, "explain", *SMALL, "--tensor-model-parallel-size", "2",
                         "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
                         "--global-batch-size", "8", "--recompute-granularity", "full",
                         "--recompute-method", "uniform")
    assert code == 0, err
    assert "Layers:" in out and "Stages:" in out and "binding" in out
    assert "0-1" in out and "2-3" in out  # equal layers folded per stage
    assert "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" in out


@pytest.mark.pure
def test_explain_a_non_megatron_plan_lists_reasons(capsys, tmp_path):
    data = Plan.uniform(8, 4, global_batch_size=16, num_microbatches=2, tp=2).to_dict()
    data["layers"][1]["tp"] = 4
    data["layers"][2]["dp_mode"] = "zero3"
    Plan.from_dict(data).save(tmp_path / "mixed.json")
    code, out, err = run(capsys, "explain", *SMALL, "--plan", str(tmp_path / "mixed.json"))
    assert code == 0, err
    assert "Not expressible as classic Megatron-LM flags" in out
    assert "per-layer tensor-parallel degrees differ ([2, 4])" in out


@pytest.mark.pure
def test_plan_searches_writes_and_explains(capsys, tmp_path):
    out_path = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", *SMALL, "--global-batch-size", "16", "--bf16",
                         "--memory-budget-gb", "8", "--plan-out", str(out_path), "--quiet")
    assert code == 0, err
    plan = Plan.load(out_path)
    assert plan.world_size == 8 and plan.num_layers == 4 and plan.estimate
    assert "Searched plan" in out and "Stages:" in out
    assert plan.search["precision"] == "bf16" and plan.search["cluster"] == "a100-40g-1x8"
    # The written plan records its model, precision and cluster, so evaluate needs none of
    # those flags again; and it agrees with the search's estimate.
    code, out2, err = run(capsys, "evaluate", "--plan", str(out_path), "--memory-budget-gb", "8",
                          "--json")
    assert code == 0, err
    assert json.loads(out2)["iteration_time_s"] == pytest.approx(plan.estimate["iteration_time_s"])
    # Another cluster size is refused with the reason.
    code, _, err = run(capsys, "explain", "--plan", str(out_path), "--cluster", "a100-40g-2x8")
    assert code == 2 and "plan world_size=8 but the cluster has 16 devices" in err


@pytest.mark.pure
def test_plan_without_plan_out_says_where_it_wrote(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "plan", *SMALL, "--memory-budget-gb", "8", "--quiet")
    assert code == 0, err
    assert out.rstrip().splitlines()[-1] == "plan written to plan.json"
    assert Plan.load(tmp_path / "plan.json").num_layers == 4


@pytest.mark.pure
def test_plan_with_an_impossible_budget_states_the_minimum(capsys, tmp_path):
    model = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--seq-length", "512", "--vocab-size", "50000", "--global-batch-size", "64"]
    # The framework reserve alone is 1.5 GiB = 1.61 GB: 1.8 GB leaves too little for this model.
    code, _, err = run(capsys, "plan", *model, "--memory-budget-gb", "1.8",
                       "--plan-out", str(tmp_path / "x.json"), "--quiet")
    assert code == 2
    assert "Traceback" not in err
    line = [x for x in err.splitlines() if "minimum memory that works" in x][0]
    minimum = float(line.split()[-1])
    assert minimum > 1.8
    code, _, err = run(capsys, "plan", *model, "--memory-budget-gb", str(minimum),
                       "--plan-out", str(tmp_path / "x.json"), "--quiet")
    assert code == 0, err
    assert Plan.load(tmp_path / "x.json").estimate["peak_memory_bytes"] <= minimum * 1e9


@pytest.mark.single
def test_import_galvatron_then_evaluate(capsys, tmp_path):
    bert = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--seq-length", "512", "--vocab-size", "30522", "--model-type", "bert", "--bf16"]
    profile, cluster, plan = tmp_path / "bert.profile.json", tmp_path / "c.json", tmp_path / "p.json"
    code, out, err = run(
        capsys, "import-galvatron", *bert,
        "--computation", str(PROFILES / "computation_profiling_bf16_hidden1024_head16.json"),
        "--memory", str(PROFILES / "memory_profiling_bf16_hidden1024_head16.json"),
        "--model-profile-out", str(profile),
        "--allreduce", str(PROFILES / "allreduce_bandwidth_1nodes_8gpus_per_node.json"),
        "--p2p", str(PROFILES / "p2p_bandwidth_1nodes_8gpus_per_node.json"),
        "--overlap", str(PROFILES / "overlap_coefficient.json"), "--cluster-out", str(cluster),
        "--galvatron-config", str(PROFILES / "galvatron_config_hidden1024_head16_1nodes_8gpus_"
                                             "per_node_23GB_bf16_bsz128_[tpconsec_off].json"),
        "--plan-out", str(plan))
    assert code == 0, err
    assert ClusterSpec.load(cluster).allreduce_busbw(8) == pytest.approx(154.203e9)
    assert Plan.load(plan).layers[0].tp == 2
    code, out, err = run(capsys, "evaluate", *bert, "--plan", str(plan), "--cluster", str(cluster),
                         "--model-profile", str(profile), "--memory-budget-gb", "23", "--json")
    assert code == 0, err
    est = json.loads(out)
    assert est["samples_per_s"] == pytest.approx(128 / est["iteration_time_s"])
    # The same Galvatron plan priced directly from its file gives the same estimate.
    code, out2, err = run(
        capsys, "evaluate", *bert, "--galvatron-config",
        str(PROFILES / "galvatron_config_hidden1024_head16_1nodes_8gpus_per_node_23GB_bf16_bsz128_"
                       "[tpconsec_off].json"),
        "--cluster", str(cluster), "--model-profile", str(profile), "--memory-budget-gb", "23",
        "--json")
    assert code == 0, err
    assert json.loads(out2) == est


@pytest.mark.single
@pytest.mark.parametrize("argv, message", [
    (["evaluate", "--cluster", "tpu-v9-1x8"], "--cluster tpu-v9-1x8: not a preset name"),
    (["evaluate", *SMALL, "--tensor-model-parallel-size", "3"],
     "--tensor-model-parallel-size=3: must divide --num-attention-heads=4"),
    (["evaluate", *SMALL, "--pipeline-model-parallel-size", "3", "--num-layers", "3"],
     "--tensor-model-parallel-size=1 x --pipeline-model-parallel-size=3 = 3 must divide the "
     "world size 8"),
    (["evaluate", *SMALL, "--hidden-size", "250"], "--hidden-size=250: must be divisible by"),
    (["evaluate", *SMALL, "--memory-budget-gb", "-1"], "--memory-budget-gb=-1.0: must be positive"),
    (["plan", *SMALL, "--memory-budget-gb", "inf"], "--memory-budget-gb=inf: must be positive "
                                                      "and finite"),
    (["evaluate", *SMALL, "--memory-budget-gb", "nan"], "--memory-budget-gb=nan: must be positive "
                                                        "and finite"),
    (["evaluate", *SMALL, "--bf16", "--fp16"], "--bf16=True: cannot be combined with --fp16"),
    (["plan", *SMALL, "--memory-budget-gb", "1"],
     "--memory-budget-gb=1.0: not above the framework reserve of 1.61 GB"),
    (["evaluate", *SMALL, "--plan", "missing.json"], "--plan missing.json: cannot read the file"),
    (["evaluate", *SMALL, "--plan", "a.json", "--tensor-model-parallel-size", "2"],
     "--plan and --tensor-model-parallel-size given together"),
    (["evaluate", *SMALL, "--model-profile", "nope.json"], "--model-profile nope.json: cannot read"),
    (["evaluate", *SMALL, "--tensor-model-parallel-size", "8", "--micro-batch-size", "1",
      "--global-batch-size", "2"], "--tensor-model-parallel-size=8: must divide --num-attention-heads=4"),
    (["plan", *SMALL, "--search-space", "bogus"], "--search-space='bogus': choose one of full"),
    (["plan", *SMALL, "--time-limit", "-1"], "--time-limit=-1.0: must be positive"),
    (["import-galvatron"], "nothing to import"),
    (["import-galvatron", "--computation", "c.json"], "--computation and --memory go together"),
    (["import-galvatron", "--p2p", "p.json"], "give --allreduce FILE too"),
])
def test_bad_input_names_the_flag_and_exits_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


@pytest.mark.pure
def test_argparse_errors_and_help(capsys):
    code, _, err = run(capsys, "evaluate", "--num-layers", "four")
    assert code == 2 and "--num-layers" in err
    for sub in ("plan", "evaluate", "explain", "import-galvatron"):
        code, out, _ = run(capsys, sub, "--help")
        assert code == 0 and "examples:" in out and "megatron-auto " + sub in out
    code, out, _ = run(capsys)
    assert code == 2 and "plan" in out


@pytest.mark.pure
def test_plan_searches_module_recompute_on_request(capsys, tmp_path):
    out_path = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", *SMALL, "--global-batch-size", "16", "--bf16",
                         "--memory-budget-gb", "8", "--plan-out", str(out_path), "--quiet",
                         "--search-module-recompute", "selective", "core_attn+mlp")
    assert code == 0, err
    assert Plan.load(out_path).num_layers == 4
    code, _, err = run(capsys, "plan", *SMALL, "--search-module-recompute", "attention")
    assert code == 2 and "--search-module-recompute=['attention']: unknown module name(s)" in err
    code, _, err = run(capsys, "plan", *SMALL, "--search-module-recompute", "full")
    assert code == 2 and "none and full are always searched" in err
