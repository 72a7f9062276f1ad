"""The cost of activation offload (plan ``layers[i].offload``, parallel/offload.py).

What a layer's offload moves, per micro-batch on one rank (``samples`` samples, TP ``t``, compute
dtype ``beta`` bytes; SP splits the sequence-wise tensors outside attention over ``t``):

- ``true``: everything the layer keeps for backward (its priced kept activations, after any
  module recompute's release, with the autocast weight copies) except what autograd does not
  hold through saved tensors: the inputs of its recomputed modules, which the checkpoint holds
  on the device (``core_attn`` q, k, v; ``mlp`` its input; ``norm`` both inputs).
- ``core_attn``: what the attention call saves: q, k, v ``beta s (h + 2 kv) / t``, its output
  ``beta s h / t``, and beyond them the kernel's kept scores (``cost/recompute.py``'s quadratic
  bytes, math kernel) or its log-sum-exp (``4 heads s / t``, fused kernels).
- ``mlp``: fc1's input ``beta s h`` (``/ t`` under SP), fc1's output and the activation's
  output ``2 beta s f / t`` (GeLU) or gate, up, SiLU and product ``4 beta s f / t`` (SwiGLU).
- ``norm``: the two norms' inputs ``2 beta s h`` (``/ t`` under SP); their statistics are a few
  bytes per token, not counted.
Module lists leave the weight copies on the device (under-counting what moves keeps the device
estimate on the safe side); no module is priced above the layer's kept bytes.

Device memory: a micro-batch keeps the moved bytes less; in backward the layer's moved bytes of
the running micro-batch are back on the device until its backward ends (a transient). Host
memory: the moved bytes of every micro-batch in flight (a second budget, ``host_per_microbatch``).

Time, at ``ClusterSpec.host_link_bw`` (bytes/s per direction, a preset from the PCIe figures of
docs/hardware.md or a measured profile): on CUDA the forward's copy runs on a side stream beside
the layer's forward compute, so only ``max(0, copy - forward compute)`` shows; backward's copy
back runs on the compute stream before the layer's backward uses it (the runtime waits for it):
all of it shows. On CPU the copy is a memory copy, not priced (host and device are one memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from ...plan import LayerStrategy
from ..inputs.cluster_model import ClusterModel
from ..inputs.hardware import GB
from ..inputs.model_spec import LayerType
from ..inputs.profile_records import LayerTypeProfile
from .gpu_terms import NO_SCORES_BACKENDS, attention_kept_bytes
from .memory_model import ADAM_BYTES, MemoryCost
from .time_model import TimeCost

LSE_BYTES = 4  # fused attention kernels keep one fp32 log-sum-exp per head and token


@dataclass(frozen=True)
class OffloadCost:
    """Per micro-batch on one rank: bytes moved to the host (and back), and the seconds of one
    direction's copy."""

    moved_bytes: float = 0.0
    copy_time_s: float = 0.0


NONE = OffloadCost()


def _module_bytes(module: str, profile: LayerTypeProfile, layer_type: LayerType, tp: int,
                  sp: bool, compute_bytes: int, mask_bytes: int) -> float:
    """Per sample: what module ``module`` saves for backward (module docstring)."""
    beta, s, h = compute_bytes, layer_type.seq_length, layer_type.hidden_size
    split = tp if sp else 1  # sequence-wise tensors outside attention under SP
    if module == "core_attn":
        qkv = beta * s * (h + 2 * layer_type.kv_size) / tp
        out = beta * s * h / tp
        if profile.attention_backend in NO_SCORES_BACKENDS:
            extra = LSE_BYTES * layer_type.num_attention_heads * s / tp
        else:
            extra = (profile.attention_kept_quadratic_bytes or attention_kept_bytes(
                beta, layer_type.num_attention_heads, s, layer_type.attended_tokens,
                profile.attention_backend, mask_bytes)) / tp
        return qkv + out + extra
    if module == "mlp":
        mats = 4 if layer_type.activation == "swiglu" else 2
        return beta * s * h / split + mats * beta * s * layer_type.ffn_hidden_size / tp
    if module == "norm":
        return 2 * beta * s * h / split
    raise ValueError(f"offload module {module!r}: unknown")


def _checkpoint_inputs(module: str, layer_type: LayerType, tp: int, sp: bool,
                       compute_bytes: int) -> float:
    """Per sample: the inputs a recomputed module's checkpoint holds on the device."""
    beta, s, h = compute_bytes, layer_type.seq_length, layer_type.hidden_size
    if module == "core_attn":
        return beta * s * (h + 2 * layer_type.kv_size) / tp
    return (1 if module == "mlp" else 2) * beta * s * h / (tp if sp else 1)


