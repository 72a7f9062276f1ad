"""Model profiler: measure one transformer layer, the embedding and the LM head on this device.

It runs the runtime's own modules (``models.transformer.TransformerLayer``,
``models.gpt.LanguageModelEmbedding``, the final norm, the tied or untied head and
``vocab_parallel_cross_entropy``) at tensor-parallel degree 1 on one process, in the training
precision (fp32, or bf16/fp16 under ``torch.autocast`` with fp32 master weights), and writes the
planner's :class:`~megatron_auto.planner.inputs.profiles.ModelProfile` (``source: "measured"``).

Per micro-batch size ``b`` in ``batch_sizes`` (forward and backward timed separately in each of
``iters`` steps, medians) it fits straight lines ``y = alpha * b + beta`` (docs/profiling.md §2):

- forward time -> ``forward_time_per_sample_s`` (alpha) and ``forward_time_constant_s``
  (beta); backward time -> ``backward_forward_ratio`` (ratio of the slopes);
- bytes autograd keeps (:class:`~.activation_meter.SavedTensorMeter`) plus the layer output, with
  and without recompute -> ``activation_split_bytes`` / ``activation_replicated_bytes`` /
  ``recompute_bytes_per_sample`` (alpha); under autocast the intercept is the compute-dtype weight
  copies -> ``weight_copy_bytes_per_parameter``;
- the peak during forward+backward (``parallel.memory.PeakMemoryMeter``: CUDA allocator stats or
  MemTracker on CPU) minus parameters, gradients and kept activations -> the backward scratch;
  for the head this is the transient of the logits and the loss.

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

:func:`get_or_create_model_profile` caches the result (``cache.py``) under a key of device,
precision, model shape, sequence length, torch version and profiler settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import platform
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..config import ModelConfig
from ..models.gpt import LanguageModelEmbedding
from ..models.te_layers import make_transformer_layer
from ..models.transformer import TransformerLayer, make_norm
from ..layout import StageLayout
from ..parallel.context import LayerGroups
from ..parallel import mappings
from ..parallel.device import resolve_device
from ..parallel.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy
from ..planner.inputs.profiles import EmbeddingProfile, LayerTypeProfile, ModelProfile
from ..parallel.memory import PeakMemoryMeter, storage_bytes
from ..utils.progress import Progress
from . import cache as profile_cache
from .activation_meter import SavedTensorMeter, transformer_classifier, vocab_classifier
from .layer_timing import (_sync, _time_rounds, fit_line, fit_replicated_fraction,  # noqa: F401
                           ranks_measure_together)  # re-exported: part of this module's API
from .sdpa_probe import sdpa_backend

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Part of the cache key: bumped whenever what is measured changes, so that older cached
# profiles are measured again (2: transient with gradients allocated beforehand; in-place loss;
# 3: backward/forward ratio of totals, CPU micro-batch sizes 2, 4, 8; 4: TP shards timed;
# 5: the backward transient's constant part, a weight gradient before accumulation, kept;
# 6: sizes timed in interleaved rounds, 9 of them).
MEASUREMENT_VERSION = 6


@dataclass(frozen=True)
class ModelProfilerConfig:
    """Micro-batch sizes and repetitions; part of the cache key."""

    # () = (2, 4, 8) on CPU, (2, 4, 6, 8) on GPU. Not 1: at b = 1 some reshapes are views
    # that are copies for b > 1, which would bend the activation line.
    batch_sizes: tuple[int, ...] = ()
    warmup_iters: int = 2
    iters: int = 9  # rounds; medians of 3 (then 5) left CPU profiles 20-60% apart between runs
    # TP degrees > 1 whose shard is timed too; None = the powers of two up to the local ranks
    # when torch.distributed runs (LOCAL_WORLD_SIZE, else the world), none on a lone process.
    tp_degrees: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.tp_degrees is not None and any(t < 2 for t in self.tp_degrees):
            raise ValueError(f"--tp-degrees {list(self.tp_degrees)}: give TP degrees >= 2 (tp 1 "
                             f"is always measured), e.g. 2 4 8")
        if any(b < 1 for b in self.batch_sizes) or len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ValueError(f"--batch-sizes {list(self.batch_sizes)}: need distinct positive "
                             f"micro-batch sizes, e.g. 1 2 4")
        if 0 < len(self.batch_sizes) < 2:
            raise ValueError(f"--batch-sizes {list(self.batch_sizes)}: give at least two sizes "
                             f"to fit time = alpha * b + beta")
        if self.iters < 1 or self.warmup_iters < 0:
            raise ValueError(f"--iters {self.iters} / --warmup-iters {self.warmup_iters}: need "
                             f"iters >= 1 and warmup >= 0")

    def sizes(self, device: torch.device) -> tuple[int, ...]:
        return self.batch_sizes or ((2, 4, 6, 8) if device.type == "cuda" else (2, 4, 8))

    def degrees(self, model_config: ModelConfig) -> tuple[int, ...]:
        """The TP degrees > 1 to time: the configured ones, or the powers of two up to the
        local ranks, keeping those that split this model's heads and FFN."""
        if self.tp_degrees is not None:
            wanted = sorted(set(self.tp_degrees))
        else:
            local = 1
            if dist.is_available() and dist.is_initialized():
                local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
            wanted = [1 << k for k in range(1, max(1, local).bit_length()) if 1 << k <= local]
        out = []
        for t in wanted:
            try:
                model_config.check_tensor_parallel(t)
            except ValueError:
                if self.tp_degrees is not None:
                    raise
                continue
            out.append(t)
        return tuple(out)


