"""Re-lay out a batch-split activation between two layouts of the same pipeline stage.

What moves is decided by :func:`megatron_auto.layout.relayout_step`, the rule the cost model
prices too: nothing when both layouts give every rank the same batch slice; a local slice when
every rank's new slice lies inside its old one; one all-gather over the rank's new TP group when
its members' old slices make up exactly the new one; otherwise one all-gather over the rank's
source DP group (one replica of every source slice: the whole micro-batch), then the new slice.
Backward is the same rule applied to the gradient the other way (``dst`` to ``src``).

A result that is a slice is copied (the slice alone, ``b/dp`` samples), in forward and in
backward: a view would keep the whole gathered buffer, or the whole source tensor, alive for as
long as the next layer (or its recompute checkpoint) keeps its input, which is memory the cost
model does not count and the layer does not use.
"""

from __future__ import annotations

from typing import Any

import torch

from ..layout import StageLayout, relayout_step, slice_bounds
from .comm import all_gather_into_tensor
from .context_parallel import sequence_chunks


def _relayout_data(x: torch.Tensor, src: Any, dst: Any, local_index: int,
                   stage_size: int) -> torch.Tensor:
    """Forward data movement; ``src``/``dst`` are LayerGroups of this rank's stage."""
    step = relayout_step(src.layout.layout, dst.layout.layout, stage_size, local_index)
    if step.is_identity:
        return x
    if step.gather:
        x = x.contiguous()
        out = torch.empty((len(step.gather_group) * x.shape[0],) + tuple(x.shape[1:]),
                          dtype=x.dtype, device=x.device)
        # "src_dp": the source slice group (its DP group without CP): every batch slice of
        # this rank's sequence chunks once
        group = dst.tp_group if step.gather_on == "dst_tp" else src.slice_group
        all_gather_into_tensor(out, x, group=group)
        if step.keep_count == 1:
            return out  # exactly the new slice, in a buffer of its own
        x = out
    per = x.shape[0] // step.keep_count
    return x[step.keep_index * per:(step.keep_index + 1) * per].clone()


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, src: Any, dst: Any, local_index: int,
                stage_size: int) -> torch.Tensor:
        ctx.args = (src, dst, local_index, stage_size)
        return _relayout_data(x, src, dst, local_index, stage_size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        src, dst, local_index, stage_size = ctx.args
        return _relayout_data(grad, dst, src, local_index, stage_size), None, None, None, None


def relayout(x: torch.Tensor, src: Any, dst: Any, ctx: Any) -> torch.Tensor:
    """Move ``x`` (batch dim 0, this rank's ``src`` slice) to its ``dst`` slice (autograd).

    ``src``/``dst`` are :class:`LayerGroups` (or bare ``layout.StageLayout``, looked up in ``ctx``) of
    this rank's stage; ``ctx`` a :class:`ParallelContext`. Returns ``x`` itself when both layouts
    assign every rank the same slice, else a new tensor that shares no storage with ``x``.
    """
    if src is dst:
        return x
    src_layout = src if isinstance(src, StageLayout) else src.layout
    dst_layout = dst if isinstance(dst, StageLayout) else dst.layout
    if src_layout.stage != dst_layout.stage:
        raise ValueError(f"relayout between different stages ({src_layout} -> {dst_layout}); "
                         f"move the layout to the receiving stage first")
    if isinstance(src, StageLayout):
        src = ctx.layout_groups(src)
    if isinstance(dst, StageLayout):
        dst = ctx.layout_groups(dst)
    n = ctx.stage_size
    if relayout_step(src.layout.layout, dst.layout.layout, n, ctx.local_index).is_identity:
        return x
    return _Relayout.apply(x, src, dst, ctx.local_index, n)


def batch_chunk(x: torch.Tensor, groups: Any) -> torch.Tensor:
    """This rank's contiguous dim-0 chunk of a whole micro-batch tensor under ``groups``' layout
    (its batch slice; under CP the slice of its CP block, every sequence position kept)."""
    if groups.slice_size == 1:
        return x
    if x.shape[0] % groups.slice_size:
        raise ValueError(f"micro-batch of {x.shape[0]} samples is not divisible by the "
                         f"{groups.slice_size} data-parallel replicas of layout {groups.layout}")
    start, stop = slice_bounds(groups.slice_rank, groups.slice_size, x.shape[0])
    return x[start:stop]


def sample_chunk(x: torch.Tensor, groups: Any) -> torch.Tensor:
    """What this rank holds of a whole micro-batch tensor ``(b_m, s, ...)`` (token ids, labels,
    loss mask, position ids): its batch slice (:func:`batch_chunk`) and, under context
    parallelism, its CP rank's two sequence chunks along dim 1 (``context_parallel``)."""
    return sequence_chunks(batch_chunk(x, groups), groups.cp_rank, groups.cp_size, dim=1)
