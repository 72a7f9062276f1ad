"""Hardware profiler: the fit, the group shapes, and real runs on 2 and 4 forked gloo ranks."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from megatron_auto.planner.inputs.hardware import ClusterSpec
from megatron_auto.profiler import cli as pcli
from megatron_auto.profiler import comm_bench as cb
from megatron_auto.profiler import hardware_profiler as hp
from tests.dist_utils import run_distributed

# Small sizes and few iterations: these tests check plumbing, never speed.
QUICK = hp.HardwareProfilerConfig(message_sizes=(4096, 65536), warmup_iters=1, iters=2,
                                  matmul_size=64, matmul_iters=1, overlap_comm_iters=2,
                                  overlap_repeats=1)


# ------------------------------------------------------------------------------- pure parts
@pytest.mark.single
def test_fit_recovers_latency_and_bandwidth():
    # t = 50 us + x / 2 GB/s, sampled exactly at three sizes.
    xs = [1e4, 1e6, 4e6]
    ts = [50e-6 + x / 2e9 for x in xs]
    latency, bw = cb.fit_latency_bandwidth(xs, ts)
    assert latency == pytest.approx(50e-6, rel=1e-6)
    assert bw == pytest.approx(2e9, rel=1e-6)


@pytest.mark.single
def test_fit_with_noise_that_breaks_the_slope_falls_back_to_the_largest_message():
    # Larger message measured faster (noise): no positive slope; 4e6 B in 2 ms -> 2 GB/s.
    latency, bw = cb.fit_latency_bandwidth([1e6, 4e6], [3e-3, 2e-3])
    assert bw == pytest.approx(2e9)
    assert latency == pytest.approx(3e-3)


@pytest.mark.single
def test_message_sizes_are_timed_in_interleaved_rounds():
    calls: list[str] = []
    steps = [lambda name=name: calls.append(name) for name in ("64K", "1M", "4M")]
    befores: list[int] = []
    times = cb.time_calls(steps, warmup=1, iters=3, device=torch.device("cpu"),
                           before=lambda: befores.append(len(calls)))
    assert calls == ["64K", "1M", "4M"] * 4  # every size once per round, the warm-up one too
    assert befores == list(range(12))  # the untimed gap before every call
    assert len(times) == 3 and all(t >= 0 for t in times)


@pytest.mark.single
def test_fit_rejects_bad_inputs():
    with pytest.raises(ValueError, match="matching, non-empty"):
        cb.fit_latency_bandwidth([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive sizes and times"):
        cb.fit_latency_bandwidth([1.0, 2.0], [0.0, 1.0])


@pytest.mark.single
def test_bus_factors_follow_the_ring_formulas():
    assert cb.bus_factor("allreduce", 4) == pytest.approx(1.5)  # 2 * 3/4
    assert cb.bus_factor("allgather", 4) == pytest.approx(0.75)
    assert cb.bus_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    with pytest.raises(ValueError, match="op='alltoall'"):
        cb.bus_factor("alltoall", 2)


@pytest.mark.single
def test_partitions_and_shapes():
    assert hp.partition_groups(8, 2, True) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert hp.partition_groups(8, 2, False) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hp.partition_groups(8, 4, False) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert hp.group_shapes(4) == [(2, True), (2, False), (4, True)]
    assert hp.group_shapes(6) == [(2, True), (2, False), (6, True)]
    assert hp.group_shapes(1) == []
    assert hp.nodes_of([0, 4], 2) == 2 and hp.nodes_of([0, 1], 2) == 1


@pytest.mark.single
def test_known_gpu_keeps_spec_peak_and_measures_efficiency():
    profile = hp.HardwareProfile(world_size=1, devices_per_node=1,
                                 device_name="NVIDIA H100 80GB HBM3",
                                 device_memory_bytes=80 * 2**30, backend="none",
                                 matmul_flops={"bf16": 0.5 * 989e12, "fp32": 30e12})
    spec = profile.to_cluster_spec()
    assert spec.peak_flops["bf16"] == pytest.approx(989e12)  # spec sheet, presets.py
    assert spec.compute_efficiency == pytest.approx(0.5)
    assert spec.flops("bf16") == pytest.approx(0.5 * 989e12)


@pytest.mark.single
def test_cpu_measured_rate_is_the_peak():
    profile = hp.HardwareProfile(world_size=1, devices_per_node=1, device_name="cpu-x86_64",
                                 device_memory_bytes=8 * 2**30, backend="none",
                                 matmul_flops={"fp32": 4e10})
    spec = profile.to_cluster_spec()
    assert spec.peak_flops == {"fp32": 4e10} and spec.compute_efficiency == 1.0
    assert spec.overlap_slowdown == 1.0


@pytest.mark.single
def test_inter_node_bandwidth_is_busbw_per_member_per_node():
    # A 4-rank group over 2 nodes (2 members per node) at 3 GB/s busbw -> 1.5 GB/s per device.
    comm = [hp.CommResult("allreduce", 2, True, 1, [1], [1.0], busbw=8e9, latency_s=1e-5),
            hp.CommResult("allreduce", 4, True, 2, [1], [1.0], busbw=3e9, latency_s=3e-5)]
    profile = hp.HardwareProfile(world_size=4, devices_per_node=2, device_name="cpu",
                                 device_memory_bytes=8 * 2**30, backend="gloo", comm=comm,
                                 matmul_flops={"fp32": 1e10})
    spec = profile.to_cluster_spec()
    assert spec.intra_node_busbw == pytest.approx(8e9)
    assert spec.inter_node_bw_per_device == pytest.approx(1.5e9)
    assert spec.collective_latency_s == pytest.approx(1e-5)
    assert spec.inter_node_latency_s == pytest.approx(3e-5)
    assert spec.allreduce_busbw_table == {(2, True): 8e9, (4, True): 3e9}


@pytest.mark.single
def test_bad_config_names_the_flag():
    with pytest.raises(ValueError, match=r"--message-sizes \[0\]"):
        hp.HardwareProfilerConfig(message_sizes=(0,))
    with pytest.raises(ValueError, match="--ops broadcast"):
        hp.HardwareProfilerConfig(ops=("broadcast",))
    with pytest.raises(ValueError, match="iters=0"):
        hp.HardwareProfilerConfig(iters=0)


# ------------------------------------------------------------------------- forked gloo ranks
def _profile_rank(rank: int, world_size: int, out: str, devices_per_node: int | None):
    config = hp.HardwareProfilerConfig(**{**QUICK.__dict__, "devices_per_node": devices_per_node})
    profile = hp.profile_hardware(config)
    spec = profile.to_cluster_spec()
    if rank == 0:
        spec.save(out)
    return {"table": dict(spec.allreduce_busbw_table), "p2p": dict(spec.p2p_bw_table),
            "nodes": spec.num_nodes,
            "spanned": {(r.op, r.group_size, r.consecutive): r.nodes_spanned for r in profile.comm}}


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_profile_on_gloo_ranks_writes_a_loadable_cluster(tmp_path, world_size):
    out = tmp_path / "cluster.json"
    results = run_distributed(_profile_rank, world_size, str(out), None)
    spec = ClusterSpec.load(out)
    assert spec.world_size == world_size and spec.num_nodes == 1
    expected_keys = {(g, c) for g, c in hp.group_shapes(world_size)}
    assert set(spec.allreduce_busbw_table) == expected_keys
    assert all(v > 0 for v in spec.allreduce_busbw_table.values())
    assert set(spec.p2p_bw_table) == {g for g, _ in expected_keys}
    assert all(v > 0 for v in spec.p2p_bw_table.values())
    assert spec.peak_flops["fp32"] > 0 and spec.overlap_slowdown >= 1.0
    assert spec.intra_node_busbw > 0 and spec.collective_latency_s >= 0
    # The runtime's own ZeRO collectives and optimizer step were measured and fitted.
    assert spec.zero_gather_busbw > 0 and spec.zero_scatter_busbw > 0
    assert spec.optimizer_time_per_parameter_s > 0
    # Every rank computed the same (max-reduced) numbers.
    assert all(r["table"] == results[0]["table"] for r in results)
    assert json.loads(out.read_text())["format"] == "megatron_auto.cluster"


@pytest.mark.single
def test_zero_and_optimizer_rows_are_fitted_into_the_cluster():
    # Rows made from known lines: gather 1 ms + (1/2) S / 1 GB/s, scatter 2 ms + (1/2) S / 0.5
    # GB/s over 2 ranks; the step 0.5 ms + 10 ns per parameter.
    profile = hp.HardwareProfile(world_size=2, devices_per_node=2, device_name="cpu-test",
                                 device_memory_bytes=2**34, backend="gloo",
                                 matmul_flops={"fp32": 1e10})
    sizes = [2**16, 2**20, 2**22]
    profile.zero = [(s, 1e-3 + 0.5 * s / 1e9, 2e-3 + 0.5 * s / 0.5e9) for s in sizes]
    profile.optimizer = [(n, 0.5e-3 + 1e-8 * n) for n in (2**17, 2**20)]
    spec = profile.to_cluster_spec()
    assert spec.zero_gather_latency_s == pytest.approx(1e-3)
    assert spec.zero_gather_busbw == pytest.approx(1e9)
    assert spec.zero_scatter_latency_s == pytest.approx(2e-3)
    assert spec.zero_scatter_busbw == pytest.approx(0.5e9)
    assert spec.step_overhead_s == pytest.approx(0.5e-3)
    assert spec.optimizer_time_per_parameter_s == pytest.approx(1e-8)


@pytest.mark.multirank
def test_node_boundaries_mark_groups_that_cross_nodes(tmp_path):
    # 4 ranks pretending to be 2 nodes x 2: strided pairs {0,2},{1,3} and the 4-group cross.
    out = tmp_path / "cluster.json"
    results = run_distributed(_profile_rank, 4, str(out), 2)
    spanned = results[0]["spanned"]
    assert spanned[("allreduce", 2, True)] == 1
    assert spanned[("allreduce", 2, False)] == 2
    assert spanned[("allreduce", 4, True)] == 2
    spec = ClusterSpec.load(out)
    assert spec.num_nodes == 2 and spec.devices_per_node == 2
    assert spec.inter_node_bw_per_device > 0


def _bad_node_size(rank: int, world_size: int):
    with pytest.raises(ValueError, match="devices per node 3 .* must divide the world size 4"):
        hp.profile_hardware(hp.HardwareProfilerConfig(devices_per_node=3))
    return True


@pytest.mark.multirank
def test_devices_per_node_must_divide_the_world():
    assert run_distributed(_bad_node_size, 4) == [True] * 4


@pytest.mark.single
def test_single_process_profile_without_distributed(tmp_path):
    assert not torch.distributed.is_initialized()
    spec = hp.profile_hardware(QUICK).to_cluster_spec(name="solo")
    assert spec.name == "solo" and spec.world_size == 1 and spec.peak_flops["fp32"] > 0
    assert spec.allreduce_busbw_table == {}


def _cli_rank(rank: int, world_size: int, out: str, raw: str):
    args = pcli.add_hardware_flags(argparse.ArgumentParser()).parse_args(
        ["--out", out, "--raw-out", raw, "--message-sizes", "4096", "16384", "--iters", "1",
         "--name", "bench"])
    return pcli.profile_hardware_from_args(args).name


@pytest.mark.multirank
def test_torchrun_entry_writes_cluster_and_raw_timings(tmp_path):
    out, raw = tmp_path / "c.json", tmp_path / "raw.json"
    assert run_distributed(_cli_rank, 2, str(out), str(raw)) == ["bench", "bench"]
    assert ClusterSpec.load(out).name == "bench"
    timings = json.loads(raw.read_text())
    assert timings["world_size"] == 2
    assert {r["op"] for r in timings["comm"]} == {"allreduce", "allgather", "reduce_scatter"}
    assert all(len(r["times_s"]) == 2 for r in timings["comm"])
