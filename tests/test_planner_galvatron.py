"""Galvatron 2.4 import: known values from the shipped files, plan conversion, clear errors."""

import json
import os
from pathlib import Path

import pytest

from megatron_auto.planner.interop.galvatron import (cluster_from_galvatron,
                                                     model_profile_from_galvatron,
                                                     plan_from_galvatron_config)
from megatron_auto.planner.interop.galvatron_files import GalvatronFormatError, read_computation
from megatron_auto.planner.interop.galvatron_memory import read_memory
from megatron_auto.planner.inputs.hardware import GB
from megatron_auto.planner.inputs.model_spec import ModelSpec, TrainingSpec
from megatron_auto.planner.inputs.presets import get_cluster

# Galvatron 2.4's shipped profile and plan files, copied into the repository (source and
# license: tests/data/galvatron/README.md).
PROFILES = Path(__file__).resolve().parent / "data" / "galvatron"

MB = 2**20
BERT_COMP = "computation_profiling_bf16_hidden1024_head16.json"
BERT_MEM = "memory_profiling_bf16_hidden1024_head16.json"
GPT_COMP = "computation_profiling_bf16_hidden1600_head32_seqlen1024.json"
GPT_MEM = "memory_profiling_bf16_hidden1600_head32_seqlen1024.json"
BERT_PLAN = "galvatron_config_hidden1024_head16_1nodes_8gpus_per_node_23GB_bf16_bsz128_[tpconsec_off].json"
GPT_PLAN = "galvatron_config_gpt-1.5b_2nodes_8gpus_per_node_40GB_bf16_example.json"


def bert(seq=512):
    return ModelSpec.uniform(24, 1024, 16, seq, 30592, causal=False, name="bert")


def gpt():
    return ModelSpec.uniform(48, 1600, 32, 1024, 50304, name="gpt")


@pytest.mark.single
def test_hardware_files_give_the_measured_numbers():
    c = cluster_from_galvatron(PROFILES / "allreduce_bandwidth_1nodes_8gpus_per_node.json",
                               PROFILES / "p2p_bandwidth_1nodes_8gpus_per_node.json",
                               PROFILES / "overlap_coefficient.json",
                               PROFILES / "sp_time_1nodes_8gpus_per_node.json")
    assert (c.num_nodes, c.devices_per_node) == (1, 8)  # from the file name
    assert c.allreduce_busbw(8) == pytest.approx(154.203 * GB)
    assert c.allreduce_busbw(4, consecutive=False) == pytest.approx(155.815 * GB)
    assert c.p2p_bandwidth(8) == pytest.approx(109.45 * GB)
    assert c.overlap_slowdown == pytest.approx(1.1256, abs=1e-4)
    # Latency from the sp_time fit lies between 0 and the 1 MB all-reduce time (0.079 ms).
    assert 0 < c.collective_latency_s <= 0.07895e-3
    # All-reduce of 1 GB over 8 ranks by hand: 2*7/8 * 1e9 / 154.203e9 + latency.
    assert c.allreduce_time(1e9, 8) == pytest.approx(1.75e9 / 154.203e9 + c.collective_latency_s)
    # sp_time is optional (Galvatron 2.4 crashes without it; we do not).
    plain = cluster_from_galvatron(PROFILES / "allreduce_bandwidth_1nodes_8gpus_per_node.json")
    assert plain.allreduce_busbw(2) == pytest.approx(138.156 * GB)


