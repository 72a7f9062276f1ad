"""``megatron-auto plan`` with context parallelism searched (planner/search/cp_space.py): a
LLaMA-7B-like model at 32k tokens on one 8-GPU H100 node, the CP flags as pins, bad pins."""

from __future__ import annotations

import json
import re

import pytest

from megatron_auto.cli import main

pytestmark = pytest.mark.pure

LLAMA_32K = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
             "--ffn-hidden-size", "11008", "--seq-length", "32768",
             "--max-position-embeddings", "32768", "--swiglu", "--normalization", "RMSNorm",
             "--position-embedding-type", "rope", "--group-query-attention",
             "--num-query-groups", "8", "--vocab-size", "32000", "--global-batch-size", "64",
             "--attention-dropout", "0", "--cluster", "h100-80g-1x8"]


def _plan(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    assert main(["plan", *LLAMA_32K, *extra, "--plan-out", str(out)]) == 0
    return json.loads(out.read_text())


def _cp(plan):
    return {layer.get("cp", 1) for layer in plan["layers"]}


def test_long_sequences_get_context_parallelism_when_it_is_faster(tmp_path, capsys):
    searched = _plan(tmp_path, "searched")
    text = capsys.readouterr().out
    without = _plan(tmp_path, "without", "--context-parallel-size", "1")
    assert _cp(searched) != {1} and _cp(without) == {1}
    # the search's certified gap (1%) cannot hide a faster plan without CP
    assert searched["estimate"]["iteration_time_s"] < \
        without["estimate"]["iteration_time_s"] * (1 + 0.01)
    assert " cp " in text.splitlines()[[i for i, line in enumerate(text.splitlines())
                                        if line.startswith("Layers:")][0] + 1] + " "
    # the note puts the best plan without CP next to the answer (a baseline of the full
    # space with cp 1, searched in what the limit leaves: no faster than the answer)
    row = next(line for line in text.splitlines() if "full, cp 1" in line)
    ratio = re.search(r" (\d+\.\d+)x ", row)
    assert ratio is not None and float(ratio.group(1)) >= 1.0, row
    assert "full, cp 1" in searched["search"]["baselines"]
    assert "full, cp 1" not in without["search"]["baselines"]


def test_cp_flags_pin_degree_and_mode(tmp_path):
    plan = _plan(tmp_path, "pinned", "--context-parallel-size", "2", "--cp-comm-type", "a2a")
    assert _cp(plan) == {2}
    assert {layer.get("cp_mode") for layer in plan["layers"]} == {"ulysses"}


def test_a_cp_pin_that_cannot_hold_is_one_line(capsys):
    assert main(["plan", *LLAMA_32K, "--context-parallel-size", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "cp=3" in err and "power of two" in err


SHORT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "512", "--max-position-embeddings", "512", "--vocab-size", "512",
         "--global-batch-size", "2", "--cluster", "a100-40g-1x4",
         "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--quiet"]


def test_cp_min_seq_length_lets_the_search_try_cp_on_shorter_sequences(tmp_path, capsys):
    # 4 ranks, tp and pp pinned to 1, 2 samples: only cp > 1 uses every rank
    out = tmp_path / "short.json"
    assert main(["plan", *SHORT, "--plan-out", str(out)]) == 2  # 512 < 8192: cp 1 only
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no plan" in err[0] and "--cp-min-seq-length 512" in err[0]
    assert main(["plan", *SHORT, "--cp-min-seq-length", "512", "--plan-out", str(out)]) == 0
    assert _cp(json.loads(out.read_text())) in ({2}, {4})
    # above the model's length the knob keeps cp out again
    assert main(["plan", *SHORT, "--cp-min-seq-length", "1024", "--plan-out", str(out)]) == 2


@pytest.mark.parametrize("value", ["0", "-256"])
def test_a_bad_cp_min_seq_length_is_one_line(value, capsys):
    assert main(["plan", *SHORT, "--cp-min-seq-length", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--cp-min-seq-length={value}" in err[0] and "positive" in err[0]


def _check(plan_path, attention_dropout):
    """The runtime's plan check (``Plan.check_model``, which holds ``plan_cp``'s rules) on the
    searched plan and the model it was searched for (the plan's model record leaves dropout
    out: it prices nothing)."""
    from dataclasses import replace

    from megatron_auto.families.registry import config_from_record
    from megatron_auto.plan import Plan

    plan = Plan.load(plan_path)
    config = config_from_record(json.loads(plan_path.read_text())["model"])
    plan.check_model(replace(config, attention_dropout=attention_dropout))  # PlanError if refused
    return plan


@pytest.mark.parametrize("extra", [[], ["--num-attention-heads", "8"]])
def test_with_attention_dropout_the_search_offers_no_ring(tmp_path, extra):
    # ring attention runs without attention dropout (plan_cp): only Ulysses layers may take cp
    out = tmp_path / "dropout.json"
    argv = ["plan", *SHORT, "--cp-min-seq-length", "512", "--attention-dropout", "0.1", *extra]
    assert main([*argv, "--plan-out", str(out)]) == 0
    plan = _check(out, 0.1)
    assert {layer.cp for layer in plan.layers} != {1}
    assert {layer.cp_mode for layer in plan.layers} == {"ulysses"}
    # the same search without dropout takes ring here (the case above is not vacuous)
    assert main(["plan", *SHORT, "--cp-min-seq-length", "512", "--attention-dropout", "0",
                 *extra, "--plan-out", str(out)]) == 0
    assert "ring" in {layer.cp_mode for layer in _check(out, 0.0).layers}


def test_ring_pinned_with_attention_dropout_is_one_line(tmp_path, capsys):
    out = tmp_path / "p.json"
    base = ["plan", *SHORT, "--cp-min-seq-length", "512", "--attention-dropout", "0.1",
            "--cp-comm-type", "p2p", "--plan-out", str(out)]
    assert main([*base, "--context-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cp-comm-type=p2p" in err[0] and "--attention-dropout=0.1" in err[0]
    # p2p asked for, cp left to the search: no CP layer can run, so the plan keeps cp 1
    free = [*SHORT[:SHORT.index("--tensor-model-parallel-size")], "--quiet",
            "--global-batch-size", "4"]
    assert main(["plan", *free, "--cp-min-seq-length", "512", "--attention-dropout", "0.1",
                 "--cp-comm-type", "p2p", "--plan-out", str(out)]) == 0
    assert {layer.cp for layer in _check(out, 0.1).layers} == {1}
