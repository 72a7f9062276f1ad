"""Named cost arrays of one task's candidate strategies (no positional columns, no tuples).

For a task (pipeline degree, micro-batches, schedule) every layer type gets, at every stage
position (the micro-batches in flight differ per position), a :class:`StrategyCosts`: one array
per priced quantity over the strategy axis ``s``, each computed by the cost model's own
per-layer functions (``cost_memory.layer_memory``, ``cost_time.layer_time``). The embedding and
head of a first/last stage get an :class:`EmbeddingCosts` the same way. The search only adds
these up the way ``cost_model.evaluate_plan`` does; it never re-derives a formula.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields

import numpy as np

from ...plan import LayerStrategy, VocabStrategy
from ..inputs.cluster_model import ClusterModel
from ..inputs.model_spec import LayerType
from ..cost.memory_model import MemoryCost, embedding_memory, layer_memory
from ..cost.time_model import TimeCost, embedding_time, layer_time
from ..cost.recompute import NONE as NONE_RECOMPUTED, module_terms
from ..cost.moe import has_mlp, with_experts
from ..cost.offload import (apply_offload_memory, apply_offload_time, offload_cost,
                            optimizer_offload_terms)
from ..inputs.profile_records import EmbeddingProfile, LayerTypeProfile
from ..inputs.profiles import dropout_mask_bytes
from ...layout import Layout, layout_of


@dataclass(frozen=True)
class StrategyCosts:
    """Arrays over ``s`` for one layer type at one stage position of a task.

    Times in seconds: ``forward``/``backward`` per micro-batch (the layer's own TP and ZeRO
    communication included), ``exposed_sync`` and ``optimizer`` once per iteration. Memory in
    bytes per rank, as ``evaluate_plan`` charges it: ``persistent`` at this position's
    micro-batches in flight and ``transient`` while the layer runs, each with the allocator's
    fragmentation share of its activations (a GPU term, linear, so it folds in exactly);
    ``step_peak`` during the optimizer step, and ``step_floor`` the least it can add to a
    stage's step peak (less the foreach temporaries that fused AdamW drops when nothing of the
    stage is sharded). ``sharded``: ZeRO-2/3 over more than one replica (1.0) or not (0.0).
    """

    strategies: tuple[LayerStrategy, ...]
    # each strategy's class: its layout and whether it runs sequence parallelism (transitions
    # depend on both)
    layouts: tuple[tuple[Layout, bool], ...]
    forward: np.ndarray
    backward: np.ndarray
    exposed_sync: np.ndarray
    optimizer: np.ndarray
    persistent: np.ndarray
    transient: np.ndarray
    step_peak: np.ndarray
    step_floor: np.ndarray
    step_temporary: np.ndarray
    sharded: np.ndarray
    # host bytes at this position's micro-batches in flight (activation offload)
    host: np.ndarray

    @property
    def microbatch(self) -> np.ndarray:
        return self.forward + self.backward

    def __len__(self) -> int:
        return len(self.strategies)

    @functools.cached_property
    def position(self) -> dict[LayerStrategy, int]:
        """Each strategy's index (a dict: ``strategies.index`` compares dataclasses one by
        one, a million comparisons in GPT-3's uniform seeds)."""
        return {st: i for i, st in enumerate(self.strategies)}

    def take(self, index: np.ndarray) -> "StrategyCosts":
        """The strategies at ``index`` (in that order)."""
        idx = [int(i) for i in index]
        return StrategyCosts(
            strategies=tuple(self.strategies[i] for i in idx),
            layouts=tuple(self.layouts[i] for i in idx),
            **{f.name: getattr(self, f.name)[idx] for f in fields(self)
               if f.name not in ("strategies", "layouts")})


@dataclass(frozen=True)
class EmbeddingCosts:
    """The embedding (first stage) and/or head (last stage) of one stage; zeros in between."""

    forward: float = 0.0
    backward: float = 0.0
    exposed_sync: float = 0.0
    optimizer: float = 0.0
    persistent: float = 0.0
    transient: float = 0.0
    step_peak: float = 0.0
    step_floor: float = 0.0
    step_temporary: float = 0.0
    sharded: bool = False

    @property
    def microbatch(self) -> float:
        return self.forward + self.backward


_COLUMNS = ("forward", "backward", "exposed_sync", "optimizer", "persistent", "transient",
            "step_peak", "step_floor", "step_temporary", "sharded", "host")

# A strategy's key: (strategy, stage size, micro-batch size, in flight, schedule, precision,
# SP-reduced norm bytes); its layer terms' key leaves out the micro-batches in flight.
StrategyKey = tuple[LayerStrategy, int, int, int, str, str, tuple[float, ...]]
LayerKey = tuple[LayerStrategy, int, int, str, str, tuple[float, ...]]
Row = tuple[tuple[Layout, bool], tuple[float, ...]]  # a strategy's class and _COLUMNS values


