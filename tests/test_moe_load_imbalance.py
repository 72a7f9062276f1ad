"""The router's load imbalance, measured by the model profiler and used by the cost model
(issue 25): ``profiler/model_profiler.router_load_imbalance`` on the runtime's router, the
profile field ``moe_load_imbalance`` and its file round trip, its carrying onto derived MoE
layer types, and ``cost/moe.py`` pricing the busiest EP rank with it (1.2 without one)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_auto.config import ModelConfig
from megatron_auto.families.gpt.config import MoEConfig
from megatron_auto.families.registry import model_spec
from megatron_auto.layout import make_layout
from megatron_auto.plan import LayerStrategy
from megatron_auto.planner import TrainingSpec, analytic_profile
from megatron_auto.planner.cost import moe as cost_moe
from megatron_auto.planner.inputs.presets import make_cluster
from megatron_auto.planner.inputs.profile_records import ProfileError
from megatron_auto.planner.inputs.profiles import ModelProfile, with_analytic_layer_types
from megatron_auto.profiler import measure
from megatron_auto.profiler import model_profiler as mp

pytestmark = pytest.mark.single

E, K = 4, 2


def _config(freq=1, capacity=None) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                       seq_length=16, max_position_embeddings=16, vocab_size=128,
                       hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
                       moe=MoEConfig(num_experts=E, router_topk=K, ffn_hidden_size=48,
                                     layer_freq=freq, expert_capacity_factor=capacity))


def test_identical_tokens_all_go_to_the_same_experts():
    cfg = _config()
    groups = measure.tp1_groups(torch.device("cpu"))
    torch.manual_seed(0)
    same = torch.randn(1, 1, cfg.hidden_size).expand(3, cfg.seq_length, -1)
    # every token picks the same K experts: those hold all T assignments each, the mean is
    # T K / E, so the busiest over the mean is E / K
    assert mp.router_load_imbalance(cfg, groups, same) == pytest.approx(E / K)
    varied = mp.router_load_imbalance(cfg, groups, torch.randn(3, cfg.seq_length,
                                                               cfg.hidden_size))
    assert 1.0 <= varied < E / K


def test_the_profiler_records_it_and_the_file_keeps_it(tmp_path):
    torch.set_num_threads(1)
    quick = measure.ModelProfilerConfig(batch_sizes=(2, 3), warmup_iters=0, iters=1)
    cfg = _config()
    profile = mp.profile_model(cfg, "fp32", "cpu", config=quick)
    measured = profile.layer_types[cfg.model_type].moe_load_imbalance
    assert 1.0 <= measured <= E / K
    path = tmp_path / "profile.json"
    profile.save(path)
    assert ModelProfile.load(path).layer_types[cfg.model_type].moe_load_imbalance == measured
    # a dense profile has none, and its file does not mention it
    dense = dataclasses.replace(profile.layer_types[cfg.model_type], moe_load_imbalance=0.0)
    plain = dataclasses.replace(profile, layer_types={cfg.model_type: dense})
    assert "moe_load_imbalance" not in plain.to_dict()["layer_types"][cfg.model_type]


def test_a_derived_moe_layer_type_takes_the_measured_imbalance():
    spec = model_spec(_config(freq=(0, 1)))
    training = TrainingSpec(8, "fp32")
    cluster = make_cluster("a100-40g", 1, 2)
    full = analytic_profile(spec, training, cluster)
    assert full.layer_types["gpt_moe"].moe_load_imbalance == 0.0  # analytic: not measured
    dense = dataclasses.replace(full.layer_types["gpt"], moe_load_imbalance=1.7)
    measured = dataclasses.replace(full, source="measured", layer_types={"gpt": dense})
    done = with_analytic_layer_types(measured, spec, training, cluster)
    assert done.layer_types["gpt_moe"].moe_load_imbalance == 1.7


def _compute(ep: int, imbalance: float, capacity=None) -> float:
    spec = model_spec(_config(capacity=capacity))
    lt = spec.layer_types[0]
    cluster = make_cluster("a100-40g", 1, 4)
    profile = dataclasses.replace(
        analytic_profile(spec, TrainingSpec(8, "fp32"), cluster).layer_types[lt.name],
        moe_load_imbalance=imbalance)
    terms = cost_moe.expert_costs(profile, lt, cluster, LayerStrategy(ep=ep),
                                  make_layout(1, True, 4), 4, 2.0, "fp32")
    return terms.time.compute


def test_the_cost_model_prices_the_busiest_rank_at_the_measured_load():
    moe = model_spec(_config()).layer_types[0].moe
    assert cost_moe.load_factors(moe, 2, 1.7) == (1.0, 1.7)
    assert cost_moe.load_factors(moe, 2) == (1.0, cost_moe.LOAD_IMBALANCE)  # not measured
    assert cost_moe.load_factors(moe, 1, 1.7) == (1.0, 1.0)  # ep 1: a rank's own tokens
    low, default, high = (_compute(2, x) for x in (1.05, 0.0, 1.9))
    assert low < default < high
    assert _compute(1, 1.9) == _compute(1, 0.0)
    # a capacity factor still caps it
    assert _compute(2, 1.9, capacity=1.0) == _compute(2, 1.05, capacity=1.0)


def test_an_imbalance_below_one_is_refused_naming_the_field():
    spec = model_spec(_config())
    lt = analytic_profile(spec, TrainingSpec(8, "fp32"),
                          make_cluster("a100-40g", 1, 2)).layer_types["gpt_moe"]
    with pytest.raises(ProfileError) as err:
        dataclasses.replace(lt, moe_load_imbalance=0.5)
    message = str(err.value)
    assert "moe_load_imbalance=0.5" in message and "at least 1" in message
    assert "\n" not in message
