"""Point-to-point transfers between adjacent pipeline stages.

Rank ``j`` (local index inside its stage) of stage ``k`` talks only to rank ``j`` of stages
``k-1`` and ``k+1`` (``ctx.prev_rank`` / ``ctx.next_rank``): activations flow forward, their
gradients flow backward. Whatever layout the sending stage's last layer has, rank ``j`` sends
exactly what it holds; the receiving stage re-lays it out itself (``GPTStage.input_layout``).

Every transfer that a schedule step needs is posted at once (``batch_isend_irecv`` of
``isend``/``irecv`` operations) and then waited on. Posting a send and the matching opposite-direction receive
together is what keeps 1F1B free of deadlocks: two neighbours that both "send then receive"
with blocking calls would wait on each other forever (gloo's send completes only once the
peer receives).

Tensors travel in one communication dtype chosen by the schedule (the autocast dtype in mixed
precision, else fp32), so both sides agree on the buffer to allocate without a handshake.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.distributed as dist


class PipelineNeighbours(Protocol):
    """What p2p needs from ``ParallelContext``."""

    prev_rank: int | None
    next_rank: int | None
    device: torch.device


def communicate(ctx: PipelineNeighbours, *, send_next: torch.Tensor | None = None,
                send_prev: torch.Tensor | None = None,
                recv_prev_shape: Sequence[int] | None = None,
                recv_next_shape: Sequence[int] | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Post all requested transfers together, wait for them, return ``(from_prev, from_next)``.

    ``send_next``/``recv_next_shape`` need ``ctx.next_rank``; ``send_prev``/``recv_prev_shape``
    need ``ctx.prev_rank``. Received tensors are fresh, contiguous, of ``dtype`` on
    ``ctx.device``; a sent tensor must already have that dtype.
    """
    ops: list[tuple[object, torch.Tensor, int]] = []
    from_prev = from_next = None
    # Receives are posted before sends so that a peer's send always finds a posted buffer.
    if recv_prev_shape is not None:
        from_prev = torch.empty(tuple(recv_prev_shape), dtype=dtype, device=ctx.device)
        ops.append((dist.irecv, from_prev, _peer(ctx.prev_rank, "previous")))
    if recv_next_shape is not None:
        from_next = torch.empty(tuple(recv_next_shape), dtype=dtype, device=ctx.device)
        ops.append((dist.irecv, from_next, _peer(ctx.next_rank, "next")))
    if send_next is not None:
        ops.append((dist.isend, _checked(send_next, dtype), _peer(ctx.next_rank, "next")))
    if send_prev is not None:
        ops.append((dist.isend, _checked(send_prev, dtype), _peer(ctx.prev_rank, "previous")))
    if not ops:
        return from_prev, from_next
    # batch_isend_irecv groups the step's transfers (ncclGroupStart/End on NCCL, where a send
    # and a receive between the same two GPUs could otherwise wait on each other; plain
    # isend/irecv on gloo), so one code path serves both backends. torch.distributed's docs for
    # it: on NCCL the current device must be set (training/pretrain.py selects cuda:LOCAL_RANK
    # before the process group exists), and if it is the group's first collective every rank
    # of the group must take part (the trainer's world barrier comes first). Inside one NCCL
    # group the order of the ops does not matter; gloo needs the receives posted first (above).
    works = dist.batch_isend_irecv([dist.P2POp(fn, t, peer) for fn, t, peer in ops])
    for work in works:
        work.wait()
    return from_prev, from_next


def _peer(rank: int | None, which: str) -> int:
    if rank is None:
        raise RuntimeError(f"pipeline p2p: this rank has no {which} stage; the schedule asked "
                           f"for a transfer that cannot exist (a bug in the caller)")
    return rank


def _checked(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if tensor.dtype != dtype:
        raise RuntimeError(f"pipeline p2p: sending a {tensor.dtype} tensor on a {dtype} channel; "
                           f"cast it with .to({dtype}) first")
    return tensor.detach().contiguous()


# Named wrappers: each schedule step reads like Megatron's vocabulary.

def recv_forward(ctx: PipelineNeighbours, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Activation from the previous stage."""
    return communicate(ctx, recv_prev_shape=shape, dtype=dtype)[0]


def send_forward(ctx: PipelineNeighbours, output: torch.Tensor, dtype: torch.dtype) -> None:
    """Activation to the next stage."""
    communicate(ctx, send_next=output, dtype=dtype)


def recv_backward(ctx: PipelineNeighbours, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Gradient of this stage's output, from the next stage."""
    return communicate(ctx, recv_next_shape=shape, dtype=dtype)[1]


def send_backward(ctx: PipelineNeighbours, grad: torch.Tensor, dtype: torch.dtype) -> None:
    """Gradient of this stage's input, to the previous stage."""
    communicate(ctx, send_prev=grad, dtype=dtype)


def send_forward_recv_backward(ctx: PipelineNeighbours, output: torch.Tensor,
                               shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Steady 1F1B: ship this micro-batch's output, get the gradient of an older one back."""
    return communicate(ctx, send_next=output, recv_next_shape=shape, dtype=dtype)[1]


def send_backward_recv_forward(ctx: PipelineNeighbours, grad: torch.Tensor,
                               shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Steady 1F1B: ship an input gradient back, get the next micro-batch's input."""
    return communicate(ctx, send_prev=grad, recv_prev_shape=shape, dtype=dtype)[0]
