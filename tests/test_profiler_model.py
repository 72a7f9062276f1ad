"""Model profiler: a valid measured ModelProfile for a tiny GPT, hand-checked bytes, the cache."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_auto.config import ModelConfig
from megatron_auto.plan import Plan
from megatron_auto.families.registry import model_spec
from megatron_auto.planner.inputs.profiles import ModelProfile
from megatron_auto.profiler import cache as profile_cache
from megatron_auto.profiler import lookup, measure
from megatron_auto.profiler import model_profiler as mp
from megatron_auto.profiler import timing
from megatron_auto.profiler.activation_meter import SavedTensorMeter
from tests.dist_utils import run_distributed

# s*h*4 = 8192 bytes per sample: a multiple of the 512-byte allocator block, so fp32 (b, s, h)
# tensors are counted without rounding and hand calculations are exact.
TINY = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                   vocab_size=256, make_vocab_size_divisible_by=128, hidden_dropout=0.0,
                   attention_dropout=0.0)
QUICK = measure.ModelProfilerConfig(batch_sizes=(2, 3), warmup_iters=0, iters=1)
S, H = TINY.seq_length, TINY.hidden_size


@pytest.fixture(scope="module")
def tiny_profile() -> ModelProfile:
    torch.set_num_threads(1)
    return mp.profile_model(TINY, "fp32", "cpu", config=QUICK)


@pytest.mark.single
def test_profile_is_valid_and_matches_the_model(tiny_profile):
    spec = model_spec(TINY)
    tiny_profile.check_matches(spec, "fp32")
    again = ModelProfile.from_dict(json.loads(json.dumps(tiny_profile.to_dict())))
    assert again == tiny_profile
    lt = tiny_profile.layer_types["gpt"]
    assert lt.parameter_count == TINY.num_layer_parameters()
    emb = tiny_profile.embedding
    assert emb.embedding_parameters == spec.embedding_parameters
    assert emb.head_parameters == spec.head_parameters
    assert emb.vocab_size == TINY.padded_vocab_size and emb.tied
    assert tiny_profile.source == "measured"


@pytest.mark.single
def test_activation_bytes_are_positive_and_recompute_keeps_less(tiny_profile):
    lt = tiny_profile.layer_types["gpt"]
    assert lt.activation_replicated_bytes > 0 and lt.activation_split_bytes > 0
    assert lt.recompute_bytes_per_sample < lt.activation_bytes(1)
    # A recomputing layer keeps its input (counted as the previous layer's output) and adds
    # only its own fp32 output: s*h*4 bytes per sample.
    assert lt.recompute_bytes_per_sample == pytest.approx(4 * S * H)
    # Without dropout the embedding keeps only its fp32 output (b, s, h).
    assert tiny_profile.embedding.embedding_activation_bytes == pytest.approx(4 * S * H)
    # fp32 cross entropy keeps one (s, V) fp32 softmax per sample (split by vocab TP); the
    # head's linear keeps its (replicated) normed input, (s, h) fp32, and the loss its (s,)
    # int64 local target ids and bool outside-mask (each rounded up to 512-byte blocks).
    assert tiny_profile.embedding.head_activation_split_bytes == pytest.approx(
        4 * S * TINY.padded_vocab_size)
    replicated = tiny_profile.embedding.head_activation_replicated_bytes
    assert 4 * S * H + 9 * S <= replicated <= 4 * S * H + 2 * 512
    assert lt.forward_time_per_sample_s > 0 and lt.backward_forward_ratio > 0
    assert lt.hidden_bytes_per_sample == 4 * S * H and lt.weight_copy_bytes_per_parameter == 0


@pytest.mark.single
def test_bf16_profile_counts_weight_copies():
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32,
                      vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)
    rng_before = torch.get_rng_state()
    profile = mp.profile_model(cfg, "bf16", "cpu", config=QUICK)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG is untouched
    lt = profile.layer_types["gpt"]
    # autocast saves a bf16 copy of each matrix for backward: ~2 bytes per parameter.
    assert 1.0 < lt.weight_copy_bytes_per_parameter < 3.0
    assert lt.hidden_bytes_per_sample == 2 * 32 * 64


def _tp2_saved_bytes(rank: int, world_size: int, cfg_dict: dict) -> int:
    from megatron_auto.models.transformer import TransformerLayer
    from megatron_auto.parallel.context import ParallelContext

    cfg = ModelConfig.from_dict(cfg_dict)
    ctx = ParallelContext(Plan.uniform(2, cfg.num_layers, global_batch_size=4, tp=2))
    layer = measure.init_parameters(TransformerLayer(cfg, ctx.layer_groups(0)), 0.02)
    x = torch.randn(4, cfg.seq_length, cfg.hidden_size, requires_grad=True)
    meter = SavedTensorMeter(layer, exclude=[x])
    with meter:
        out = layer(x)
    meter.add_output(out)
    return meter.total_bytes


@pytest.mark.multirank
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_tp_split_derivation_matches_a_real_tp2_layer(dropout):
    # The tp=1 split/replicated attribution predicts what a TP=2 rank keeps; measure it. The
    # tolerance covers the 512-byte rounding of small per-row statistics (mean, rstd).
    cfg = ModelConfig.from_dict({**TINY.to_dict(), "hidden_dropout": dropout,
                                 "attention_dropout": dropout})
    lt = mp.profile_model(cfg, "fp32", "cpu", config=QUICK).layer_types["gpt"]
    measured = run_distributed(_tp2_saved_bytes, 2, cfg.to_dict())
    predicted = 4 * lt.activation_bytes(2)
    for per_rank in measured:
        assert per_rank == pytest.approx(predicted, rel=0.02)


# ------------------------------------------------------------------------------------ cache
@pytest.mark.single
def test_cache_reuses_the_profile_without_measuring(tmp_path):
    first = lookup.lookup_or_measure(TINY, "fp32", "cpu", str(tmp_path), config=QUICK)
    assert first.measured
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and files[0].name.startswith("cpu-")
    second = lookup.lookup_or_measure(TINY, "fp32", "cpu", str(tmp_path), config=QUICK)
    assert not second.measured  # served from the cache
    assert second.profile == first.profile
    assert lookup.get_or_create_model_profile(TINY, "fp32", "cpu", str(tmp_path),
                                          config=QUICK) == first.profile
    # The layer count is not part of the key; the sequence length is.
    deeper = ModelConfig.from_dict({**TINY.to_dict(), "num_layers": 8})
    assert not lookup.lookup_or_measure(deeper, "fp32", "cpu", str(tmp_path), config=QUICK).measured
    longer = ModelConfig.from_dict({**TINY.to_dict(), "seq_length": 16})
    assert lookup.lookup_or_measure(longer, "fp32", "cpu", str(tmp_path), config=QUICK).measured
    assert lookup.lookup_or_measure(TINY, "fp32", "cpu", str(tmp_path), config=QUICK,
                                force=True).measured
    assert len(list(tmp_path.glob("*.json"))) == 2


@pytest.mark.single
def test_damaged_or_foreign_cache_files_are_misses(tmp_path):
    key = mp.profile_cache_key(TINY, "fp32", "cpu", QUICK)
    path = profile_cache.cache_path(key, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    assert profile_cache.load_cached(key, tmp_path) is None
    other = {**key, "torch": "0.0"}
    assert profile_cache.cache_path(other, tmp_path) != path


@pytest.mark.single
def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(profile_cache.CACHE_ENV, str(tmp_path / "c"))
    assert profile_cache.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv(profile_cache.CACHE_ENV)
    assert profile_cache.default_cache_dir().parts[-2:] == ("megatron_auto", "profiles")


# ------------------------------------------------------------------------------- bad inputs
@pytest.mark.single
def test_bad_inputs_name_the_flag():
    with pytest.raises(ValueError, match="--precision 'fp8'"):
        mp.profile_model(TINY, "fp8", "cpu", config=QUICK)
    with pytest.raises(ValueError, match=r"--batch-sizes \[2\]: give at least two"):
        measure.ModelProfilerConfig(batch_sizes=(2,))
    with pytest.raises(ValueError, match=r"--batch-sizes \[1, 1\]: need distinct"):
        measure.ModelProfilerConfig(batch_sizes=(1, 1))


@pytest.mark.single
def test_fit_line_hand_checked():
    assert timing.fit_line([1, 2, 4], [3.0, 5.0, 9.0]) == pytest.approx((2.0, 1.0))
    # Negative intercept from noise -> line through the origin: sum(xy)/sum(x^2) = 20.5/21.
    assert timing.fit_line([1, 2, 4], [0.5, 2.0, 4.0]) == pytest.approx((20.5 / 21, 0.0))


# -------------------------------------------------------------------------- TP shards timed
@pytest.mark.single
def test_tp_shard_is_the_runtimes_shard_and_runs_without_communication():
    from megatron_auto.models.transformer import TransformerLayer
    from megatron_auto.parallel import mappings

    before = mappings.group_size, mappings._all_reduce
    with measure.tensor_parallel_compute_only(2):
        shard = TransformerLayer(TINY, measure.tp_shard_groups(torch.device("cpu"), 2))
        x = torch.randn(2, S, H, requires_grad=True)
        shard(x).sum().backward()  # no process group exists: nothing may communicate
    assert (mappings.group_size, mappings._all_reduce) == before
    assert x.grad.shape == x.shape
    # Half of QKV (3h^2/2 + 3h/2), of the projection's rows (h^2/2, its bias h whole), of FC1
    # (f h/2 + f/2) and FC2's columns (h f/2, bias h); both norms whole (4h). h=64, f=256.
    h, f = H, 4 * H
    hand = (3 * h * h // 2 + 3 * h // 2) + (h * h // 2 + h) + (f * h // 2 + f // 2) \
        + (h * f // 2 + h) + 4 * h
    assert sum(p.numel() for p in shard.parameters()) == hand


@pytest.mark.single
def test_replicated_fraction_fit_recovers_a_known_split():
    # A toy layer that repeats 20% of its tp-1 work on every rank: 1.0 -> 0.8/2 + 0.2 = 0.6 at
    # tp 2, 0.8/4 + 0.2 = 0.4 at tp 4 (ms per sample).
    table = {1: (1.0e-3, 0.0), 2: (0.6e-3, 1e-4), 4: (0.4e-3, 2e-4)}
    assert timing.fit_replicated_fraction(table) == pytest.approx(0.2)
    assert timing.fit_replicated_fraction({1: (1.0e-3, 0.0)}) == 0.0
    # Noise faster than a perfect split is clipped to "nothing repeated".
    assert timing.fit_replicated_fraction({1: (1.0e-3, 0.0), 2: (0.4e-3, 0.0)}) == 0.0


@pytest.mark.single
def test_profile_times_the_requested_tp_degrees_and_keys_the_cache_on_them():
    config = measure.ModelProfilerConfig(batch_sizes=(2, 3), warmup_iters=0, iters=1, tp_degrees=(2,))
    profile = mp.profile_model(TINY, "fp32", "cpu", config=config)
    lt = profile.layer_types["gpt"]
    assert sorted(lt.forward_time_by_tp) == [1, 2]
    assert all(slope >= 0 and const >= 0 for slope, const in lt.forward_time_by_tp.values())
    assert 0.0 <= lt.tp_replicated_fraction <= 1.0
    assert mp.profile_cache_key(TINY, "fp32", "cpu", config)["tp_degrees"] == [2]
    assert mp.profile_cache_key(TINY, "fp32", "cpu", QUICK)["tp_degrees"] == []  # lone process
    with pytest.raises(ValueError, match="--tp-degrees"):
        measure.ModelProfilerConfig(tp_degrees=(1,))
    with pytest.raises(ValueError, match="must divide --num-attention-heads=4"):
        measure.ModelProfilerConfig(tp_degrees=(3,)).degrees(TINY)


def _default_degrees_profile(rank: int, world_size: int, cfg_dict: dict) -> dict:
    from megatron_auto.models.transformer import TransformerLayer
    from megatron_auto.parallel.context import ParallelContext

    import torch.distributed as dist

    cfg = ModelConfig.from_dict(cfg_dict)
    ctx = ParallelContext(Plan.uniform(2, cfg.num_layers, global_batch_size=4, tp=2))
    real = TransformerLayer(cfg, ctx.layer_groups(0))
    with measure.tensor_parallel_compute_only(2):
        shard = TransformerLayer(cfg, measure.tp_shard_groups(torch.device("cpu"), 2))
    profile = mp.profile_model(cfg, "fp32", "cpu", config=QUICK)  # no collective inside
    dist.barrier()  # both ranks done before either tears the group down
    return {"degrees": sorted(profile.layer_types["gpt"].forward_time_by_tp),
            "real": [tuple(p.shape) for p in real.parameters()],
            "shard": [tuple(p.shape) for p in shard.parameters()]}


@pytest.mark.multirank
def test_under_two_ranks_the_profile_times_tp2_on_the_runtimes_tp2_shapes():
    for rank in run_distributed(_default_degrees_profile, 2, TINY.to_dict()):
        assert rank["degrees"] == [1, 2]
        assert rank["shard"] == rank["real"]


@pytest.mark.single
def test_analytic_kept_bytes_on_a_cpu_cluster_are_what_a_cpu_layer_keeps():
    """With dropout on, a CPU layer keeps its dropout masks in the compute dtype (at::dropout's
    noise tensor), not CUDA's 1-byte masks: the analytic profile of a CPU cluster counts them
    so, and then agrees with what autograd saves, byte for byte (TINY's shapes are multiples of
    the 512-byte block)."""
    import dataclasses

    from megatron_auto.planner.inputs.hardware import ClusterSpec
    from megatron_auto.planner.inputs.model_spec import TrainingSpec
    from megatron_auto.planner.inputs.profiles import analytic_profile

    torch.set_num_threads(1)
    cfg = dataclasses.replace(TINY, hidden_dropout=0.1, attention_dropout=0.1)
    measured = mp.profile_model(cfg, "fp32", "cpu", config=QUICK)
    cpu = ClusterSpec(name="cpu", num_nodes=1, devices_per_node=1, device_name="cpu-test",
                      device_memory_bytes=2**34, peak_flops={"fp32": 1e11, "bf16": 1e11})
    spec = model_spec(cfg)
    analytic = analytic_profile(spec, TrainingSpec(8, "fp32"), cpu)
    got, want = analytic.layer_types["gpt"], measured.layer_types["gpt"]
    assert got.activation_split_bytes == pytest.approx(want.activation_split_bytes, rel=1e-9)
    assert got.activation_replicated_bytes == pytest.approx(want.activation_replicated_bytes,
                                                            rel=1e-9)
    assert analytic.embedding.embedding_activation_bytes == pytest.approx(
        measured.embedding.embedding_activation_bytes, rel=1e-9)
    # a GPU cluster keeps 1-byte masks: two hidden masks and one per attention score
    gpu = analytic_profile(spec, TrainingSpec(8, "fp32"),
                           dataclasses.replace(cpu, device_name="NVIDIA H100"))
    s, h, a = cfg.seq_length, cfg.hidden_size, cfg.num_attention_heads
    assert got.activation_replicated_bytes - gpu.layer_types["gpt"].activation_replicated_bytes \
        == 2 * 3 * s * h
    assert got.activation_split_bytes - gpu.layer_types["gpt"].activation_split_bytes \
        == 3 * a * s * s


@pytest.mark.single
def test_sizes_are_timed_in_interleaved_rounds_each_started_by_the_barrier():
    calls: list[str] = []
    barriers: list[int] = []

    def closure(name: str, seconds: float):
        w = torch.ones(3, requires_grad=True)

        def forward() -> torch.Tensor:
            calls.append(name)
            return (w * seconds).sum()
        return forward

    forwards = [closure("b2", 1.0), closure("b4", 2.0), closure("b8", 3.0)]
    settings = measure.ModelProfilerConfig(batch_sizes=(2, 4, 8), warmup_iters=1, iters=3)
    fwd, bwd = measure.time_forward_backward(forwards, settings, torch.device("cpu"))
    assert calls == ["b2", "b4", "b8"] * 4  # one of every size per round, warm-up round included
    assert len(fwd) == len(bwd) == 3 and all(t > 0 for t in fwd + bwd)
    assert barriers == []  # no barrier given: none is called
    calls.clear()
    settings = measure.ModelProfilerConfig(batch_sizes=(2, 4, 8), warmup_iters=2, iters=2)
    measure.time_forward_backward(forwards, settings, torch.device("cpu"),
                                  barrier=lambda: barriers.append(len(calls)))
    # one barrier before every round (warm-up ones too), each before that round's first size
    assert barriers == [0, 3, 6, 9]


def _profile_together(rank: int, world_size: int, cfg_dict: dict) -> int:
    import torch.distributed as dist

    count = [0]

    def barrier() -> None:
        count[0] += 1
        dist.barrier()

    config = measure.ModelProfilerConfig(batch_sizes=(2, 3), warmup_iters=1, iters=2)
    profile = mp.profile_model(ModelConfig.from_dict(cfg_dict), "fp32", "cpu", config=config,
                               barrier=barrier)
    assert profile.layer_types["gpt"].forward_time_per_sample_s >= 0
    dist.barrier()
    return count[0]


@pytest.mark.multirank
def test_ranks_that_measure_together_pair_up_their_barriers():
    # Every rank runs the same rounds (layer, TP-2 shard, embedding, head, and the single
    # modules: the core attention at each measured length, the MLP, a norm; 3 rounds each),
    # so the barriers pair up and the run ends; a mismatch would hang until the test's timeout.
    from megatron_auto.profiler.module_profiler import attention_lengths

    counts = run_distributed(_profile_together, 2, TINY.to_dict())
    series = 4 + len(attention_lengths(TINY.seq_length)) + 2
    assert counts[0] == counts[1] == series * 3
