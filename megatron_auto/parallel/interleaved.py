"""Interleaved 1F1B (Megatron's virtual pipeline) for plans with ``pipeline.virtual_size`` v > 1.

The model is cut into ``pp * v`` chunks; chunk ``c`` runs on stage ``c % pp``, so an activation
visits every stage v times (after the last stage it goes back to stage 0). A stage runs
``M * v`` forwards and as many backwards per iteration (``M`` micro-batches).

Order: ``schedule.interleaved_order``, the pure rules the cost model prices too (each op's
virtual micro-batch; Megatron's warm-up forwards, the steady state's forward-backward pairs,
the cool-down's backwards); ``M`` must be a multiple of ``pp``.

Communication: every send is posted asynchronously right after the compute that produced it
and waited for once the peer has certainly received it (an output: when its gradient arrives;
a gradient: when the previous rank's next message after its backward arrives,
:func:`gradient_send_releases`), else at the end of the iteration; a receive is posted when
the compute that needs it comes up and waited for at once. Because sends never block, a rank only waits for data its
neighbour produces earlier in the neighbour's own order, and the order above is deadlock-free
(``tests/test_interleaved.py`` simulates it for many (pp, v, M)). Messages between two ranks
are matched without ambiguity even when both neighbours are the same rank (pp = 2): every
message carries a tag unique to (direction, micro-batch, chunk) (gloo matches by tag), and
gradients travel on their own process group, so each (sender, receiver, group) stream is sent
and received in the same order (what NCCL, which ignores tags, needs; the forward and the
backward streams are each produced and consumed in virtual micro-batch order on every stage).
NCCL is reasoned about here, only gloo is tested.

Memory: like 1F1B, only the received input and the output's autograd edge are kept per
in-flight (micro-batch, chunk); stage ``k`` keeps up to ``schedule.max_in_flight`` of them.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from ..schedule import interleaved_order, virtual_microbatch

_BACKWARD_GROUPS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


class _Ring:
    """Asynchronous p2p with the ring neighbours of an interleaved pipeline."""

    def __init__(self, ctx: Any, dtype: torch.dtype, num_chunks: int) -> None:
        n, world = ctx.stage_size, ctx.world_size
        self.next_rank = (ctx.rank + n) % world
        self.prev_rank = (ctx.rank - n) % world
        self.device, self.dtype, self.num_chunks = ctx.device, dtype, num_chunks
        if ctx not in _BACKWARD_GROUPS:  # collective on first use: every rank runs the schedule
            _BACKWARD_GROUPS[ctx] = dist.new_group(list(range(world)))
        self.backward_group = _BACKWARD_GROUPS[ctx]
        # posted sends by (forward, micro-batch, receiving chunk): the buffer lives until waited
        self.pending: dict[tuple[bool, int, int], tuple[Any, torch.Tensor]] = {}

    def _tag(self, forward: bool, microbatch: int, chunk: int) -> int:
        return (microbatch * self.num_chunks + chunk) * 2 + (0 if forward else 1)

    def send(self, tensor: torch.Tensor, forward: bool, microbatch: int, chunk: int) -> None:
        """Post ``tensor`` for ``chunk`` (the receiving model chunk) of ``microbatch``."""
        if tensor.dtype != self.dtype:
            raise RuntimeError(f"pipeline p2p: sending a {tensor.dtype} tensor on a {self.dtype} "
                               f"channel; cast it first")
        tensor = tensor.detach().contiguous()
        peer = self.next_rank if forward else self.prev_rank
        group = None if forward else self.backward_group
        work = dist.isend(tensor, peer, group=group, tag=self._tag(forward, microbatch, chunk))
        self.pending[forward, microbatch, chunk] = (work, tensor)

    def release(self, forward: bool, microbatch: int, chunk: int) -> None:
        """Wait for a send the peer has certainly received already, and drop its buffer (which
        would otherwise live until :meth:`finish`)."""
        entry = self.pending.pop((forward, microbatch, chunk), None)
        if entry is not None:
            entry[0].wait()

    def recv(self, shape: tuple[int, ...], forward: bool, microbatch: int,
             chunk: int) -> torch.Tensor:
        """Receive what ``chunk`` of ``microbatch`` needs: its input (forward) or its output's
        gradient (backward)."""
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        peer = self.prev_rank if forward else self.next_rank
        group = None if forward else self.backward_group
        dist.irecv(out, peer, group=group, tag=self._tag(forward, microbatch, chunk)).wait()
        return out

    def finish(self) -> None:
        for work, _ in self.pending.values():
            work.wait()
        self.pending.clear()


def gradient_send_releases(pp: int, v: int, num_microbatches: int,
                           stage: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """When ``stage`` may wait for its gradient sends: ``{(micro-batch, chunk) of one of its
    forward receives: [(micro-batch, receiving chunk) of gradient sends]}``.

    The gradient ``stage`` sends for (``mb``, ``c``) is received by the previous ring rank at
    the start of its backward of (``mb``, ``c``); the next forward of that rank that sends to
    ``stage`` comes after it in that rank's order, so once ``stage`` has received that message
    its gradient send is complete and waiting for it cannot block. Sends with no such later
    message (the cool-down) are waited for at the end of the iteration."""
    prev = (stage - 1) % pp
    last_chunk = pp * v - 1
    order = interleaved_order(pp, v, num_microbatches, prev)
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    waiting: list[tuple[int, int]] = []
    for forward, mb, chunk in order:
        if not forward:
            if chunk < last_chunk:  # consumes the gradient stage sent for (mb, chunk)
                waiting.append((mb, chunk))
        elif chunk < last_chunk and waiting:
            out.setdefault((mb, chunk + 1), []).extend(waiting)
            waiting = []
    return out


def run_interleaved(run: Any) -> None:
    """Run one iteration of interleaved 1F1B with the ``_Stage`` helper ``run`` of pipeline.py."""
    ctx, plan = run.ctx, run.ctx.plan
    pp, v, num_mb = plan.pp_size, plan.virtual_size, run.num_microbatches
    last_chunk = plan.num_chunks - 1
    b = plan.microbatch_size
    ring = _Ring(ctx, run.comm_dtype, plan.num_chunks)
    if run.forward_only:
        order = [(True, *virtual_microbatch(t, pp, v, ctx.stage, True)) for t in range(num_mb * v)]
    else:
        order = interleaved_order(pp, v, num_mb, ctx.stage)
    inputs: dict[tuple[int, int], Any] = {}
    outputs: dict[tuple[int, int], Any] = {}
    # Sent buffers are dropped as soon as the peer has surely received them (else every sent
    # output and gradient of the iteration would stay alive until its end).
    releases = {} if run.forward_only else gradient_send_releases(pp, v, num_mb, ctx.stage)
    try:
        with torch.no_grad() if run.forward_only else torch.enable_grad():
            for forward, mb, chunk in order:
                if forward:
                    x = None
                    if chunk > 0:
                        with run.timers("forward-recv"):
                            x = ring.recv(tuple(run.stage.input_shape(b, chunk=chunk)), True, mb,
                                          chunk)
                        for sent_mb, sent_chunk in releases.get((mb, chunk), ()):
                            ring.release(False, sent_mb, sent_chunk)
                        if not run.forward_only:
                            x.requires_grad_()
                    out = run.forward(mb, x, chunk)
                    if chunk < last_chunk:
                        ring.send(out, True, mb, chunk + 1)
                    if not run.forward_only:
                        inputs[mb, chunk], outputs[mb, chunk] = x, run.keep(out, chunk)
                    del out, x  # the dicts (and a pending send) hold what is still needed
                else:
                    grad_out = None
                    if chunk < last_chunk:
                        with run.timers("backward-recv"):
                            grad_out = ring.recv(tuple(run.stage.output_shape(b, chunk=chunk)),
                                                 False, mb, chunk)
                        # the next stage ran forward (mb, chunk + 1) before this gradient
                        ring.release(True, mb, chunk + 1)
                    grad_in = run.backward(inputs.pop((mb, chunk)), outputs.pop((mb, chunk)),
                                           grad_out, chunk)
                    if chunk > 0:
                        ring.send(grad_in, False, mb, chunk - 1)
                    del grad_out, grad_in  # not past this backward: they are micro-batch sized
    finally:
        with run.timers("p2p-send-wait"):  # the posted sends, waited for once
            ring.finish()
