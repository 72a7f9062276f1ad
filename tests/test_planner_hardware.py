"""ClusterSpec formulas against hand calculations, the cluster JSON format and the presets."""

import json

import pytest

from megatron_auto.planner.inputs.hardware import GB, ClusterError, ClusterSpec
from megatron_auto.planner.inputs.presets import PRESET_NAMES, get_cluster, make_cluster

pytestmark = pytest.mark.pure


def small_cluster(**overrides) -> ClusterSpec:
    """2 nodes x 4 devices; NVLink 100 GB/s, 10 GB/s per GPU across nodes, round latencies."""
    kwargs = dict(name="toy", num_nodes=2, devices_per_node=4, device_name="toy-gpu",
                  device_memory_bytes=16 * 10**9, peak_flops={"bf16": 100e12, "fp32": 10e12},
                  compute_efficiency=0.5, overlap_slowdown=1.2, memory_reserve_bytes=10**9,
                  source="test", intra_node_busbw=100 * GB, inter_node_bw_per_device=10 * GB,
                  p2p_intra_bw=50 * GB, p2p_inter_bw=5 * GB, collective_latency_s=1e-5,
                  inter_node_latency_s=1e-4, p2p_latency_s=2e-6)
    kwargs.update(overrides)
    return ClusterSpec(**kwargs)


def test_ring_formulas_inside_a_node():
    c = small_cluster()
    # 4 consecutive ranks = one node: 2*(3/4)*1e9 B / 100e9 B/s = 0.015 s, + 10 us latency.
    assert c.allreduce_time(1e9, 4) == pytest.approx(0.015 + 1e-5)
    # all-gather / reduce-scatter move half of that: (3/4)*1e9/100e9 = 0.0075 s.
    assert c.allgather_time(1e9, 4) == pytest.approx(0.0075 + 1e-5)
    assert c.reduce_scatter_time(1e9, 4) == pytest.approx(0.0075 + 1e-5)
    assert c.allreduce_time(1e9, 1) == 0.0
    assert c.allreduce_time(0, 4) == 0.0


def test_zero_collectives_use_the_measured_runtime_cost_but_never_beat_the_raw_one():
    c = small_cluster()
    # Not measured: the raw all-gather / reduce-scatter.
    assert c.zero_gather_time(1e9, 4) == c.allgather_time(1e9, 4)
    assert c.zero_scatter_time(1e9, 4) == c.reduce_scatter_time(1e9, 4)
    # Measured at 1 ms + (3/4) S / 10 GB/s: 1e-3 + 0.075 s for 1 GB over 4 in a node.
    m = small_cluster(zero_gather_latency_s=1e-3, zero_gather_busbw=10 * GB,
                      zero_scatter_latency_s=2e-3, zero_scatter_busbw=20 * GB)
    assert m.zero_gather_time(1e9, 4) == pytest.approx(1e-3 + 0.075)
    assert m.zero_scatter_time(1e9, 4) == pytest.approx(2e-3 + 0.0375)
    # Across nodes the topology (4 GPUs x 10 GB/s per node... 8 consecutive: 40 GB/s) caps it,
    # and a measurement faster than the raw collective never lowers the raw time.
    fast = small_cluster(zero_gather_latency_s=0.0, zero_gather_busbw=1000 * GB)
    assert fast.zero_gather_time(1e9, 8) == pytest.approx(fast.allgather_time(1e9, 8))
    assert m.zero_gather_time(0, 4) == 0.0 and m.zero_gather_time(1e9, 1) == 0.0


def test_presets_price_the_optimizer_step_from_hbm_bandwidth():
    # (The cost model's use of these fields is hand-checked in test_planner_cost_model.py.)
    assert small_cluster().optimizer_time_per_parameter_s == 0.0  # not modelled unless given
    # Presets: 40 B per parameter at 90% of the spec-sheet HBM bandwidth.
    assert get_cluster("h100-80g-1x8").optimizer_time_per_parameter_s == pytest.approx(
        40 / (0.9 * 3.35e12))


def test_groups_crossing_nodes_are_limited_by_the_nics_of_their_members():
    c = small_cluster()
    # 8 consecutive = 2 nodes with 4 members each: busbw = min(100, 4*10) = 40 GB/s.
    assert c.allreduce_time(1e9, 8) == pytest.approx(2 * 7 / 8 * 1e9 / 40e9 + 1e-4)
    # 2 strided ranks over the whole world (stride 4 = one node): one member per node, 10 GB/s.
    assert c.allreduce_time(1e9, 2, consecutive=False) == pytest.approx(1e9 / 10e9 + 1e-4)
    # 4 strided over 8 ranks (stride 2): 2 per node -> 20 GB/s.
    assert c.allreduce_busbw(4, consecutive=False) == pytest.approx(20 * GB)
    # The same strided pair inside a 4-rank span (one node) gets NVLink.
    assert c.allreduce_time(1e9, 2, consecutive=False, span=4) == pytest.approx(1e9 / 100e9 + 1e-5)


