"""Measured profiles of the image classifiers: every layer type, the patch embedding, the head.

The profiling core's measurements (:mod:`.measure`: forward/backward time fitted over
micro-batch sizes, activations autograd keeps split into TP-split and replicated parts, the
recompute input, backward transients), taken for each layer type of the vision family's spec
(:func:`megatron_auto.families.vision.family.model_spec`): ViT has one, Swin one per
stage plus one per patch-merging block (a block of type ``swin<k>_merge`` is measured with its
merging, on the previous stage's token grid). A Swin type is timed on one of its shifted-window
blocks when the stage shifts (the mask add is its only extra work).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..families.vision.config import VisionConfig
from ..families.vision.family import model_spec
from ..models.swin import SwinBlock, WindowAttention
from ..models.transformer import TransformerLayer
from ..models.vit import ClassificationHead, PatchEmbedding, layer_model_config
from ..planner.inputs.profile_records import LayerTypeProfile
from ..planner.inputs.profiles import ModelProfile
from .activation_meter import transformer_classifier
from .lookup import FamilyProfiler, config_cache_key
from .measure import (Barrier, ModelProfilerConfig, activation_bytes, autocast,
                      embedding_profile, init_parameters, layer_type_profile, measure,
                      measured_profile, never_split, parameter_count, run_seeded, tp1_groups)

logger = logging.getLogger(__name__)


def _vision_classifier(t: torch.Tensor, module: nn.Module | None) -> bool:
    """TP-split: what the transformer classifier says, and whatever window attention saves."""
    return transformer_classifier(t, module) or isinstance(module, WindowAttention)


def _layer_for(cfg: VisionConfig, name: str, groups: Any) -> tuple[nn.Module, int]:
    """A fresh layer of type ``name`` and the index of a layer of that type."""
    if not cfg.swin_stages():  # ViT: one layer type
        lc = layer_model_config(cfg, cfg.hidden_size, cfg.num_attention_heads,
                                cfg.ffn_hidden_size, cfg.seq_length)
        return TransformerLayer(lc, groups, causal=False), 0
    stage = next(st for st in cfg.swin_stages() if name.startswith(f"swin{st.index + 1}"))
    merge = name.endswith("_merge")
    # the merging block is the stage's first; otherwise a shifted block when there is one
    index_in_stage = 0 if merge else (1 if stage.depth > 1 else 0)
    layer = stage.first_layer + index_in_stage
    return SwinBlock(cfg, stage, index_in_stage, groups, merge=merge), layer


def profile_vision_model(cfg: VisionConfig, precision: str = "fp32",
                         device: str | torch.device | None = None, *,
                         config: ModelProfilerConfig = ModelProfilerConfig(),
                         seed: int = 1234, barrier: Barrier = None) -> ModelProfile:
    """Measure every layer type, the patch embedding and the head of ``cfg`` (one process)."""
    return run_seeded(lambda dev: _profile(cfg, precision, dev, config, barrier), precision,
                      device, seed)


def _profile(cfg: VisionConfig, precision: str, dev: torch.device,
             config: ModelProfilerConfig, barrier: Barrier) -> ModelProfile:
    spec = model_spec(cfg)
    sizes = config.sizes(dev)
    groups = tp1_groups(dev)
    amp = lambda: autocast(precision, dev)  # noqa: E731 - a fresh context per use
    beta = activation_bytes(precision)
    started = time.perf_counter()
    layers: dict[str, LayerTypeProfile] = {}
    raw: dict[str, Any] = {}
    for lt in spec.layer_types:
        layer, index = _layer_for(cfg, lt.name, groups)
        layer = init_parameters(layer, cfg.init_method_std).to(dev).train()
        tokens, width = cfg.layer_input_shape(index)

        def run(b: int, layer: nn.Module = layer, tokens: int = tokens,
                width: int = width) -> tuple[Callable[[], torch.Tensor], list]:
            x = torch.randn(b, tokens, width, device=dev, requires_grad=True)

            def forward() -> torch.Tensor:
                with amp():
                    return layer(x)
            return forward, [x]

        def set_recompute(flag: bool, layer: nn.Module = layer) -> None:
            layer.recompute = flag

        series = measure(layer, run, sizes, config, dev, _vision_classifier, True, set_recompute,
                         barrier=barrier)
        s, h = lt.seq_length, lt.hidden_size
        layers[lt.name] = layer_type_profile(
            lt.name, layer, series, sizes, precision,
            grad_io_bytes=4 * (s * h + tokens * width),  # fp32 gradients of input and output
            hidden_bytes_per_sample=float(beta * s * h))
        raw[lt.name] = dataclasses.asdict(series)
        del layer

    emb = init_parameters(PatchEmbedding(cfg, None), cfg.init_method_std).to(dev).train()

    def embed_run(b: int) -> tuple[Callable[[], torch.Tensor], list]:
        images = torch.randn(b, cfg.num_channels, cfg.img_h, cfg.img_w, device=dev)

        def forward() -> torch.Tensor:
            with amp():
                return emb(images)
        return forward, [images]

    emb_series = measure(emb, embed_run, sizes, config, dev, never_split, True, barrier=barrier)
    head = init_parameters(ClassificationHead(cfg), cfg.init_method_std).to(dev).train()
    last_tokens, last_width = cfg.layer_output_shape(cfg.num_layers - 1)

    def head_run(b: int) -> tuple[Callable[[], torch.Tensor], list]:
        hidden = torch.randn(b, last_tokens, last_width, device=dev, requires_grad=True)
        labels = torch.randint(0, cfg.num_classes, (b,), device=dev)

        def forward() -> torch.Tensor:
            with amp():
                logits = head(hidden)
            return F.cross_entropy(logits.float(), labels, reduction="sum")
        return forward, [hidden, labels]

    head_series = measure(head, head_run, sizes, config, dev, never_split, False,
                          barrier=barrier)
    embedding = embedding_profile(
        emb_series, head_series, sizes,
        head_replicated=True,  # the head is replicated over the vocab TP group
        embedding_parameters=parameter_count(emb), head_parameters=parameter_count(head),
        tied=False, vocab_size=cfg.num_classes,
        hidden_bytes_per_sample=float(beta * cfg.seq_length * cfg.embedding_hidden_size))
    profile = measured_profile(
        layers, embedding, precision, dev, model=cfg.model_type, sizes=sizes, started=started,
        tp_derivation="measured at tp=1; tp>1 = replicated + split/tp (analytic)",
        raw={"layers": raw, "embedding": dataclasses.asdict(emb_series),
             "head": dataclasses.asdict(head_series)})
    logger.info("profiled %s (%d layer types) on %s in %.1f s", cfg.model_type, len(layers),
                profile.metadata["device"], profile.metadata["profile_seconds"])
    return profile


#: What the vit and swin families register (``families/vision/family.py``).
VISION_PROFILER = FamilyProfiler(measure=profile_vision_model, cache_key=config_cache_key)
