"""Named autograd communication functions; layers compose these and never call ``dist`` inline.

Each function takes the group it communicates over and is an identity (no copy, no collective)
when that group has one rank, so a world of one pays nothing.

==========================  =======================  ==============================
function                    forward                  backward
==========================  =======================  ==============================
copy_to_tensor_parallel     identity                 all-reduce (sum)
reduce_from_tensor_parallel all-reduce (sum)         identity
scatter_to_last_dim         keep own last-dim chunk  all-gather along the last dim
gather_from_last_dim        all-gather last dim      keep own last-dim chunk
==========================  =======================  ==============================

The first two are conjugates: a column-parallel layer copies its replicated input into the TP
region (its input gradient is the sum of every shard's contribution), a row-parallel layer sums
its partial outputs out of it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .comm import all_gather_dim, group_size


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    size = group_size(group)
    if x.shape[-1] % size:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the group size {size}")
    return x.chunk(size, dim=-1)[dist.get_rank(group)].contiguous()


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_dim(grad, ctx.group, dim=-1), None


class _GatherFromLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return all_gather_dim(x, group, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.group), None


def copy_to_tensor_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient in backward."""
    return x if group_size(group) == 1 else _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward."""
    return x if group_size(group) == 1 else _ReduceFromTensorParallel.apply(x, group)


def scatter_to_last_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Keep this rank's chunk of the last dimension; all-gather the gradient in backward."""
    return x if group_size(group) == 1 else _ScatterToLastDim.apply(x, group)


def gather_from_last_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather along the last dimension; keep this rank's chunk of the gradient in backward."""
    return x if group_size(group) == 1 else _GatherFromLastDim.apply(x, group)
