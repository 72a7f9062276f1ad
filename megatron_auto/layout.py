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

Context parallelism (a layout's ``cp`` > 1, one degree per plan): the stage is ``cp`` *blocks*
of ``m = n/cp`` adjacent indices, block ``c = j // m`` holding sequence chunks ``c`` and
``2cp-1-c`` of ``2cp`` equal chunks of every sample (:func:`cp_chunks`, the load-balanced order
of causal ring attention). Inside a block the rules above apply to ``m`` ranks and the block
index ``j % m``: TP groups, batch slices (``m/tp`` of them, :func:`num_batch_slices`) and
relayouts never leave a block, since every block holds the same samples. The ranks with the
same block index form a *CP group* (``cp`` members ``m`` apart, :func:`cp_group_ranks`): they
exchange keys and values in attention. Parameters are replicated over the CP group as over the
batch slices, so the group a parameter shard's gradient is reduced over (the *DP group*,
:func:`dp_group_ranks`) is every rank of the stage with the same TP rank: ``dp x cp = n/tp``
members (:func:`dp_size`). With ``cp > 1`` TP groups are consecutive (strided TP with CP is
not a layout: :func:`make_layout` refuses it).

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
from typing import Any, Collection, NamedTuple, Sequence

from .plan import Plan


class Layout(NamedTuple):
    """A TP degree, rank order and CP degree inside a stage; build it with :func:`make_layout`."""

    tp: int
    consecutive: bool
    cp: int = 1


def _check_tp(tp: int, stage_size: int) -> None:
    if not isinstance(tp, int) or tp < 1 or stage_size % tp:
        raise ValueError(f"tp={tp}: must be a positive divisor of the {stage_size} ranks per stage")


