"""Measured profiles of a T5: the encoder layer, the decoder layer, the embedding and the head.

The profiling core's measurements (:mod:`.measure`: forward/backward time fitted over
micro-batch sizes, the activations autograd keeps split into TP-split and replicated parts, the
recompute input, backward transients) for the two layer types of the T5 family's spec
(:func:`megatron_auto.families.t5.family.model_spec`): ``t5_encoder`` on
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

from ..families.t5.config import T5Config
from ..families.t5.family import model_spec
from ..models.gpt import LanguageModelEmbedding
from ..models.t5 import RelativePositionBias, T5Attention, T5Layer
from ..planner.inputs.model_spec import TrainingSpec
from ..planner.inputs.profile_records import LayerTypeProfile
from ..planner.inputs.profiles import ModelProfile, analytic_profile
from .activation_meter import transformer_classifier, vocab_classifier
from .lookup import FamilyProfiler, config_cache_key
from .measure import (Barrier, ModelProfilerConfig, activation_bytes, autocast,
                      embedding_profile, init_parameters, layer_type_profile, measure,
                      measured_profile, never_split, run_seeded, tp1_groups)

logger = logging.getLogger(__name__)


def _t5_classifier(t: torch.Tensor, module: nn.Module | None) -> bool:
    """TP-split: what the transformer classifier says, and whatever T5's attention saves."""
    return transformer_classifier(t, module) or isinstance(module, T5Attention)


def profile_t5_model(cfg: T5Config, precision: str = "fp32",
                     device: str | torch.device | None = None, *,
                     config: ModelProfilerConfig = ModelProfilerConfig(),
                     seed: int = 1234, barrier: Barrier = None) -> ModelProfile:
    """Measure both layer types, the embedding and the head of ``cfg`` (one process)."""
    return run_seeded(lambda dev: _profile(cfg, precision, dev, config, barrier), precision,
                      device, seed)


def _profile(cfg: T5Config, precision: str, dev: torch.device,
             config: ModelProfilerConfig, barrier: Barrier) -> ModelProfile:
    spec = model_spec(cfg)
    # shapes-only terms (TP messages, the carry, the encoder output a decoder layer keeps)
    analytic = analytic_profile(spec, TrainingSpec(global_batch_size=1, precision=precision),
                                _UnitRate())
    sizes = config.sizes(dev)
    groups = tp1_groups(dev)
    amp = lambda: autocast(precision, dev)  # noqa: E731 - a fresh context per use
    beta = activation_bytes(precision)
    h, se, sd = cfg.hidden_size, cfg.seq_length, cfg.decoder_seq_length
    relative = cfg.position_embedding_type == "relative"
    started = time.perf_counter()
    layers: dict[str, LayerTypeProfile] = {}
    raw: dict[str, Any] = {}
    for lt in spec.layer_types:
        decoder = lt.name == "t5_decoder"
        layer = init_parameters(T5Layer(cfg, groups, rng=None, decoder=decoder),
                                cfg.init_method_std)
        layer = layer.to(dev).train()
        table = (init_parameters(RelativePositionBias(cfg, bidirectional=not decoder),
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

        series = measure(layer, run, sizes, config, dev, _t5_classifier, True, set_recompute,
                         barrier=barrier)
        shapes = analytic.layer_types[lt.name]
        layers[lt.name] = layer_type_profile(
            lt.name, layer, series, sizes, precision,
            grad_io_bytes=4 * (2 * s * h + (se * h if decoder else 0)),  # fp32 in/out grads
            # the encoder output (an input here) is kept once per decoder stage; the analytic
            # profile's carried share of the replicated bytes (see planner/inputs/profiles.py)
            extra_replicated_bytes=beta * (se if decoder else sd) * h,
            hidden_bytes_per_sample=shapes.hidden_bytes_per_sample,
            boundary_bytes_per_sample=shapes.boundary_bytes_per_sample,
            tp_message_bytes_per_sample=shapes.tp_message_bytes_per_sample,
            flops_per_sample=shapes.flops_per_sample)
        raw[lt.name] = dataclasses.asdict(series)
        del layer

    vocab = cfg.padded_vocab_size
    emb = init_parameters(LanguageModelEmbedding(cfg, groups, None, with_positions=True),
                          cfg.init_method_std).to(dev).train()

    def embed_run(b: int) -> tuple[Callable[[], torch.Tensor], list]:
        enc = torch.randint(0, cfg.vocab_size, (b, se), device=dev)
        dec = torch.randint(0, cfg.vocab_size, (b, sd), device=dev)

        def forward() -> torch.Tensor:
            with amp():
                return torch.cat([emb.embed(enc), emb.embed(dec)], dim=1)
        return forward, [enc, dec]

    emb_series = measure(emb, embed_run, sizes, config, dev, never_split, True, barrier=barrier)
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

    head_series = measure(head, head_run, sizes, config, dev, vocab_classifier(vocab), False,
                          barrier=barrier)
    embedding = embedding_profile(
        emb_series, head_series, sizes,
        head_transient_floor=analytic.embedding.head_transient_split_bytes,
        embedding_parameters=spec.embedding_parameters, head_parameters=spec.head_parameters,
        tied=True, vocab_size=vocab, hidden_bytes_per_sample=float(beta * se * h),
        replicated_parameters=spec.num_position_embeddings * spec.embedding_hidden_size)
    profile = measured_profile(
        layers, embedding, precision, dev, model="t5", sizes=sizes, started=started,
        tp_derivation="measured at tp=1; tp>1 = replicated + split/tp (analytic)",
        raw={"layers": raw, "embedding": dataclasses.asdict(emb_series),
             "head": dataclasses.asdict(head_series)})
    logger.info("profiled t5 (encoder and decoder layers) on %s in %.1f s",
                profile.metadata["device"], profile.metadata["profile_seconds"])
    return profile


class _UnitRate:
    """A stand-in cluster for :func:`analytic_profile` when only its shape terms are read."""

    name = "shapes"

    def flops(self, precision: str) -> float:
        return 1.0


#: What the T5 family registers (``families/t5/family.py``); the whole config is the key.
T5_PROFILER = FamilyProfiler(measure=profile_t5_model, cache_key=config_cache_key)
