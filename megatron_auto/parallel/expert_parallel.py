"""Expert parallelism: an MoE layer's experts split over ``ep`` ranks of its data-parallel group.

Groups (``expert_layout.ExpertLayout`` has the rank arithmetic, shared with the cost model): the EP
group is ``ep`` consecutive members of the layer's DP group; EP rank ``r`` holds experts
``[r*E/ep, (r+1)*E/ep)``. The expert-DP group is the ``dp/ep`` members of the DP group with the
same EP rank: they hold the same experts and see different tokens, so the experts' gradients
are summed over it (``DataParallel`` reads :attr:`ExpertGroups.dp` for the experts' unit, in
the layer's ``expert_dp_mode``), while the rest of the layer keeps the layer's DP group. Under
dense TP (``expert_tp = 1``) each TP rank of the layer runs the same all-to-alls over its own
EP group on the same replicated tokens, so the experts stay replicated over TP like the router.

Dispatch (:class:`ExpertParallelDispatch`): the tokens arrive sorted by global expert, so the
rows for EP rank ``r`` are one contiguous block. The per-expert counts are exchanged first
(``all_to_all_single`` of ``ep x E/ep`` integers), which fixes the uneven split sizes of both
token exchanges; the tokens go out with ``all_to_all_single`` (rows grouped by source, then by
local expert), are regrouped by local expert, run through the local experts, put back in
arrival order and return with the reverse ``all_to_all_single``. Both exchanges are
:class:`_AllToAll`, whose backward is the reverse exchange of the gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .context import ExpertGroups


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any
                ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                               input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send,
                               input_split_sizes=ctx.recv, group=ctx.group)
        return out, None, None, None


def exchange_counts(counts: torch.Tensor, ep_size: int, group: Any) -> torch.Tensor:
    """``counts`` (E,) rows this rank sends per global expert -> (ep, E/ep): rows each EP rank
    sends to this rank's local experts."""
    local = counts.numel() // ep_size
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts.contiguous(), group=group)
    return got.view(ep_size, local)


class ExpertParallelDispatch:
    """The ``Dispatch`` of an MoE block under expert parallelism (see the module docstring)."""

    def __init__(self, groups: ExpertGroups, num_experts: int) -> None:
        self.groups = groups
        self.num_experts = num_experts

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: Any) -> torch.Tensor:
        g = self.groups
        ep, local = g.ep_size, self.num_experts // g.ep_size
        received = exchange_counts(counts, ep, g.ep_group)  # (source, local expert)
        send = counts.view(ep, local).sum(1).tolist()
        recv = received.sum(1).tolist()
        arrived = _AllToAll.apply(x, send, recv, g.ep_group)
        # arrival order: by source, then local expert; the experts want local-expert order
        expert_of = torch.repeat_interleave(
            torch.arange(local, device=x.device).repeat(ep), received.reshape(-1))
        order = torch.argsort(expert_of, stable=True)
        y = experts(arrived[order], received.sum(0))
        back = torch.empty_like(y).index_copy_(0, order, y)  # arrival order again
        return _AllToAll.apply(back, recv, send, g.ep_group)
