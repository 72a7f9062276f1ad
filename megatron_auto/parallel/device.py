"""The one rule for which device this process computes on.

Training, ``--auto-parallel``'s profiling and the profilers all ask :func:`resolve_device`, so
that a model profile is measured on the device the run then trains on:

- an explicit request (``--device cuda:1``, ``cpu``) is honoured, and refused with a clear
  error when it names CUDA on a machine without it;
- otherwise CUDA's current device when CUDA is available and the process group (if one exists)
  is NCCL; a gloo group means CPU tensors, so CPU even on a GPU machine;
- otherwise the CPU.

Under torchrun the entry point first selects ``cuda:LOCAL_RANK`` (:func:`select_local_cuda_device`);
"CUDA's current device" is then that one.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


class DeviceError(ValueError):
    """A requested device that does not exist here; the message names it and the fix."""


def resolve_device(requested: str | torch.device | None = None) -> torch.device:
    """The device to compute on (see the module docstring for the rule)."""
    if requested is not None:
        try:
            device = torch.device(requested)
        except (RuntimeError, TypeError) as err:
            raise DeviceError(f"--device {requested}: not a device ({err}); use cuda, cuda:N "
                              f"or cpu") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise DeviceError(f"--device {requested}: CUDA is not available here; use --device cpu")
        return device
    if torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend() == "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def select_local_cuda_device() -> None:
    """Make ``cuda:LOCAL_RANK`` (torchrun's variable; 0 without it) the current CUDA device."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