# ------------------------------------------------------------------------------ helpers
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.machine() or 'unknown'}-{torch.get_num_threads()}threads"


def _check_precision(precision: str, device: torch.device) -> None:
    """Reject precisions the profiler has no compute dtype for."""
    if precision not in DTYPES:
        raise ValueError(f"--precision {precision!r}: choose one of {', '.join(DTYPES)}")


def _autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def tp1_groups(device: torch.device) -> LayerGroups:
    """The groups of a one-rank layout: no communication, plain linear layers."""
    return LayerGroups(layout=StageLayout(0, 1, True), tp_group=None, tp_rank=0, tp_size=1,
                       tp_ranks=[0], dp_group=None, dp_rank=0, dp_size=1, dp_ranks=[0],
                       device_type=device.type)


def tp_shard_groups(device: torch.device, tp: int) -> LayerGroups:
    """Groups that make a layer build its TP rank-0 shard of degree ``tp`` on one process
    (communication only through :func:`tensor_parallel_compute_only`)."""
    return LayerGroups(layout=StageLayout(0, tp, True), tp_group=None, tp_rank=0, tp_size=tp,
                       tp_ranks=list(range(tp)), dp_group=None, dp_rank=0, dp_size=1,
                       dp_ranks=[0], device_type=device.type)


@contextlib.contextmanager
def tensor_parallel_compute_only(tp: int) -> Any:
    """Inside, the runtime's TP mappings see a group of ``tp`` ranks and all-reduce nothing.

    So a layer built on :func:`tp_shard_groups` runs exactly the shard's own work (the copies
    around the collectives included) and no communication, which the cost model prices
    separately (``cost_time.layer_time``: two all-reduces per direction). Only the
    all-reduce mappings are covered; sequence parallelism's gathers are not (the profiler does
    not measure SP layers)."""
    saved = mappings.group_size, mappings._all_reduce
    mappings.group_size = lambda group: tp  # type: ignore[assignment]
    mappings._all_reduce = lambda x, group: x  # type: ignore[assignment]
    try:
        yield
    finally:
        mappings.group_size, mappings._all_reduce = saved


