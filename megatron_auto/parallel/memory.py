"""Peak memory of one training iteration on this rank, with a breakdown by kind.

What is measured is what a GPU caching allocator would have *allocated* (not reserved): every live
tensor storage rounded up to the allocator's 512-byte block. The planner's memory model predicts
exactly this quantity, so the two can be compared (``metrics`` records both).

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` at the start of the
  iteration. The breakdown holds the parameter, gradient and optimizer-state bytes resident at the
  end of the iteration, and ``activations_and_temporaries`` = peak minus those. What decides
  whether a plan fits the device is more: :attr:`device_peak_bytes` = the allocator's
  ``max_memory_reserved`` (allocated plus its cached, fragmented blocks, which
  ``reset_peak_memory_stats`` also resets to the current reserve) plus the bytes in use outside
  it (``mem_get_info``'s used bytes less ``memory_reserved``: CUDA context, NCCL buffers). The
  planner's peak (reserve, fragmentation and NCCL terms included) predicts that one; the
  profiler's transient measurement uses the allocated peak. On CPU both are the same number.
- CPU: ``torch.distributed._tools.mem_tracker.MemTracker`` (a private PyTorch API, used only in
  this module): a dispatch mode that follows every storage's lifetime and records the peak split
  into parameters, buffers, gradients, activations, temporaries and optimizer state. Entering it
  resets the peak; the per-module statistics are cleared after each iteration so that they do not
  grow with the run.

The meter must see the model and optimizer before its first iteration (``track``); optimizer
state created during an iteration is picked up on its own.

Optimizer offload (``parallel/optimizer_offload.py``): on CPU the host share's tensors are in the
same memory and MemTracker counts those it sees (the AdamW state and masters, as optimizer
state). They are host memory, not device memory: the meter subtracts the ones that existed when
the iteration started (they then live through it, so they are in its peak) and reports them as
:attr:`PeakMemoryMeter.host_bytes`. The host step's own temporaries are not separated.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

# MemTracker's categories -> our names (the planner's memory_breakdown keys).
_MEMTRACKER_KINDS = {
    "Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients",
    "Activation": "activations", "Temp": "temporaries", "Optstate": "optimizer_state",
    "Other": "other",
}
ALLOCATOR_BLOCK_BYTES = 512  # the CUDA caching allocator's rounding (and MemTracker's)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors: Iterable[torch.Tensor], *, rounded: bool = True) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard).

    ``rounded`` rounds each storage up to the allocator block, as the GPU allocator would.
    """
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = _local(t).untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else id(storage)
        if key in seen:
            continue
        seen.add(key)
        size = storage.nbytes()
        if rounded and size:
            size = -(-size // ALLOCATOR_BLOCK_BYTES) * ALLOCATOR_BLOCK_BYTES
        total += size
    return total


def _state_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    return [v for opt in optimizers for state in opt.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def _make_tracker() -> Any:
    """A MemTracker that accepts a top-level module being called once per micro-batch.

    MemTracker refuses a second forward of a root module inside one ``with`` block (it takes it
    for the next iteration), but a pipeline schedule runs the stage once per micro-batch. The
    per-module statistics of that root are dropped and restarted instead; the global peak, which
    is all we report, is unaffected.
    """
    # lazy: torch.distributed._tools.mem_tracker takes ~1 s to import and only CPU runs need it
    from torch.distributed._tools.mem_tracker import MemTracker  # noqa: PLC0415

    class _MicrobatchMemTracker(MemTracker):
        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    tracker = _MicrobatchMemTracker()
    _pop_modules_after_backward(tracker._mod_tracker)
    return tracker


def _pop_modules_after_backward(mod_tracker: Any) -> None:
    """Stop the module tracker from hooking the gradients of module inputs.

    To see a module's backward end, the tracker registers a multi-grad hook on the inputs of
    every module call. Those hooks keep the pipeline's received activations (and their
    gradients) alive after their micro-batch -- through references in C++ that the garbage
    collector cannot break -- so the CPU peak of a later pipeline stage grew with every
    micro-batch the meter saw (measured: 8 leaked ``(b, s, h)`` tensors per iteration on the
    last of 2 stages; nothing leaks without the tracker). With the inputs hidden from it, the
    tracker closes each module's backward when the backward pass ends: only the per-module
    statistics, which are not reported, change; the peak and its split by kind do not.
    """
    hook = mod_tracker._fw_pre_hook

    def fw_pre_hook(module: nn.Module, inputs: Any) -> None:
        args, spec = tree_flatten(inputs)
        hidden = [None if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
        hook(module, tree_unflatten(hidden, spec))

    mod_tracker._fw_pre_hook = fw_pre_hook  # read by ModTracker.__enter__


@functools.lru_cache(maxsize=None)
def _rounded_record_class(base: type) -> type:
    """MemTracker's storage record ``base`` rounding every storage to the allocator block (one
    class per base, so records made in different iterations share it)."""

    class _RoundedWeakRefInfo(base):  # type: ignore[misc, valid-type]
        rounds_like_cuda = True

        def _calculate_mem_consumed(self) -> int:
            mem = self.size * self.element_size
            return -(-mem // ALLOCATOR_BLOCK_BYTES) * ALLOCATOR_BLOCK_BYTES

    return _RoundedWeakRefInfo


def _round_like_cuda(enable: bool) -> None:
    """Make MemTracker round CPU storages to the CUDA allocator block while a meter runs.

    MemTracker rounds only CUDA storages; a CPU run must report what the GPU would allocate.
    Storages seen while enabled keep the rounding rule (it lives on their record objects). The
    swapped class itself says whether it is ours, so no state of our own is kept.
    """
    # lazy: torch.distributed._tools.mem_tracker takes ~1 s to import and only CPU runs need it
    from torch.distributed._tools import mem_tracker  # noqa: PLC0415

    current = mem_tracker._WeakRefInfo
    ours = getattr(current, "rounds_like_cuda", False)
    if enable and not ours:
        mem_tracker._WeakRefInfo = _rounded_record_class(current)
    elif not enable and ours:
        mem_tracker._WeakRefInfo = current.__base__


class PeakMemoryMeter:
    """Measure one iteration's peak memory on ``device``; use as a context manager or start/stop.

    ::

        meter = PeakMemoryMeter(device, model, optimizer)
        with meter:
            ...one iteration...
        meter.peak_bytes, meter.breakdown

    Not re-entrant. On CPU the tracked objects must be given (constructor or :meth:`track`)
    before the first iteration; tensors the meter never saw are invisible to it.
    """

    def __init__(self, device: torch.device | str | None = None,
                 *track: nn.Module | torch.optim.Optimizer) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"PeakMemoryMeter device={self.device}: only cpu and cuda are "
                             f"supported; pass the device the model lives on")
        self.peak_bytes = 0
        self.device_peak_bytes = 0  # CUDA: reserved peak + bytes outside the allocator
        self.host_bytes = 0  # CPU: an offloaded optimizer's host tensors, taken out of the peak
        self._host_at_start: set[int] = set()
        self.breakdown: dict[str, int] = {}
        self._modules: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._pending: list[Any] = []
        self._tracker: Any = None
        self._active = False
        self.track(*track)

    def track(self, *objs: nn.Module | torch.optim.Optimizer) -> None:
        """Make modules and optimizers built outside the meter visible to it."""
        if self._active:
            raise RuntimeError("PeakMemoryMeter.track: call it between iterations, not inside one")
        for obj in objs:
            if isinstance(obj, nn.Module):
                self._modules.append(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                self._optimizers.append(obj)
            else:
                raise TypeError(f"PeakMemoryMeter.track: got {type(obj).__name__}; pass "
                                f"nn.Module or torch.optim.Optimizer objects")
            self._pending.append(obj)

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        if self._active:
            raise RuntimeError("PeakMemoryMeter.start: already measuring; call stop() first")
        self._active = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        if self._tracker is None:
            self._tracker = _make_tracker()
        _round_like_cuda(True)
        if self._pending:
            self._tracker.track_external(*self._pending)
            self._pending = []
        self._tracker.__enter__()
        self._host_at_start = {_local(t).untyped_storage().data_ptr()
                               for t in self._host_tensors()}

    def stop(self) -> int:
        """End the iteration; sets and returns :attr:`peak_bytes` (and :attr:`breakdown`)."""
        if not self._active:
            raise RuntimeError("PeakMemoryMeter.stop: start() was not called")
        self._active = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            reserved = int(torch.cuda.max_memory_reserved(self.device))
            free, total = torch.cuda.mem_get_info(self.device)
            outside = max(0, int(total - free) - int(torch.cuda.memory_reserved(self.device)))
            self.device_peak_bytes = reserved + outside
            params = storage_bytes(p for m in self._modules for p in m.parameters())
            grads = storage_bytes(p.grad for m in self._modules for p in m.parameters()
                                  if p.grad is not None)
            state = storage_bytes(_state_tensors(self._optimizers))
            self.breakdown = {"parameters": params, "gradients": grads, "optimizer_state": state,
                              "activations_and_temporaries":
                                  max(0, self.peak_bytes - params - grads - state),
                              "allocator_cache": max(0, reserved - self.peak_bytes),
                              "outside_allocator": outside}
            return self.peak_bytes
        tracker = self._tracker
        tracker.__exit__(None, None, None)
        _round_like_cuda(False)
        snapshot = tracker.get_tracker_snapshot("peak").get(self.device, {})
        breakdown = {ours: 0 for ours in _MEMTRACKER_KINDS.values()}
        total = 0
        for kind, nbytes in snapshot.items():
            name = getattr(kind, "value", kind)
            if name in _MEMTRACKER_KINDS:
                breakdown[_MEMTRACKER_KINDS[name]] += int(nbytes)
            elif name == "Total":
                total = int(nbytes)
        peak = total or sum(breakdown.values())
        # the host share of an offloaded optimizer: present all iteration, not device memory
        seen = [t for t in self._host_tensors()
                if _local(t).untyped_storage().data_ptr() in self._host_at_start
                and tracker._WINFO.get(_local(t).untyped_storage()) is not None]
        self.host_bytes = min(storage_bytes(seen), breakdown["optimizer_state"])
        breakdown["optimizer_state"] -= self.host_bytes
        self.breakdown = breakdown
        self.peak_bytes = peak - self.host_bytes
        self.device_peak_bytes = self.peak_bytes  # no allocator cache or context on CPU
        tracker.reset_mod_stats()  # per-module stats would otherwise grow every iteration
        return self.peak_bytes

    def _host_tensors(self) -> list[torch.Tensor]:
        return [t for opt in self._optimizers if hasattr(opt, "host_tensors")
                for t in opt.host_tensors()]

    def __enter__(self) -> "PeakMemoryMeter":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
