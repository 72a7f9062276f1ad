"""Thin wrappers over the tensor collectives whose names changed in torch 2.13.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` and made the old names warn. Callers use the
functions here and get the new name when it exists, the old one otherwise, with no warning.
The name is looked up on ``torch.distributed`` at each call, so a wrapper installed there (the
collective-count test's) sees our collectives as well as FSDP2's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER = ("reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
                   else "reduce_scatter_tensor")


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Any:
    """Gather ``input`` from every rank of ``group`` into ``output`` (concatenated on dim 0)."""
    return getattr(dist, _ALL_GATHER)(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor,
                          op: Any = dist.ReduceOp.SUM, group: Any = None,
                          async_op: bool = False) -> Any:
    """Reduce ``input`` over ``group`` and keep this rank's dim-0 chunk in ``output``."""
    return getattr(dist, _REDUCE_SCATTER)(output, input, op=op, group=group, async_op=async_op)


def group_size(group: Any) -> int:
    """Ranks in ``group``; 1 when torch.distributed is not initialised (a world of one)."""
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def all_gather_dim(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in group-rank order (no autograd)."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into_tensor(out, x, group=group)
    if dim in (0, -x.dim()):
        return out
    # (size*a, ...) -> (size, a, ...) -> concatenate the size pieces along dim
    return torch.cat(out.chunk(size, dim=0), dim=dim)