@dataclass
class PricedStrategies:
    """One layer type's priced strategies on one cluster (a search's ``SearchCache`` holds
    one per layer type): ``rows`` per :data:`StrategyKey`, and the layer's memory terms and
    times, which do not depend on the micro-batches in flight, per :data:`LayerKey`."""

    rows: dict[StrategyKey, Row] = field(default_factory=dict)
    layers: dict[LayerKey, tuple[MemoryCost, TimeCost, bool]] = field(default_factory=dict)


def strategy_costs(profile: LayerTypeProfile, cluster: ClusterModel,
                   strategies: list[LayerStrategy], stage_size: int, microbatch_size: int,
                   in_flight: int, schedule: str, precision: str,
                   norm_grad_bytes: tuple[float, ...] = (),
                   memo: PricedStrategies | None = None,
                   layer_type: LayerType | None = None,
                   optimizer_offload: float = 0.0) -> StrategyCosts:
    """Price every strategy of one layer type (``evaluate_plan``'s per-layer terms).
    ``norm_grad_bytes``: ``cost_model.sp_reduced_tensor_bytes`` of the type, all-reduced by its
    sequence-parallel strategies. ``memo``: this type's earlier prices on this cluster (the
    search's cache), read and extended; None prices everything afresh. ``layer_type``: the
    ``LayerType`` the module-recompute strategies need (``cost/recompute.py``).
    ``optimizer_offload``: the task's ``pipeline.optimizer_offload_fraction`` (its terms are
    linear in each layer's owned elements: ``cost/offload.optimizer_offload_terms``)."""
    n = stage_size
    memo = PricedStrategies() if memo is None else memo
    rows = []
    norms = tuple(norm_grad_bytes)
    for s in strategies:
        key = (s, n, microbatch_size, in_flight, schedule, precision, norms)
        if optimizer_offload:
            key += (optimizer_offload,)  # type: ignore[assignment]
        row = memo.rows.get(key)
        if row is None:
            row = memo.rows[key] = _price(profile, cluster, s, n, microbatch_size, in_flight,
                                          schedule, precision, norms, memo, layer_type,
                                          optimizer_offload)
        rows.append(row)
    return StrategyCosts(strategies=tuple(strategies), layouts=tuple(r[0] for r in rows),
                         **{k: np.array([r[1][j] for r in rows], dtype=float)
                            for j, k in enumerate(_COLUMNS)})


def _price(profile: LayerTypeProfile, cluster: ClusterModel, s: LayerStrategy, n: int,
           microbatch_size: int, in_flight: int, schedule: str, precision: str,
           norm_grad_bytes: tuple[float, ...], memo: PricedStrategies,
           layer_type: LayerType | None = None, optimizer_offload: float = 0.0) -> Row:
    """One strategy's class and its ``_COLUMNS`` values."""
    frag = fragmentation_of(cluster)
    fused = bool(getattr(cluster, "fused_optimizer", False))
    layout = layout_of(s, n)
    dp = n // s.tp
    sp = s.sequence_parallel and s.tp > 1
    # The layer's memory terms and times do not depend on the micro-batches in flight: priced
    # once for every stage position (memo.layers).
    key = (s, n, microbatch_size, schedule, precision, norm_grad_bytes)
    if key not in memo.layers:
        samples = microbatch_size / dp
        beta = 4 if precision == "fp32" else 2
        mod = NONE_RECOMPUTED
        # ring CP keeps no scores: there is no core attention to recompute (evaluate_plan)
        modules = s.recompute_modules - ({"core_attn"} if s.cp > 1 else set())
        if modules:
            if layer_type is None:
                raise ValueError("module recompute strategies need the layer_type to price")
            mod = module_terms(profile, layer_type, modules, s.tp, samples, beta,
                               dropout_mask_bytes(cluster, beta))
        dense = (
            layer_memory(profile, s.tp, dp, s.dp_mode, s.full_recompute, samples,
                         first_backward_peak=schedule == "gpipe", sequence_parallel=sp,
                         cp=s.cp, cp_mode=s.cp_mode, compute_bytes=beta,
                         released_bytes=mod.released_bytes,
                         rebuilt_bytes=mod.largest_module_bytes),
            layer_time(profile, cluster, layout, s.dp_mode, s.full_recompute, samples, n,
                       precision, sequence_parallel=sp,
                       norm_grad_bytes=norm_grad_bytes if sp else (), cp_mode=s.cp_mode,
                       recompute_forward_s=mod.forward_time_s,
                       recompute_modules=s.recompute_modules,
                       mlp=layer_type is None or has_mlp(layer_type)))
        if layer_type is not None:  # MoE layers: the router and routed experts on top
            priced = with_experts(*dense, profile, layer_type, cluster, s, layout, n, samples,
                                  precision, first_backward_peak=schedule == "gpipe")
            # activation offload (layers[i].offload), as evaluate_plan prices it
            moved = offload_cost(s, profile, layer_type, cluster, samples,
                                 priced[0].activations_per_microbatch, beta,
                                 dropout_mask_bytes(cluster, beta))
            memo.layers[key] = (apply_offload_memory(priced[0], moved),
                                apply_offload_time(priced[1], moved), priced[2])
        else:
            if s.offload is not False:
                raise ValueError("activation offload strategies need the layer_type to price")
            memo.layers[key] = (*dense, False)
    mem, t, experts_sharded = memo.layers[key]
    off = optimizer_offload_terms(cluster, optimizer_offload, mem.optimizer_states,
                                  mem.step_temporary, t.optimizer)
    step_peak = mem.step_peak - off.step_peak_saved
    # evaluate_plan sums parameters + gradients_at_peak + optimizer states and
    # in_flight x activations per layer; persistent() is that sum (no early release here).
    return (layout, sp), (
        t.forward, t.backward, t.exposed_sync, off.optimizer_time_s,
        mem.persistent(in_flight) + frag * in_flight * mem.activations_per_microbatch
        - off.device_saved,
        (1 + frag) * mem.transient, step_peak,
        step_peak - (off.step_temporary if fused else 0.0),
        off.step_temporary if fused else 0.0,
        float(experts_sharded or (s.dp_mode in ("zero2", "zero3") and dp > 1)),
        in_flight * mem.host_per_microbatch)


