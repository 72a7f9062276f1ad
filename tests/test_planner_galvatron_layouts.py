"""Galvatron 2.4 interop for every layout it ships, on files built here from the format.

Time profiles in batch mode (with and without the length in the key) and sequence mode;
multi-type models (T5 encoder/decoder, Swin's four stages) with ``layernum[a,b]`` raw totals and
``seq[s1,s2,...]`` keys; ViT's single type nested by length; memory records flat or nested,
plain and Megatron sequence-parallel (``*_sp``), with raw checkpointing (``_c``) and vocab-TP
(``_vtp``) runs. The numbers are chosen so the expected profile can be written down by hand.
"""

import json

import pytest

from megatron_auto.cli import main
from megatron_auto.planner.interop.galvatron import (model_profile_from_galvatron,
                                                     plan_from_galvatron_config)
from megatron_auto.planner.interop.galvatron_files import GalvatronFormatError, read_computation
from megatron_auto.planner.interop.galvatron_memory import read_memory
from megatron_auto.planner.inputs.model_spec import LayerType, ModelSpec, TrainingSpec
from megatron_auto.planner.inputs.presets import get_cluster
from megatron_auto.planner.inputs.profiles import ModelProfile
from megatron_auto.planner.search.driver import evaluate

pytestmark = pytest.mark.pure

MB = 2**20
CLUSTER = get_cluster("a100-40g-1x8")
BF16 = TrainingSpec(global_batch_size=64, precision="bf16")


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def param_mb(lt: LayerType, scale: float = 1.0) -> float:
    """Galvatron's parameter_size of a layer with ``scale`` x the model's parameters (MB of
    parameters at 4 B; model states are 4x that)."""
    return lt.num_parameters * scale * 4 / MB


def layer_rec(lt, acts, ckpt, scale=1.0):
    return {"parameter_size": param_mb(lt, scale),
            "tp_activation_per_bsz_dict": {**{str(t): v for t, v in acts.items()},
                                           "checkpoint": ckpt}}


def other_rec(ms, act):
    return {"model_states": {str(t): v for t, v in ms.items()},
            "activation": {str(t): v for t, v in act.items()}}


def raw_run(counts, bsz, seq, ranks=(0, 7)):
    key = f"layernum[{','.join(map(str, counts))}]_bsz{bsz}_seq{seq}"
    return {f"{key}_rank{r}_{k}": 100.0 for r in ranks for k in ("ms", "act", "act_peak")}


# ------------------------------------------------------------------ LLaMA: batch mode, flat
LLAMA = ModelSpec.uniform(4, 512, 8, 256, 1024, name="llama", activation="swiglu",
                          ffn_hidden_size=1408, num_position_embeddings=0)


def llama_files(tmp_path, *, with_sp=True):
    """Batch-mode time keys without the length (``layertype_0_bsz<b>``), the older one-value
    ``layertype_0`` beside them, flat memory records, plain and ``_sp``."""
    alpha, beta = 0.75, 1.5  # ms per sample, ms per call: per-sample time = alpha + beta / b
    o_alpha, o_beta = 0.5, 2.0
    comp = {"layertype_0": 9.99, "layernum[2]_bsz2": 40.0, "layernum[4]_bsz2": 70.0}
    for b in range(1, 9):
        comp[f"layertype_0_bsz{b}"] = alpha + beta / b
        comp[f"layertype_other_0_bsz{b}"] = o_alpha + o_beta / b
    lt = LLAMA.layer_types[0]
    mem = {"1_1_8": raw_run([1], 8, 256), "1_2_4_c": raw_run([1], 8, 256),
           "layertype_0": layer_rec(lt, {1: 40.0, 2: 26.0, 4: 19.0, 8: 15.5}, 2.0),
           "other_memory_pp_off": {"model_states": 200.0, "activation": 30.0},
           "other_memory_pp_on_first": {"model_states": 96.0, "activation": 3.0},
           "other_memory_pp_on_last": {"model_states": 112.0, "activation": 20.0}}
    if with_sp:
        mem.update({"1_2_4_vtp_sp": raw_run([1], 8, 256),
                    "layertype_0_sp": layer_rec(lt, {1: 40.0, 2: 20.0, 4: 10.0, 8: 5.0}, 2.5),
                    "other_memory_pp_off_sp": other_rec({1: 200.0, 2: 100.0}, {1: 30.0, 2: 15.0}),
                    "other_memory_pp_on_first_sp": other_rec({1: 96.0, 2: 48.0}, {1: 3.0, 2: 1.5}),
                    "other_memory_pp_on_last_sp": other_rec({1: 112.0, 2: 56.0},
                                                            {1: 20.0, 2: 10.0})})
    name = "bf16_hidden512_head8_seqlen256.json"
    return (write(tmp_path, "computation_profiling_" + name, comp),
            write(tmp_path, "memory_profiling_" + name, mem), (alpha, beta, o_alpha, o_beta))


