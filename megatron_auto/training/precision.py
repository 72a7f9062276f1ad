"""Mixed precision: autocast dtype, fp32 master parameters, fp16 loss scaling.

Parameters (and so the optimizer's master copy) always stay fp32; ``--bf16``/``--fp16`` only
change the compute dtype through ``torch.autocast`` in the pipeline schedule. fp16 gradients can
overflow, so the loss is multiplied by a scale before backward and the gradients divided by it
afterwards:

- dynamic scaling (default): an iteration whose gradient norm is inf/nan on *any* rank is
  skipped (no optimizer step, counted as a skipped iteration); after ``hysteresis`` such
  iterations the scale is halved (never below ``min_loss_scale``); after ``loss_scale_window``
  clean iterations in a row it is doubled;
- static scaling (``--loss-scale X``): the scale never changes, overflowing steps are still
  skipped.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..run_config import PrecisionConfig

__all__ = ["LossScaler", "PrecisionConfig", "autocast_dtype", "unscale_"]


def autocast_dtype(config: PrecisionConfig) -> torch.dtype | None:
    """The ``torch.autocast`` dtype of ``config`` (``None``: fp32, no autocast)."""
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None


class LossScaler:
    """Loss scale for fp16 (dynamic or static); a constant 1 for fp32/bf16."""

    def __init__(self, config: PrecisionConfig) -> None:
        self.dynamic = config.fp16 and config.loss_scale is None
        if not config.fp16:
            self.scale = 1.0
        else:
            self.scale = float(config.loss_scale or config.initial_loss_scale)
        self.min_scale = config.min_loss_scale
        self.window = config.loss_scale_window
        self.hysteresis = config.hysteresis
        self._hysteresis_left = config.hysteresis
        self._clean_steps = 0

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after an iteration whose gradients did (not) overflow."""
        if not self.dynamic:
            return
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
        else:
            self._clean_steps += 1
            if self._clean_steps % self.window == 0:
                self.scale *= 2.0
                self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps,
                "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict` (a checkpoint); a static or unit scale stays as set."""
        if not self.dynamic:
            return
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])


def unscale_(params: Iterable[torch.nn.Parameter], scale: float) -> None:
    """Divide every gradient by ``scale`` in place (no-op for scale 1)."""
    if scale == 1.0:
        return
    inv = 1.0 / scale
    for p in params:
        if p.grad is not None:
            p.grad.mul_(inv)
