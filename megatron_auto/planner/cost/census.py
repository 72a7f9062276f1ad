"""Every collective one rank issues in one training iteration, as the cost model prices it.

:func:`rank_collectives` is the list the time model's formulas charge for, as ``Collective``s
one rank of a stage issues, with their counts. tests/test_collective_count.py records what the
runtime really issues (every ``torch.distributed`` call, p2p included) and compares it with
this list kind by kind, group by group and byte for byte. It adds to
``collectives.stage_collectives`` (relayouts, SP boundaries, layer TP, ZeRO):

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
- the per-step scalar all-reduces over the world (``collectives.step_collectives``), the MoE
  statistics' row per MoE layer among them.
"""

from __future__ import annotations

from collections import Counter

from ...layout import Collective, dp_size, vocab_layout
from ...plan import Plan
from .collectives import bucket_collectives, stage_collectives, step_collectives
from .moves import chunk_moves
from .time_model import DDP_BUCKET_BYTES, hop_bytes, tied_embedding_collective, vocab_tp_collectives
from ..inputs.model_spec import ModelSpec
from ..inputs.profiles import ModelProfile


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
    out.update(step_collectives(plan.world_size, spec))
    return +out  # drop the zero counts