def test_batch_mode_without_length_fits_per_sample_time_and_per_call_constant(tmp_path):
    comp, mem, (alpha, beta, o_alpha, o_beta) = llama_files(tmp_path)
    p = model_profile_from_galvatron(comp, mem, LLAMA, BF16, CLUSTER)
    layer = p.layer_types["llama"]
    # The per-call totals ms*b = alpha*b + beta lie on a line: the fit recovers both exactly
    # (the bare layertype_0 = 9.99 is the older record and is not used).
    assert layer.forward_time_per_sample_s == pytest.approx(alpha / 1000)
    assert layer.forward_time_constant_s == pytest.approx(beta / 1000)
    assert layer.forward_time(4, 1) == pytest.approx((alpha * 4 + beta) / 1000)
    # Embedding + head: split evenly, each with half the constant.
    assert p.embedding.embedding_forward_time_per_sample_s == pytest.approx(o_alpha / 2000)
    assert p.embedding.forward_time_constant_s == pytest.approx(o_beta / 2000)
    assert any("linear fit over bsz1..8" in n for n in p.metadata["notes"])
    # The plain records are priced (tp 1, 2, 4, 8 as measured) ...
    assert layer.activation_bytes(2) == pytest.approx(26.0 * MB)
    assert layer.recompute_bytes_per_sample == pytest.approx(2.0 * MB)
    # ... and the Megatron-SP ones are kept, in bytes (the layer's also price our SP layers).
    sp = p.metadata["megatron_sp"]
    assert sp["layer_types"]["llama"]["activation_bytes_per_sample_by_tp"] == {
        "1": 40.0 * MB, "2": 20.0 * MB, "4": 10.0 * MB, "8": 5.0 * MB}
    assert sp["layer_types"]["llama"]["recompute_bytes_per_sample"] == 2.5 * MB
    assert sp["embedding_head"]["pp_on_last"]["model_state_bytes_by_vocab_tp"] == {
        "1": 112.0 * MB, "2": 56.0 * MB}
    # Saved and loaded, the profile (SP records included) is the same.
    path = tmp_path / "profile.json"
    p.save(path)
    assert ModelProfile.load(path) == p


def test_flat_memory_without_sp_records_has_no_sp_metadata(tmp_path):
    comp, mem, _ = llama_files(tmp_path, with_sp=False)
    p = model_profile_from_galvatron(comp, mem, LLAMA, BF16, CLUSTER)
    assert "megatron_sp" not in p.metadata
    # Embedding: first-stage model states 96 MB at 16 B/param; untied head = last stage's.
    assert p.embedding.embedding_parameters == round(96 * MB / 16)


# --------------------------------------------------------- BERT-like: sequence mode, nested
BERT = ModelSpec.uniform(4, 256, 4, 512, 1024, causal=False, name="bert")


def bert_files(tmp_path):
    comp, mem_layer, mem_other = {}, {}, {}
    lt = BERT.layer_types[0]
    for s in (128, 256, 512, 1024):
        comp[f"layernum[1]_bsz1_seq{s}"] = 5.0
        comp[f"layernum[2]_bsz1_seq{s}"] = 5.0 + s / 512
        comp[f"layertype_0_bsz1_seq{s}"] = s / 512
        comp[f"layertype_other_0_bsz1_seq{s}"] = 3.0 + s / 1024
        mem_layer[str(s)] = layer_rec(lt, {1: s / 64, 2: s / 128, 4: s / 256}, s / 2048)
        mem_other[str(s)] = other_rec({1: 60.0, 2: 30.0}, {1: s / 100, 2: s / 200})
    mem = {"1_1_8_sp": raw_run([1], 8, 128), "1_1_8_c_sp": raw_run([2], 8, 128),
           "layertype_0_sp": mem_layer, "other_memory_pp_off_sp": mem_other,
           "other_memory_pp_on_first_sp": mem_other, "other_memory_pp_on_last_sp": mem_other}
    return (write(tmp_path, "computation_profiling_bf16_hidden256_head4.json", comp),
            write(tmp_path, "memory_profiling_bf16_hidden256_head4.json", mem))