def offload_cost(strategy: LayerStrategy, profile: LayerTypeProfile, layer_type: LayerType,
                 cluster: ClusterModel, samples: float, kept_bytes: float, compute_bytes: int,
                 mask_bytes: int) -> OffloadCost:
    """What ``strategy.offload`` moves for one micro-batch of ``samples`` samples per rank and
    the copy's seconds one way; ``kept_bytes`` is the layer's priced kept activations per
    micro-batch (``MemoryCost.activations_per_microbatch``)."""
    offload = strategy.offload
    if offload is False or kept_bytes <= 0:
        return NONE
    tp, sp = strategy.tp, strategy.sequence_parallel and strategy.tp > 1
    if offload is True:
        held = sum(_checkpoint_inputs(m, layer_type, tp, sp, compute_bytes)
                   for m in strategy.recompute_modules) * samples
        moved = max(0.0, kept_bytes - held)
    else:
        moved = min(kept_bytes, samples * sum(
            _module_bytes(m, profile, layer_type, tp, sp, compute_bytes, mask_bytes)
            for m in offload))
    bandwidth = getattr(cluster, "host_link_bw", 0.0)
    return OffloadCost(moved_bytes=moved, copy_time_s=moved / bandwidth if bandwidth else 0.0)


def apply_offload_memory(mem: MemoryCost, cost: OffloadCost) -> MemoryCost:
    """``mem`` with the moved bytes on the host: kept less on the device, back on it while the
    layer's backward runs (transient)."""
    if not cost.moved_bytes:
        return mem
    return replace(mem, activations_per_microbatch=mem.activations_per_microbatch
                   - cost.moved_bytes, transient=mem.transient + cost.moved_bytes,
                   host_per_microbatch=cost.moved_bytes)


def apply_offload_time(time: TimeCost, cost: OffloadCost) -> TimeCost:
    """``time`` with the copies that do not hide: forward's beyond the layer's forward compute
    (side stream), backward's whole (the layer waits for its tensors)."""
    if not cost.copy_time_s:
        return time
    forward_compute = time.compute * time.forward / max(time.microbatch, 1e-30)
    return replace(time, forward=time.forward + max(0.0, cost.copy_time_s - forward_compute),
                   backward=time.backward + cost.copy_time_s)


def host_budget_problem(host_memory_bytes: float, host_budget_gb: float | None,
                        host_optimizer_bytes: float = 0.0) -> str | None:
    """Why a plan whose offload needs ``host_memory_bytes`` per device (the most of any stage;
    ``host_optimizer_bytes`` of it the offloaded optimizer's) cannot run under
    ``--host-memory-budget-gb`` (None: not given), as one line, or None. A budget must be
    positive and finite; a plan that offloads needs one that holds it."""
    if host_budget_gb is not None and not (host_budget_gb > 0 and math.isfinite(host_budget_gb)):
        return (f"--host-memory-budget-gb={host_budget_gb}: must be a positive number (GB = 1e9 "
                f"bytes of host memory one device's rank may use)")
    if not host_memory_bytes:
        return None
    need = math.ceil(host_memory_bytes / GB * 100) / 100
    activations = host_memory_bytes - host_optimizer_bytes > 0
    if activations and host_optimizer_bytes:
        what = ("offloaded activations (layers[i].offload) and optimizer share "
                "(pipeline.optimizer_offload_fraction)")
        fix = "offload fewer layers or modules or a smaller optimizer share"
    elif activations:
        what, fix = "offloaded activations", "offload fewer layers or modules"
    else:
        what = "offloaded optimizer share (pipeline.optimizer_offload_fraction)"
        fix = "lower pipeline.optimizer_offload_fraction"
    if host_budget_gb is None:
        if not host_optimizer_bytes:  # the activation-only wording, as before
            return (f"the plan offloads activations (layers[i].offload) that need {need:.2f} GB "
                    f"of host memory per device: give --host-memory-budget-gb {need:.2f} or "
                    f"more, or set offload to false")
        return (f"the plan's {what} needs {need:.2f} GB of host memory per device: give "
                f"--host-memory-budget-gb {need:.2f} or more, or {fix}")
    if host_memory_bytes > host_budget_gb * GB:
        verb = "needs" if host_optimizer_bytes else "need"
        return (f"--host-memory-budget-gb={host_budget_gb}: the plan's {what} {verb} "
                f"{need:.2f} GB of host memory per device; raise it to {need:.2f}, or {fix}")
    return None


