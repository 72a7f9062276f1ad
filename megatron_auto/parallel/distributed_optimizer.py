"""ZeRO-1, Megatron's distributed optimizer, on top of the ``ddp`` gradient buckets.

FSDP2 has no ZeRO-1 mode (it shards parameters or nothing), so ``dp_mode: zero1`` layers keep
their parameters and gradients replicated like ``ddp`` and shard only the optimizer:

- the parameters of a bucket live in one flat buffer laid out exactly like the bucket's gradient
  buffer (``param.data`` is a view into it), padded to a multiple of the DP group size;
- backward reduce-scatters each gradient bucket in place (:class:`GradBuckets` with
  ``shard=True``): rank ``r`` of the DP group holds the summed gradient of slice ``r``;
- the optimizer owns only this rank's slice, as one small 1-D parameter ("piece") per model
  parameter that intersects it, a view into the flat parameter buffer whose ``.grad`` is the
  matching view of the reduced gradient slice. AdamW is element-wise, so stepping on the
  pieces is the same arithmetic as stepping on the whole parameters; its ``exp_avg`` and
  ``exp_avg_sq`` therefore take ``1/dp`` of the replicated size;
- after ``optimizer.step()`` every bucket's parameter buffer is all-gathered in place, so every
  replica holds the updated parameters before the next forward (:meth:`ZeroOneShards.all_gather`,
  run by an optimizer step post-hook).

Master weights: our mixed precision keeps fp32 parameters and computes under ``torch.autocast``
(no separate low-precision model copy), so the fp32 parameters are both the model and the
master weights and must be whole on every replica for forward; what zero1 shards is the
optimizer state. Pieces carry ``source_name`` / ``source_ndim`` (the model parameter's FQN and
dimensionality) so that the weight-decay rule sees the parameter, not the 1-D piece.

Every collective here runs bucket by bucket in :meth:`GradBuckets.buckets` order, which is the
same on all ranks of a stage, so ranks that share several DP groups issue them consistently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from .comm import all_gather_into_tensor
from .ddp_buckets import GradBuckets


@dataclass
class Piece:
    """This rank's part ``[start, stop)`` (flat, TP-local) of one model parameter."""

    fqn: str
    param: nn.Parameter  # the model parameter (replicated, a view into the parameter buffer)
    shard: nn.Parameter  # what the optimizer owns: flat view of ``param``'s elements
    start: int
    stop: int


