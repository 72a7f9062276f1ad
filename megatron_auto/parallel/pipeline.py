"""Pipeline schedules: non-interleaved 1F1B and GPipe, as plain functions (interleaved 1F1B,
for plans with ``pipeline.virtual_size > 1``, in :mod:`.interleaved`).

One call of :func:`forward_backward` runs one iteration's forward and backward passes over all
micro-batches on this rank's stage and leaves the gradients summed in the parameters (after the
data-parallel layer has synchronised them). With one stage it degenerates into plain gradient
accumulation.

Contracts (docs/design.md §4, agreed runtime interfaces):

- ``stage(x, **kwargs)``: on the first stage ``x`` is the micro-batch's token ids (every
  first-stage rank passes the whole micro-batch, the stage takes its slice); elsewhere ``x`` is
  the activation received from rank ``j`` of the previous stage. A non-last stage returns its
  output activation; the last stage returns ``(loss_sum, num_tokens)`` for its slice.
- ``stage.input_shape(b)`` / ``stage.output_shape(b)`` give the per-rank shapes exchanged with
  the neighbours for a micro-batch of ``b`` samples (``ctx.plan.microbatch_size``).
- Loss normalisation: each micro-batch's ``loss_sum`` is divided by ``total_tokens`` (masked
  tokens of the whole global batch) and multiplied by ``loss_scale`` before backward, so that
  after all micro-batches the gradient is that of the global mean loss (times the scale) and the
  data-parallel layer only has to *sum*.
- ``data_parallel.set_microbatch(k, M)`` is called before the ``k``-th backward of the
  iteration (``k = M - 1`` is the last one), ``data_parallel.finish_grad_sync()`` after all.
  With interleaving ``k`` counts the backwards of the model chunk being run, so ``k = M - 1`` is
  each chunk's last backward, the one after which its layers' gradients are complete.
- Interleaved stages (``virtual_size > 1``) take a ``chunk=c`` keyword (the model chunk to run)
  in ``stage(x, chunk=c, ...)``, ``stage.input_shape(b, chunk=c)`` and
  ``stage.output_shape(b, chunk=c)``; chunk 0 gets the tokens, the last chunk returns the loss.
- Mixed precision: forwards run under ``torch.autocast(device, autocast_dtype)``; activations
  and their gradients travel between stages in ``autocast_dtype`` (fp32 without autocast).
- Loss parts (addition to the agreed interface, backward compatible): when ``loss_parts`` is a
  list and the last stage exposes a ``last_losses`` dict after its forward (BERT's MLM and SOP
  sums), a copy per micro-batch is appended to it, for logging.
- Micro-batch values that are not tensors with the batch dimension (e.g. BERT's ``sop_weight``,
  a 0-d tensor) are passed to the stage unchanged like any other keyword.

Memory: a non-last stage keeps, per in-flight micro-batch, its received input (its gradient is
needed) and only the autograd edge of its output. The output tensor itself is dropped right
after sending; if the stage's last operation saved it for backward, autograd still holds it,
otherwise it is freed. Backward then starts from that edge with the received gradient.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, Protocol, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ..plan import SCHEDULES
from ..schedule import num_warmup
from . import p2p
from .interleaved import run_interleaved
from .timers import Timers

_NO_TIMERS = Timers(0)

# Keys of a micro-batch dict that are not handed to the stage as keyword arguments.
_FIRST_STAGE_INPUT = "tokens"
_LAST_STAGE_KEYS = ("labels", "loss_mask")


def _virtual_size(plan: Any) -> int:
    """The plan's interleaving degree (plan-like stand-ins without the field: 1)."""
    return getattr(plan, "virtual_size", 1)


class GradSync(Protocol):
    """The part of ``DataParallel`` the schedule drives."""

    def set_microbatch(self, index: int, num_microbatches: int) -> None: ...

    def finish_grad_sync(self) -> None: ...