def test_p2p_within_and_across_nodes():
    one_node = small_cluster(num_nodes=1)
    assert one_node.p2p_time(1e8, 2) == pytest.approx(1e8 / 50e9 + 2e-6)
    # On two nodes some hop crosses the node boundary and paces the pipeline.
    assert small_cluster().p2p_time(1e8, 4) == pytest.approx(1e8 / 5e9 + 1e-4)
    assert small_cluster().p2p_time(1e8, 1) == 0.0


def test_measured_table_wins_and_gaps_are_filled_conservatively():
    table = {(2, True): 60 * GB, (8, True): 30 * GB}
    c = small_cluster(allreduce_busbw_table=table, p2p_bw_table={2: 7 * GB})
    assert c.allreduce_busbw(2) == 60 * GB
    # 4 is not measured: the slower neighbour (8 -> 30) and never above the topology (100).
    assert c.allreduce_busbw(4) == 30 * GB
    assert c.p2p_time(7e9, 2) == pytest.approx(1.0 + 1e-4)
    # pp 4 unmeasured: min(measured neighbour 7, topology 5 GB/s across nodes).
    assert c.p2p_bandwidth(4) == 5 * GB


def test_flops_and_usable_memory():
    c = small_cluster()
    assert c.flops("bf16") == pytest.approx(50e12)
    assert c.usable_memory_bytes == 15 * 10**9
    with pytest.raises(ClusterError, match="no peak_flops for precision 'fp16'"):
        c.flops("fp16")


def test_json_round_trip(tmp_path):
    c = small_cluster(allreduce_busbw_table={(4, False): 80 * GB}, p2p_bw_table={2: 40 * GB})
    path = tmp_path / "cluster.json"
    c.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "megatron_auto.cluster" and data["version"] == 1
    assert data["allreduce_busbw_table"] == {"4_strided": 80e9}
    again = ClusterSpec.load(path)
    assert again == c
    assert again.allreduce_busbw_table == {(4, False): 80 * GB}
    assert get_cluster(str(path)) == c


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="other"), "format='other': must be 'megatron_auto.cluster'"),
    (lambda d: d.update(version=7), "version=7"),
    (lambda d: d.update(colour="red"), "unknown field(s) ['colour']"),
    (lambda d: d.pop("device_memory_bytes"), "missing field(s) ['device_memory_bytes']"),
    (lambda d: d.update(intra_node_busbw=-1), "intra_node_busbw=-1: must be positive"),
    (lambda d: d.update(allreduce_busbw_table={"8-fast": 1.0}), "allreduce_busbw_table.8-fast"),
    (lambda d: d.update(peak_flops={"int4": 1e15}), "peak_flops.int4"),
    (lambda d: d.update(intra_node_busbw="fast"), "intra_node_busbw='fast': must be a finite number"),
    (lambda d: d.update(num_nodes="2"), "num_nodes='2': must be a positive integer"),
    (lambda d: d.update(p2p_bw_table={"2": "x"}), "p2p_bw_table"),
    (lambda d: d.update(allreduce_busbw_table={"8_consecutive": "x"}), "8_consecutive='x'"),
    (lambda d: d.update(zero_gather_busbw=-1.0), "zero_gather_busbw=-1.0: must be >= 0"),
    (lambda d: d.update(optimizer_time_per_parameter_s=-1e-9),
     "optimizer_time_per_parameter_s=-1e-09: must be >= 0"),
])
def test_bad_cluster_files_name_the_field(tmp_path, mutate, message):
    data = small_cluster().to_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClusterError) as err:
        ClusterSpec.load(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_galvatron_hardware_file_given_as_cluster_points_to_import(tmp_path):
    path = tmp_path / "allreduce.json"
    path.write_text(json.dumps({"allreduce_size_8_consec_1": 154.2}))
    with pytest.raises(ClusterError, match="import-galvatron"):
        get_cluster(str(path))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ClusterError, match="not valid JSON"):
        get_cluster(str(broken))


