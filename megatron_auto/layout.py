"""Layout arithmetic: who holds which batch slice, which ranks form groups, what a relayout moves.

The one source of these rules for the planner's cost model and the runtime (docs/design.md §4); pure
Python, no torch. A pipeline stage has ``n`` ranks, known inside it by their *local index*
``j``. A layout is a TP degree ``tp`` (dividing ``n``) and a TP rank order:

- consecutive: TP groups are blocks of ``tp`` adjacent indices, ``tp_rank = j % tp`` and
  ``dp_rank = j // tp``; a DP group is every ``tp``-th index with the same ``tp_rank``.
- strided: the TP group of ``j`` is ``{j % dp + k*dp}`` (members ``dp = n/tp`` apart),
  ``tp_rank = j // dp`` and ``dp_rank = j % dp``; DP groups are blocks of ``dp`` adjacent indices.

With ``tp`` equal to 1 or ``n`` both orders give the same groups; :func:`make_layout`
normalises those to consecutive so that equal layouts compare equal.

Activations are split along the batch: DP replica ``dp_rank`` holds the contiguous slice
``dp_rank`` of ``dp`` equal slices of the micro-batch, the same on every rank of its TP group.

A relayout from ``src`` to ``dst`` (:func:`relayout_step`) is what the runtime
(``parallel/redistribute.py``) executes and the cost model (``planner/cost/time_model.py``) prices:

- if both layouts give every rank the same slice: nothing;
- if every rank's ``dst`` slice lies inside its ``src`` slice: a local slice, no communication;
- if the ``src`` slices held by each rank's ``dst`` TP group are, in TP order, exactly its
  ``dst`` slice (from ``tp = 1`` into consecutive TP, for instance): one all-gather over that
  group, which moves only the new slice;
- otherwise one all-gather over the rank's ``src`` DP group (which holds one replica of every
  ``src`` slice, in slice order: the whole micro-batch), then the ``dst`` slice of it.

Backward re-lays the gradient out the other way (``dst`` to ``src``): every ``dst`` holder has
the complete gradient of its slice (TP layers all-reduce input gradients), so that is again a
relayout by the same rule. :func:`relayout_collectives` lists the
collectives of both directions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from .plan import Plan


class Layout(NamedTuple):
    """A TP degree and rank order inside a stage; build it with :func:`make_layout`."""

    tp: int
    consecutive: bool


def _check_tp(tp: int, stage_size: int) -> None:
    if not isinstance(tp, int) or tp < 1 or stage_size % tp:
        raise ValueError(f"tp={tp}: must be a positive divisor of the {stage_size} ranks per stage")


def make_layout(tp: int, consecutive: bool, stage_size: int) -> Layout:
    """The normalised layout: ``consecutive`` is True when ``tp`` is 1 or ``stage_size``."""
    _check_tp(tp, stage_size)
    return Layout(tp, bool(consecutive) or tp in (1, stage_size))


def layout_of(strategy: Any, stage_size: int) -> Layout:
    """The layout of anything with ``tp`` and ``tp_consecutive`` (a ``plan.LayerStrategy``)."""
    return make_layout(strategy.tp, strategy.tp_consecutive, stage_size)


def vocab_layout(vocab_tp: int, stage_size: int) -> Layout:
    """The embedding's and LM head's layout: vocab TP groups are always consecutive."""
    return make_layout(vocab_tp, True, stage_size)


def dp_size(layout: Layout, stage_size: int) -> int:
    return stage_size // layout.tp


def tp_dp_rank(local_index: int, stage_size: int, tp: int, consecutive: bool) -> tuple[int, int]:
    """``(tp_rank, dp_rank)`` of local index ``local_index`` under a layout."""
    dp = stage_size // tp
    if consecutive:
        return local_index % tp, local_index // tp
    return local_index // dp, local_index % dp


def tp_group_ranks(stage_ranks: Sequence[int], tp: int, consecutive: bool) -> list[list[int]]:
    """Ranks of every TP group of a stage (indexed by ``dp_rank``), each ordered by ``tp_rank``."""
    n = len(stage_ranks)
    _check_tp(tp, n)
    dp = n // tp
    if consecutive:
        return [[stage_ranks[d * tp + t] for t in range(tp)] for d in range(dp)]
    return [[stage_ranks[d + t * dp] for t in range(tp)] for d in range(dp)]


def dp_group_ranks(stage_ranks: Sequence[int], tp: int, consecutive: bool) -> list[list[int]]:
    """Ranks of every DP group of a stage (indexed by ``tp_rank``), each ordered by ``dp_rank``."""
    n = len(stage_ranks)
    _check_tp(tp, n)
    dp = n // tp
    if consecutive:
        return [[stage_ranks[d * tp + t] for d in range(dp)] for t in range(tp)]
    return [[stage_ranks[d + t * dp] for d in range(dp)] for t in range(tp)]


def tp_group_consecutive(layout: Layout) -> bool:
    """Whether TP groups are blocks of adjacent ranks (the cluster model's ``consecutive``)."""
    return layout.consecutive


def dp_group_consecutive(layout: Layout) -> bool:
    """Whether DP groups are blocks of adjacent ranks: TP is 1 (the group is the stage) or
    strided (DP groups are then the blocks)."""
    return layout.tp == 1 or not layout.consecutive


def batch_slice(local_index: int, stage_size: int, layout: Layout) -> tuple[int, int]:
    """``(index, count)``: rank ``local_index`` holds slice ``index`` of ``count`` equal slices."""
    return tp_dp_rank(local_index, stage_size, layout.tp, layout.consecutive)[1], \
        stage_size // layout.tp


@functools.lru_cache(maxsize=None)
def batch_slices(layout: Layout, stage_size: int) -> tuple[tuple[int, int], ...]:
    """:func:`batch_slice` of every local index, in index order."""
    return tuple(batch_slice(j, stage_size, layout) for j in range(stage_size))


def slice_bounds(index: int, count: int, batch: int) -> tuple[int, int]:
    """``[start, stop)`` of slice ``index`` of ``count`` in a batch of ``batch`` samples."""
    if batch % count:
        raise ValueError(f"micro-batch of {batch} samples is not divisible by the {count} "
                         f"data-parallel replicas")
    per = batch // count
    return index * per, (index + 1) * per


@functools.lru_cache(maxsize=None)
def relayout_is_local(src: Layout, dst: Layout, stage_size: int) -> bool:
    """True when every rank's ``dst`` slice lies inside its ``src`` slice."""
    for (i_src, n_src), (i_dst, n_dst) in zip(batch_slices(src, stage_size),
                                               batch_slices(dst, stage_size)):
        # slice i of n covers [i/n, (i+1)/n): containment in integer arithmetic
        if not (i_src * n_dst <= i_dst * n_src and (i_dst + 1) * n_src <= (i_src + 1) * n_dst):
            return False
    return True


@dataclass(frozen=True)
class RelayoutStep:
    """What one rank does to move its ``src`` slice to its ``dst`` slice (one direction).

    ``gather``: all-gather first over ``gather_on`` (``"src_dp"``: the rank's ``src`` DP group,
    which yields the whole micro-batch; ``"dst_tp"``: its ``dst`` TP group, whose members' ``src``
    slices make up exactly its ``dst`` slice), ``gather_group`` the group's local indices in
    gather order. Then keep part ``keep_index`` of ``keep_count`` equal parts of what the rank
    holds (``(0, 1)``: all of it; with no gather, the input itself, nothing to do).
    """

    gather: bool
    gather_group: tuple[int, ...]
    keep_index: int
    keep_count: int
    gather_on: str = ""

    @property
    def is_identity(self) -> bool:
        return not self.gather and self.keep_count == 1


@functools.lru_cache(maxsize=None)
def _dst_tp_gather_delivers(src: Layout, dst: Layout, stage_size: int) -> bool:
    """True when, for every rank, the ``src`` slices of its ``dst`` TP group, in TP order, are
    its ``dst`` slice (from ``tp = 1``, e.g., into consecutive TP: then a gather over that small
    group moves ``b/dp_dst`` samples instead of the whole micro-batch)."""
    groups = tp_group_ranks(range(stage_size), dst.tp, dst.consecutive)
    for j in range(stage_size):
        i_dst, n_dst = batch_slice(j, stage_size, dst)
        members = groups[i_dst]
        held = [batch_slice(g, stage_size, src) for g in members]
        if any(n_src != n_dst * len(members) for _, n_src in held):
            return False
        if [i for i, _ in held] != [i_dst * len(members) + k for k in range(len(members))]:
            return False
    return True


@functools.lru_cache(maxsize=None)
def relayout_step(src: Layout, dst: Layout, stage_size: int, local_index: int) -> RelayoutStep:
    """The runtime's relayout for rank ``local_index``: identity, local slice, or a gather (over
    the ``dst`` TP group when that delivers exactly the new slice, else over the ``src`` DP
    group) followed by the slice. The branch depends only on the two layouts, so every rank of
    the stage takes the same one.
    """
    i_src, n_src = batch_slice(local_index, stage_size, src)
    i_dst, n_dst = batch_slice(local_index, stage_size, dst)
    if batch_slices(src, stage_size) == batch_slices(dst, stage_size):
        return RelayoutStep(False, (), 0, 1)
    if relayout_is_local(src, dst, stage_size):
        parts = n_dst // n_src
        return RelayoutStep(False, (), i_dst % parts, parts)
    if _dst_tp_gather_delivers(src, dst, stage_size):
        group = tp_group_ranks(range(stage_size), dst.tp, dst.consecutive)[i_dst]
        return RelayoutStep(True, tuple(group), 0, 1, "dst_tp")
    tp_rank = tp_dp_rank(local_index, stage_size, src.tp, src.consecutive)[0]
    group = dp_group_ranks(range(stage_size), src.tp, src.consecutive)[tp_rank]
    return RelayoutStep(True, tuple(group), i_dst, n_dst, "src_dp")


def gathered_fraction(src: Layout, step: RelayoutStep, stage_size: int) -> float:
    """The part of the micro-batch a gathering step's output holds (its members' ``src``
    slices); 0 without a gather."""
    return len(step.gather_group) / dp_size(src, stage_size) if step.gather else 0.0


@dataclass(frozen=True)
class Collective:
    """One collective a rank issues, as the cost model prices it: ``kind`` (``all_gather`` for
    relayouts; the planner adds ``zero_gather``, ``zero_scatter`` and ``all_reduce``), the
    group's size, whether it is a block of adjacent ranks (how the cluster model places it), and
    ``nbytes``: the unsharded size (an all-gather's output on each rank, a reduce-scatter's
    input, an all-reduce's buffer)."""

    kind: str
    group_size: int
    consecutive: bool
    nbytes: float


def _one_way(src: Layout, dst: Layout, stage_size: int,
             microbatch_bytes: float) -> tuple[Collective, ...]:
    # The branch is the same for every rank, so rank 0's step stands for the stage.
    step = relayout_step(src, dst, stage_size, 0)
    if not step.gather:
        return ()
    consecutive = (tp_group_consecutive(dst) if step.gather_on == "dst_tp"
                   else dp_group_consecutive(src))
    return (Collective("all_gather", len(step.gather_group), consecutive,
                       microbatch_bytes * gathered_fraction(src, step, stage_size)),)


def relayout_collectives(src: Layout, dst: Layout, stage_size: int, microbatch_bytes: float
                         ) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """``(forward, backward)`` collectives of one rank for a relayout of a micro-batch whose
    whole size is ``microbatch_bytes`` (every rank issues the same ones on its own group)."""
    return (_one_way(src, dst, stage_size, microbatch_bytes),
            _one_way(dst, src, stage_size, microbatch_bytes))


def all_layouts(stage_size: int) -> list[Layout]:
    """Every distinct layout of a stage with power-of-two TP degrees, sorted."""
    out, tp = [], 1
    while tp <= stage_size:
        if stage_size % tp == 0:
            out.append(make_layout(tp, True, stage_size))
            if 1 < tp < stage_size:
                out.append(make_layout(tp, False, stage_size))
        tp *= 2
    return sorted(out)


# --------------------------------------------------------------------- layouts placed on stages
class StageLayout(NamedTuple):
    """A layout placed on one pipeline stage: the key of a rank's process groups for it
    (``parallel/context.py``). Build it with :func:`stage_layout` (normalised like
    :func:`make_layout`, so equal layouts compare equal); ``layout`` is the stage-free part."""

    stage: int
    tp: int
    consecutive: bool

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.consecutive)


