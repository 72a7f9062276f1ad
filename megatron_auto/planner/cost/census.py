"""Every collective one rank issues in one training iteration, as the cost model prices it.

:func:`rank_collectives` is the list the time model's formulas charge for, as ``Collective``s
one rank of a stage issues, with their counts. tests/test_collective_count.py records what the
runtime really issues (every ``torch.distributed`` call, p2p included) and compares it with
this list kind by kind, group by group and byte for byte. It adds to
``estimate.stage_collectives`` (relayouts, SP boundaries, layer TP, ZeRO):

- the ``ddp`` and ``zero1`` gradient buckets: the time model charges each layer its share of
  a bucket (``cost_time.bucketed_allreduce_time``); the runtime packs the layers of one DP group
  (one layout) into buckets of ``DDP_BUCKET_BYTES`` (``zero1`` buckets padded to a multiple of
  the group, the tied word embedding in buckets of its own), so the shares of one layout are
  merged here into ``ceil(total / DDP_BUCKET_BYTES)`` calls (exact while a DP group's
  gradients fit one bucket; beyond that the runtime cuts at parameter boundaries);
- the vocabulary TP all-reduces and the tied-embedding all-reduce (``cost_time.embedding_time``,
  from :func:`cost_time.vocab_tp_collectives` and :func:`cost_time.tied_embedding_collective`);
- the pipeline p2p (``cost_time.stage_boundary_cost``: one hop each way per micro-batch and
  chunk boundary, :func:`cost_time.hop_bytes`) as ``send``/``recv`` between two ranks;
- the per-step scalar all-reduces over the world (``estimate.step_collectives``).
"""

from __future__ import annotations

import math
from collections import Counter

from ...expert_layout import expert_layout, expert_ranks
from ...layout import Collective, dp_group_ranks, dp_size, layout_of, vocab_layout
from ...plan import Plan
from .estimate import chunk_moves, dp_parts, stage_collectives, step_collectives
from .memory_model import GRAD_BYTES, vocab_parameters
from .time_model import DDP_BUCKET_BYTES, hop_bytes, tied_embedding_collective, vocab_tp_collectives
from ..inputs.model_spec import ModelSpec
from ..inputs.profiles import ModelProfile


def _buckets(kind: str, group_size: int, consecutive: bool, nbytes: float, pad: bool,
             bucket_bytes: float) -> Counter[Collective]:
    """The bucket calls of ``nbytes`` of one DP group's gradients (fp32 elements)."""
    out: Counter[Collective] = Counter()
    left = nbytes
    for _ in range(max(1, math.ceil(nbytes / bucket_bytes))):
        size = min(left, bucket_bytes)
        left -= size
        if pad:  # reduce-scatter needs equal slices: a multiple of the group in elements
            size = math.ceil(size / GRAD_BYTES / group_size) * group_size * GRAD_BYTES
        out[Collective(kind, group_size, consecutive, float(size))] += 1
    return out


def bucket_collectives(plan: Plan, spec: ModelSpec, profile: ModelProfile, precision: str,
                       stage: int, bucket_bytes: float = DDP_BUCKET_BYTES
                       ) -> tuple[Counter[Collective], Counter[Collective]]:
    """``(per-layer shares, bucket calls)`` of the ``ddp`` all-reduce and the ``zero1``
    reduce-scatter and parameter all-gather of one rank of ``stage``: the first is what
    ``stage_collectives`` lists, the second what the runtime issues for the same bytes."""
    shares: Counter[Collective] = Counter()
    merged: dict[tuple[frozenset, str, int, bool, bool], float] = {}
    tied_alone = (profile.embedding.tied and plan.pp_size > 1
                  and stage in (0, plan.pp_size - 1))
    for key, part in dp_parts(plan, spec, profile, precision, stage):
        for c in part.per_iteration + part.after_step:
            if c.kind not in ("all_reduce", "reduce_scatter", "all_gather"):
                continue  # zero2's gather: FSDP2, per unit
            shares[c] += 1
            pieces = [(c.nbytes, False)]
            if key == "vocab" and c.kind != "all_reduce" and tied_alone:
                # zero1: the tied word embedding's own buckets (the same slices on both stages)
                emb = c.nbytes * profile.embedding.split_embedding_parameters / \
                    plan.vocab.tp / _vocab_params(plan, profile, stage)
                pieces = [(c.nbytes - emb, False), (emb, True)]
            layout = _dp_partition(plan, key)
            for nbytes, alone in pieces:
                if nbytes > 0:
                    k = (layout, c.kind, c.group_size, c.consecutive, alone)
                    merged[k] = merged.get(k, 0.0) + nbytes
    calls: Counter[Collective] = Counter()
    for (_, kind, size, consecutive, _), nbytes in merged.items():
        calls.update(_buckets(kind, size, consecutive, nbytes, kind != "all_reduce",
                              bucket_bytes))
    return shares, calls


