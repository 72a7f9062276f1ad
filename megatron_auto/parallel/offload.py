"""Activation offload: the tensors autograd saves for backward move to host memory in forward
and come back before they are used in backward (plan ``layers[i].offload``; applied by
models/recompute.py's LayerLevers).

``with ActivationOffload(device): y = layer(x)`` installs ``torch.autograd.graph
.saved_tensors_hooks``: each saved activation is copied to the host when autograd saves it and
the graph keeps only that copy, so the device tensor is freed as soon as forward no longer needs
it; backward's unpack copies it back to ``device``. Parameters (leaves that require grad) are
not moved: they stay resident anyway. On CUDA the host copy is pinned and made on a side
stream, so it overlaps the forward's compute; the unpack waits for it (an event) before copying
back. Hand-written rather than ``torch.autograd.graph.save_on_cpu`` because that copies on the
compute stream (no overlap) and would move the weights too.

On a CPU-only machine "device" and "host" are the same memory: the mechanism still runs (the
graph's saved tensors are replaced by copies and the originals released, which the tests check
with weak references) but saves nothing; its memory effect is a GPU measurement.
"""

from __future__ import annotations

from typing import Any

import torch


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved activations of the enclosed forward live on the host until backward.

    ``min_bytes``: smaller tensors stay where they are (a copy costs more than it saves).
    ``offloaded_bytes`` counts what was moved (for logs and tests)."""

    def __init__(self, device: torch.device | str, *, min_bytes: int = 0) -> None:
        self.device = torch.device(device)
        self.min_bytes = min_bytes
        self.offloaded_bytes = 0
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        if (tensor.requires_grad and tensor.grad_fn is None) or nbytes < self.min_bytes:
            return tensor  # a parameter (resident anyway) or too small to be worth a copy
        self.offloaded_bytes += nbytes
        if self._stream is None:  # CPU: the copy stands in for host memory
            return ("host", tensor.detach().clone(), None, tensor.device)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout,
                           pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        # the device tensor must not be reused before the copy has read it
        tensor.record_stream(self._stream)
        return ("host", host, event, tensor.device)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        _, host, event, device = packed
        if event is not None:
            event.synchronize()
            return host.to(device, non_blocking=True)
        return host