def test_sequence_mode_picks_the_length_or_the_next_longer_and_refuses_beyond(tmp_path):
    comp, mem = bert_files(tmp_path)
    p = model_profile_from_galvatron(comp, mem, BERT, BF16, CLUSTER)
    assert p.layer_types["bert"].forward_time_per_sample_s == pytest.approx(1e-3)  # 512/512 ms
    assert p.layer_types["bert"].forward_time_constant_s == 0.0  # one batch size: no constant
    assert p.embedding.head_forward_time_per_sample_s == pytest.approx(3.5 / 2000)
    # Only SP records: priced from tp 1 (8 MB at 512), split by the analytic ratio.
    assert p.layer_types["bert"].activation_bytes(1) == pytest.approx(8.0 * MB)
    assert p.metadata["megatron_sp"]["layer_types"]["bert"]["seq_length"] == 512
    # 384 is not profiled: the next longer (512) is used, never a shorter one.
    p384 = model_profile_from_galvatron(comp, mem, ModelSpec.uniform(
        4, 256, 4, 384, 1024, causal=False, name="bert"), BF16, CLUSTER)
    assert p384.layer_types["bert"].forward_time_per_sample_s == pytest.approx(1e-3)
    with pytest.raises(GalvatronFormatError, match="profiled up to sequence length 1024 but the "
                                                   "model has --seq-length=2048"):
        model_profile_from_galvatron(comp, mem, ModelSpec.uniform(
            4, 256, 4, 2048, 1024, causal=False, name="bert"), BF16, CLUSTER)


# ---------------------------------------------------------- T5: two types, layernum[a,b]
ENC = LayerType("encoder", 512, 8, 2048, 256, 3, causal=False)
DEC = LayerType("decoder", 512, 8, 2048, 256, 3)
T5 = ModelSpec.stacked([(ENC, 3), (DEC, 3)], vocab_size=1024, embedding_hidden_size=512,
                       seq_length=256, name="t5")


def t5_files(tmp_path):
    comp = {}
    for b in (1, 2, 4, 8):
        for counts in ((2, 2), (4, 2), (2, 4)):
            comp[f"layernum[{counts[0]},{counts[1]}]_bsz{b}_seq[256,256]"] = 10.0 + b
        comp[f"layertype_0_bsz{b}_seq256"] = 0.3 + 0.8 / b
        comp[f"layertype_1_bsz{b}_seq256"] = 0.4 + 1.6 / b
        comp[f"layertype_other_bsz{b}_seq[256,256]"] = 1.0
    sp_other = other_rec({1: 80.0, 2: 40.0, 4: 20.0, 8: 10.0}, {1: 4.0, 2: 2.0, 4: 1.0, 8: 0.5})
    mem = {"1_1_8_sp": raw_run([1, 1], 8, "[256,256]"), "2_1_4_sp": raw_run([2, 2], 8, "[256,256]"),
           "1_1_8_c_sp": raw_run([2, 1], 8, "[256,256]"),
           "layertype_0_sp": {"256": layer_rec(ENC, {1: 12.0, 2: 6.0, 4: 3.0, 8: 1.5}, 1.0)},
           "layertype_1_sp": {"256": layer_rec(DEC, {1: 16.0, 2: 8.0, 4: 4.0, 8: 2.0}, 1.0,
                                               scale=1.3)},  # cross-attention: more weights
           "other_memory_pp_off_sp": {"[256,256]": sp_other},
           "other_memory_pp_on_first_sp": {"[256,256]": sp_other},
           "other_memory_pp_on_last_sp": {"[256,256]": sp_other}}
    return (write(tmp_path, "computation_profiling_bf16_t5-small.json", comp),
            write(tmp_path, "memory_profiling_bf16_t5-small.json", mem))


