"""Measured profiles of a T5: the encoder layer, the decoder layer, the embedding and the head.

The same measurements as :mod:`.model_profiler` (forward/backward time fitted over micro-batch
sizes, the activations autograd keeps split into TP-split and replicated parts, the recompute
input, backward transients) for the two layer types of
:meth:`~megatron_auto.planner.inputs.model_spec.ModelSpec.from_t5_config`: ``t5_encoder`` on
``(b, s_e, h)`` with the encoder's relative bias, ``t5_decoder`` on ``(b, s_d, h)`` with the
decoder's bias and the encoder output ``(b, s_e, h)`` it cross-attends (an input of the layer,
so it is not counted as kept; the analytic profile's share for it is added). Messages: the TP
all-reduce size and the bytes of a relayout or stage boundary (the carry) are the analytic
profile's, since they follow from shapes alone.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..models.gpt import LanguageModelEmbedding
from ..models.t5 import RelativePositionBias, T5Attention, T5Layer
from ..parallel.device import resolve_device
from ..planner.inputs.model_spec import ModelSpec, TrainingSpec
from ..planner.inputs.profiles import (EmbeddingProfile, LayerTypeProfile, ModelProfile,
                                       analytic_profile)
from ..families.t5.config import T5Config
from .activation_meter import transformer_classifier, vocab_classifier
from .model_profiler import (cached_or_measured, config_cache_key, ModelProfilerConfig,
                             ProfileLookup, _autocast, _check_precision, _init_, _measure, _ratio,
                             device_name, fit_line, tp1_groups)

logger = logging.getLogger(__name__)


def _t5_classifier(t: torch.Tensor, module: nn.Module | None) -> bool:
    """TP-split: what the transformer classifier says, and whatever T5's attention saves."""
    return transformer_classifier(t, module) or isinstance(module, T5Attention)


def profile_t5_model(cfg: T5Config, precision: str = "fp32",
                     device: str | torch.device | None = None, *,
                     config: ModelProfilerConfig = ModelProfilerConfig(),
                     seed: int = 1234) -> ModelProfile:
    """Measure both layer types, the embedding and the head of ``cfg`` (one process)."""
    dev = resolve_device(device)
    _check_precision(precision, dev)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        return _profile(cfg, precision, dev, config)


