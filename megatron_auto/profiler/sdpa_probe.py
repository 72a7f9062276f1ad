"""Which SDPA kernel a forward actually ran, read from the op names torch's profiler records.

``F.scaled_dot_product_attention`` picks its kernel at run time (flash, memory-efficient,
cuDNN or the math fallback) from the device, dtype, mask and head size. The cost model needs to
know which one ran: only ``math`` keeps the ``s x s`` scores (docs/cost_model.md §9). The
profiler's CPU op trace names the aten op the dispatcher chose, on every device (CPU has a
flash kernel too: ``_scaled_dot_product_flash_attention_for_cpu``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile

# aten op name fragments -> the cost model's backend names (planner.hardware.ATTENTION_BACKENDS)
_OPS = (("_scaled_dot_product_flash_attention", "flash"),
        ("_flash_attention_forward", "flash"),
        ("_scaled_dot_product_efficient_attention", "efficient"),
        ("_efficient_attention_forward", "efficient"),
        ("_scaled_dot_product_cudnn_attention", "cudnn"),
        ("_scaled_dot_product_attention_math", "math"))


def backend_from_op_names(names: Iterable[str]) -> str:
    """The backend named by the first SDPA kernel op among ``names``; ``math`` when none of the
    fused kernels appears (the math path is made of plain matmuls and a softmax)."""
    for name in names:
        for fragment, backend in _OPS:
            if fragment in name:
                return backend
    return "math"


def sdpa_backend(forward: Callable[[], object]) -> str:
    """Run ``forward`` once under the profiler (no grad) and name the SDPA kernel it used."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        forward()
    return backend_from_op_names(event.name for event in prof.events())