def test_t5_encoder_and_decoder_each_get_their_own_costs(tmp_path):
    comp, mem = t5_files(tmp_path)
    p = model_profile_from_galvatron(comp, mem, T5, BF16, CLUSTER)
    enc, dec = p.layer_types["encoder"], p.layer_types["decoder"]
    assert (enc.forward_time_per_sample_s, enc.forward_time_constant_s) == \
        (pytest.approx(0.3e-3), pytest.approx(0.8e-3))
    assert (dec.forward_time_per_sample_s, dec.forward_time_constant_s) == \
        (pytest.approx(0.4e-3), pytest.approx(1.6e-3))
    assert dec.parameter_count == round(param_mb(DEC, 1.3) * MB / 4)
    assert enc.activation_bytes(1) == pytest.approx(12.0 * MB)
    assert dec.activation_bytes(1) == pytest.approx(16.0 * MB)
    assert set(p.metadata["megatron_sp"]["layer_types"]) == {"encoder", "decoder"}
    # The Galvatron plan of this model prices under our cost model, layer by layer.
    config = {"pp_deg": 2, "tp_sizes_enc": "1,1,1,2,2,2", "tp_consecutive_flags": "1,1,1,1,1,1",
              "dp_types_enc": "0,0,0,0,0,0", "checkpoint": "0,0,0,1,1,1", "global_bsz": 64,
              "chunks": 4, "pp_division": "3,3", "pipeline_type": "pipedream_flush",
              "default_dp_type": "zero2", "vtp": 1, "vsp": 0, "embed_sdp": 0}
    est = evaluate(plan_from_galvatron_config(config, world_size=8), T5, BF16, CLUSTER, p)
    assert est.samples_per_s > 0 and len(est.stages) == 2


# ---------------------------------------------------------- Swin: four types, plain records
SWIN_TYPES = [LayerType(f"stage{k}", h, a, 4 * h, s, n, causal=False)
              for k, (h, a, s, n) in enumerate([(128, 4, 3136, 2), (256, 8, 784, 2),
                                                (512, 16, 196, 4), (1024, 32, 49, 2)])]
SWIN = ModelSpec.stacked([(lt, lt.count) for lt in SWIN_TYPES], vocab_size=1000,
                         embedding_hidden_size=128, seq_length=3136, name="swin")
SEQS = "[3136,784,196,49]"


def swin_files(tmp_path):
    comp = {f"layernum[2,2,4,2]_bsz12_seq{SEQS}": 90.0,
            f"layernum[4,2,4,2]_bsz12_seq{SEQS}": 120.0,
            **{f"layertype_{k}_bsz12_seq{lt.seq_length}": 0.2 + 0.01 * k
               for k, lt in enumerate(SWIN_TYPES)},
            f"layertype_other_bsz12_seq{SEQS}": 0.5}
    mem = {f"{run}": raw_run([2, 2, 2, 2], 8, SEQS) for run in ("1_1_8", "1_2_4_vtp", "1_1_8_c",
                                                                 "2_2_2_vtp")}
    for k, lt in enumerate(SWIN_TYPES):
        mem[f"layertype_{k}"] = {str(lt.seq_length): layer_rec(
            lt, {1: 30.0 / (k + 1), 2: 18.0 / (k + 1), 4: 12.0 / (k + 1), 8: 9.0 / (k + 1)},
            1.5 / (k + 1))}
    for pos, ms in (("pp_off", 400.0), ("pp_on_first", 48.0), ("pp_on_last", 256.0)):
        mem[f"other_memory_{pos}"] = {SEQS: other_rec({1: ms, 2: ms / 2, 4: ms / 4},
                                                      {1: 8.0, 2: 4.0, 4: 2.0})}
    return (write(tmp_path, "computation_profiling_bf16_swin-tiny.json", comp),
            write(tmp_path, "memory_profiling_bf16_swin-tiny.json", mem))


