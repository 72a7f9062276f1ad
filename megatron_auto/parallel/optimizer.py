"""AdamW over the data-parallel layer's (possibly sharded) parameters.

Weight decay applies to matrices only: biases and 1-D parameters (LayerNorm/RMSNorm weights)
are exempt, as in Megatron-LM. The decision uses the parameter's *global* shape (a DTensor
shard of a matrix is still a matrix) and its name when the stage knows it.

Kernel choice: NVIDIA apex ``FusedAdam`` when importable on CUDA with plain tensors; else
torch's fused AdamW on CUDA with plain tensors; else torch's ``foreach`` implementation (the
path for CPU and for FSDP2 DTensor shards). All of them compute the same AdamW update, so the
single-process reference and every plan agree.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..run_config import OptimizerConfig

__all__ = ["OptimizerConfig", "build_optimizer", "param_groups"]


def _no_weight_decay(name: str, param: torch.Tensor) -> bool:
    # Norm weights are 1-D, so the shape rule covers them; the name catches 2-D-stored biases.
    # A zero1 slice is a flat piece of a model parameter: judge the parameter it comes from.
    name = name or getattr(param, "source_name", "")
    return getattr(param, "source_ndim", param.dim()) < 2 or name.endswith(".bias")


def _is_plain(param: torch.Tensor) -> bool:
    return type(param) in (torch.Tensor, nn.Parameter)


def param_groups(params: Iterable[nn.Parameter], names: dict[int, str],
                 weight_decay: float) -> list[dict]:
    """Group ``params`` by (decayed or not, plain tensor or DTensor shard); drop empty groups.

    Plain tensors and FSDP2's DTensor shards go to separate groups because torch's ``foreach``
    kernels refuse a list that mixes the two.
    """
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for p in params:
        if not p.requires_grad:
            continue
        key = (_no_weight_decay(names.get(id(p), ""), p), not _is_plain(p))
        groups.setdefault(key, []).append(p)
    return [{"params": groups[key], "weight_decay": 0.0 if key[0] else weight_decay}
            for key in sorted(groups)]


def build_optimizer(params: Iterable[nn.Parameter], config: OptimizerConfig, *, lr: float,
                    named_parameters: Iterable[tuple[str, nn.Parameter]] = (),
                    offload_fraction: float = 0.0) -> torch.optim.Optimizer:
    """AdamW over ``params`` (what ``DataParallel.parameters()`` yields).

    ``named_parameters`` (e.g. ``stage.named_parameters()``) supplies names for the weight-decay
    rule; parameters without a name fall back to the shape rule. ``offload_fraction`` > 0 (the
    plan's ``pipeline.optimizer_offload_fraction`` of this stage) steps that share of the
    parameters' bytes on the host (:class:`.optimizer_offload.HostOffloadAdamW`).
    """
    params = list(params)
    names = {id(p): n for n, p in named_parameters}
    groups = param_groups(params, names, config.weight_decay)
    if not groups:
        raise ValueError("build_optimizer: no trainable parameter on this rank; every rank must "
                         "own at least one layer's shard (check the plan)")
    kwargs: dict[str, Any] = dict(lr=lr, betas=(config.adam_beta1, config.adam_beta2),
                                  eps=config.adam_eps)
    if offload_fraction > 0.0:
        from .optimizer_offload import HostOffloadAdamW  # noqa: PLC0415 - only when offloading

        return HostOffloadAdamW(groups, offload_fraction,
                                device_optimizer=lambda g: _device_adamw(g, kwargs), **kwargs)
    return _device_adamw(groups, kwargs)


def _device_adamw(groups: list[dict], kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """AdamW over ``groups`` with the kernel of the module docstring."""
    params = [p for g in groups for p in g["params"]]
    plain_cuda = all(_is_plain(p) and p.is_cuda for p in params)
    if plain_cuda:
        try:
            from apex.optimizers import FusedAdam  # noqa: PLC0415 - optional dependency

            return FusedAdam(groups, adam_w_mode=True, **kwargs)
        except Exception:  # noqa: BLE001 - apex may fail to import in many ways (ABI, CUDA)
            return torch.optim.AdamW(groups, fused=True, **kwargs)
    return torch.optim.AdamW(groups, foreach=True, **kwargs)
