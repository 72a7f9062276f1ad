"""Plan-independent parameter initialisation, and gathering TP shards back into full tensors.

Every parameter has a fully qualified name (FQN) that does not depend on the plan. Its initial
value is drawn as the FULL global tensor from a CPU ``torch.Generator`` seeded from
``(seed, fqn)`` and only then cut into this rank's TP shard, so every plan (and a single process)
starts from bit-identical weights. Rules (Megatron's): norm weights 1, biases 0, output
projections of a residual branch (``linear_proj``, ``linear_fc2``) N(0, std/sqrt(2L)), every other
matrix N(0, std).

Which parameters are sharded, and how, is read from the modules themselves: a tensor-parallel
module carries ``tp_shard_dims`` ({param name: dim}) and its ``tp_group/tp_size/tp_rank``. A
module may shard a second dimension over a second group (an MoE layer's experts: EP on dim 0,
expert TP on dim 1 or 2) with ``inner_shard_dims`` and ``inner_group/inner_size/inner_rank``:
the chunk of the first split is cut again along the second dimension (:attr:`ShardSpec.inner`).
:func:`collect_shard_specs` records that per FQN once (before FSDP2 may wrap the parameters), and
:func:`gather_full_state` uses it to rebuild full tensors for equivalence tests and checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import ModelConfig
from ..parallel.comm import all_gather_dim
from ..parallel.random import derive_seed

#: suffixes of the residual-branch output projections (scaled init)
SCALED_INIT_SUFFIXES = ("linear_proj.weight", "linear_fc2.weight")


@dataclass(frozen=True)
class ShardSpec:
    """Parameter ``fqn`` is the contiguous chunk ``tp_rank`` (of ``tp_size``) along ``dim``;
    with ``inner``, that chunk is cut again: this rank holds chunk ``inner.tp_rank`` of it
    along ``inner.dim`` (another dimension, over ``inner.tp_group``)."""

    dim: int
    tp_size: int
    tp_rank: int
    tp_group: Any
    inner: "ShardSpec | None" = None

    def splits(self) -> list["ShardSpec"]:
        """The one-dimensional splits, outer first (each with ``inner`` None)."""
        outer = ShardSpec(self.dim, self.tp_size, self.tp_rank, self.tp_group)
        return [outer] + (self.inner.splits() if self.inner is not None else [])


def _module_split(module: nn.Module, pname: str, prefix: str) -> ShardSpec | None:
    """The split of ``module.<pname>`` its ``<prefix>shard_dims`` names (None: not split there,
    or over one rank)."""
    dims = getattr(module, f"{prefix}shard_dims", None) or {}
    size = getattr(module, f"{prefix}size", 1)
    if pname not in dims or size == 1:
        return None
    return ShardSpec(dims[pname], size, getattr(module, f"{prefix}rank"),
                     getattr(module, f"{prefix}group"))


def collect_shard_specs(root: nn.Module) -> dict[str, ShardSpec]:
    """FQN -> :class:`ShardSpec` for every sharded parameter under ``root`` (``tp_shard_dims``
    with tp_size > 1, and/or ``inner_shard_dims`` with inner_size > 1)."""
    specs: dict[str, ShardSpec] = {}
    for mod_name, module in root.named_modules():
        names = set(getattr(module, "tp_shard_dims", None) or {})
        names |= set(getattr(module, "inner_shard_dims", None) or {})
        for pname in sorted(names):
            if getattr(module, pname, None) is None:
                continue
            outer = _module_split(module, pname, "tp_")
            inner = _module_split(module, pname, "inner_")
            if outer is None and inner is None:
                continue
            if outer is not None and inner is not None and outer.dim == inner.dim:
                raise ValueError(f"{mod_name}.{pname}: the two splits must use different "
                                 f"dimensions (both use dim {outer.dim})")
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            if outer is None:
                assert inner is not None
                specs[fqn] = inner
            else:
                specs[fqn] = ShardSpec(outer.dim, outer.tp_size, outer.tp_rank, outer.tp_group,
                                       inner)
    return specs


def global_shape(local: torch.Size | tuple[int, ...] | list[int], spec: ShardSpec | None
                 ) -> list[int]:
    """The global shape of a parameter whose local shard has shape ``local``."""
    shape = list(local)
    for split in (spec.splits() if spec is not None else []):
        shape[split.dim] *= split.tp_size
    return shape


def shard_tensor(full: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """This rank's chunk of ``full`` (the tensor itself when unsharded)."""
    for split in (spec.splits() if spec is not None else []):
        full = full.chunk(split.tp_size, dim=split.dim)[split.tp_rank]
    return full