def test_swin_stages_use_their_own_length_and_records(tmp_path):
    comp, mem = swin_files(tmp_path)
    c = read_computation(comp)
    assert c.other_time((3136, 784, 196, 49)).per_sample_ms == 0.5
    p = model_profile_from_galvatron(comp, mem, SWIN, BF16, CLUSTER)
    for k, lt in enumerate(SWIN_TYPES):
        prof = p.layer_types[lt.name]
        assert prof.forward_time_per_sample_s == pytest.approx((0.2 + 0.01 * k) / 1000)
        assert prof.activation_bytes(4) == pytest.approx(12.0 / (k + 1) * MB)  # measured tp 4
        assert prof.recompute_bytes_per_sample == pytest.approx(1.5 / (k + 1) * MB)
    assert p.embedding.embedding_parameters == round(48.0 * MB / 16)
    assert p.embedding.embedding_activation_bytes == pytest.approx(8.0 * MB)
    assert p.embedding.head_forward_time_per_sample_s == pytest.approx(0.25e-3)
    assert "megatron_sp" not in p.metadata


def test_swin_profile_for_a_single_type_model_is_refused(tmp_path):
    comp, mem = swin_files(tmp_path)
    one = ModelSpec.uniform(10, 128, 4, 3136, 1000, causal=False, name="vit")
    with pytest.raises(GalvatronFormatError) as err:
        model_profile_from_galvatron(comp, mem, one, BF16, CLUSTER)
    assert f"{comp}: holds layer types [0, 1, 2, 3] but the model has 1" in str(err.value)


# --------------------------------------------------------------- ViT: one type, nested 197
def test_vit_single_type_nested_by_length(tmp_path):
    vit = ModelSpec.uniform(4, 640, 8, 197, 1000, causal=False, name="vit")
    lt = vit.layer_types[0]
    comp = write(tmp_path, "computation_profiling_bf16_hidden640_head8.json",
                 {"layernum[1]_bsz8_seq197": 7.0, "layernum[4]_bsz8_seq197": 12.0,
                  "layertype_0_bsz8_seq197": 0.2, "layertype_other_bsz8_seq197": 0.6})
    mem = write(tmp_path, "memory_profiling_bf16_hidden640_head8.json", {
        "1_1_4": raw_run([1], 8, 197, ranks=(0, 3)), "1_2_2_vtp": raw_run([1], 8, 197, (0, 3)),
        "1_1_4_c": raw_run([1], 8, 197, (0, 3)), "4_1_1": raw_run([4], 8, 197, (0, 3)),
        "layertype_0": {"197": layer_rec(lt, {1: 9.0, 2: 5.5, 4: 3.75}, 0.4)},
        "other_memory_pp_off": {"197": other_rec({1: 140.0, 2: 90.0}, {1: 8.0, 2: 4.0})},
        "other_memory_pp_on_first": {"197": other_rec({1: 56.0, 2: 38.0}, {1: 7.0, 2: 4.0})},
        "other_memory_pp_on_last": {"197": other_rec({1: 80.0, 2: 62.0}, {1: 7.0, 2: 3.5})}})
    p = model_profile_from_galvatron(comp, mem, vit, BF16, get_cluster("a100-40g-1x8"))
    assert p.layer_types["vit"].forward_time_per_sample_s == pytest.approx(0.2e-3)
    assert p.layer_types["vit"].activation_bytes(2) == pytest.approx(5.5 * MB)
    assert p.embedding.embedding_parameters == round(56.0 * MB / 16)


# ------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kind, data, message", [
    ("computation", {"layertype_0_bsz1_seq128": 1.0, "layer_type_0": 2.0},
     "unknown key 'layer_type_0'"),
    ("computation", {"layertype_0_bsz1_seq128": 1.0},
     "no layertype_other_* key and no raw layernum[...] totals"),
    ("computation", {"layernum[1]_bsz1_seq128": 1.0}, "no layertype_<i> key"),
    ("memory", {"layertype_0": {"128": {"parameter_size": 1.0, "tp_activation_per_bsz_dict":
                                        {"2": 1.0, "checkpoint": 0.1}}}},
     "key layertype_0.128.tp_activation_per_bsz_dict has TP degrees [2] but no 1"),
    ("memory", {"layertype_0": {"parameter_size": 1.0, "tp_activation_per_bsz_dict":
                                {"1": 1.0, "checkpoint": 0.1}},
                "other_memory_pp_off": {"model_states": {"2": 1.0}, "activation": {"2": 1.0}}},
     "key other_memory_pp_off.model_states has TP degrees [2] but no 1"),
    ("memory", {"1_1_8": {"layernum[1]_bsz8_rank0_ms": 1.0, "peak": 2.0}},
     "raw run '1_1_8' holds 'peak'"),
    ("memory", {"layertype_0_zero3": {}}, "unknown key 'layertype_0_zero3'"),
    ("memory", {"layertype_0_sp": {"parameter_size": 1.0, "tp_activation_per_bsz_dict":
                                   {"1": 1.0, "checkpoint": 0.1}}},
     "missing key(s) ['other_memory_pp_off_sp', 'other_memory_pp_on_first_sp', "
     "'other_memory_pp_on_last_sp']"),
    ("memory", {"1_1_8_sp": {"layernum[1]_bsz8_seq128_rank0_ms": 1.0}},
     "no derived 'layertype_<i>' record (only raw runs?)"),
])
def test_unknown_layouts_and_missing_values_name_file_and_key(tmp_path, kind, data, message):
    path = write(tmp_path, f"{kind}_profiling_bf16_x.json", data)
    reader = read_computation if kind == "computation" else read_memory
    with pytest.raises(GalvatronFormatError) as err:
        reader(path)
    text = str(err.value)
    assert message in text and str(path) in text and "\n" not in text


