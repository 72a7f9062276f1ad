"""The per-layer strategy space.

A layer's strategy inside a pipeline stage of ``n`` ranks is a ``plan.LayerStrategy``: TP degree
``tp`` (power of two dividing ``n``), data-parallel flavour (``ddp``/``zero1``/``zero2``/``zero3``
over the ``dp = n/tp`` replicas), TP layout (consecutive or strided ranks), Megatron sequence
parallelism (``tp > 1`` dividing the sequence) and recompute. Pipeline degree (and the
interleaving of its stages) is chosen outside (one per plan).

Pruning rules (each keeps the optimum, or encodes a rule of the runtime):

1. ``tp`` must divide the layer's heads and FFN size (Megatron splits both) and ``n``; ``dp``
   must divide the micro-batch (each replica takes an equal slice). Runtime rules.
2. With ``dp == 1`` the four DP flavours are the same computation with the same memory, so only
   ``ddp`` is kept (a duplicate would only slow the DP).
3. The layout flag is kept only where it changes the groups, ``1 < tp < n``: with ``tp == 1`` or
   ``tp == n`` consecutive and strided groups are identical.
4. ``tp`` above the ranks of one node is dropped unless ``max_tp`` asks for it: a TP group
   crossing nodes pays inter-node all-reduces four times per layer and micro-batch, which on every
   cluster we model is slower than the alternatives (a user can still force it).
5. Dominance (applied after the costs are known, in the search): two strategies of the same layout
   class (so the same transition costs) where one needs no more persistent memory, no more
   transient memory and no more time than the other make the other redundant.

The layout arithmetic (``Layout``, ``layout_of``, batch slices, relayouts) is
:mod:`megatron_auto.layout`, shared with the runtime; ``Layout`` and ``layout_of`` are re-exported
here for the search.

Restricted spaces for baselines are in :data:`BASELINE_SPACES` (docs/planner.md §3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ..layout import Layout, layout_of
from ..plan import DP_MODES, LayerStrategy
from .model_spec import LayerType

# Baseline spaces: a restricted search each, compared against the full space in every result.
BASELINE_SPACES: tuple[str, ...] = ("dp", "zero3", "tp", "pp", "megatron3d", "galvatron-base")
SPACES: tuple[str, ...] = ("full",) + BASELINE_SPACES

__all__ = ["BASELINE_SPACES", "SPACES", "Layout", "SpaceRules", "layer_strategies",
           "layout_classes", "layout_of", "powers_of_two_upto", "vocab_tps"]


def powers_of_two_upto(n: int) -> list[int]:
    out, x = [], 1
    while x <= n:
        out.append(x)
        x *= 2
    return out


@dataclass(frozen=True)
class SpaceRules:
    """Which strategies a search space allows (after the structural rules of the module doc)."""

    tps: tuple[int, ...] | None = None  # allowed TP degrees (None: all powers of two)
    dp_modes: tuple[str, ...] = DP_MODES
    allow_recompute: bool = True
    allow_strided: bool = True
    max_tp: int | None = None
    force_recompute: bool = False  # every layer recomputes (uniform Megatron grids)
    # Megatron-SP choices of a tp > 1 layer: (False, True) searches it, (True,) pins it on
    # (``--sequence-parallel``), (False,) leaves it out.
    sequence_parallel: tuple[bool, ...] = (False,)


def layer_strategies(layer_type: LayerType, stage_size: int, microbatch_size: int,
                     rules: SpaceRules, devices_per_node: int) -> list[LayerStrategy]:
    """All strategies of ``layer_type`` in a stage of ``stage_size`` ranks (pruning rules 1-4).

    Deterministic order: tp ascending, then layout (consecutive first), DP flavour in
    ``rules.dp_modes`` order, sequence parallelism off before on, recompute off before on.
    SP is offered where ``tp > 1`` divides the sequence (the runtime's rule).
    """
    cap = rules.max_tp if rules.max_tp is not None else devices_per_node
    out: list[LayerStrategy] = []
    for tp in powers_of_two_upto(stage_size):
        if rules.tps is not None and tp not in rules.tps:
            continue
        if rules.tps is None and tp > cap:
            continue
        if not layer_type.tp_divides(tp):
            continue
        dp = stage_size // tp
        if microbatch_size % dp:
            continue
        modes = ("ddp",) if dp == 1 else rules.dp_modes
        if dp == 1 and "ddp" not in rules.dp_modes and len(rules.dp_modes) > 0:
            modes = (rules.dp_modes[0],)  # equivalent anyway; keep the name the space uses
        layouts = [True, False] if (1 < tp < stage_size and rules.allow_strided) else [True]
        sps: tuple[bool, ...] = (False,)
        if tp > 1 and layer_type.seq_length % tp == 0:
            sps = rules.sequence_parallel
        for consec in layouts:
            for mode in modes:
                if rules.force_recompute:
                    recomputes: tuple[bool, ...] = (True,)
                else:
                    recomputes = (False, True) if rules.allow_recompute else (False,)
                for sp in sps:
                    for recompute in recomputes:
                        out.append(LayerStrategy(tp=tp, dp_mode=mode, tp_consecutive=consec,
                                                 recompute=recompute, sequence_parallel=sp))
    return out


def layout_classes(strategies: Iterable[Sequence[LayerStrategy]], stage_size: int) -> list[Layout]:
    """Sorted distinct layouts over several strategy lists (the DP's transition classes)."""
    seen = {layout_of(s, stage_size) for group in strategies for s in group}
    return sorted(seen)


def vocab_tps(vocab_size: int, stage_size: int, microbatch_size: int,
              rules: SpaceRules, devices_per_node: int) -> list[int]:
    """TP degrees the embedding and head may use (rules 1 and 4, on the vocabulary)."""
    cap = rules.max_tp if rules.max_tp is not None else devices_per_node
    out = []
    for tp in powers_of_two_upto(stage_size):
        if rules.tps is not None and tp not in rules.tps:
            continue
        if rules.tps is None and tp > cap:
            continue
        if vocab_size % tp or microbatch_size % (stage_size // tp):
            continue
        out.append(tp)
    return out