class _Stage:
    """Per-iteration helper: runs forward/backward of one micro-batch and the p2p around it."""

    def __init__(self, stage: torch.nn.Module, data_parallel: GradSync | None, ctx: Any,
                 microbatches: Sequence[dict], total_tokens: float, loss_scale: float,
                 forward_only: bool, autocast_dtype: torch.dtype | None,
                 loss_parts: list[dict] | None = None, timers: Timers | None = None) -> None:
        self.stage = stage
        self.timers = timers or _NO_TIMERS
        self.data_parallel = data_parallel
        self.ctx = ctx
        self.microbatches = microbatches
        self.num_microbatches = len(microbatches)
        self.total_tokens = float(total_tokens)
        self.loss_scale = float(loss_scale)
        self.forward_only = forward_only
        self.autocast_dtype = autocast_dtype
        self.comm_dtype = autocast_dtype or torch.float32
        self.is_first = bool(ctx.is_first_stage)
        self.is_last = bool(ctx.is_last_stage)
        b = ctx.plan.microbatch_size
        virtual_size = _virtual_size(ctx.plan)
        one_chunk = virtual_size == 1  # interleaved: shapes are asked per chunk
        self.input_shape = None if self.is_first or not one_chunk else tuple(stage.input_shape(b))
        self.output_shape = None if self.is_last or not one_chunk else tuple(stage.output_shape(b))
        self.losses: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.loss_parts = loss_parts
        self.num_chunks = ctx.num_stages * virtual_size
        self.num_backwards: dict[int | None, int] = {}  # per model chunk (None: not interleaved)

    # ------------------------------------------------------------------ p2p
    def recv_forward(self) -> torch.Tensor | None:
        if self.is_first:
            return None
        with self.timers("forward-recv"):
            x = p2p.recv_forward(self.ctx, self.input_shape, self.comm_dtype)
        return x if self.forward_only else x.requires_grad_()

    def send_forward(self, output: Any) -> None:
        if not self.is_last:
            with self.timers("forward-send"):
                p2p.send_forward(self.ctx, output, self.comm_dtype)

    def recv_backward(self) -> torch.Tensor | None:
        if self.is_last:
            return None
        with self.timers("backward-recv"):
            return p2p.recv_backward(self.ctx, self.output_shape, self.comm_dtype)

    def send_backward(self, grad: torch.Tensor | None) -> None:
        if not self.is_first:
            with self.timers("backward-send"):
                p2p.send_backward(self.ctx, grad, self.comm_dtype)

    def send_forward_recv_backward(self, output: Any) -> torch.Tensor | None:
        if self.is_last:
            return None
        with self.timers("forward-send-backward-recv"):
            return p2p.send_forward_recv_backward(self.ctx, output, self.output_shape,
                                                  self.comm_dtype)

    def send_backward_recv_forward(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        if self.is_first:
            return None
        with self.timers("backward-send-forward-recv"):
            x = p2p.send_backward_recv_forward(self.ctx, grad, self.input_shape, self.comm_dtype)
        return x.requires_grad_()

    # ------------------------------------------------------------- compute
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.ctx.device.type, dtype=self.autocast_dtype)

    def ends(self, chunk: int | None) -> tuple[bool, bool]:
        """(starts the model, ends the model) for ``chunk`` (None: this stage, not interleaved)."""
        if chunk is None:
            return self.is_first, self.is_last
        return chunk == 0, chunk == self.num_chunks - 1

    def forward(self, index: int, received: torch.Tensor | None, chunk: int | None = None) -> Any:
        """Forward of micro-batch ``index`` (of model ``chunk`` when interleaved): the scaled loss
        at the end of the model, else the output."""
        with self.timers("forward-compute"):
            return self._forward(index, received, chunk)

    def _forward(self, index: int, received: torch.Tensor | None, chunk: int | None) -> Any:
        is_first, is_last = self.ends(chunk)
        mb = self.microbatches[index]
        kwargs = {k: v for k, v in mb.items() if k != _FIRST_STAGE_INPUT and k not in _LAST_STAGE_KEYS}
        if is_last:
            for key in _LAST_STAGE_KEYS:
                if key in mb:
                    kwargs[key] = mb[key]
        if chunk is not None:
            kwargs["chunk"] = chunk
        x = mb[_FIRST_STAGE_INPUT] if is_first else received
        with self._autocast():
            out = self.stage(x, **kwargs)
        if not is_last:
            # One dtype on the wire; `.to` is a no-op (same tensor) when it already matches.
            return out.to(self.comm_dtype)
        loss_sum, num_tokens = out
        loss_sum = loss_sum.float()
        num_tokens = torch.as_tensor(num_tokens, dtype=torch.float32)
        self.losses.append((loss_sum.detach(), num_tokens.detach()))
        parts = getattr(self.stage, "last_losses", None)
        if self.loss_parts is not None and parts:
            self.loss_parts.append({k: float(v) for k, v in parts.items()})
        return loss_sum * (self.loss_scale / self.total_tokens)

    def backward(self, received: torch.Tensor | None, output: torch.Tensor | GradientEdge,
                 grad_output: torch.Tensor | None, chunk: int | None = None) -> torch.Tensor | None:
        """Backward of one micro-batch (of ``chunk``); returns the gradient of the received input."""
        is_first, is_last = self.ends(chunk)
        done = self.num_backwards.get(chunk, 0)
        if self.data_parallel is not None:
            self.data_parallel.set_microbatch(done, self.num_microbatches)
        self.num_backwards[chunk] = done + 1
        with self.timers("backward-compute"):
            if is_last:
                output.backward()
            else:
                torch.autograd.backward(output, grad_tensors=grad_output)
        if is_first:
            return None
        grad = received.grad
        if grad is None:
            # The stage ignored its input (cannot happen for a transformer stage): send zeros so
            # the previous stage's backward still runs and the pipeline keeps its rhythm.
            grad = torch.zeros_like(received)
        return grad.to(self.comm_dtype)

    def keep(self, output: Any, chunk: int | None = None) -> Any:
        """What survives from a sent output until its backward: the autograd edge only."""
        if self.ends(chunk)[1]:
            return output
        return get_gradient_edge(output)


