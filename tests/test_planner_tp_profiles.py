"""Per-tp profile times: the TP efficiency term by hand, per-tp round trip, the missing-degree
error (one line naming the file, the field, the degree and the fix)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from megatron_auto.planner import ModelProfile, ProfileError
from megatron_auto.families.registry import model_spec

from planner_fakes import round_profile

pytestmark = pytest.mark.pure


def test_replicated_fraction_by_hand():
    # 1 ms per sample at tp 1, a quarter of it repeated on every TP rank: at tp 4 a rank does
    # the 0.25 ms everyone repeats plus its quarter of the other 0.75 ms (0.1875 ms) = 0.4375 ms
    # per sample; 2 samples + the 0.1 ms per call = 0.975 ms. Efficiency: 1 / (4 * 0.4375).
    lt = replace(round_profile("fp32").layer_types["gpt"], forward_time_per_sample_s=1e-3,
                 forward_time_constant_s=1e-4, tp_replicated_fraction=0.25)
    assert lt.forward_time(2, 4) == pytest.approx(0.975e-3)
    assert lt.forward_time(2, 1) == pytest.approx(2.1e-3)
    assert lt.tp_efficiency(4) == pytest.approx(1 / 1.75)
    # Nothing repeated: TP divides perfectly (what every profile without the field reads as).
    plain = replace(lt, tp_replicated_fraction=0.0)
    assert plain.forward_time(2, 4) == pytest.approx(0.5e-3 + 1e-4)
    assert plain.tp_efficiency(8) == 1.0


def test_measured_tp_times_are_used_as_measured():
    lt = replace(round_profile("fp32").layer_types["gpt"], forward_time_per_sample_s=1e-3,
                 forward_time_by_tp={1: (1e-3, 0.0), 2: (0.6e-3, 2e-4)})
    assert lt.forward_time(3, 2) == pytest.approx(3 * 0.6e-3 + 2e-4)
    assert lt.measured_tp_degrees() == (2,)
    # tp 2 ran 0.6 ms per sample where a perfect split would take 0.5.
    assert lt.tp_efficiency(2) == pytest.approx(0.5 / 0.6)


def test_profile_round_trip_with_per_tp_times(tmp_path):
    prof = round_profile("fp32")
    lt = replace(prof.layer_types["gpt"], tp_replicated_fraction=0.125,
                 forward_time_by_tp={1: (1e-3, 1e-4), 2: (0.55e-3, 1.2e-4), 4: (0.3e-3, 1.5e-4)})
    prof = replace(prof, layer_types={"gpt": lt})
    path = tmp_path / "p.json"
    prof.save(path)
    data = json.loads(path.read_text())
    assert data["layer_types"]["gpt"]["forward_time_by_tp"]["4"] == [0.3e-3, 1.5e-4]
    again = ModelProfile.load(path)
    assert again == prof
    assert again.layer_types["gpt"].forward_time(2, 4) == pytest.approx(0.75e-3)


def test_profile_files_without_the_new_field_still_load(tmp_path):
    data = round_profile("fp32").to_dict()
    del data["layer_types"]["gpt"]["tp_replicated_fraction"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    lt = ModelProfile.load(path).layer_types["gpt"]
    assert lt.tp_replicated_fraction == 0.0
    # A perfect split: 4 samples over 2 TP ranks take what 2 samples take on one.
    assert lt.forward_time(4, 2) == pytest.approx(lt.forward_time(2, 1))


def test_a_missing_tp_degree_is_one_line_naming_file_field_and_fix(tmp_path):
    prof = round_profile("fp32")
    lt = replace(prof.layer_types["gpt"], forward_time_by_tp={1: (1e-3, 0.0), 2: (6e-4, 0.0)})
    path = tmp_path / "measured.json"
    replace(prof, layer_types={"gpt": lt}).save(path)
    loaded = ModelProfile.load(path).layer_types["gpt"]
    with pytest.raises(ProfileError) as err:
        loaded.forward_time(2, 4)
    message = str(err.value)
    assert "\n" not in message
    assert str(path) in message
    assert "layer_types.gpt.forward_time_by_tp" in message and "tp=4" in message
    assert "measured: 1, 2" in message
    assert "--tp-degrees 2 4" in message and "--tensor-model-parallel-size 2" in message


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_bad_replicated_fraction_names_the_field(tmp_path, value):
    data = round_profile("fp32").to_dict()
    data["layer_types"]["gpt"]["tp_replicated_fraction"] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"tp_replicated_fraction=.*must be a number in \[0, 1\]"):
        ModelProfile.load(path)


def test_evaluate_with_a_profile_lacking_the_plans_tp_exits_2_with_one_line(tmp_path, capsys):
    from megatron_auto.cli import main
    from megatron_auto.config import ModelConfig
    from megatron_auto.planner import TrainingSpec, analytic_profile
    from megatron_auto.planner.inputs.presets import get_cluster

    shape = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "128", "--vocab-size", "1024"]
    config = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128,
                         vocab_size=1024)
    cluster = get_cluster("a100-40g-1x8")
    prof = analytic_profile(model_spec(config), TrainingSpec(16, "fp32"), cluster)
    lt = prof.layer_types["gpt"]
    measured = replace(lt, forward_time_by_tp={t: lt.forward_time_by_tp[t] for t in (1, 2)})
    path = tmp_path / "two.json"
    replace(prof, layer_types={"gpt": measured}).save(path)
    code = main(["evaluate", *shape, "--cluster", "a100-40g-1x8", "--model-profile", str(path),
                 "--tensor-model-parallel-size", "4", "--global-batch-size", "16"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1
    assert f"--model-profile {path}" in err and "forward_time_by_tp has no tp=4" in err