@pytest.mark.single
def test_computation_and_memory_files_both_layouts():
    comp = read_computation(PROFILES / BERT_COMP)
    assert comp.layer_time(0, 512).per_sample_ms == pytest.approx(1.773727989196777)
    assert comp.other_time((1024,)).per_sample_ms == pytest.approx(3.173219156265258)
    old = read_computation(PROFILES / GPT_COMP)
    assert old.layer_time(0, 1024).per_sample_ms == pytest.approx(0.5981169303258261)
    # Embedding/head recovered from the raw totals as Galvatron does: (41.4843 - 12*0.59812*4)/4.
    assert old.other_time((1024,)).per_sample_ms == pytest.approx((41.484313583374025 - 12 * 0.5981169303258261 * 4) / 4)
    mem24 = read_memory(PROFILES / BERT_MEM)
    rec, seq = mem24.layer(0, 512)
    assert seq == 512 and rec.parameter_mb == pytest.approx(40.8896484375)
    assert rec.checkpoint_mb_per_sample == pytest.approx(1.25)
    assert mem24.sequence_parallel
    mem_old = read_memory(PROFILES / GPT_MEM)
    rec_old, _ = mem_old.layer(0, 1024)
    assert rec_old.activation_mb_per_sample[4] == pytest.approx(26.2032470703125)
    assert mem_old.other_record("pp_on_last", 1024).model_states_mb == {1: 1304.0}


@pytest.mark.single
def test_model_profile_units_by_hand():
    training = TrainingSpec(global_batch_size=64, precision="bf16")
    cluster = get_cluster("a100-40g-1x8")
    p = model_profile_from_galvatron(PROFILES / GPT_COMP, PROFILES / GPT_MEM, gpt(), training, cluster)
    layer = p.layer_types["gpt"]
    assert p.source == "galvatron"
    assert layer.forward_time_per_sample_s == pytest.approx(0.5981169303258261e-3)
    assert layer.parameter_count == round(119.087890625 * MB / 4)  # model states / 16 B
    assert layer.activation_bytes(2) == pytest.approx(36.988525390625 * MB)
    assert layer.recompute_bytes_per_sample == pytest.approx(3.619140625 * MB)
    # Embedding: first-stage model states 1277 MB at 16 B/param; tied head = last - first.
    assert p.embedding.embedding_parameters == round(1277 * MB / 16)
    assert p.embedding.head_parameters == round(1304 * MB / 16) - round(1277 * MB / 16)
    # 2.4 layout with sequence-parallel records: tp=1 value is kept exactly.
    b = model_profile_from_galvatron(PROFILES / BERT_COMP, PROFILES / BERT_MEM, bert(), training,
                                     cluster)
    assert b.layer_types["bert"].activation_bytes(1) == pytest.approx(36.85546875 * MB)
    assert b.layer_types["bert"].forward_time_per_sample_s == pytest.approx(1.773727989196777e-3)
    # Round trip through our own profile format.
    assert type(b).from_dict(b.to_dict()) == b


@pytest.mark.single
def test_profile_of_another_model_is_refused():
    other = ModelSpec.uniform(24, 2048, 16, 512, 30592, causal=False, name="bert")
    cluster = get_cluster("a100-40g-1x8")
    with pytest.raises(GalvatronFormatError, match="hidden=1024 but the model has --hidden-size=2048"):
        model_profile_from_galvatron(PROFILES / BERT_COMP, PROFILES / BERT_MEM, other,
                                     TrainingSpec(8), cluster)
    with pytest.raises(GalvatronFormatError, match="profiled in bf16 but the run trains in fp32"):
        model_profile_from_galvatron(PROFILES / BERT_COMP, PROFILES / BERT_MEM, bert(),
                                     TrainingSpec(8, precision="fp32"), cluster)
    with pytest.raises(GalvatronFormatError, match="seqlen=1024 but the model has --seq-length=2048"):
        model_profile_from_galvatron(PROFILES / GPT_COMP, PROFILES / GPT_MEM,
                                     ModelSpec.uniform(48, 1600, 32, 2048, 50304), TrainingSpec(8),
                                     cluster)
    # 2.4 layout: the computation file stops at 1024, so 4096 cannot be priced from it.
    with pytest.raises(GalvatronFormatError, match="profiled up to sequence length 1024 but the "
                                                   "model has --seq-length=4096"):
        model_profile_from_galvatron(PROFILES / BERT_COMP, PROFILES / BERT_MEM, bert(4096),
                                     TrainingSpec(8), cluster)
    # seq 768: the computation file has it; the memory file does not and its next longer
    # record (1024) is used, which over- rather than under-estimates.
    p768 = model_profile_from_galvatron(PROFILES / BERT_COMP, PROFILES / BERT_MEM, bert(768),
                                        TrainingSpec(8), cluster)
    assert p768.layer_types["bert"].forward_time_per_sample_s == pytest.approx(1.9231648445129386e-3)
    assert p768.layer_types["bert"].activation_bytes(1) == pytest.approx(110.56787109375 * MB)


