"""The search's pins and knobs (:class:`SearchOptions`) and the names they choose from: the
spaces (``full`` and the :data:`BASELINE_SPACES` reported next to the answer) and the partition
kinds. ``driver.search`` takes the options; ``spaces.py`` reads their pins. Pure, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ...plan import ALL_DP_MODES, DP_MODES, SCHEDULES

BASELINE_SPACES: tuple[str, ...] = ("dp", "zero3", "tp", "pp", "megatron3d", "galvatron-base")
# ``galvatron``: Galvatron 2.4's strategy space (``named_spaces.spaces_of``), searched on request
# (``--search-space galvatron``) for a like-with-like comparison; not a baseline.
GALVATRON_SPACE = "galvatron"
SPACES: tuple[str, ...] = ("full",) + BASELINE_SPACES + (GALVATRON_SPACE,)
# Reported next to an answer with cp > 1 that the search chose (cp not pinned): the full space
# with context parallelism left out, the best plan without CP (not a --search-space value).
NO_CP_BASELINE = "full, cp 1"
PARTITIONS = ("exact", "even", "memory", "time", "bmw-paper")

Progress = Callable[[int, int, float | None], None]


@dataclass(frozen=True)
class SearchOptions:
    """Pins and knobs. ``None`` means "search it".

    ``partition``: ``exact`` searches every partition; the others pin the partition kind.
    ``memory_step_bytes``: cell size of the bound DP (default: the budget in
    ``driver.BOUND_CELLS`` cells); it changes only how fast the search prunes, never the answer
    (memory is checked in bytes). ``progress``: called as
    ``progress(tasks_done, tasks, best_samples_per_s)``; with ``show_progress`` and no callback,
    progress goes to ``utils.progress.RestartingProgress`` (stderr, rank-agnostic: callers on
    other ranks pass ``show_progress=False``).
    """

    pp: int | None = None
    tp: int | None = None
    num_microbatches: int | None = None
    schedule: str | None = None
    dp_modes: tuple[str, ...] = DP_MODES
    allow_recompute: bool = True
    module_recompute: tuple = ()  # e.g. ("selective",): per-layer choices beside none/full
    vocab_tp: int | None = None
    # False: TP groups on consecutive ranks only (no strided layout is searched).
    allow_strided_tp: bool = True
    search_batch_size: bool = False
    space: str = "full"
    time_limit_s: float | None = None
    # Stop once the answer is within this relative gap of the lower bound (0: prove it exact).
    optimality_gap: float = 0.01
    memory_step_bytes: int | None = None
    show_progress: bool = True
    max_tp: int | None = None
    partition: str = "exact"
    include_baselines: bool = True
    progress: Progress | None = field(default=None, compare=False)
    # Megatron sequence parallelism of tp > 1 layers: None searches it per layer, True pins it
    # on (``--sequence-parallel``), False leaves it out.
    sequence_parallel: bool | None = None
    # Interleaved 1F1B: the virtual sizes searched (tasks with pp > 1, m a multiple of pp and
    # at least one layer per chunk; every chunk split); a single value > 1 pins it
    # (``--num-layers-per-virtual-pipeline-stage``), (1,) turns interleaving off.
    virtual_sizes: tuple[int, ...] = (1, 2, 4)
    # Price the winner's task under the other partition kinds too (plan.search["partitions"]);
    # False for callers that need only the answer (it can cost more than the search).
    report_partitions: bool = True
    # Expert parallelism of the MoE layers: None searches it per layer (with the experts' own
    # DP flavour), an int pins ep on every MoE layer (``--expert-model-parallel-size``).
    expert_parallel: int | None = None
    # Expert TP of the MoE layers: None searches it per layer (powers of two dividing the
    # layer's tp), an int pins it on every MoE layer (``--expert-tensor-parallel-size``).
    expert_tensor_parallel: int | None = None
    # Context parallelism (``cp_space``): None searches the degree per task (from
    # ``cp_min_seq_length`` tokens on), an int pins it (``--context-parallel-size``); the CP
    # modes offered per layer (``--cp-comm-type``: p2p = ring, a2a = ulysses).
    cp: int | None = None
    cp_modes: tuple[str, ...] = ("ring", "ulysses")
    cp_min_seq_length: int = 8192  # cp_space.CP_MIN_SEQ_LENGTH
    # Optimizer offload (``pipeline.optimizer_offload_fraction``): the host memory one device's
    # rank may use (bytes; ``--host-memory-budget-gb``). None: no offload is searched. Given,
    # every task is also searched with each fraction of ``optimizer_offload_fractions`` (one
    # for all stages and, with ``per_stage_offload``, each stage its own: mixed_offload), and a
    # plan whose host bytes exceed the budget is infeasible.
    host_memory_budget_bytes: float | None = None
    optimizer_offload_fractions: tuple[float, ...] = (0.5, 1.0)
    per_stage_offload: bool = True
    # With a host budget, also offer every layer that does not recompute ``offload: true``
    # (its saved activations in host memory, cost/offload.py).
    activation_offload: bool = True

    def validate(self) -> None:
        def need(cond: bool, name: str, value: Any, fix: str) -> None:
            if not cond:
                raise ValueError(f"search option {name}={value!r}: {fix}")
        need(self.space in SPACES, "space", self.space, f"choose one of {', '.join(SPACES)}")
        need(self.schedule is None or self.schedule in SCHEDULES, "schedule", self.schedule,
             f"choose one of {', '.join(SCHEDULES)} or leave it unset")
        need(bool(self.dp_modes) and all(d in ALL_DP_MODES for d in self.dp_modes), "dp_modes",
             self.dp_modes, f"give a non-empty subset of {ALL_DP_MODES}")
        need(bool(self.virtual_sizes) and all(isinstance(v, int) and v >= 1
                                              for v in self.virtual_sizes),
             "virtual_sizes", self.virtual_sizes, "give positive integers, e.g. (1, 2, 4)")
        need(self.partition in PARTITIONS, "partition", self.partition,
             f"choose one of {', '.join(PARTITIONS)}")
        need(bool(self.cp_modes) and all(m in ("ring", "ulysses") for m in self.cp_modes),
             "cp_modes", self.cp_modes, "give a non-empty subset of ('ring', 'ulysses')")
        need(isinstance(self.cp_min_seq_length, int) and self.cp_min_seq_length >= 0,
             "cp_min_seq_length", self.cp_min_seq_length,
             "must be a number of tokens >= 0 (e.g. 8192; 0 searches CP at any length)")
        need(self.cp is None or (isinstance(self.cp, int) and not isinstance(self.cp, bool)
                                 and self.cp >= 1 and self.cp & (self.cp - 1) == 0),
             "cp", self.cp, "must be a power of two (1, 2, 4, ...) or unset to search it")
        for name in ("pp", "tp", "vocab_tp", "max_tp", "expert_parallel",
                     "expert_tensor_parallel"):
            value = getattr(self, name)
            need(value is None or (isinstance(value, int) and value >= 1), name, value,
                 "must be a positive integer (a divisor of the ranks it splits)")
        need(self.num_microbatches is None or self.num_microbatches >= 1, "num_microbatches",
             self.num_microbatches, "must be a positive integer")
        need(self.memory_step_bytes is None or self.memory_step_bytes >= 1, "memory_step_bytes",
             self.memory_step_bytes, "must be a positive number of bytes (e.g. 1048576)")
        need(self.time_limit_s is None or self.time_limit_s > 0, "time_limit_s",
             self.time_limit_s, "must be positive seconds")
        need(isinstance(self.allow_strided_tp, bool), "allow_strided_tp",
             self.allow_strided_tp, "give True or False")
        need(self.space != GALVATRON_SPACE or bool({"zero2", "zero3"} & set(self.dp_modes)),
             "dp_modes", self.dp_modes, "the galvatron space's DP flavours are zero2 and zero3 "
             "(Galvatron's DP with --default_dp_type zero2, and SDP): allow one of them")
        need(isinstance(self.per_stage_offload, bool), "per_stage_offload",
             self.per_stage_offload, "give True or False")
        need(self.host_memory_budget_bytes is None or (
            isinstance(self.host_memory_budget_bytes, (int, float))
            and 0 < self.host_memory_budget_bytes < math.inf), "host_memory_budget_bytes",
             self.host_memory_budget_bytes, "must be a positive number of bytes or unset")
        need(all(isinstance(f, (int, float)) and 0 < f <= 1
                 for f in self.optimizer_offload_fractions), "optimizer_offload_fractions",
             self.optimizer_offload_fractions, "give fractions in (0, 1], e.g. (0.5, 1.0)")
        need(0 <= self.optimality_gap < math.inf, "optimality_gap", self.optimality_gap,
             "must be a relative gap >= 0 (e.g. 0.01; 0 proves the optimum)")