# ------------------------------------------------------------------------ optimizer offload
#: Host bytes per offloaded element (parallel/optimizer_offload.py): the fp32 master, the fp32
#: gradient buffer the gradient is copied into, and AdamW's two fp32 moments.
HOST_OPTIMIZER_BYTES = 16
#: Bytes one step moves per offloaded element each way: the fp32 gradient down, the updated
#: fp32 parameter up.
OPTIMIZER_COPY_BYTES = 4


@dataclass(frozen=True)
class OptimizerOffloadCost:
    """What ``pipeline.optimizer_offload_fraction`` = ``fraction`` changes on one rank of a
    stage whose optimizer owns ``owned`` elements (``optimizer_offload_cost``)."""

    offloaded_elements: float = 0.0
    host_bytes: float = 0.0
    step_time_s: float = 0.0  # the whole step of the rank's owned elements, device + host


def optimizer_offload_cost(cluster: ClusterModel, fraction: float, owned: float) -> \
        OptimizerOffloadCost:
    """The host side of a stage's optimizer step when ``fraction`` of the ``owned`` elements
    (the AdamW elements this rank steps: every local one under ``ddp``, its slice under
    ``zero1``) are offloaded.

    The runtime (``HostOffloadAdamW``) offloads whole parameters in order while they start
    below ``fraction`` of the bytes, so it offloads at least ``fraction x owned`` elements (at
    most one parameter more): priced at ``fraction x owned``, the device side is on the safe
    side and the host side exact for 0 and 1.

    The device keeps the parameter (it is the fp32 master of the device path) and its gradient;
    its AdamW moments (8 B) and the step's foreach temporary (4 B) go; the host holds
    ``HOST_OPTIMIZER_BYTES`` per element. Step time, with ``T`` the device's step of the owned
    elements (``optimizer_time_per_parameter_s``) and ``H`` the host's
    (``host_optimizer_time_per_parameter_s``, 0: the device's figure): on CUDA
    (``host_link_bw > 0``) the gradients go down first (one sync), the device's share is queued
    and runs while the host steps, then the parameters go up:
    ``copy + max((1 - f) T, f H) + copy``, each copy ``4 B x offloaded / host_link_bw``; on CPU
    (one memory) nothing is copied at a price and both parts run one after the other:
    ``(1 - f) T + f H``."""
    if not fraction or owned <= 0:
        return OptimizerOffloadCost()
    offloaded = fraction * owned
    device = cluster.optimizer_time_per_parameter_s
    host = getattr(cluster, "host_optimizer_time_per_parameter_s", 0.0) or device
    bandwidth = getattr(cluster, "host_link_bw", 0.0)
    device_part, host_part = (owned - offloaded) * device, offloaded * host
    if bandwidth:
        copy = OPTIMIZER_COPY_BYTES * offloaded / bandwidth
        step = 2 * copy + max(device_part, host_part)
    else:
        step = device_part + host_part
    return OptimizerOffloadCost(offloaded_elements=offloaded,
                                host_bytes=HOST_OPTIMIZER_BYTES * offloaded, step_time_s=step)


@dataclass(frozen=True)
class OptimizerOffloadTerms:
    """One component's (a layer's, the embedding's) share of a stage's optimizer offload:
    ``optimizer_offload_cost`` is linear in the owned elements, so the stage's terms are the
    sum of its components' (what the search adds up; ``evaluate_plan`` prices the stage)."""

    device_saved: float  # bytes off the persistent memory: the moments
    step_peak_saved: float  # bytes off the optimizer-step peak: moments and foreach temporary
    step_temporary: float  # the foreach temporary left on the device
    optimizer_time_s: float  # the component's step


def optimizer_offload_terms(cluster: ClusterModel, fraction: float, optimizer_states: float,
                            step_temporary: float, optimizer_time_s: float) -> \
        OptimizerOffloadTerms:
    """A component with ``optimizer_states`` bytes of AdamW moments (8 B per owned element),
    ``step_temporary`` bytes of foreach temporary and an ``optimizer_time_s`` step (the
    device's step of its owned elements plus anything after it, e.g. zero1's all-gather) under
    ``fraction`` offload."""
    owned = optimizer_states / ADAM_BYTES
    cost = optimizer_offload_cost(cluster, fraction, owned)
    if not cost.offloaded_elements:
        return OptimizerOffloadTerms(0.0, 0.0, step_temporary, optimizer_time_s)
    return OptimizerOffloadTerms(
        device_saved=fraction * optimizer_states,
        step_peak_saved=fraction * (optimizer_states + step_temporary),
        step_temporary=(1.0 - fraction) * step_temporary,
        optimizer_time_s=(optimizer_time_s - cluster.optimizer_time_per_parameter_s * owned
                          + cost.step_time_s))
