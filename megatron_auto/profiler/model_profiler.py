"""The GPT and BERT families' profiler: one transformer layer, the embedding and the LM head.

It runs the runtime's own modules (``models.transformer.TransformerLayer``,
``models.gpt.LanguageModelEmbedding``, the final norm, the tied or untied head and
``vocab_parallel_cross_entropy``) at tensor-parallel degree 1 on one process, in the training
precision (fp32, or bf16/fp16 under ``torch.autocast`` with fp32 master weights), and writes the
planner's :class:`~megatron_auto.planner.inputs.profiles.ModelProfile` (``source: "measured"``).

It measures with the profiling core (:mod:`.measure`). Per micro-batch size ``b`` in
``batch_sizes`` (forward and backward timed separately in each of ``iters`` rounds, medians) it
fits straight lines ``y = alpha * b + beta`` (docs/profiling.md §2):

- forward time -> ``forward_time_per_sample_s`` (alpha) and ``forward_time_constant_s``
  (beta); backward time -> ``backward_forward_ratio`` (ratio of the slopes);
- bytes autograd keeps (:class:`~.activation_meter.SavedTensorMeter`) plus the layer output, with
  and without recompute -> ``activation_split_bytes`` / ``activation_replicated_bytes`` /
  ``recompute_bytes_per_sample`` (alpha); under autocast the intercept is the compute-dtype weight
  copies -> ``weight_copy_bytes_per_parameter``;
- the peak during forward+backward (``parallel.memory.PeakMemoryMeter``: CUDA allocator stats or
  MemTracker on CPU) minus parameters, gradients and kept activations -> the backward scratch;
  for the head this is the transient of the logits and the loss;
- MoE models: the router (initialised as training does) routes the largest micro-batch's
  random tokens -> ``moe_load_imbalance``, the busiest expert's kept assignments over the
  mean (:func:`router_load_imbalance`), which cost/moe.py uses for the busiest EP rank.

Tensor parallelism: the layer's time is also measured at every degree ``tp > 1`` of
``ModelProfilerConfig.tp_degrees`` (default: the powers of two up to the ranks on this machine
when torch.distributed runs, so a ``torchrun`` launch of N local ranks measures up to N; none on
a lone process). Each degree runs the runtime's own TP shard of the layer (``tp_size = t``:
``1/t`` of the heads and of the FFN, the norms, residual adds and dropouts on the whole
``(b, s, h)``) with its TP all-reduces made identities (:func:`tensor_parallel_compute_only`):
the cost model prices those collectives itself from the cluster profile, so the profile keeps
the shard's compute. Every rank measures at once under ``--auto-parallel``, so the shard is timed
under training's sharing of the machine. Stored as ``forward_time_by_tp[t]`` (forward + backward
over ``1 + backward_forward_ratio``, so that the cost model's ``r F`` backward adds up to the
measured step) and condensed into ``tp_replicated_fraction`` (the share every TP rank repeats,
least squares over the degrees). Kept activations at ``tp > 1`` stay derived (split part / tp +
replicated part, decided per saved tensor by the module that saved it: ``activation_meter``).

:data:`GPT_PROFILER` is what the families register; ``lookup.lookup_or_measure`` caches the
result (``cache.py``) under :func:`profile_cache_key`: device, precision, model shape, sequence
length, torch version and profiler settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..config import ModelConfig
from ..models.gpt import LanguageModelEmbedding
from ..models.moe import MoELayer, route
from ..models.te_layers import make_transformer_layer
from ..models.transformer import TransformerLayer, make_norm
from ..parallel.device import resolve_device
from ..parallel.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy
from ..planner.inputs.profile_records import LayerTypeProfile
from ..planner.inputs.profiles import ModelProfile
from ..utils.progress import Progress
from .activation_meter import transformer_classifier, vocab_classifier
from .lookup import FamilyProfiler
from .module_profiler import profile_modules
from .measure import (MEASUREMENT_VERSION, Barrier, ModelProfilerConfig, activation_bytes,
                      autocast, device_name, embedding_profile, first_rank, init_parameters,
                      layer_type_profile, measure, measured_profile, never_split,
                      parameter_count, run_seeded, tensor_parallel_compute_only,
                      time_forward_backward, tp1_groups, tp_shard_groups)
from .sdpa_probe import sdpa_backend
from .timing import fit_line, fit_replicated_fraction

logger = logging.getLogger(__name__)


def profile_model(model_config: ModelConfig, precision: str = "fp32",
                  device: str | torch.device | None = None, *,
                  config: ModelProfilerConfig = ModelProfilerConfig(),
                  seed: int = 1234, barrier: Barrier = None) -> ModelProfile:
    """Measure ``model_config``'s layer, embedding and head on ``device`` (no cache).

    Runs on one process and needs no torch.distributed. Dropout rates are the model's, so the
    masks' memory and time are included as in training. The caller's RNG state is left as it
    was (the random inputs come from ``seed`` inside a forked RNG). ``barrier`` starts every
    timing round (ranks that measure at once: ``--auto-parallel``).
    """
    return run_seeded(lambda dev: _profile_model(model_config, precision, dev, config, barrier),
                      precision, device, seed)


def _profile_model(cfg: ModelConfig, precision: str, dev: torch.device,
                   config: ModelProfilerConfig, barrier: Barrier) -> ModelProfile:
    """The measurement behind :func:`profile_model`."""
    s, h, vocab = cfg.seq_length, cfg.hidden_size, cfg.padded_vocab_size
    sizes = config.sizes(dev)
    groups = tp1_groups(dev)
    started = time.perf_counter()
    amp = lambda: autocast(precision, dev)  # noqa: E731 - a fresh context per use
    # Layer, embedding and head, each at every micro-batch size; from the first rank only (a
    # process without torch.distributed is one).
    progress = Progress(f"megatron-auto profile-model ({cfg.model_type})", 3 * len(sizes),
                        "measurements", enabled=first_rank(), delay_s=2.0)

    layer = init_parameters(make_transformer_layer(cfg, groups, causal=cfg.causal, device=dev),
                            cfg.init_method_std).to(dev)
    layer.train()

    def layer_run(b: int) -> tuple[Callable[[], torch.Tensor], list]:
        x = torch.randn(b, s, h, device=dev, requires_grad=True)

        def forward() -> torch.Tensor:
            with amp():
                return layer(x)
        return forward, [x]

    def set_recompute(flag: bool) -> None:
        layer.recompute = flag

    lay = measure(layer, layer_run, sizes, config, dev, transformer_classifier, True,
                  set_recompute, progress=progress, barrier=barrier)
    attention_backend = sdpa_backend(layer_run(sizes[0])[0])  # the kernel the numbers are of
    # single modules recompute in our layer only (Transformer Engine's: whole layers)
    modules = (profile_modules(layer, cfg, sizes, config, dev, amp, barrier)
               if isinstance(layer, TransformerLayer) else {})
    beta_bytes = activation_bytes(precision)
    layer_profile = layer_type_profile(
        cfg.model_type, layer, lay, sizes, precision,
        grad_io_bytes=2 * 4 * s * h,  # fp32 gradients of the layer's input and output (docs)
        hidden_bytes_per_sample=float(beta_bytes * s * h), attention_backend=attention_backend,
        flops_per_sample=float(2 * s * (4 * h * h + (3 if cfg.activation == "swiglu" else 2)
                                        * h * cfg.ffn_hidden_size) + 4 * s * s * h),
        **modules)
    del layer
    layer_profile = _with_tp_shards(layer_profile, cfg, config, sizes, dev, amp, barrier)
    if getattr(cfg, "moe", None) is not None:  # the router's load on the profiling batch
        x = torch.randn(max(sizes), s, h, device=dev)
        layer_profile = dataclasses.replace(
            layer_profile, moe_load_imbalance=router_load_imbalance(cfg, groups, x))

    tied = not cfg.untie_embeddings_and_output_weights
    emb = init_parameters(LanguageModelEmbedding(cfg, groups, None, with_positions=True,
                                                 num_tokentypes=cfg.num_tokentypes),
                          cfg.init_method_std).to(dev).train()

    def embed_run(b: int) -> tuple[Callable[[], torch.Tensor], list]:
        tokens = torch.randint(0, cfg.vocab_size, (b, s), device=dev)

        def forward() -> torch.Tensor:
            with amp():
                return emb.embed(tokens)
        return forward, [tokens]

    emb_series = measure(emb, embed_run, sizes, config, dev, never_split, True,
                         progress=progress, barrier=barrier)
    norm = init_parameters(make_norm(cfg), cfg.init_method_std).to(dev)
    head_parts = nn.ModuleList([norm])
    if tied:
        head_parts.append(emb)
        project = emb.logits
    else:
        out_layer = init_parameters(ColumnParallelLinear(h, vocab, groups, bias=False),
                                    cfg.init_method_std).to(dev)
        head_parts.append(out_layer)
        project = out_layer

    def head_run(b: int) -> tuple[Callable[[], torch.Tensor], list]:
        hidden = torch.randn(b, s, h, device=dev, requires_grad=True)
        labels = torch.randint(0, cfg.vocab_size, (b, s), device=dev)

        def forward() -> torch.Tensor:
            with amp():
                logits = project(norm(hidden))
            return vocab_parallel_cross_entropy(logits, labels, groups).sum()
        return forward, [hidden, labels]

    head_series = measure(head_parts, head_run, sizes, config, dev, vocab_classifier(vocab),
                          False, progress=progress, barrier=barrier)
    progress.close()
    embedding = embedding_profile(
        emb_series, head_series, sizes, embedding_parameters=parameter_count(emb),
        head_parameters=parameter_count(norm) + (0 if tied else parameter_count(head_parts[1])),
        tied=tied, vocab_size=vocab, hidden_bytes_per_sample=float(beta_bytes * s * h),
        final_norm_parameters=parameter_count(norm),
        # position (and token-type) rows: replicated over vocab TP, not tied to the head
        replicated_parameters=parameter_count(emb) - parameter_count(emb.word_embeddings))
    profile = measured_profile(
        {cfg.model_type: layer_profile}, embedding, precision, dev, model=cfg.model_type,
        sizes=sizes, started=started,
        tp_derivation=("time measured at tp " + ", ".join(
            str(t) for t in sorted(layer_profile.forward_time_by_tp)) + " (TP shards, "
            "all-reduces excluded); activations at tp>1 = replicated + split/tp"),
        raw={"layer": dataclasses.asdict(lay), "embedding": dataclasses.asdict(emb_series),
             "head": dataclasses.asdict(head_series)})
    logger.info("profiled %s layer (h=%d, s=%d) on %s in %.1f s", cfg.model_type, h, s,
                profile.metadata["device"], profile.metadata["profile_seconds"])
    return profile


def router_load_imbalance(cfg: ModelConfig, groups: Any, x: torch.Tensor) -> float:
    """Most kept assignments of one expert over the mean per expert when the runtime's router
    (``models/moe.py``: its weight initialised as training does, its routing rules) routes the
    tokens of ``x`` (b, s, h). An untrained router: what a fresh run starts from."""
    block = init_parameters(MoELayer(cfg, groups), cfg.init_method_std).to(x.device)
    with torch.no_grad():
        logits = torch.nn.functional.linear(x.float(), block.router.weight.float())
        routing = route(logits, cfg)
        kept = routing.experts[routing.keep]
        counts = torch.bincount(kept.reshape(-1), minlength=block.num_experts).double()
    return float(counts.max() / counts.mean())


def _with_tp_shards(profile: LayerTypeProfile, cfg: ModelConfig, config: ModelProfilerConfig,
                    sizes: Sequence[int], dev: torch.device,
                    amp: Callable[[], contextlib.AbstractContextManager],
                    barrier: Barrier) -> LayerTypeProfile:
    """``profile`` with ``forward_time_by_tp`` and ``tp_replicated_fraction`` from the TP
    shards of ``config.degrees(cfg)`` (module docstring); unchanged when there are none."""
    degrees = config.degrees(cfg)
    if not degrees:
        return profile
    s, h = cfg.seq_length, cfg.hidden_size
    by_tp = dict(profile.forward_time_by_tp)
    share = 1.0 + profile.backward_forward_ratio  # of one step, the forward's part
    for tp in degrees:
        with tensor_parallel_compute_only(tp):
            # our layer's shard even under --transformer-impl transformer_engine: TE's modules
            # would issue their own TP collectives, which this compute-only timing excludes
            shard = init_parameters(TransformerLayer(cfg, tp_shard_groups(dev, tp),
                                                     causal=cfg.causal),
                                    cfg.init_method_std).to(dev).train()
            forwards = []
            for b in sizes:
                x = torch.randn(b, s, h, device=dev, requires_grad=True)

                def forward(x: torch.Tensor = x) -> torch.Tensor:
                    with amp():
                        return shard(x)
                forwards.append(forward)
            fwd, bwd = time_forward_backward(forwards, config, dev, barrier)
            by_tp[tp] = fit_line(sizes, [(f + b) / share for f, b in zip(fwd, bwd)])
            del shard
    return dataclasses.replace(profile, forward_time_by_tp=by_tp,
                               tp_replicated_fraction=fit_replicated_fraction(by_tp))


def profile_cache_key(model_config: ModelConfig, precision: str, device: str | torch.device | None,
                      config: ModelProfilerConfig = ModelProfilerConfig()) -> dict[str, Any]:
    """Everything that changes the measured numbers (see cache.py); not the number of layers."""
    dev = resolve_device(device)
    shape = {k: v for k, v in model_config.to_dict().items() if k not in ("num_layers",)}
    shape["padded_vocab_size"] = model_config.padded_vocab_size
    return {"measurement": MEASUREMENT_VERSION,
            "device": device_name(dev), "precision": precision, "torch": torch.__version__,
            "model": shape, "batch_sizes": list(config.sizes(dev)),
            "iters": config.iters, "warmup_iters": config.warmup_iters,
            "tp_degrees": list(config.degrees(model_config))}


#: What the GPT and BERT families register (``families/gpt/family.py``).
GPT_PROFILER = FamilyProfiler(measure=profile_model, cache_key=profile_cache_key)
