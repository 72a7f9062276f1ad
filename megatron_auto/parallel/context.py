"""The parallel context: which ranks form which groups, for every layout a plan uses.

The rank arithmetic (stages of ``n = N/pp`` consecutive ranks, a rank's local index
``j = rank - stage*n``, TP/DP positions and group members under consecutive or strided TP, the
batch slice a rank holds) is :mod:`megatron_auto.layout`, shared with the planner's cost model.
This module turns it into process groups: a :class:`Layout` here is a ``layout.Layout`` placed
on one pipeline stage (the key of its groups).

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

from .. import layout as pure_layout
from ..layout import dp_group_ranks, tp_dp_rank, tp_group_ranks
from ..plan import Plan
from .device import resolve_device

__all__ = ["LayerGroups", "Layout", "ParallelContext", "dp_group_ranks", "make_layout",
           "tp_dp_rank", "tp_group_ranks"]


@dataclass(frozen=True)
class Layout:
    """A layout on one pipeline stage: the key of a rank's :class:`LayerGroups` for it."""

    stage: int
    tp: int
    consecutive: bool

    @property
    def pure(self) -> pure_layout.Layout:
        """The stage-free layout (what :mod:`megatron_auto.layout` computes with)."""
        return pure_layout.Layout(self.tp, self.consecutive)


def make_layout(stage: int, tp: int, consecutive: bool, stage_size: int) -> Layout:
    """A normalised :class:`Layout` on ``stage`` (``layout.make_layout``: consecutive when moot)."""
    local = pure_layout.make_layout(tp, consecutive, stage_size)
    return Layout(stage, local.tp, local.consecutive)


@dataclass
class LayerGroups:
    """The groups one rank uses for one layout: its TP group and its DP group."""

    layout: Layout
    tp_group: Any
    tp_rank: int
    tp_size: int
    tp_ranks: list[int]
    dp_group: Any
    dp_rank: int
    dp_size: int
    dp_ranks: list[int]
    device_type: str = "cpu"
    _dp_mesh: Any = field(default=None, repr=False, compare=False)

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
        self._layouts: dict[Layout, LayerGroups] = {}
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

    def all_layouts(self) -> list[Layout]:
        """Every layout any rank may ask for, in the same order on every rank.

        Layer and vocab layouts of each stage, plus each stage's *input layout* (the previous
        stage's last layer layout moved to this stage) so relayout at stage boundaries works.
        """
        plan = self.plan
        n = plan.stage_size
        seen: set[Layout] = set()
        for i, layer in enumerate(plan.layers):
            stage = plan.stage_of_layer(i)
            seen.add(make_layout(stage, layer.tp, layer.tp_consecutive, n))
            chunk = plan.chunk_of_layer(i)
            if chunk + 1 < plan.num_chunks and i == plan.chunk_layer_range(chunk)[-1]:
                # the next model chunk's stage (the next stage; stage 0 after the last one
                # when interleaved) receives this layout
                seen.add(make_layout((chunk + 1) % plan.pp_size, layer.tp, layer.tp_consecutive, n))
        for stage in {0, plan.pp_size - 1}:
            seen.add(make_layout(stage, plan.vocab.tp, True, n))
        return sorted(seen, key=lambda lay: (lay.stage, lay.tp, lay.consecutive))

    def _create_all_groups(self) -> None:
        plan = self.plan
        # Stage groups first, then embedding pairs, then per-layout TP and DP groups: one fixed
        # order so every rank issues the same sequence of collective new_group calls.
        self._stage_groups = [self._group(plan.stage_ranks(k)) for k in range(plan.pp_size)]
        self.stage_group = self._stage_groups[self.stage]
        self.embedding_group = None
        if plan.pp_size > 1:
            first, last = plan.stage_ranks(0), plan.stage_ranks(plan.pp_size - 1)
            for j in range(plan.stage_size):
                group = self._group([first[j], last[j]])
                if self.local_index == j and (self.is_first_stage or self.is_last_stage):
                    self.embedding_group = group
        device_type = self.device.type
        for layout in self.all_layouts():
            ranks = plan.stage_ranks(layout.stage)
            tp_groups = tp_group_ranks(ranks, layout.tp, layout.consecutive)
            dp_groups = dp_group_ranks(ranks, layout.tp, layout.consecutive)
            made_tp = [self._group(g) for g in tp_groups]
            made_dp = [self._group(g) for g in dp_groups]
            if layout.stage != self.stage:
                continue
            tp_rank, dp_rank = tp_dp_rank(self.local_index, len(ranks), layout.tp,
                                          layout.consecutive)
            self._layouts[layout] = LayerGroups(
                layout=layout, tp_group=made_tp[dp_rank], tp_rank=tp_rank, tp_size=layout.tp,
                tp_ranks=tp_groups[dp_rank], dp_group=made_dp[tp_rank], dp_rank=dp_rank,
                dp_size=len(ranks) // layout.tp, dp_ranks=dp_groups[tp_rank],
                device_type=device_type)

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

    def layout_groups(self, layout: Layout) -> LayerGroups:
        """Groups of this rank for ``layout`` (a layout of this rank's stage)."""
        layout = make_layout(layout.stage, layout.tp, layout.consecutive, self.stage_size)
        if layout not in self._layouts:
            raise KeyError(f"layout {layout} is not used on stage {self.stage} by this plan; "
                           f"known: {sorted(self._layouts, key=str)}")
        return self._layouts[layout]

    def layer_layout(self, layer: int) -> Layout:
        strategy = self.plan.layers[layer]
        return make_layout(self.plan.stage_of_layer(layer), strategy.tp,
                           strategy.tp_consecutive, self.stage_size)

    def layer_groups(self, layer: int) -> LayerGroups:
        """Groups for global layer index ``layer``, which must belong to this rank's stage."""
        if self.plan.stage_of_layer(layer) != self.stage:
            raise ValueError(f"layer {layer} lives on stage {self.plan.stage_of_layer(layer)}, "
                             f"not on this rank's stage {self.stage}")
        return self.layout_groups(self.layer_layout(layer))

    def vocab_layout(self, stage: int | None = None) -> Layout:
        stage = self.stage if stage is None else stage
        return make_layout(stage, self.plan.vocab.tp, True, self.stage_size)

    def vocab_groups(self) -> LayerGroups:
        """Embedding / LM-head groups (vocab tp, consecutive) on this rank's stage."""
        if not (self.is_first_stage or self.is_last_stage):
            raise ValueError(f"stage {self.stage} holds neither the embedding nor the LM head")
        return self.layout_groups(self.vocab_layout())

    def __repr__(self) -> str:
        return (f"ParallelContext(rank={self.rank}, world_size={self.world_size}, "
                f"stage={self.stage}/{self.num_stages}, local_index={self.local_index}, "
                f"groups={self.num_groups})")
