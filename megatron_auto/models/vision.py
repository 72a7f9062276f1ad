"""The image classifiers' stage provider: a ViT or a Swin stage, as ``config.model_type`` says.

Its own module so that ``vit.py`` (the shared :class:`~.vit.VisionStage` and ViT) and
``swin.py`` (built on it) need not import each other both ways.
"""

from __future__ import annotations

from ..parallel.context import ParallelContext
from ..families.vision.config import VisionConfig
from .swin import SwinStage
from .vit import ViTStage, VisionStage


def build_vision_stage(config: VisionConfig, ctx: ParallelContext, seed: int = 1234) -> VisionStage:
    """This rank's stage of the backbone ``config.model_type`` names (ViT or Swin)."""
    if config.model_type == "swin":
        return SwinStage(config, ctx, seed=seed)
    return ViTStage(config, ctx, seed=seed)