def forward_backward(stage: torch.nn.Module, data_parallel: GradSync | None, ctx: Any,
                     microbatches: Sequence[dict], *, schedule: str, total_tokens: float,
                     loss_scale: float = 1.0, forward_only: bool = False,
                     autocast_dtype: torch.dtype | None = None,
                     loss_parts: list[dict] | None = None,
                     timers: Timers | None = None) -> list[tuple[float, float]]:
    """Run one iteration of ``schedule`` over ``microbatches``; see the module docstring.

    ``microbatches`` has one dict per micro-batch on every rank (its length is the micro-batch
    count); ranks of the first stage need ``"tokens"``, of the last stage ``"labels"`` and
    ``"loss_mask"``; other keys (``position_ids``, ``attention_mask``) go to the stage as keyword
    arguments. Returns ``[(loss_sum, num_tokens), ...]`` per micro-batch on last-stage ranks
    (unscaled, this rank's slice) and ``[]`` elsewhere. With ``forward_only`` no gradients are
    computed and ``data_parallel`` is not touched (evaluation). ``timers`` (a
    :class:`~.timers.Timers`; default: none) time the schedule's phases.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if len(microbatches) == 0:
        raise ValueError("microbatches is empty: an iteration needs at least one micro-batch")
    if total_tokens <= 0:
        raise ValueError(f"total_tokens={total_tokens}: the global batch has no token with a "
                         f"non-zero loss mask; check the dataset's loss_mask")
    run = _Stage(stage, data_parallel, ctx, microbatches, total_tokens, loss_scale,
                 forward_only, autocast_dtype, loss_parts, timers)
    with run.timers("forward-backward"):
        if _virtual_size(ctx.plan) > 1:
            run_interleaved(run)
        elif forward_only:
            with torch.no_grad():
                _forward_only(run)
        elif schedule == "gpipe":
            _gpipe(run)
        else:
            _one_f_one_b(run)
        if not forward_only and data_parallel is not None:
            with run.timers("all-grads-sync"):
                data_parallel.finish_grad_sync()
    return [(float(loss), float(tokens)) for loss, tokens in run.losses]


def _forward_only(run: _Stage) -> None:
    for i in range(run.num_microbatches):
        out = run.forward(i, run.recv_forward())
        run.send_forward(out)


def _forward_and_keep(run: _Stage, i: int, inputs: Any, outputs: Any) -> None:
    """Receive, run and send micro-batch ``i``'s forward; keep only what its backward needs."""
    x = run.recv_forward()
    out = run.forward(i, x)
    run.send_forward(out)
    inputs.append(x)
    outputs.append(run.keep(out))


def _gpipe(run: _Stage) -> None:
    """All forwards, then all backwards (in the same micro-batch order on every stage)."""
    inputs, outputs = [], []
    for i in range(run.num_microbatches):
        _forward_and_keep(run, i, inputs, outputs)
    for i in range(run.num_microbatches):
        grad_out = run.recv_backward()
        grad_in = run.backward(inputs[i], outputs[i], grad_out)
        inputs[i] = outputs[i] = None  # release what this micro-batch's backward needed
        run.send_backward(grad_in)


def _one_f_one_b(run: _Stage) -> None:
    """Non-interleaved 1F1B (PipeDream-flush), as in Megatron-LM.

    ``schedule.num_warmup`` forwards first (warm-up, so that the last stage can start backward
    at once); then one forward and one backward at a time (steady state, at most
    ``schedule.max_in_flight`` micro-batches in flight); then the warm-up micro-batches'
    backwards (cool-down): the order ``schedule.interleaved_order(pp, 1, ...)``, run with the
    paired p2p calls of :mod:`.p2p`.
    """
    num_mb = run.num_microbatches
    warmup = num_warmup(run.ctx.num_stages, 1, num_mb, run.ctx.stage)
    num_steady = num_mb - warmup
    inputs: deque = deque()
    outputs: deque = deque()

    # Warm-up: forwards only.
    for i in range(warmup):
        _forward_and_keep(run, i, inputs, outputs)

    # Steady state: forward of micro-batch warmup + i, backward of micro-batch i.
    x = run.recv_forward() if num_steady > 0 else None
    for i in range(num_steady):
        out = run.forward(warmup + i, x)
        grad_out = run.send_forward_recv_backward(out)
        inputs.append(x)
        outputs.append(run.keep(out))
        del out
        grad_in = run.backward(inputs.popleft(), outputs.popleft(), grad_out)
        if i == num_steady - 1:
            x = None
            run.send_backward(grad_in)
        else:
            x = run.send_backward_recv_forward(grad_in)

    # Cool-down: the warm-up micro-batches' backwards.
    for _ in range(warmup):
        grad_out = run.recv_backward()
        grad_in = run.backward(inputs.popleft(), outputs.popleft(), grad_out)
        run.send_backward(grad_in)
