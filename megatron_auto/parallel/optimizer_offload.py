"""Optimizer offload: AdamW with a share of its parameters stepped on the host.

The plan's ``pipeline.optimizer_offload_fraction`` (plan_optimizer_offload.py) says which share
of a stage's optimizer lives in host memory. :class:`HostOffloadAdamW` splits the parameters its
rank's optimizer owns (``DataParallel.parameters()``: whole ``ddp`` parameters, this rank's
``zero1`` slices) by bytes, in parameter order: a parameter is offloaded when it starts below
``fraction x total bytes`` (so 0 offloads nothing and 1 everything). For an offloaded parameter
the host holds an fp32 master copy, the two Adam moments and a gradient buffer (pinned memory on
CUDA); each step

1. copies its gradient device -> host (non-blocking from pinned memory, then one stream sync),
2. steps a CPU ``torch.optim.AdamW`` (``foreach``) on the host masters,
3. copies the updated master host -> device into the parameter (non-blocking; the next step's
   host update runs only after a later stream sync, so the source is not overwritten early).

The remaining parameters are stepped on the device by the usual kernel (optimizer.py). AdamW is
element-wise, so the split changes where the arithmetic runs, not its result.

Composition: the wrapper is a ``torch.optim.Optimizer`` whose ``param_groups`` are the device
parameters' groups (learning-rate schedule, ``_init_optimizer_state``) and whose ``state`` maps
each device parameter to its AdamW state wherever it lives (host tensors for offloaded ones), so
checkpoints save and load it by parameter name like any other; a checkpoint is therefore
independent of the fraction and reshards between fractions. Gradient clipping and loss-scale
unscaling act on the device gradients before :meth:`step`; zero1's post-step all-gather is a
step post-hook and sees the copied-back parameters. FSDP2 shards (``zero2``/``zero3``) are
DTensors and are refused (the plan refuses them first).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def offloaded_mask(params: list[torch.Tensor], fraction: float) -> list[bool]:
    """Which of ``params`` go to the host: those that start below ``fraction`` of the bytes."""
    total = sum(p.numel() * p.element_size() for p in params)
    limit, offset, out = fraction * total, 0, []
    for p in params:
        out.append(offset < limit)
        offset += p.numel() * p.element_size()
    return out


class HostOffloadAdamW(torch.optim.Optimizer):
    """AdamW over ``groups`` (``param_groups`` of optimizer.py) with ``fraction`` of the
    parameters' bytes stepped on the host; ``device_optimizer`` builds the device part's
    optimizer from its groups (the kernel choice of optimizer.py)."""

    def __init__(self, groups: list[dict], fraction: float, *, lr: float,
                 betas: tuple[float, float], eps: float,
                 device_optimizer: Callable[[list[dict]], torch.optim.Optimizer]) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"optimizer offload fraction={fraction}: must be in [0, 1]")
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        params = [p for g in self.param_groups for p in g["params"]]
        for p in params:
            if type(p) not in (torch.Tensor, nn.Parameter):
                raise ValueError("optimizer offload: a parameter is a DTensor shard (dp_mode "
                                 "zero2/zero3); the host optimizer steps ddp and zero1 "
                                 "parameters only: use ddp/zero1 or "
                                 "pipeline.optimizer_offload_fraction 0 for this stage")
        self.fraction = fraction
        self._pin = any(p.is_cuda for p in params)
        mask = dict(zip(map(id, params), offloaded_mask(params, fraction)))
        # id(device param) -> (device param, host master); the master's .grad is the buffer
        self._host: dict[int, tuple[torch.Tensor, nn.Parameter]] = {}
        host_groups, device_groups = [], []
        self._group_map: list[tuple[dict | None, dict | None]] = []
        for group in self.param_groups:
            on_host = [p for p in group["params"] if mask[id(p)]]
            on_device = [p for p in group["params"] if not mask[id(p)]]
            masters = [self._master(p) for p in on_host]
            extra = {k: v for k, v in group.items() if k != "params"}
            h = {"params": masters, **extra} if masters else None
            d = {"params": on_device, **extra} if on_device else None
            host_groups += [h] if h else []
            device_groups += [d] if d else []
            self._group_map.append((h, d))
        self.host_optimizer = (torch.optim.AdamW(host_groups, lr=lr, betas=betas, eps=eps,
                                                 foreach=True) if host_groups else None)
        self.device_optimizer = device_optimizer(device_groups) if device_groups else None
        # the inner optimizers' group dicts are copies: find them again, in order
        hosts = iter(self.host_optimizer.param_groups if self.host_optimizer else ())
        devices = iter(self.device_optimizer.param_groups if self.device_optimizer else ())
        self._group_map = [(next(hosts) if h else None, next(devices) if d else None)
                           for h, d in self._group_map]
        self.state = {}  # type: ignore[assignment] # device param -> its state (see _refresh)

    def _master(self, p: torch.Tensor) -> nn.Parameter:
        master = torch.empty(p.shape, dtype=torch.float32, pin_memory=self._pin)
        master.copy_(p.detach())
        out = nn.Parameter(master, requires_grad=False)
        out.grad = torch.empty(p.shape, dtype=torch.float32, pin_memory=self._pin)
        self._host[id(p)] = (p, out)
        return out

    # ---------------------------------------------------------------- byte counts
    @property
    def offloaded_elements(self) -> int:
        return sum(m.numel() for _, m in self._host.values())

    def transfer_bytes(self) -> dict[str, int]:
        """Bytes one step moves: gradients down, parameters up (in their device dtypes)."""
        down = sum(p.numel() * (p.grad.element_size() if p.grad is not None else p.element_size())
                   for p, _ in self._host.values())
        up = sum(p.numel() * p.element_size() for p, _ in self._host.values())
        return {"device_to_host": down, "host_to_device": up}

    def host_tensors(self) -> list[torch.Tensor]:
        """Every tensor the offloaded share keeps in host memory (masters, gradient buffers,
        AdamW state): what a CPU memory meter must not count as device memory."""
        out: list[torch.Tensor] = []
        for _, master in self._host.values():
            out += [master] + ([master.grad] if master.grad is not None else [])
            state = self.host_optimizer.state.get(master, {}) if self.host_optimizer else {}
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return out

    def host_bytes(self) -> int:
        """Host memory the offloaded share holds: masters, gradient buffers and AdamW moments."""
        total = 0
        for _, master in self._host.values():
            total += master.numel() * master.element_size() * 2  # master + gradient buffer
            state = self.host_optimizer.state.get(master, {}) if self.host_optimizer else {}
            total += sum(v.numel() * v.element_size() for v in state.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
        return total

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("HostOffloadAdamW.step: closures are not supported")
        for group, (h, d) in zip(self.param_groups, self._group_map):
            for inner in (h, d):
                if inner is not None:
                    inner.update({k: v for k, v in group.items() if k != "params"})
        if self.host_optimizer is not None:
            for p, master in self._host.values():
                if p.grad is None:
                    master.grad = None
                    continue
                if master.grad is None:
                    master.grad = torch.empty(p.shape, dtype=torch.float32, pin_memory=self._pin)
                master.grad.copy_(p.grad, non_blocking=self._pin)
            if self._pin:
                torch.cuda.current_stream().synchronize()
        if self.device_optimizer is not None:  # queued on the device while the host steps
            self.device_optimizer.step()
        if self.host_optimizer is not None:
            self.host_optimizer.step()
            for p, master in self._host.values():
                if master.grad is not None:
                    p.copy_(master, non_blocking=self._pin)
        self._refresh()

    def _refresh(self) -> None:
        """Point ``state[p]`` at each parameter's AdamW state (the same dicts, so loading a
        checkpoint into them in place loads the inner optimizers)."""
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in self._host:
                    inner = self.host_optimizer.state if self.host_optimizer else {}
                    key: Any = self._host[id(p)][1]
                else:
                    inner = self.device_optimizer.state if self.device_optimizer else {}
                    key = p
                if key in inner:
                    self.state[p] = inner[key]

    @torch.no_grad()
    def sync_masters_from_params(self) -> None:
        """Copy the device parameters into the host masters (after a checkpoint load wrote the
        parameters)."""
        for p, master in self._host.values():
            master.copy_(p.detach())
