"""What the planner needs to know about a cluster: a typed protocol instead of ``Any``.

``hardware.ClusterSpec`` (presets, measured profiles) implements it; tests use a small fake
with round numbers (``tests/planner_fakes.py``). Times are seconds, sizes bytes; ``span`` places
a strided group inside the ranks of one pipeline stage (see ``ClusterSpec.nodes_spanned``).
"""

from __future__ import annotations

from typing import Protocol


class ClusterModel(Protocol):
    """The cluster attributes and collective timings the cost model and the search read
    (read-only: a frozen dataclass such as ``ClusterSpec`` implements them as fields)."""

    @property
    def name(self) -> str: ...

    @property
    def devices_per_node(self) -> int: ...

    @property
    def device_memory_bytes(self) -> int: ...

    @property
    def memory_reserve_bytes(self) -> int: ...

    @property
    def overlap_slowdown(self) -> float: ...

    @property
    def optimizer_time_per_parameter_s(self) -> float: ...

    @property
    def step_overhead_s(self) -> float: ...

    @property
    def world_size(self) -> int: ...

    def flops(self, precision: str) -> float: ...

    def allreduce_time(self, nbytes: float, group_size: int, consecutive: bool = True,
                       span: int | None = None) -> float: ...

    def allgather_time(self, nbytes_total: float, group_size: int, consecutive: bool = True,
                       span: int | None = None) -> float: ...

    def zero_gather_time(self, nbytes_total: float, group_size: int, consecutive: bool = True,
                         span: int | None = None) -> float: ...

    def zero_scatter_time(self, nbytes_total: float, group_size: int, consecutive: bool = True,
                          span: int | None = None) -> float: ...

    def cp_send_time(self, nbytes: float, group_size: int, consecutive: bool = True,
                     span: int | None = None) -> float: ...

    def alltoall_time(self, nbytes: float, group_size: int, consecutive: bool = True,
                      span: int | None = None) -> float: ...

    def p2p_time(self, nbytes: float, pp_size: int) -> float: ...
