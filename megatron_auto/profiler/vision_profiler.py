"""Measured profiles of the image classifiers: every layer type, the patch embedding, the head.

The same measurements as :mod:`.model_profiler` (forward/backward time fitted over micro-batch
sizes, activations autograd keeps split into TP-split and replicated parts, the recompute
input, backward transients), taken for each layer type of
:meth:`~megatron_auto.planner.inputs.model_spec.ModelSpec.from_vision_config`: ViT has one, Swin one per
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

from ..models.swin import SwinBlock, WindowAttention
from ..models.transformer import TransformerLayer
from ..models.vit import ClassificationHead, PatchEmbedding, layer_model_config
from ..parallel.device import resolve_device
from ..planner.inputs.model_spec import ModelSpec
from ..planner.inputs.profiles import EmbeddingProfile, LayerTypeProfile, ModelProfile
from ..families.vision.config import VisionConfig
from .activation_meter import transformer_classifier
from .model_profiler import (cached_or_measured, config_cache_key, ModelProfilerConfig,
                             ProfileLookup, _check_precision, _autocast, _init_, _measure, _ratio,
                             device_name, fit_line, tp1_groups)

logger = logging.getLogger(__name__)


def _vision_classifier(t: torch.Tensor, module: nn.Module | None) -> bool:
    """TP-split: what the transformer classifier says, and whatever window attention saves."""
    return transformer_classifier(t, module) or isinstance(module, WindowAttention)


def _layer_for(cfg: VisionConfig, name: str, groups: Any) -> tuple[nn.Module, int]:
    """A fresh layer of type ``name`` and the index of a layer of that type."""
    if cfg.model_type == "vit":
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
                         seed: int = 1234) -> ModelProfile:
    """Measure every layer type, the patch embedding and the head of ``cfg`` (one process)."""
    dev = resolve_device(device)
    _check_precision(precision, dev)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        return _profile(cfg, precision, dev, config)


def _profile(cfg: VisionConfig, precision: str, dev: torch.device,
             config: ModelProfilerConfig) -> ModelProfile:
    spec = ModelSpec.from_vision_config(cfg)
    sizes = config.sizes(dev)
    groups = tp1_groups(dev)
    amp = lambda: _autocast(precision, dev)  # noqa: E731 - a fresh context per use
    beta = 4 if precision == "fp32" else 2
    started = time.perf_counter()
    layers: dict[str, LayerTypeProfile] = {}
    raw: dict[str, Any] = {}
    for lt in spec.layer_types:
        layer, index = _layer_for(cfg, lt.name, groups)
        layer = _init_(layer, cfg.init_method_std).to(dev).train()
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

        series = _measure(layer, run, sizes, config, dev, _vision_classifier, True, set_recompute)
        num_params = sum(p.numel() for p in layer.parameters())
        s, h = lt.seq_length, lt.hidden_size
        split_a, split_b = fit_line(sizes, series.split)
        rep_a, rep_b = fit_line(sizes, series.replicated)
        grad_io = 4 * (s * h + tokens * width)  # fp32 gradients of the layer's input and output
        scratch_a, scratch_b = fit_line(sizes, series.transient)
        fwd_a, fwd_b = fit_line(sizes, series.forward_s)
        layers[lt.name] = LayerTypeProfile(
            name=lt.name, parameter_count=num_params, forward_time_per_sample_s=fwd_a,
            forward_time_constant_s=fwd_b, backward_forward_ratio=_ratio(series),
            activation_replicated_bytes=rep_a, activation_split_bytes=split_a,
            recompute_bytes_per_sample=fit_line(sizes, series.recompute)[0],
            hidden_bytes_per_sample=float(beta * s * h),
            backward_scratch_replicated_bytes=float(min(scratch_a, grad_io)),
            backward_scratch_split_bytes=float(max(0.0, scratch_a - grad_io)),
            backward_scratch_constant_bytes=float(max(0.0, scratch_b)),
            weight_copy_bytes_per_parameter=(0.0 if precision == "fp32"
                                             else (split_b + rep_b) / max(num_params, 1)),
            forward_time_by_tp={1: (fwd_a, fwd_b)})
        raw[lt.name] = dataclasses.asdict(series)
        del layer

    emb = _init_(PatchEmbedding(cfg, None), cfg.init_method_std).to(dev).train()

    def embed_run(b: int) -> tuple[Callable[[], torch.Tensor], list]:
        images = torch.randn(b, cfg.num_channels, cfg.img_h, cfg.img_w, device=dev)

        def forward() -> torch.Tensor:
            with amp():
                return emb(images)
        return forward, [images]

    emb_series = _measure(emb, embed_run, sizes, config, dev, lambda t, m: False, True)
    head = _init_(ClassificationHead(cfg), cfg.init_method_std).to(dev).train()
    last_tokens, last_width = cfg.layer_output_shape(cfg.num_layers - 1)

    def head_run(b: int) -> tuple[Callable[[], torch.Tensor], list]:
        hidden = torch.randn(b, last_tokens, last_width, device=dev, requires_grad=True)
        labels = torch.randint(0, cfg.num_classes, (b,), device=dev)

        def forward() -> torch.Tensor:
            with amp():
                logits = head(hidden)
            return F.cross_entropy(logits.float(), labels, reduction="sum")
        return forward, [hidden, labels]

    head_series = _measure(head, head_run, sizes, config, dev, lambda t, m: False, False)
    e_fwd_a, e_fwd_b = fit_line(sizes, emb_series.forward_s)
    h_fwd_a, h_fwd_b = fit_line(sizes, head_series.forward_s)
    embedding = EmbeddingProfile(
        embedding_parameters=sum(p.numel() for p in emb.parameters()),
        head_parameters=sum(p.numel() for p in head.parameters()), tied=False,
        vocab_size=cfg.num_classes,
        hidden_bytes_per_sample=float(beta * cfg.seq_length * cfg.embedding_hidden_size),
        embedding_forward_time_per_sample_s=e_fwd_a, head_forward_time_per_sample_s=h_fwd_a,
        embedding_activation_bytes=fit_line(sizes, [a + r for a, r in zip(
            emb_series.split, emb_series.replicated)])[0],
        head_activation_replicated_bytes=fit_line(sizes, [a + r for a, r in zip(
            head_series.split, head_series.replicated)])[0],
        head_activation_split_bytes=0.0,  # the head is replicated over the vocab TP group
        head_transient_split_bytes=fit_line(sizes, head_series.transient)[0],
        forward_time_constant_s=(e_fwd_b + h_fwd_b) / 2,
        backward_forward_ratio=_ratio(emb_series, head_series))
    elapsed = time.perf_counter() - started
    metadata = {"model": cfg.model_type, "device": device_name(dev), "torch": torch.__version__,
                "batch_sizes": list(sizes), "profile_seconds": elapsed,
                "tp_derivation": "measured at tp=1; tp>1 = replicated + split/tp (analytic)",
                "raw": {"layers": raw, "embedding": dataclasses.asdict(emb_series),
                        "head": dataclasses.asdict(head_series)}}
    logger.info("profiled %s (%d layer types) on %s in %.1f s", cfg.model_type,
                len(layers), metadata["device"], elapsed)
    return ModelProfile(layer_types=layers, embedding=embedding, precision=precision,
                        source="measured", metadata=metadata)


def vision_profile_cache_key(cfg: VisionConfig, precision: str,
                             device: str | torch.device | None,
                             config: ModelProfilerConfig = ModelProfilerConfig()) -> dict[str, Any]:
    """Everything that changes the measured numbers (see cache.py)."""
    return config_cache_key(cfg, precision, device, config)


def lookup_or_measure_vision(cfg: VisionConfig, precision: str = "fp32",
                             device: str | torch.device | None = None,
                             cache_dir: str | None = None, *,
                             config: ModelProfilerConfig = ModelProfilerConfig(),
                             force: bool = False) -> ProfileLookup:
    """The cached profile of ``cfg`` on this device, or a fresh measurement stored there."""
    key = vision_profile_cache_key(cfg, precision, device, config)
    return cached_or_measured(key, lambda: profile_vision_model(cfg, precision, device, config=config),
                              cache_dir, force)