def _profile(cfg: T5Config, precision: str, dev: torch.device,
             config: ModelProfilerConfig) -> ModelProfile:
    spec = ModelSpec.from_t5_config(cfg)
    # shapes-only terms (TP messages, the carry, the encoder output a decoder layer keeps)
    analytic = analytic_profile(spec, TrainingSpec(global_batch_size=1, precision=precision),
                                _UnitRate())
    sizes = config.sizes(dev)
    groups = tp1_groups(dev)
    amp = lambda: _autocast(precision, dev)  # noqa: E731 - a fresh context per use
    beta = 4 if precision == "fp32" else 2
    h, se, sd = cfg.hidden_size, cfg.seq_length, cfg.decoder_seq_length
    relative = cfg.position_embedding_type == "relative"
    started = time.perf_counter()
    layers: dict[str, LayerTypeProfile] = {}
    raw: dict[str, Any] = {}
    for lt in spec.layer_types:
        decoder = lt.name == "t5_decoder"
        layer = _init_(T5Layer(cfg, groups, rng=None, decoder=decoder), cfg.init_method_std)
        layer = layer.to(dev).train()
        table = (_init_(RelativePositionBias(cfg, bidirectional=not decoder),
                        cfg.init_method_std).to(dev) if relative else None)
        s = sd if decoder else se

        def run(b: int, layer: nn.Module = layer, s: int = s, decoder: bool = decoder,
                table: nn.Module | None = table) -> tuple[Callable[[], torch.Tensor], list]:
            x = torch.randn(b, s, h, device=dev, requires_grad=True)
            memory = (torch.randn(b, se, h, device=dev, requires_grad=True) if decoder
                      else None)

            def forward() -> torch.Tensor:
                with amp():
                    bias = None if table is None else table(s, s)
                    return layer(x, memory, bias, None)
            return forward, [x] + ([memory] if memory is not None else [])

        def set_recompute(flag: bool, layer: nn.Module = layer) -> None:
            layer.recompute = flag

        series = _measure(layer, run, sizes, config, dev, _t5_classifier, True, set_recompute)
        num_params = sum(p.numel() for p in layer.parameters())
        split_a, split_b = fit_line(sizes, series.split)
        rep_a, rep_b = fit_line(sizes, series.replicated)
        shapes = analytic.layer_types[lt.name]
        # the encoder output (an input here) is kept once per decoder stage; the analytic
        # profile's carried share of the replicated bytes (see planner/inputs/profiles.py)
        carried = beta * (se if decoder else sd) * h
        grad_io = 4 * (2 * s * h + (se * h if decoder else 0))  # fp32 input/output gradients
        scratch_a, scratch_b = fit_line(sizes, series.transient)
        fwd_a, fwd_b = fit_line(sizes, series.forward_s)
        layers[lt.name] = LayerTypeProfile(
            name=lt.name, parameter_count=num_params, forward_time_per_sample_s=fwd_a,
            forward_time_constant_s=fwd_b, backward_forward_ratio=_ratio(series),
            activation_replicated_bytes=rep_a + carried, activation_split_bytes=split_a,
            recompute_bytes_per_sample=fit_line(sizes, series.recompute)[0],
            hidden_bytes_per_sample=shapes.hidden_bytes_per_sample,
            boundary_bytes_per_sample=shapes.boundary_bytes_per_sample,
            tp_message_bytes_per_sample=shapes.tp_message_bytes_per_sample,
            backward_scratch_replicated_bytes=float(min(scratch_a, grad_io)),
            backward_scratch_split_bytes=float(max(0.0, scratch_a - grad_io)),
            backward_scratch_constant_bytes=float(max(0.0, scratch_b)),
            weight_copy_bytes_per_parameter=(0.0 if precision == "fp32"
                                             else (split_b + rep_b) / max(num_params, 1)),
            forward_time_by_tp={1: (fwd_a, fwd_b)}, flops_per_sample=shapes.flops_per_sample)
        raw[lt.name] = dataclasses.asdict(series)
        del layer

    vocab = cfg.padded_vocab_size
    emb = _init_(LanguageModelEmbedding(cfg, groups, None, with_positions=True),
                 cfg.init_method_std).to(dev).train()

    def embed_run(b: int) -> tuple[Callable[[], torch.Tensor], list]:
        enc = torch.randint(0, cfg.vocab_size, (b, se), device=dev)
        dec = torch.randint(0, cfg.vocab_size, (b, sd), device=dev)

        def forward() -> torch.Tensor:
            with amp():
                return torch.cat([emb.embed(enc), emb.embed(dec)], dim=1)
        return forward, [enc, dec]

    emb_series = _measure(emb, embed_run, sizes, config, dev, lambda t, m: False, True)
    norm = nn.LayerNorm(h, eps=cfg.layernorm_epsilon) if cfg.normalization == "layernorm" \
        else nn.RMSNorm(h, eps=cfg.layernorm_epsilon)
    head = nn.ModuleDict({"final_norm": norm, "emb": emb}).to(dev).train()
    lm_bias = torch.zeros(vocab, device=dev, requires_grad=True)

    def head_run(b: int) -> tuple[Callable[[], torch.Tensor], list]:
        hidden = torch.randn(b, sd, h, device=dev, requires_grad=True)
        labels = torch.randint(0, cfg.vocab_size, (b, sd), device=dev)

        def forward() -> torch.Tensor:
            with amp():
                logits = emb.logits(head["final_norm"](hidden)) + lm_bias
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                   reduction="sum")
        return forward, [hidden, labels]

    head_series = _measure(head, head_run, sizes, config, dev, vocab_classifier(vocab), False)
    e_fwd_a, e_fwd_b = fit_line(sizes, emb_series.forward_s)
    h_fwd_a, h_fwd_b = fit_line(sizes, head_series.forward_s)
    spec_emb = analytic.embedding
    embedding = EmbeddingProfile(
        embedding_parameters=spec.embedding_parameters, head_parameters=spec.head_parameters,
        tied=True, vocab_size=vocab, hidden_bytes_per_sample=float(beta * se * h),
        embedding_forward_time_per_sample_s=e_fwd_a, head_forward_time_per_sample_s=h_fwd_a,
        embedding_activation_bytes=fit_line(sizes, [a + r for a, r in zip(
            emb_series.split, emb_series.replicated)])[0],
        head_activation_replicated_bytes=fit_line(sizes, head_series.replicated)[0],
        head_activation_split_bytes=fit_line(sizes, head_series.split)[0],
        head_transient_split_bytes=max(fit_line(sizes, head_series.transient)[0],
                                       spec_emb.head_transient_split_bytes),
        forward_time_constant_s=(e_fwd_b + h_fwd_b) / 2,
        backward_forward_ratio=_ratio(emb_series, head_series))
    elapsed = time.perf_counter() - started
    metadata = {"model": "t5", "device": device_name(dev), "torch": torch.__version__,
                "batch_sizes": list(sizes), "profile_seconds": elapsed,
                "tp_derivation": "measured at tp=1; tp>1 = replicated + split/tp (analytic)",
                "raw": {"layers": raw, "embedding": dataclasses.asdict(emb_series),
                        "head": dataclasses.asdict(head_series)}}
    logger.info("profiled t5 (encoder and decoder layers) on %s in %.1f s", metadata["device"],
                elapsed)
    return ModelProfile(layer_types=layers, embedding=embedding, precision=precision,
                        source="measured", metadata=metadata)


class _UnitRate:
    """A stand-in cluster for :func:`analytic_profile` when only its shape terms are read."""

    name = "shapes"

    def flops(self, precision: str) -> float:
        return 1.0


def t5_profile_cache_key(cfg: T5Config, precision: str, device: str | torch.device | None,
                         config: ModelProfilerConfig = ModelProfilerConfig()) -> dict[str, Any]:
    """Everything that changes the measured numbers (see cache.py)."""
    return config_cache_key(cfg, precision, device, config)


def lookup_or_measure_t5(cfg: T5Config, precision: str = "fp32",
                         device: str | torch.device | None = None,
                         cache_dir: str | None = None, *,
                         config: ModelProfilerConfig = ModelProfilerConfig(),
                         force: bool = False) -> ProfileLookup:
    """The cached profile of ``cfg`` on this device, or a fresh measurement stored there."""
    key = t5_profile_cache_key(cfg, precision, device, config)
    return cached_or_measured(key, lambda: profile_t5_model(cfg, precision, device, config=config),
                              cache_dir, force)