def stage_layout(stage: int, tp: int, consecutive: bool, stage_size: int) -> StageLayout:
    """The normalised :class:`StageLayout` of ``tp`` and TP order on ``stage``."""
    local = make_layout(tp, consecutive, stage_size)
    return StageLayout(stage, local.tp, local.consecutive)


def layer_stage_layout(plan: Plan, layer: int, stage: int | None = None) -> StageLayout:
    """Layer ``layer``'s layout on its own stage, or on ``stage`` (where its output arrives)."""
    strategy = plan.layers[layer]
    where = plan.stage_of_layer(layer) if stage is None else stage
    return stage_layout(where, strategy.tp, strategy.tp_consecutive, plan.stage_size)


def vocab_stage_layout(plan: Plan, stage: int) -> StageLayout:
    """The embedding's and LM head's layout on ``stage`` (vocab TP, always consecutive)."""
    return stage_layout(stage, plan.vocab.tp, True, plan.stage_size)


def received_layout(plan: Plan, chunk: int) -> StageLayout | None:
    """The layout model chunk ``chunk`` receives its input in: the previous chunk's last layer's
    layout, on ``chunk``'s stage (``chunk % pp``); None for chunk 0, which embeds."""
    if chunk == 0:
        return None
    return layer_stage_layout(plan, plan.chunk_layer_range(chunk)[0] - 1, chunk % plan.pp_size)


