"""Model specs and profiles: builders, analytic numbers by hand, JSON format and its errors."""

from __future__ import annotations

import json

import pytest

from megatron_auto.config import ModelConfig
from megatron_auto.planner import (LayerType, ModelProfile, ModelSpec, ProfileError, SpecError,
                                   TrainingSpec, analytic_profile)
from megatron_auto.families.registry import model_spec

from planner_fakes import FakeCluster, round_profile

pytestmark = pytest.mark.pure


def test_from_model_config_gpt_and_bert():
    cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16,
                      vocab_size=1000, make_vocab_size_divisible_by=128)
    spec = model_spec(cfg)
    assert spec.num_layers == 4 and spec.vocab_size == 1024
    assert spec.layer_types[0].ffn_hidden_size == 256 and spec.layer_types[0].causal
    # Parameters agree with the runtime config's own count (tied: embedding counted once).
    assert spec.layer_types[0].num_parameters == cfg.num_layer_parameters()
    assert spec.plan_model_record()["hidden_size"] == 64
    bert = model_spec(ModelConfig(num_layers=2, hidden_size=64,
                                                   num_attention_heads=4, model_type="bert"))
    assert not bert.layer_types[0].causal


def test_stacked_model_keeps_order_and_counts():
    enc = LayerType("enc", 64, 4, 256, 16, 2)
    dec = LayerType("dec", 32, 2, 64, 16, 3)
    spec = ModelSpec.stacked([(enc, 2), (dec, 3)], 100, 64, 16)
    assert spec.layer_order == (0, 0, 1, 1, 1)
    assert [t.count for t in spec.layer_types] == [2, 3]


@pytest.mark.parametrize("kwargs, message", [
    (dict(hidden_size=65), "hidden_size=65: must be divisible by num_attention_heads=4"),
    (dict(activation="relu"), "activation='relu'"),
    (dict(count=0), "count=0: must be a positive integer"),
])
def test_layer_type_errors_name_the_field(kwargs, message):
    base = dict(name="x", hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                seq_length=16, count=1)
    with pytest.raises(SpecError, match=message):
        LayerType(**{**base, **kwargs})


def test_spec_and_training_errors():
    lt = LayerType("x", 64, 4, 256, 16, 2)
    with pytest.raises(SpecError, match=r"layer_types\['x'\].count=2: layer_order holds 1"):
        ModelSpec((lt,), (0,), 64, 64, 16)
    with pytest.raises(SpecError, match="precision='fp8'"):
        TrainingSpec(8, precision="fp8")
    with pytest.raises(SpecError, match="global_batch_size=0"):
        TrainingSpec(0)


def test_analytic_profile_hand_numbers():
    # h = 64, f = 256, s = 16, a = 4, bf16 (2 B), 1e12 FLOP/s.
    # FLOPs/sample = 2*16*(4*64^2 + 2*64*256) + 4*16^2*64 = 1,572,864 + 65,536 = 1,638,400.
    # Kept per sample: replicated (4*2 + 2)*16*64 = 10,240;
    #   split 4*2*16*64 + 2*2*16*256 + (2*2 + 1)*4*16^2 = 8,192 + 16,384 + 5,120 = 29,696.
    spec = ModelSpec.uniform(2, 64, 4, 16, 128)
    prof = analytic_profile(spec, TrainingSpec(8), FakeCluster())
    lt = prof.layer_types["gpt"]
    assert lt.flops_per_sample == pytest.approx(1_638_400)
    assert lt.forward_time_per_sample_s == pytest.approx(1_638_400 / 1e12)
    assert lt.activation_bytes(1) == pytest.approx(10_240 + 29_696)
    assert lt.activation_bytes(4) == pytest.approx(10_240 + 29_696 / 4)
    assert lt.recompute_bytes_per_sample == pytest.approx(2 * 16 * 64)
    assert lt.weight_copy_bytes_per_parameter == 2.0
    fp32 = analytic_profile(spec, TrainingSpec(8, "fp32"), FakeCluster())
    assert fp32.layer_types["gpt"].weight_copy_bytes_per_parameter == 0.0
    # Head: 2*s*h*V = 2*16*64*128 FLOPs per sample.
    assert prof.embedding.head_forward_time_per_sample_s == pytest.approx(262_144 / 1e12)


def test_measured_activation_table_interpolates_conservatively():
    prof = round_profile().layer_types["gpt"]
    from dataclasses import replace
    measured = replace(prof, activation_bytes_by_tp={1: 300.0, 2: 200.0, 4: 150.0})
    assert measured.activation_bytes(2) == 200.0
    # a + b/t through tp 2 and 4: b = 200, a = 100 -> tp 8: 125.
    assert measured.activation_bytes(8) == pytest.approx(125.0)


def test_profile_json_round_trip(tmp_path):
    spec = ModelSpec.uniform(2, 64, 4, 16, 128)
    prof = analytic_profile(spec, TrainingSpec(8), FakeCluster())
    path = tmp_path / "profile.json"
    prof.save(path)
    assert ModelProfile.load(path) == prof
    data = json.loads(path.read_text())
    assert data["format"] == "megatron_auto.model_profile" and data["version"] == 1


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="galvatron"), "format='galvatron'.*import-galvatron"),
    (lambda d: d.update(version=7), "version=7"),
    (lambda d: d["layer_types"]["gpt"].update(parameter_count=-1), "parameter_count=-1"),
    (lambda d: d["layer_types"]["gpt"].update(speed=1), r"unknown key\(s\)"),
    (lambda d: d["layer_types"]["gpt"].pop("hidden_bytes_per_sample"), "hidden_bytes_per_sample"),
    (lambda d: d["embedding"].update(tied="yes"), "embedding.tied='yes'"),
    (lambda d: d.update(source="guess"), "source='guess'"),
])
def test_bad_profile_files_name_field_and_fix(tmp_path, mutate, message):
    data = round_profile().to_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message):
        ModelProfile.load(path)


def test_unreadable_profile_files(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        ModelProfile.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        ModelProfile.load(bad)


def test_profile_must_cover_the_model():
    spec = ModelSpec.uniform(2, 64, 4, 16, 128, name="bert", causal=False)
    with pytest.raises(ProfileError, match=r"no entry for layer type\(s\) \['bert'\]"):
        round_profile().check_matches(spec, "bf16")
