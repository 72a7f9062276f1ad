"""Tensor-parallel layers (Megatron-style) over one explicit TP group.

Every layer takes the :class:`~megatron_auto.parallel.context.LayerGroups` of its layout and keeps
only its TP shard: a contiguous chunk ``tp_rank`` of the global weight along the dimension named in
``tp_shard_dims`` (read by :mod:`megatron_auto.models.init` to initialise and gather shards).
Parameters are allocated uninitialised; the model's plan-independent init fills them.

With ``tp_size == 1`` the layers are a plain ``F.linear`` / ``F.embedding`` with no extra copies.

Sequence parallelism (``sequence_parallel=True``, Megatron-SP, needs ``tp_size > 1``): the
column-parallel input and the row-parallel output are split along the sequence (b, s/tp, h).
The column-parallel layer all-gathers its input (backward: reduce-scatter of the input
gradient) and saves only the local chunk, gathering it again in backward for the weight
gradient; the row-parallel layer reduce-scatters instead of all-reducing, and its replicated
bias, now added to a sequence chunk, has its gradient summed over the TP group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .context import LayerGroups
from .mappings import (all_gather_sequence, copy_to_tensor_parallel, gather_from_last_dim,
                       reduce_from_tensor_parallel, reduce_scatter_sequence,
                       reduce_scatter_to_sequence, scatter_to_last_dim)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {parts}; "
                         f"choose a TP degree that divides it")
    return total // parts


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """``gather_sequence(x) @ W^T + b`` saving only the local (b, s/tp, in) input.

    Runs in the autocast dtype by hand (autocast does not reach inside a custom function's
    backward); gradients go back in the dtypes of the inputs.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: Any) -> torch.Tensor:
        dtype = _compute_dtype(x)
        xc, wc = x.to(dtype), weight.to(dtype)
        bc = None if bias is None else bias.to(dtype)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(xc, wc)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(all_gather_sequence(xc, group), wc, bc)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        full = all_gather_sequence(x, ctx.group)  # (b, s, in), gathered again
        grad_x = reduce_scatter_sequence(grad.matmul(weight), ctx.group)
        flat = grad.flatten(0, -2)  # (b*s, out/tp)
        grad_w = flat.t().matmul(full.flatten(0, -2))
        grad_b = flat.sum(0) if ctx.has_bias else None
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        return (grad_x.to(x_dtype), grad_w.to(w_dtype),
                None if grad_b is None else grad_b.to(b_dtype), None)


class _ParallelLinear(nn.Module):
    """What both TP linears hold: ``weight`` (out, in) split over the TP group along
    ``split_dim`` (0: output features, 1: input features), and a bias of the output features,
    split with them (``split_dim`` 0) or replicated."""

    def __init__(self, in_features: int, out_features: int, groups: LayerGroups, split_dim: int,
                 bias: bool, sequence_parallel: bool, device: torch.device | None,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.tp_size, self.tp_rank = groups.tp_group, groups.tp_size, groups.tp_rank
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        shape = [out_features, in_features]
        shape[split_dim] = _divide(shape[split_dim], self.tp_size,
                                   ("output features", "input features")[split_dim])
        self.weight = nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype))
                     if bias else None)
        self.tp_shard_dims = {"weight": 0, "bias": 0} if split_dim == 0 else {"weight": 1}


class ColumnParallelLinear(_ParallelLinear):
    """``y = x A^T + b`` with ``A`` (out, in) split along its rows (output features).

    Input ``(..., in)`` replicated on the TP group; output ``(..., out/tp)`` (this rank's output
    features) or, with ``gather_output``, the full ``(..., out)``. With ``sequence_parallel``
    the input is this rank's sequence chunk ``(b, s/tp, in)`` and the output ``(b, s, out/tp)``.
    """

    def __init__(self, in_features: int, out_features: int, groups: LayerGroups, *,
                 bias: bool = True, gather_output: bool = False, sequence_parallel: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, groups, 0, bias, sequence_parallel, device,
                         dtype)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        if self.sequence_parallel:
            y = _SequenceParallelColumnLinear.apply(x, self.weight, self.bias, self.tp_group)
        else:
            y = F.linear(copy_to_tensor_parallel(x, self.tp_group), self.weight, self.bias)
        return gather_from_last_dim(y, self.tp_group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}")