def _check_cp(cp: int, tp: int, stage_size: int) -> None:
    if not isinstance(cp, int) or cp < 1 or stage_size % cp:
        raise ValueError(f"cp={cp}: must be a positive divisor of the {stage_size} ranks per stage")
    if (stage_size // cp) % tp:
        raise ValueError(f"tp={tp} x cp={cp}: must divide the {stage_size} ranks per stage")


def make_layout(tp: int, consecutive: bool, stage_size: int, cp: int = 1) -> Layout:
    """The normalised layout: ``consecutive`` is True when ``tp`` is 1 or the whole CP block
    (``stage_size / cp``). Raises ``ValueError`` for strided TP under ``cp > 1``."""
    _check_tp(tp, stage_size)
    _check_cp(cp, tp, stage_size)
    block = stage_size // cp
    consecutive = bool(consecutive) or tp in (1, block)
    if cp > 1 and not consecutive:
        raise ValueError(f"tp={tp} with cp={cp}: strided TP groups (tp_consecutive false) are "
                         f"not a layout under context parallelism; use consecutive TP")
    return Layout(tp, consecutive, cp)


def layout_of(strategy: Any, stage_size: int) -> Layout:
    """The layout of anything with ``tp``, ``tp_consecutive`` and optionally ``cp`` (a
    ``plan.LayerStrategy``)."""
    return make_layout(strategy.tp, strategy.tp_consecutive, stage_size,
                       getattr(strategy, "cp", 1))


def vocab_layout(vocab_tp: int, stage_size: int, cp: int = 1) -> Layout:
    """The embedding's and LM head's layout: vocab TP groups are always consecutive; the
    vocabulary shares the plan's CP degree."""
    return make_layout(vocab_tp, True, stage_size, cp)


def dp_size(layout: Layout, stage_size: int) -> int:
    """Ranks of a DP group, those holding the same parameter shard: ``dp x cp = n/tp``. In
    sample units (a sample's share of the sequence) each rank processes ``b/dp_size`` of a
    micro-batch of ``b`` samples, with or without CP."""
    return stage_size // layout.tp


def cp_block_size(layout: Layout, stage_size: int) -> int:
    """Ranks of one CP block (``m = n/cp``): the ranks holding the same sequence chunks."""
    return stage_size // layout.cp


def num_batch_slices(layout: Layout, stage_size: int) -> int:
    """Batch slices of a micro-batch (``m/tp`` per CP block): what must divide it."""
    return stage_size // (layout.tp * layout.cp)


def cp_rank(local_index: int, stage_size: int, cp: int) -> int:
    """The CP rank of a local index: its block ``j // (n/cp)``."""
    return local_index // (stage_size // cp)


def cp_chunks(cp_rank_: int, cp: int) -> tuple[int, int]:
    """The two of ``2cp`` equal sequence chunks a CP rank holds, in sequence order: ``r`` and
    ``2cp-1-r`` (causal attention then costs every rank the same; docs/runtime.md)."""
    if not 0 <= cp_rank_ < cp:
        raise ValueError(f"cp rank {cp_rank_} out of range for cp={cp}")
    return cp_rank_, 2 * cp - 1 - cp_rank_


def cp_positions(cp_rank_: int, cp: int, seq_length: int) -> list[int]:
    """The global positions of a CP rank's tokens, in the order it holds them (its two chunks
    concatenated); every position once over the CP group. ``seq_length`` divisible by ``2cp``."""
    if seq_length % (2 * cp):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x cp = {2 * cp}")
    c = seq_length // (2 * cp)
    return [k * c + t for k in cp_chunks(cp_rank_, cp) for t in range(c)]


def cp_group_ranks(stage_ranks: Sequence[int], cp: int) -> list[list[int]]:
    """Ranks of every CP group of a stage (indexed by the block index ``j % m``), each ordered
    by CP rank: ``stage_ranks[u + c*m]`` for ``c`` in ``0..cp-1``."""
    n = len(stage_ranks)
    _check_cp(cp, 1, n)
    m = n // cp
    return [[stage_ranks[u + c * m] for c in range(cp)] for u in range(m)]


def tp_dp_rank(local_index: int, stage_size: int, tp: int, consecutive: bool) -> tuple[int, int]:
    """``(tp_rank, dp_rank)`` of local index ``local_index`` under a layout."""
    dp = stage_size // tp
    if consecutive:
        return local_index % tp, local_index // tp
    return local_index // dp, local_index % dp


def _blocks(stage_ranks: Sequence[int], cp: int) -> list[list[int]]:
    n = len(stage_ranks)
    m = n // cp
    return [list(stage_ranks[c * m:(c + 1) * m]) for c in range(cp)]


def tp_group_ranks(stage_ranks: Sequence[int], tp: int, consecutive: bool,
                   cp: int = 1) -> list[list[int]]:
    """Ranks of every TP group of a stage, each ordered by ``tp_rank``; indexed by ``dp_rank``
    (``cp == 1``), else by ``cp_rank * m/tp + slice`` (the groups of each CP block in turn)."""
    n = len(stage_ranks)
    _check_tp(tp, n)
    _check_cp(cp, tp, n)
    if cp > 1:
        return [g for block in _blocks(stage_ranks, cp) for g in tp_group_ranks(block, tp, True)]
    dp = n // tp
    if consecutive:
        return [[stage_ranks[d * tp + t] for t in range(tp)] for d in range(dp)]
    return [[stage_ranks[d + t * dp] for t in range(tp)] for d in range(dp)]


def slice_group_ranks(stage_ranks: Sequence[int], tp: int, consecutive: bool,
                      cp: int = 1) -> list[list[int]]:
    """Ranks of every *slice group* (the ranks of one CP block with the same TP rank: one
    holder of every batch slice of the block's sequence chunks, what a relayout gathers over),
    indexed by ``cp_rank * tp + tp_rank``, each ordered by slice. The DP groups when ``cp == 1``."""
    n = len(stage_ranks)
    _check_tp(tp, n)
    _check_cp(cp, tp, n)
    if cp > 1:
        return [g for block in _blocks(stage_ranks, cp) for g in slice_group_ranks(block, tp, True)]
    dp = n // tp
    if consecutive:
        return [[stage_ranks[d * tp + t] for d in range(dp)] for t in range(tp)]
    return [[stage_ranks[d + t * dp] for d in range(dp)] for t in range(tp)]


def dp_group_ranks(stage_ranks: Sequence[int], tp: int, consecutive: bool,
                   cp: int = 1) -> list[list[int]]:
    """Ranks of every DP group of a stage (indexed by ``tp_rank``), each ordered by
    ``cp_rank * m/tp + slice`` (``dp_rank``): the ranks a parameter shard is replicated on."""
    groups = slice_group_ranks(stage_ranks, tp, consecutive, cp)
    return [[r for c in range(cp) for r in groups[c * tp + t]] for t in range(tp)]


def layout_ranks(local_index: int, stage_size: int, layout: Layout) -> tuple[int, int, int, int]:
    """``(tp_rank, slice_rank, dp_rank, cp_rank)`` of a local index under ``layout``: its
    positions in its TP group, slice group, DP group and CP group."""
    m = cp_block_size(layout, stage_size)
    c = local_index // m
    tp_rank, slice_rank = tp_dp_rank(local_index % m, m, layout.tp, layout.consecutive)
    return tp_rank, slice_rank, c * (m // layout.tp) + slice_rank, c


def tp_group_consecutive(layout: Layout) -> bool:
    """Whether TP groups are blocks of adjacent ranks (the cluster model's ``consecutive``)."""
    return layout.consecutive


def dp_group_consecutive(layout: Layout) -> bool:
    """Whether DP groups are blocks of adjacent ranks: TP is 1 (the group is the stage) or
    strided (DP groups are then the blocks)."""
    return layout.tp == 1 or not layout.consecutive


def batch_slice(local_index: int, stage_size: int, layout: Layout) -> tuple[int, int]:
    """``(index, count)``: rank ``local_index`` holds slice ``index`` of ``count`` equal slices
    (of its CP block's sequence chunks)."""
    m = cp_block_size(layout, stage_size)
    return tp_dp_rank(local_index % m, m, layout.tp, layout.consecutive)[1], m // layout.tp


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

    ``gather``: all-gather first over ``gather_on`` (``"src_dp"``: the rank's ``src`` slice
    group, its DP group without CP, which yields the whole micro-batch of its sequence chunks; ``"dst_tp"``: its ``dst`` TP group, whose members' ``src``
    slices make up exactly its ``dst`` slice), ``gather_group`` the group's local indices in
    gather order. Then keep part ``keep_index`` of ``keep_count`` equal parts of what the rank
    holds (``(0, 1)``: all of it; with no gather, the input itself, nothing to do).
    """

    gather: bool
    gather_group: tuple[int, ...]  # local indices of the stage
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
    _same_cp(src, dst)
    m = cp_block_size(dst, stage_size)
    groups = tp_group_ranks(range(m), dst.tp, dst.consecutive)  # in one block: all alike
    for j in range(m):
        i_dst, n_dst = batch_slice(j, m, dst._replace(cp=1))
        members = groups[i_dst]
        held = [batch_slice(g, m, src._replace(cp=1)) for g in members]
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
    _same_cp(src, dst)
    i_src, n_src = batch_slice(local_index, stage_size, src)
    i_dst, n_dst = batch_slice(local_index, stage_size, dst)
    if batch_slices(src, stage_size) == batch_slices(dst, stage_size):
        return RelayoutStep(False, (), 0, 1)
    if relayout_is_local(src, dst, stage_size):
        parts = n_dst // n_src
        return RelayoutStep(False, (), i_dst % parts, parts)
    # the groups of this rank's CP block (all blocks do the same on their own ranks)
    m = cp_block_size(src, stage_size)
    offset, inner = local_index - local_index % m, local_index % m
    if _dst_tp_gather_delivers(src, dst, stage_size):
        group = tp_group_ranks(range(offset, offset + m), dst.tp, dst.consecutive)[i_dst]
        return RelayoutStep(True, tuple(group), 0, 1, "dst_tp")
    tp_rank = tp_dp_rank(inner, m, src.tp, src.consecutive)[0]
    group = slice_group_ranks(range(offset, offset + m), src.tp, src.consecutive)[tp_rank]
    return RelayoutStep(True, tuple(group), i_dst, n_dst, "src_dp")


def _same_cp(src: Layout, dst: Layout) -> None:
    if src.cp != dst.cp:
        raise ValueError(f"relayout between cp={src.cp} and cp={dst.cp}: every layout of a plan "
                         f"has the plan's one CP degree")


def gathered_fraction(src: Layout, step: RelayoutStep, stage_size: int) -> float:
    """The part of the micro-batch a gathering step's output holds (its members' ``src``
    slices, of the CP block's sequence chunks: ``1/cp`` of every sample at most); 0 without a
    gather."""
    if not step.gather:
        return 0.0
    return len(step.gather_group) / num_batch_slices(src, stage_size) / src.cp


@dataclass(frozen=True)
class Collective:
    """One collective a rank issues, as the cost model prices it: ``kind`` (``all_gather`` for
    relayouts; the planner adds ``zero_gather``, ``zero_scatter`` and ``all_reduce``), the
    group's size, whether it is a block of adjacent ranks (how the cluster model places it), and
    ``nbytes``: the unsharded size (an all-gather's output on each rank, a reduce-scatter's
    input, an all-reduce's buffer). ``span``: the adjacent ranks a strided group spreads over
    (0: the whole stage; a CP block's slice group spreads over the block). Context parallelism
    adds ``cp_send`` (one step of the ring: every member sends ``nbytes`` to the next CP rank
    and receives as much from the previous one) and ``all_to_all`` (``nbytes`` per rank in,
    as much out)."""

    kind: str
    group_size: int
    consecutive: bool
    nbytes: float
    span: int = 0


def _one_way(src: Layout, dst: Layout, stage_size: int,
             microbatch_bytes: float) -> tuple[Collective, ...]:
    # The branch is the same for every rank, so rank 0's step stands for the stage.
    step = relayout_step(src, dst, stage_size, 0)
    if not step.gather:
        return ()
    consecutive = (tp_group_consecutive(dst) if step.gather_on == "dst_tp"
                   else dp_group_consecutive(src))
    span = cp_block_size(src, stage_size) if src.cp > 1 and not consecutive else 0
    return (Collective("all_gather", len(step.gather_group), consecutive,
                       microbatch_bytes * gathered_fraction(src, step, stage_size), span),)


def relayout_collectives(src: Layout, dst: Layout, stage_size: int, microbatch_bytes: float
                         ) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """``(forward, backward)`` collectives of one rank for a relayout of a micro-batch whose
    whole size is ``microbatch_bytes`` (every rank issues the same ones on its own group)."""
    return (_one_way(src, dst, stage_size, microbatch_bytes),
            _one_way(dst, src, stage_size, microbatch_bytes))


def all_layouts(stage_size: int, cp: int = 1) -> list[Layout]:
    """Every distinct layout of a stage with power-of-two TP degrees and CP degree ``cp``,
    sorted (strided TP only without CP)."""
    out, tp = [], 1
    block = stage_size // cp
    while tp <= block:
        if block % tp == 0:
            out.append(make_layout(tp, True, stage_size, cp))
            if 1 < tp < block and cp == 1:
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
    cp: int = 1

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.consecutive, self.cp)


def stage_layout(stage: int, tp: int, consecutive: bool, stage_size: int,
                 cp: int = 1) -> StageLayout:
    """The normalised :class:`StageLayout` of ``tp``, TP order and ``cp`` on ``stage``."""
    local = make_layout(tp, consecutive, stage_size, cp)
    return StageLayout(stage, local.tp, local.consecutive, local.cp)


def layer_stage_layout(plan: Plan, layer: int, stage: int | None = None) -> StageLayout:
    """Layer ``layer``'s layout on its own stage, or on ``stage`` (where its output arrives)."""
    strategy = plan.layers[layer]
    where = plan.stage_of_layer(layer) if stage is None else stage
    return stage_layout(where, strategy.tp, strategy.tp_consecutive, plan.stage_size,
                        strategy.cp)


def vocab_stage_layout(plan: Plan, stage: int) -> StageLayout:
    """The embedding's and LM head's layout on ``stage`` (vocab TP, always consecutive, the
    plan's CP degree)."""
    return stage_layout(stage, plan.vocab.tp, True, plan.stage_size, plan.cp_size)


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
    then for each layout of :func:`plan_stage_layouts` its TP groups and its DP groups and,
    with CP, its slice groups and CP groups (then the context creates
    ``expert_layout.plan_expert_group_ranks``). One-rank groups and the whole world are
    included (the context caches them too)."""
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
        groups = (tp_group_ranks(ranks, lay.tp, lay.consecutive, lay.cp)
                  + dp_group_ranks(ranks, lay.tp, lay.consecutive, lay.cp))
        if lay.cp > 1:
            groups += (slice_group_ranks(ranks, lay.tp, lay.consecutive, lay.cp)
                       + cp_group_ranks(ranks, lay.cp))
        for group in groups:
            out[tuple(group)] = None
    return list(out)


# --------------------------------------------------------------------- a layer's TP collectives
def layer_tp_collectives(layout: Layout, stage_size: int, activation_bytes: float, *,
                         sequence_parallel: bool, norm_tensor_bytes: Sequence[float] = (),
                         row_bias_bytes: Sequence[float] = (), recompute: bool = False,
                         recompute_modules: Collection[str] = (), mlp: bool = True
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
    feeds the residual add). ``recompute_modules`` (models/recompute.py): of the single modules
    only ``mlp`` under SP re-issues a collective, fc1's all-gather (the recompute stops after
    fc2's matmul, before its reduce-scatter; without SP fc1's input copy issues nothing); core
    attention and the norms have none. Nothing with ``tp == 1``.

    ``mlp=False`` (an MoE layer without shared experts, ``models/moe.py``: its router and
    experts are replicated over TP): the attention's pair only, one all-reduce each way; a
    recomputing one re-runs that forward all-reduce too (the router reads its result).
    """
    if layout.tp == 1:
        return (), ()
    consecutive = tp_group_consecutive(layout)

    def c(kind: str, nbytes: float) -> Collective:
        return Collective(kind, layout.tp, consecutive, float(nbytes))

    forward: tuple[Collective, ...]
    backward: tuple[Collective, ...]
    if not mlp:
        if sequence_parallel:
            raise ValueError("an MoE layer runs without sequence parallelism")
        one = (c("all_reduce", activation_bytes),)
        return one, (one if recompute else ()) + one
    if not sequence_parallel:
        forward = (c("all_reduce", activation_bytes),) * 2
        backward = (c("all_reduce", activation_bytes),) * 2
    else:
        forward = (c("all_gather", activation_bytes), c("reduce_scatter", activation_bytes)) * 2
        backward = ((c("all_gather", activation_bytes),) * 2
                    + (c("all_gather", activation_bytes), c("reduce_scatter", activation_bytes)) * 2
                    + tuple(c("all_reduce", n) for n in (*norm_tensor_bytes, *row_bias_bytes)))
    if recompute:
        return forward, forward[:-1] + backward
    if sequence_parallel and "mlp" in recompute_modules:
        return forward, forward[2:3] + backward
    return forward, backward


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
