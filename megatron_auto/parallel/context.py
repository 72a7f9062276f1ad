"""The parallel context: which ranks form which groups, for every layout a plan uses.

The rank arithmetic (stages of ``n = N/pp`` consecutive ranks, a rank's local index
``j = rank - stage*n``, TP/DP positions and group members under consecutive or strided TP, the
batch slice a rank holds) is :mod:`megatron_auto.layout`, shared with the planner's cost model.
This module turns it into process groups: the key of a rank's groups for a layout is a
``layout.StageLayout`` (a layout placed on one pipeline stage); which layouts a plan needs and
which groups they make are ``layout.plan_stage_layouts`` and ``layout.plan_group_ranks``, the
ones ``planner/cost/gpu_terms.py`` counts NCCL communicators by.

Groups are created once, collectively and in one deterministic order on every rank (
``torch.distributed.new_group`` is collective over the world), and cached by their rank tuple:
layouts that share a group (a one-rank group, the whole stage) share the object, and the number
of groups grows with the distinct layouts of the plan, never with its number of layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..layout import (StageLayout, cp_group_ranks, dp_group_ranks, layer_stage_layout,
                      layout_ranks, plan_group_ranks, plan_stage_layouts, slice_group_ranks,
                      stage_layout, tp_dp_rank, tp_group_ranks, vocab_stage_layout)
from ..expert_layout import ExpertLayout, expert_layout, expert_ranks, plan_expert_group_ranks
from ..plan import Plan
from .device import resolve_device

__all__ = ["LayerGroups", "ParallelContext", "StageLayout", "dp_group_ranks", "stage_layout",
           "tp_dp_rank", "tp_group_ranks"]


@dataclass
class LayerGroups:
    """The groups one rank uses for one layout: its TP group and its DP group and, under
    context parallelism (``layout.cp > 1``), its slice group and CP group.

    The DP group is every rank holding the same parameter shard (``dp x cp`` members): what
    gradients are summed over. The *slice group* holds one copy of every batch slice of this
    rank's sequence chunks (``slice_rank`` of ``slice_size`` is the batch slice this rank
    holds; relayouts gather over it); without CP it is the DP group. The CP group holds the
    other sequence chunks of the same samples (``cp_rank`` of ``cp_size``; ``cp_ranks``
    global ranks in CP-rank order, what ring attention passes keys and values around).
    """

    layout: StageLayout
    tp_group: Any
    tp_rank: int
    tp_size: int
    tp_ranks: list[int]
    dp_group: Any
    dp_rank: int
    dp_size: int
    dp_ranks: list[int]
    device_type: str = "cpu"
    slice_group: Any = None
    slice_rank: int | None = None
    slice_size: int | None = None
    cp_group: Any = None
    cp_rank: int = 0
    cp_size: int = 1
    cp_ranks: list[int] | None = None
    _dp_mesh: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.slice_size is None:  # no CP: the batch slices are the DP replicas
            self.slice_group, self.slice_rank, self.slice_size = (self.dp_group, self.dp_rank,
                                                                  self.dp_size)
        if self.cp_ranks is None:
            self.cp_ranks = [self.tp_ranks[self.tp_rank]] if self.tp_ranks else []

    @property
    def dp_mesh(self) -> Any:
        """A 1-D DeviceMesh over the DP group (for FSDP2), built on first use and cached."""
        if self._dp_mesh is None:
            self._dp_mesh = DeviceMesh.from_group(self.dp_group, self.device_type)
        return self._dp_mesh


def _default_device() -> torch.device:
    return resolve_device()


class ParallelContext:
    """Every process group a plan needs, built once; pass it explicitly to the model and runtime.

    Needs ``torch.distributed`` initialised with ``plan.world_size`` ranks (a one-rank plan also
    works without it: groups are then ``None`` and no collective is ever called). The
    constructor is collective: every rank must build the context from the same plan.
    """

    def __init__(self, plan: Plan, *, device: torch.device | None = None) -> None:
        # A one-rank plan also runs without torch.distributed (groups are then None and every
        # communication function is skipped); anything bigger needs the process group.
        self._distributed = dist.is_initialized()
        if not self._distributed and plan.world_size != 1:
            raise RuntimeError("ParallelContext needs torch.distributed initialised; call "
                               "torch.distributed.init_process_group first (torchrun sets the env)")
        world_size = dist.get_world_size() if self._distributed else 1
        if world_size != plan.world_size:
            raise ValueError(f"plan field world_size={plan.world_size} but this run has "
                             f"{world_size} ranks; launch with {plan.world_size} processes or "
                             f"use a plan made for {world_size}")
        self.plan = plan
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = world_size
        self.device = device if device is not None else _default_device()
        self.num_stages = plan.pp_size
        self.stage_size = plan.stage_size
        self.stage = plan.stage_of_rank(self.rank)
        self.stage_ranks = plan.stage_ranks(self.stage)
        self.local_index = self.rank - self.stage_ranks[0]
        self.is_first_stage = self.stage == 0
        self.is_last_stage = self.stage == self.num_stages - 1
        self.prev_rank = None if self.is_first_stage else self.rank - self.stage_size
        self.next_rank = None if self.is_last_stage else self.rank + self.stage_size
        self._groups: dict[tuple[int, ...], Any] = {}
        self._layouts: dict[StageLayout, LayerGroups] = {}
        self._create_all_groups()

    # ------------------------------------------------------------------ creation
    def _group(self, ranks: Sequence[int]) -> Any:
        """The group over ``ranks`` (collective on first request for a tuple, cached after)."""
        key = tuple(ranks)
        if key not in self._groups:
            if not self._distributed:
                self._groups[key] = None
            elif len(key) == self.world_size:
                self._groups[key] = dist.group.WORLD
            else:
                self._groups[key] = dist.new_group(list(key))
        return self._groups[key]

    def all_layouts(self) -> list[StageLayout]:
        """Every layout any rank may ask for, in the same order on every rank
        (``layout.plan_stage_layouts``: layer and vocab layouts of each stage, plus each stage's
        *input layout*, the previous chunk's last layer layout moved to this stage)."""
        return plan_stage_layouts(self.plan)

    def _create_all_groups(self) -> None:
        plan = self.plan
        # Every group in one fixed order (stages, embedding pairs, per-layout TP and DP groups:
        # layout.plan_group_ranks) so every rank issues the same collective new_group calls;
        # what follows only looks them up.
        for ranks in plan_group_ranks(plan) + plan_expert_group_ranks(plan):
            self._group(ranks)
        self._stage_groups = [self._group(plan.stage_ranks(k)) for k in range(plan.pp_size)]
        self.stage_group = self._stage_groups[self.stage]
        self.embedding_group = None
        if plan.pp_size > 1 and (self.is_first_stage or self.is_last_stage):
            j = self.local_index
            self.embedding_group = self._group([plan.stage_ranks(0)[j],
                                                plan.stage_ranks(plan.pp_size - 1)[j]])
        device_type = self.device.type
        for layout in self.all_layouts():
            if layout.stage != self.stage:
                continue
            members, n, cp = self.stage_ranks, len(self.stage_ranks), layout.cp
            tp_rank, slice_rank, dp_rank, cp_rank = layout_ranks(self.local_index, n,
                                                                 layout.layout)
            slices = n // (layout.tp * cp)
            tp_ranks = tp_group_ranks(members, layout.tp, layout.consecutive, cp)[
                cp_rank * slices + slice_rank]
            dp_ranks = dp_group_ranks(members, layout.tp, layout.consecutive, cp)[tp_rank]
            extra: dict[str, Any] = {}
            if cp > 1:
                slice_ranks = slice_group_ranks(members, layout.tp, layout.consecutive, cp)[
                    cp_rank * layout.tp + tp_rank]
                cp_ranks = cp_group_ranks(members, cp)[self.local_index % (n // cp)]
                extra = dict(slice_group=self._group(slice_ranks), slice_rank=slice_rank,
                             slice_size=slices, cp_group=self._group(cp_ranks), cp_rank=cp_rank,
                             cp_size=cp, cp_ranks=cp_ranks)
            self._layouts[layout] = LayerGroups(
                layout=layout, tp_group=self._group(tp_ranks), tp_rank=tp_rank,
                tp_size=layout.tp, tp_ranks=tp_ranks,
                dp_group=self._group(dp_ranks), dp_rank=dp_rank,
                dp_size=n // layout.tp, dp_ranks=dp_ranks,
                device_type=device_type, **extra)

    def group(self, ranks: Sequence[int]) -> Any:
        """The process group over ``ranks`` (cached by the rank tuple; ``None`` without
        torch.distributed). Collective on first request: every rank of the world asks for the
        same tuples in the same order, e.g. a model whose parameters are replicated across
        stages (T5's relative position bias tables) while every rank builds its stage."""
        return self._group(ranks)

    # ------------------------------------------------------------------- queries
    @property
    def num_groups(self) -> int:
        """Distinct process groups created (grows with layouts, not with layers)."""
        return len(self._groups)

    @property
    def group_ranks(self) -> list[tuple[int, ...]]:
        """The rank tuples of every group created so far, in creation order (the plan's
        ``layout.plan_group_ranks`` first, then those asked for through :meth:`group`)."""
        return list(self._groups)

    def layout_groups(self, layout: StageLayout) -> LayerGroups:
        """Groups of this rank for ``layout`` (a layout of this rank's stage)."""
        layout = stage_layout(layout.stage, layout.tp, layout.consecutive, self.stage_size,
                              layout.cp)
        if layout not in self._layouts:
            raise KeyError(f"layout {layout} is not used on stage {self.stage} by this plan; "
                           f"known: {sorted(self._layouts, key=str)}")
        return self._layouts[layout]

    def layer_layout(self, layer: int) -> StageLayout:
        return layer_stage_layout(self.plan, layer)

    def layer_groups(self, layer: int) -> LayerGroups:
        """Groups for global layer index ``layer``, which must belong to this rank's stage."""
        if self.plan.stage_of_layer(layer) != self.stage:
            raise ValueError(f"layer {layer} lives on stage {self.plan.stage_of_layer(layer)}, "
                             f"not on this rank's stage {self.stage}")
        return self.layout_groups(self.layer_layout(layer))

    def expert_groups(self, layer: int) -> "ExpertGroups":
        """The expert groups (:class:`ExpertGroups`) of MoE layer
        ``layer`` on this rank's stage; built on first request from groups the constructor
        already created, then cached."""
        cache = self.__dict__.setdefault("_expert_groups", {})
        if layer not in cache:
            cache[layer] = build_expert_groups(self, layer)
        return cache[layer]

    def vocab_layout(self, stage: int | None = None) -> StageLayout:
        return vocab_stage_layout(self.plan, self.stage if stage is None else stage)

    def vocab_groups(self) -> LayerGroups:
        """Embedding / LM-head groups (vocab tp, consecutive) on this rank's stage."""
        if not (self.is_first_stage or self.is_last_stage):
            raise ValueError(f"stage {self.stage} holds neither the embedding nor the LM head")
        return self.layout_groups(self.vocab_layout())

    def __repr__(self) -> str:
        return (f"ParallelContext(rank={self.rank}, world_size={self.world_size}, "
                f"stage={self.stage}/{self.num_stages}, local_index={self.local_index}, "
                f"groups={self.num_groups})")


@dataclass
class ExpertGroups:
    """One rank's expert groups for one MoE layer."""

    layout: ExpertLayout
    ep_group: Any
    ep_rank: int
    ep_size: int
    ep_ranks: tuple[int, ...]
    dp: LayerGroups  # the experts' data-parallel groups: expert-DP, with the layer's TP fields
    # expert TP: each expert split over these ``expert_tp_size`` members of the layer's TP
    # group; ``expert_replica`` numbers the tp / expert_tp groups computing the same thing
    expert_tp_group: Any = None
    expert_tp_rank: int = 0
    expert_tp_size: int = 1
    expert_tp_ranks: tuple[int, ...] = ()
    expert_replica: int = 0


def build_expert_groups(ctx: Any, layer: int) -> ExpertGroups:
    """The expert groups of ``layer`` on this rank (``ctx``: the ``ParallelContext``, whose
    constructor created them all, ``expert_layout.plan_expert_group_ranks``); the rank
    arithmetic is ``expert_layout.expert_ranks``'s (parallel/expert_parallel.py runs them)."""
    plan = ctx.plan
    strategy = plan.layers[layer]
    groups = ctx.layer_groups(layer)
    lay = expert_layout(ctx.stage, strategy.tp, strategy.tp_consecutive, strategy.ep,
                        strategy.expert_tp, ctx.stage_size)
    mine = expert_ranks(ctx.stage_ranks, lay, ctx.local_index)
    dp = LayerGroups(layout=groups.layout, tp_group=groups.tp_group, tp_rank=groups.tp_rank,
                     tp_size=groups.tp_size, tp_ranks=groups.tp_ranks,
                     dp_group=ctx.group(mine.expert_dp_ranks), dp_rank=mine.expert_dp_rank,
                     dp_size=len(mine.expert_dp_ranks), dp_ranks=list(mine.expert_dp_ranks),
                     device_type=groups.device_type)
    return ExpertGroups(layout=lay, ep_group=ctx.group(mine.ep_ranks), ep_rank=mine.ep_rank,
                        ep_size=len(mine.ep_ranks), ep_ranks=mine.ep_ranks, dp=dp,
                        expert_tp_group=ctx.group(mine.expert_tp_ranks),
                        expert_tp_rank=mine.expert_tp_rank,
                        expert_tp_size=len(mine.expert_tp_ranks),
                        expert_tp_ranks=mine.expert_tp_ranks,
                        expert_replica=mine.expert_replica)
