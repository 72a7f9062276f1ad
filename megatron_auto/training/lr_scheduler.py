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
from dataclasses import dataclass

import torch

DECAY_STYLES = ("constant", "linear", "cosine", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclass(frozen=True)
class LRConfig:
    lr: float = 1e-3
    min_lr: float = 0.0
    decay_style: str = "cosine"
    warmup_iters: int = 0
    decay_iters: int = 100
    wsd_decay_iters: int | None = None  # default: 10% of the decay horizon
    wsd_decay_style: str = "linear"

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style={self.decay_style}: choose one of "
                             f"{', '.join(DECAY_STYLES)}")
        if self.wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"--lr-wsd-decay-style={self.wsd_decay_style}: choose one of "
                             f"{', '.join(WSD_DECAY_STYLES)}")
        if self.decay_style != "constant" and self.decay_iters < 1:
            raise ValueError(f"--lr-decay-iters={self.decay_iters}: must be a positive integer")
        if self.decay_style == "WSD" and self.wsd_decay_iters is not None and not (
                0 < self.wsd_decay_iters <= self.decay_iters - self.warmup_iters):
            raise ValueError(
                f"--lr-wsd-decay-iters={self.wsd_decay_iters}: must be in 1.."
                f"{self.decay_iters - self.warmup_iters} (--lr-decay-iters minus warm-up)")


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
