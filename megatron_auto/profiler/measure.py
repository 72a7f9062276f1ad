"""The profiling core every family's profiler measures with (docs/profiling.md §2).

A family's profiler builds its layers, embedding and head from the runtime's own modules at
tensor-parallel degree 1 (:func:`tp1_groups`, :func:`init_parameters`), hands each with a
``run(b)`` closure to :func:`measure`, and turns what was measured into the planner's profile
types with :func:`layer_type_profile`, :func:`embedding_profile` and :func:`measured_profile`,
inside :func:`run_seeded`. What :func:`measure` takes per micro-batch size ``b`` of the
settings (:class:`ModelProfilerConfig`):

- forward and backward time (:func:`~.timing.time_rounds`: every size once per round, medians
  over ``iters`` rounds; a ``barrier`` starts each round on every rank at once);
- the bytes autograd keeps (:class:`~.activation_meter.SavedTensorMeter`, split into TP-split
  and replicated parts by the family's classifier), plus the output when it stays alive, with
  and without recompute;
- the peak during forward + backward (``parallel.memory.PeakMemoryMeter``) above parameters,
  gradients and kept activations: the backward transient.

The profile's fields are straight-line fits ``y = alpha * b + beta`` of those series
(:func:`~.timing.fit_line`). Only the family knows its shapes: the fp32 gradients of a layer's
inputs and outputs (the bound between the replicated and the split backward scratch), the
hidden bytes per sample, and any field its layers add.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..layout import StageLayout
from ..parallel import mappings
from ..parallel.context import LayerGroups
from ..parallel.device import resolve_device
from ..parallel.memory import PeakMemoryMeter, storage_bytes
from ..planner.inputs.profile_records import EmbeddingProfile, LayerTypeProfile
from ..planner.inputs.profiles import ModelProfile
from ..utils.progress import Progress
from .activation_meter import SavedTensorMeter
from .timing import fit_line, forward_backward, sync, time_rounds

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Part of the cache key: bumped whenever what is measured changes, so that older cached
# profiles are measured again (2: transient with gradients allocated beforehand; in-place loss;
# 3: backward/forward ratio of totals, CPU micro-batch sizes 2, 4, 8; 4: TP shards timed;
# 5: the backward transient's constant part, a weight gradient before accumulation, kept;
# 6: sizes timed in interleaved rounds, 9 of them; 7: the layer's modules one by one and the
# core attention at several lengths, profiler/module_profiler.py; 8: an MoE model's router
# load imbalance, model_profiler.router_load_imbalance).
MEASUREMENT_VERSION = 8

#: ``run(b) -> (forward, inputs)``: ``forward()`` runs one micro-batch of ``b`` samples and
#: returns what to back-propagate; ``inputs`` are the tensors that exist before it (not kept).
Run = Callable[[int], tuple[Callable[[], torch.Tensor], list]]
#: Whether a saved tensor (and the module that saved it) is split by tensor parallelism.
Classifier = Callable[[torch.Tensor, "nn.Module | None"], bool]
#: The barrier of ranks that measure at once (``dist.barrier``), or None.
Barrier = Callable[[], Any] | None


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

    def degrees(self, model_config: Any) -> tuple[int, ...]:
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


def check_precision(precision: str) -> None:
    """Reject precisions the profiler has no compute dtype for."""
    if precision not in DTYPES:
        raise ValueError(f"--precision {precision!r}: choose one of {', '.join(DTYPES)}")


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The training precision's autocast (a fresh context per use; none for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def activation_bytes(precision: str) -> int:
    """Bytes of one activation element in ``precision`` (the autocast dtype)."""
    return 4 if precision == "fp32" else 2


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


def init_parameters(module: nn.Module, std: float) -> nn.Module:
    """Plausible values (the runtime's init needs a parallel context): matrices N(0, std),
    vectors of linear layers 0, norms keep their ones/zeros."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif "norm" not in name:
                p.zero_()
    return module


def never_split(t: torch.Tensor, module: nn.Module | None) -> bool:
    """The classifier of a component that tensor parallelism does not split."""
    return False


def first_rank() -> bool:
    """Whether this process reports progress: rank 0, or a process outside torch.distributed."""
    return not dist.is_initialized() or dist.get_rank() == 0


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------------- one measurement
@dataclass
class Series:
    """Per-micro-batch-size measurements of one component."""

    forward_s: list[float] = dataclasses.field(default_factory=list)
    backward_s: list[float] = dataclasses.field(default_factory=list)
    split: list[float] = dataclasses.field(default_factory=list)
    replicated: list[float] = dataclasses.field(default_factory=list)
    recompute: list[float] = dataclasses.field(default_factory=list)
    transient: list[float] = dataclasses.field(default_factory=list)


def time_forward_backward(forwards: Sequence[Callable[[], torch.Tensor]],
                          settings: ModelProfilerConfig, device: torch.device,
                          barrier: Barrier = None) -> tuple[list[float], list[float]]:
    """Median forward and backward seconds of each closure (one training step each per round)."""
    rounds = time_rounds([forward_backward(f) for f in forwards], settings.warmup_iters,
                         settings.iters, device, barrier=barrier)
    return [f for f, _ in rounds], [b for _, b in rounds]


def measure(modules: nn.Module, run: Run, sizes: Sequence[int], settings: ModelProfilerConfig,
            device: torch.device, classifier: Classifier, count_output: bool,
            recompute: Callable[[bool], None] | None = None, progress: Progress | None = None,
            barrier: Barrier = None) -> Series:
    """Time and meter ``run(b)`` (see :data:`Run`) for every micro-batch size (one ``progress``
    step each). ``count_output``: the forward's output stays alive as kept activation (a layer,
    the embedding), not a head's loss. ``recompute(flag)`` switches the module's recompute on
    and off, when it has one; with it on, the kept bytes are the recompute input."""
    series = Series()
    params = list(modules.parameters())
    runs = [run(b) for b in sizes]
    series.forward_s, series.backward_s = time_forward_backward(
        [forward for forward, _ in runs], settings, device, barrier)
    for b, (forward, inputs) in zip(sizes, runs):
        if progress is not None:
            progress.update(0, batch_size=b)
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
        sync(device)
        base = (torch.cuda.memory_allocated(device) if device.type == "cuda"
                else storage_bytes(params) + storage_bytes([p.grad for p in params]))
        step_forward, step_backward = forward_backward(forward)
        peak_meter = PeakMemoryMeter(device, modules)
        with peak_meter:
            step_forward()
            step_backward()
        series.transient.append(max(0.0, peak_meter.peak_bytes - base - retained))
        for p in params:
            p.grad = None
        if progress is not None:
            progress.update(1)
    return series


def backward_ratio(*series: Series) -> float:
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


# ---------------------------------------------------------------------- the profile's fields
def layer_type_profile(name: str, layer: nn.Module, series: Series, sizes: Sequence[int],
                       precision: str, *, grad_io_bytes: float,
                       extra_replicated_bytes: float = 0.0, **fields: Any) -> LayerTypeProfile:
    """The :class:`LayerTypeProfile` of one layer type from its measured ``series``.

    Slopes of the fits: time per sample, kept activations (split and replicated; plus
    ``extra_replicated_bytes`` the family adds, e.g. an input the layer keeps that the meter
    excluded), the recompute input, and the backward transient, which is replicated up to
    ``grad_io_bytes`` (the fp32 gradients of the layer's inputs and outputs per sample, which
    every TP rank holds whole) and split beyond. Intercepts: the per-call time, the transient's
    constant part, and under autocast the compute-dtype weight copies. ``fields``: the rest of
    the profile's fields (``hidden_bytes_per_sample`` always; whatever else the family knows).
    """
    num_params = parameter_count(layer)
    split_a, split_b = fit_line(sizes, series.split)
    rep_a, rep_b = fit_line(sizes, series.replicated)
    scratch_a, scratch_b = fit_line(sizes, series.transient)
    fwd_a, fwd_b = fit_line(sizes, series.forward_s)
    return LayerTypeProfile(
        name=name, parameter_count=num_params, forward_time_per_sample_s=fwd_a,
        forward_time_constant_s=fwd_b, backward_forward_ratio=backward_ratio(series),
        activation_replicated_bytes=rep_a + extra_replicated_bytes,
        activation_split_bytes=split_a,
        recompute_bytes_per_sample=fit_line(sizes, series.recompute)[0],
        backward_scratch_replicated_bytes=float(min(scratch_a, grad_io_bytes)),
        backward_scratch_split_bytes=float(max(0.0, scratch_a - grad_io_bytes)),
        backward_scratch_constant_bytes=float(max(0.0, scratch_b)),
        weight_copy_bytes_per_parameter=(0.0 if precision == "fp32"
                                         else (split_b + rep_b) / max(num_params, 1)),
        forward_time_by_tp={1: (fwd_a, fwd_b)}, **fields)


def embedding_profile(embedding: Series, head: Series, sizes: Sequence[int], *,
                      head_replicated: bool = False, head_transient_floor: float = 0.0,
                      **fields: Any) -> EmbeddingProfile:
    """The :class:`EmbeddingProfile` from the embedding's and the head's measured series.

    Slopes: forward times, the embedding's kept bytes (all of them), the head's kept bytes
    split by vocab TP or not (``head_replicated``: a head that vocab TP does not split keeps
    all of them replicated), the head's transient (the logits and the loss; at least
    ``head_transient_floor``). The intercepts' mean is the per-call constant. ``fields``: the
    parameter counts, ``tied``, ``vocab_size``, ``hidden_bytes_per_sample``, and the rest.
    """
    if head_replicated:
        replicated = fit_line(sizes, [a + r for a, r in zip(head.split, head.replicated)])[0]
        split = 0.0
    else:
        replicated, split = fit_line(sizes, head.replicated)[0], fit_line(sizes, head.split)[0]
    e_fwd_a, e_fwd_b = fit_line(sizes, embedding.forward_s)
    h_fwd_a, h_fwd_b = fit_line(sizes, head.forward_s)
    return EmbeddingProfile(
        embedding_forward_time_per_sample_s=e_fwd_a, head_forward_time_per_sample_s=h_fwd_a,
        embedding_activation_bytes=fit_line(sizes, [a + r for a, r in zip(
            embedding.split, embedding.replicated)])[0],
        head_activation_replicated_bytes=replicated, head_activation_split_bytes=split,
        head_transient_split_bytes=max(fit_line(sizes, head.transient)[0], head_transient_floor),
        forward_time_constant_s=(e_fwd_b + h_fwd_b) / 2,
        backward_forward_ratio=backward_ratio(embedding, head), **fields)


def measured_profile(layers: dict[str, LayerTypeProfile], embedding: EmbeddingProfile,
                     precision: str, device: torch.device, *, model: str,
                     sizes: Sequence[int], started: float, tp_derivation: str,
                     raw: dict[str, Any]) -> ModelProfile:
    """The :class:`ModelProfile` (``source: "measured"``) with the metadata every family's
    profile records: the model, device, torch version, sizes, seconds since ``started``, how
    TP degrees > 1 are derived, and the raw series."""
    metadata = {"model": model, "device": device_name(device), "torch": torch.__version__,
                "batch_sizes": list(sizes), "profile_seconds": time.perf_counter() - started,
                "tp_derivation": tp_derivation, "raw": raw}
    return ModelProfile(layer_types=layers, embedding=embedding, precision=precision,
                        source="measured", metadata=metadata)


def run_seeded(profile: Callable[[torch.device], ModelProfile], precision: str,
               device: str | torch.device | None, seed: int) -> ModelProfile:
    """``profile(device)`` on one process, its random inputs from ``seed`` inside a forked RNG
    (the caller's RNG state is left as it was); ``ValueError`` for an unknown precision."""
    dev = resolve_device(device)
    check_precision(precision)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        return profile(dev)