class ZeroOneShards:
    """Flat parameter buffers, optimizer pieces and the post-step all-gather of ``buckets``.

    ``buckets`` must be a :class:`GradBuckets` built with ``shard=True``; ``names`` maps
    ``id(param)`` to its FQN. Construction moves every bucketed parameter's data into its flat
    buffer (values unchanged).
    """

    def __init__(self, buckets: GradBuckets, names: dict[int, str]) -> None:
        if not buckets.shard:
            raise ValueError("ZeroOneShards needs GradBuckets(shard=True) (reduce-scattered)")
        self.buckets = buckets
        self._param_buffers: list[torch.Tensor] = []
        self.pieces: list[Piece] = []
        self._pieces_of_bucket: list[list[Piece]] = []
        for bucket in buckets.buckets():
            assert bucket.shard is not None
            flat = torch.zeros_like(bucket.buffer)
            lo, hi = bucket.shard_start, bucket.shard_start + bucket.shard.numel()
            base = bucket.buffer.storage_offset()
            mine: list[Piece] = []
            for p, view in zip(bucket.params, bucket.views):
                offset, numel = view.storage_offset() - base, p.numel()
                home = flat[offset:offset + numel]
                home.copy_(p.detach().reshape(-1))
                p.data = home.view_as(p)
                a, b = max(offset, lo), min(offset + numel, hi)
                if a >= b:
                    continue  # none of this parameter's elements are in this rank's slice
                shard = nn.Parameter(flat[a:b])  # shares the buffer's storage
                shard.grad = bucket.buffer[a:b]  # the reduced gradient after the scatter
                fqn = names.get(id(p), "")
                shard.source_name = fqn  # type: ignore[attr-defined]
                shard.source_ndim = p.dim()  # type: ignore[attr-defined]
                mine.append(Piece(fqn, p, shard, a - offset, b - offset))
            self._param_buffers.append(flat)
            self._pieces_of_bucket.append(mine)
            self.pieces.extend(mine)
        self._sharded_ids = {id(p) for bucket in buckets.buckets() for p in bucket.params}
        self._names = {pid: names.get(pid, "") for pid in self._sharded_ids}

    # --------------------------------------------------------------- queries
    def owns(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is a zero1 model parameter (the optimizer sees its pieces)."""
        return id(param) in self._sharded_ids

    def shards(self) -> Iterator[nn.Parameter]:
        """The optimizer's parameters: this rank's pieces."""
        return (piece.shard for piece in self.pieces)

    @property
    def num_shard_elements(self) -> int:
        """Elements this rank's optimizer steps on (``1/dp`` of the zero1 parameters, + padding)."""
        return sum(piece.stop - piece.start for piece in self.pieces)

    # ------------------------------------------------------------- iteration
    def all_gather(self) -> None:
        """Give every replica the updated parameters: all-gather each buffer in place (collective
        over each bucket's DP group)."""
        works = []
        for bucket, flat in zip(self.buckets.buckets(), self._param_buffers):
            assert bucket.shard is not None
            mine = flat[bucket.shard_start:bucket.shard_start + bucket.shard.numel()]
            works.append(all_gather_into_tensor(flat, mine, group=bucket.group, async_op=True))
        for work in works:
            work.wait()

    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Run :meth:`all_gather` after every ``optimizer.step()`` (a skipped fp16 step runs
        none and changes nothing). Returns the hook handle."""
        return optimizer.register_step_post_hook(lambda *_: self.all_gather())

    # ----------------------------------------------------------- checkpoints
    @torch.no_grad()
    def full_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
        """Collective over each bucket's DP group: every zero1 parameter's optimizer state as
        whole (TP-local) tensors.

        Per FQN, each element-wise state (AdamW's ``exp_avg``, ``exp_avg_sq``) gathered over
        the DP group and shaped like the parameter, and the scalar ``step``; replicas get
        identical values. Empty when the optimizer has no state yet (before the first step).
        """
        names = _elementwise_state_names(optimizer)
        out: dict[str, dict[str, torch.Tensor]] = {}
        if not names:
            return out
        step = _scalar_states(optimizer)
        for bucket, pieces in zip(self.buckets.buckets(), self._pieces_of_bucket):
            assert bucket.shard is not None
            for name in names:
                full = torch.zeros_like(bucket.buffer)
                mine = full[bucket.shard_start:bucket.shard_start + bucket.shard.numel()]
                for piece in pieces:
                    a = self._offset(bucket, piece.param) + piece.start - bucket.shard_start
                    mine[a:a + piece.stop - piece.start].copy_(optimizer.state[piece.shard][name])
                all_gather_into_tensor(full, mine.clone(), group=bucket.group)
                for p in bucket.params:
                    offset = self._offset(bucket, p)
                    entry = out.setdefault(self._names[id(p)], dict(step))
                    entry[name] = full[offset:offset + p.numel()].view_as(p).clone()
        return out

    @torch.no_grad()
    def load_full_state(self, optimizer: torch.optim.Optimizer,
                        full: dict[str, dict[str, torch.Tensor]]) -> None:
        """Copy this rank's slices of :meth:`full_state`-shaped tensors into the pieces' state
        (which must exist: create it first, e.g. with one step at learning rate 0)."""
        for piece in self.pieces:
            state = optimizer.state[piece.shard]
            for key, value in full.get(piece.fqn, {}).items():
                if key not in state:
                    continue
                if value.dim() > 0:
                    state[key].copy_(value.reshape(-1)[piece.start:piece.stop])
                else:
                    state[key].copy_(value)

    @staticmethod
    def _offset(bucket: Any, param: torch.Tensor) -> int:
        view = bucket.views[[id(p) for p in bucket.params].index(id(param))]
        return view.storage_offset() - bucket.buffer.storage_offset()


def _elementwise_state_names(optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the parameter-shaped states (AdamW: exp_avg, exp_avg_sq), from any state the
    optimizer holds; every rank has the same ones once it has stepped."""
    return sorted({k for state in optimizer.state.values() for k, v in state.items()
                   if isinstance(v, torch.Tensor) and v.dim() > 0})


def _scalar_states(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The scalar states (AdamW's ``step``), equal for every parameter of the optimizer."""
    for state in optimizer.state.values():
        return {k: v.clone() for k, v in state.items()
                if isinstance(v, torch.Tensor) and v.dim() == 0}
    return {}