def test_plan_without_checkpoint_key_reads_as_galvatrons_runtime_does():
    config = {"pp_deg": 2, "tp_sizes_enc": "2,2,2,2", "tp_consecutive_flags": "1,1,1,1",
              "dp_types_enc": "0,0,0,0", "global_bsz": 16, "chunks": 2, "pp_division": "2,2",
              "pipeline_type": "pipedream_flush", "default_dp_type": "zero2"}
    plan = plan_from_galvatron_config(config, world_size=8)
    assert [lyr.recompute for lyr in plan.layers] == [False] * 4
    with pytest.raises(GalvatronFormatError, match="Ulysses"):
        plan_from_galvatron_config({**config, "use_sp": "1,1,1,1"}, world_size=8)


# --------------------------------------------------------------------------- the CLI
LLAMA_FLAGS = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
               "--ffn-hidden-size", "1408", "--seq-length", "256", "--vocab-size", "1024",
               "--swiglu", "--position-embedding-type", "rope", "--bf16"]


def test_cli_imports_a_batch_mode_profile_and_refuses_a_bad_one(tmp_path, capsys):
    comp, mem, (alpha, beta, _, _) = llama_files(tmp_path)
    out = tmp_path / "profile.json"
    code = main(["import-galvatron", *LLAMA_FLAGS, "--computation", str(comp), "--memory",
                 str(mem), "--model-profile-out", str(out)])
    assert code == 0, capsys.readouterr().err
    layer = next(iter(ModelProfile.load(out).layer_types.values()))
    assert layer.forward_time_constant_s == pytest.approx(beta / 1000)
    capsys.readouterr()
    bad = write(tmp_path, "memory_profiling_bf16_hidden512_head8_seqlen256.json",
                {"layertype_0": {"parameter_size": 1.0}})
    code = main(["import-galvatron", *LLAMA_FLAGS, "--computation", str(comp), "--memory",
                 str(bad), "--model-profile-out", str(tmp_path / "p2.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert str(bad) in err and "'layertype_0' needs 'parameter_size' and" in err


def test_our_swin_spec_with_merging_blocks_takes_the_stage_records(tmp_path):
    """Our Swin spec gives each later stage's first block (it merges patches) its own type;
    Galvatron profiles the four stages' plain blocks. Stage k's records price both."""
    comp, mem = swin_files(tmp_path)
    types = []
    for k, lt in enumerate(SWIN_TYPES):
        if k:
            types.append((LayerType(f"{lt.name}_merge", lt.hidden_size, lt.num_attention_heads,
                                    lt.ffn_hidden_size, lt.seq_length, 1, causal=False,
                                    merge_input_hidden=lt.hidden_size // 2), 1))
        types.append((lt, lt.count - (1 if k else 0)))
    spec = ModelSpec.stacked(types, vocab_size=1000, embedding_hidden_size=128,
                             seq_length=3136, name="swin")
    assert len(spec.layer_types) == 7
    p = model_profile_from_galvatron(comp, mem, spec, BF16, CLUSTER)
    from megatron_auto.planner.inputs.profiles import analytic_profile
    a = analytic_profile(spec, BF16, CLUSTER).layer_types
    plain, merge = p.layer_types["stage2"], p.layer_types["stage2_merge"]
    assert plain.forward_time_per_sample_s == pytest.approx(0.22e-3)  # layertype_2 as measured
    assert plain.activation_bytes(4) == pytest.approx(4.0 * MB)
    # The merging block: the measured block, scaled by what merging adds analytically.
    grow = a["stage2_merge"].forward_time_per_sample_s / a["stage2"].forward_time_per_sample_s
    assert grow > 1
    assert merge.forward_time_per_sample_s == pytest.approx(0.22e-3 * grow)
    assert merge.parameter_count == plain.parameter_count + (
        a["stage2_merge"].parameter_count - a["stage2"].parameter_count)
    # Galvatron's other records are keyed by its four stage lengths, found from our seven types.
    assert p.embedding.head_forward_time_per_sample_s == pytest.approx(0.25e-3)
    with pytest.raises(GalvatronFormatError, match="map them with layer_type_map"):
        model_profile_from_galvatron(comp, mem, spec, BF16, CLUSTER,
                                     layer_type_map={"stage0": 0, "stage1": 1})


@pytest.mark.pure
def test_megatron_sp_records_price_our_sequence_parallel_layers(tmp_path):
    # Plain records 40/26/19/15.5 MB per sample at tp 1/2/4/8; SP records 40/22/12/7 MB (every
    # activation split by tp, plus what SP keeps whole). An SP layer is charged the SP record,
    # a layer without SP the plain one.
    comp, mem, _ = llama_files(tmp_path)
    data = json.loads(open(mem).read())
    data["layertype_0_sp"] = layer_rec(LLAMA.layer_types[0], {1: 40.0, 2: 22.0, 4: 12.0, 8: 7.0},
                                       2.5)
    open(mem, "w").write(json.dumps(data))
    p = model_profile_from_galvatron(comp, mem, LLAMA, BF16, CLUSTER)
    layer = p.layer_types["llama"]
    assert layer.sequence_parallel_activation_bytes(2) == pytest.approx(22.0 * MB)
    assert layer.sequence_parallel_activation_bytes(8) == pytest.approx(7.0 * MB)
    assert layer.activation_bytes(2) == pytest.approx(26.0 * MB)
    assert any("*_sp records (tp 1, 2, 4, 8)" in n for n in p.metadata["notes"])
    path = tmp_path / "profile.json"
    p.save(path)
    assert ModelProfile.load(path) == p
    # without SP records, SP splits the tp=1 measurement: 40 / 2 MB
    (tmp_path / "plain").mkdir()
    comp2, mem2, _ = llama_files(tmp_path / "plain", with_sp=False)
    plain = model_profile_from_galvatron(comp2, mem2, LLAMA, BF16, CLUSTER).layer_types["llama"]
    assert plain.activation_bytes_by_tp_sp == {}
    assert plain.sequence_parallel_activation_bytes(2) == pytest.approx(20.0 * MB)


@pytest.mark.pure
def test_galvatron_global_sequence_parallel_maps_to_our_sp(tmp_path):
    config = {"pp_deg": 1, "tp_sizes_enc": "1,2,4,2", "tp_consecutive_flags": "1,1,1,0",
              "dp_types_enc": "0,0,0,0", "use_sp": "0,0,0,0", "global_bsz": 16, "chunks": 1,
              "default_dp_type": "zero2"}
    plan = plan_from_galvatron_config(config, world_size=8, sequence_parallel=True)
    assert [layer.sequence_parallel for layer in plan.layers] == [False, True, True, True]
    assert not any(layer.sequence_parallel
                   for layer in plan_from_galvatron_config(config, world_size=8).layers)
    # the CLI flag says the same
    path = write(tmp_path, "galvatron_config_x_1nodes_8gpus_per_node.json", config)
    out = tmp_path / "plan.json"
    assert main(["import-galvatron", "--galvatron-config", str(path), "--sequence-parallel",
                 "--plan-out", str(out)]) == 0
    assert [layer["sequence_parallel"] for layer in json.loads(out.read_text())["layers"][1:]] \
        == [True] * 3
    # use_sp = 1 is Ulysses: still refused
    with pytest.raises(GalvatronFormatError, match="Ulysses"):
        plan_from_galvatron_config({**config, "use_sp": "0,1,0,0"}, world_size=8,
                                   sequence_parallel=True)