def _init_(module: nn.Module, std: float) -> nn.Module:
    """Plausible values (the runtime's init needs a parallel context): matrices N(0, std),
    vectors of linear layers 0, norms keep their ones/zeros."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif "norm" not in name:
                p.zero_()
    return module


# ---------------------------------------------------------------------- one measurement
@dataclass
class _Series:
    """Per-batch-size measurements of one component."""

    forward_s: list[float] = dataclasses.field(default_factory=list)
    backward_s: list[float] = dataclasses.field(default_factory=list)
    split: list[float] = dataclasses.field(default_factory=list)
    replicated: list[float] = dataclasses.field(default_factory=list)
    recompute: list[float] = dataclasses.field(default_factory=list)
    transient: list[float] = dataclasses.field(default_factory=list)


def _measure(modules: nn.Module, run: Callable[[int], tuple[Callable[[], torch.Tensor], list]],
             sizes: Sequence[int], cfg: ModelProfilerConfig, device: torch.device,
             classifier: Callable, count_output: bool,
             recompute: Callable[[bool], None] | None = None,
             progress: Progress | None = None) -> _Series:
    """Time and meter ``run(b)`` -> (forward closure returning the value to back-propagate,
    tensors that existed before the forward) for every micro-batch size (one ``progress``
    step each)."""
    series = _Series()
    params = list(modules.parameters())
    runs = [run(b) for b in sizes]
    series.forward_s, series.backward_s = _time_rounds([forward for forward, _ in runs],
                                                       cfg.warmup_iters, cfg.iters, device)
    for b, (forward, inputs) in zip(sizes, runs):
        if progress is not None:
            progress.update(0, batch_size=b)

        def backward_step() -> None:
            out = forward()
            out.backward(torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out))

        meter = SavedTensorMeter(modules, exclude=inputs, classifier=classifier)
        with meter:
            out = forward()
        if count_output:
            meter.add_output(out)
        series.split.append(meter.split_bytes)
        series.replicated.append(meter.replicated_bytes)
        retained = meter.total_bytes
        del out, meter
        if recompute is not None:
            recompute(True)
            meter = SavedTensorMeter(modules, exclude=inputs, classifier=classifier)
            with meter:
                out = forward()
            meter.add_output(out)
            series.recompute.append(meter.total_bytes)
            del out, meter
            recompute(False)

        # Gradients exist before the metered step, as in training (DDP buckets, FSDP shards),
        # and count in the base: subtracting the final gradients from the peak instead would
        # hide the transient whenever the peak comes before a gradient is made (the head's
        # loss backward runs before its weight gradient).
        for p in params:
            p.grad = torch.zeros_like(p)
        _sync(device)
        base = (torch.cuda.memory_allocated(device) if device.type == "cuda"
                else storage_bytes(params) + storage_bytes([p.grad for p in params]))
        peak_meter = PeakMemoryMeter(device, modules)
        with peak_meter:
            backward_step()
        series.transient.append(max(0.0, peak_meter.peak_bytes - base - retained))
        for p in params:
            p.grad = None
        if progress is not None:
            progress.update(1)
    return series


def _first_rank() -> bool:
    """Whether this process reports progress: rank 0, or a process outside torch.distributed."""
    return not dist.is_initialized() or dist.get_rank() == 0


def _ratio(*series: _Series) -> float:
    """Backward over forward time, as the ratio of their totals over the measured sizes.

    The cost model prices backward as ``ratio * forward(b)``, constant term included, so the
    ratio must be one of totals: a ratio of the fitted slopes is wrong whenever the constant
    matters (small CPU layers: 3.1-3.5 ms forward at b = 2..4 is mostly constant), and noisy
    (one such profile had slopes 0.24 and 1.4 ms/sample, a ratio of 5.9 for a layer whose
    backward took 1.9x its forward at every size).
    """
    fwd = sum(sum(x.forward_s) for x in series)
    bwd = sum(sum(x.backward_s) for x in series)
    return max(1e-3, bwd / fwd) if fwd > 0 else 2.0


# ------------------------------------------------------------------------------ profiler
def profile_model(model_config: ModelConfig, precision: str = "fp32",
                  device: str | torch.device | None = None, *,
                  config: ModelProfilerConfig = ModelProfilerConfig(),
                  seed: int = 1234) -> ModelProfile:
    """Measure ``model_config``'s layer, embedding and head on ``device`` (no cache).

    Runs on one process and needs no torch.distributed. Dropout rates are the model's, so the
    masks' memory and time are included as in training. The caller's RNG state is left as it
    was (the random inputs come from ``seed`` inside a forked RNG).
    """
    dev = resolve_device(device)
    _check_precision(precision, dev)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        return _profile_model(model_config, precision, dev, config=config, seed=seed)


def _profile_model(model_config: ModelConfig, precision: str = "fp32",
                  device: str | torch.device | None = None, *,
                  config: ModelProfilerConfig = ModelProfilerConfig(),
                  seed: int = 1234) -> ModelProfile:
    """The measurement behind :func:`profile_model`."""
    dev = resolve_device(device)
    torch.manual_seed(seed)
    cfg = model_config
    s, h, vocab = cfg.seq_length, cfg.hidden_size, cfg.padded_vocab_size
    sizes = config.sizes(dev)
    groups = tp1_groups(dev)
    started = time.perf_counter()
    amp = lambda: _autocast(precision, dev)  # noqa: E731 - a fresh context per use
    # Layer, embedding and head, each at every micro-batch size; from the first rank only (a
    # process without torch.distributed is one).
    progress = Progress(f"megatron-auto profile-model ({cfg.model_type})", 3 * len(sizes),
                        "measurements", enabled=_first_rank(), delay_s=2.0)

    layer = _init_(make_transformer_layer(cfg, groups, causal=cfg.causal, device=dev),
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

    lay = _measure(layer, layer_run, sizes, config, dev, transformer_classifier, True,
                   set_recompute, progress=progress)
    attention_backend = sdpa_backend(layer_run(sizes[0])[0])  # the kernel the numbers are of
    num_params = sum(p.numel() for p in layer.parameters())
    beta_bytes = 4 if precision == "fp32" else 2
    split_a, split_b = fit_line(sizes, lay.split)
    rep_a, rep_b = fit_line(sizes, lay.replicated)
    rec_a, _ = fit_line(sizes, lay.recompute)
    scratch_a, scratch_b = fit_line(sizes, lay.transient)
    grad_io = 2 * 4 * s * h  # fp32 gradients of the layer's input and output (see docs)
    fwd_a, fwd_b = fit_line(sizes, lay.forward_s)
    layer_profile = LayerTypeProfile(
        name=cfg.model_type, parameter_count=num_params,
        forward_time_per_sample_s=fwd_a, forward_time_constant_s=fwd_b,
        backward_forward_ratio=_ratio(lay),
        activation_replicated_bytes=rep_a, activation_split_bytes=split_a,
        recompute_bytes_per_sample=rec_a, hidden_bytes_per_sample=float(beta_bytes * s * h),
        backward_scratch_replicated_bytes=float(min(scratch_a, grad_io)),
        backward_scratch_split_bytes=float(max(0.0, scratch_a - grad_io)),
        backward_scratch_constant_bytes=float(max(0.0, scratch_b)),
        weight_copy_bytes_per_parameter=(0.0 if precision == "fp32"
                                         else (split_b + rep_b) / max(num_params, 1)),
        forward_time_by_tp={1: (fwd_a, fwd_b)}, attention_backend=attention_backend,
        flops_per_sample=float(2 * s * (4 * h * h + (3 if cfg.activation == "swiglu" else 2)
                                        * h * cfg.ffn_hidden_size) + 4 * s * s * h))
    del layer
    layer_profile = _with_tp_shards(layer_profile, cfg, config, sizes, dev, amp)

    tied = not cfg.untie_embeddings_and_output_weights
    emb = _init_(LanguageModelEmbedding(cfg, groups, None, with_positions=True,
                                        num_tokentypes=cfg.num_tokentypes),
                 cfg.init_method_std).to(dev).train()

    def embed_run(b: int) -> tuple[Callable[[], torch.Tensor], list]:
        tokens = torch.randint(0, cfg.vocab_size, (b, s), device=dev)

        def forward() -> torch.Tensor:
            with amp():
                return emb.embed(tokens)
        return forward, [tokens]

    emb_series = _measure(emb, embed_run, sizes, config, dev, lambda t, m: False, True,
                          progress=progress)
    norm = _init_(make_norm(cfg), cfg.init_method_std).to(dev)
    head_parts = nn.ModuleList([norm])
    if tied:
        head_parts.append(emb)
        project = emb.logits
    else:
        out_layer = _init_(ColumnParallelLinear(h, vocab, groups, bias=False),
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

    head_series = _measure(head_parts, head_run, sizes, config, dev, vocab_classifier(vocab),
                           False, progress=progress)
    progress.close()
    e_fwd_a, e_fwd_b = fit_line(sizes, emb_series.forward_s)
    h_fwd_a, h_fwd_b = fit_line(sizes, head_series.forward_s)
    emb_params = sum(p.numel() for p in emb.parameters())
    head_params = sum(p.numel() for p in norm.parameters()) + (
        0 if tied else sum(p.numel() for p in head_parts[1].parameters()))
    embedding_profile = EmbeddingProfile(
        embedding_parameters=emb_params, head_parameters=head_params, tied=tied,
        vocab_size=vocab, hidden_bytes_per_sample=float(beta_bytes * s * h),
        embedding_forward_time_per_sample_s=e_fwd_a, head_forward_time_per_sample_s=h_fwd_a,
        embedding_activation_bytes=fit_line(sizes, [a + r for a, r in zip(
            emb_series.split, emb_series.replicated)])[0],
        head_activation_replicated_bytes=fit_line(sizes, head_series.replicated)[0],
        head_activation_split_bytes=fit_line(sizes, head_series.split)[0],
        head_transient_split_bytes=fit_line(sizes, head_series.transient)[0],
        forward_time_constant_s=(e_fwd_b + h_fwd_b) / 2,
        backward_forward_ratio=_ratio(emb_series, head_series),
        final_norm_parameters=sum(p.numel() for p in norm.parameters()))
    elapsed = time.perf_counter() - started
    metadata = {
        "model": cfg.model_type, "device": device_name(dev), "torch": torch.__version__,
        "batch_sizes": list(sizes), "profile_seconds": elapsed,
        "tp_derivation": ("time measured at tp " + ", ".join(
            str(t) for t in sorted(layer_profile.forward_time_by_tp)) + " (TP shards, "
            "all-reduces excluded); activations at tp>1 = replicated + split/tp"),
        "raw": {"layer": dataclasses.asdict(lay), "embedding": dataclasses.asdict(emb_series),
                "head": dataclasses.asdict(head_series)}}
    logger.info("profiled %s layer (h=%d, s=%d) on %s in %.1f s", cfg.model_type, h, s,
                metadata["device"], elapsed)
    return ModelProfile(layer_types={cfg.model_type: layer_profile}, embedding=embedding_profile,
                        precision=precision, source="measured", metadata=metadata)


def _with_tp_shards(profile: LayerTypeProfile, cfg: ModelConfig, config: ModelProfilerConfig,
                    sizes: Sequence[int], dev: torch.device,
                    amp: Callable[[], contextlib.AbstractContextManager]) -> LayerTypeProfile:
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
            shard = _init_(TransformerLayer(cfg, tp_shard_groups(dev, tp), causal=cfg.causal),
                           cfg.init_method_std).to(dev).train()
            forwards = []
            for b in sizes:
                x = torch.randn(b, s, h, device=dev, requires_grad=True)

                def forward(x: torch.Tensor = x) -> torch.Tensor:
                    with amp():
                        return shard(x)
                forwards.append(forward)
            fwd, bwd = _time_rounds(forwards, config.warmup_iters, config.iters, dev)
            by_tp[tp] = fit_line(sizes, [(f + b) / share for f, b in zip(fwd, bwd)])
            del shard
    return dataclasses.replace(profile, forward_time_by_tp=by_tp,
                               tp_replicated_fraction=fit_replicated_fraction(by_tp))


def profile_cache_key(model_config: ModelConfig, precision: str, device: str | torch.device | None,
                      config: ModelProfilerConfig = ModelProfilerConfig()) -> dict[str, Any]:
    """Everything that changes the measured numbers (see cache.py)."""
    dev = resolve_device(device)
    shape = {k: v for k, v in model_config.to_dict().items() if k not in ("num_layers",)}
    shape["padded_vocab_size"] = model_config.padded_vocab_size
    return {"measurement": MEASUREMENT_VERSION,
            "device": device_name(dev), "precision": precision, "torch": torch.__version__,
            "model": shape, "batch_sizes": list(config.sizes(dev)),
            "iters": config.iters, "warmup_iters": config.warmup_iters,
            "tp_degrees": list(config.degrees(model_config))}


@dataclass(frozen=True)
class ProfileLookup:
    """What :func:`lookup_or_measure` found: the profile, and whether it was measured now
    (False: served from the cache)."""

    profile: ModelProfile
    measured: bool


def lookup_or_measure(model_config: ModelConfig, precision: str = "fp32",
                      device: str | torch.device | None = None, cache_dir: str | None = None, *,
                      config: ModelProfilerConfig = ModelProfilerConfig(),
                      force: bool = False) -> ProfileLookup:
    """The cached profile for this (device, precision, layer shape, seq length, torch), or a
    fresh measurement stored in the cache. ``force`` re-measures and overwrites.

    The number of layers is not part of the key: layers of one shape cost the same, so a 24-
    and a 48-layer model of the same width share one profile.
    """
    key = profile_cache_key(model_config, precision, device, config)
    if not force:
        cached = profile_cache.load_cached(key, cache_dir)
        if cached is not None:
            logger.info("reusing cached model profile %s", profile_cache.cache_path(key, cache_dir))
            return ProfileLookup(cached, measured=False)
    profile = profile_model(model_config, precision, device, config=config)
    profile = dataclasses.replace(profile, metadata={**profile.metadata,
                                                     profile_cache.KEY_FIELD: key})
    path = profile_cache.store(profile, key, cache_dir)
    logger.info("stored model profile %s", path)
    return ProfileLookup(profile, measured=True)


def get_or_create_model_profile(model_config: ModelConfig, precision: str = "fp32",
                                device: str | torch.device | None = None,
                                cache_dir: str | None = None, *,
                                config: ModelProfilerConfig = ModelProfilerConfig(),
                                force: bool = False) -> ModelProfile:
    """:func:`lookup_or_measure`'s profile (cached, or measured and stored)."""
    return lookup_or_measure(model_config, precision, device, cache_dir, config=config,
                             force=force).profile

def config_cache_key(cfg: Any, precision: str, device: str | torch.device | None,
                     config: ModelProfilerConfig) -> dict[str, Any]:
    """Cache key of a family profiled from its config alone (T5, ViT, Swin; see cache.py)."""
    dev = resolve_device(device)
    return {"measurement": MEASUREMENT_VERSION, "device": device_name(dev),
            "precision": precision, "torch": torch.__version__, "model": cfg.to_dict(),
            "batch_sizes": list(config.sizes(dev)), "iters": config.iters,
            "warmup_iters": config.warmup_iters}

def cached_or_measured(key: dict[str, Any], measure: Callable[[], ModelProfile],
                       cache_dir: str | None, force: bool) -> ProfileLookup:
    """The profile cached under ``key``, or ``measure()`` stored there with its key."""
    if not force:
        cached = profile_cache.load_cached(key, cache_dir)
        if cached is not None:
            return ProfileLookup(cached, measured=False)
    profile = measure()
    profile = dataclasses.replace(profile, metadata={**profile.metadata,
                                                     profile_cache.KEY_FIELD: key})
    profile_cache.store(profile, key, cache_dir)
    return ProfileLookup(profile, measured=True)