class RowParallelLinear(_ParallelLinear):
    """``y = x A^T + b`` with ``A`` (out, in) split along its columns (input features).

    Input ``(..., in/tp)`` when ``input_is_parallel`` (the usual case after a column-parallel
    layer), else the full ``(..., in)`` which is split here. Output ``(..., out)`` summed over the
    TP group; the bias is replicated and added once after the sum. With ``sequence_parallel``
    the output is this rank's sequence chunk ``(b, s/tp, out)`` of the sum.
    """

    def __init__(self, in_features: int, out_features: int, groups: LayerGroups, *,
                 bias: bool = True, input_is_parallel: bool = True,
                 sequence_parallel: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, groups, 1, bias, sequence_parallel, device,
                         dtype)
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        if not self.input_is_parallel:
            x = scatter_to_last_dim(x, self.tp_group)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(F.linear(x, self.weight), self.tp_group)
            # each rank adds the bias to its own positions: sum its gradient over the group
            return y if self.bias is None else y + copy_to_tensor_parallel(self.bias,
                                                                           self.tp_group)
        y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.tp_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table ``(V, h)`` split along the vocabulary: rank ``r`` holds rows
    ``[r*V/tp, (r+1)*V/tp)``. Tokens outside a rank's range look up zeros there; the sum over the
    TP group gives every rank the full ``(..., h)`` embedding.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, groups: LayerGroups, *,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group, self.tp_size, self.tp_rank = groups.tp_group, groups.tp_size, groups.tp_rank
        local = _divide(num_embeddings, self.tp_size, "vocabulary rows")
        self.vocab_start = self.tp_rank * local
        self.vocab_end = self.vocab_start + local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype))
        self.tp_shard_dims = {"weight": 0}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(out, self.tp_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy of logits split along the vocabulary, computed in fp32.

    Stable softmax: subtract the global row maximum (a MAX all-reduce), then one SUM all-reduce
    carries both the target logit (found on exactly one rank) and the sum of exponentials
    (``group=None``: the whole vocabulary is local, no communication).

    Memory (what the cost model's head profile measures): one logits-sized fp32 buffer is kept
    (the softmax) and backward turns it into the gradient in place, so the loss adds one
    transient logits copy in forward (the shifted logits while the input logits are alive) and
    none in backward -- ``F.cross_entropy`` would add two in backward.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any,
                tp_rank: int) -> torch.Tensor:
        x = logits.float()  # (..., V/tp); a copy when logits are already fp32 is made below
        row_max = x.max(dim=-1).values
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        x = x - row_max.unsqueeze(-1)
        local_size = x.shape[-1]
        start = tp_rank * local_size
        outside = (target < start) | (target >= start + local_size)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        exp = x.exp_()
        sums = torch.stack([target_logit, exp.sum(dim=-1)])
        if group is not None:
            dist.all_reduce(sums, group=group)
        target_logit, sum_exp = sums[0], sums[1]
        loss = torch.log(sum_exp) - target_logit
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local_target, outside)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # saved buffer, used once: modify in place
        grad.scatter_add_(-1, local_target.unsqueeze(-1),
                          (outside.to(grad.dtype) - 1.0).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 groups: LayerGroups | None = None) -> torch.Tensor:
    """Per-token cross entropy (fp32, shape of ``target``) of vocab-split ``logits`` (..., V/tp).

    ``target`` holds global vocabulary ids; ``groups`` is the vocab layout's groups (None or
    ``tp_size == 1``: the logits are the full vocabulary). Every degree, 1 included, runs the same
    in-place function, so the profile measured at tp=1 is the memory the runtime has at any tp.
    """
    if groups is None or groups.tp_size == 1:
        return _VocabParallelCrossEntropy.apply(logits, target, None, 0)
    return _VocabParallelCrossEntropy.apply(logits, target, groups.tp_group, groups.tp_rank)
