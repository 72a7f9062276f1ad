"""The model profiler's single-module measurements (profiler/module_profiler.py) and how the
cost model reads them (planner/cost/recompute.py): fp32 on CPU; attention dropout on, so SDPA
runs its math kernel, which keeps the score matrices."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_auto.config import ModelConfig
from megatron_auto.planner.inputs.profile_records import ProfileError
from megatron_auto.planner.inputs.profiles import ModelProfile

pytestmark = pytest.mark.single

S, H, HEADS, F = 64, 32, 4, 128
CFG = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=F,
                  seq_length=S, max_position_embeddings=S, vocab_size=128,
                  hidden_dropout=0.0, attention_dropout=0.1)


@pytest.fixture(scope="module")
def profile() -> ModelProfile:
    from megatron_auto.profiler.measure import ModelProfilerConfig
    from megatron_auto.profiler.model_profiler import profile_model

    return profile_model(CFG, "fp32", "cpu", config=ModelProfilerConfig(iters=2, warmup_iters=1))


def test_modules_are_measured_within_physical_bounds(profile):
    lt = profile.layer_types["gpt"]
    saved = lt.module_saved_bytes
    assert set(saved) == set(lt.module_forward_time_s) == {"core_attn", "mlp", "norm"}
    assert lt.attention_backend == "math"
    # The math kernel keeps the (heads, s, s) fp32 probabilities at least; with dropout also
    # its mask and the dropped-out probabilities, at most 3 such matrices, plus a few (s, h)
    # tensors (the scaled queries); q, k, v are the module's inputs and are not counted.
    probs = 4 * HEADS * S * S
    assert probs <= saved["core_attn"] <= 3 * probs + 4 * 4 * S * H
    # GeLU MLP: fc1's output and the activation's output, (s, f) fp32 each; its input is not
    assert saved["mlp"] == pytest.approx(2 * 4 * S * F, rel=0.05)
    # norms keep their statistics only, far less than one (s, h) activation
    assert 0 < saved["norm"] < 4 * S * H
    # the quadratic part of what the core attention keeps: the probabilities, not the rest
    assert probs * 0.9 <= lt.attention_kept_quadratic_bytes <= saved["core_attn"] * 1.01


def test_core_attention_is_timed_at_several_lengths(profile):
    from megatron_auto.profiler.module_profiler import attention_lengths

    table = profile.layer_types["gpt"].attention_time_by_seq_length
    assert sorted(table) == list(attention_lengths(S)) == [16, 32, 64]
    assert all(t > 0 for t in table.values())
    assert table[64] > table[16]  # four times the length: 16 times the scores


def test_measured_modules_survive_the_profile_file_and_old_files_load(profile, tmp_path):
    path = tmp_path / "p.json"
    profile.save(path)
    again = ModelProfile.load(path).layer_types["gpt"]
    lt = profile.layer_types["gpt"]
    assert again.module_saved_bytes == lt.module_saved_bytes
    assert again.module_forward_time_s == lt.module_forward_time_s
    old = profile.to_dict()
    for name in ("module_saved_bytes", "module_forward_time_s"):
        del old["layer_types"]["gpt"][name]
    assert ModelProfile.from_dict(old).layer_types["gpt"].module_saved_bytes == {}
    bad = profile.to_dict()
    bad["layer_types"]["gpt"]["module_saved_bytes"] = {"attention": 1.0}
    with pytest.raises(ProfileError, match="module_saved_bytes.*'attention'.*core_attn"):
        ModelProfile.from_dict(bad)


def test_the_cost_model_prices_recompute_from_the_measured_modules(profile):
    from megatron_auto.families.registry import model_spec
    from megatron_auto.planner.cost.recompute import module_terms

    lt = profile.layer_types["gpt"]
    layer_type = model_spec(CFG).layer_types[0]
    for module, tp in (("mlp", 1), ("mlp", 2), ("core_attn", 2)):
        terms = module_terms(lt, layer_type, {module}, tp, 3.0, 4, 1)
        assert terms.released_bytes == pytest.approx(lt.module_saved_bytes[module] * 3 / tp)
    mlp = module_terms(lt, layer_type, {"mlp"}, 2, 3.0, 4, 1)
    assert mlp.forward_time_s == pytest.approx(lt.module_forward_time_s["mlp"] * 3 / 2)
    # without the measurement the analytic term is used: a different number for the MLP
    analytic = dataclasses.replace(lt, module_saved_bytes={}, module_forward_time_s={})
    doubled = dataclasses.replace(lt, module_saved_bytes={**lt.module_saved_bytes,
                                                          "mlp": 2 * lt.module_saved_bytes["mlp"]})
    assert module_terms(doubled, layer_type, {"mlp"}, 1, 1.0, 4, 1).released_bytes == \
        pytest.approx(2 * module_terms(lt, layer_type, {"mlp"}, 1, 1.0, 4, 1).released_bytes)
    assert module_terms(analytic, layer_type, {"norm"}, 1, 1.0, 4, 1).released_bytes == 0
    assert module_terms(lt, layer_type, {"norm"}, 1, 1.0, 4, 1).released_bytes == \
        pytest.approx(lt.module_saved_bytes["norm"])