@pytest.mark.single
def test_galvatron_plans_convert_with_per_layer_values():
    from megatron_auto.utils.flag_warnings import FlagWarning

    with pytest.warns(FlagWarning, match="chunks=3 does not split global_bsz=128 into equal "
                                         "micro-batches .*; using 4 micro-batches"):
        plan = plan_from_galvatron_config(PROFILES / BERT_PLAN)
    assert plan.world_size == 8 and plan.num_layers == 24
    assert all(layer.tp == 2 and layer.dp_mode == "zero2" and layer.tp_consecutive
               and not layer.recompute for layer in plan.layers)
    assert plan.vocab.tp == 2 and plan.pipeline.schedule == "1f1b"
    # chunks=3 cannot split 128 evenly: the next valid count is 4 (dp 4 divides 32).
    assert plan.num_microbatches == 4 and "chunks=3" in plan.search["notes"][-1]
    gpt_plan = plan_from_galvatron_config(PROFILES / GPT_PLAN)
    assert gpt_plan.world_size == 16 and gpt_plan.global_batch_size == 144
    assert gpt_plan.pipeline.layers_per_stage == (48,)


@pytest.mark.pure
def test_mixed_galvatron_plan_maps_each_field():
    config = {"pp_deg": 2, "tp_sizes_enc": "1,2,2,4", "tp_consecutive_flags": "1,0,1,1",
              "dp_types_enc": "1,0,0,1", "checkpoint": "1,1,0,0", "global_bsz": 16, "chunks": 2,
              "pp_division": "3,1", "pipeline_type": "gpipe", "default_dp_type": "ddp", "vtp": 4,
              "embed_sdp": 1}
    plan = plan_from_galvatron_config(config, world_size=8)
    assert [lyr.tp for lyr in plan.layers] == [1, 2, 2, 4]
    assert [lyr.dp_mode for lyr in plan.layers] == ["zero3", "ddp", "ddp", "zero3"]
    assert [lyr.tp_consecutive for lyr in plan.layers] == [True, False, True, True]
    assert [lyr.recompute for lyr in plan.layers] == [True, True, False, False]
    assert plan.pipeline.layers_per_stage == (3, 1) and plan.pipeline.schedule == "gpipe"
    assert plan.vocab.tp == 4 and plan.vocab.dp_mode == "zero3"
    assert plan.num_microbatches == 2