def _norm_param_fqns(root: nn.Module) -> set[str]:
    names = set()
    for mod_name, module in root.named_modules():
        # a module may say it is a norm (apex's fused norms, the TE layer's views of its
        # fused norms' parameters: models/te_layers.py)
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or getattr(module, "is_norm", False):
            for pname, _ in module.named_parameters(recurse=False):
                names.add(f"{mod_name}.{pname}" if mod_name else pname)
    return names


def full_initial_value(fqn: str, shape: torch.Size | tuple[int, ...], config: ModelConfig,
                       seed: int, *, is_norm: bool = False) -> torch.Tensor:
    """The global initial tensor of parameter ``fqn`` (fp32, CPU), independent of any plan."""
    if is_norm and fqn.endswith("weight"):
        return torch.ones(shape)
    if fqn.endswith("bias"):
        return torch.zeros(shape)
    std = config.init_method_std
    if fqn.endswith(SCALED_INIT_SUFFIXES):
        std = std / math.sqrt(2.0 * config.num_layers)
    gen = torch.Generator().manual_seed(derive_seed(seed, fqn))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_parameters(root: nn.Module, config: ModelConfig, seed: int,
                    specs: dict[str, ShardSpec] | None = None) -> None:
    """Fill every parameter of ``root`` with its shard of the plan-independent initial value."""
    specs = collect_shard_specs(root) if specs is None else specs
    norms = _norm_param_fqns(root)
    for fqn, param in root.named_parameters():
        spec = specs.get(fqn)
        shape = global_shape(param.shape, spec)
        full = full_initial_value(fqn, tuple(shape), config, seed, is_norm=fqn in norms)
        param.copy_(shard_tensor(full, spec))


def _local_value(t: torch.Tensor) -> torch.Tensor:
    # lazy: torch.distributed.tensor takes ~1 s to import; only ZeRO (FSDP2) runs have DTensors
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    if isinstance(t, DTensor):  # FSDP2 shards over the DP mesh: reassemble the TP-local tensor
        t = t.full_tensor()
    return t.detach()


@torch.no_grad()
def gather_full_state(stage: nn.Module, ctx: Any = None, *, grads: bool = False
                      ) -> dict[str, torch.Tensor]:
    """FQN -> full global tensor (fp32 CPU copy) of every parameter (or gradient) this rank holds.

    Collective over each TP group and inner split group (every member must call it, same order). Parameters without a
    gradient are skipped when ``grads`` is True. ``ctx`` is accepted for symmetry with other
    runtime helpers; the shard layout comes from ``stage.shard_specs`` (or the modules).
    """
    specs = getattr(stage, "shard_specs", None)
    if specs is None:
        specs = collect_shard_specs(stage)
    out: dict[str, torch.Tensor] = {}
    for fqn, param in stage.named_parameters():
        value = param.grad if grads else param
        if value is None:
            continue
        local = _local_value(value)
        spec = specs.get(fqn)
        if spec is not None and dist.is_initialized():
            for split in reversed(spec.splits()):  # the inner split first
                if split.tp_size > 1:
                    local = all_gather_dim(local, split.tp_group, dim=split.dim)
        out[fqn] = local.float().cpu().clone()
    return out
