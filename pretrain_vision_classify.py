"""Train an image classifier (ViT or Swin backbone) with a per-layer parallel plan.

    torchrun --standalone --nproc-per-node 2 pretrain_vision_classify.py     # embedded patterns
    torchrun --nproc-per-node 4 pretrain_vision_classify.py --vision-backbone-type swin \\
        --swin-backbone-type tiny --img-h 224 --img-w 224 --num-classes 1000 --mock-data
    torchrun --nproc-per-node 8 pretrain_vision_classify.py --data-path train_dir val_dir \\
        --auto-parallel

Data: ``--mock-data`` (random images), ``--data-path TRAIN [VALID]`` (image folders, one
sub-folder per class), or nothing (the embedded pattern set). Same plan, checkpoint and logging
flags as ``pretrain_gpt.py``; the log shows ``lm loss`` (cross entropy) and ``accuracy``.
Only the vision providers and the vision flags' conversion live here; the run is
``megatron_auto.training.pretrain``.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch
from torch import nn

from megatron_auto.arguments import build_parser
from megatron_auto.run_config import DataConfig
from megatron_auto.training.data import DataSource, collate
from megatron_auto.training.pretrain import launch
from megatron_auto.training.trainer import TaskSpec
from megatron_auto.families.vision.flags import add_vision_args, vision_config_from_args
from megatron_auto.families.vision.config import VisionConfig

# The embedded pattern set: distinct images per epoch-free index, cycled beyond this many.
EMBEDDED_TRAIN_IMAGES = 50_000


def model_provider(config: VisionConfig, ctx: Any, seed: int) -> nn.Module:
    """This rank's pipeline stage of the classifier (ViT or Swin: the config's family's)."""
    from megatron_auto.families.registry import family_of

    return family_of(config).build_stage(config, ctx, seed)


def datasets_provider(data_config: DataConfig, source: DataSource, model_config: VisionConfig,
                      seed: int, train_samples: int, valid_samples: int,
                      test_samples: int) -> tuple[Any, Any, Any]:
    """(train, valid, None): image folders, random images or the embedded patterns."""
    from megatron_auto.data import vision

    cfg = model_config
    shape = (cfg.num_channels, cfg.img_h, cfg.img_w, cfg.num_classes)
    if source.kind == "files":
        paths = source.data_prefix or []
        train = vision.ImageFolderDataset(paths[0], cfg.num_channels, cfg.img_h, cfg.img_w,
                                          cfg.num_classes)
        valid = (vision.ImageFolderDataset(paths[1], cfg.num_channels, cfg.img_h, cfg.img_w,
                                           cfg.num_classes, flag="--data-path (validation)")
                 if len(paths) > 1 else None)
        return train, valid, None
    kind = vision.MockImageDataset if source.kind == "mock" else vision.PatternImageDataset
    train = kind(*shape, max(train_samples, 1) if source.kind == "mock"
                 else max(train_samples, EMBEDDED_TRAIN_IMAGES), seed)
    valid = kind(*shape, valid_samples, seed + 1) if valid_samples else None
    return train, valid, None


def batch_fn(items: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Stack items; the images go to the first stage as ``tokens``, every image counts once."""
    batch = collate(items)
    images, labels = batch["images"], batch["labels"]
    return {"tokens": images, "labels": labels, "loss_mask": torch.ones(labels.shape[0])}


def named_losses(sums: dict[str, float]) -> dict[str, float]:
    return {"accuracy": sums["correct"] / max(sums["num_samples"], 1.0)}


VISION_TASK = TaskSpec(text_data=False, model_families=("vit", "swin"), loss_part_keys=("correct", "num_samples"),
                       named_losses=named_losses)


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_vision_args(build_parser("Train a ViT or Swin image classifier with a "
                                          "per-layer parallel plan."))
    return launch(model_provider, datasets_provider, batch_fn, argv=argv, parser=parser,
                  model_config_from_args=vision_config_from_args, task=VISION_TASK)


if __name__ == "__main__":
    sys.exit(main())