@pytest.mark.pure
@pytest.mark.parametrize("change, message", [
    ({"tp_sizes_enc": None}, "key 'tp_sizes_enc' is missing"),
    ({"checkpoint": "0,0"}, "key 'checkpoint' has 2 entries but tp_sizes_enc has 4"),
    ({"dp_types_enc": "0,2,0,0"}, "'dp_types_enc' entry 1 is 2"),
    ({"tp_sizes_enc": "1,x,1,1"}, "must be comma-separated integers"),
    ({"use_sp": "0,1,0,0"}, "Ulysses"),
    ({"pipeline_type": "zb"}, "'pipeline_type'='zb'"),
    ({"default_dp_type": "zero3"}, "'default_dp_type'='zero3'"),
    ({"colour": 1}, "unknown key(s) ['colour']"),
    ({"pp_division": "3,2"}, "layers_per_stage"),
])
def test_bad_galvatron_plans_name_file_and_key(tmp_path, change, message):
    config = {"pp_deg": 2, "tp_sizes_enc": "1,1,1,1", "tp_consecutive_flags": "1,1,1,1",
              "dp_types_enc": "0,0,0,0", "checkpoint": "0,0,0,0", "global_bsz": 8, "chunks": 1,
              "pp_division": "2,2", "pipeline_type": "pipedream_flush", "default_dp_type": "zero2"}
    for key, value in change.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path = tmp_path / "galvatron_config_x_1nodes_8gpus_per_node.json"
    path.write_text(json.dumps(config))
    with pytest.raises(GalvatronFormatError) as err:
        plan_from_galvatron_config(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


@pytest.mark.pure
def test_bad_profile_files_name_file_and_key(tmp_path):
    comp = tmp_path / "computation.json"
    comp.write_text(json.dumps({"layertype_0_bsz1_seq128": 1.0, "speed": 3}))
    with pytest.raises(GalvatronFormatError, match=r"unknown key 'speed'"):
        read_computation(comp)
    comp.write_text(json.dumps({"layertype_0_bsz1_seq128": "fast"}))
    with pytest.raises(GalvatronFormatError, match=r"'layertype_0_bsz1_seq128' has value 'fast'"):
        read_computation(comp)
    mem = tmp_path / "memory.json"
    mem.write_text(json.dumps({"1_1_8": {"layernum[1]_bsz8_rank0_ms": 1.0}}))
    with pytest.raises(GalvatronFormatError, match="no derived 'layertype_<i>' record"):
        read_memory(mem)
    mem.write_text(json.dumps({"layertype_0": {"parameter_size": 1.0,
                                               "tp_activation_per_bsz_dict": {"1": 2.0}}}))
    with pytest.raises(GalvatronFormatError, match="no 'checkpoint' entry"):
        read_memory(mem)
    bw = tmp_path / "allreduce_bandwidth_1nodes_8gpus_per_node.json"
    bw.write_text(json.dumps({"allreduce_size_8": 100}))
    with pytest.raises(GalvatronFormatError, match="allreduce_size_<g>_consec_<0|1>"):
        cluster_from_galvatron(bw)
    noshape = tmp_path / "bw.json"
    noshape.write_text(json.dumps({"allreduce_size_8_consec_1": 100}))
    with pytest.raises(GalvatronFormatError, match="pass --num-nodes and --devices-per-node"):
        cluster_from_galvatron(noshape)
    assert cluster_from_galvatron(noshape, num_nodes=1, devices_per_node=8).world_size == 8
    missing = tmp_path / "nope.json"
    with pytest.raises(GalvatronFormatError, match="cannot read the file"):
        read_memory(missing)
    assert not os.path.exists(missing)


@pytest.mark.pure
def test_plan_to_galvatron_config_round_trips():
    from megatron_auto.planner.interop.galvatron import plan_to_galvatron_config
    config = {"pp_deg": 2, "tp_sizes_enc": "1,2,2,4", "tp_consecutive_flags": "1,0,1,1",
              "dp_types_enc": "1,0,0,1", "use_sp": "0,0,0,0", "checkpoint": "1,1,0,0",
              "global_bsz": 16, "chunks": 2, "pp_division": "3,1", "pipeline_type": "gpipe",
              "default_dp_type": "ddp", "vtp": 4, "vsp": 0, "embed_sdp": 1}
    plan = plan_from_galvatron_config(config, world_size=8)
    back, reasons = plan_to_galvatron_config(plan)
    assert reasons == [] and back == config
    from dataclasses import replace
    from megatron_auto.plan import LayerStrategy
    mixed = replace(plan, layers=(LayerStrategy(dp_mode="ddp"), LayerStrategy(dp_mode="zero2"))
                    + plan.layers[2:])
    none, reasons = plan_to_galvatron_config(mixed)
    assert none is None and "both ddp and zero2" in reasons[0]
