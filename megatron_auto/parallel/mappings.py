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
scatter_to_sequence         keep own sequence chunk  all-gather along the sequence
gather_from_sequence        all-gather sequence      keep own chunk, or reduce-scatter
reduce_scatter_to_sequence  reduce-scatter sequence  all-gather along the sequence
==========================  =======================  ==============================

The sequence functions serve sequence parallelism (Megatron-SP): activations ``(b, s, h)`` split
along the sequence (dim 1) over the TP group, TP rank ``r`` holding positions
``[r*s/tp, (r+1)*s/tp)``. ``gather_from_sequence(x, g, reduce_grad=True)`` is the input of a
column-parallel layer (every rank's gradient is a partial sum over its shards: reduce-scatter),
``reduce_grad=False`` the exit to a replicated activation (every rank has the whole gradient:
keep its chunk). ``reduce_scatter_to_sequence`` replaces a row-parallel layer's all-reduce.

The first two are conjugates: a column-parallel layer copies its replicated input into the TP
region (its input gradient is the sum of every shard's contribution), a row-parallel layer sums
its partial outputs out of it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from .comm import all_gather_dim, group_size, reduce_scatter_tensor


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    size = group_size(group)
    if x.shape[-1] % size:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the group size {size}")
    return x.chunk(size, dim=-1)[dist.get_rank(group)].contiguous()


SEQUENCE_DIM = 1  # activations are (b, s, h)


def _split_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    size = group_size(group)
    if x.shape[SEQUENCE_DIM] % size:
        raise ValueError(f"sequence length {x.shape[SEQUENCE_DIM]} is not divisible by the "
                         f"tensor-parallel size {size}; sequence parallelism needs it to be")
    return x.chunk(size, dim=SEQUENCE_DIM)[dist.get_rank(group)].contiguous()


def all_gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(b, s/tp, h) chunks -> (b, s, h) in TP-rank order (no autograd)."""
    return all_gather_dim(x, group, dim=SEQUENCE_DIM)


def reduce_scatter_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(b, s, h) partial sums -> this rank's (b, s/tp, h) chunk of their sum (no autograd)."""
    size = group_size(group)
    b, s = x.shape[0], x.shape[SEQUENCE_DIM]
    if s % size:
        raise ValueError(f"sequence length {s} is not divisible by the tensor-parallel size "
                         f"{size}; sequence parallelism needs it to be")
    # (b, s, ...) -> (tp, b, s/tp, ...): each rank's chunk contiguous for the collective
    chunks = x.reshape(b, size, s // size, *x.shape[2:]).transpose(0, 1).contiguous()
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_tensor(out, chunks.flatten(0, 1), group=group)
    return out


def _conjugate_pair(name: str, forward: Callable[[torch.Tensor, Any], torch.Tensor],
                    backward: Callable[[torch.Tensor, Any], torch.Tensor]) -> Any:
    """A named autograd function over a group: ``forward(x, group)`` forward,
    ``backward(grad, group)`` for the gradient (one row of the module docstring's table)."""

    def run_forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return forward(x, group)

    def run_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return backward(grad, ctx.group), None

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(run_forward), "backward": staticmethod(run_backward)})


def _identity(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x


def _sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _all_reduce(x.clone(), group)  # a copy: the input (or saved gradient) stays intact


def _gather_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    return all_gather_dim(x, group, dim=-1)


_CopyToTensorParallel = _conjugate_pair("_CopyToTensorParallel", _identity, _sum)
_ReduceFromTensorParallel = _conjugate_pair("_ReduceFromTensorParallel", _sum, _identity)
_ScatterToLastDim = _conjugate_pair("_ScatterToLastDim", _split_last, _gather_last)
_GatherFromLastDim = _conjugate_pair("_GatherFromLastDim", _gather_last, _split_last)
_ScatterToSequence = _conjugate_pair("_ScatterToSequence", _split_sequence, all_gather_sequence)
_ReduceScatterToSequence = _conjugate_pair("_ReduceScatterToSequence", reduce_scatter_sequence,
                                           all_gather_sequence)


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, reduce_grad: bool) -> torch.Tensor:
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.reduce_grad:
            return reduce_scatter_sequence(grad, ctx.group), None, None
        return _split_sequence(grad, ctx.group), None, None


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


def scatter_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Keep this rank's sequence chunk of a replicated (b, s, h); all-gather the gradient."""
    return x if group_size(group) == 1 else _ScatterToSequence.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: Any, *, reduce_grad: bool) -> torch.Tensor:
    """All-gather sequence chunks into (b, s, h); backward reduce-scatters the gradient
    (``reduce_grad``: each rank's is a partial sum) or keeps this rank's chunk of it."""
    return x if group_size(group) == 1 else _GatherFromSequence.apply(x, group, reduce_grad)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum partial (b, s, h) over the group, keep this rank's sequence chunk; all-gather back."""
    return x if group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group)
