"""Galvatron 3 (its main branch) files: a shipped LLaMA-3-8B memory profile with its
``model_config`` block and sequence-parallel records only, a shipped Mixtral per-module time
profile (refused), and plans with Galvatron 3's context- and expert-parallel fields.

The shipped files' source and licence: tests/data/galvatron/README.md. The plans are written
here from the keys Galvatron 3's runtime reads (``cp_sizes_enc``, ``ep_sizes_enc``,
``tp_of_ep_sizes_enc``, ``dispatcher`` beside 2.4's).
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_auto.planner.inputs.model_spec import ModelSpec, TrainingSpec
from megatron_auto.planner.inputs.presets import get_cluster
from megatron_auto.planner.interop.galvatron import (model_profile_from_galvatron,
                                                     plan_from_galvatron_config,
                                                     plan_to_galvatron_config)
from megatron_auto.planner.interop.galvatron_files import GalvatronFormatError, read_computation
from megatron_auto.planner.interop.galvatron_memory import read_memory

pytestmark = pytest.mark.single

DATA = Path(__file__).resolve().parent / "data" / "galvatron"
LLAMA3_MEM = DATA / "memory_profiling_bf16_llama3-8b.json"
MIXTRAL_COMP = DATA / "computation_profiling_bf16_mixtral-8x7b.json"
MB = 2**20


def llama3_8b(seq: int = 8192, hidden: int = 4096) -> ModelSpec:
    spec = ModelSpec.uniform(32, hidden, 32, seq, 128256, ffn_hidden_size=14336, name="llama3")
    lt = replace(spec.layer_types[0], activation="swiglu", num_query_groups=8,
                 add_bias_linear=False, normalization="rmsnorm")
    return replace(spec, layer_types=(lt,), tied_embeddings=False, num_position_embeddings=0)


def _computation(tmp_path: Path) -> Path:
    """A time profile at the memory profile's length, in the layout Galvatron 3 still writes
    (``layertype_<i>_bsz<b>_seq<s>``, ``layertype_other_bsz<b>_seq<s>``): 10 ms + 2 ms/sample
    per layer, embedding and head 3 ms/sample."""
    data = {}
    for b in (1, 2, 4):
        data[f"layertype_0_bsz{b}_seq8192"] = (10.0 * b + 2.0) / b
        data[f"layertype_other_bsz{b}_seq8192"] = 3.0
    path = tmp_path / "computation_profiling_bf16_llama3-8b.json"
    path.write_text(json.dumps(data))
    return path


def test_llama3_memory_profile_with_model_config_and_sp_records_only(tmp_path):
    mem = read_memory(LLAMA3_MEM)
    assert mem.model_config["dim"] == 4096 and mem.sequence_parallel  # only *_sp records
    rec, seq = mem.layer(0, 8192)
    assert (rec.parameter_mb, seq) == (832.2509765625, 8192)
    profile = model_profile_from_galvatron(_computation(tmp_path), LLAMA3_MEM, llama3_8b(),
                                           TrainingSpec(global_batch_size=64, precision="bf16"),
                                           get_cluster("h100-80g-1x8"))
    layer = profile.layer_types["llama3"]
    # parameter_size is model states / 4 in MB: 832.25 MB * 2**20 / 4 parameters
    assert layer.parameter_count == round(832.2509765625 * MB / 4)
    assert layer.parameter_count == pytest.approx(218.2e6, rel=1e-3)  # LLaMA-3-8B's layer
    assert layer.recompute_bytes_per_sample == 64.0 * MB
    assert layer.forward_time_per_sample_s == pytest.approx(0.010)
    assert layer.forward_time_constant_s == pytest.approx(0.002)
    # the SP records price sequence-parallel layers at every measured degree
    assert layer.activation_bytes_by_tp_sp[8] == pytest.approx(184.6407470703125 * MB)


def test_model_config_that_disagrees_names_the_field(tmp_path):
    comp = _computation(tmp_path)
    with pytest.raises(GalvatronFormatError) as err:
        model_profile_from_galvatron(comp, LLAMA3_MEM, llama3_8b(hidden=5120),
                                     TrainingSpec(global_batch_size=64, precision="bf16"), get_cluster("h100-80g-1x8"))
    assert str(err.value) == (
        f"memory profile {LLAMA3_MEM}: model_config.dim=4096 but the model has "
        f"--hidden-size=5120; give the profile of this model or profile it with Galvatron")
    assert "\n" not in str(err.value)


def test_mixtral_per_module_time_profile_is_refused_in_one_line():
    with pytest.raises(GalvatronFormatError) as err:
        read_computation(MIXTRAL_COMP)
    msg = str(err.value)
    assert "key 'layernum[2]_bsz1_seq4096_attention' times the attention module alone" in msg
    assert msg.endswith("megatron_auto prices whole layers: profile with --profile_unit all")
    assert "\n" not in msg


def _v3_plan(**overrides) -> dict:
    ones, zeros = "1,1,1,1", "0,0,0,0"
    plan = {"pp_deg": 1, "tp_sizes_enc": ones, "tp_consecutive_flags": ones,
            "cp_sizes_enc": ones, "dp_types_enc": zeros, "use_sp": zeros, "checkpoint": zeros,
            "global_bsz": 16, "chunks": 2, "pp_division": "4", "pipeline_type": "pipedream_flush",
            "default_dp_type": "zero2", "vtp": 1, "vsp": 0}
    plan.update(overrides)
    return plan


def test_context_parallel_plan_round_trips():
    plan = plan_from_galvatron_config(_v3_plan(cp_sizes_enc="2,2,2,2",
                                               tp_sizes_enc="2,2,2,2"), 8)
    assert [(la.tp, la.cp, la.cp_mode) for la in plan.layers] == [(2, 2, "ring")] * 4
    assert plan.layers[0].dp_mode == "zero2"
    back, reasons = plan_to_galvatron_config(plan)
    assert reasons == []
    assert (back["cp_sizes_enc"], back["tp_sizes_enc"]) == ("2,2,2,2", "2,2,2,2")
    assert plan_from_galvatron_config(back, 8) == plan
    # a plan without CP keeps writing 2.4's keys only
    plain, _ = plan_to_galvatron_config(plan_from_galvatron_config(_v3_plan(), 8))
    assert "cp_sizes_enc" not in plain and "ep_sizes_enc" not in plain


def test_expert_parallel_plan_round_trips():
    plan = plan_from_galvatron_config(_v3_plan(ep_sizes_enc="4,4,2,2",
                                               tp_of_ep_sizes_enc="1,1,1,1",
                                               dispatcher="alltoall"), 8)
    assert [(la.ep, la.expert_tp) for la in plan.layers] == [(4, 1), (4, 1), (2, 1), (2, 1)]
    assert any("dispatcher alltoall" in n for n in plan.search["notes"])
    back, reasons = plan_to_galvatron_config(plan)
    assert reasons == [] and back["ep_sizes_enc"] == "4,4,2,2"
    assert plan_from_galvatron_config(back, 8).layers == plan.layers


@pytest.mark.parametrize("overrides, message", [
    ({"cp_sizes_enc": "2,2,1,1"},
     "key 'cp_sizes_enc' gives the layers different context-parallel degrees [1, 2]; "
     "megatron_auto runs one CP degree for the whole plan: search again with one cp size"),
    ({"cp_sizes_enc": "0,0,0,0"}, "key 'cp_sizes_enc' has 0; a context-parallel degree is at "
                                  "least 1"),
    ({"ep_sizes_enc": "2,2,2"}, "key 'ep_sizes_enc' has 3 entries but tp_sizes_enc has 4"),
    ({"ep_sizes_enc": "2,2,2,2", "dispatcher": "flex"},
     "key 'dispatcher'='flex' is not one of alltoall, allgather"),
    ({"use_sp": "1,1,1,1"}, "key 'use_sp' enables Ulysses sequence parallelism"),
    ({"checkpoint": "2,2,2,2"}, "key 'checkpoint' entry 0 is 2; use 0 or 1"),
])
def test_what_we_do_not_model_is_one_line(overrides, message):
    with pytest.raises(GalvatronFormatError) as err:
        plan_from_galvatron_config(_v3_plan(**overrides), 8)
    assert message in str(err.value) and "\n" not in str(err.value)