def embedding_costs(profile: EmbeddingProfile, cluster: ClusterModel, vocab: VocabStrategy,
                    stage_size: int, microbatch_size: int, in_flight: int, schedule: str,
                    first: bool, last: bool, pp: int, seq_length: int,
                    precision: str, optimizer_offload: float = 0.0) -> EmbeddingCosts:
    """Price the embedding/head of a stage (zeros when it is neither first nor last) under
    the task's optimizer offload fraction."""
    if not (first or last):
        return EmbeddingCosts()
    dp = stage_size // vocab.tp
    samples = microbatch_size / dp
    mem = embedding_memory(profile, vocab.tp, dp, vocab.dp_mode, samples, first, last, pp,
                           first_backward_peak=schedule == "gpipe")
    t = embedding_time(profile, cluster, vocab.tp, vocab.dp_mode, samples, stage_size, first,
                       last, pp, seq_length, precision)
    frag = fragmentation_of(cluster)
    fused = bool(getattr(cluster, "fused_optimizer", False))
    off = optimizer_offload_terms(cluster, optimizer_offload, mem.optimizer_states,
                                  mem.step_temporary, t.optimizer)
    temp = off.step_temporary if fused else 0.0
    step_peak = mem.step_peak - off.step_peak_saved
    return EmbeddingCosts(forward=t.forward, backward=t.backward, exposed_sync=t.exposed_sync,
                          optimizer=off.optimizer_time_s,
                          persistent=mem.persistent(in_flight)
                          + frag * (in_flight * mem.activations_per_microbatch
                                    + mem.held_in_backward) - off.device_saved,
                          transient=(1 + frag) * mem.transient, step_peak=step_peak,
                          step_floor=step_peak - temp, step_temporary=temp,
                          sharded=vocab.dp_mode in ("zero2", "zero3") and dp > 1)


def fragmentation_of(cluster: ClusterModel) -> float:
    """The allocator fragmentation fraction ``evaluate_plan`` charges (0 where not modelled)."""
    return float(getattr(cluster, "fragmentation_fraction", 0.0))


def prune_dominated(costs: StrategyCosts) -> np.ndarray:
    """Indices of the strategies no other strategy of the same class (layout and sequence
    parallelism) dominates (rule 5).

    ``j`` dominates ``i`` when it is no worse in every quantity: forward, backward, exposed sync,
    optimizer step, persistent, transient and step-peak memory, host bytes (activation
    offload: the host budget is a second constraint), and both are sharded or both
    not (a sharded layer makes fused AdamW keep its temporaries for the whole stage). Exact: the iteration time of
    ``cost_time.pipeline_time`` does not decrease when a stage's forward, backward, tail or step
    grows (a longer backward hides more of a later stage's tail, but lengthens the pipeline by
    at least as much), stage memory is a sum and maxima of these terms, and transitions depend
    only on the class. Ties keep the first.
    """
    keys = np.stack([costs.forward, costs.backward, costs.exposed_sync, costs.optimizer,
                     costs.persistent, costs.transient, costs.step_peak, costs.step_floor,
                     costs.host], axis=1)  # (s, q)
    n = len(costs)
    codes = {(lay, sh): c for c, (lay, sh) in
             enumerate(sorted(set(zip(costs.layouts, costs.sharded.tolist()))))}
    layout = np.array([codes[key] for key in zip(costs.layouts, costs.sharded.tolist())])
    no_worse = (keys[:, None, :] <= keys[None, :, :]).all(axis=2)      # [j, i]
    better = (keys[:, None, :] < keys[None, :, :]).any(axis=2)
    earlier = np.arange(n)[:, None] < np.arange(n)[None, :]
    dominates = no_worse & (better | earlier) & (layout[:, None] == layout[None, :])
    np.fill_diagonal(dominates, False)
    return np.nonzero(~dominates.any(axis=0))[0].astype(np.int64)