def test_every_preset_resolves_with_the_named_shape():
    for name in PRESET_NAMES:
        c = get_cluster(name)
        gpu, mem, shape = name.split("-")
        nodes, devices = map(int, shape.split("x"))
        assert (c.name, c.num_nodes, c.devices_per_node) == (name, nodes, devices)
        assert c.source and "spec sheet" in c.source
        assert c.device_memory_bytes == int(mem[:-1]) * 10**9
    assert len(PRESET_NAMES) == 13


def test_presets_carry_the_published_numbers():
    a100 = get_cluster("a100-40g-1x8")
    assert a100.allreduce_busbw(8) == pytest.approx(154.203 * GB)  # Galvatron 1x8 measured
    assert a100.allreduce_busbw(2, consecutive=False) == pytest.approx(151.344 * GB)
    assert a100.p2p_bandwidth(4) == pytest.approx(138.581 * GB)
    assert a100.overlap_slowdown == pytest.approx(1.1256)
    two = get_cluster("a100-40g-2x8")
    assert two.allreduce_busbw(16) == pytest.approx(44.7 * GB)
    h100 = get_cluster("h100-80g-2x8")
    assert h100.peak_flops["bf16"] == 989e12
    assert h100.allreduce_busbw(8) == 460 * GB  # in a node: nccl-tests low end
    # 16 consecutive over two nodes: 8 NDR ports per node at 80% of 50 GB/s = 320 GB/s.
    assert h100.allreduce_busbw(16) == pytest.approx(8 * 0.8 * 50 * GB)
    h200 = get_cluster("h200-141g-1x8")
    assert h200.flops("bf16") == pytest.approx(0.78 * 989e12)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ClusterError) as err:
        get_cluster("v100-16g-1x8")
    assert "a100-40g-1x8" in str(err.value) and "h200-141g-1x8" in str(err.value)
    with pytest.raises(ClusterError, match="cannot read the file"):
        get_cluster("missing-cluster.json")


def test_large_synthetic_cluster():
    c = make_cluster("h100-80g", num_nodes=128, devices_per_node=8)
    assert c.world_size == 1024
    assert get_cluster("h100-80g-128x8") == c
    # A data-parallel group of 128 strided ranks (stride 8): one GPU per node, one NIC each.
    assert c.allreduce_busbw(128, consecutive=False) == pytest.approx(0.8 * 50 * GB)
    with pytest.raises(ClusterError, match="num_nodes=0"):
        make_cluster("h100-80g", num_nodes=0)


def test_measured_strided_entry_is_not_used_for_a_group_that_stays_in_a_node():
    two = get_cluster("a100-40g-2x8")
    # Measured (2, strided) = 8.1 GB/s: stride 8 over 16 ranks puts the pair on two nodes.
    assert two.allreduce_busbw(2, consecutive=False) == pytest.approx(8.1 * GB)
    # A strided pair inside an 8-rank stage (pp=2) stays in one node: the in-node entry applies.
    assert two.allreduce_busbw(2, consecutive=False, span=8) == pytest.approx(149.7 * GB)

def test_groups_larger_than_any_measured_take_min_of_largest_and_topology():
    from dataclasses import replace
    four = make_cluster("a100-40g", num_nodes=4)  # topology across nodes: 8 GPUs x 20 GB/s
    measured = replace(four, allreduce_busbw_table={(8, True): 200 * GB, (16, True): 180 * GB})
    assert measured.allreduce_busbw(32) == pytest.approx(160 * GB)  # min(180, 160)
    slow = replace(four, allreduce_busbw_table={(16, True): 90 * GB})
    assert slow.allreduce_busbw(32) == pytest.approx(90 * GB)  # min(90, 160)


def test_make_cluster_rejects_unknown_gpu():
    with pytest.raises(ClusterError, match="gpu='v100-16g': unknown; choose one of a100-40g"):
        make_cluster("v100-16g", num_nodes=1)


def test_a_size_measured_in_one_flavour_only_answers_for_the_other():
    # A 2-rank profiler run measures only the consecutive pair; a strided pair of the same two
    # ranks must use that number (it used to find no neighbour and crash the search).
    spec = ClusterSpec(name="t", num_nodes=1, devices_per_node=2, device_name="cpu",
                       device_memory_bytes=8 * 2**30, memory_reserve_bytes=0,
                       peak_flops={"fp32": 1e11}, allreduce_busbw_table={(2, True): 0.8e9})
    assert spec.allreduce_busbw(2, consecutive=False) == 0.8e9
    # all-reduce of 1e9 bytes over 2 ranks: 2*(1/2)*1e9/0.8e9 s + latency
    assert abs(spec.allreduce_time(1e9, 2, consecutive=False)
               - (1.25 + spec.collective_latency_s)) < 1e-9
