"""Re-lay out a batch-split activation between two layouts of the same pipeline stage.

Under a layout with ``dp`` replicas, local index ``j`` holds the contiguous batch chunk
``dp_rank(j)`` (``b/dp`` samples) of the micro-batch, replicated over its TP group (see
:mod:`megatron_auto.parallel.context`). Going from ``src`` to ``dst``:

- if, for EVERY rank of the stage, the ``dst`` chunk lies inside the ``src`` chunk (``dst.dp`` a
  multiple of ``src.dp`` and the chunk indices nested), each rank just slices locally (no comm);
  identical layouts and equal chunk assignments are the zero-copy special case;
- otherwise every rank all-gathers over its ``src`` DP group (one replica of each ``src`` chunk,
  in chunk order), which rebuilds the whole micro-batch, and keeps its ``dst`` chunk. (Any
  stage-wide gather would also do; the DP group moves ``n/tp_src`` times less data.)

The decision depends only on the two layouts, so all ranks of the stage take the same branch.
Backward is the reverse relayout of the gradient: each ``dst`` holder has the complete gradient of
its chunk (TP layers all-reduce input gradients), so re-laying it out to ``src`` gives every
``src`` holder the complete gradient of its chunk.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .comm import all_gather_into_tensor
from .context import Layout, tp_dp_rank


@functools.lru_cache(maxsize=None)
def _chunks(layout: Layout, stage_size: int) -> tuple[tuple[int, int], ...]:
    """Per local index: (dp_rank, dp_size)."""
    dp = stage_size // layout.tp
    return tuple((tp_dp_rank(j, stage_size, layout.tp, layout.consecutive)[1], dp)
                 for j in range(stage_size))


@functools.lru_cache(maxsize=None)
def relayout_is_local(src: Layout, dst: Layout, stage_size: int) -> bool:
    """True when every rank's ``dst`` chunk is inside its ``src`` chunk (pure)."""
    for (d_src, n_src), (d_dst, n_dst) in zip(_chunks(src, stage_size), _chunks(dst, stage_size)):
        if n_dst % n_src or d_dst // (n_dst // n_src) != d_src:
            return False
    return True


def _relayout_data(x: torch.Tensor, src: Any, dst: Any, local_index: int,
                   stage_size: int) -> torch.Tensor:
    """Forward data movement; ``src``/``dst`` are LayerGroups of this rank's stage."""
    src_chunks = _chunks(src.layout, stage_size)
    dst_chunks = _chunks(dst.layout, stage_size)
    if src_chunks == dst_chunks:
        return x
    d_dst, n_dst = dst_chunks[local_index]
    n_src = src.dp_size
    if relayout_is_local(src.layout, dst.layout, stage_size):
        per = x.shape[0] // (n_dst // n_src)
        start = (d_dst % (n_dst // n_src)) * per
        return x[start:start + per]
    # The src DP group holds one replica of every src chunk, ordered by dp_rank: gathering over
    # it rebuilds the whole micro-batch with n_src chunks of traffic (a stage-wide gather would
    # move stage_size chunks, duplicates included).
    x = x.contiguous()
    full = torch.empty((n_src * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype,
                       device=x.device)
    all_gather_into_tensor(full, x, group=src.dp_group)
    per = full.shape[0] // n_dst
    return full[d_dst * per:(d_dst + 1) * per]


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
    """Move ``x`` (batch dim 0, this rank's ``src`` chunk) to its ``dst`` chunk (autograd).

    ``src``/``dst`` are :class:`LayerGroups` (or bare :class:`Layout`, looked up in ``ctx``) of
    this rank's stage; ``ctx`` a :class:`ParallelContext`. Returns ``x`` itself when both layouts
    assign every rank the same chunk.
    """
    if src is dst:
        return x
    src_layout = src if isinstance(src, Layout) else src.layout
    dst_layout = dst if isinstance(dst, Layout) else dst.layout
    if src_layout.stage != dst_layout.stage:
        raise ValueError(f"relayout between different stages ({src_layout} -> {dst_layout}); "
                         f"move the layout to the receiving stage first")
    if isinstance(src, Layout):
        src = ctx.layout_groups(src)
    if isinstance(dst, Layout):
        dst = ctx.layout_groups(dst)
    n = ctx.stage_size
    if _chunks(src.layout, n) == _chunks(dst.layout, n):
        return x
    return _Relayout.apply(x, src, dst, ctx.local_index, n)


def batch_chunk(x: torch.Tensor, groups: Any) -> torch.Tensor:
    """This rank's contiguous dim-0 chunk of a whole micro-batch tensor under ``groups``' layout."""
    if groups.dp_size == 1:
        return x
    if x.shape[0] % groups.dp_size:
        raise ValueError(f"micro-batch of {x.shape[0]} samples is not divisible by the "
                         f"{groups.dp_size} data-parallel replicas of layout {groups.layout}")
    per = x.shape[0] // groups.dp_size
    return x[groups.dp_rank * per:(groups.dp_rank + 1) * per]