def plan_stage_layouts(plan: Plan) -> list[StageLayout]:
    """Every layout any rank of ``plan`` makes groups for, sorted (the same on every rank): the
    layer layouts of each stage, each chunk's received layout (:func:`received_layout`, so
    relayouts at stage boundaries work) and the vocab layout of the first and last stage.
    ``ParallelContext`` creates groups for these; ``planner/cost/gpu_terms.py`` counts them."""
    seen = {layer_stage_layout(plan, i) for i in range(plan.num_layers)}
    for chunk in range(1, plan.num_chunks):
        seen.add(layer_stage_layout(plan, plan.chunk_layer_range(chunk)[0] - 1,
                                    chunk % plan.pp_size))  # received_layout(plan, chunk)
    seen.update(vocab_stage_layout(plan, stage) for stage in {0, plan.pp_size - 1})
    return sorted(seen)


def plan_group_ranks(plan: Plan) -> list[tuple[int, ...]]:
    """Every process group ``ParallelContext(plan)`` creates, as global rank tuples in its
    creation order (the same on every rank, since ``new_group`` is collective), each once:
    the stages, the embedding pairs (rank ``j`` of the first and of the last stage, pp > 1),
    then for each layout of :func:`plan_stage_layouts` its TP groups and its DP groups.
    One-rank groups and the whole world are included (the context caches them too)."""
    n, pp = plan.stage_size, plan.pp_size
    out: dict[tuple[int, ...], None] = {}
    for k in range(pp):
        out[tuple(plan.stage_ranks(k))] = None
    if pp > 1:
        first, last = plan.stage_ranks(0), plan.stage_ranks(pp - 1)
        for j in range(n):
            out[(first[j], last[j])] = None
    for lay in plan_stage_layouts(plan):
        ranks = plan.stage_ranks(lay.stage)
        for group in (tp_group_ranks(ranks, lay.tp, lay.consecutive)
                      + dp_group_ranks(ranks, lay.tp, lay.consecutive)):
            out[tuple(group)] = None
    return list(out)


