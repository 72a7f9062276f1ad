"""Named cluster presets built from public hardware facts, and ``get_cluster``.

Preset names follow ``<gpu>-<memory>-<nodes>x<devices>`` (docs/design.md §5.1), e.g. ``a100-40g-1x8``.
Every number carries its origin in the preset's ``source`` string (docs/hardware.md tabulates
them): NVIDIA's A100/H100/H200 datasheets (dense peak FLOP/s, memory, NVLink), the published
nccl-tests bus-bandwidth tables for 8-GPU NVSwitch nodes, the measured A100 1x8 and 2x8 profiles
that ship with the hetu-galvatron 2.4.0 package, InfiniBand HDR/NDR port rates, and an 8192^3
bf16 matmul and a device copy measured on an H200 by this project. Where no public figure exists
we say "assumed" and choose the conservative side.

A measured profile (``--cluster FILE``, written by the hardware profiler or by
``megatron-auto import-galvatron``) always overrides a preset.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .hardware import GB, GiB, ClusterError, ClusterSpec

# Framework reserve per device: the upper end of the 0.5-1.5 GB PyTorch context + allocator
# overhead commonly reported per GPU (Galvatron budgets 1 GB); conservative until calibrated.
RESERVE_BYTES = int(1.5 * GiB)
# An 8192^3 bf16 matmul ran at 769-798 TFLOP/s on an H200 (989 peak): 0.78 is the low end.
MEASURED_MATMUL_EFFICIENCY = 0.78
# Galvatron 2.4's shipped overlap coefficient, measured on its A100 nodes.
GALVATRON_OVERLAP = 1.1256
# Assumed achievable fraction of InfiniBand line rate (no measurement available).
IB_EFFICIENCY = 0.8
# The optimizer step is memory-bound: per fp32 parameter the gradient norm reads the gradient
# (4 B), clipping rewrites it (8 B), AdamW reads parameter, gradient and both moments (16 B) and
# writes parameter and moments back (12 B): 40 B of HBM traffic.
OPTIMIZER_BYTES_PER_PARAMETER = 40
# A device-to-device copy moved about 4.3 of the 4.8 TB/s on an H200 (measured by this project).
MEASURED_HBM_EFFICIENCY = 0.9
# Kernel launches of the step and the gradient norm's scalar all-reduce: assumed, no measurement.
STEP_OVERHEAD_S = 0.5e-3
# NCCL communicator buffers per process group on a rank: NCCL_BUFFSIZE's documented default of
# 4 MiB (NCCL user guide, environment variables) per channel and direction (send, receive);
# 8 channels assumed. Outside the caching allocator. The hardware profiler measures it.
NCCL_BUFFSIZE = 4 * 2**20
NCCL_CHANNELS_ASSUMED = 8
NCCL_COMMUNICATOR_BYTES = 2 * NCCL_CHANNELS_ASSUMED * NCCL_BUFFSIZE
# Caching-allocator fragmentation: reserved beyond allocated, as a fraction of the activations
# and transients (the CUDA memory-management notes describe the cause, not a size): assumed 5%
# until the hardware profiler measures it after a training step.
FRAGMENTATION_FRACTION = 0.05
# Host<->device link per GPU: one PCIe x16 link at its per-direction line rate (PCIe 4.0:
# 16 GT/s x 16 lanes x 128b/130b = 31.5 GB/s, A100 SXM4; PCIe 5.0: 63 GB/s, H100/H200 SXM),
# of which 80% is assumed achievable by pinned copies (no measurement available); GPUs sharing a
# PCIe switch's uplink copying at once would get less, which is not modelled.
PCIE_X16_BW = {4: 31.5 * GB, 5: 63.0 * GB}
HOST_LINK_EFFICIENCY = 0.8
# The host's AdamW step under optimizer offload: torch's foreach AdamW over fp32 masters on the
# CPU cores of a node, assumed at 1e9 elements/s for the whole host (memory-bound: ~28 B of
# traffic per element, a few passes, on a two-socket server; no measurement available), shared
# by the node's GPUs when all of them offload at once.
HOST_ADAM_ELEMENTS_PER_S_PER_NODE = 1e9


@dataclass(frozen=True)
class _Gpu:
    device_name: str
    memory_bytes: int
    peak_flops: dict
    nvlink_busbw: float  # 8-GPU NVSwitch all-reduce busbw, low end of nccl-tests tables
    nic_bw: float  # one InfiniBand port per GPU, line rate
    hbm_bw: float  # bytes/s, spec sheet
    pcie_gen: int  # the host link, PCIe x16 of this generation (spec sheet)
    flops_source: str
    busbw_source: str
    nic_source: str


_GPUS: dict[str, _Gpu] = {
    "a100-40g": _Gpu(
        "A100-SXM4-40GB", 40 * 10**9, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
        230 * GB, 25 * GB, 1.56e12, 4,
        "peak 312 TFLOP/s bf16/fp16 (spec sheet, dense), 19.5 TFLOP/s fp32 (spec sheet, no TF32)",
        "NVLink all-reduce busbw 230 GB/s (low end of nccl-tests 8xA100 NVSwitch 230-250 GB/s)",
        "InfiniBand HDR 200 Gb/s = 25 GB/s per port, one port per GPU (DGX A100)"),
    "a100-80g": _Gpu(
        "A100-SXM4-80GB", 80 * 10**9, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
        230 * GB, 25 * GB, 2.04e12, 4,
        "peak 312 TFLOP/s bf16/fp16 (spec sheet, dense), 19.5 TFLOP/s fp32 (spec sheet, no TF32)",
        "NVLink all-reduce busbw 230 GB/s (low end of nccl-tests 8xA100 NVSwitch 230-250 GB/s)",
        "InfiniBand HDR 200 Gb/s = 25 GB/s per port, one port per GPU (DGX A100)"),
    "h100-80g": _Gpu(
        "H100-SXM5-80GB", 80 * 10**9,
        {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "fp32": 67e12},
        460 * GB, 50 * GB, 3.35e12, 5,
        "peak 989 TFLOP/s bf16/fp16, 1979 fp8 (spec sheet, dense), 67 TFLOP/s fp32 (spec sheet)",
        "NVLink all-reduce busbw 460 GB/s (low end of nccl-tests 8xH100 460-480 GB/s)",
        "InfiniBand NDR 400 Gb/s = 50 GB/s per port, one port per GPU (DGX H100)"),
    "h200-141g": _Gpu(
        "H200-SXM-141GB", 141 * 10**9,
        {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "fp32": 67e12},
        460 * GB, 50 * GB, 4.8e12, 5,
        "peak 989 TFLOP/s bf16/fp16, 1979 fp8 (spec sheet, dense; same die as H100), "
        "67 TFLOP/s fp32 (H100 spec sheet, assumed equal)",
        "NVLink all-reduce busbw 460 GB/s (nccl-tests 8xH100 low end; same NVLink 4/NVSwitch, "
        "assumed equal)",
        "InfiniBand NDR 400 Gb/s = 50 GB/s per port, one port per GPU (assumed DGX-like)"),
}

# Galvatron 2.4's measured A100 profiles (shipped in hetu-galvatron 2.4.0): all-reduce busbw by (group, consecutive).
_GALVATRON_1X8_ALLREDUCE = {(8, True): 154.203, (4, True): 159.119, (4, False): 155.815,
                            (2, True): 138.156, (2, False): 151.344}
_GALVATRON_1X8_P2P = {2: 163.671, 4: 138.581, 8: 109.45}
_GALVATRON_2X8_ALLREDUCE = {(16, True): 44.7, (8, True): 155.7, (8, False): 20.8,
                            (4, True): 158.0, (4, False): 16.2, (2, True): 149.7, (2, False): 8.1}
_GALVATRON_2X8_P2P_ACROSS = 8.0

PRESET_NAMES: tuple[str, ...] = tuple(
    [f"{gpu}-{n}x8" for gpu in ("a100-40g", "a100-80g", "h100-80g") for n in (1, 2, 4, 8)]
    + ["h200-141g-1x8"])

_NAME_RE = re.compile(r"^(?P<gpu>[a-z0-9]+-\d+g)-(?P<nodes>\d+)x(?P<dev>\d+)$")


def make_cluster(gpu: str, num_nodes: int, devices_per_node: int = 8,
                 name: str | None = None) -> ClusterSpec:
    """A cluster of ``num_nodes`` DGX-like nodes of ``gpu`` built from public facts only.

    ``gpu`` is one of ``a100-40g, a100-80g, h100-80g, h200-141g``. Intra-node groups get the
    NVLink busbw; groups crossing nodes are limited by one InfiniBand port per member GPU at
    ``IB_EFFICIENCY`` of line rate. Use it for clusters no preset covers (e.g. 128x8 for a
    1024-GPU study).
    """
    if gpu not in _GPUS:
        raise ClusterError(f"gpu={gpu!r}: unknown; choose one of {', '.join(sorted(_GPUS))}")
    for label, value in (("num_nodes", num_nodes), ("devices_per_node", devices_per_node)):
        if not isinstance(value, int) or value < 1:
            raise ClusterError(f"{label}={value!r}: must be a positive integer")
    g = _GPUS[gpu]
    inter = g.nic_bw * IB_EFFICIENCY
    source = "; ".join([
        g.flops_source,
        f"compute efficiency {MEASURED_MATMUL_EFFICIENCY} (8192^3 bf16 matmul measured at "
        f"769-798 TFLOP/s on an H200{'' if gpu.startswith('h') else ', assumed to carry over'})",
        f"memory {g.memory_bytes / 1e9:.0f} GB (spec sheet, decimal GB: conservative)",
        f"reserve {RESERVE_BYTES / GiB:.1f} GiB (upper end of 0.5-1.5 GB context+allocator)",
        f"overlap slowdown {GALVATRON_OVERLAP} (Galvatron 2.4 measured on A100, assumed)",
        g.busbw_source,
        g.nic_source + f"; {IB_EFFICIENCY:.0%} of line rate assumed achievable",
        "p2p within a node assumed equal to the all-reduce busbw (Galvatron's A100 1x8: p2p "
        "163.7 vs all-reduce 154.2 GB/s)",
        "latency 20 us in-node / 40 us across nodes per collective (NCCL: tens of us per call)",
        f"optimizer step {OPTIMIZER_BYTES_PER_PARAMETER} B of HBM traffic per parameter at "
        f"{MEASURED_HBM_EFFICIENCY:.0%} of {g.hbm_bw / 1e12:.2f} TB/s (spec sheet; efficiency of "
        f"a device copy measured on an H200), {STEP_OVERHEAD_S * 1e3:.1f} ms fixed (assumed)",
        f"element-wise work and memory-bound matmuls at the same {MEASURED_HBM_EFFICIENCY:.0%} of "
        f"HBM bandwidth; attention priced as SDPA flash (no stored scores, causal half); fused "
        f"AdamW (torch, CUDA, plain tensors)",
        f"NCCL {NCCL_COMMUNICATOR_BYTES / 2**20:.0f} MiB per communicator (NCCL_BUFFSIZE default "
        f"4 MiB x 2 directions x {NCCL_CHANNELS_ASSUMED} channels, channel count assumed)",
        f"allocator fragmentation {FRAGMENTATION_FRACTION:.0%} of activations and transients "
        f"(assumed)",
        f"host link PCIe {g.pcie_gen}.0 x16, {PCIE_X16_BW[g.pcie_gen] / GB:.1f} GB/s per "
        f"direction (spec), {HOST_LINK_EFFICIENCY:.0%} assumed achievable",
        f"host AdamW (optimizer offload) {HOST_ADAM_ELEMENTS_PER_S_PER_NODE:.0e} elements/s per "
        f"node shared by its {devices_per_node} devices (assumed)",
    ])
    return ClusterSpec(
        name=name or f"{gpu}-{num_nodes}x{devices_per_node}", num_nodes=num_nodes,
        devices_per_node=devices_per_node, device_name=g.device_name,
        device_memory_bytes=g.memory_bytes, peak_flops=dict(g.peak_flops),
        compute_efficiency=MEASURED_MATMUL_EFFICIENCY, overlap_slowdown=GALVATRON_OVERLAP,
        memory_reserve_bytes=RESERVE_BYTES, source=source,
        intra_node_busbw=g.nvlink_busbw, inter_node_bw_per_device=inter,
        p2p_intra_bw=g.nvlink_busbw, p2p_inter_bw=inter,
        collective_latency_s=20e-6, inter_node_latency_s=40e-6, p2p_latency_s=10e-6,
        optimizer_time_per_parameter_s=OPTIMIZER_BYTES_PER_PARAMETER / (
            MEASURED_HBM_EFFICIENCY * g.hbm_bw),
        step_overhead_s=STEP_OVERHEAD_S, **_gpu_terms(g),
        host_optimizer_time_per_parameter_s=devices_per_node / HOST_ADAM_ELEMENTS_PER_S_PER_NODE)


def _gpu_terms(g: _Gpu) -> dict:
    """The GPU cost terms of a preset (docs/cost_model.md §9), sources in ``make_cluster``."""
    return dict(hbm_bandwidth=MEASURED_HBM_EFFICIENCY * g.hbm_bw, attention_backend="flash",
                fused_optimizer=True, nccl_communicator_bytes=float(NCCL_COMMUNICATOR_BYTES),
                fragmentation_fraction=FRAGMENTATION_FRACTION,
                host_link_bw=HOST_LINK_EFFICIENCY * PCIE_X16_BW[g.pcie_gen])


def _galvatron_a100(num_nodes: int) -> ClusterSpec:
    """a100-40g-1x8 / -2x8: Galvatron 2.4's measured A100-SXM4-40GB clusters, for comparisons."""
    base = make_cluster("a100-40g", num_nodes, 8)
    if num_nodes == 1:
        table = {k: v * GB for k, v in _GALVATRON_1X8_ALLREDUCE.items()}
        p2p_table = {k: v * GB for k, v in _GALVATRON_1X8_P2P.items()}
        inter = base.inter_node_bw_per_device  # unused on one node
        p2p_inter = base.p2p_inter_bw
        note = ("all-reduce busbw and p2p bandwidth tables: Galvatron 2.4's measured 1x8 A100 "
                "profile (8: 154.2; 4: 159.1/155.8; 2: 138.2/151.3 GB/s; p2p 163.7/138.6/109.5)")
    else:
        table = {k: v * GB for k, v in _GALVATRON_2X8_ALLREDUCE.items()}
        p2p_table = {}
        # Per-GPU share of the inter-node link implied by the cross-node measurements: the
        # slowest of busbw / member-GPUs-per-node (16: 44.7/8, 8 strided: 20.8/4, ...).
        inter = min(44.7 / 8, 20.8 / 4, 16.2 / 2, 8.1 / 1) * GB
        p2p_inter = _GALVATRON_2X8_P2P_ACROSS * GB
        note = ("all-reduce busbw table: Galvatron 2.4's measured 2x8 A100 profile (16: 44.7; "
                "8: 155.7/20.8; 4: 158.0/16.2; 2: 149.7/8.1 GB/s); inter-node 5.2 GB/s per GPU "
                "derived from it; p2p across nodes 8 GB/s (measured)")
    return ClusterSpec(
        name=f"a100-40g-{num_nodes}x8", num_nodes=num_nodes, devices_per_node=8,
        device_name=base.device_name, device_memory_bytes=base.device_memory_bytes,
        peak_flops=base.peak_flops, compute_efficiency=base.compute_efficiency,
        overlap_slowdown=base.overlap_slowdown, memory_reserve_bytes=base.memory_reserve_bytes,
        source=note + "; " + base.source,
        intra_node_busbw=base.intra_node_busbw, inter_node_bw_per_device=inter,
        p2p_intra_bw=_GALVATRON_1X8_P2P[2] * GB, p2p_inter_bw=p2p_inter,
        collective_latency_s=base.collective_latency_s,
        inter_node_latency_s=base.inter_node_latency_s, p2p_latency_s=base.p2p_latency_s,
        allreduce_busbw_table=table, p2p_bw_table=p2p_table,
        optimizer_time_per_parameter_s=base.optimizer_time_per_parameter_s,
        step_overhead_s=base.step_overhead_s, **_gpu_terms(_GPUS["a100-40g"]),
        host_optimizer_time_per_parameter_s=base.host_optimizer_time_per_parameter_s)


