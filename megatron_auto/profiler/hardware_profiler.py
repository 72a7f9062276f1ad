"""Hardware profiler: measure this cluster's communication and compute, write a ClusterSpec.

Run it on the machines you will train on, one process per device::

    torchrun --nproc-per-node 4 -m megatron_auto.cli profile-hardware --out cluster.json

(the flags and the torchrun set-up live in ``profiler/cli.py``; this module measures).

What it measures (everything with torch.distributed: gloo on CPU, nccl on GPU):

- all-reduce, all-gather and reduce-scatter over groups of every power-of-two size ``g`` up to
  the world, both *consecutive* (blocks of ``g`` adjacent ranks) and *strided* (members
  ``N/g`` apart, like Galvatron and ``ClusterSpec``'s default span), all groups of a partition at
  once (as the TP or DP groups of a plan run); ``t = latency + factor * S / busbw`` is fitted
  over several message sizes per group (``comm_bench.fit_latency_bandwidth``);
- p2p bandwidth per pipeline degree ``pp``: ranks of stage ``2k`` send to the same local index
  of stage ``2k+1``;
- node boundaries from torchrun's ``LOCAL_WORLD_SIZE`` (node ``j`` = ranks ``[jD, (j+1)D)``),
  checked against where every rank really runs (:func:`detect_nodes`: torchrun's node rank
  ``GROUP_RANK``, else the host name, gathered over the world); a group touching several
  nodes feeds the inter-node numbers;
- the compute/communication overlap slowdown (``comm_bench.overlap_slowdown``);
- ZeRO's all-gather and reduce-scatter as the runtime issues them (FSDP2 units over the world,
  ``comm_bench.zero_collectives``), fitted like the raw collectives;
- the step after backward (gradient norm, clipping, AdamW) per parameter and fixed
  (``comm_bench.optimizer_step_times``);
- matmul FLOP/s: on known GPUs (A100/H100/H200) the spec-sheet peak is kept and the measured
  fraction becomes ``compute_efficiency``; elsewhere (CPU, unknown GPUs) the measured rate *is*
  the peak and the efficiency is 1.

Rank 0 writes the ``megatron_auto.cluster`` JSON; ``--raw-out`` adds every timing for the record.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import socket
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..layout import tp_group_ranks
from ..parallel.device import resolve_device
from ..planner.inputs.hardware import GiB, ClusterSpec
from ..planner.inputs.presets import FRAGMENTATION_FRACTION, make_cluster
from ..utils.progress import Progress
from . import comm_bench as cb

DEFAULT_CPU_SIZES = (1 << 16, 1 << 20, 1 << 22)  # bytes; 64 KiB .. 4 MiB keeps 4 CPU ranks < 30 s
DEFAULT_GPU_SIZES = (1 << 20, 1 << 24, 1 << 27)  # 1 MiB .. 128 MiB: past NCCL's latency regime
# Parameters per optimizer-step timing: enough for a clear slope, a few ms each on a CPU core.
CPU_OPTIMIZER_COUNTS = (1 << 17, 1 << 20)
GPU_OPTIMIZER_COUNTS = (1 << 22, 1 << 26)
# What a profile measures; part of --auto-parallel's cache key, so that a profile cached by an
# older profiler is measured again instead of silently lacking its changes (revision 2: ZeRO and
# optimizer-step timings; 3: communication timed after compute, as a step issues it; 4: ZeRO
# gather and reduce-scatter each measured directly, the unit variants interleaved per round;
# 5: collective and p2p message sizes timed in interleaved rounds).
PROFILER_REVISION = 5
_KNOWN_GPUS = (("H200", "h200-141g"), ("H100", "h100-80g"), ("A100", None))


@dataclass(frozen=True)
class HardwareProfilerConfig:
    """Knobs of one profiling run; defaults keep a 4-rank CPU profile well under 30 s."""

    message_sizes: tuple[int, ...] = ()  # bytes; () = DEFAULT_CPU_SIZES / DEFAULT_GPU_SIZES
    warmup_iters: int = 1
    iters: int = 10  # medians of 5 moved the fitted CPU latency by 2x between runs
    ops: tuple[str, ...] = cb.OPS
    devices_per_node: int | None = None  # None = LOCAL_WORLD_SIZE (torchrun), else the world
    matmul_size: int = 0  # 0 = 512 on CPU, 8192 on GPU
    matmul_iters: int = 3
    overlap_comm_bytes: int = 0  # 0 = the largest message size
    overlap_comm_iters: int = 4
    overlap_repeats: int = 3
    name: str | None = None

    def __post_init__(self) -> None:
        for label, value in (("warmup_iters", self.warmup_iters), ("iters", self.iters),
                             ("matmul_iters", self.matmul_iters),
                             ("overlap_comm_iters", self.overlap_comm_iters),
                             ("overlap_repeats", self.overlap_repeats)):
            if value < (0 if label == "warmup_iters" else 1):
                raise ValueError(f"hardware profiler {label}={value}: must be a positive integer")
        if any(s <= 0 for s in self.message_sizes):
            raise ValueError(f"--message-sizes {list(self.message_sizes)}: sizes must be positive "
                             f"byte counts, e.g. 65536 1048576")
        for op in self.ops:
            if op not in cb.OPS:
                raise ValueError(f"--ops {op}: unknown; choose from {', '.join(cb.OPS)}")
        if self.devices_per_node is not None and self.devices_per_node < 1:
            raise ValueError(f"--devices-per-node {self.devices_per_node}: must be >= 1")


@dataclass
class CommResult:
    """One measured (op, group shape): the sizes tried, the seconds per call, and the fit."""

    op: str
    group_size: int
    consecutive: bool
    nodes_spanned: int
    message_bytes: list[int]
    times_s: list[float]
    busbw: float = 0.0
    latency_s: float = 0.0


@dataclass
class HardwareProfile:
    """Everything one run measured; :meth:`to_cluster_spec` condenses it for the planner."""

    world_size: int
    devices_per_node: int
    device_name: str
    device_memory_bytes: int
    backend: str
    comm: list[CommResult] = field(default_factory=list)
    p2p: list[CommResult] = field(default_factory=list)  # group_size = the pipeline degree
    matmul_flops: dict[str, float] = field(default_factory=dict)
    overlap: dict[str, float] = field(default_factory=dict)
    memory_reserve_bytes: int = GiB
    zero: list[tuple[int, float, float]] = field(default_factory=list)  # bytes, gather, scatter
    optimizer: list[tuple[int, float]] = field(default_factory=list)  # parameters, seconds
    nodes: list[str] = field(default_factory=list)  # per node: where its ranks ran (the record)
    # GPU terms (docs/cost_model.md §9), measured on CUDA only (0 elsewhere): device memory one
    # NCCL communicator took (the most over the partitions' groups) and a copy's bandwidth.
    device_type: str = "cpu"
    nccl_communicator_bytes: float = 0.0
    hbm_bandwidth: float = 0.0

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.devices_per_node

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_cluster_spec(self, name: str | None = None) -> ClusterSpec:
        """The planner's view: busbw/p2p tables, latencies, overlap, device and FLOP/s."""
        allreduce = [r for r in self.comm if r.op == "allreduce"]
        in_node = [r for r in allreduce if r.nodes_spanned == 1]
        across = [r for r in allreduce if r.nodes_spanned > 1]
        table = {(r.group_size, r.consecutive): r.busbw for r in allreduce}
        # The fastest in-node group stands for the node's bus (like NVLink in a preset).
        intra = max((r.busbw for r in in_node), default=0.0) or \
            max((r.busbw for r in allreduce), default=0.0)
        # ClusterSpec models a cross-node ring as min(intra, ranks_per_node * inter_per_device),
        # so each cross-node group measures inter_per_device = busbw / ranks_per_node.
        inter = min((r.busbw / -(-r.group_size // r.nodes_spanned) for r in across),
                    default=intra)
        p2p_in = [r for r in self.p2p if r.nodes_spanned == 1]
        p2p_across = [r for r in self.p2p if r.nodes_spanned > 1]
        lat_in = [r.latency_s for r in in_node]
        lat_across = [r.latency_s for r in across]
        defaults = _ClusterDefaults()
        zero = {}
        if len(self.zero) >= 2:
            factor = cb.bus_factor("allgather", self.world_size)
            for key, column in (("gather", 1), ("scatter", 2)):
                zero[f"zero_{key}_latency_s"], zero[f"zero_{key}_busbw"] = \
                    cb.fit_latency_bandwidth([factor * row[0] for row in self.zero],
                                             [row[column] for row in self.zero])
        step = {}
        if len(self.optimizer) >= 2:
            overhead, per_second = cb.fit_latency_bandwidth([n for n, _ in self.optimizer],
                                                            [t for _, t in self.optimizer])
            step = {"step_overhead_s": overhead, "optimizer_time_per_parameter_s": 1 / per_second}
        peak, efficiency = _peak_and_efficiency(self.device_name, self.matmul_flops)
        source = (f"measured by megatron_auto's hardware profiler on "
                  f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: "
                  f"{self.world_size} ranks ({self.num_nodes} node(s) x {self.devices_per_node}), "
                  f"backend {self.backend}, torch {torch.__version__}; busbw fitted from "
                  f"t = latency + factor*S/busbw; overlap slowdown "
                  f"{self.overlap.get('slowdown', 1.0):.3f}; matmul FLOP/s "
                  + ", ".join(f"{k} {v / 1e12:.3f} T" for k, v in self.matmul_flops.items()))
        if not allreduce:
            source += "; no communication measured (world of one): bandwidths are defaults"
        return ClusterSpec(
            name=name or f"measured-{_slug(self.device_name)}-{self.num_nodes}x{self.devices_per_node}",
            num_nodes=self.num_nodes, devices_per_node=self.devices_per_node,
            device_name=self.device_name, device_memory_bytes=self.device_memory_bytes,
            peak_flops=peak, compute_efficiency=efficiency,
            overlap_slowdown=max(1.0, float(self.overlap.get("slowdown", 1.0))),
            memory_reserve_bytes=min(self.memory_reserve_bytes, self.device_memory_bytes // 2),
            source=source,
            intra_node_busbw=intra or defaults.intra_node_busbw,
            inter_node_bw_per_device=inter or defaults.inter_node_bw_per_device,
            p2p_intra_bw=max((r.busbw for r in p2p_in), default=0.0) or defaults.p2p_intra_bw,
            p2p_inter_bw=min((r.busbw for r in p2p_across), default=0.0)
            or max((r.busbw for r in p2p_in), default=0.0) or defaults.p2p_inter_bw,
            collective_latency_s=statistics.median(lat_in) if lat_in
            else defaults.collective_latency_s,
            inter_node_latency_s=statistics.median(lat_across) if lat_across
            else (statistics.median(lat_in) if lat_in else defaults.inter_node_latency_s),
            p2p_latency_s=statistics.median([r.latency_s for r in self.p2p]) if self.p2p
            else defaults.p2p_latency_s,
            allreduce_busbw_table=table,
            p2p_bw_table={r.group_size: r.busbw for r in self.p2p}, **zero, **step,
            **self._gpu_terms())

    def _gpu_terms(self) -> dict[str, Any]:
        """The cluster's GPU fields: measured HBM bandwidth and NCCL communicator bytes, the
        flash kernel and fused AdamW (what the runtime uses on CUDA), and the presets' assumed
        fragmentation (measured per plan by benchmarks/gpu_check.py). Nothing on CPU."""
        if self.device_type != "cuda":
            return {}
        return {"hbm_bandwidth": self.hbm_bandwidth, "attention_backend": "flash",
                "fused_optimizer": True,
                "nccl_communicator_bytes": float(self.nccl_communicator_bytes),
                "fragmentation_fraction": FRAGMENTATION_FRACTION}


class _ClusterDefaults:
    """ClusterSpec's own field defaults, for fields a run could not measure (e.g. no nodes to
    cross on one machine)."""

    def __getattr__(self, name: str) -> Any:
        return ClusterSpec.__dataclass_fields__[name].default


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def _peak_and_efficiency(device_name: str, measured: dict[str, float]) -> tuple[dict[str, float], float]:
    """Spec peaks and measured efficiency on a known GPU; measured peaks (efficiency 1) elsewhere."""
    for marker, key in _KNOWN_GPUS:
        if marker in device_name:
            if key is None:  # A100: the memory size decides which preset
                key = "a100-80g" if "80" in device_name else "a100-40g"
            spec = dict(make_cluster(key, 1, 1).peak_flops)
            ref = "bf16" if "bf16" in measured else next(iter(measured), None)
            if ref is None or ref not in spec:
                return spec, make_cluster(key, 1, 1).compute_efficiency
            return spec, min(1.0, max(0.05, measured[ref] / spec[ref]))
    return dict(measured), 1.0


# ------------------------------------------------------------------------------ group shapes
def partition_groups(world_size: int, group_size: int, consecutive: bool) -> list[list[int]]:
    """The groups of ``group_size`` that partition the world: adjacent blocks or stride ``N/g``."""
    if world_size % group_size:
        raise ValueError(f"group size {group_size} does not divide world size {world_size}")
    # The world read as one stage: the TP groups of that layout (megatron_auto.layout).
    return tp_group_ranks(list(range(world_size)), group_size, consecutive)


def group_shapes(world_size: int) -> list[tuple[int, bool]]:
    """Power-of-two sizes from 2 up to the world (and the world itself), strided when distinct."""
    sizes, g = [], 2
    while g <= world_size:
        if world_size % g == 0:
            sizes.append(g)
        g *= 2
    if world_size >= 2 and world_size not in sizes:
        sizes.append(world_size)
    return [(g, c) for g in sizes for c in ((True, False) if g < world_size else (True,))]


def nodes_of(ranks: Sequence[int], devices_per_node: int) -> int:
    return len({r // devices_per_node for r in ranks})


def _node_key() -> str:
    """Where this rank runs: torchrun's node rank (``GROUP_RANK``: it tells apart two agents on
    one host, as in the CPU test) with the host name, or the host name alone."""
    host = socket.gethostname()
    group = os.environ.get("GROUP_RANK")
    return f"node {group} ({host})" if group is not None else host


def detect_nodes(world_size: int, devices_per_node: int) -> list[str]:
    """Collective: the node of every rank, checked against ``devices_per_node`` blocks.

    The planner (``ClusterSpec``) and the runtime's consecutive TP groups take node ``j`` to be
    ranks ``[jD, (j+1)D)``; torchrun assigns ranks that way. A launch where ranks of one node
    are not such a block (another launcher, a different process count per node) would make
    every intra/inter-node number wrong, so it stops with the ranks of each node named.
    Returns one name per node, in rank order.
    """
    keys = [_node_key()] * world_size
    if dist.is_initialized() and world_size > 1:
        dist.all_gather_object(keys, _node_key())
    blocks = [keys[j * devices_per_node:(j + 1) * devices_per_node]
              for j in range(world_size // devices_per_node)]
    if any(len(set(block)) != 1 for block in blocks) or len({b[0] for b in blocks}) != len(blocks):
        where = {key: [r for r, k in enumerate(keys) if k == key] for key in dict.fromkeys(keys)}
        raise ValueError(
            f"ranks per node {where} are not blocks of {devices_per_node} consecutive ranks "
            f"(LOCAL_WORLD_SIZE or --devices-per-node); launch with torchrun, the same "
            f"--nproc-per-node on every node")
    return [block[0] for block in blocks]


# ----------------------------------------------------------------------------- the profiler
def _device() -> torch.device:
    """CUDA (the current device, which the launcher or ``cli.profile_hardware_from_args``
    selected) unless the process group is gloo; then CPU."""
    return resolve_device()


def _device_info(device: torch.device, local_world: int) -> tuple[str, int, int]:
    """(name, memory bytes per device, framework reserve bytes) of this rank's device."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        # Memory used outside PyTorch's allocator (CUDA context, NCCL buffers) plus a fixed
        # allocator/fragmentation allowance; `calibrate` refines it from measured runs.
        outside = max(0, total - free - torch.cuda.memory_reserved(device))
        return props.name, int(props.total_memory), int(outside + GiB // 2)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    per_rank = int(pages // max(1, local_world))
    # On CPU there is no device context and the runtime measures peak memory as the bytes of
    # live tensors (parallel/memory.py), so the planner's reserve must not add a GPU-style
    # allowance on top: plans and measurements then speak about the same quantity.
    return f"cpu-{platform.machine() or 'unknown'}", per_rank, 0


def outside_allocator_bytes(device: torch.device) -> int | None:
    """Device bytes in use outside PyTorch's caching allocator (CUDA context, NCCL buffers);
    None off CUDA. ``torch.cuda.mem_get_info`` is the driver's view of the whole device, so the
    allocator's own ``memory_reserved`` is taken off."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free - torch.cuda.memory_reserved(device))


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, iters: int = 10) -> float:
    """Bytes/s a device-to-device copy moves (each byte read and written once, counted
    twice): the sustained HBM bandwidth element-wise kernels reach."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    return 2.0 * nbytes / seconds


def profile_hardware(config: HardwareProfilerConfig = HardwareProfilerConfig()) -> HardwareProfile:
    """Measure the cluster; collective over the world (call on every rank, same ``config``).

    Works without torch.distributed initialised (a world of one: compute only). Every rank
    returns the same :class:`HardwareProfile` (timings are maxima over ranks).
    """
    device = _device()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    local = config.devices_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise ValueError(f"devices per node {local} (LOCAL_WORLD_SIZE or --devices-per-node) must "
                         f"divide the world size {world}; launch the same number of ranks per node")
    sizes = config.message_sizes or (DEFAULT_GPU_SIZES if device.type == "cuda" else DEFAULT_CPU_SIZES)
    name, memory, reserve = _device_info(device, local)
    backend = dist.get_backend() if dist.is_initialized() else "none"
    # --devices-per-node states the node size on purpose (e.g. pretend nodes on one host);
    # otherwise the launcher's node size is checked against where the ranks really run.
    nodes = (detect_nodes(world, local) if config.devices_per_node is None
             else [f"node {j} (--devices-per-node {local})" for j in range(world // local)])
    profile = HardwareProfile(world_size=world, devices_per_node=local, device_name=name,
                              device_memory_bytes=memory, backend=backend,
                              memory_reserve_bytes=reserve, nodes=nodes)

    profile.device_type = device.type
    gap = cb.compute_gap(device)  # calls are timed after compute, as a training step issues them
    shapes = group_shapes(world)
    pps = sorted({g for g, _ in shapes})
    # Collectives per group shape and op, p2p per pipeline degree, then matmuls, overlap, ZeRO
    # and the optimizer step; rank 0 reports.
    progress = Progress("megatron-auto profile-hardware", len(shapes) * len(config.ops)
                        + len(pps) + 4, "measurements", enabled=rank == 0, delay_s=2.0)
    nccl = 0
    for g, consecutive in shapes:
        groups = partition_groups(world, g, consecutive)
        outside = outside_allocator_bytes(device)  # before this partition's communicator exists
        handles = [dist.new_group(ranks) for ranks in groups]  # collective: every rank, same order
        mine = next(i for i, ranks in enumerate(groups) if rank in ranks)
        spanned = max(nodes_of(ranks, local) for ranks in groups)
        for op in config.ops:
            steps = [cb.collective_step(op, nbytes, handles[mine], g, device) for nbytes in sizes]
            times = cb.time_calls(steps, config.warmup_iters, config.iters, device, before=gap)
            if outside is not None:  # NCCL makes the communicator at its first collective
                nccl = max(nccl, outside_allocator_bytes(device) - outside)
                outside = None
            times = cb.world_max(times, device)
            result = CommResult(op, g, consecutive, spanned, list(sizes), times)
            result.latency_s, result.busbw = cb.fit_latency_bandwidth(
                [cb.bus_factor(op, g) * s for s in sizes], times)
            profile.comm.append(result)
            progress.update(1, last=f"{op} over {g} ranks")
        # Free this partition's communicators (NCCL buffers would otherwise stay allocated in
        # a training process that profiles before it trains).
        if handles[mine] is not None and handles[mine] != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(handles[mine])

    for pp in pps:
        stage = world // pp
        peer, sender = None, False
        if (rank // stage) % 2 == 0 and rank // stage + 1 < pp:
            peer, sender = rank + stage, True
        elif (rank // stage) % 2 == 1:
            peer = rank - stage
        senders = [r for r in range(world) if (r // stage) % 2 == 0 and r + stage < world]
        spanned = max(nodes_of([r, r + stage], local) for r in senders)
        steps = [cb.p2p_step(nbytes, peer, sender, device) for nbytes in sizes]
        times = cb.world_max(cb.time_calls(steps, config.warmup_iters, config.iters, device,
                                            before=gap), device)
        result = CommResult("p2p", pp, True, spanned, list(sizes), times)
        result.latency_s, result.busbw = cb.fit_latency_bandwidth(list(sizes), times)
        profile.p2p.append(result)
        progress.update(1, last=f"p2p at pp {pp}")

    mm_size = config.matmul_size or (8192 if device.type == "cuda" else 512)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if device.type == "cuda":
        dtypes["fp16"] = torch.float16
    for prec, dtype in dtypes.items():
        # CPU bf16 matmuls are slow (no matrix units on most CPUs): a smaller one suffices.
        size = mm_size if prec == "fp32" or device.type == "cuda" else max(64, mm_size // 2)
        rate = cb.matmul_flops(device, dtype, size, config.matmul_iters)
        # The slowest rank's rate (the planner paces a step by its slowest device).
        profile.matmul_flops[prec] = -cb.world_max([-rate], device)[0]
    progress.update(1, last="matmul")

    profile.overlap = cb.overlap_slowdown(
        device, min(mm_size, 2048) if device.type == "cuda" else max(64, mm_size // 2),
        config.overlap_comm_bytes or max(sizes), config.overlap_comm_iters, config.overlap_repeats)
    progress.update(1, last="overlap")
    profile.zero = cb.zero_collectives(device, sizes, config.warmup_iters, config.iters)
    progress.update(1, last="ZeRO collectives")
    if device.type == "cuda":
        profile.nccl_communicator_bytes = float(cb.world_max([float(nccl)], device)[0])
        profile.hbm_bandwidth = -cb.world_max([-copy_bandwidth(device)], device)[0]
    profile.optimizer = cb.optimizer_step_times(
        device, GPU_OPTIMIZER_COUNTS if device.type == "cuda" else CPU_OPTIMIZER_COUNTS,
        config.warmup_iters, config.iters)
    progress.update(1, last="optimizer step")
    progress.close()
    return profile