# --------------------------------------------------------------------- a layer's TP collectives
def layer_tp_collectives(layout: Layout, stage_size: int, activation_bytes: float, *,
                         sequence_parallel: bool, norm_tensor_bytes: Sequence[float] = (),
                         row_bias_bytes: Sequence[float] = (), recompute: bool = False
                         ) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """``(forward, backward)`` TP collectives of one rank for one micro-batch of a transformer
    layer (``models/transformer.py``), on the layer's TP group.

    ``activation_bytes``: the layer's whole-sequence activation on one rank, ``(b/dp, s, h)``
    in the compute dtype. Without SP the two row-parallel outputs are all-reduced in forward
    and the two column-parallel input gradients in backward. With ``sequence_parallel`` (see
    ``docs/runtime.md``) forward all-gathers the two column-parallel inputs and reduce-scatters
    the two row-parallel outputs; backward all-gathers the two row-parallel output gradients,
    all-gathers the two saved column-parallel inputs again (for the weight gradients) and
    reduce-scatters their input gradients, and all-reduces the gradient of every norm weight /
    bias (``norm_tensor_bytes``, one entry per tensor) and row-parallel bias
    (``row_bias_bytes``), which then saw only this rank's positions. ``recompute``: backward
    first re-runs the forward up to the last tensor it needs (``torch.utils.checkpoint`` stops
    early), i.e. every forward collective but the last (the MLP output's, whose result only
    feeds the residual add). Nothing with ``tp == 1``.
    """
    if layout.tp == 1:
        return (), ()
    consecutive = tp_group_consecutive(layout)

    def c(kind: str, nbytes: float) -> Collective:
        return Collective(kind, layout.tp, consecutive, float(nbytes))

    if not sequence_parallel:
        forward = (c("all_reduce", activation_bytes),) * 2
        backward = (c("all_reduce", activation_bytes),) * 2
    else:
        forward = (c("all_gather", activation_bytes), c("reduce_scatter", activation_bytes)) * 2
        backward = ((c("all_gather", activation_bytes),) * 2
                    + (c("all_gather", activation_bytes), c("reduce_scatter", activation_bytes)) * 2
                    + tuple(c("all_reduce", n) for n in (*norm_tensor_bytes, *row_bias_bytes)))
    return forward, (forward[:-1] if recompute else ()) + backward


def sequence_parallel_boundary_collectives(layout: Layout, activation_bytes: float, *,
                                           entering: bool
                                           ) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """``(forward, backward)`` collectives where an activation enters a run of SP layers of
    ``layout`` (keep this rank's positions; backward all-gathers the gradient) or leaves it
    (all-gather the sequence; backward keeps this rank's positions). Consecutive SP layers of
    one layout pass their chunks on with neither."""
    if layout.tp == 1:
        return (), ()
    gather = (Collective("all_gather", layout.tp, tp_group_consecutive(layout),
                         float(activation_bytes)),)
    return ((), gather) if entering else (gather, ())