def _dp_partition(plan: Plan, key: object) -> frozenset[tuple[int, ...]]:
    """The DP groups of a ``dp_parts`` component over the stage's local ranks: the runtime's
    buckets are per process group, and groups are shared by rank set (an MoE layer's
    expert-DP groups may be another layout's DP groups)."""
    n = plan.stage_size
    local = range(n)
    if isinstance(key, tuple):  # ("experts", i): the experts' expert-DP groups
        s = plan.layers[key[1]]
        grid = expert_layout(0, s.tp, s.tp_consecutive, s.ep, s.expert_tp, n)
        return frozenset(expert_ranks(local, grid, j).expert_dp_ranks for j in local)
    if isinstance(key, int):
        lay = layout_of(plan.layers[key], n)
    else:  # "vocab"
        lay = vocab_layout(plan.vocab.tp, n, plan.cp_size)
    return frozenset(tuple(g) for g in dp_group_ranks(local, lay.tp, lay.consecutive, lay.cp))


def _vocab_params(plan: Plan, profile: ModelProfile, stage: int) -> float:
    return vocab_parameters(profile.embedding, plan.vocab.tp, stage == 0,
                            stage == plan.pp_size - 1, plan.pp_size)


def p2p_collectives(plan: Plan, spec: ModelSpec, profile: ModelProfile,
                    stage: int) -> Counter[Collective]:
    """The pipeline transfers of one rank of ``stage`` per iteration: for each chunk boundary
    into one of its chunks, a ``recv`` of the activation and a ``send`` of its gradient per
    micro-batch; for each out of one, a ``send`` and a ``recv`` (the hop's
    ``cost_time.hop_bytes``, what ``stage_boundary_cost`` prices, charged to the receiver)."""
    out: Counter[Collective] = Counter()
    m, n = plan.num_microbatches, plan.stage_size
    for chunk in range(1, plan.num_chunks):
        into, out_of = chunk % plan.pp_size == stage, (chunk - 1) % plan.pp_size == stage
        move = chunk_moves(plan, spec, profile, chunk)[0]  # the hop into ``chunk``
        nbytes = hop_bytes(move.old, plan.microbatch_size, move.bytes_per_sample, n)
        for here in (into, out_of):
            if here:
                out[Collective("send", 2, False, nbytes)] += m
                out[Collective("recv", 2, False, nbytes)] += m
    return out


def rank_collectives(plan: Plan, spec: ModelSpec, profile: ModelProfile, precision: str,
                     stage: int, bucket_bytes: float = DDP_BUCKET_BYTES
                     ) -> Counter[Collective]:
    """How often one rank of ``stage`` issues each collective in one iteration, everything
    the cost model prices (the module docstring lists the parts)."""
    n, m = plan.stage_size, plan.num_microbatches
    shares, buckets = bucket_collectives(plan, spec, profile, precision, stage, bucket_bytes)
    out = stage_collectives(plan, spec, profile, precision, stage)
    out.subtract(shares)
    out.update(buckets)
    first, last = stage == 0, stage == plan.pp_size - 1
    if first or last:
        vtp = plan.vocab.tp
        samples = plan.microbatch_size / dp_size(vocab_layout(vtp, n), n)
        forward, backward = vocab_tp_collectives(profile.embedding, vtp, samples, first, last,
                                                 spec.seq_length, precision)
        for c in forward + backward:
            out[c] += m
        tied = tied_embedding_collective(profile.embedding, vtp, plan.pp_size, n // vtp,
                                         plan.vocab.dp_mode)
        if tied is not None:
            out[tied] += 1
    out.update(p2p_collectives(plan, spec, profile, stage))
    out.update(step_collectives(plan.world_size))
    return +out  # drop the zero counts

