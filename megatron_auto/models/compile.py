"""``--compile``: ``torch.compile`` of each transformer layer, not of the pipeline schedule.

Each layer module is compiled in place (``nn.Module.compile``), so its parameters keep their
plan-independent names (``torch.compile(module)`` would wrap them under ``_orig_mod.``) and
checkpoints move between compiled and eager runs. The schedule, the relayouts between layers
and the data-parallel machinery stay eager: they are control flow and communication, where a
graph buys nothing. Communication inside a layer (tensor-parallel all-reduces, FSDP2's gathers
in its hooks) makes dynamo break the graph around the collective; the pieces between still
compile and the numerics stay those of eager mode (tested in fp32 against eager).

Backends: ``inductor`` (the default: generated kernels; on CPU it needs a working C++ compiler,
on CUDA triton), ``aot_eager`` (traces forward and backward through AOTAutograd but runs eager
kernels: what CI uses on 2 cores, since it exercises the same graph capture quickly), ``eager``
(dynamo only). When inductor cannot run here, one warning names the cause and the layers stay
eager; a backend name torch does not know is a configuration error.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from typing import Iterable

import torch
from torch import nn

from ..run_config import COMPILE_BACKENDS as BACKENDS

logger = logging.getLogger(__name__)


class CompileError(ValueError):
    """An unusable ``--compile-backend``; the message names the value and the choices."""


def inductor_unavailable_reason(device: torch.device) -> str | None:
    """Why inductor cannot generate kernels for ``device`` here, or None when it can."""
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "inductor on CUDA needs the triton package, which is not installed"
        return None
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None and shutil.which("c++") is None:
        return f"inductor on CPU needs a C++ compiler ({compiler} or c++ on PATH); none found"
    return None


def resolve_backend(backend: str, device: torch.device) -> str | None:
    """The backend to use, or None (stay eager) after one warning when inductor cannot run."""
    if backend not in BACKENDS:
        raise CompileError(f"--compile-backend={backend}: unknown; choose one of "
                           f"{', '.join(BACKENDS)}")
    if backend == "inductor":
        reason = inductor_unavailable_reason(device)
        if reason is not None:
            logger.warning("--compile: %s; the layers run eagerly (use --compile-backend "
                           "aot_eager to trace them without generated kernels)", reason)
            return None
    return backend


def compile_layers(layers: Iterable[nn.Module], backend: str, device: torch.device) -> int:
    """Compile every module of ``layers`` in place with ``backend``; returns how many were."""
    chosen = resolve_backend(backend, device)
    if chosen is None:
        return 0
    count = 0
    for layer in layers:
        layer.compile(backend=chosen)
        count += 1
    return count
