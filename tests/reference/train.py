"""Train a reference model the way a user of plain PyTorch would.

One process, the whole global batch in one forward (the loss is a mean over the batch, so no
gradient accumulation is needed), ``torch.nn.utils.clip_grad_norm_`` on the global norm, then
``torch.optim.AdamW``. Weight decay applies to matrices only (biases and norm weights are exempt,
as in Megatron-LM and GPT-2/LLaMA training recipes). The learning rate is constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class RefOptim:
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0


def adamw(model: nn.Module, optim: RefOptim) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": optim.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=optim.lr, betas=optim.betas, eps=optim.eps)  # torch's defaults


LossFn = Callable[[nn.Module, Mapping[str, torch.Tensor]], torch.Tensor]


def step_fn(model: nn.Module, loss_fn: LossFn, optim: RefOptim
            ) -> Callable[[Mapping[str, torch.Tensor]], tuple[float, float]]:
    """One training step per call on a batch: (loss, gradient norm before clipping)."""
    optimizer = adamw(model, optim)

    def step(batch: Mapping[str, torch.Tensor]) -> tuple[float, float]:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_grad)
        optimizer.step()
        return loss.item(), norm.item()

    return step


def train(model: nn.Module, loss_fn: LossFn, batches: Sequence[Mapping[str, torch.Tensor]],
          optim: RefOptim) -> list[tuple[float, float]]:
    """(loss, gradient norm before clipping) of each step, one step per batch."""
    step = step_fn(model, loss_fn, optim)
    return [step(batch) for batch in batches]
