"""The planner's view of T5: two layer types, cross-attention and the pipeline carry in the
analytic profile and the cost model, searched plans the runtime accepts, and the planning CLI
with pretrain_t5.py's flags (pure: no torch)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_auto.cli import main
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.planner import SearchOptions, TrainingSpec, analytic_profile, search
from megatron_auto.families.registry import model_spec
from megatron_auto.planner.cost.estimate import evaluate_plan
from megatron_auto.planner.cost.moves import stage_moves
from megatron_auto.planner.inputs.presets import get_cluster
from megatron_auto.families.t5.config import T5Config

pytestmark = pytest.mark.pure

T5_BASE = T5Config(encoder_num_layers=12, decoder_num_layers=12, hidden_size=768,
                   num_attention_heads=12, kv_channels=64, seq_length=512, decoder_seq_length=128,
                   vocab_size=32128)
T5_FLAGS = ["--model-type", "t5", "--encoder-num-layers", "12", "--decoder-num-layers", "12",
            "--hidden-size", "768", "--num-attention-heads", "12", "--kv-channels", "64",
            "--encoder-seq-length", "512", "--decoder-seq-length", "128", "--vocab-size",
            "32128", "--cluster", "a100-40g-1x8", "--bf16"]


def test_t5_has_an_encoder_and_a_decoder_type_in_order():
    spec = model_spec(T5_BASE)
    enc, dec = spec.layer_types
    assert (enc.name, enc.count, enc.seq_length, enc.cross_attention_seq_length,
            enc.carried_seq_length) == ("t5_encoder", 12, 512, 0, 128)
    assert (dec.name, dec.count, dec.seq_length, dec.cross_attention_seq_length,
            dec.carried_seq_length) == ("t5_decoder", 12, 128, 512, 512)
    assert spec.layer_order == (0,) * 12 + (1,) * 12
    assert spec.head_tokens == 128  # the LM head projects the decoder tokens


@pytest.mark.parametrize("kv", [64, 32])
def test_spec_counts_every_parameter_of_the_runtime_model(kv):
    # T5Config.num_parameters equals the runtime stage's parameters (test_t5, test_t5_parts)
    cfg = dataclasses.replace(T5_BASE, kv_channels=kv)
    spec = model_spec(cfg)
    assert spec.layer_types[0].num_parameters == cfg.encoder_layer_parameters()
    assert spec.layer_types[1].num_parameters == cfg.decoder_layer_parameters()
    total = (sum(spec.layer_type(i).num_parameters for i in range(spec.num_layers))
             + spec.embedding_parameters + spec.head_parameters)
    assert total == cfg.num_parameters()


def test_analytic_profile_charges_cross_attention_and_the_carry():
    spec = model_spec(T5_BASE)
    profile = analytic_profile(spec, TrainingSpec(8, precision="bf16"),
                               get_cluster("a100-40g-1x8"))
    enc, dec = profile.layer_types["t5_encoder"], profile.layer_types["t5_decoder"]
    # the same decoder layer without cross-attention: only the carry differs
    plain_type = dataclasses.replace(spec.layer_types[1], cross_attention_seq_length=0)
    plain = analytic_profile(dataclasses.replace(spec, layer_types=(spec.layer_types[0],
                                                                    plain_type)),
                             TrainingSpec(8, precision="bf16"), get_cluster("a100-40g-1x8"))
    no_cross = plain.layer_types["t5_decoder"]
    assert dec.forward_time_per_sample_s > no_cross.forward_time_per_sample_s
    assert dec.activation_split_bytes > no_cross.activation_split_bytes
    assert dec.parameter_count > no_cross.parameter_count
    # both sides of every boundary move the hidden state and the carry: (512 + 128) x 768, bf16
    assert enc.moved_bytes_per_sample == dec.moved_bytes_per_sample == 2 * 640 * 768
    assert enc.hidden_bytes_per_sample == 2 * 512 * 768
    assert dec.hidden_bytes_per_sample == 2 * 128 * 768


def _plan(lps, tp=1):
    return Plan(world_size=8, global_batch_size=64, num_microbatches=8,
                pipeline=PipelineSpec(len(lps), "1f1b", tuple(lps)),
                vocab=VocabStrategy(tp=tp), layers=(LayerStrategy(tp=tp),) * 24)


def test_cost_model_moves_the_carry_across_every_boundary():
    spec = model_spec(T5_BASE)
    profile = analytic_profile(spec, TrainingSpec(64, precision="bf16"),
                               get_cluster("a100-40g-1x8"))
    carried = 2 * 640 * 768
    for lps in ((6, 18), (12, 12), (18, 6)):  # inside the encoder, at the boundary, decoder
        plan = _plan(lps)
        hop = [m for m in stage_moves(plan, spec, profile, 1) if m.hop]
        assert [m.bytes_per_sample for m in hop] == [carried], lps
    # the move into the head carries only the decoder's hidden state
    last = stage_moves(_plan((12, 12), tp=2), spec, profile, 1)[-1]
    assert last.bytes_per_sample == 2 * 128 * 768
    # a pipelined T5 pays more for its hops than one without the carry would
    plan = _plan((12, 12))
    bare = dataclasses.replace(profile, layer_types={
        n: dataclasses.replace(lt, boundary_bytes_per_sample=0.0)
        for n, lt in profile.layer_types.items()})
    cluster = get_cluster("a100-40g-1x8")
    with_carry = evaluate_plan(plan, spec, TrainingSpec(64, "bf16"), cluster, profile)
    without = evaluate_plan(plan, spec, TrainingSpec(64, "bf16"), cluster, bare)
    assert with_carry.iteration_time_s > without.iteration_time_s


def test_search_finds_a_plan_the_runtime_accepts():
    spec = model_spec(T5_BASE)
    cluster = get_cluster("a100-40g-1x8")
    training = TrainingSpec(64, precision="bf16")
    result = search(spec, training, cluster, analytic_profile(spec, training, cluster),
                    cluster.budget_bytes(None), SearchOptions(), world_size=8)
    plan = Plan.from_dict({**result.plan.to_dict(), "model": T5_BASE.to_dict()})
    plan.validate(T5_BASE)
    assert sum(plan.pipeline.layers_per_stage) == 24 and result.estimate.samples_per_s > 0


def test_plan_then_evaluate_and_explain_a_t5_plan(tmp_path, capsys):
    out = tmp_path / "t5.json"
    assert main(["plan", *T5_FLAGS, "--global-batch-size", "64", "--plan-out", str(out),
                 "--quiet"]) == 0
    plan = Plan.load(out)
    assert plan.model["model_type"] == "t5" and plan.model["decoder_seq_length"] == 128
    plan.validate(T5Config.from_dict(plan.model))
    assert "t5_decoder" in capsys.readouterr().out
    assert main(["evaluate", "--plan", str(out), "--json"]) == 0  # the plan records its model
    assert json.loads(capsys.readouterr().out)["iteration_time_s"] > 0
    assert main(["explain", "--plan", str(out)]) == 0
    assert "t5_encoder" in capsys.readouterr().out


def test_evaluate_a_classic_t5_layout_and_bad_input(tmp_path, capsys):
    assert main(["evaluate", *T5_FLAGS, "--global-batch-size", "64",
                 "--pipeline-model-parallel-size", "2", "--micro-batch-size", "8",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_time_s"] > 0
    code = main(["plan", *T5_FLAGS, "--position-embedding-type", "learned",
                 "--max-position-embeddings", "512", "--decoder-seq-length", "600",
                 "--plan-out", str(tmp_path / "unused.json")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--decoder-seq-length=600: is longer than the learned" in err[0]


def test_search_offers_t5_only_plans_its_runtime_trains(tmp_path, capsys):
    # T5 stages run neither Megatron-SP nor the interleaved schedule: not searched, and pinning
    # them is one error line
    out = tmp_path / "t5.json"
    assert main(["plan", *T5_FLAGS, "--global-batch-size", "64", "--plan-out", str(out),
                 "--quiet"]) == 0
    plan = Plan.load(out)
    assert plan.pipeline.virtual_size == 1
    assert not any(layer.sequence_parallel for layer in plan.layers)
    capsys.readouterr()
    assert main(["plan", *T5_FLAGS, "--sequence-parallel", "--plan-out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sequence-parallel: the t5 model does not run" in err[0]
