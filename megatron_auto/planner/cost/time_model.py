"""Time cost of one layer (or the embedding/head) per micro-batch, relayouts, and the pipeline.

All results are seconds. Communication times come from the cluster (``allreduce_time``,
``allgather_time``, ``zero_gather_time``, ``zero_scatter_time``, ``p2p_time``); which groups and
messages a relayout uses comes from :mod:`megatron_auto.layout`; groups inside a stage pass
``span=stage_size`` so that strided groups are placed inside the stage's ranks. Overlap of a
communication of duration ``c`` with compute ``x`` takes ``ov(c, x) = max(c, x) + (g-1)*min(c, x)``
(``g`` = ``overlap_slowdown``): both streams run slowed while they overlap. Formulas with symbols:
docs/cost_model.md §4-5.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Collection, Sequence

from ...layout import (Collective, Layout, dp_group_consecutive, dp_size, layer_tp_collectives,
                       make_layout, relayout_collectives,
                       sequence_parallel_boundary_collectives)
from .context_parallel import cp_layer_time
from .memory_model import GRAD_BYTES, MASTER_BYTES, relayout_memory, vocab_parameters
from ..inputs.cluster_model import ClusterModel
from ..inputs.profile_records import EmbeddingProfile, LayerTypeProfile

# Bytes per parameter of a ZeRO parameter all-gather: FSDP2 gathers in its ``param_dtype``, the
# compute dtype under bf16/fp16 (``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=fp32)``,
# parallel/data_parallel.py); gradients are reduce-scattered in fp32 (``GRAD_BYTES``).
GATHER_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# The runtime's ``ddp`` gradient bucket (``parallel/data_parallel.py``'s default, checked by
# tests/test_cost_time_zero.py): one all-reduce per bucket, not per layer.
DDP_BUCKET_BYTES = 25 * 2**20


def gather_bytes(precision: str) -> int:
    """Bytes per parameter of a ZeRO all-gather under ``precision``."""
    if precision not in GATHER_BYTES:
        raise ValueError(f"precision={precision!r}: choose one of {', '.join(GATHER_BYTES)}")
    return GATHER_BYTES[precision]


def overlap(comm: float, compute: float, slowdown: float) -> float:
    """Wall time of ``comm`` seconds of communication overlapped with ``compute`` seconds."""
    return max(comm, compute) + (slowdown - 1.0) * min(comm, compute)


def zero_slowdown(cluster: ClusterModel) -> float:
    """The ``g`` of :func:`overlap` for FSDP2's gathers and reduce-scatters (ZeRO-2/3).

    On a GPU FSDP2 runs them on side streams, overlapped with compute: the cluster's
    ``overlap_slowdown``. On a CPU it has no streams: each collective runs synchronously on the
    compute thread, before (gather) or after (reduce-scatter) the unit's compute, so the two add
    up, which is ``overlap`` with ``g = 2`` (``max + min``), whatever the measured slowdown of
    truly concurrent work (the DDP buckets' asynchronous all-reduce keeps that one).
    """
    if str(getattr(cluster, "device_name", "")).startswith("cpu"):
        return 2.0
    return cluster.overlap_slowdown


@dataclass(frozen=True)
class TimeCost:
    """Seconds. ``forward``/``backward`` per micro-batch include the layer's own TP and ZeRO
    communication; ``sync`` is the once-per-iteration DDP all-reduce and ``exposed_sync`` the part
    of it that does not hide behind this layer's last backward."""

    forward: float
    backward: float
    sync: float
    exposed_sync: float
    compute: float  # forward + backward compute alone (for the binding report)
    tp_comm: float
    dp_comm: float  # ZeRO gathers and reduce-scatters per micro-batch
    optimizer: float = 0.0  # once per iteration, after every stage's backward and sync
    ep_comm: float = 0.0  # MoE layers' expert-parallel all-to-alls per micro-batch (cost/moe.py)

    @property
    def microbatch(self) -> float:
        return self.forward + self.backward

    def __add__(self, other: "TimeCost") -> "TimeCost":
        """Field-wise sum: the time of components that run one after the other."""
        return TimeCost(*(getattr(self, f.name) + getattr(other, f.name)
                          for f in fields(TimeCost)))


NO_TIME = TimeCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class DataParallelCollectives:
    """The collectives one rank's data parallelism issues for one component (FSDP2 for ZeRO,
    our gradient buckets for ``ddp`` and ``zero1``): ``forward`` and ``backward`` per
    micro-batch, ``per_iteration`` once (the ``ddp`` gradient all-reduce and ``zero1``'s
    reduce-scatter, both in the last micro-batch's backward; ``zero2``'s parameter gather before
    the first forward, kept until the last backward) and ``after_step`` once, after the
    optimizer step (``zero1``'s all-gather of the updated parameters)."""

    forward: tuple[Collective, ...] = ()
    backward: tuple[Collective, ...] = ()
    per_iteration: tuple[Collective, ...] = ()
    after_step: tuple[Collective, ...] = ()


def dp_collectives(num_params: float, dp: int, dp_mode: str, consecutive: bool,
                   precision: str) -> DataParallelCollectives:
    """What the runtime issues for ``num_params`` local parameters over a DP group of ``dp``.

    ZeRO parameter gathers (kind ``zero_gather``) move ``gather_bytes(precision)`` per parameter
    (FSDP2's ``param_dtype``), gradient reduce-scatters (``zero_scatter``) 4 (its fp32
    ``reduce_dtype``); ``nbytes`` is the unsharded size (gather output, reduce-scatter input).
    ``zero1`` (our buckets, ``parallel/distributed_optimizer.py``): one ``reduce_scatter`` of
    the fp32 gradients and one ``all_gather`` of the fp32 parameters (they are the master
    weights) per iteration. The runtime merges the layers of one DP group into buckets; listed
    here is each layer's share (the merge saves latency only).
    """
    if dp <= 1:
        return DataParallelCollectives()
    gather = Collective("zero_gather", dp, consecutive, gather_bytes(precision) * num_params)
    scatter = Collective("zero_scatter", dp, consecutive, GRAD_BYTES * num_params)
    if dp_mode == "zero3":
        return DataParallelCollectives(forward=(gather,), backward=(gather, scatter))
    if dp_mode == "zero2":
        return DataParallelCollectives(backward=(scatter,), per_iteration=(gather,))
    if dp_mode == "ddp":
        return DataParallelCollectives(per_iteration=(
            Collective("all_reduce", dp, consecutive, GRAD_BYTES * num_params),))
    if dp_mode == "zero1":
        return DataParallelCollectives(
            per_iteration=(Collective("reduce_scatter", dp, consecutive, GRAD_BYTES * num_params),),
            after_step=(Collective("all_gather", dp, consecutive, MASTER_BYTES * num_params),))
    raise ValueError(f"dp_mode={dp_mode!r}: choose one of ddp, zero1, zero2, zero3")


def vocab_units(profile: EmbeddingProfile, vocab_tp: int, first: bool, last: bool,
                pp: int) -> list[tuple[float, int]]:
    """``(local parameters, forward uses per micro-batch)`` of each unit the runtime shards
    of this stage's vocab-layout modules (``models.gpt.GPTStage.parallel_units``): the
    embedding (first stage), the final norm and an untied output layer (last stage), the tied
    word embedding's own copy (a last stage that is not the first). With one stage and tied
    weights the embedding is the LM head too: one unit, used twice per forward (``embed`` and
    ``logits``), which FSDP2 gathers for each use under ZeRO-3. The parameters add up to
    ``cost_memory.vocab_parameters``."""
    emb = profile.local_embedding_parameters(vocab_tp)
    units: list[tuple[float, int]] = [(emb, 1)] if first else []
    if last:
        if profile.tied:
            units.append((float(profile.head_parameters), 1))  # the final norm alone
            if first:
                units[0] = (emb, 2)
            else:  # the word embedding's copy (no position rows)
                units.append((profile.split_embedding_parameters / vocab_tp, 1))
        elif 0 < profile.final_norm_parameters < profile.head_parameters:
            units += [(float(profile.final_norm_parameters), 1),
                      (float(profile.head_parameters - profile.final_norm_parameters), 1)]
        else:  # the norm's share not recorded: one unit
            units.append((float(profile.head_parameters), 1))
    return units


def vocab_dp_collectives(profile: EmbeddingProfile, vocab_tp: int, dp: int, dp_mode: str,
                         first: bool, last: bool, pp: int,
                         precision: str) -> DataParallelCollectives:
    """ZeRO-2/3: :func:`dp_collectives` of every :func:`vocab_units` unit, each gather repeated per use
    (measured: with one tied stage FSDP2 gathers the embedding twice per forward and twice per
    backward under ZeRO-3, and twice per iteration under ZeRO-2, whose last backward reshards
    it after the head's use; one reduce-scatter per unit and micro-batch either way). ``ddp``
    and ``zero1`` go through our gradient buckets, not units: one piece of all the parameters."""
    units = vocab_units(profile, vocab_tp, first, last, pp)
    # the vocab layout's DP group: strided when 1 < vocab_tp < stage size
    consecutive = dp_group_consecutive(make_layout(vocab_tp, True, vocab_tp * dp))
    if dp_mode not in ("zero2", "zero3"):  # ddp / zero1: our buckets, not units (one piece)
        return dp_collectives(sum(p for p, _ in units), dp, dp_mode, consecutive, precision)
    forward: list[Collective] = []
    backward: list[Collective] = []
    per_iteration: list[Collective] = []
    after_step: list[Collective] = []
    for num_params, uses in units:
        cs = dp_collectives(num_params, dp, dp_mode, consecutive, precision)
        for out, part in ((forward, cs.forward), (backward, cs.backward),
                          (per_iteration, cs.per_iteration), (after_step, cs.after_step)):
            for c in part:
                out.extend([c] * (uses if c.kind == "zero_gather" else 1))
    return DataParallelCollectives(tuple(forward), tuple(backward), tuple(per_iteration),
                                   tuple(after_step))


def _dp_times(cluster: ClusterModel, num_params: float, dp: int, dp_mode: str, consecutive: bool,
              stage_size: int, precision: str,
              collectives: DataParallelCollectives | None = None
              ) -> tuple[float, float, float, float, float]:
    """``(gather, reduce_scatter, gradient_sync, zero2_gather, after_step)`` seconds for
    ``num_params`` params (or the given ``collectives``): the first two per micro-batch (zero3
    gathers twice), the rest once per iteration (``gradient_sync``: the ``ddp`` all-reduce, in
    buckets, or the ``zero1`` reduce-scatter, in the last backward; ``after_step``: the
    ``zero1`` parameter all-gather)."""
    cs = collectives if collectives is not None else dp_collectives(
        num_params, dp, dp_mode, consecutive, precision)

    def total(collectives: Sequence[Collective], *kinds: str) -> float:
        return sum(collective_time(cluster, c, stage_size) for c in collectives if c.kind in kinds)

    allreduce = sum(bucketed_allreduce_time(cluster, c, stage_size)
                    for c in cs.per_iteration if c.kind == "all_reduce")
    return (total(cs.forward, "zero_gather"), total(cs.backward, "zero_scatter"),
            allreduce + total(cs.per_iteration, "reduce_scatter"),
            total(cs.per_iteration, "zero_gather"), total(cs.after_step, "all_gather"))


def bucketed_allreduce_time(cluster: ClusterModel, collective: Collective, stage_size: int,
                            bucket_bytes: float = DDP_BUCKET_BYTES) -> float:
    """A component's share of the bucketed ``ddp`` gradient all-reduce: its bytes at the
    group's bandwidth plus ``nbytes / bucket_bytes`` of one call's latency.

    The runtime packs the gradients of every ``ddp`` component on one DP group into buckets of
    ``bucket_bytes`` and issues one all-reduce per bucket (``parallel/ddp_buckets.py``), so a
    stage pays ``ceil(total / bucket_bytes)`` latencies, not one per layer; the per-component
    share keeps the price additive (it falls short of the runtime by less than one latency per
    DP group and stage, the partly filled last bucket). The latency is read off the cluster's
    own price, which is affine in the bytes: ``L = 2 t(n) - t(2n)``.
    """
    one = collective_time(cluster, collective, stage_size)
    if one <= 0:
        return 0.0
    twice = collective_time(cluster, replace(collective, nbytes=2 * collective.nbytes),
                            stage_size)
    latency = min(one, max(0.0, 2 * one - twice))
    return one - latency + latency * collective.nbytes / bucket_bytes


def layer_time(profile: LayerTypeProfile, cluster: ClusterModel, layout: Layout, dp_mode: str,
               recompute: bool, samples: float, stage_size: int,
               precision: str = "fp32", *, sequence_parallel: bool = False,
               norm_grad_bytes: Sequence[float] = (),
               recompute_forward_s: float = 0.0, recompute_modules: Collection[str] = (),
               cp_mode: str = "ring", mlp: bool = True) -> TimeCost:
    """Time of one layer for one micro-batch of ``samples`` samples per rank.

    Forward: compute ``F``, ZeRO-3 parameter gather overlapped with it, the TP collectives of
    ``layout.layer_tp_collectives`` (what ``models/transformer.py`` issues): two all-reduces of
    the ``(b, s, h)`` activation, or with ``sequence_parallel`` two all-gathers and two
    reduce-scatters of it. Backward: ``r*F`` (plus ``F`` when recomputing, with the forward's
    collectives but the last again), the ZeRO-3 re-gather and the ZeRO-2/3 gradient
    reduce-scatter overlapped with it, and the backward TP collectives (SP: also the all-reduces
    of the norm-weight and row-bias gradients, ``norm_grad_bytes`` one entry per tensor). DDP:
    one all-reduce of the fp32 gradients per iteration; ZeRO-1: one reduce-scatter of them in
    the last backward, and the all-gather of the updated parameters after the step, charged to
    ``optimizer`` (it follows the step on every stage). ZeRO gathers move
    ``gather_bytes(precision)`` per parameter, reduce-scatters 4.

    Context parallelism (``layout.cp > 1``, ``samples`` in sample equivalents): the DP group
    is ``dp x cp = n/tp`` ranks as above, and ``context_parallel.cp_layer_time`` adds the
    attention's CP communication (``cp_mode``) left exposed and the ring's chunked attention.

    ``mlp=False``: the layer has no dense MLP (an MoE layer without shared experts), so only
    the attention's TP collectives (``layout.layer_tp_collectives``).
    """
    tp = layout.tp
    dp = stage_size // tp
    g = cluster.overlap_slowdown
    fwd = profile.forward_time(samples, tp)
    cpt = cp_layer_time(profile, cluster, layout, cp_mode, samples, stage_size,
                        4 if precision == "fp32" else 2, recompute)
    fwd += cpt.forward_compute
    # whole layer: its forward again; single modules (cost/recompute.py): their forward time
    bwd = profile.backward_forward_ratio * fwd + (fwd if recompute else recompute_forward_s)
    tp_fwd, tp_bwd = layer_tp_collectives(
        layout, stage_size, profile.tp_bytes_per_sample * samples,
        sequence_parallel=sequence_parallel and tp > 1, norm_tensor_bytes=norm_grad_bytes,
        recompute=recompute, recompute_modules=recompute_modules, mlp=mlp)
    tp_f = sum(collective_time(cluster, c, stage_size) for c in tp_fwd)
    tp_b = sum(collective_time(cluster, c, stage_size) for c in tp_bwd)
    local = profile.local_parameters(tp)
    gather, scatter, allreduce, regather, after_step = _dp_times(
        cluster, local, dp, dp_mode, dp_group_consecutive(layout), stage_size, precision)
    gz = zero_slowdown(cluster)
    forward = overlap(gather, fwd, gz) + tp_f + cpt.forward_comm
    backward = overlap(gather + scatter, bwd, gz) + tp_b + cpt.backward_comm
    exposed = overlap(allreduce, bwd, g) - bwd if allreduce > 0 else 0.0
    exposed += overlap(regather, fwd, gz) - fwd if regather > 0 else 0.0
    return TimeCost(forward, backward, allreduce + regather, exposed, fwd + bwd,
                    tp_f + tp_b + cpt.forward_comm + cpt.backward_comm, 2 * gather + scatter,
                    _optimizer_time(cluster, local, dp, dp_mode) + after_step)


def _optimizer_time(cluster: ClusterModel, num_params: float, dp: int, dp_mode: str) -> float:
    """The optimizer step's share of ``num_params`` local parameters: ZeRO updates its shard."""
    sharded = dp_mode in ("zero1", "zero2", "zero3") and dp > 1
    owned = num_params / dp if sharded else num_params
    return cluster.optimizer_time_per_parameter_s * owned


def embedding_time(profile: EmbeddingProfile, cluster: ClusterModel, vocab_tp: int, dp_mode: str,
                   samples: float, stage_size: int, first: bool, last: bool, pp: int,
                   seq_length: int = 1, precision: str = "fp32") -> TimeCost:
    """Embedding (first stage) and/or head + loss (last stage) for one micro-batch.

    Vocab-parallel embedding all-reduces its ``(b, s, h)`` output in forward; the parallel head
    all-reduces the gradient of its input in backward, and its cross entropy two per-token fp32
    vectors (row maxima; target logit and sum of exponentials) in forward. With tied weights and ``pp > 1`` both
    stages all-reduce the word-embedding gradient between them once per iteration (added to
    ``sync``, fully exposed: it waits for both ends of the pipeline).
    """
    dp = stage_size // vocab_tp
    g = cluster.overlap_slowdown
    fwd = 0.0
    num_params = vocab_parameters(profile, vocab_tp, first, last, pp)
    tp_ar = 0.0
    if vocab_tp > 1:
        tp_ar = collective_time(cluster, _vocab_activation(profile, vocab_tp, samples,
                                                           precision), stage_size)
    tp_comm = 0.0
    loss_comm = sum(collective_time(cluster, c, stage_size)
                    for c in _vocab_loss(vocab_tp, samples, seq_length)) if last else 0.0
    if first:
        fwd += profile.embedding_forward_time_per_sample_s * samples / vocab_tp
        fwd += profile.forward_time_constant_s
        tp_comm += tp_ar
    if last:
        fwd += profile.head_forward_time_per_sample_s * samples / vocab_tp
        fwd += profile.forward_time_constant_s
        tp_comm += tp_ar + loss_comm
    bwd = profile.backward_forward_ratio * fwd
    gather, scatter, allreduce, regather, after_step = _dp_times(
        cluster, num_params, dp, dp_mode, True, stage_size, precision,
        vocab_dp_collectives(profile, vocab_tp, dp, dp_mode, first, last, pp, precision))
    tied_sync = tied_embedding_collective(profile, vocab_tp, pp, dp, dp_mode)
    tied = 0.0
    if tied_sync is not None:  # between the stages: no span inside one stage
        tied = cluster.allreduce_time(tied_sync.nbytes, tied_sync.group_size,
                                      tied_sync.consecutive)
    gz = zero_slowdown(cluster)
    forward = overlap(gather, fwd, gz) + (tp_ar if first else 0.0) + loss_comm
    backward = overlap(gather + scatter, bwd, gz) + (tp_ar if last else 0.0)
    exposed = (overlap(allreduce, bwd, g) - bwd if allreduce > 0 else 0.0) + tied
    exposed += overlap(regather, fwd, gz) - fwd if regather > 0 else 0.0
    return TimeCost(forward, backward, allreduce + tied + regather, exposed, fwd + bwd, tp_comm,
                    2 * gather + scatter,
                    _optimizer_time(cluster, num_params, dp, dp_mode) + after_step)


def _vocab_activation(profile: EmbeddingProfile, vocab_tp: int, samples: float,
                      precision: str) -> Collective:
    """The vocab-parallel embedding's output all-reduce (forward), and the head's input
    gradient all-reduce (backward): one ``(b, s, h)`` activation in fp32 whatever the
    precision (autocast runs neither the embedding lookup nor the final norm in bf16/fp16)."""
    fp32 = profile.hidden_bytes_per_sample * 4 / gather_bytes(precision)
    return Collective("all_reduce", vocab_tp, True, fp32 * samples)


def _vocab_loss(vocab_tp: int, samples: float, seq_length: int) -> tuple[Collective, ...]:
    """Vocab-parallel cross entropy (forward): a MAX all-reduce of the row maxima and a SUM
    all-reduce of (target logit, sum of exponentials), fp32 per token; latency-bound."""
    if vocab_tp <= 1:
        return ()
    tokens = samples * max(1, seq_length)
    return (Collective("all_reduce", vocab_tp, True, 4 * tokens),
            Collective("all_reduce", vocab_tp, True, 8 * tokens))


def vocab_tp_collectives(profile: EmbeddingProfile, vocab_tp: int, samples: float,
                         first: bool, last: bool, seq_length: int, precision: str = "fp32"
                         ) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """``(forward, backward)`` vocab-TP all-reduces of one rank per micro-batch of ``samples``
    (what :func:`embedding_time` charges): the embedding's output (first stage, forward), the
    loss's two (last stage, forward), the head's input gradient (last stage, backward)."""
    if vocab_tp <= 1:
        return (), ()
    act = _vocab_activation(profile, vocab_tp, samples, precision)
    forward = ((act,) if first else ()) + (_vocab_loss(vocab_tp, samples, seq_length)
                                           if last else ())
    return forward, ((act,) if last else ())


def tied_embedding_collective(profile: EmbeddingProfile, vocab_tp: int, pp: int, dp: int = 1,
                              dp_mode: str = "ddp") -> Collective | None:
    """The once-per-iteration all-reduce of the tied word embedding's fp32 gradient between
    its copies on the first and the last stage (rank ``j`` of each; ``pp > 1``): this rank's
    shard of it under ZeRO-1/2/3 over ``dp`` replicas (the same slice on both stages)."""
    if not profile.tied or pp <= 1:
        return None
    shards = dp if dp_mode in ("zero1", "zero2", "zero3") else 1
    return Collective("all_reduce", 2, False,
                      GRAD_BYTES * profile.split_embedding_parameters / vocab_tp / shards)


def hop_bytes(sender: Layout, microbatch_size: int, bytes_per_sample: float,
              stage_size: int) -> float:
    """Bytes of one p2p transfer across a stage boundary: the sender's slice of the micro-batch
    (``microbatch_size / dp_sender`` samples; the gradient back is as large)."""
    return bytes_per_sample * microbatch_size / dp_size(sender, stage_size)


@dataclass(frozen=True)
class MoveCost:
    """One micro-batch's activation moving between layouts: ``forward`` and ``backward``
    seconds (the gradient moves back), and ``transient_bytes``, the most it adds on a rank
    while it runs (a gathered micro-batch beside the slice kept from it)."""

    forward: float
    backward: float
    transient_bytes: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


NO_MOVE = MoveCost(0.0, 0.0, 0.0)


# The cluster method that prices each kind of collective.
_PRICES = {"all_gather": "allgather_time", "all_reduce": "allreduce_time",
           "reduce_scatter": "reduce_scatter_time",
           "zero_gather": "zero_gather_time", "zero_scatter": "zero_scatter_time",
           "cp_send": "cp_send_time", "all_to_all": "alltoall_time"}


def collective_time(cluster: ClusterModel, collective: Collective, stage_size: int) -> float:
    """Seconds of one :class:`~megatron_auto.layout.Collective` on a group inside a stage
    (placed over its ``span`` adjacent ranks when it has one, else over the stage)."""
    method = _PRICES.get(collective.kind)
    if method is None:
        raise ValueError(f"collective kind {collective.kind!r} has no price")
    return getattr(cluster, method)(collective.nbytes, collective.group_size, collective.consecutive,
                 span=collective.span or stage_size)


def relayout_cost(cluster: ClusterModel, old: Layout, new: Layout, microbatch_size: int,
                  bytes_per_sample: float, stage_size: int) -> MoveCost:
    """What the runtime's relayout of one micro-batch from ``old`` to ``new`` costs.

    The collectives are :func:`megatron_auto.layout.relayout_collectives`, the ones
    ``parallel/redistribute.py`` issues: in forward, unless every rank's new slice lies inside
    its old one (a free local slice), one all-gather: of the new slice over the ``new`` TP group
    when its members' old slices make it up exactly (from ``tp = 1``), else of the whole
    micro-batch (``microbatch_size * bytes_per_sample``) over the ``old`` DP group; in
    backward, the same rule for the gradient from ``new`` to ``old``.
    """
    forward, backward = relayout_collectives(old, new, stage_size,
                                             microbatch_size * bytes_per_sample)
    return MoveCost(sum(collective_time(cluster, c, stage_size) for c in forward),
                    sum(collective_time(cluster, c, stage_size) for c in backward),
                    relayout_memory(old, new, microbatch_size, bytes_per_sample, stage_size))


def relayout_time(cluster: ClusterModel, old: Layout, new: Layout, microbatch_size: int,
                  hidden_bytes_per_sample: float, stage_size: int) -> float:
    """Forward + backward seconds of :func:`relayout_cost`."""
    return relayout_cost(cluster, old, new, microbatch_size, hidden_bytes_per_sample,
                         stage_size).total


def sequence_parallel_switch_time(cluster: ClusterModel, old: Layout, old_sp: bool, new: Layout,
                                  new_sp: bool, microbatch_size: int, bytes_per_sample: float,
                                  stage_size: int) -> float:
    """Forward + backward seconds of the SP boundaries between a layer ``(old, old_sp)`` and
    the next ``(new, new_sp)`` (``cost_model.chunk_moves`` makes the same moves): nothing inside
    one run of SP layers of a layout; else leaving an SP run all-gathers the sequence (forward)
    and entering one all-gathers the gradient (backward), each on its layout's TP group
    (``layout.sequence_parallel_boundary_collectives``). Relayouts are priced apart."""
    old_sp, new_sp = old_sp and old.tp > 1, new_sp and new.tp > 1
    if old_sp and new_sp and old == new:
        return 0.0
    total = 0.0
    for layout, sp, entering in ((old, old_sp, False), (new, new_sp, True)):
        if sp:
            whole = microbatch_size / dp_size(layout, stage_size) * bytes_per_sample
            f, b = sequence_parallel_boundary_collectives(layout, whole, entering=entering)
            total += sum(collective_time(cluster, c, stage_size) for c in f + b)
    return total


def stage_boundary_cost(cluster: ClusterModel, sender: Layout, receiver: Layout, microbatch_size: int,
                        bytes_per_sample: float, stage_size: int, pp: int) -> MoveCost:
    """A micro-batch crossing from one stage to the next, charged to the receiving stage.

    Rank ``j`` of the sender sends its slice (``microbatch_size / dp_sender`` samples) to rank
    ``j`` of the receiver, which holds it in the sender's layout and re-lays it out into its
    first layer's (:func:`relayout_cost`); backward sends the slice's gradient back.
    """
    p2p = cluster.p2p_time(hop_bytes(sender, microbatch_size, bytes_per_sample, stage_size), pp)
    move = relayout_cost(cluster, sender, receiver, microbatch_size, bytes_per_sample,
                         stage_size)
    return MoveCost(p2p + move.forward, p2p + move.backward, move.transient_bytes)


@dataclass(frozen=True)
class PipelineTime:
    iteration: float
    pipeline: float  # without the gradient-sync tails
    bubble_fraction: float
    stage_finish: tuple[float, ...]  # when each stage is done, tails included


def pipeline_time(microbatch: Sequence[float], backward: Sequence[float],
                  tails: Sequence[float], num_microbatches: int,
                  step: Sequence[float] = (), step_overhead: float = 0.0, *,
                  virtual_size: int = 1, fill: float | None = None) -> PipelineTime:
    """Iteration time of a pipeline (1F1B or GPipe: same time, not same memory; or interleaved).

    ``microbatch[k]`` is stage k's time for one micro-batch (forward + backward, p2p included),
    ``backward[k]`` its backward part, ``tails[k]`` the gradient sync that does not hide behind
    its own last backward. Steady state is paced by the slowest stage:
    ``T_pipe = sum_k C_k + (m - 1) * max_k C_k``. Stage ``k`` finishes its last backward
    ``sum_{j<k} B_j`` before stage 0 does (the last gradient still has to travel down), which its
    sync tail may use: ``T = max(T_pipe, max_k(T_pipe - sum_{j<k} B_j + tail_k))``.
    The optimizer step follows the global gradient norm, which waits for every stage, so the
    slowest stage's ``step[k]`` and the fixed ``step_overhead`` are added after that.

    Interleaved (``virtual_size`` v > 1): ``microbatch[k]`` is all of stage k's chunks for one
    micro-batch, ``fill`` the fill-and-drain time ``sum_k max_j c_{k,j}``
    (``interleaving.pipeline_fill``), and ``T_pipe = fill + (m - 1/v) max_k C_k``: with equal
    chunks the bubble ``(p - 1) C / v`` is v times smaller. ``backward[k]`` is then the backward of
    stage k's first chunk (global chunk k), what runs after stage k's last backward.
    """
    m = num_microbatches
    total = sum(microbatch) if fill is None else fill
    slowest = max(microbatch)
    t_pipe = total + (m - 1.0 / virtual_size) * slowest
    finish = []
    ahead = 0.0
    for k, tail in enumerate(tails):
        finish.append(t_pipe - ahead + tail)
        ahead += backward[k]
    iteration = max([t_pipe] + finish) + max(step, default=0.0) + step_overhead
    busy = m * sum(microbatch) / len(microbatch) if microbatch else 0.0
    bubble = 1.0 - busy / t_pipe if t_pipe > 0 else 0.0
    return PipelineTime(iteration, t_pipe, bubble, tuple(finish))
