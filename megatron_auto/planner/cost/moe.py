"""Mixture of experts in the cost model: what an MoE layer's router and routed experts add to
its time and memory under expert parallelism (docs/cost_model.md §12).

An MoE layer type (``LayerType.moe``) is priced in two parts. Its profile
(``profiles.analytic_profile``) is the layer without router and routed experts: attention,
norms and, as its MLP, the shared experts (width 0 without them), priced by ``layer_time`` /
``layer_memory`` like any layer (its TP collectives without the MLP's pair when there are no
shared experts). This module adds the rest, as the runtime runs it (``models/moe.py``,
``parallel/expert_parallel.py``), for a layer of strategy ``s`` on ``n`` ranks with
``samples`` samples of ``s_len`` tokens per rank, ``T = samples * s_len`` tokens:

- The router's parameters (``E x h``, replicated over TP) are the layer's own
  (``LayerType.num_parameters``, the profile's TP-replicated ones); its fp32 compute is here.
  The routed experts (``E`` experts of ``mats * h * f`` weights) are replicated over TP and
  split over ``ep`` ranks of the DP group; the expert-DP group is the ``dp / ep`` ranks
  holding the same experts, their parameters in ``s.experts_dp_mode`` over it.
- Compute: ``T * k`` expert assignments per rank on average (dropless), each
  ``2 * mats * h * f`` FLOPs forward; with a capacity factor ``c`` at most ``c`` times that
  (``min(1, c)`` kept on average). Under ``ep > 1`` a rank computes what the ``ep`` ranks
  route to its experts, and the step waits for the busiest: the profile's measured
  ``moe_load_imbalance`` times the mean, or :data:`LOAD_IMBALANCE` without one (capped by
  ``c``). ``ep = 1`` computes its own tokens' assignments, no imbalance.
- Communication, on the EP group (``ep`` consecutive members of the layer's DP group): forward
  one ``all_to_all`` of the per-expert counts (``E`` int64) and two of the tokens (dispatch and
  combine, ``T * k * h`` elements in the compute dtype each), backward the two token exchanges
  reversed; not overlapped (the experts wait for their tokens). Full recompute re-runs the
  forward's three. The busiest rank's bytes set the time.
- Expert TP (``expert_tp = t > 1``, ``expert_layout``: ``t`` consecutive members of the layer's
  TP group, which hold the same tokens): each expert's fc1 rows and fc2 columns are split over
  the ``t`` ranks, so a rank computes ``1/t`` of every assignment's expert FLOPs, holds ``1/t``
  of the experts' parameters and of their fc1/activation outputs. The partial fc2 outputs of
  the tokens the rank's experts received are all-reduced over the expert-TP group in forward,
  the experts' input gradients in backward (one ``all_reduce`` of ``T * k * h`` elements each
  way, the busiest rank's bytes; full recompute re-runs the forward's). The EP exchanges are
  the same on every member (each moves the same tokens).
- Memory: the experts' model states (``memory_model.model_states`` over the expert-DP
  group), the kept activations per assignment (the experts' input, fc1 output, activation
  output and the output the combine weights multiply) and per token (the router's fp32 input,
  logits and probabilities), autocast's copies of the expert weights, and in backward the
  gradients of those and the exchange buffers (transient).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ...layout import Collective, Layout, dp_group_consecutive
from ..inputs.model_spec import ExpertSpec, LayerType
from ..inputs.profile_records import LayerTypeProfile
from .memory_model import (ADAM_BYTES, STEP_TEMP_BYTES, MemoryCost, lazy_gradients,
                           model_states)
from .time_model import (DataParallelCollectives, TimeCost, _dp_times, collective_time,
                         dp_collectives, overlap, zero_slowdown)

# The busiest EP rank's expert load over the mean under ep > 1 when the profile has no
# measured one (analytic profiles): a router trained with a load-balancing loss;
# Switch/GShard-style training keeps it near 1.1-1.3. A measured profile's
# ``moe_load_imbalance`` (the profiler's router on its batch) replaces it.
LOAD_IMBALANCE = 1.2
COUNT_BYTES = 8  # the per-expert counts exchanged before the tokens: int64
FP32 = 4
# Kernel launches of the routing, sort, dispatch and combine per forward (about 20 small ops).
MOE_CALL_OVERHEAD_S = 40e-6


def expert_parameters(moe: ExpertSpec, layer_type: LayerType) -> int:
    """Weights of all routed experts of one MoE layer (no biases)."""
    mats = 3 if layer_type.activation == "swiglu" else 2
    return moe.num_experts * mats * layer_type.hidden_size * moe.ffn_hidden_size


def load_factors(moe: ExpertSpec, ep: int, measured: float = 0.0) -> tuple[float, float]:
    """``(mean, busiest)`` kept assignments per rank over ``T * k`` (module docstring); the
    busiest at ``measured`` (the profile's ``moe_load_imbalance``) when given, else
    :data:`LOAD_IMBALANCE`."""
    c = moe.capacity_factor
    mean = min(1.0, c) if c else 1.0
    if ep == 1:
        return mean, mean
    imbalance = measured if measured > 0 else LOAD_IMBALANCE
    return mean, min(imbalance, c) if c else imbalance


def ep_group(layout: Layout, ep: int, stage_size: int) -> tuple[bool, int]:
    """``(consecutive, span)`` of an EP group (``expert_layout``: ``ep`` consecutive members of
    the layer's DP group): adjacent ranks when the DP group is (tp 1 or strided TP), else
    members ``tp`` apart over ``ep * tp`` adjacent ranks."""
    if dp_group_consecutive(layout) or ep == 1:
        return True, 0
    return False, ep * layout.tp


def expert_dp_group(layout: Layout, ep: int, stage_size: int) -> tuple[bool, int]:
    """``(consecutive, span)`` of an expert-DP group (members ``ep`` apart in the DP group)."""
    adjacent = dp_group_consecutive(layout)
    if ep == 1:
        return adjacent, 0
    dp = stage_size // layout.tp
    return False, (dp if adjacent else 0)


def moe_collectives(layer_type: LayerType, strategy: Any, layout: Layout, stage_size: int,
                    samples: float, compute_bytes: int, *, load: float | None = None
                    ) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """``(forward, backward)`` EP all-to-alls of one rank for one micro-batch (none at
    ``ep = 1``): counts, dispatch, combine forward; the two token exchanges reversed backward;
    full recompute repeats the forward's in backward. Token bytes at ``load`` times ``T * k``
    assignments (default: the mean, :func:`load_factors`)."""
    moe = layer_type.moe
    ep, etp = strategy.ep, strategy.expert_tp
    if moe is None or (ep == 1 and etp == 1):
        return (), ()
    factor = load_factors(moe, ep)[0] if load is None else load
    tokens = samples * layer_type.seq_length * moe.topk * factor
    payload = float(tokens * layer_type.hidden_size * compute_bytes)
    forward: tuple[Collective, ...] = ()
    backward: tuple[Collective, ...] = ()
    if ep > 1:
        consecutive, span = ep_group(layout, ep, stage_size)
        counts = Collective("all_to_all", ep, consecutive, float(COUNT_BYTES * moe.num_experts),
                            span)
        moved = Collective("all_to_all", ep, consecutive, payload, span)
        forward, backward = (counts, moved, moved), (moved, moved)
    if etp > 1:  # between the dispatch and the combine: the experts' output, their input grad
        adjacent, spread = expert_tp_group(layout, etp, stage_size)
        reduce = Collective("all_reduce", etp, adjacent, payload, spread)
        forward = forward[:2] + (reduce,) + forward[2:]
        backward = backward[:1] + (reduce,) + backward[1:]
    return forward, (forward if strategy.recompute is True else ()) + backward


def expert_tp_group(layout: Layout, etp: int, stage_size: int) -> tuple[bool, int]:
    """``(consecutive, span)`` of an expert-TP group (``expert_layout``: ``etp`` consecutive
    members of the layer's TP group): adjacent ranks under a consecutive TP layout, else members
    ``dp`` apart over ``etp * dp`` adjacent ranks (the stage when ``etp`` is the whole TP)."""
    if layout.consecutive:
        return True, 0
    dp = stage_size // layout.tp
    return False, (0 if etp == layout.tp else etp * dp)


@dataclass(frozen=True)
class ExpertTerms:
    """What :func:`expert_costs` adds to an MoE layer: memory and time in the units of
    ``memory_model.MemoryCost`` and ``time_model.TimeCost``, and whether its expert
    parameters are FSDP2-sharded (fused AdamW then keeps its temporaries)."""

    memory: MemoryCost
    time: TimeCost
    sharded: bool


def expert_costs(profile: LayerTypeProfile, layer_type: LayerType, cluster: Any,
                 strategy: Any, layout: Layout, stage_size: int, samples: float,
                 precision: str, *, first_backward_peak: bool = False) -> ExpertTerms:
    """The router's and routed experts' memory and time for one micro-batch of ``samples``
    samples per rank (module docstring). ``profile`` gives the backward/forward ratio and the
    autocast weight-copy bytes."""
    moe = layer_type.moe
    assert moe is not None, "expert_costs prices MoE layer types only"
    s = strategy
    n, tp, ep, etp = stage_size, layout.tp, s.ep, s.expert_tp
    dp = n // tp
    edp = dp // ep
    beta = 4 if precision == "fp32" else 2
    h, f, k, e = layer_type.hidden_size, moe.ffn_hidden_size, moe.topk, moe.num_experts
    mats = 3 if layer_type.activation == "swiglu" else 2
    fc1 = (2 if mats == 3 else 1) * f
    mean, busiest = load_factors(moe, ep, profile.moe_load_imbalance)
    tokens = samples * layer_type.seq_length
    a_mean, a_busy = tokens * k * mean, tokens * k * busiest
    recompute = s.recompute is True
    # ----------------------------------------------------------------- time
    rate = cluster.flops(precision)
    fwd = (a_busy * 2 * mats * h * f / etp / rate + tokens * 2 * h * e / cluster.flops("fp32")
           + MOE_CALL_OVERHEAD_S)
    hbm = float(getattr(cluster, "hbm_bandwidth", 0.0))
    if hbm > 0:  # the token gather before and the weighted index_add after the experts
        fwd += 4 * beta * a_mean * h / hbm
    r = profile.backward_forward_ratio
    bwd = r * fwd + (fwd if recompute else 0.0)
    fwd_c, bwd_c = moe_collectives(layer_type, s, layout, n, samples, beta, load=busiest)
    a2a_f = sum(collective_time(cluster, c, n) for c in fwd_c)
    a2a_b = sum(collective_time(cluster, c, n) for c in bwd_c)
    local_e = expert_parameters(moe, layer_type) / (ep * etp)
    e_consec, e_span = expert_dp_group(layout, ep, n)
    cs = expert_dp_collectives(local_e, edp, s.experts_dp_mode, e_consec, e_span, precision)
    gather, scatter, allreduce, regather, after_step = _dp_times(
        cluster, local_e, edp, s.experts_dp_mode, e_consec, n, precision, cs)
    gz, g = zero_slowdown(cluster), cluster.overlap_slowdown
    forward = overlap(gather, fwd, gz) + a2a_f
    backward = overlap(gather + scatter, bwd, gz) + a2a_b
    exposed = overlap(allreduce, bwd, g) - bwd if allreduce > 0 else 0.0
    exposed += overlap(regather, fwd, gz) - fwd if regather > 0 else 0.0
    step = cluster.optimizer_time_per_parameter_s * _owned(local_e, edp, s.experts_dp_mode)
    time = TimeCost(forward, backward, allreduce + regather, exposed, fwd + bwd, 0.0,
                    2 * gather + scatter, step + after_step, ep_comm=a2a_f + a2a_b)
    # --------------------------------------------------------------- memory
    params, grads, optim, states_transient = model_states(local_e, s.experts_dp_mode, edp)
    copies = profile.weight_copy_bytes_per_parameter * local_e
    # per assignment: experts' input, fc1 output, activation output (fc2 input) on the
    # computing rank; the returned output the combine weights multiply on the routing rank
    kept = (beta * (h + (fc1 + f) / etp) * a_busy + beta * h * a_mean
            + FP32 * (h + 2 * e) * tokens + copies)
    # backward: the fc1 output's gradient and the exchanged token gradients (in and out)
    scratch = beta * (fc1 / etp + 2 * h) * a_busy + (2 * beta * h * a_busy if ep > 1 else 0.0)
    transient = scratch + states_transient + (kept if recompute else 0.0)
    keep = 0.0 if recompute else kept
    step_temp = STEP_TEMP_BYTES * optim / ADAM_BYTES
    lazy = grads if first_backward_peak and lazy_gradients(s.experts_dp_mode, edp) else 0.0
    transient += min(keep, lazy)
    memory = MemoryCost(params, grads, optim, keep, transient, lazy_gradients=lazy,
                        step_temporary=step_temp,
                        sync_transient=fsdp_sync_bytes(local_e, s.experts_dp_mode, edp, beta))
    sharded = s.experts_dp_mode in ("zero2", "zero3") and edp > 1
    return ExpertTerms(memory, time, sharded)


def metrics_collective(spec: Any, world_size: int) -> Collective | None:
    """The step's MoE statistics all-reduce (``training/moe_metrics.py``): one float64 row of
    ``E + 3`` numbers (tokens per expert, balance and z-loss sums, sequences) per MoE layer of
    the model, over every rank, once per iteration. None without MoE layers or on one rank."""
    moe_types = [t for t in spec.layer_order if spec.layer_types[t].moe is not None]
    if not moe_types or world_size <= 1:
        return None
    experts = spec.layer_types[moe_types[0]].moe.num_experts
    return Collective("all_reduce", world_size, True, float(8 * len(moe_types) * (experts + 3)))


def fsdp_sync_bytes(num_params: float, dp_mode: str, dp: int, compute_bytes: int) -> float:
    """Bytes FSDP2 holds for a unit of ``num_params`` local parameters at the end of the
    backward pass (``MemoryCost.sync_transient``, ``zero2``/``zero3`` over ``dp > 1``): the
    gradient buffers of two units, each the unsharded gradient (compute dtype) and the fp32
    reduce-scatter input it is copied into -- FSDP2 keeps one unit's reduce-scatter state until
    the next unit's reduce-scatter. Measured on the experts' units
    (tests/test_moe_memory_estimate.py): four times the unit's fp32 bytes at fp32 under both
    modes (zero3 over 2 ranks 3.95, over 4 ranks 3.64)."""
    if dp <= 1 or dp_mode not in ("zero2", "zero3"):
        return 0.0
    return 2 * (compute_bytes + FP32) * num_params


def expert_dp_collectives(num_params: float, edp: int, dp_mode: str, consecutive: bool,
                          span: int, precision: str) -> DataParallelCollectives:
    """``time_model.dp_collectives`` of the local experts over their expert-DP group of
    ``edp`` ranks (placed over ``span`` adjacent ranks; 0: the stage)."""
    cs = dp_collectives(num_params, edp, dp_mode, consecutive, precision)
    if not span:
        return cs
    return DataParallelCollectives(*(tuple(replace(c, span=span) for c in part) for part in (
        cs.forward, cs.backward, cs.per_iteration, cs.after_step)))


def _owned(num_params: float, dp: int, dp_mode: str) -> float:
    return num_params / dp if dp_mode in ("zero1", "zero2", "zero3") and dp > 1 else num_params


def add_memory(a: MemoryCost, b: MemoryCost) -> MemoryCost:
    """Two parts of one layer: every term adds (the transients too, an upper bound: the
    experts' backward and the attention's do not run at once, but their states' transients
    can meet)."""
    return MemoryCost(*(getattr(a, f.name) + getattr(b, f.name) for f in fields(MemoryCost)))


def with_experts(memory: MemoryCost, time: TimeCost, profile: LayerTypeProfile,
                 layer_type: LayerType, cluster: Any, strategy: Any, layout: Layout,
                 stage_size: int, samples: float, precision: str, *,
                 first_backward_peak: bool = False) -> tuple[MemoryCost, TimeCost, bool]:
    """``(memory, time, experts sharded)`` of a whole layer from its priced dense part: the
    dense part unchanged for a dense layer type, else plus :func:`expert_costs`."""
    if layer_type.moe is None:
        return memory, time, False
    terms = expert_costs(profile, layer_type, cluster, strategy, layout, stage_size, samples,
                         precision, first_backward_peak=first_backward_peak)
    return add_memory(memory, terms.memory), time + terms.time, terms.sharded


def has_mlp(layer_type: LayerType) -> bool:
    """Whether the layer has a dense (TP-split) MLP: every dense layer, and an MoE layer with
    shared experts (``ffn_hidden_size`` their width)."""
    return layer_type.moe is None or layer_type.ffn_hidden_size > 0
