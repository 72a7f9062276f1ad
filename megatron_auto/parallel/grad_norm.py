"""Global gradient-norm computation and clipping across every parallel dimension.

The global L2 norm must count every element of the *model's* gradient exactly once, although
ranks hold it in overlapping pieces: TP shards (each counted), TP-replicated tensors such as
LayerNorm weights (identical on all TP ranks: counted on TP rank 0), ``ddp`` replicas (identical
after the sum: counted on DP rank 0), ZeRO shards (disjoint: each counted), pipeline stages
(disjoint) and the last stage's copy of a tied word embedding (identical to the first stage's
after the tied sync: not counted). The caller decides per tensor whether this rank counts it
(:class:`NormEntry`); here each rank sums the squares of the tensors it counts and one
``all_reduce`` over the world adds the partial sums. inf and nan propagate into the result, which
fp16 loss scaling uses to detect overflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class NormEntry:
    """One local gradient tensor and whether this rank contributes it to the global norm."""

    grad: torch.Tensor
    counted: bool


def global_grad_norm(entries: Iterable[NormEntry], *, group: Any = None,
                     device: torch.device | None = None) -> float:
    """L2 norm of the counted gradients of all ranks of ``group`` (default: the world).

    Collective: every rank of ``group`` must call it, also ranks that count nothing.
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    for entry in entries:
        if entry.counted and entry.grad.numel():
            # Accumulate in fp64: the sum of squares of a large model in fp32 loses digits that
            # the single-process reference (one norm over all elements) keeps.
            total += torch.linalg.vector_norm(entry.grad, dtype=torch.float32).double() ** 2
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return math.sqrt(total.item())  # sqrt keeps inf and nan


def clip_grads_(grads: Sequence[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale ``grads`` in place by ``max_norm / (total_norm + 1e-6)`` when that is below one.

    Same rule as ``torch.nn.utils.clip_grad_norm_``; applied to every local gradient tensor,
    counted or not, so that replicas stay identical. A non-finite norm leaves the gradients
    alone (the optimizer step is skipped by the loss scaler in that case).
    """
    if max_norm <= 0.0 or not math.isfinite(total_norm):
        return
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0 and grads:
        torch._foreach_mul_(list(grads), coef)