def preset(name: str) -> ClusterSpec:
    """The named preset (one of ``PRESET_NAMES``)."""
    if name not in PRESET_NAMES:
        raise ClusterError(_unknown_message(name))
    if name in ("a100-40g-1x8", "a100-40g-2x8"):
        return _galvatron_a100(int(name.split("-")[2][0]))
    m = _NAME_RE.match(name)
    assert m is not None  # every preset name follows the pattern
    return make_cluster(m["gpu"], int(m["nodes"]), int(m["dev"]), name=name)


def _unknown_message(name: str) -> str:
    return (f"--cluster {name}: not a preset name and no such file; presets are "
            f"{', '.join(PRESET_NAMES)} (any <gpu>-<memory>-<nodes>x<devices> with gpu in "
            f"{', '.join(sorted(_GPUS))} also works, e.g. h100-80g-128x8), or give a cluster "
            f"JSON file written by the hardware profiler or `megatron-auto import-galvatron`")


def get_cluster(name_or_path: str | os.PathLike) -> ClusterSpec:
    """Resolve ``--cluster``: a preset name, a ``<gpu>-<mem>-<N>x<D>`` pattern, or a JSON file."""
    text = os.fspath(name_or_path)
    if text in PRESET_NAMES:
        return preset(text)
    if os.path.exists(text) or text.endswith(".json"):
        return ClusterSpec.load(text)
    m = _NAME_RE.match(text)
    if m and m["gpu"] in _GPUS and int(m["nodes"]) >= 1 and int(m["dev"]) >= 1:
        return make_cluster(m["gpu"], int(m["nodes"]), int(m["dev"]), name=text)
    raise ClusterError(_unknown_message(text))
