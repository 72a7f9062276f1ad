"""Cluster descriptions: compute, memory and communication costs of a GPU cluster.

A :class:`ClusterSpec` answers the cost model's hardware questions in seconds: how long an
all-reduce / all-gather / reduce-scatter of ``S`` bytes takes over a group of ``g`` ranks, how long
a pipeline p2p hop takes, and how many FLOP/s a device sustains. Numbers come either from a
measured profile (the hardware profiler, or an imported Galvatron profile) or from public facts
(presets, ``presets.py``); ``source`` records which.

Units: bytes, bytes per second (1 GB/s = 1e9 B/s, as nccl-tests reports), seconds, FLOP/s.

Ring collectives (nccl-tests "bus bandwidth" convention)::

    all-reduce      t = 2(g-1)/g * S / busbw + latency
    all-gather      t =  (g-1)/g * S / busbw + latency     (S = the gathered, total size)
    reduce-scatter  t =  (g-1)/g * S / busbw + latency     (S = the input, total size)

Rank placement: node ``j`` holds ranks ``[j*D, (j+1)*D)`` (``D`` = devices per node). A
*consecutive* group of ``g`` ranks is an aligned block; a *strided* group spreads its ``g`` ranks
evenly over ``span`` adjacent ranks (stride ``span/g``; by default the whole world, like
Galvatron's measurements). The number of nodes a group touches decides its bandwidth: inside one
node the NVLink bus bandwidth; across nodes each node's share of the ring leaves through the NICs
of its member GPUs, so ``busbw = min(NVLink busbw, ranks_per_node * inter-node bandwidth per GPU)``.
A measured table, when present, overrides this topology estimate for the sizes it measured;
unmeasured sizes take the smaller (slower) of their measured neighbours and never more than the
topology estimate, so gaps are filled conservatively.

The JSON form (``format: "megatron_auto.cluster"``, ``version: 1``) is what the hardware profiler
writes and ``--cluster FILE`` reads; see docs/hardware.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ...utils.jsonfile import read_json, write_json

CLUSTER_FORMAT = "megatron_auto.cluster"
CLUSTER_VERSION = 1
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# SDPA kernels (torch.nn.attention.SDPBackend names, lower case) the cost model knows.
ATTENTION_BACKENDS = ("math", "flash", "efficient", "cudnn")
GB = 1e9  # bandwidth unit of nccl-tests and Galvatron profiles
GiB = 2**30


class ClusterError(ValueError):
    """An invalid cluster description; the message names the field, the value and the fix."""


def _need(cond: bool, name: str, value: Any, fix: str) -> None:
    if not cond:
        raise ClusterError(f"cluster field {name}={value!r}: {fix}")


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster of ``num_nodes`` nodes with ``devices_per_node`` devices each.

    Bandwidths are in bytes/s, latencies in seconds, memory in bytes, ``peak_flops`` in FLOP/s
    per device and precision. ``allreduce_busbw_table`` maps ``(group_size, consecutive)`` to a
    measured all-reduce bus bandwidth; ``p2p_bw_table`` maps a pipeline degree to a measured
    p2p bandwidth between adjacent stages. Both may be empty (topology estimate only).
    """

    name: str
    num_nodes: int
    devices_per_node: int
    device_name: str
    device_memory_bytes: int
    peak_flops: Mapping[str, float] = field(hash=False)
    compute_efficiency: float = 0.6
    overlap_slowdown: float = 1.1
    memory_reserve_bytes: int = GiB
    source: str = ""
    intra_node_busbw: float = 150 * GB
    inter_node_bw_per_device: float = 20 * GB
    p2p_intra_bw: float = 150 * GB
    p2p_inter_bw: float = 20 * GB
    collective_latency_s: float = 20e-6
    inter_node_latency_s: float = 40e-6
    p2p_latency_s: float = 10e-6
    allreduce_busbw_table: Mapping[tuple[int, bool], float] = field(default_factory=dict, hash=False)
    p2p_bw_table: Mapping[int, float] = field(default_factory=dict, hash=False)
    # The step after the last backward (docs/design.md §4): global gradient norm, clipping and the AdamW
    # update are memory-bound, ``optimizer_time_per_parameter_s`` per local parameter, plus a
    # fixed ``step_overhead_s`` (launches and the norm's scalar all-reduce). 0 = not modelled.
    optimizer_time_per_parameter_s: float = 0.0
    step_overhead_s: float = 0.0
    # ZeRO collectives as the runtime issues them (FSDP2: copy-in/out and bookkeeping around the
    # all-gather / reduce-scatter), measured by the hardware profiler. 0 = not measured: the raw
    # collective's latency and bandwidth apply.
    zero_gather_latency_s: float = 0.0
    zero_gather_busbw: float = 0.0
    zero_scatter_latency_s: float = 0.0
    zero_scatter_busbw: float = 0.0
    # GPU terms (docs/cost_model.md §9; planner/cost/gpu_terms.py). The defaults keep the CPU rules.
    # Sustained device-memory bandwidth (bytes/s) for element-wise / normalisation work and
    # memory-bound matmuls; 0 = not priced by bytes (a per-call constant covers it).
    hbm_bandwidth: float = 0.0
    # The SDPA kernel the analytic profile prices: "math" stores the s x s scores, "flash",
    # "efficient" and "cudnn" do not (a measured profile records its own).
    attention_backend: str = "math"
    # The runtime's AdamW is fused (CUDA with plain tensors): no foreach temporaries.
    fused_optimizer: bool = False
    # Device memory of one NCCL communicator on a rank (bytes), per process group it is in.
    nccl_communicator_bytes: float = 0.0
    # CUDA caching-allocator fragmentation: reserved beyond allocated, as a fraction of the
    # bytes that come and go each iteration (activations, transients).
    fragmentation_fraction: float = 0.0
    # Host<->device copy bandwidth per device and direction (bytes/s; pinned memory), which
    # activation offload's copies run at (planner/cost/offload.py). 0 = one memory (CPU) or not
    # known: the copies are not priced. Presets: PCIe x16 figures (docs/hardware.md).
    host_link_bw: float = 0.0
    # The host's AdamW step (optimizer offload, planner/cost/offload.py): seconds per offloaded
    # element on one device's share of the host (torch's foreach AdamW on fp32 masters).
    # 0 = the device's ``optimizer_time_per_parameter_s`` (right on CPU: one memory, one kernel).
    host_optimizer_time_per_parameter_s: float = 0.0

    def __post_init__(self) -> None:
        # Types first, so that a string in a JSON file is reported by field, not as a TypeError.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "float":  # integer fields are checked (with their own message) below
                _need(isinstance(value, (int, float)) and not isinstance(value, bool)
                      and math.isfinite(value), f.name, value, "must be a finite number")
        for name in ("peak_flops", "allreduce_busbw_table", "p2p_bw_table"):
            table = getattr(self, name)
            _need(isinstance(table, Mapping) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                for v in table.values()), name, table, "must map keys to finite numbers")
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))
        object.__setattr__(self, "allreduce_busbw_table",
                           {(int(g), bool(c)): float(v)
                            for (g, c), v in self.allreduce_busbw_table.items()})
        object.__setattr__(self, "p2p_bw_table",
                           {int(p): float(v) for p, v in self.p2p_bw_table.items()})
        self.validate()

    # ---------------------------------------------------------------- validation
    def validate(self) -> None:
        for name in ("num_nodes", "devices_per_node", "device_memory_bytes"):
            value = getattr(self, name)
            _need(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, value,
                  "must be a positive integer")
        _need(isinstance(self.memory_reserve_bytes, int) and
              0 <= self.memory_reserve_bytes < self.device_memory_bytes,
              "memory_reserve_bytes", self.memory_reserve_bytes,
              f"must be a non-negative integer below device_memory_bytes={self.device_memory_bytes}")
        _need(bool(self.peak_flops), "peak_flops", self.peak_flops,
              'give FLOP/s per precision, e.g. {"bf16": 312e12, "fp32": 19.5e12}')
        for prec, flops in self.peak_flops.items():
            _need(prec in PRECISIONS, f"peak_flops.{prec}", flops,
                  f"unknown precision; use one of {', '.join(PRECISIONS)}")
            _need(flops > 0, f"peak_flops.{prec}", flops, "must be positive (FLOP/s per device)")
        _need(0 < self.compute_efficiency <= 1, "compute_efficiency", self.compute_efficiency,
              "must be in (0, 1]: the fraction of peak FLOP/s that matmuls sustain")
        _need(self.overlap_slowdown >= 1, "overlap_slowdown", self.overlap_slowdown,
              "must be >= 1 (1 = compute and communication overlap without slowing each other)")
        for name in ("intra_node_busbw", "inter_node_bw_per_device", "p2p_intra_bw", "p2p_inter_bw"):
            _need(getattr(self, name) > 0, name, getattr(self, name), "must be positive (bytes/s)")
        for name in ("collective_latency_s", "inter_node_latency_s", "p2p_latency_s",
                     "optimizer_time_per_parameter_s", "step_overhead_s",
                     "host_optimizer_time_per_parameter_s",
                     "zero_gather_latency_s", "zero_scatter_latency_s"):
            _need(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0 (seconds)")
        _need(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
              self.attention_backend, f"choose one of {', '.join(ATTENTION_BACKENDS)}")
        _need(isinstance(self.fused_optimizer, bool), "fused_optimizer", self.fused_optimizer,
              "must be true or false")
        _need(0 <= self.fragmentation_fraction < 1, "fragmentation_fraction",
              self.fragmentation_fraction, "must be in [0, 1) (0 = not modelled)")
        for name in ("hbm_bandwidth", "nccl_communicator_bytes", "host_link_bw"):
            _need(getattr(self, name) >= 0, name, getattr(self, name),
                  "must be >= 0 (0 = not modelled)")
        for name in ("zero_gather_busbw", "zero_scatter_busbw"):
            _need(getattr(self, name) >= 0, name, getattr(self, name),
                  "must be >= 0 (bytes/s; 0 = not measured, the raw collective applies)")
        for (g, c), v in self.allreduce_busbw_table.items():
            _need(g >= 2 and v > 0, f"allreduce_busbw[{g}, {'consecutive' if c else 'strided'}]", v,
                  "group size must be >= 2 and bandwidth positive (bytes/s)")
        for p, v in self.p2p_bw_table.items():
            _need(p >= 2 and v > 0, f"p2p_bw[{p}]", v,
                  "pipeline size must be >= 2 and bandwidth positive (bytes/s)")

    # ------------------------------------------------------------------- derived
    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def usable_memory_bytes(self) -> int:
        """Device memory minus the framework reserve: the default planning budget."""
        return self.device_memory_bytes - self.memory_reserve_bytes

    def budget_bytes(self, memory_budget_gb: float | None) -> int:
        """The per-device planning budget for ``--memory-budget-gb`` (None: the device memory).

        Raises ``ClusterError`` naming the flag when the budget is not positive or does not
        exceed the framework reserve (nothing would be left for the model).
        """
        if memory_budget_gb is None:
            return self.device_memory_bytes
        # inf would overflow int() below; nan fails the comparison.
        if not (memory_budget_gb > 0 and math.isfinite(memory_budget_gb)):
            raise ClusterError(f"--memory-budget-gb={memory_budget_gb}: must be positive "
                               f"and finite (GB per device)")
        budget = int(memory_budget_gb * GB)
        if budget <= self.memory_reserve_bytes:
            raise ClusterError(
                f"--memory-budget-gb={memory_budget_gb}: not above the framework reserve of "
                f"{self.memory_reserve_bytes / GB:.2f} GB per device (CUDA context and "
                f"allocator, cluster {self.name!r}); raise the budget")
        return budget

    def flops(self, precision: str) -> float:
        """Sustained FLOP/s per device for ``precision`` (peak times ``compute_efficiency``)."""
        if precision not in self.peak_flops:
            raise ClusterError(
                f"cluster {self.name!r} has no peak_flops for precision {precision!r}; it knows "
                f"{sorted(self.peak_flops)}: add it to the cluster file or choose another precision")
        return self.peak_flops[precision] * self.compute_efficiency

    # ---------------------------------------------------------------- topology
    def nodes_spanned(self, group_size: int, consecutive: bool = True, span: int | None = None) -> int:
        """Nodes touched by a group of ``group_size`` ranks (see the module docstring for placement)."""
        dpn = self.devices_per_node
        if consecutive or group_size <= 1:
            return max(1, math.ceil(group_size / dpn))
        span = self.world_size if span is None else max(span, group_size)
        stride = span // group_size
        if stride >= dpn:
            return group_size  # every member on its own node
        return max(1, math.ceil(span / dpn))

    def _topology_busbw(self, group_size: int, nodes: int) -> float:
        if nodes <= 1:
            return self.intra_node_busbw
        ranks_per_node = math.ceil(group_size / nodes)
        return min(self.intra_node_busbw, ranks_per_node * self.inter_node_bw_per_device)

    def _table_busbw(self, group_size: int, consecutive: bool) -> float | None:
        """Measured busbw for this size, or the slower measured neighbour; None when no data."""
        table = self.allreduce_busbw_table
        if not table:
            return None
        if (group_size, consecutive) in table:
            return table[(group_size, consecutive)]
        # Groups of size D or less inside a node are the same whether called strided or not in a
        # table that measured only one flavour; fall back to the other flavour before giving up.
        same = {g: v for (g, c), v in table.items() if c == consecutive} or \
               {g: v for (g, c), v in table.items()}
        if group_size in same:  # measured only as the other flavour
            return same[group_size]
        below = [g for g in same if g < group_size]
        above = [g for g in same if g > group_size]
        neighbours = ([same[max(below)]] if below else []) + ([same[min(above)]] if above else [])
        return min(neighbours)

    def allreduce_busbw(self, group_size: int, consecutive: bool = True,
                        span: int | None = None) -> float:
        """All-reduce bus bandwidth (bytes/s) of a group; measured when possible, else topology.
        Kept per group (the spec is frozen): the cost model asks tens of thousands of times."""
        memo = self.__dict__.setdefault("_busbw_memo", {})
        key = (group_size, consecutive, span)
        if key not in memo:
            memo[key] = self._allreduce_busbw(group_size, consecutive, span)
        return memo[key]

    def _allreduce_busbw(self, group_size: int, consecutive: bool, span: int | None) -> float:
        nodes = self.nodes_spanned(group_size, consecutive, span)
        topo = self._topology_busbw(group_size, nodes)
        key_consecutive = consecutive
        if (not consecutive and nodes == 1
                and self.nodes_spanned(group_size, False, None) > 1):
            # The measured strided group of this size left the node (stride over the whole
            # world); this one stays inside a node, so the in-node (consecutive) entry applies.
            key_consecutive = True
        measured = self._table_busbw(group_size, key_consecutive)
        if measured is None:
            return topo
        if (group_size, key_consecutive) in self.allreduce_busbw_table:
            return measured
        return min(measured, topo)

    # ------------------------------------------------------------- collectives
    def _latency(self, nodes: int) -> float:
        return self.inter_node_latency_s if nodes > 1 else self.collective_latency_s

    def allreduce_time(self, nbytes: float, group_size: int, consecutive: bool = True,
                       span: int | None = None) -> float:
        """Seconds for a ring all-reduce of ``nbytes`` (per rank) over ``group_size`` ranks."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        g = group_size
        bw = self.allreduce_busbw(g, consecutive, span)
        return 2 * (g - 1) / g * nbytes / bw + self._latency(self.nodes_spanned(g, consecutive, span))

    def allgather_time(self, nbytes_total: float, group_size: int, consecutive: bool = True,
                       span: int | None = None) -> float:
        """Seconds to all-gather a tensor of ``nbytes_total`` (the gathered size) over the group."""
        if group_size <= 1 or nbytes_total <= 0:
            return 0.0
        g = group_size
        bw = self.allreduce_busbw(g, consecutive, span)
        return (g - 1) / g * nbytes_total / bw + self._latency(self.nodes_spanned(g, consecutive, span))

    def reduce_scatter_time(self, nbytes_total: float, group_size: int, consecutive: bool = True,
                            span: int | None = None) -> float:
        """Seconds to reduce-scatter an input of ``nbytes_total`` (per rank, unsharded)."""
        return self.allgather_time(nbytes_total, group_size, consecutive, span)

    def cp_send_time(self, nbytes: float, group_size: int, consecutive: bool = True,
                     span: int | None = None) -> float:
        """Seconds of one ring step of context parallelism: every member of the CP group sends
        ``nbytes`` to the next member and receives as much from the previous one at once. A
        ring step is what a ring collective is made of, so it runs at the group's bus bandwidth
        (nccl-tests' busbw is the per-link rate of the ring) plus one latency."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        bw = self.allreduce_busbw(group_size, consecutive, span)
        return nbytes / bw + self._latency(self.nodes_spanned(group_size, consecutive, span))

    def alltoall_time(self, nbytes: float, group_size: int, consecutive: bool = True,
                      span: int | None = None) -> float:
        """Seconds of an all-to-all of ``nbytes`` per rank (Ulysses attention): each rank keeps
        ``1/g`` and exchanges the rest, ``(g-1)/g * nbytes`` through its links, priced at the
        group's bus bandwidth like the ring collectives."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        g = group_size
        bw = self.allreduce_busbw(g, consecutive, span)
        return (g - 1) / g * nbytes / bw + self._latency(self.nodes_spanned(g, consecutive, span))

    def _zero_time(self, raw: float, nbytes_total: float, group_size: int, consecutive: bool,
                   span: int | None, latency: float, busbw: float) -> float:
        if busbw <= 0 or raw <= 0:
            return raw
        g = group_size
        bw = min(busbw, self.allreduce_busbw(g, consecutive, span))  # topology still caps it
        return max(raw, latency + (g - 1) / g * nbytes_total / bw)

    def zero_gather_time(self, nbytes_total: float, group_size: int, consecutive: bool = True,
                         span: int | None = None) -> float:
        """Seconds for a ZeRO parameter all-gather as the runtime issues it (measured FSDP2
        latency and bandwidth when the profile has them, never below the raw all-gather)."""
        raw = self.allgather_time(nbytes_total, group_size, consecutive, span)
        return self._zero_time(raw, nbytes_total, group_size, consecutive, span,
                               self.zero_gather_latency_s, self.zero_gather_busbw)

    def zero_scatter_time(self, nbytes_total: float, group_size: int, consecutive: bool = True,
                          span: int | None = None) -> float:
        """Seconds for a ZeRO gradient reduce-scatter as the runtime issues it (see above)."""
        raw = self.reduce_scatter_time(nbytes_total, group_size, consecutive, span)
        return self._zero_time(raw, nbytes_total, group_size, consecutive, span,
                               self.zero_scatter_latency_s, self.zero_scatter_busbw)

    def p2p_bandwidth(self, pp_size: int) -> float:
        """Bytes/s of one rank's send to its counterpart in the next pipeline stage."""
        topo = self.p2p_inter_bw if self.num_nodes > 1 else self.p2p_intra_bw
        table = self.p2p_bw_table
        if pp_size in table:
            return table[pp_size]
        if not table:
            return topo
        below = [p for p in table if p < pp_size]
        above = [p for p in table if p > pp_size]
        neighbours = ([table[max(below)]] if below else []) + ([table[min(above)]] if above else [])
        return min(min(neighbours), topo)

    def p2p_time(self, nbytes: float, pp_size: int) -> float:
        """Seconds for one pipeline hop of ``nbytes`` per rank with ``pp_size`` stages.

        Stage ``k`` holds ranks ``[k*N/pp, (k+1)*N/pp)`` and the pipeline spans the whole world,
        so on more than one node at least one hop crosses nodes; the slowest hop paces the
        pipeline, so every hop is charged at the inter-node rate then (conservative for hops that
        stay inside a node). All ranks of a stage send at once, each through its own NIC share.
        """
        if pp_size <= 1 or nbytes <= 0:
            return 0.0
        crosses = self.num_nodes > 1
        latency = self.inter_node_latency_s if crosses else self.p2p_latency_s
        return nbytes / self.p2p_bandwidth(pp_size) + latency

    # ------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": CLUSTER_FORMAT, "version": CLUSTER_VERSION}
        for f in dataclasses.fields(self):
            out[f.name] = getattr(self, f.name)
        out["peak_flops"] = dict(self.peak_flops)
        out["allreduce_busbw_table"] = {
            f"{g}_{'consecutive' if c else 'strided'}": v
            for (g, c), v in sorted(self.allreduce_busbw_table.items())}
        out["p2p_bw_table"] = {str(p): v for p, v in sorted(self.p2p_bw_table.items())}
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "cluster") -> "ClusterSpec":
        if not isinstance(data, Mapping):
            raise ClusterError(f"{where}: must be a JSON object, got {type(data).__name__}")
        fmt = data.get("format")
        if fmt != CLUSTER_FORMAT:
            hint = (" (this looks like a Galvatron hardware file; convert it with "
                    "`megatron-auto import-galvatron --allreduce FILE ...`)"
                    if any(str(k).startswith(("allreduce_size_", "pp_size_")) for k in data) else "")
            raise ClusterError(f"{where}: field format={fmt!r}: must be {CLUSTER_FORMAT!r}{hint}")
        if data.get("version") != CLUSTER_VERSION:
            raise ClusterError(f"{where}: field version={data.get('version')!r}: this megatron_auto "
                               f"reads cluster version {CLUSTER_VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names - {"format", "version"})
        if unknown:
            raise ClusterError(f"{where}: unknown field(s) {unknown}; known fields are {sorted(names)}")
        kwargs = {k: v for k, v in data.items() if k in names}
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in kwargs and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise ClusterError(f"{where}: missing field(s) {missing}; add them (see docs/hardware.md)")
        kwargs["allreduce_busbw_table"] = _parse_allreduce_keys(
            kwargs.get("allreduce_busbw_table", {}), where)
        try:
            kwargs["p2p_bw_table"] = {int(k): float(v) for k, v in kwargs.get("p2p_bw_table", {}).items()}
        except (TypeError, ValueError):
            raise ClusterError(f"{where}: field p2p_bw_table={kwargs.get('p2p_bw_table')!r}: keys must "
                               f'be pipeline sizes and values bytes/s, e.g. {{"2": 1.5e11}}') from None
        try:
            return cls(**kwargs)
        except ClusterError as err:
            raise ClusterError(f"{where}: {err}") from None
        except TypeError as err:
            raise ClusterError(f"{where}: {err}") from None

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ClusterSpec":
        data = read_json(path, "--cluster", ClusterError,
                         read_fix="check the path or give a preset name",
                         syntax_fix="fix the file or write it again")
        return cls.from_dict(data, where=f"--cluster {path}")


def _parse_allreduce_keys(table: Any, where: str) -> dict[tuple[int, bool], float]:
    if not isinstance(table, Mapping):
        raise ClusterError(f"{where}: field allreduce_busbw_table={table!r}: must be an object like "
                           '{"8_consecutive": 1.5e11, "4_strided": 1.4e11}')
    out: dict[tuple[int, bool], float] = {}
    for key, value in table.items():
        size, _, kind = str(key).partition("_")
        if not size.isdigit() or kind not in ("consecutive", "strided"):
            raise ClusterError(f"{where}: key allreduce_busbw_table.{key}: must look like "
                               f"'<group size>_consecutive' or '<group size>_strided'")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ClusterError(f"{where}: key allreduce_busbw_table.{key}={value!r}: must be a "
                               f"bandwidth in bytes/s")
        out[(int(size), kind == "consecutive")] = float(value)
    return out
