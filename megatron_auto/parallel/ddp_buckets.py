"""Bucketed, overlapped gradient all-reduce for ``ddp`` layers (replicated parameters).

Every ``ddp`` parameter's ``.grad`` is a view into a flat per-bucket buffer, so that autograd
accumulates micro-batch gradients straight into the buffer and one ``all_reduce`` per bucket
(no copy) sums it over the layer's data-parallel group.

Buckets never mix process groups or dtypes. Inside a group, parameters are laid out in reverse
registration order, which approximates the order in which backward produces their gradients, and
cut into buckets of about ``bucket_size_bytes``.

Overlap: during the *last* micro-batch's backward a post-accumulate-grad hook counts the
parameters of each bucket; when a bucket is complete its all-reduce is launched asynchronously
while backward continues with earlier layers. Buckets of one group are always launched in
index order (a complete bucket waits for the ones before it), so that every rank of the group
issues its collectives in the same order even if autograd finished them in another order.
:meth:`GradBuckets.finish` launches what is left (parameters that got no gradient) and waits.
Earlier micro-batches only accumulate; they communicate nothing.

Sharded mode (``shard=True``, the ``zero1`` distributed optimizer): each bucket's buffer is
padded to a multiple of the group size and *reduce-scattered* instead of all-reduced, in place:
rank ``r`` of the group ends up with the summed gradient of its contiguous ``1/dp`` slice
``buffer[r*n/dp:(r+1)*n/dp]`` (:attr:`_Bucket.shard`), the rest of the buffer keeps its local,
unreduced values. :mod:`.distributed_optimizer` steps on those slices and all-gathers the updated
parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .comm import reduce_scatter_tensor


@dataclass
class _Bucket:
    group: Any
    buffer: torch.Tensor  # flat (numel,) gradient storage of the bucket's parameters
    params: list[nn.Parameter]
    views: list[torch.Tensor]  # views[k] is params[k].grad's home inside ``buffer``
    num_ready: int = 0
    ready: set[int] = field(default_factory=set)  # id() of params whose gradient is final
    work: Any = None  # the async all-reduce handle once launched
    launched: bool = False
    shard: torch.Tensor | None = None  # sharded mode: this rank's slice of ``buffer``
    shard_start: int = 0  # where ``shard`` starts inside ``buffer``


class GradBuckets:
    """Sum the gradients of replicated parameters over their data-parallel groups.

    ``groups`` lists ``(dp_group, params)`` pairs; a parameter may appear in one pair only.
    Groups with a single rank need no communication and should not be passed. Each pair gets
    its own buckets. ``shard=True``: reduce-scatter instead of all-reduce (module docstring).
    """

    def __init__(self, groups: Sequence[tuple[Any, Sequence[nn.Parameter]]], *,
                 bucket_size_bytes: int = 25 * 2**20, overlap: bool = True,
                 shard: bool = False) -> None:
        if bucket_size_bytes <= 0:
            raise ValueError(f"bucket_size_bytes={bucket_size_bytes}: must be positive "
                             f"(e.g. 25 * 2**20 for 25 MiB buckets)")
        self.overlap = overlap
        self.shard = shard
        # Buckets whose all-reduce started while backward still had gradients of these groups to
        # produce, in the last step (for tests and benchmarks: how much communication overlaps).
        self.num_overlapped = 0
        self.last_num_overlapped = 0
        self._num_params = 0
        self._num_ready = 0  # parameters whose gradient is final in this step
        self._sync_now = True  # True while the last micro-batch's backward runs
        # One ordered bucket list per group; the launch cursor walks it in order.
        self._chains: list[list[_Bucket]] = []
        self._cursor: list[int] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (chain, bucket)
        seen: set[int] = set()
        for group, params in groups:
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in reversed(list(params)):
                if id(p) in seen:
                    raise ValueError("a parameter was given to two data-parallel groups; each "
                                     "parameter belongs to exactly one layer's group")
                seen.add(id(p))
                by_dtype.setdefault(p.dtype, []).append(p)
            for dtype, plist in by_dtype.items():
                chain = self._make_chain(group, dtype, plist, bucket_size_bytes, shard)
                self._chains.append(chain)
                self._cursor.append(0)
        for c, chain in enumerate(self._chains):
            for b, bucket in enumerate(chain):
                for p in bucket.params:
                    self._where[id(p)] = (c, b)
                    self._num_params += 1
                    p.register_hook(self._guard(id(p)))
                    p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.zero_grad()

    @staticmethod
    def _make_chain(group: Any, dtype: torch.dtype, params: list[nn.Parameter],
                    bucket_size_bytes: int, shard: bool = False) -> list[_Bucket]:
        chain: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        dp_size = dist.get_world_size(group) if shard else 1
        dp_rank = dist.get_rank(group) if shard else 0

        def close() -> None:
            numel = sum(p.numel() for p in current)
            padded = -(-numel // dp_size) * dp_size  # reduce-scatter needs equal slices
            buffer = torch.zeros(padded, dtype=dtype, device=current[0].device)
            views, offset = [], 0
            for p in current:
                views.append(buffer[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            bucket = _Bucket(group=group, buffer=buffer, params=list(current), views=views)
            if shard:
                per = padded // dp_size
                bucket.shard_start = dp_rank * per
                bucket.shard = buffer[bucket.shard_start:bucket.shard_start + per]
            chain.append(bucket)

        for p in params:
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_size_bytes:
                close()
                current, size = [], 0
        if current:
            close()
        return chain

    # ------------------------------------------------------------------ control
    @property
    def num_buckets(self) -> int:
        return sum(len(chain) for chain in self._chains)

    def buckets(self) -> list[_Bucket]:
        """Every bucket, in the same order on all ranks of a stage (chain by chain)."""
        return [bucket for chain in self._chains for bucket in chain]

    def set_sync(self, sync: bool) -> None:
        """Whether the coming backward is the last micro-batch's (the one that reduces)."""
        self._sync_now = sync

    def zero_grad(self) -> None:
        """Zero the buffers and point every ``.grad`` back at its buffer view."""
        self._num_ready = 0
        self._cursor = [0] * len(self._chains)
        for chain in self._chains:
            for bucket in chain:
                self._reset(bucket)
                bucket.buffer.zero_()
                for p, view in zip(bucket.params, bucket.views):
                    p.grad = view

    @staticmethod
    def _reset(bucket: _Bucket) -> None:
        bucket.ready.clear()
        bucket.num_ready = 0
        bucket.work = None
        bucket.launched = False

    # ----------------------------------------------------------------- hooks
    def _guard(self, key: int) -> Any:
        """A hook that runs *before* accumulation and refuses to touch a buffer in flight."""

        def check(grad: torch.Tensor) -> None:
            c, b = self._where[key]
            if self._chains[c][b].launched:
                raise RuntimeError(
                    "a ddp parameter received a gradient after its bucket's all-reduce was "
                    "launched (a second backward in the last micro-batch without "
                    "set_microbatch/finish_grad_sync, or reentrant checkpointing); call "
                    "set_microbatch before every backward and use non-reentrant checkpointing")

        return check

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync_now:
            return
        c, b = self._where[id(param)]
        bucket = self._chains[c][b]
        if id(param) not in bucket.ready:
            bucket.ready.add(id(param))
            bucket.num_ready += 1
            self._num_ready += 1
        if self.overlap:
            self._launch_ready(c)

    def _launch_ready(self, c: int) -> None:
        chain = self._chains[c]
        while self._cursor[c] < len(chain):
            bucket = chain[self._cursor[c]]
            if bucket.num_ready < len(bucket.params):
                return
            self._launch(bucket)
            if self._num_ready < self._num_params:
                self.num_overlapped += 1
            self._cursor[c] += 1

    @staticmethod
    def _launch(bucket: _Bucket) -> None:
        # Someone may have replaced .grad (e.g. optimizer.zero_grad(set_to_none=True) followed by
        # a backward that allocated a fresh tensor): fold it back into the buffer first.
        for k, (p, view) in enumerate(zip(bucket.params, bucket.views)):
            grad = p.grad
            if grad is None:
                view.zero_()
                p.grad = view
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                p.grad = view
        if bucket.shard is not None:
            # In place: the output is this rank's own slice of the input (NCCL's documented
            # in-place form; gloo copies the input first).
            bucket.work = reduce_scatter_tensor(bucket.shard, bucket.buffer, group=bucket.group,
                                                async_op=True)
        else:
            bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM,
                                          group=bucket.group, async_op=True)
        bucket.launched = True

    def finish(self) -> None:
        """Launch buckets not launched yet (in order), wait for all, reset for the next step."""
        self.last_num_overlapped, self.num_overlapped = self.num_overlapped, 0
        self._num_ready = 0
        for c, chain in enumerate(self._chains):
            while self._cursor[c] < len(chain):
                self._launch(chain[self._cursor[c]])
                self._cursor[c] += 1
        for chain in self._chains:
            for bucket in chain:
                if bucket.work is not None:
                    bucket.work.wait()
                self._reset(bucket)
        self._cursor = [0] * len(self._chains)
