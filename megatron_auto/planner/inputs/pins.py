"""The one mapping from the layout flags a user typed to the search's ``SearchOptions``.

Two front ends pin the search: ``--auto-parallel`` (its ``run_config.SearchPins``, every layout
flag typed next to it) and ``megatron-auto plan`` (its parsed flags, the same names). Both call
:func:`search_options`, so a flag means the same in both:

- ``--tensor-model-parallel-size`` / ``--pipeline-model-parallel-size`` pin every layer's tp
  and the pipeline degree (a typed value pins even when it equals Megatron's default);
- ``--use-distributed-optimizer`` pins ``zero1`` on every layer (Megatron's distributed
  optimizer; before ZeRO-1 existed it meant zero2);
- ``--sequence-parallel`` pins sequence parallelism on every layer with tp > 1 (unset: searched
  per layer);
- ``--num-layers-per-virtual-pipeline-stage N`` pins the virtual size ``L / (pp N)``
  (``interleaving.pinned_virtual_sizes``; it needs the pinned pp);
- ``--context-parallel-size`` / ``--cp-comm-type`` pin the CP degree / mode (absent: searched);
- ``--cp-min-seq-length N`` lowers (or raises) the sequence length from which the search tries
  cp > 1 (``SearchOptions.cp_min_seq_length``, default ``cp_space.CP_MIN_SEQ_LENGTH``); a
  positive number of tokens, refused otherwise;
- ``--micro-batch-size`` (``--auto-parallel`` only) pins the micro-batch count
  ``B / (micro-batch x dp)`` when tp and pp are pinned too (they fix dp); otherwise it is not a
  pin (the caller says so to the user).

The ``plan`` command's own knobs (search space, time limit, schedule, ...) pass through as
keywords. Nothing here imports ``run_config`` (the planning commands' start-up, see
docs/cli.md): the pins are read through the :class:`LayoutPins` protocol.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Protocol

from ...config import ArgumentError
from ...plan import DP_MODES
from ..cost.interleaving import pinned_virtual_sizes
from ..search.options import SearchOptions
from .hardware import GB


class LayoutPins(Protocol):
    """The layout flags as typed (``None`` / ``False``: not typed, the planner chooses)."""

    @property
    def tensor_model_parallel_size(self) -> int | None: ...

    @property
    def pipeline_model_parallel_size(self) -> int | None: ...

    @property
    def use_distributed_optimizer(self) -> bool: ...

    @property
    def sequence_parallel(self) -> bool: ...

    @property
    def num_layers_per_virtual_pipeline_stage(self) -> int | None: ...


def search_options(pins: LayoutPins, world_size: int, num_layers: int | None, *,
                   micro_batch_size: int | None = None, global_batch_size: int | None = None,
                   num_microbatches: int | None = None, schedule: str | None = None,
                   allow_recompute: bool = True, search_batch_size: bool = False,
                   space: str = "full", time_limit_s: float | None = None,
                   show_progress: bool = True,
                   optimality_gap: float | None = None) -> SearchOptions:
    """``SearchOptions`` of ``pins`` (module docstring) and the knobs given.

    ``micro_batch_size`` with pinned tp and pp fixes ``num_microbatches`` from
    ``global_batch_size``; raises ``ArgumentError`` when it does not divide it, and
    ``ValueError`` for a virtual-size pin that cannot hold (both name the flag and the fix).
    The options are not validated here (the caller names its own flags in those errors)."""
    tp, pp = pins.tensor_model_parallel_size, pins.pipeline_model_parallel_size
    # --context-parallel-size / --cp-comm-type typed: pinned; absent: searched (cp_space.py)
    cp = getattr(pins, "context_parallel_size", None)
    comm = getattr(pins, "cp_comm_type", None)
    cp_modes = {"p2p": ("ring",), "a2a": ("ulysses",)}.get(comm or "", ("ring", "ulysses"))
    cp_min = getattr(pins, "cp_min_seq_length", None)
    check_cp_min_seq_length(cp_min)
    if micro_batch_size is not None and tp is not None and pp is not None:
        if global_batch_size is None:
            raise ValueError("search_options: micro_batch_size needs global_batch_size")
        dp = world_size // (tp * pp * (cp or 1))
        per_step = micro_batch_size * dp
        if per_step <= 0 or global_batch_size % per_step:
            raise ArgumentError(f"--micro-batch-size={micro_batch_size}: times the data-parallel "
                                f"size {dp} must divide --global-batch-size={global_batch_size}")
        num_microbatches = global_batch_size // per_step
    virtual_sizes = pinned_virtual_sizes(pins.num_layers_per_virtual_pipeline_stage, pp,
                                         num_layers)
    options = SearchOptions(
        pp=pp, tp=tp, cp=cp, cp_modes=cp_modes, num_microbatches=num_microbatches,
        schedule=schedule,
        allow_recompute=allow_recompute, search_batch_size=search_batch_size, space=space,
        time_limit_s=time_limit_s, show_progress=show_progress,
        dp_modes=("zero1",) if pins.use_distributed_optimizer else DP_MODES,
        sequence_parallel=True if pins.sequence_parallel else None,
        virtual_sizes=virtual_sizes)
    if cp_min is not None:
        options = replace(options, cp_min_seq_length=cp_min)
    ep = getattr(pins, "expert_model_parallel_size", None)
    if ep is not None:  # --expert-model-parallel-size typed: every MoE layer's ep pinned
        if not (isinstance(ep, int) and ep >= 1 and ep & (ep - 1) == 0):
            raise ArgumentError(f"--expert-model-parallel-size={ep}: must be a power of two "
                                f"(the experts split over that many data-parallel ranks)")
        options = replace(options, expert_parallel=ep)
    etp = getattr(pins, "expert_tensor_parallel_size", None)
    if etp is not None:  # --expert-tensor-parallel-size typed: every MoE layer's pinned
        if not (isinstance(etp, int) and etp >= 1 and etp & (etp - 1) == 0):
            raise ArgumentError(f"--expert-tensor-parallel-size={etp}: must be a power of two "
                                f"dividing the layers' tp (1 replicates the experts)")
        options = replace(options, expert_tensor_parallel=etp)
    host = getattr(pins, "host_memory_budget_gb", None)
    if host is not None:  # optimizer offload enters the search (SearchOptions)
        if not (isinstance(host, (int, float)) and 0 < host < math.inf):
            raise ArgumentError(f"--host-memory-budget-gb={host}: must be a positive number "
                                f"(GB = 1e9 bytes of host memory one device's rank may use)")
        options = replace(options, host_memory_budget_bytes=host * GB)
    # no gap given: the options' default
    return options if optimality_gap is None else replace(options, optimality_gap=optimality_gap)


def check_cp_min_seq_length(value: object) -> None:
    """``--cp-min-seq-length``: ``None`` (the default) or a positive number of tokens; raises
    ``ValueError`` naming the flag, the value and the fix."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ValueError(f"--cp-min-seq-length={value}: must be a positive number of tokens "
                         f"(e.g. 256 to let the search try context parallelism from 256-token "
                         f"sequences on)")
