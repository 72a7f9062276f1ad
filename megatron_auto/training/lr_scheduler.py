"""Learning-rate schedules: linear warm-up, then constant, linear, cosine or WSD decay.

``lr_at(config, iteration)`` is a pure function of the 1-based iteration number (the iteration
whose optimizer step uses that rate), so it is checked against hand values and resumes exactly
from an iteration count:

- warm-up (``iteration <= warmup_iters``): ``lr * iteration / warmup_iters``; unlike Megatron-LM
  (whose first step uses rate 0) the first iteration already updates the weights;
- then, with ``r = (iteration - warmup_iters) / (decay_iters - warmup_iters)`` clipped to
  [0, 1], ``min_lr + (lr - min_lr) * c(r)``: constant ``c = 1`` (and ``min_lr`` is unused),
  linear ``c = 1 - r``, cosine ``c = (1 + cos(pi r)) / 2``;
- ``WSD`` (warm-up, stable, decay): ``lr`` until the last ``wsd_decay_iters`` iterations of the
  decay horizon, then a decay to ``min_lr`` of style ``wsd_decay_style`` (linear ``1 - r``,
  cosine, exponential ``2 * 0.5**r - 1``, minus_sqrt ``1 - sqrt(r)``) over that final phase;
- after ``decay_iters``: ``min_lr``.
"""

from __future__ import annotations

import math

import torch

from ..run_config import DECAY_STYLES, WSD_DECAY_STYLES, LRConfig

__all__ = ["DECAY_STYLES", "WSD_DECAY_STYLES", "LRConfig", "lr_at", "set_lr"]


def _decay_coefficient(style: str, ratio: float) -> float:
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * ratio))
    if style == "exponential":
        return 2.0 * 0.5 ** ratio - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"decay style {style!r}: choose one of {', '.join(WSD_DECAY_STYLES)}")


def lr_at(config: LRConfig, iteration: int) -> float:
    """Learning rate for 1-based ``iteration`` (see the module docstring for the formulas)."""
    if config.warmup_iters > 0 and iteration <= config.warmup_iters:
        return config.lr * iteration / config.warmup_iters
    if config.decay_style == "constant":
        return config.lr
    if iteration >= config.decay_iters:
        return config.min_lr
    span = config.decay_iters - config.warmup_iters
    if config.decay_style == "WSD":
        decay_len = config.wsd_decay_iters or max(1, span // 10)
        start = config.decay_iters - decay_len
        if iteration <= start:
            return config.lr
        coeff = _decay_coefficient(config.wsd_decay_style, (iteration - start) / decay_len)
    else:
        ratio = min(max((iteration - config.warmup_iters) / span, 0.0), 1.0)
        coeff = _decay_coefficient(config.decay_style, ratio)
    return config.min_lr + (config.lr - config.min_lr) * coeff


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Give every parameter group the rate ``lr`` (tensor-valued rates are updated in place)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
