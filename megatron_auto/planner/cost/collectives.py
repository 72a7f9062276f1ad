"""The collectives one rank of a stage issues, as the cost model prices them.

:func:`stage_collectives` lists the per-layer ones (relayouts, sequence-parallel boundaries,
layer TP, context and expert parallelism, ZeRO) that :func:`estimate.evaluate_plan` charges;
:func:`dp_parts` is each component's data-parallel traffic (its layers, an MoE layer's experts,
the vocabulary modules); :func:`bucket_collectives` merges the ``ddp`` / ``zero1`` per-layer
shares into the bucket calls the runtime issues; :func:`step_collectives` are the per-step
scalar all-reduces. ``census.rank_collectives`` adds the p2p hops and the vocabulary's own
collectives; tests/test_collective_count.py compares that list with what the runtime issues.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from ...expert_layout import expert_layout, expert_ranks
from ...layout import (Collective, dp_group_consecutive, dp_group_ranks, layer_tp_collectives,
                       layout_of, relayout_collectives, vocab_layout)
from ...plan import Plan
from .context_parallel import cp_attention_collectives
from .memory_model import GRAD_BYTES, vocab_parameters
from .moves import sp_boundary, sp_reduced_tensor_bytes, stage_moves
from .time_model import (DDP_BUCKET_BYTES, DataParallelCollectives, dp_collectives,
                         vocab_dp_collectives)
from ..inputs.model_spec import ModelSpec
from ..inputs.profiles import ModelProfile
from ..inputs.cluster_model import ClusterModel
from .moe import (expert_dp_collectives, expert_dp_group, expert_parameters, has_mlp,
                  metrics_collective, moe_collectives)


def step_collectives(world_size: int, spec: ModelSpec | None = None) -> Counter[Collective]:
    """The scalar all-reduces over the world of every training step (``training/trainer.py``):
    the global gradient norm (one fp64), the skip flag (one fp32), the loss and its token count
    (two fp64); for a model with MoE layers (``spec``) the step's MoE statistics
    (:func:`moe.metrics_collective`). None on one rank."""
    if world_size <= 1:
        return Counter()
    out = Counter(Collective("all_reduce", world_size, True, float(nbytes))
                  for nbytes in (8, 4, 16))
    metrics = metrics_collective(spec, world_size) if spec is not None else None
    if metrics is not None:
        out[metrics] += 1
    return out



def _layer_tp(plan: Plan, spec: ModelSpec, profile: ModelProfile, i: int
              ) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    s = plan.layers[i]
    n = plan.stage_size
    lp = profile.layer_types[spec.layer_type(i).name]
    sp = s.sequence_parallel and s.tp > 1
    samples = plan.microbatch_size / (n // s.tp)
    return layer_tp_collectives(layout_of(s, n), n, lp.tp_bytes_per_sample * samples,
                                sequence_parallel=sp,
                                norm_tensor_bytes=sp_reduced_tensor_bytes(spec, i) if sp else (),
                                recompute=s.full_recompute,
                                recompute_modules=s.recompute_modules,
                                mlp=has_mlp(spec.layer_type(i)))


def _layer_cp(plan: Plan, spec: ModelSpec, profile: ModelProfile, precision: str, i: int
              ) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """Layer ``i``'s context-parallel collectives for one micro-batch (none without CP)."""
    s = plan.layers[i]
    n = plan.stage_size
    lp = profile.layer_types[spec.layer_type(i).name]
    samples = plan.microbatch_size / (n // s.tp)
    # backward re-runs the CP exchange when it re-runs core attention: the whole layer, or
    # core_attn among its modules (an mlp / norm recompute leaves the attention alone)
    reruns_attention = s.full_recompute or "core_attn" in s.recompute_modules
    return cp_attention_collectives(layout_of(s, n), n, s.cp_mode,
                                    lp.hidden_bytes_per_sample * samples / s.tp,
                                    lp.kv_bytes * samples / s.tp,
                                    4 if precision == "fp32" else 2, recompute=reruns_attention)


def _layer_ep(plan: Plan, spec: ModelSpec, precision: str, i: int
              ) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """Layer ``i``'s expert-parallel all-to-alls for one micro-batch at the mean load (none
    for a dense layer or ``ep = 1``; ``moe.moe_collectives``)."""
    s = plan.layers[i]
    n = plan.stage_size
    return moe_collectives(spec.layer_type(i), s, layout_of(s, n), n,
                           plan.microbatch_size / (n // s.tp), 4 if precision == "fp32" else 2)


def dp_parts(plan: Plan, spec: ModelSpec, profile: ModelProfile, precision: str, stage: int
             ) -> list[tuple[Any, DataParallelCollectives]]:
    """``(layer index, ("experts", layer index) or "vocab", its cost_time.dp_collectives)`` of
    every component of one rank of ``stage``: its layers (an MoE layer's routed experts as a
    component of their own, on the expert-DP group: ``moe.expert_dp_collectives``), then the
    vocab modules (first and last stage)."""
    n = plan.stage_size
    parts: list[tuple[Any, DataParallelCollectives]] = []
    for i in plan.stage_layers(stage):
        s = plan.layers[i]
        lt = spec.layer_type(i)
        local = profile.layer_types[lt.name].local_parameters(s.tp)
        layout = layout_of(s, n)
        # the runtime makes an MoE layer's experts a unit of their own only with expert
        # fields in the plan (models/gpt.py); otherwise they are the layer's (one FSDP2 unit;
        # the time model prices them apart, one latency more per ZeRO-2/3 collective)
        own_unit = lt.moe is not None and (s.ep > 1 or s.expert_dp_mode is not None)
        if lt.moe is not None and not own_unit:
            local += expert_parameters(lt.moe, lt)
        parts.append((i, dp_collectives(local, n // s.tp, s.dp_mode,
                                        dp_group_consecutive(layout), precision)))
        if own_unit and lt.moe is not None:
            consecutive, span = expert_dp_group(layout, s.ep, n)
            parts.append((("experts", i), expert_dp_collectives(
                expert_parameters(lt.moe, lt) / s.ep, n // s.tp // s.ep, s.experts_dp_mode,
                consecutive, span, precision)))
    first, last = stage == 0, stage == plan.pp_size - 1
    if first or last:
        vtp = plan.vocab.tp
        parts.append(("vocab", vocab_dp_collectives(profile.embedding, vtp, n // vtp,
                                                    plan.vocab.dp_mode, first, last,
                                                    plan.pp_size, precision)))
    return parts


def stage_collectives(plan: Plan, spec: ModelSpec, profile: ModelProfile, precision: str,
                      stage: int) -> Counter[Collective]:
    """How often one rank of ``stage`` issues each collective in one iteration, as
    :func:`evaluate_plan` prices them: both directions of every :func:`stage_moves` relayout
    and SP boundary, every layer's TP collectives (``layout.layer_tp_collectives``) and the
    per-micro-batch ZeRO gathers and reduce-scatters ``m`` times; ``zero2``'s gather, the
    ``ddp`` all-reduce and ``zero1``'s reduce-scatter and all-gather once
    (``cost_time.dp_collectives`` of every layer; the vocab modules as the runtime's units,
    ``cost_time.vocab_units``).
    With context parallelism also every layer's CP collectives
    (``context_parallel.cp_attention_collectives``: the ring's sends, Ulysses' all-to-alls),
    and with expert parallelism every MoE layer's all-to-alls (``moe.moe_collectives``, token
    payloads at the mean load: the runtime's depend on the routing).
    Not listed here: p2p hops, the embedding's and head's TP all-reduces, the tied-embedding
    and scalar all-reduces; ``ddp`` and ``zero1`` are each layer's share of the runtime's
    buckets. ``cost.census.rank_collectives`` adds those and merges the shares into buckets."""
    n, m = plan.stage_size, plan.num_microbatches
    out: Counter[Collective] = Counter()
    for move in stage_moves(plan, spec, profile, stage):
        forward, backward = relayout_collectives(move.old, move.new, n,
                                                 plan.microbatch_size * move.bytes_per_sample)
        sp_f, sp_b = sp_boundary(move, plan)
        for c in forward + backward + sp_f + sp_b:
            out[c] += m
    for i in plan.stage_layers(stage):
        tp_f, tp_b = _layer_tp(plan, spec, profile, i)
        cp_f, cp_b = _layer_cp(plan, spec, profile, precision, i)
        ep_f, ep_b = _layer_ep(plan, spec, precision, i)
        for c in tp_f + tp_b + cp_f + cp_b + ep_f + ep_b:
            out[c] += m
    for _, part in dp_parts(plan, spec, profile, precision, stage):
        for c in part.forward + part.backward:
            out[c] += m
        for c in part.per_iteration + part.after_step:
            out[c] += 1
    return out



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


def gloo_bucket_copy_bytes(plan: Plan, spec: ModelSpec, profile: ModelProfile,
                           cluster: ClusterModel, precision: str, stage: int) -> float:
    """On a CPU cluster (gloo), ``reduce_scatter_tensor`` copies its whole input first (measured
    with the memory meter: one bucket's bytes beside the bucket), so the ``zero1`` gradient
    buckets' reduce-scatter at the end of backward holds a copy of the largest bucket of
    ``stage``; NCCL reduces in place. 0 off CPU or without ``zero1`` buckets."""
    if not str(getattr(cluster, "device_name", "")).startswith("cpu"):
        return 0.0
    modes = {plan.vocab.dp_mode} | {s.dp_mode for s in plan.layers} | {
        s.experts_dp_mode for s in plan.layers}
    if "zero1" not in modes:
        return 0.0
    calls = bucket_collectives(plan, spec, profile, precision, stage)[1]
    return max((c.nbytes for c in calls if c.kind == "reduce_scatter"), default=0.0)
